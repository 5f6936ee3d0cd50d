"""What each row's own parameters do to its logits before a token is chosen.

In order, each only for the rows that ask: repetition, frequency and presence penalties; logit
bias; the stop tokens ``min_tokens`` holds back; bad words; ``allowed_token_ids``; the
structured-output mask. The input is never written: rows that ask for nothing cost nothing, and a
step where no row asks returns the logits as they are. Every operation is on the logits' device,
batched over the rows that ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lorapage.sampling_params import SamplingParams
from lorapage.structured.grammars import Constraint
from lorapage.structured.masks import apply_bitmask

NEG_INF = float("-inf")


@dataclass
class SampleRow:
    """What the sampler needs of one sequence this step."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded per request, so a row's draws ignore its batch
    output_ids: list[int]  # generated so far (penalties, min_tokens, bad words)
    prompt_ids: Sequence[int] = ()  # the prompt (repetition_penalty counts it)
    stop_ids: tuple[int, ...] = ()  # the tokens min_tokens holds back: EOS (unless ignored), stop_token_ids
    bad_words: tuple[tuple[int, ...], ...] = field(default=(), repr=False)  # each bad word's token ids
    constraint: Constraint | None = field(default=None, repr=False)  # structured output


def _history_rules(row: SampleRow) -> bool:
    """Whether a processor reading the row's history runs on it now, whatever it has generated so
    far: the repetition penalty (prompt too), min_tokens still holding stop tokens, bad words, a grammar."""
    p = row.params
    return (
        p.repetition_penalty != 1.0
        or (len(row.output_ids) < p.min_tokens and bool(row.stop_ids))
        or bool(row.bad_words)
        or row.constraint is not None
    )


def _output_penalties(row: SampleRow) -> bool:
    return row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0


def reads_outputs(row: SampleRow) -> bool:
    """Whether the row's next token depends on the tokens it generated (penalties, min_tokens still
    holding stop tokens back, bad words, a constraint): each must be recorded before the next is
    drawn. Rows that read none may draw several tokens before any is recorded (num_scheduler_steps)."""
    return _output_penalties(row) or _history_rules(row)


def needs_processing(row: SampleRow) -> bool:
    p = row.params
    return (
        (bool(row.output_ids) and _output_penalties(row))
        or _history_rules(row)
        or bool(p.logit_bias)
        or p.allowed_token_ids is not None
    )


def process(logits: Tensor, rows: Sequence[SampleRow], masks: Tensor | None = None) -> Tensor:
    """``logits`` [len(rows), V] after every row's processors (a new tensor when any row has
    one). ``masks``: the bitmasks of the rows with a constraint, in row order."""
    if not any(needs_processing(r) for r in rows):
        return logits
    out = logits.clone()
    _penalties(out, rows)
    _logit_bias(out, rows)
    _hold_stop_tokens(out, rows)
    _bad_words(out, rows)
    _allowed_tokens(out, rows)
    constrained = [i for i, r in enumerate(rows) if r.constraint is not None]
    if constrained:
        assert masks is not None and masks.shape[0] >= len(constrained)
        index = torch.tensor(constrained, device=out.device)
        sub = out[index]
        apply_bitmask(sub, masks[: len(constrained)])
        out[index] = sub
    return out


def _pairs(rows: Sequence[SampleRow], ids_of) -> tuple[list[int], list[int], list[int]]:
    """(row positions, flat row index, flat token ids) of the rows ``ids_of`` gives ids for."""
    which, flat_rows, flat_ids = [], [], []
    for i, row in enumerate(rows):
        ids = ids_of(row)
        if ids is not None:
            which.append(i)
            flat_rows.extend([len(which) - 1] * len(ids))
            flat_ids.extend(ids)
    return which, flat_rows, flat_ids


def _penalties(out: Tensor, rows: Sequence[SampleRow]) -> None:
    """HF / vLLM repetition penalty over prompt and output (positive logits divided, negative
    multiplied); OpenAI's frequency and presence penalties over the output."""
    dev = out.device
    which, r_idx, t_idx = _pairs(
        rows, lambda r: [*r.prompt_ids, *r.output_ids] if r.params.repetition_penalty != 1.0 else None
    )
    if which:
        seen = torch.zeros(len(which), out.shape[1], dtype=torch.bool, device=dev)
        seen[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = True
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in which], device=dev)[:, None]
        sub = out[which]
        out[which] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    which, r_idx, t_idx = _pairs(
        rows,
        lambda r: (
            r.output_ids
            if r.output_ids and (r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0)
            else None
        ),
    )
    if which:
        counts = torch.zeros(len(which), out.shape[1], dtype=out.dtype, device=dev)
        ones = torch.ones(len(t_idx), dtype=out.dtype, device=dev)
        counts.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)), ones, accumulate=True)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in which], dtype=out.dtype, device=dev)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in which], dtype=out.dtype, device=dev)[:, None]
        out[which] = out[which] - freq * counts - pres * (counts > 0).to(out.dtype)


def _logit_bias(out: Tensor, rows: Sequence[SampleRow]) -> None:
    rr, tt, vv = [], [], []
    for i, row in enumerate(rows):
        for token, bias in row.params.logit_bias:
            rr.append(i)
            tt.append(token)
            vv.append(bias)
    if rr:
        dev = out.device
        index = (torch.tensor(rr, device=dev), torch.tensor(tt, device=dev))
        out.index_put_(index, torch.tensor(vv, dtype=out.dtype, device=dev), accumulate=True)


def _fill(out: Tensor, pairs: list[tuple[int, int]], value: float) -> None:
    if pairs:
        rr, tt = zip(*pairs)
        out[torch.tensor(rr, device=out.device), torch.tensor(tt, device=out.device)] = value


def _hold_stop_tokens(out: Tensor, rows: Sequence[SampleRow]) -> None:
    """Before ``min_tokens`` are out, EOS and the stop token ids cannot be chosen."""
    _fill(
        out,
        [(i, t) for i, r in enumerate(rows) if len(r.output_ids) < r.params.min_tokens for t in r.stop_ids],
        NEG_INF,
    )


def _bad_words(out: Tensor, rows: Sequence[SampleRow]) -> None:
    """A bad word's last token cannot follow the rest of it (a one-token word: never)."""
    banned = []
    for i, row in enumerate(rows):
        for word in row.bad_words:
            head = word[:-1]
            if not head or tuple(row.output_ids[-len(head) :]) == head:
                banned.append((i, word[-1]))
    _fill(out, banned, NEG_INF)


def _allowed_tokens(out: Tensor, rows: Sequence[SampleRow]) -> None:
    for i, row in enumerate(rows):
        allowed = row.params.allowed_token_ids
        if allowed is not None:
            keep = torch.zeros(out.shape[1], dtype=torch.bool, device=out.device)
            keep[torch.tensor(allowed, device=out.device)] = True
            out[i].masked_fill_(~keep, NEG_INF)
