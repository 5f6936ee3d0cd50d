"""Per-row sampling: every row has its own temperature, top-p, top-k, penalties and seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lorapage.sampling import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs of one sequence this step."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded per request, so a row's draws ignore its batch
    output_ids: list[int]  # generated so far (for presence / frequency penalties)


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _penalize(logits: Tensor, row: SampleRow) -> Tensor:
    p = row.params
    if not row.output_ids or (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
        return logits
    ids = torch.tensor(row.output_ids, device=logits.device)
    counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
    return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_row(logits: Tensor, row: SampleRow) -> int:
    p = row.params
    logits = _penalize(logits, row)
    if p.greedy:
        return int(torch.argmax(logits))
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if row.generator is not None and row.generator.device != probs.device:
        probs = probs.to(row.generator.device)  # a request's seeded generator lives on the CPU
    return int(torch.multinomial(probs, 1, generator=row.generator))


def sample(logits: Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Next token of each row, and its logprobs where the row asked for them.

    ``logits`` is float32 [len(rows), vocab]. Greedy rows take the argmax of the (penalized)
    logits; others sample from their own filtered distribution with their own generator.
    """
    all_greedy = all(
        r.params.greedy and r.params.presence_penalty == 0 and r.params.frequency_penalty == 0 for r in rows
    )
    if all_greedy:
        tokens = torch.argmax(logits, dim=-1).tolist()
    else:
        tokens = [_sample_row(logits[i], r) for i, r in enumerate(rows)]
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        k = max(rows[i].params.logprobs for i in want)
        top_v, top_i = torch.topk(lp, k, dim=-1) if k else (None, None)
        for j, i in enumerate(want):
            n = rows[i].params.logprobs
            top = tuple(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist())) if n else ()
            logprobs[i] = TokenLogprob(tokens[i], float(lp[j, tokens[i]]), top)
    return tokens, logprobs
