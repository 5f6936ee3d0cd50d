"""Running the drift check of :mod:`lorapage.bases.drift` on two engines, one per base."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from lorapage.bases.drift import PromptDrift, prompt_drift
from lorapage.engine import Engine
from lorapage.errors import InvalidRequestError
from lorapage.sampling_params import SamplingParams

TOP = 20  # alternatives per position (the KL's support)


def same_tokenizer(old: Engine, new: Engine) -> bool:
    """Whether token ids mean the same text on both bases (the check compares ids)."""
    return old.tokenizer.backend.to_str() == new.tokenizer.backend.to_str()


async def prompt_drifts(
    old: Engine,
    new: Engine,
    old_adapter: str | None,
    new_adapter: str | None,
    prompts: Sequence[str | list[int]],
    *,
    max_tokens: int = 32,
) -> list[PromptDrift]:
    """Each prompt's drift: greedy on ``old`` (with ``old_adapter``), then free-running and
    teacher-forced along the old tokens on ``new`` (with ``new_adapter``). All prompts run
    together, as one batch per engine."""
    if not same_tokenizer(old, new):
        raise InvalidRequestError("the two bases have different tokenizers: the drift check compares token ids")

    async def one(prompt: str | list[int]) -> PromptDrift:
        first = await old.run_to_end(
            prompt, old_adapter, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP)
        )
        ids, tokens = first.prompt_token_ids, first.token_ids
        forced, free = await asyncio.gather(
            new.run_to_end(
                ids + tokens, new_adapter, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
            ),
            new.run_to_end(ids, new_adapter, SamplingParams(max_tokens=len(tokens), temperature=0.0)),
        )
        assert first.logprobs is not None and forced.prompt_logprobs is not None
        along = [lp for lp in forced.prompt_logprobs[len(ids) :] if lp is not None]
        return prompt_drift(first.logprobs, along, free.token_ids)

    return list(await asyncio.gather(*(one(p) for p in prompts)))
