"""A safetensors file read whole into one tensor, and its tensors as views of that buffer.

Loading an adapter reads its weights file once (so the bytes hashed against the registered
digest are the bytes used) and then packs them into its host-RAM copy. ``Path.read_bytes`` grows
a ``bytes`` object by reallocation and ``safetensors.torch.load`` then copies it into tensors of
their own: two fresh buffers per load that are thrown away at once, and on the VMs this project
runs on fresh memory costs more to touch than to copy (bench/RESULTS.md, session 7). So the file
goes with ``readinto`` into a uint8 tensor (an I/O thread's reused buffer, for loads) and the
header (the format's documented layout: an 8-byte little-endian length, that many bytes of UTF-8
JSON starting with ``{``, then the data) is parsed here into views, refused where safetensors'
own reader refuses. safetensors still writes the files (``save_file``) everywhere they are made.

Only regular files are read (:mod:`lorapage.adapters.files`), and registration reads a header
alone (:func:`read_header`), checked against the file's size before any data is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lorapage.adapters.files import UntrustedFileError, open_regular
from lorapage.adapters.verified import FileStamp
from lorapage.memory.host import host_empty

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header


class SafetensorsFormatError(ValueError):
    """The buffer is not a well-formed safetensors file; the message says what is wrong."""


class ReadBuffer:
    """One reusable read buffer per thread, for reads whose tensors are copied out before that
    thread reads again (an adapter load packs them into its host copy).

    Reading into memory already mapped skips the page faults of a fresh buffer, which on the
    2-vCPU VMs this project runs on cost more than the read itself (bench/RESULTS.md, session 7).
    A buffer grows to the largest file its thread has read, up to ``MAX_KEPT_BYTES``; a larger
    file is read into a buffer of its own.
    """

    MAX_KEPT_BYTES = 256 << 20

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, size: int) -> torch.Tensor:
        """This thread's buffer, at least ``size`` bytes (its first ``size`` are what to use)."""
        if size > self.MAX_KEPT_BYTES:
            return host_empty(size)
        buf: torch.Tensor | None = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < size:
            buf = self._local.buf = host_empty(size + size // 4)  # room for a slightly larger file
        return buf


def read_file(path: Path, into: ReadBuffer | None = None, *, size: int | None = None) -> torch.Tensor:
    """The file's bytes in one uint8 tensor, read without an intermediate copy: a fresh tensor,
    or a view of this thread's buffer from ``into``. Only a regular file is read (a FIFO or a
    device is refused without blocking, see :mod:`lorapage.adapters.files`), and with ``size``
    only one of exactly that many bytes: any other is refused before a byte is read."""
    return read_stamped(path, into, size=size)[0]


def read_stamped(
    path: Path, into: ReadBuffer | None = None, *, size: int | None = None
) -> tuple[torch.Tensor, FileStamp | None]:
    """:func:`read_file`, and the file's stamp (:mod:`lorapage.adapters.verified`) when ``fstat``
    said the same before and after the read (None: it changed while it was read)."""
    read_ns = time.time_ns()
    f, actual = open_regular(path, max_bytes=size)
    with f:
        if size is not None and actual != size:
            raise UntrustedFileError(f"{path.name} is {actual} bytes; {size} were expected")
        before = os.fstat(f.fileno())
        buf = _buffer(actual, into)
        view = buf.numpy().data.cast("B")
        got = 0
        while got < actual and (n := f.readinto(view[got:])):
            got += n
        if got != actual or f.read(1):
            raise OSError(f"{path.name} changed size while it was read ({actual} bytes when opened)")
        stamp = FileStamp.of(before, os.fstat(f.fileno()), read_ns)
    return buf, stamp


def _buffer(size: int, into: ReadBuffer | None) -> torch.Tensor:
    return host_empty(size) if into is None else into.get(size)[:size]


@dataclass(frozen=True)
class Header:
    """What a safetensors file's header says: each tensor's dtype and shape, and the file's size
    in bytes (which the header describes exactly)."""

    shapes: dict[str, tuple[torch.dtype, list[int]]]
    size: int


def read_header(path: Path, max_header_bytes: int = MAX_HEADER_BYTES) -> Header:
    """The header of the safetensors file ``path``, reading nothing else. It must describe the
    file's size exactly (the checks of :func:`tensor_views`, on the size the file has): a file
    padded or extended past its tensors (a sparse file costs nothing to make) is refused before
    its data is read. Only a regular file is opened."""
    f, size = open_regular(path)
    with f:
        prefix = f.read(8)
        n = _header_length(prefix, size, max_header_bytes)
        raw = f.read(n)
    if len(raw) != n:
        raise SafetensorsFormatError(f"the file ended inside its {n}-byte header")
    header = _decode_header(raw)
    return Header({name: (dtype, shape) for _, _, name, dtype, shape in _spans(header, size - 8 - n)}, size)


def tensor_views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> tensor for every tensor of the safetensors file held in ``buf`` (uint8), each a
    view of ``buf`` (a copy only where a writer left data unaligned for its dtype).

    Refuses what safetensors' reader refuses: a header that is not a JSON object of entries with
    a known dtype, a shape and offsets whose byte count matches it, and data that the entries do
    not cover exactly, in order, without gaps or overlaps.
    """
    size = buf.numel()
    n = _header_length(buf[:8].numpy().tobytes(), size, MAX_HEADER_BYTES)
    header = _decode_header(buf[8 : 8 + n].numpy().tobytes())
    data = buf[8 + n :]
    views: dict[str, torch.Tensor] = {}
    for begin, end, name, dtype, shape in _spans(header, data.numel()):
        raw = data[begin:end]
        if raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()  # unaligned for its dtype: a view cannot reinterpret it
        views[name] = raw.view(dtype).view(shape)
    return views


def _header_length(prefix: bytes, size: int, limit: int) -> int:
    if size < 8 or len(prefix) < 8:
        raise SafetensorsFormatError(f"{size} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > size - 8:
        raise SafetensorsFormatError(f"header length {n} does not fit in a {size}-byte file")
    if n > limit:
        raise SafetensorsFormatError(f"header length {n} is over the limit of {limit} bytes")
    return n


def _decode_header(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
        header = json.loads(text) if text.startswith("{") else None
    except UnicodeDecodeError as e:
        raise SafetensorsFormatError(f"header is not UTF-8 ({e})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise SafetensorsFormatError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("header is not a JSON object (it must start with '{')")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsFormatError("__metadata__ is not a JSON object of strings")
    return header


def _spans(header: dict, data_size: int) -> list[tuple[int, int, str, torch.dtype, list[int]]]:
    """The header's tensors as (begin, end, name, dtype, shape), in data order, checked to cover
    ``data_size`` bytes exactly."""
    spans = []
    for name, meta in header.items():
        dtype, shape, offsets = _entry(name, meta)
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise SafetensorsFormatError(f"tensor {name!r}: offsets {offsets} lie outside the {data_size}-byte data")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise SafetensorsFormatError(f"tensor {name!r}: {end - begin} bytes do not hold {shape} of {dtype}")
        spans.append((begin, end, name, dtype, shape))
    spans.sort()
    covered = 0
    for begin, end, name, _, _ in spans:
        if begin != covered:
            raise SafetensorsFormatError(f"tensor {name!r} starts at byte {begin}, not at {covered}: a gap or overlap")
        covered = end
    if covered != data_size:
        raise SafetensorsFormatError(f"{data_size - covered} bytes after the last tensor")
    return spans


def _entry(name: str, meta: object) -> tuple[torch.dtype, list[int], list[int]]:
    if not isinstance(meta, dict):
        raise SafetensorsFormatError(f"tensor {name!r}: entry is not a JSON object")
    name_of_dtype = meta.get("dtype")
    dtype = DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
    if dtype is None:
        raise SafetensorsFormatError(f"tensor {name!r}: dtype {name_of_dtype!r} is not one of {sorted(DTYPES)}")
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsFormatError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise SafetensorsFormatError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    return dtype, shape, offsets
