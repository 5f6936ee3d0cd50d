"""Per-row sampling: every row has its own temperature, top-p, top-k, penalties and seed.

Rows are isolated: a row whose distribution is not finite (NaN / Inf logits, or nothing left to
draw from after its filters) is reported as failed and every other row gets exactly the token it
would have had without it. Nothing here raises on bad values, so one request can never fail the
step. The results are read back from the device once for all rows (a seeded row on an accelerator
also copies its distribution to its CPU generator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from lorapage.request import TokenLogprob
from lorapage.sampling_params import SamplingParams

FAILED_TOKEN = -1  # the token reported for a row that could not be sampled
_BAD_LOGITS, _BAD_DISTRIBUTION = -1, -2  # status codes of a failed row, read back with the tokens
_ERRORS = {
    _BAD_LOGITS: "the model produced NaN or Inf logits for this request (a broken adapter or overflow)",
    _BAD_DISTRIBUTION: "the sampling distribution is not finite after temperature / top-k / top-p",
}


@dataclass
class SampleRow:
    """What the sampler needs of one sequence this step."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded per request, so a row's draws ignore its batch
    output_ids: list[int]  # generated so far (for presence / frequency penalties)


class SampleOutput(NamedTuple):
    """One step's sampling, row by row (unpacks as ``tokens, logprobs, errors``)."""

    tokens: list[int]  # the next token; FAILED_TOKEN where the row failed
    logprobs: list[TokenLogprob | None]  # where the row asked for them; None where it failed
    errors: list[str | None]  # None where the row sampled; else why it could not (fail that request)


def _has_penalty(row: SampleRow) -> bool:
    p = row.params
    return bool(row.output_ids) and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)


def _penalize(logits: Tensor, row: SampleRow) -> Tensor:
    p = row.params
    ids = torch.tensor(row.output_ids, device=logits.device)
    counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
    return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)


def _penalized(logits: Tensor, rows: list[SampleRow]) -> Tensor:
    if not any(_has_penalty(r) for r in rows):
        return logits
    out = logits.clone()
    for i, row in enumerate(rows):
        if _has_penalty(row):
            out[i] = _penalize(logits[i], row)
    return out


def _draw(logits: Tensor, row: SampleRow) -> tuple[Tensor, Tensor]:
    """(token, ok) of one non-greedy row, both 0-d tensors; ``ok`` is False if nothing finite
    was left to draw from, in which case the token is meaningless."""
    p = row.params
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    total = probs.sum()  # at most the vocabulary size: NaN or Inf only if some entry is
    ok = torch.isfinite(total) & (total > 0)
    # A bad row draws from a harmless stand-in instead of raising (or tripping a device assert on
    # CUDA), so no host sync is needed to decide whether to draw; its token is discarded.
    probs = torch.where(ok, probs, torch.ones_like(probs))
    if row.generator is not None and row.generator.device != probs.device:
        probs = probs.to(row.generator.device)  # a request's seeded generator lives on the CPU
    return torch.multinomial(probs, 1, generator=row.generator)[0], ok


def _logprobs(logits: Tensor, rows: list[SampleRow], tokens: list[int]) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None and tokens[i] != FAILED_TOKEN]
    if not want:
        return out
    lp = torch.log_softmax(logits[want], dim=-1)
    index = torch.tensor([[tokens[i]] for i in want], device=lp.device)
    chosen = lp.gather(1, index)[:, 0].tolist()
    n_top = [rows[i].params.logprobs or 0 for i in want]
    top_v, top_i = torch.topk(lp, max(n_top), dim=-1)
    values, ids = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        n = n_top[j]
        out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(ids[j][:n], values[j][:n])))
    return out


def sample(logits: Tensor, rows: list[SampleRow]) -> SampleOutput:
    """Next token of each row, its logprobs where the row asked for them, and per-row errors.

    ``logits`` is float32 [len(rows), vocab]. Greedy rows (temperature below
    :data:`~lorapage.sampling_params.SAMPLING_EPS`) take the argmax of the penalized logits; others
    sample from their own filtered distribution with their own generator, so a seeded row's draw
    depends on nothing else in the batch. A row is failed (``errors[i]`` set, token
    :data:`FAILED_TOKEN`, logprobs None) when its logits hold NaN or Inf or its filtered
    distribution is not finite; that never changes another row's token or logprobs. (Unseeded
    rows share the global generator, so their draws are fresh per step either way.)
    """
    penalized = _penalized(logits, rows)
    picked = torch.argmax(penalized, dim=-1)
    drawn_ok = torch.ones(len(rows), dtype=torch.bool, device=logits.device)
    for i, row in enumerate(rows):
        if not row.params.greedy:
            token, ok = _draw(penalized[i], row)
            picked[i], drawn_ok[i] = token, ok
    # All finite exactly when the row's max and min are (both propagate NaN); two vectorized
    # reductions, where isfinite().all() on CPU costs ~20x as much for a batch of logits.
    finite = torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))
    status = torch.where(finite, torch.where(drawn_ok, picked, _BAD_DISTRIBUTION), _BAD_LOGITS).tolist()
    errors = [_ERRORS[s] if s < 0 else None for s in status]
    tokens = [FAILED_TOKEN if s < 0 else s for s in status]
    return SampleOutput(tokens, _logprobs(logits, rows, tokens), errors)
