"""The equivalence check a dedicated (merged) deployment passes before it takes traffic.

On stored prompts (:data:`CHECK_PROMPTS`, plus any the operator gives), the adapter runs greedily
first through the shared pool's LoRA path, then merged into the base weights, on the same engine.
The greedy tokens must be identical (but for a near-tie: where the merged run picks a token the
unmerged path had within the tolerance of its own choice), and the chosen tokens' logprobs within
:data:`TOLERANCES` of the model's dtype (the largest absolute difference over every position both
runs share).

Why these bounds: the two paths compute the same function in a different order (``W x + s B (A x)``
against ``(W + s B A) x``), so they differ by rounding only. Measured on this CPU (float32): 1.2e-7
on the built-in tiny model, 1e-5 to 3e-5 on a random 6-layer 256-wide checkpoint with a rank-32
adapter on every module; 6e-4 only with an adapter whose delta is ~40 times the base weights
(rsLoRA, alpha 48). 1e-3 is the float32 bound; a merge with a doubled scale moves logprobs by 0.4
to 0.6 and flips tokens on nearly every prompt. In 16-bit dtypes the merged weight is rounded once
to the dtype while the LoRA path rounds its own partial sums: measured 1e-3 (bfloat16) and 2e-4
(float16) on the tiny model, up to 0.23 and 0.05 on the random checkpoint, whose flat distributions
are full of near-ties; hence 0.25 and 0.1. Not yet measured on a GPU.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from lorapage.engine.engine import Engine
from lorapage.model.merge import MergeFn, merge_adapter
from lorapage.sampling_params import SamplingParams

# Short prompts of different kinds: each runs CHECK_MAX_TOKENS greedy tokens on both paths.
CHECK_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Translate to German: good morning, how are you?",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    '{"name": "lorapage", "kind":',
    "The quick brown fox jumps over the lazy dog. Then it",
)
CHECK_MAX_TOKENS = 16
# Largest |logprob difference| of a chosen token between the merged and the unmerged path.
TOLERANCES = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}
# On a w8a8 base (float32 only) the merged product rounds the adapter's share of every projection's
# input to int8 too, which the LoRA path keeps in float32, and the merged weight is re-quantized:
# 1.9e-3 on the tiny model. An int8 (weight-only) base keeps float32's.
QUANTIZED_TOLERANCES = {"w8a8": 1e-2}
MAX_PROMPTS_FILE_BYTES = 1 << 20
MAX_CHECK_PROMPTS = 256


@dataclass(frozen=True)
class GreedyRun:
    """One prompt's greedy tokens, their logprobs and, per position, the top alternatives
    (token id -> logprob) on one path."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: tuple[dict[int, float], ...] = ()


@dataclass(frozen=True)
class MergeCheck:
    """The check's outcome, with its numbers."""

    adapter: str  # the version key, id@N
    prompts: int
    tokens: int  # positions generated on the unmerged path, every prompt together
    mismatched_prompts: int  # prompts whose greedy tokens differ where no near-tie explains it
    near_ties: int  # prompts that part at a near-tie: the two tokens within tolerance on the unmerged path
    first_mismatch: str  # where the first mismatch is ("" when none)
    max_abs_dlogprob: float  # over the positions before each prompt's first differing token
    tolerance: float
    passed: bool

    def line(self) -> str:
        """One line for the log, or for the refusal to start."""
        verdict = "passed" if self.passed else "FAILED"
        if self.mismatched_prompts:
            tokens = f"greedy tokens differ on {self.mismatched_prompts} prompt(s) ({self.first_mismatch})"
        elif self.near_ties:
            tokens = f"greedy tokens identical but for {self.near_ties} near-tie(s) within the tolerance"
        else:
            tokens = "greedy tokens identical"
        return (
            f"merge equivalence check of {self.adapter} {verdict}: {self.prompts} prompts, {self.tokens} tokens, "
            f"{tokens}; max |d logprob| {self.max_abs_dlogprob:.3g} (tolerance {self.tolerance:g})"
        )

    def as_json(self) -> dict:
        """The outcome as ``/internal/state`` reports it."""
        return asdict(self)


