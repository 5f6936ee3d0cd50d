"""Which layers attend through a sliding window, read from ``config.json`` as transformers reads it.

A sliding-window layer of width W lets the token at position p attend to positions
``p - W < j <= p`` (transformers' ``sliding_window_overlay``); a global layer to every ``j <= p``.
Gemma 2 alternates local and global layers, Gemma 3 has five local layers to one global, Mistral
windows every layer when ``sliding_window`` is set, Qwen2 the layers from ``max_window_layers`` on
when ``use_sliding_window``. Llama has no windows.

Block freeing: a page whose positions all lie before ``context_len - W`` of EVERY layer's window is
never read again, so it could be returned to the pool while the sequence runs; with one global
layer (every Gemma checkpoint) no page ever falls out. :func:`blocks_out_of_window` gives that
count; the engine does not free them yet (docs/families.md says what it needs).
"""

from __future__ import annotations

WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Every how many layers a global one comes, where config.json has no layer_types.
GLOBAL_EVERY = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}


def _sliding(raw: dict, arch: str, num_layers: int) -> list[bool]:
    """Per layer, whether it is a sliding-window layer (given the model has a window at all)."""
    types = raw.get("layer_types")
    if isinstance(types, list):
        if len(types) != num_layers:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
        return [t == "sliding_attention" for t in types]
    if arch in GLOBAL_EVERY:
        every = raw.get("sliding_window_pattern") or GLOBAL_EVERY[arch]
        return [(i + 1) % every != 0 for i in range(num_layers)]
    if arch == "Qwen2ForCausalLM":
        first = raw.get("max_window_layers", 28)
        return [i >= first for i in range(num_layers)]
    return [True] * num_layers  # Mistral


def layer_windows(raw: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Per layer, its sliding window (None: global); () when no layer has one."""
    window = raw.get("sliding_window")
    if arch not in WINDOWED_ARCHITECTURES or window is None or raw.get("use_sliding_window") is False:
        return ()
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window"):
        return ()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: sliding_window must be a positive integer or null; got {window!r}")
    windows = tuple(window if s else None for s in _sliding(raw, arch, num_layers))
    return windows if any(w is not None for w in windows) else ()


def blocks_out_of_window(windows: tuple[int | None, ...], context_len: int, block_size: int) -> int:
    """How many of a sequence's first pages no layer reads again once it holds ``context_len``
    positions (the next token is at ``context_len``): 0 with any global layer, else the pages
    wholly before the widest window's first position, ``context_len + 1 - W``."""
    if not windows or any(w is None for w in windows):
        return 0
    widest = max(w for w in windows if w is not None)
    return max(0, context_len + 1 - widest) // block_size
