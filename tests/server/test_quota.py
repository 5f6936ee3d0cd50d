"""Token buckets and the quota manager, on a fake clock."""

from __future__ import annotations

import pytest

from lorapage.tenancy.quota import (
    AdmissionRate,
    QuotaExceeded,
    QuotaManager,
    Reservation,
    TokenBucket,
    overload_retry_after_s,
)
from lorapage.tenancy.tenants import TenantConfig, TenantsConfig


def manager(**limits) -> QuotaManager:
    return QuotaManager(TenantsConfig({"a": TenantConfig("a", **limits), "b": TenantConfig("b", **limits)}))


def reserve(quota: QuotaManager, tenant: str, prompt_tokens: int, max_tokens: int, now: float):
    """One request as the server takes it: :meth:`~QuotaManager.admit` before its body is read,
    then :meth:`~QuotaManager.charge` of its size; a refused charge releases what admit took."""
    got = quota.admit(tenant, now)
    if isinstance(got, QuotaExceeded):
        return got
    refused = quota.charge(got, prompt_tokens, max_tokens, now)
    if refused is not None:
        quota.release(got, 0, now)
        return refused
    return got


def test_refill_arithmetic_is_exact():
    bucket = TokenBucket(capacity=3, rate=1.0, now=0.0)  # 60 per minute, burst 3
    for _ in range(3):
        assert bucket.has(1, 0.0)
        bucket.take(1)
    assert not bucket.has(1, 0.999)
    assert bucket.has(1, 1.0)
    bucket.take(1)
    assert not bucket.has(1, 1.5)
    assert bucket.has(2, 3.0) and not bucket.has(3, 3.0)
    assert bucket.has(3, 100.0) and not bucket.has(3.5, 100.0)  # never above the burst


def test_fractional_rates_land_on_whole_tokens():
    tpm = TokenBucket(capacity=200_000, rate=200_000 / 60, now=0.0)
    tpm.take(200_000)
    assert not tpm.has(10_000, 2.999)
    assert tpm.has(10_000, 3.0)  # 200000 / 60 * 3 = 10000 exactly, despite float rounding


def test_burst_then_sustained_rate():
    quota = manager(rpm=60, rpm_burst=10)
    admitted = [isinstance(reserve(quota, "a", 1, 1, 0.0), Reservation) for _ in range(12)]
    assert admitted == [True] * 10 + [False] * 2
    times = [t / 10 for t in range(1, 101)]  # 10 s, one attempt every 100 ms
    got = sum(isinstance(reserve(quota, "a", 1, 1, t), Reservation) for t in times)
    assert got == 10  # one per second after the burst


def test_no_fixed_window_double_burst():
    """A fixed window would admit a full minute's quota at 59.9 s and again at 60.0 s."""
    quota = manager(rpm=600)
    admitted: list[float] = []
    for t in [59.9] * 700 + [60.0] * 700:
        if isinstance(reserve(quota, "a", 1, 1, t), Reservation):
            admitted.append(t)
    assert admitted.count(59.9) == 600
    assert admitted.count(60.0) == 1  # 0.1 s of refill at 10/s
    for t in [60.0 + i * 0.01 for i in range(1, 12001)]:  # then hammer it for two minutes
        if isinstance(reserve(quota, "a", 1, 1, t), Reservation):
            admitted.append(t)
    for window in (1.0, 10.0, 60.0):  # any window of T seconds: at most burst + rate * T
        for start in [59.9 + i * 0.5 for i in range(240)]:
            n = sum(start <= t < start + window for t in admitted)
            assert n <= 600 + 10 * window + 1e-9


@pytest.mark.parametrize(("rpm", "burst"), [(1, 1), (7, 3), (600, 600), (90, 1)])
def test_retry_after_is_correct_to_the_second(rpm, burst):
    quota = manager(rpm=rpm, rpm_burst=burst)
    now = 12.25
    while isinstance(reserve(quota, "a", 1, 1, now), Reservation):
        pass
    refused = reserve(quota, "a", 1, 1, now)
    assert isinstance(refused, QuotaExceeded) and refused.which == "rpm"
    wait = refused.retry_after_s
    assert wait is not None and wait >= 1
    if wait > 1:
        assert isinstance(reserve(quota, "a", 1, 1, now + wait - 1), QuotaExceeded)
    assert isinstance(reserve(quota, "a", 1, 1, now + wait), Reservation)


