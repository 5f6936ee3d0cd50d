"""Reading a safetensors file into one buffer and viewing its tensors: the same tensors as the
safetensors library reads, no copies, and the library's refusals of malformed files; only
regular files of the size their header (or the caller) says are read."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from lorapage.adapters.files import UntrustedFileError
from lorapage.adapters.safetensors_buffer import (
    Header,
    ReadBuffer,
    SafetensorsFormatError,
    read_file,
    read_header,
    tensor_views,
)
from lorapage.memory.host import HOST_ARENA, HUGE_PAGE_BYTES, host_empty


def _buffer(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _file(header: dict, data: bytes, pad_to: int | None = None) -> torch.Tensor:
    """A safetensors file written by hand: length, JSON header (padded to ``pad_to`` bytes), data."""
    text = json.dumps(header).encode()
    if pad_to is not None:
        text = text.ljust(pad_to)
    return _buffer(struct.pack("<Q", len(text)) + text + data)


def test_views_match_the_library_and_share_the_buffer(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(16, 768),
        "b": torch.randn(2048, 16).to(torch.bfloat16),
        "c": torch.randn(3, 5).to(torch.float16),
        "d": torch.randn(7).double(),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    raw = save(tensors, metadata={"format": "pt"})
    (tmp_path / "w.safetensors").write_bytes(raw)
    buf = read_file(tmp_path / "w.safetensors")
    assert buf.dtype == torch.uint8 and buf.numel() == len(raw)
    views = tensor_views(buf)
    want = load(raw)
    assert views.keys() == want.keys()
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for name, t in want.items():
        assert views[name].dtype == t.dtype and views[name].shape == t.shape
        assert torch.equal(views[name], t), name
        if t.numel():
            assert lo <= views[name].data_ptr() < hi, f"{name} was copied, not viewed"


def test_a_read_buffer_is_reused_per_thread_and_grows(tmp_path: Path) -> None:
    small, large = tmp_path / "small.safetensors", tmp_path / "large.safetensors"
    small.write_bytes(save({"x": torch.arange(10.0)}))
    large.write_bytes(save({"x": torch.arange(1000.0)}))
    buffers = ReadBuffer()
    first = read_file(small, buffers)
    again = read_file(small, buffers)
    assert first.data_ptr() == again.data_ptr(), "the thread's buffer was not reused"
    grown = read_file(large, buffers)
    assert grown.numel() == large.stat().st_size and torch.equal(tensor_views(grown)["x"], torch.arange(1000.0))
    other: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: other.append(read_file(large, buffers)))
    worker.start()
    worker.join()
    assert other[0].data_ptr() != grown.data_ptr(), "two threads shared one buffer"
    assert torch.equal(other[0], grown)


def test_a_fifo_or_a_device_is_refused_without_blocking(tmp_path: Path) -> None:
    """Opening a FIFO waits for a writer, forever if none comes: it is refused at once instead
    (no writer exists here, so a blocking open would hang this test), as a device is."""
    fifo = tmp_path / "w.safetensors"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        with pytest.raises(UntrustedFileError, match=f"is {kind}, not a regular file"):
            read_file(path, ReadBuffer())
        with pytest.raises(UntrustedFileError, match=kind):
            read_header(path)


def test_a_file_of_another_size_than_expected_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    raw = save({"x": torch.arange(16.0)})
    path.write_bytes(raw)
    assert read_header(path) == Header({"x": (torch.float32, [16])}, len(raw))
    assert torch.equal(tensor_views(read_file(path, size=len(raw)))["x"], torch.arange(16.0))
    with pytest.raises(UntrustedFileError, match=f"{len(raw) + 1} were expected"):
        read_file(path, size=len(raw) + 1)
    with pytest.raises(UntrustedFileError, match="over the limit"):
        read_file(path, size=len(raw) - 1)
    # Extended past its tensors (sparse: a gigabyte that costs nothing): the header says otherwise.
    with path.open("r+b") as f:
        f.truncate(1 << 30)
    with pytest.raises(SafetensorsFormatError, match="bytes after the last tensor"):
        read_header(path)


def test_unaligned_data_is_copied_with_its_values() -> None:
    # A header padded so the data starts at an odd offset: no float32 view of it can exist.
    value = torch.arange(6, dtype=torch.float32)
    header = {"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    text = json.dumps(header).encode()
    pad_to = len(text) + (1 - (8 + len(text))) % 4  # data then starts 1 byte past a multiple of 4
    buf = _file(header, value.numpy().tobytes(), pad_to=pad_to)
    assert (8 + pad_to) % 4 == 1
    assert torch.equal(tensor_views(buf)["x"], value.view(2, 3))


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"\x01\x02", "shorter than the 8-byte header length"),
        (struct.pack("<Q", 1000) + b"{}", "does not fit"),
        (struct.pack("<Q", 5) + b"{nope", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 3) + b" {}", "must start with"),
        (struct.pack("<Q", 4) + "{}".encode("utf-16"), "not UTF-8"),
        (struct.pack("<Q", 26) + b'{"__metadata__": {"a": 1}}', "__metadata__ is not a JSON object of strings"),
    ],
)
def test_malformed_headers_are_refused(raw: bytes, why: str) -> None:
    with pytest.raises(SafetensorsFormatError, match=why):
        tensor_views(_buffer(raw))


@pytest.mark.parametrize(
    ("entry", "data", "why"),
    [
        ({"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}, bytes(8), "dtype 'I64' is not one of"),
        ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, bytes(4), "dtype \\['F32'\\] is not one of"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, bytes(4), "is not a list of sizes"),
        ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, bytes(4), "is not a list of sizes"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, bytes(4), "is not \\[begin, end\\]"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, bytes(4), "lie outside"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, bytes(8), "do not hold"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, bytes(8), "not at 0: a gap or overlap"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, bytes(8), "4 bytes after the last tensor"),
        ("F32", bytes(4), "entry is not a JSON object"),
    ],
)
def test_malformed_entries_are_refused(entry: object, data: bytes, why: str) -> None:
    with pytest.raises(SafetensorsFormatError, match=why):
        tensor_views(_file({"x": entry}, data))


def test_overlapping_tensors_are_refused() -> None:
    header = {
        "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    with pytest.raises(SafetensorsFormatError, match="'y' starts at byte 4, not at 8"):
        tensor_views(_file(header, bytes(12)))


def test_host_empty_is_a_writable_tensor_of_the_shape_asked() -> None:
    small = host_empty(100, torch.float32)
    big = host_empty((3, HUGE_PAGE_BYTES // 4), torch.float32)
    for t in (small, big):
        t.fill_(1.5)
        assert t.dtype == torch.float32 and float(t.sum()) == 1.5 * t.numel()
    assert big.shape == (3, HUGE_PAGE_BYTES // 4)
    assert host_empty(0).numel() == 0


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="no transparent huge pages (Linux's)"
)
def test_large_host_buffers_are_advised_for_huge_pages() -> None:
    """The mapping carries the kernel's huge-page advice ("hg" in its VmFlags), whatever the
    system's THP mode makes of it, and is unmapped once its tensor is gone and the arena trimmed."""
    t = host_empty(4 * HUGE_PAGE_BYTES)
    start = t.data_ptr()

    def flags() -> list[str] | None:
        region = None
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                region = lo <= start < hi
            elif head == "VmFlags:" and region:
                return line.split()[1:]
        return None

    got = flags()
    assert got is not None and "hg" in got
    del t
    HOST_ARENA.trim(0)  # an idle mapping is kept for the next buffer of its size until trimmed
    assert flags() is None, "the mapping outlived its tensor and the arena's trim"
