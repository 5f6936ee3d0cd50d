"""The behavioural-drift check of a base upgrade: does an adapter behave the same on the new base?

No labels needed (seed 000, R5, level 3): each of the adapter's stored prompts runs greedily on
the old base with the adapter (its tokens ``A``); then, on the new base with the same adapter,

- the new base continues freely (does its output differ from ``A``: the customer-visible change),
- and is teacher-forced along ``A`` (prompt logprobs over prompt + ``A``), which compares the two
  distributions position by position on the same text:
  ``token_agreement``: the fraction of positions where the new base's top token is ``A``'s;
  ``mean_abs_dlogprob``: the mean over positions of |log p_old(A_i) - log p_new(A_i)|;
  ``kl``: the mean over positions of KL(old || new), over the old base's top-k tokens plus one
  bucket for the rest of the vocabulary (a token outside the new top-k gets the new k-th
  logprob: an upper bound on its probability, so ``kl`` errs low).

:func:`verdict` compares the means with :class:`DriftThresholds`. Everything here is pure: the
engines' outputs come in as :class:`~lorapage.request.TokenLogprob` lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lorapage.request import TokenLogprob


@dataclass(frozen=True)
class DriftThresholds:
    """Limits a migration must stay within (means over the adapter's prompts)."""

    min_token_agreement: float = 0.9
    max_mean_abs_dlogprob: float = 0.5
    max_kl: float = 0.1
    # Prompts whose answers change materially: the new base disagrees with more than
    # 1 - min_token_agreement of the old answer's tokens. (Any change at all is reported too, but
    # near-ties flip a greedy token here and there under the smallest change of weights.)
    max_changed_fraction: float = 0.25


@dataclass(frozen=True)
class PromptDrift:
    """One prompt: old greedy tokens teacher-forced through the new base."""

    positions: int
    token_agreement: float
    mean_abs_dlogprob: float
    kl: float
    changed: bool  # the new base's own greedy output differs from the old one


@dataclass(frozen=True)
class DriftReport:
    """One adapter across its prompts, and the verdict."""

    prompts: int
    token_agreement: float
    mean_abs_dlogprob: float
    kl: float
    changed_fraction: float  # answers that changed materially (see DriftThresholds)
    any_change_fraction: float  # answers whose greedy tokens differ anywhere
    passed: bool
    reasons: tuple[str, ...]  # the thresholds missed (empty when passed)

    def notice(self, adapter: str, old: str, new: str) -> str:
        """What the customer is told, with the numbers."""
        outcome = (
            "passed: it will move to the new base"
            if self.passed
            else "did not pass: it stays on the current base until it is retrained or you accept the change"
        )
        return (
            f"Base upgrade {old[:12]} -> {new[:12]} for adapter {adapter}: on {self.prompts} stored prompts, "
            f"{self.changed_fraction:.0%} of answers differ materially ({self.any_change_fraction:.0%} in any "
            "token); per token, the new base agrees with the old "
            f"{self.token_agreement:.1%} of the time (mean |d logprob| {self.mean_abs_dlogprob:.3f}, "
            f"KL {self.kl:.4f}). The check {outcome}."
        )


def _kl(old: TokenLogprob, new: TokenLogprob) -> float:
    """KL(old || new) over old's top tokens plus one bucket for the rest."""
    if not old.top:
        return 0.0
    new_lp = dict(new.top)
    floor = min(new_lp.values()) if new_lp else new.logprob
    new_lp.setdefault(new.token_id, new.logprob)
    kl, p_rest, q_rest = 0.0, 1.0, 1.0
    for token, lp in old.top:
        p, q_lp = math.exp(lp), new_lp.get(token, floor)
        kl += p * (lp - q_lp)
        p_rest -= p
        q_rest -= math.exp(q_lp)
    p_rest, q_rest = max(p_rest, 0.0), max(q_rest, 1e-12)
    if p_rest > 1e-12:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def prompt_drift(old: Sequence[TokenLogprob], forced: Sequence[TokenLogprob], new_tokens: Sequence[int]) -> PromptDrift:
    """``old``: the old base's greedy tokens with their top logprobs; ``forced``: the new base's
    logprobs of those same tokens, teacher-forced (same length); ``new_tokens``: the new base's own
    greedy output."""
    assert len(old) == len(forced), (len(old), len(forced))
    n = len(old) or 1
    agree = sum(1 for o, f in zip(old, forced) if f.top and f.top[0][0] == o.token_id)
    return PromptDrift(
        positions=len(old),
        token_agreement=agree / n,
        mean_abs_dlogprob=sum(abs(o.logprob - f.logprob) for o, f in zip(old, forced)) / n,
        kl=sum(_kl(o, f) for o, f in zip(old, forced)) / n,
        changed=list(new_tokens) != [o.token_id for o in old],
    )


def verdict(drifts: Sequence[PromptDrift], limits: DriftThresholds | None = None) -> DriftReport:
    """The adapter's report: means over its prompts against ``limits``."""
    limits = limits or DriftThresholds()
    n = len(drifts) or 1
    agreement = sum(d.token_agreement for d in drifts) / n
    dlogprob = sum(d.mean_abs_dlogprob for d in drifts) / n
    kl = sum(d.kl for d in drifts) / n
    changed = sum(d.token_agreement < limits.min_token_agreement for d in drifts) / n
    any_change = sum(d.changed for d in drifts) / n
    reasons = []
    if agreement < limits.min_token_agreement:
        reasons.append(f"token agreement {agreement:.3f} < {limits.min_token_agreement}")
    if dlogprob > limits.max_mean_abs_dlogprob:
        reasons.append(f"mean |d logprob| {dlogprob:.3f} > {limits.max_mean_abs_dlogprob}")
    if kl > limits.max_kl:
        reasons.append(f"KL {kl:.4f} > {limits.max_kl}")
    if changed > limits.max_changed_fraction:
        reasons.append(f"{changed:.0%} of answers changed materially > {limits.max_changed_fraction:.0%}")
    if not drifts:
        reasons.append("no stored prompts to check")
    return DriftReport(len(drifts), agreement, dlogprob, kl, changed, any_change, not reasons, tuple(reasons))
