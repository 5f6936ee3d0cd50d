"""Adapters: the PEFT format, their layout in pages, the tiered cache, the registry of versions and
aliases, and where their files come from (``sources``)."""
