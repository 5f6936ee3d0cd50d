"""Per-tenant quotas: token buckets for requests and tokens per minute, a cap on concurrency.

A bucket holds up to ``burst`` tokens and refills continuously at ``limit / 60`` per second, so
over any interval of T seconds a tenant gets at most ``burst + limit * T / 60``: no fixed-window
double burst at a minute boundary. A request is charged one RPM token (and holds a concurrency
slot) before its body is read; once decoded, it holds a slot per sequence (prompts x ``n``,
:meth:`QuotaManager.widen`), and once its prompt is tokenized, its tokens (prompts, prompt-logprob
rows, ``max_tokens`` per sequence) from TPM; :meth:`QuotaManager.release` refunds what it did
not use. Time is injected as
``now`` (seconds).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from lorapage.tenancy.tenants import TenantConfig, TenantsConfig

_EPS = 1e-9  # relative slack on float comparisons, so refill arithmetic lands on whole tokens


class TokenBucket:
    """``capacity`` tokens at most, refilled at ``rate`` per second; starts full."""

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.updated = now

    def take_debt(self, tokens: float, now: float) -> None:
        """Take ``tokens`` even past empty: the level may go below zero."""
        self.refill(now)
        self.level -= tokens

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def has(self, n: float, now: float) -> bool:
        self.refill(now)
        return self.level + _EPS * max(1.0, n) >= n

    def take(self, n: float) -> None:
        """Take ``n`` (after :meth:`has` said yes at the same ``now``)."""
        self.level = max(0.0, self.level - n)

    def give_back(self, n: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + n)

    def retry_after_s(self, n: float, now: float) -> int | None:
        """Whole seconds until ``n`` tokens are there (at least 1), or None if ``n`` exceeds the
        capacity. Checked against :meth:`has`' own arithmetic, so retrying exactly then works
        and a second earlier would not."""
        if n > self.capacity * (1 + _EPS):
            return None
        self.refill(now)
        need = (n - self.level) / self.rate
        k = max(1, math.ceil(need - 1e-6))
        while not self._would_have(n, k):
            k += 1
        while k > 1 and self._would_have(n, k - 1):
            k -= 1
        return k

    def reconfigure(self, capacity: float, rate: float, now: float) -> None:
        self.refill(now)
        self.capacity = capacity
        self.rate = rate
        self.level = min(self.level, capacity)

    def _would_have(self, n: float, seconds: int) -> bool:
        return min(self.capacity, self.level + seconds * self.rate) + _EPS * max(1.0, n) >= n


@dataclass(frozen=True)
class Reservation:
    """What a request holds against its tenant's quota until :meth:`QuotaManager.release`."""

    id: int
    tenant: str


@dataclass(frozen=True)
class QuotaExceeded:
    """Refused: answer 429 with ``Retry-After: retry_after_s``. ``retry_after_s`` is None when
    retrying cannot help (the request is bigger than the tenant's TPM burst): answer without
    Retry-After and tell the caller to lower ``max_tokens``."""

    which: str  # "rpm" | "tpm" | "concurrency"
    retry_after_s: int | None
    message: str


class _TenantQuota:
    """One tenant's buckets and in-flight count; kept (and reconfigured in place) across reloads
    so that reservations made before a reload release correctly after it."""

    def __init__(self, cfg: TenantConfig, now: float, share: int | None) -> None:
        self.rpm: TokenBucket | None = None
        self.tpm: TokenBucket | None = None
        self.in_flight = 0
        self.configure(cfg, now, share)

    def configure(self, cfg: TenantConfig, now: float, share: int | None) -> None:
        self.max_concurrency = cfg.max_concurrency if cfg.max_concurrency is not None else share
        self.explicit = cfg.max_concurrency is not None  # else: its share of the server's queue
        self.rpm = _bucket(self.rpm, cfg.rpm, cfg.rpm_bucket, now)
        self.tpm = _bucket(self.tpm, cfg.tpm, cfg.tpm_bucket, now)


@dataclass
class _Held:
    state: _TenantQuota
    tokens: int  # taken from the TPM bucket so far
    sequences: int = 1  # concurrency slots held: prompts x n, once known


def _bucket(bucket: TokenBucket | None, per_minute: int | None, burst: int | None, now: float) -> TokenBucket | None:
    if per_minute is None or burst is None:
        return None
    if bucket is None:
        return TokenBucket(burst, per_minute / 60.0, now)
    bucket.reconfigure(burst, per_minute / 60.0, now)
    return bucket


