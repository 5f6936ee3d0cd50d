"""The kernel backends' names: what a config may choose (no torch here, so configs stay light)."""

BACKENDS = ("auto", "torch", "cpu", "triton")
