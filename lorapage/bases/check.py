"""Running the drift check of :mod:`lorapage.bases.drift` on two engines, one per base."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from lorapage.bases.drift import PromptDrift, prompt_drift
from lorapage.engine import Engine
from lorapage.errors import InvalidRequestError
from lorapage.request import TokenLogprob
from lorapage.sampling_params import SamplingParams

TOP = 20  # alternatives per position (the KL's support)


def same_tokenizer(old: Engine, new: Engine) -> bool:
    """Whether token ids mean the same text on both bases (the check compares ids)."""
    return old.tokenizer.backend.to_str() == new.tokenizer.backend.to_str()


@dataclass(frozen=True)
class Reference:
    """A prompt's greedy run on the old base: its prompt ids, the tokens, their top logprobs."""

    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[TokenLogprob]


async def references(
    old: Engine, old_adapter: str | None, prompts: Sequence[str | list[int]], *, max_tokens: int = 32
) -> list[Reference]:
    """Each prompt greedy on ``old`` (with ``old_adapter``), with its top logprobs (the check's first half)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP)

    async def one(prompt: str | list[int]) -> Reference:
        out = await old.run_to_end(prompt, old_adapter, sampling)
        assert out.logprobs is not None
        return Reference(out.prompt_token_ids, out.token_ids, out.logprobs)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def candidate_drifts(new: Engine, new_adapter: str | None, refs: Sequence[Reference]) -> list[PromptDrift]:
    """Each reference's drift on ``new`` (with ``new_adapter``): free-running, and teacher-forced
    along the old tokens (the check's second half)."""

    async def one(ref: Reference) -> PromptDrift:
        ids, tokens = ref.prompt_ids, ref.tokens
        forced, free = await asyncio.gather(
            new.run_to_end(
                ids + tokens, new_adapter, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
            ),
            new.run_to_end(ids, new_adapter, SamplingParams(max_tokens=len(tokens), temperature=0.0)),
        )
        assert forced.prompt_logprobs is not None
        along = [lp for lp in forced.prompt_logprobs[len(ids) :] if lp is not None]
        return prompt_drift(ref.logprobs, along, free.token_ids)

    return list(await asyncio.gather(*(one(r) for r in refs)))


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
    together, as one batch per engine. (A fleet runs the two halves on two deployments.)"""
    if not same_tokenizer(old, new):
        raise InvalidRequestError("the two bases have different tokenizers: the drift check compares token ids")

    async def one(prompt: str | list[int]) -> PromptDrift:  # each prompt's new half as soon as its old half ends
        (ref,) = await references(old, old_adapter, [prompt], max_tokens=max_tokens)
        (drift,) = await candidate_drifts(new, new_adapter, [ref])
        return drift

    return list(await asyncio.gather(*(one(p) for p in prompts)))