def test_tpm_retry_after_and_refund_of_unused_tokens():
    quota = manager(tpm=6000)  # 100 tokens per second, burst 6000
    r1 = reserve(quota, "a", 1000, 4000, 0.0)
    assert isinstance(r1, Reservation)
    refused = reserve(quota, "a", 500, 1500, 0.0)  # needs 2000, has 1000 left of 6000
    assert isinstance(refused, QuotaExceeded) and refused.which == "tpm" and refused.retry_after_s == 10
    quota.release(r1, used_tokens=1200, now=0.0)  # generated 200 of 4000: 3800 come back
    assert isinstance(reserve(quota, "a", 500, 1500, 0.0), Reservation)
    quota.release(r1, used_tokens=1200, now=0.0)  # a second release changes nothing
    assert quota.in_flight("a") == 1


def test_request_larger_than_the_burst_can_never_pass():
    quota = manager(tpm=1000)
    refused = reserve(quota, "a", 800, 400, 0.0)
    assert isinstance(refused, QuotaExceeded)
    assert refused.which == "tpm" and refused.retry_after_s is None and "max_tokens" in refused.message


def test_concurrency_cap_and_all_or_nothing():
    quota = manager(rpm=3, max_concurrency=2)
    r1 = reserve(quota, "a", 1, 1, 0.0)
    r2 = reserve(quota, "a", 1, 1, 0.0)
    refused = reserve(quota, "a", 1, 1, 0.0)
    assert isinstance(refused, QuotaExceeded) and refused.which == "concurrency" and refused.retry_after_s == 1
    assert isinstance(r1, Reservation) and isinstance(r2, Reservation)
    quota.release(r1, 2, 0.0)
    assert isinstance(reserve(quota, "a", 1, 1, 0.0), Reservation)  # the refusal took no RPM token
    refused = reserve(quota, "a", 1, 1, 0.0)
    assert isinstance(refused, QuotaExceeded) and refused.which == "rpm"  # the longest wait is reported
    assert refused.retry_after_s == 20


def test_one_tenant_over_quota_leaves_the_others_rate_alone():
    def admitted_for_b(hammer_a: bool) -> int:
        quota = manager(rpm=120, rpm_burst=5, tpm=50_000)
        got = 0
        for step in range(3000):  # 30 s in 10 ms steps
            now = step * 0.01
            if hammer_a:
                for _ in range(5):
                    reserve(quota, "a", 100, 100, now)
            if step % 20 == 0:
                got += isinstance(reserve(quota, "b", 100, 100, now), Reservation)
        return got

    assert admitted_for_b(hammer_a=True) == admitted_for_b(hammer_a=False) == 64  # 5 burst + 2/s for 29.8 s


def test_reload_keeps_in_flight_requests_valid():
    quota = manager(rpm=60, tpm=6000, max_concurrency=2)
    held = [reserve(quota, "a", 100, 100, 0.0) for _ in range(2)]
    b_held = reserve(quota, "b", 100, 900, 0.0)
    assert all(isinstance(r, Reservation) for r in [*held, b_held])
    new = TenantsConfig({"a": TenantConfig("a", rpm=60, tpm=6000, max_concurrency=1), "c": TenantConfig("c", rpm=1)})
    quota.reload(new, now=1.0)
    assert quota.in_flight("a") == 2  # nothing dropped, even above the new cap
    assert isinstance(reserve(quota, "a", 1, 1, 1.0), QuotaExceeded)
    quota.release(held[0], 150, 1.0)
    quota.release(held[1], 150, 1.0)
    assert isinstance(reserve(quota, "a", 1, 1, 1.0), Reservation)
    quota.release(b_held, 200, 1.0)  # b was removed; its reservation still releases cleanly
    with pytest.raises(KeyError, match="unknown tenant 'b'"):
        reserve(quota, "b", 1, 1, 1.0)
    assert isinstance(reserve(quota, "c", 1, 1, 1.0), Reservation)  # new tenants start full


