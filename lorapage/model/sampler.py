"""Per-row sampling: every row has its own temperature, top-p, top-k, penalties and seed.

Rows are isolated: a row whose distribution is not finite (NaN / Inf logits, or nothing left to
draw from after its filters) is reported as failed and every other row gets exactly the token it
would have had without it. Nothing here raises on bad values, so one request can never fail the
step. The results are read back from the device once for all rows (a seeded row on an accelerator
also copies its distribution to its CPU generator).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lorapage.kernels.step_cpu import greedy_rows_cpu
from lorapage.model.logits_processors import NEG_INF, SampleRow, needs_processing, process
from lorapage.request import TokenLogprob
from lorapage.sampling_params import SamplingParams

__all__ = ["FAILED_TOKEN", "SampleOutput", "SampleRow", "sample"]

FAILED_TOKEN = -1  # the token reported for a row that could not be sampled
_BAD_LOGITS, _BAD_DISTRIBUTION = -1, -2  # status codes of a failed row, read back with the tokens
_ERRORS = {
    _BAD_LOGITS: "the model produced NaN or Inf logits for this request (a broken adapter or overflow)",
    _BAD_DISTRIBUTION: "the sampling distribution is not finite after temperature / top-k / top-p, or no token "
    "is left after this request's bans, allowed tokens and output constraint",
}


class SampleOutput(NamedTuple):
    """One step's sampling, row by row over the sampling sequences; and the prompt logprobs of the
    prefill chunks that asked for them."""

    tokens: list[int]  # the next token; FAILED_TOKEN where the row failed
    logprobs: list[TokenLogprob | None]  # where the row asked for them; None where it failed
    errors: list[str | None]  # None where the row sampled; else why it could not (fail that request)
    # (sequence index in the plan, index of the first prompt token covered, their logprobs)
    prompt_logprobs: tuple[tuple[int, int, list[TokenLogprob]], ...] = ()

    def rows(self, keep: list[int]) -> SampleOutput:
        """These rows' samples, in this order (a decode step's: no prompt logprobs)."""
        return SampleOutput(
            [self.tokens[i] for i in keep], [self.logprobs[i] for i in keep], [self.errors[i] for i in keep]
        )


# top-p looks for the nucleus among this many most likely tokens first (a partial sort), and
# sorts a row's whole vocabulary only when their mass falls short of its top_p.
TOP_P_CANDIDATES = 512


def _scaled(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Each row's logits after its temperature and top-k (the tokens top-k drops are -inf)."""
    dev, (m, vocab) = logits.device, logits.shape
    temps = torch.tensor([r.temperature for r in params], dtype=logits.dtype, device=dev)[:, None]
    x = logits / temps
    ks = [r.top_k if 0 < r.top_k < vocab else 0 for r in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top[torch.arange(m, device=dev), torch.tensor([max(k, 1) - 1 for k in ks], device=dev)]
        kth = torch.where(torch.tensor(ks, device=dev) > 0, kth, torch.full_like(kth, NEG_INF))
        x = x.masked_fill(x < kth[:, None], NEG_INF)
    return x


def filtered_probs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Each row's distribution after its temperature, top-k, min-p and top-p (not normalized:
    the tokens a filter drops are 0)."""
    rows = params
    probs = torch.softmax(_scaled(logits, params), dim=-1)
    min_p = [r.min_p for r in rows]
    if any(min_p):
        floor = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None] * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    nucleus = [i for i, r in enumerate(rows) if r.top_p < 1.0]
    if nucleus:
        probs[nucleus] = _top_p(probs[nucleus], [rows[i].top_p for i in nucleus])
    return probs


def processed_logits(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """The logits each row's token is drawn from (vLLM's ``processed_logits``): ``logits`` (after
    the row's processors) with its temperature applied and what top-k, min-p and top-p drop at
    -inf; a greedy row's as given. Their softmax is :func:`filtered_probs`, normalized."""
    out = logits.clone()
    free = [i for i, r in enumerate(params) if not r.greedy]
    if not free:
        return out
    chosen = [params[i] for i in free]
    x = _scaled(logits[free], chosen)
    # A probability filter dropped exactly the tokens it zeroed (a token underflowing to 0 is
    # below any min-p floor or nucleus edge too); rows without one keep what top-k kept.
    by_prob = torch.tensor([r.min_p > 0 or r.top_p < 1.0 for r in chosen], device=x.device)[:, None]
    out[free] = x.masked_fill(by_prob & (filtered_probs(logits[free], chosen) == 0), NEG_INF)
    return out


def _draw(logits: Tensor, rows: list[SampleRow]) -> tuple[Tensor, Tensor]:
    """(tokens, ok) of non-greedy rows: one draw per row from its filtered distribution, each
    seeded row from its own generator (so its draw ignores the batch). ``ok`` is False where
    nothing finite was left to draw from; that row's token is meaningless."""
    dev, m = logits.device, logits.shape[0]
    probs = filtered_probs(logits, [r.params for r in rows])
    total = probs.sum(-1)  # at most the vocabulary size: NaN or Inf only if some entry is
    ok = torch.isfinite(total) & (total > 0)
    # A bad row draws from a harmless stand-in instead of raising (or tripping a device assert on
    # CUDA), so no host sync is needed to decide whether to draw; its token is discarded.
    probs = torch.where(ok[:, None], probs, torch.ones_like(probs))
    tokens = torch.empty(m, dtype=torch.long, device=dev)
    free = [i for i, r in enumerate(rows) if r.generator is None]
    if free:
        tokens[free] = torch.multinomial(probs[free], 1)[:, 0]
    for i, row in enumerate(rows):
        if row.generator is not None:
            p = probs[i] if row.generator.device == probs.device else probs[i].to(row.generator.device)
            tokens[i] = torch.multinomial(p, 1, generator=row.generator)[0]
    return tokens, ok


def _top_p(probs: Tensor, top_p: list[float]) -> Tensor:
    """``probs`` with only each row's nucleus kept: the most likely tokens whose mass first reaches
    its top_p, the token crossing it included (ties at the edge kept too)."""
    limit = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)[:, None]
    k = min(TOP_P_CANDIDATES, probs.shape[1])
    ranked = torch.topk(probs, k, dim=-1).values
    if k < probs.shape[1] and not bool((ranked.sum(-1, keepdim=True) >= limit).all()):
        ranked = torch.sort(probs, dim=-1, descending=True).values  # a flat row: its nucleus is wider
    before = ranked.cumsum(-1) - ranked  # mass of the tokens ranked above each one
    kept = (before < limit).sum(-1, keepdim=True).clamp(min=1)
    edge = ranked.gather(1, kept - 1)
    return probs.masked_fill(probs < edge, 0.0)


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's logprob of ``tokens[i]``, its rank, and its ``top`` most likely alternatives
    (raw model)."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen_t = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])
    ranks = ((lp > chosen_t).sum(-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(t, c, (), r) for t, c, r in zip(tokens, chosen, ranks)]
    top_v, top_i = torch.topk(lp, top, dim=-1)
    return [
        TokenLogprob(t, c, tuple(zip(ids, values)), r)
        for t, c, ids, values, r in zip(tokens, chosen, top_i.tolist(), top_v.tolist(), ranks)
    ]


def _logprobs(logits: Tensor, processed: Tensor, rows: list[SampleRow], tokens: list[int]) -> list[TokenLogprob | None]:
    """Each row's chosen token and top alternatives, in its ``logprobs_mode``: from the model's
    ``logits`` (raw) or from the distribution it was sampled from (processed)."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None and tokens[i] != FAILED_TOKEN]
    if not want:
        return out
    scores = logits[want]
    modes = [rows[i].params.logprobs_mode or "raw_logprobs" for i in want]
    drawn = [j for j, mode in enumerate(modes) if mode.startswith("processed")]
    if drawn:
        picked = [want[j] for j in drawn]
        scores[drawn] = processed_logits(processed[picked], [rows[i].params for i in picked])
    as_logprobs = torch.tensor([mode.endswith("logprobs") for mode in modes], device=scores.device)[:, None]
    lp = torch.where(as_logprobs, torch.log_softmax(scores, dim=-1), scores)
    index = torch.tensor([[tokens[i]] for i in want], device=lp.device)
    chosen = lp.gather(1, index)[:, 0].tolist()
    n_top = [rows[i].params.logprobs or 0 for i in want]
    top_v, top_i = torch.topk(lp, max(n_top), dim=-1)
    values, ids = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        n = n_top[j]
        out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(ids[j][:n], values[j][:n])))
    return out


def _plain_greedy(row: SampleRow) -> bool:
    """A greedy row with no processor, constraint or logprobs: its token is its logits' argmax."""
    return row.params.greedy and row.params.logprobs is None and row.constraint is None and not needs_processing(row)


def _greedy(logits: Tensor) -> SampleOutput:
    """:func:`sample` of rows that are all :func:`_plain_greedy`: each row's first largest logit
    (``argmax``'s), failed where a row is not all finite. On a CPU one C pass over the logits
    (``greedy_rows_cpu``); elsewhere three reductions (``max``'s index is ``argmax``'s; a row's
    largest or smallest is not finite where any is, both propagating NaN)."""
    status = greedy_rows_cpu(logits)
    if status is None:
        largest, picked = logits.max(dim=-1)
        finite = torch.isfinite(largest) & torch.isfinite(logits.amin(dim=-1))
        status = torch.where(finite, picked, _BAD_LOGITS).tolist()
    errors = [_ERRORS[s] if s < 0 else None for s in status]
    tokens = [FAILED_TOKEN if s < 0 else s for s in status]
    return SampleOutput(tokens, [None] * len(tokens), errors)


def sample(logits: Tensor, rows: list[SampleRow], masks: Tensor | None = None) -> SampleOutput:
    """Next token of each row, its logprobs where the row asked for them, and per-row errors.

    ``logits`` is float32 [len(rows), vocab]; ``masks`` the structured-output bitmasks of the
    constrained rows, in row order. Each row's processors run first
    (:mod:`lorapage.model.logits_processors`). Greedy rows (temperature below
    :data:`~lorapage.sampling_params.SAMPLING_EPS`) take the argmax; others sample from their own
    filtered distribution with their own generator, so a seeded row's draw depends on nothing
    else in the batch. A row is failed (``errors[i]`` set, token :data:`FAILED_TOKEN`, logprobs
    None) when its logits hold NaN or Inf, or when nothing is left to choose from after its
    processors and filters; that never changes another row's token or logprobs. Logprobs are the
    raw model's (before any processing) by default, as vLLM reports them; a row's
    ``logprobs_mode`` may ask for the processed distribution's (:func:`processed_logits`).
    (Unseeded rows share the global generator, so their draws are fresh per step either way.)
    """
    if masks is None and all(_plain_greedy(r) for r in rows):
        return _greedy(logits)
    processed = process(logits, rows, masks)
    picked = torch.argmax(processed, dim=-1)
    # A row whose every token is excluded (a grammar with no way on) has nothing to choose.
    drawn_ok = processed.amax(dim=-1) > NEG_INF
    free = [i for i, r in enumerate(rows) if not r.params.greedy]
    if free:
        drawn, ok = _draw(processed[free], [rows[i] for i in free])
        picked[free], drawn_ok[free] = drawn, ok & drawn_ok[free]
    # All finite exactly when the row's max and min are (both propagate NaN); two vectorized
    # reductions, where isfinite().all() on CPU costs ~20x as much for a batch of logits.
    finite = torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))
    status = torch.where(finite, torch.where(drawn_ok, picked, _BAD_DISTRIBUTION), _BAD_LOGITS).tolist()
    errors = [_ERRORS[s] if s < 0 else None for s in status]
    tokens = [FAILED_TOKEN if s < 0 else s for s in status]
    return SampleOutput(tokens, _logprobs(logits, processed, rows, tokens), errors)
