"""The host arena (lorapage.memory.host): a mapping is lent again only once no tensor views it,
to a buffer of about its size, and idle mappings past the arena's bound are unmapped."""

from __future__ import annotations

import threading

import torch

from lorapage.memory.host import HUGE_PAGE_BYTES, HostArena

MB = 1 << 20


def test_a_mapping_is_lent_again_only_when_no_view_of_it_is_left():
    arena = HostArena()
    t = arena.take(3 * MB)
    first = t.data_ptr()
    view = t[8:].view(torch.int32)  # a view outlives the buffer it came from
    del t
    other = arena.take(3 * MB)
    second = other.data_ptr()
    assert second != first and arena.reused == 0
    view.fill_(7)
    del view, other
    again = arena.take(3 * MB)
    assert arena.reused == 1 and again.data_ptr() in (first, second)
    again.fill_(1)  # writable, and what it held before is the caller's to overwrite
    assert int(again.sum()) == 3 * MB


def test_a_mapping_is_lent_only_to_a_buffer_of_about_its_size():
    arena = HostArena()
    big = arena.take(8 * MB)
    ptr = big.data_ptr()
    del big
    small = arena.take(2 * MB)  # 8 MB would waste three quarters of itself
    assert small.data_ptr() != ptr and arena.reused == 0
    near = arena.take(8 * MB - 12345)
    assert near.data_ptr() == ptr and arena.reused == 1 and near.numel() == 8 * MB - 12345


def test_idle_mappings_past_the_bound_are_unmapped_and_trim_frees_them():
    arena = HostArena(keep_bytes=4 * MB)
    bufs = [arena.take(4 * MB) for _ in range(3)]
    del bufs
    assert arena.idle_bytes() == 12 * MB
    kept = arena.take(6 * MB)  # no idle one fits: the idle ones above 4 MB go first
    assert arena.idle_bytes() == 4 * MB and kept.numel() == 6 * MB
    assert arena.trim(0) == 4 * MB and arena.idle_bytes() == 0


def test_threads_never_share_a_buffer():
    arena = HostArena()
    seen: list[int] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for _ in range(20):
            buf = arena.take(HUGE_PAGE_BYTES)
            buf.fill_(k)
            assert int(buf.max()) == int(buf.min()) == k  # no other thread wrote into it meanwhile
            with lock:
                seen.append(buf.data_ptr())
            del buf

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 80 and arena.reused > 0
