"""Adapters: the PEFT format, their layout in pages, the residency rules and the tiered cache that
carries them out, the registry of versions and aliases, and where their files come from
(``sources``)."""