def compare(adapter: str, unmerged: Sequence[GreedyRun], merged: Sequence[GreedyRun], tolerance: float) -> MergeCheck:
    """The check's verdict on each prompt's two runs (same order).

    Where the merged run first picks another token, the two runs part (what follows is another
    text). That is a near-tie, not a mismatch, when the unmerged path itself had the merged token
    within ``tolerance`` of its own choice: rounding may order two such tokens either way."""
    assert len(unmerged) == len(merged), (len(unmerged), len(merged))
    mismatched, ties, first, worst = 0, 0, "", 0.0
    for i, (u, m) in enumerate(zip(unmerged, merged)):
        agree = 0
        while agree < min(len(u.token_ids), len(m.token_ids)) and u.token_ids[agree] == m.token_ids[agree]:
            agree += 1
        worst = max([worst, *(abs(a - b) for a, b in zip(u.logprobs[:agree], m.logprobs[:agree]))])
        if agree == len(u.token_ids) == len(m.token_ids):
            continue
        if _near_tie(u, m, agree, tolerance):
            ties += 1
            continue
        mismatched += 1
        first = (
            first
            or f"prompt {i}, token {agree}: {_at(u.token_ids, agree)} unmerged vs {_at(m.token_ids, agree)} merged"
        )
    tokens = sum(len(u.token_ids) for u in unmerged)
    passed = not mismatched and worst <= tolerance and bool(unmerged)
    return MergeCheck(adapter, len(unmerged), tokens, mismatched, ties, first, worst, tolerance, passed)


def _near_tie(u: GreedyRun, m: GreedyRun, k: int, tolerance: float) -> bool:
    """Whether at position ``k`` the unmerged path had the merged token within ``tolerance``."""
    if k >= min(len(u.token_ids), len(m.token_ids), len(u.top)):
        return False
    other = u.top[k].get(m.token_ids[k])
    return other is not None and u.logprobs[k] - other <= tolerance


def _at(ids: Sequence[int], k: int) -> str:
    return str(ids[k]) if k < len(ids) else "end"


async def greedy_runs(
    engine: Engine, adapter: str, prompts: Sequence[str], max_tokens: int = CHECK_MAX_TOKENS
) -> list[GreedyRun]:
    """Each prompt's greedy run on ``adapter`` with its top-2 alternatives, all together (EOS
    ignored: every run is full length)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = await asyncio.gather(*(engine.run_to_end(p, adapter, sampling) for p in prompts))
    return [
        GreedyRun(
            tuple(o.token_ids),
            tuple(lp.logprob for lp in o.logprobs or ()),
            tuple(dict(lp.top) for lp in o.logprobs or ()),
        )
        for o in outs
    ]


async def merge_and_check(
    engine: Engine,
    adapter: str,
    prompts: Sequence[str] = CHECK_PROMPTS,
    *,
    tolerance: float | None = None,
    max_tokens: int = CHECK_MAX_TOKENS,
    merge: MergeFn = merge_adapter,
) -> MergeCheck:
    """Run ``prompts`` through the LoRA path, merge ``adapter`` into ``engine``'s weights
    (:meth:`Engine.merge_into_base`), run them again on the merged weights and compare; the outcome
    is kept in ``engine.stats().merged_deployment`` (``/internal/state``). The merge stays whatever the verdict:
    a caller that gets ``passed`` False must not serve from this engine."""
    if tolerance is None:
        scheme = engine.model_config.quantization  # a pre-quantized checkpoint's, else the config's
        quantized = QUANTIZED_TOLERANCES.get(scheme.name if scheme else engine.config.quantization or "")
        tolerance = TOLERANCES[engine.config.dtype] if quantized is None else quantized
    key = engine.admin.catalog.resolve_version(adapter)
    unmerged = await greedy_runs(engine, key, prompts, max_tokens)
    await engine.merge_into_base(key, merge=merge)
    merged = await greedy_runs(engine, key, prompts, max_tokens)  # the plain base path now
    check = compare(key, unmerged, merged, tolerance)
    engine.record_merge_check(check.as_json())
    return check


def read_check_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: one JSON string, or object with a ``prompt`` string, per line (blank
    lines skipped). Raises ValueError naming the line that is neither."""
    with open(path, "rb") as f:
        raw = f.read(MAX_PROMPTS_FILE_BYTES + 1)
    if len(raw) > MAX_PROMPTS_FILE_BYTES:
        raise ValueError(f"{path}: more than {MAX_PROMPTS_FILE_BYTES} bytes")
    prompts = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        prompt = row.get("prompt") if isinstance(row, dict) else row
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'{path}:{n}: expected a JSON string or {{"prompt": TEXT}}')
        prompts.append(prompt)
    if len(prompts) > MAX_CHECK_PROMPTS:
        raise ValueError(f"{path}: {len(prompts)} prompts; at most {MAX_CHECK_PROMPTS}")
    return prompts