def test_reload_keeps_bucket_levels_and_clips_to_a_smaller_burst():
    quota = manager(rpm=600)
    for _ in range(100):
        reserve(quota, "a", 1, 1, 0.0)
    quota.reload(TenantsConfig({"a": TenantConfig("a", rpm=600, rpm_burst=50)}), now=0.0)
    got = sum(isinstance(reserve(quota, "a", 1, 1, 0.0), Reservation) for _ in range(100))
    assert got == 50
    quota.reload(TenantsConfig({"a": TenantConfig("a", rpm=600)}), now=0.0)
    got = sum(isinstance(reserve(quota, "a", 1, 1, 0.0), Reservation) for _ in range(100))
    assert got == 0  # a bigger burst is not a free refill


def test_unlimited_tenant_and_overload_retry_after():
    quota = QuotaManager(TenantsConfig({"free": TenantConfig("free")}))
    assert all(isinstance(reserve(quota, "free", 10**6, 10**6, 0.0), Reservation) for _ in range(1000))
    assert overload_retry_after_s(queue_len=100, max_queue_len=100, admitted_per_s=0.5) == 2
    assert overload_retry_after_s(queue_len=4096, max_queue_len=4096, admitted_per_s=50.0) == 1
    assert overload_retry_after_s(queue_len=10, max_queue_len=10, admitted_per_s=0.0) == 60


def test_admission_rate_counts_the_last_window_only():
    rate = AdmissionRate(window_s=10)
    for i in range(50):
        rate.record(100.0 + i * 0.1)  # 10 per second over [100, 105)
    assert rate.per_second(104.9) == 5.0  # 50 in the window, averaged over 10 s
    assert rate.per_second(110.5) == 4.0  # the second starting at 100 has left the window
    assert rate.per_second(115.0) == 0.0
    rate.record(200.0)
    assert rate.per_second(200.0) == 0.1  # a bucket reused for a new second starts from zero


def test_admission_rate_memory_does_not_grow_with_traffic():
    rate = AdmissionRate(window_s=10)
    for i in range(200_000):
        rate.record(i * 0.001)  # 1,000 a second for 200 s
    assert rate.per_second(199.9995) == 1000.0
    assert len(rate._counts) == len(rate._seconds) == 10


def test_a_request_holds_a_slot_per_sequence():
    """Issue 38, finding 2: prompts x n sequences, each a concurrency slot; more than the tenant
    may ever run is refused for good (no Retry-After), more than it has free for now."""
    quota = manager(max_concurrency=8)
    first = quota.admit("a", 0.0)
    assert isinstance(first, Reservation)
    assert quota.widen(first, 6, "3 prompts x n 2") is None and quota.in_flight("a") == 6
    never = quota.admit("a", 0.0)
    assert isinstance(never, Reservation)
    refused = quota.widen(never, 9, "9 prompts x n 1")
    assert isinstance(refused, QuotaExceeded) and refused.retry_after_s is None and "9 sequences" in refused.message
    later = quota.widen(never, 3, "3 prompts x n 1")  # 6 + 3 > 8: not now
    assert isinstance(later, QuotaExceeded) and later.retry_after_s == quota.concurrency_retry_after_s
    assert quota.in_flight("a") == 7  # nothing taken by the refusals
    quota.release(first, 0, 0.0)
    assert quota.in_flight("a") == 1 and quota.widen(never, 3, "3 prompts x n 1") is None
    quota.release(never, 0, 0.0)
    assert quota.in_flight("a") == 0 and quota.in_flight("b") == 0


def test_room_is_what_the_bucket_holds_beyond_the_prompt():
    quota = manager(tpm=600)
    got = quota.admit("a", 0.0)
    assert isinstance(got, Reservation)
    assert quota.room(got, 100, 0.0) == 500
    assert quota.charge(got, 100, 500, 0.0) is None and quota.room(got, 0, 0.0) == 0
    assert quota.room(got, 0, 6.0) == 60  # 600 a minute: 60 in 6 s
    free = manager()
    unmetered = free.admit("a", 0.0)
    assert isinstance(unmetered, Reservation) and free.room(unmetered, 1, 0.0) is None
