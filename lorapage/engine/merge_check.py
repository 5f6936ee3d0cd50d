"""The equivalence check a dedicated (merged) deployment passes before it takes traffic.

On stored prompts (:data:`CHECK_PROMPTS`, plus any the operator gives), the adapter runs greedily
first through the shared pool's LoRA path, then merged into the base weights, on the same engine:
the greedy tokens must be identical, and the chosen tokens' logprobs within :data:`TOLERANCES` of
the model's dtype (largest absolute difference over every position of every prompt).

Why these bounds: the two paths compute the same function in a different order (``W x + s B (A x)``
against ``(W + s B A) x``), so they differ by rounding only. In float32 (unit roundoff 6e-8) that
moves a logprob by about 1e-6 on the built-in tiny model (measured: docs/capacity.md), growing
slowly with depth and width; 1e-3 leaves orders of magnitude of margin and still catches a real
error of a merge (a wrong scale, module or layer moves logprobs by far more). In 16-bit dtypes
the merged weight is rounded once to the dtype while the LoRA path rounds its own partial sums:
differences of several units of roundoff (bfloat16 4e-3, float16 5e-4) are normal, hence the
wider bounds (chosen, not yet measured on a GPU). A greedy near-tie can then flip a token: the
check fails, and says where.
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
TOLERANCES = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.02}
MAX_PROMPTS_FILE_BYTES = 1 << 20
MAX_CHECK_PROMPTS = 256


@dataclass(frozen=True)
class GreedyRun:
    """One prompt's greedy tokens and their logprobs on one path."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class MergeCheck:
    """The check's outcome, with its numbers."""

    adapter: str  # the version key, id@N
    prompts: int
    tokens: int  # positions compared, every prompt together
    mismatched_prompts: int  # prompts whose greedy tokens differ anywhere
    first_mismatch: str  # where the first one differs ("" when none)
    max_abs_dlogprob: float  # over the positions before each prompt's first differing token
    tolerance: float
    passed: bool

    def line(self) -> str:
        """One line for the log, or for the refusal to start."""
        verdict = "passed" if self.passed else "FAILED"
        tokens = (
            "greedy tokens identical"
            if not self.mismatched_prompts
            else f"greedy tokens differ on {self.mismatched_prompts} prompt(s) ({self.first_mismatch})"
        )
        return (
            f"merge equivalence check of {self.adapter} {verdict}: {self.prompts} prompts, {self.tokens} tokens, "
            f"{tokens}; max |d logprob| {self.max_abs_dlogprob:.3g} (tolerance {self.tolerance:g})"
        )

    def as_json(self) -> dict:
        """The outcome as ``/internal/state`` reports it."""
        return asdict(self)


def compare(adapter: str, unmerged: Sequence[GreedyRun], merged: Sequence[GreedyRun], tolerance: float) -> MergeCheck:
    """The check's verdict on each prompt's two runs (same order)."""
    assert len(unmerged) == len(merged), (len(unmerged), len(merged))
    tokens, mismatched, first, worst = 0, 0, "", 0.0
    for i, (u, m) in enumerate(zip(unmerged, merged)):
        agree = 0
        while agree < min(len(u.token_ids), len(m.token_ids)) and u.token_ids[agree] == m.token_ids[agree]:
            agree += 1
        if agree < max(len(u.token_ids), len(m.token_ids)):
            mismatched += 1
            was, now = _at(u.token_ids, agree), _at(m.token_ids, agree)
            first = first or f"prompt {i}, token {agree}: {was} unmerged vs {now} merged"
        tokens += max(len(u.token_ids), len(m.token_ids))
        worst = max([worst, *(abs(a - b) for a, b in zip(u.logprobs[:agree], m.logprobs[:agree]))])
    passed = not mismatched and worst <= tolerance and bool(unmerged)
    return MergeCheck(adapter, len(unmerged), tokens, mismatched, first, worst, tolerance, passed)


def _at(ids: Sequence[int], k: int) -> str:
    return str(ids[k]) if k < len(ids) else "end"


async def greedy_runs(
    engine: Engine, adapter: str, prompts: Sequence[str], max_tokens: int = CHECK_MAX_TOKENS
) -> list[GreedyRun]:
    """Each prompt's greedy run on ``adapter``, all together (EOS ignored: every run is full length)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = await asyncio.gather(*(engine.run_to_end(p, adapter, sampling) for p in prompts))
    return [GreedyRun(tuple(o.token_ids), tuple(lp.logprob for lp in o.logprobs or ())) for o in outs]


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
    is kept as ``engine.merge_check`` (``/internal/state``). The merge stays whatever the verdict:
    a caller that gets ``passed`` False must not serve from this engine."""
    tolerance = TOLERANCES[engine.config.dtype] if tolerance is None else tolerance
    key = engine.resolve_adapter(adapter)
    unmerged = await greedy_runs(engine, key, prompts, max_tokens)
    await engine.merge_into_base(key, merge=merge)
    merged = await greedy_runs(engine, key, prompts, max_tokens)  # the plain base path now
    check = compare(key, unmerged, merged, tolerance)
    engine.merge_check = check.as_json()
    return check


def read_check_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: one JSON string, or object with a ``prompt`` string, per line (blank
    lines skipped). Raises ValueError naming the line that is neither."""
    raw = Path(path).read_bytes()[: MAX_PROMPTS_FILE_BYTES + 1]
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
