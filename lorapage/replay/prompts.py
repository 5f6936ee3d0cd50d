"""The prompt a trace request sends: its text or ids, or deterministic ids of its length.

Made-up ids are drawn from ``[lo, hi)`` (default 32..126: printable ASCII for a byte-level
tokenizer, ordinary tokens for BPE vocabularies), seeded by the request's index so a replay sends
the same prompts every time, and by its system prompt's id for the shared leading part, so every
request naming one system prompt starts with the same tokens.
"""

from __future__ import annotations

import random
import zlib

from lorapage.traces.trace import TraceRequest

DEFAULT_TOKEN_RANGE = (32, 127)


def _ids(seed: str, n: int, lo: int, hi: int) -> list[int]:
    rng = random.Random(zlib.crc32(seed.encode()))
    return [rng.randrange(lo, hi) for _ in range(n)]


def prompt_for(req: TraceRequest, index: int, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> str | list[int]:
    """What to send as ``prompt`` for request ``index`` of a trace."""
    if req.prompt is not None:
        return req.prompt
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    assert req.prompt_len is not None  # TraceRequest.check: exactly one of the three
    lo, hi = token_range
    shared = _ids(f"system:{req.system_prompt}", req.system_prompt_len, lo, hi) if req.system_prompt else []
    return shared + _ids(f"request:{index}", req.prompt_len - len(shared), lo, hi)