def queue_share(queue_len: int | None, tenants: int) -> int | None:
    """Sequences in flight a tenant without ``max_concurrency`` may have: an equal share of the
    engine's queue (at least one), so that such tenants together never fill it; None: no bound."""
    if queue_len is None:
        return None
    return max(1, queue_len // max(1, tenants))


class QuotaManager:
    """Checks and reserves each tenant's RPM, TPM and concurrency; one tenant's exhaustion
    touches no other tenant's buckets.

    A server admits a request in two steps: :meth:`admit` takes one RPM token and a concurrency
    slot before anything is read of the body (a refusal costs the server nothing that grows with
    the request), then :meth:`charge` takes its tokens once the prompt is tokenized. A tenant
    without ``max_concurrency`` is bounded by :func:`queue_share` of ``queue_len`` (the engine's
    queue), so one tenant cannot fill the queue and have its neighbours refused with 503.
    """

    def __init__(
        self,
        config: TenantsConfig,
        now: float = 0.0,
        concurrency_retry_after_s: int = 1,
        queue_len: int | None = None,
    ) -> None:
        self.concurrency_retry_after_s = concurrency_retry_after_s  # nobody knows when one finishes
        self.queue_len = queue_len
        self._states: dict[str, _TenantQuota] = {}
        self._live: dict[int, _Held] = {}
        self._ids = itertools.count(1)
        self.reload(config, now)

    def reload(self, config: TenantsConfig, now: float = 0.0) -> None:
        """Apply a new tenants file (SIGHUP). Buckets keep their level (clipped to a smaller
        burst), in-flight requests stay counted, and every outstanding reservation stays valid,
        including those of tenants the new file removes."""
        share = queue_share(self.queue_len, len(config.tenants))
        states = {}
        for name, cfg in config.tenants.items():
            state = self._states.get(name)
            if state is None:
                state = _TenantQuota(cfg, now, share)
            else:
                state.configure(cfg, now, share)
            states[name] = state
        self._states = states

    def _state(self, tenant: str) -> _TenantQuota:
        state = self._states.get(tenant)
        if state is None:
            raise KeyError(f"unknown tenant {tenant!r}; configured: {sorted(self._states)}")
        return state

    def admit(self, tenant: str, now: float) -> Reservation | QuotaExceeded:
        """Take one RPM token and a concurrency slot for a request whose size is not known yet
        (all-or-nothing); refused too when the TPM bucket is empty. :meth:`charge` takes its tokens."""
        state = self._state(tenant)
        refusals = self._rate_refusals(state, now)
        if state.tpm is not None and not state.tpm.has(1, now):
            refusals.append(("tpm", state.tpm.retry_after_s(1, now) or 1, "tokens per minute"))
        if refusals:
            return _worst(tenant, refusals)
        return self._take(state, tenant)

    def widen(self, reservation: Reservation, sequences: int, what: str) -> QuotaExceeded | None:
        """Hold one concurrency slot per sequence of an admitted request (``what`` says how its
        ``sequences`` are made, for the refusal), or say why not: over the tenant's bound for
        good (no Retry-After) or for now. Nothing changes on a refusal."""
        held = self._live.get(reservation.id)
        if held is None:
            raise KeyError(f"reservation {reservation.id} was released")
        state, extra = held.state, sequences - held.sequences
        bound = state.max_concurrency
        if bound is not None and extra > 0:
            name = "max_concurrency" if state.explicit else "its share of the server's queue"
            if sequences > bound:
                return QuotaExceeded(
                    "concurrency", None,
                    f"the request is {sequences} sequences ({what}) but tenant {reservation.tenant!r} may run at most "
                    f"{bound} at once ({name}); send fewer prompts or a smaller n",
                )  # fmt: skip
            if state.in_flight + extra > bound:
                retry = self.concurrency_retry_after_s
                return QuotaExceeded(
                    "concurrency", retry,
                    f"tenant {reservation.tenant!r} runs {state.in_flight} of its {bound} concurrent sequences "
                    f"({name}); this request needs {sequences} ({what}); retry after {retry} s",
                )  # fmt: skip
        state.in_flight += extra
        held.sequences = sequences
        return None

    def room(self, reservation: Reservation, prompt_tokens: int, now: float) -> int | None:
        """Tokens the tenant's TPM bucket holds now beyond ``prompt_tokens`` (None: no TPM)."""
        held = self._live.get(reservation.id)
        bucket = held.state.tpm if held is not None else None
        if bucket is None:
            return None
        bucket.refill(now)
        return max(0, math.floor(bucket.level + _EPS) - prompt_tokens)

    def charge(self, reservation: Reservation, prompt_tokens: int, max_tokens: int, now: float) -> QuotaExceeded | None:
        """Take ``prompt_tokens + max_tokens`` from the TPM bucket of an admitted request, or say
        why not (nothing taken; the request keeps its RPM token and its slot until released)."""
        held = self._live.get(reservation.id)
        if held is None:
            raise KeyError(f"reservation {reservation.id} was released")
        refusals: list[tuple[str, int, str]] = []
        refused = self._tpm_refusal(held.state, reservation.tenant, prompt_tokens, max_tokens, now, refusals)
        if refused is not None:
            return refused
        if refusals:
            return _worst(reservation.tenant, refusals)
        tokens = prompt_tokens + max_tokens
        if held.state.tpm is not None:
            held.state.tpm.take(tokens)
        held.tokens += tokens
        return None

    def release(self, reservation: Reservation, used_tokens: int, now: float) -> None:
        """The request ended having used ``used_tokens`` (prompt + generated): refund the rest of
        its TPM charge and free its concurrency slot. Releasing twice is harmless."""
        held = self._live.pop(reservation.id, None)
        if held is None:
            return
        held.state.in_flight -= held.sequences
        unused = held.tokens - used_tokens
        if held.state.tpm is not None and unused > 0:
            held.state.tpm.give_back(unused, now)
        elif held.state.tpm is not None and unused < 0:
            # Used more than was reserved (a request without max_tokens ran past its tenant's
            # default_max_tokens): charged now, into debt if need be; the tenant's next requests
            # wait (429, Retry-After) until the bucket is back above empty.
            held.state.tpm.take_debt(-unused, now)

    def in_flight(self, tenant: str) -> int:
        """Sequences ``tenant`` has in flight (a request's prompts x ``n`` once decoded)."""
        state = self._states.get(tenant)
        return state.in_flight if state else 0

    def _rate_refusals(self, state: _TenantQuota, now: float) -> list[tuple[str, int, str]]:
        refusals: list[tuple[str, int, str]] = []
        if state.rpm is not None and not state.rpm.has(1, now):
            # Never None: an rpm bucket holds at least one request.
            refusals.append(("rpm", state.rpm.retry_after_s(1, now) or 1, "requests per minute"))
        if state.max_concurrency is not None and state.in_flight >= state.max_concurrency:
            what = "concurrent sequences" if state.explicit else "share of the server's queue"
            refusals.append(("concurrency", self.concurrency_retry_after_s, what))
        return refusals

    def _tpm_refusal(
        self, state: _TenantQuota, tenant: str, prompt_tokens: int, max_tokens: int, now: float, refusals: list
    ) -> QuotaExceeded | None:
        """Appends to ``refusals`` when the TPM bucket lacks the tokens now; returns the final
        refusal when it can never hold them."""
        tokens = prompt_tokens + max_tokens
        if state.tpm is None or state.tpm.has(tokens, now):
            return None
        retry = state.tpm.retry_after_s(tokens, now)
        if retry is None:
            return QuotaExceeded(
                "tpm", None,
                f"the request needs {tokens} tokens (prompt {prompt_tokens} + max_tokens {max_tokens}) but "
                f"tenant {tenant!r} may use at most {state.tpm.capacity:.0f} at once (tpm_burst); lower max_tokens",
            )  # fmt: skip
        refusals.append(("tpm", retry, "tokens per minute"))
        return None

    def _take(self, state: _TenantQuota, tenant: str) -> Reservation:
        if state.rpm is not None:
            state.rpm.take(1)
        state.in_flight += 1
        reservation = Reservation(next(self._ids), tenant)
        self._live[reservation.id] = _Held(state, 0)
        return reservation


def _worst(tenant: str, refusals: list[tuple[str, int, str]]) -> QuotaExceeded:
    """The refusal with the longest wait (retrying before it cannot pass)."""
    which, retry, what = max(refusals, key=lambda r: r[1])
    return QuotaExceeded(which, retry, f"tenant {tenant!r} is over its {what} quota; retry after {retry} s")


def overload_retry_after_s(queue_len: int, max_queue_len: int, admitted_per_s: float, ceiling_s: int = 60) -> int:
    """Retry-After for a 503 from a full queue: seconds for admission to drain the queue below its
    bound at the recent admission rate, clamped to [1, ceiling_s]."""
    excess = queue_len - max_queue_len + 1
    if admitted_per_s <= 0:
        return ceiling_s
    return min(ceiling_s, max(1, math.ceil(excess / admitted_per_s)))


class AdmissionRate:
    """Requests admitted per second over the last ``window_s`` seconds, for :func:`overload_retry_after_s`.

    Counted in one bucket per whole second, so memory is ``window_s`` counters however much
    traffic passes (a list of timestamps would grow with it). ``now`` is injected (seconds).
    """

    def __init__(self, window_s: int = 10) -> None:
        if window_s < 1:
            raise ValueError(f"window_s must be >= 1; got {window_s}")
        self.window_s = window_s
        self._counts = [0] * window_s
        self._seconds = [-1] * window_s  # the whole second bucket i counts (i = second % window_s)

    def record(self, now: float) -> None:
        second = math.floor(now)
        i = second % self.window_s
        if self._seconds[i] != second:
            self._seconds[i], self._counts[i] = second, 0
        self._counts[i] += 1

    def per_second(self, now: float) -> float:
        second = math.floor(now)
        recent = (c for c, s in zip(self._counts, self._seconds) if second - self.window_s < s <= second)
        return sum(recent) / self.window_s
