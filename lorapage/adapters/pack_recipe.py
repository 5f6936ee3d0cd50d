"""An adapter's pack as byte runs of its weights file: the recipe one load leaves for every later
load of a file with the same header.

Packing from the file's bytes (:func:`~lorapage.adapters.peft_format.load_adapter_tensors`, then
:meth:`AdapterLayout.pieces <lorapage.adapters.layout.AdapterLayout.pieces>`) parses the JSON
header, makes a view per tensor, checks each against the registered spec and lists ~170 pieces in
page order: ~4 ms of Python a load for a rank-16 all-module adapter of 12 layers, all of it
holding the GIL that the forward thread takes back after every op. In the S-LoRA replay's
2,000-adapter case the I/O threads held it ~0.9 s a pass, and the forward thread lost 0.6-0.9 s
off its CPU (bench/RESULTS.md, round 4 session 10).

Where every piece is a contiguous view of the file's bytes or zero padding (the file's dtype is
the pages' dtype: no conversion, no int8 pages, PEFT variant data, MoE experts or tensor-parallel
shards), the pack is a fixed function of the header: these byte ranges of the file, in this
order. Files with the same header, as every adapter trained with one configuration has (the
header holds names, dtypes, shapes and offsets, no values), pack with one ``torch.split`` and one
``torch.cat``.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from lorapage.adapters.layout import AdapterLayout


@dataclass(frozen=True, eq=False)
class PackRecipe:
    """The pack of files with one header: the layout it was recorded for, the sizes that split
    the file's bytes into runs, and per piece of the pack a run's index or, negative, ``-(n + 1)``
    for ``n`` bytes of zero padding."""

    layout: AdapterLayout
    runs: tuple[int, ...]  # byte sizes, in file order, summing to the file's size
    order: tuple[int, ...]
    zeros: torch.Tensor = field(repr=False)  # uint8 zeros, as many as the longest padding

    @classmethod
    def record(cls, layout: AdapterLayout, pieces: list[torch.Tensor], raw: torch.Tensor) -> PackRecipe | None:
        """The recipe of ``pieces`` (what ``layout.pieces`` listed, ending with the last layer's
        padding: a layout without a variant section) taken from ``raw`` (the file's bytes,
        uint8); None where a piece is neither a contiguous view of ``raw`` nor a slice of that
        padding (a converted or computed weight: that pack is not one of byte runs)."""
        assert layout.section is None
        base, size = raw.data_ptr(), raw.numel()
        storage = raw.untyped_storage().data_ptr()
        spans: list[tuple[int, int]] = []  # (first byte, bytes); a first byte of -1: padding
        for piece in pieces:
            nbytes = piece.numel() * piece.element_size()
            if nbytes == 0:
                continue
            if piece.untyped_storage().data_ptr() == storage and piece.is_contiguous():
                start = piece.data_ptr() - base
                if not 0 <= start <= size - nbytes:
                    return None
                spans.append((start, nbytes))
            elif piece.untyped_storage().data_ptr() == pieces[-1].untyped_storage().data_ptr():
                spans.append((-1, nbytes))  # the layer's padding ends every layer's pieces
            else:
                return None
        cuts = sorted({0, size, *(s for s, _ in spans if s >= 0), *(s + n for s, n in spans if s >= 0)})
        index = {at: i for i, at in enumerate(cuts)}
        order: list[int] = []
        for start, nbytes in spans:
            if start < 0:
                order.append(-(nbytes + 1))
            else:
                order.extend(range(index[start], index[start + nbytes]))
        longest = max((n for s, n in spans if s < 0), default=0)
        runs = tuple(b - a for a, b in zip(cuts, cuts[1:]))
        return cls(layout, runs, tuple(order), torch.zeros(longest, dtype=torch.uint8))

    def pack(self, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The file ``raw`` (uint8, of this recipe's header) packed as ``layout.join`` would."""
        runs = torch.split(raw, list(self.runs))
        return self.layout.join([runs[i] if i >= 0 else self.zeros[: -1 - i] for i in self.order]).view(dtype)


class PackRecipes:
    """Recipes by header, the most recent ``capacity`` kept (a header is ~100 bytes a tensor).
    Thread-safe: the I/O threads look up and record at once."""

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._by_header: OrderedDict[bytes, PackRecipe | None] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # loads packed by a recipe (tests and benches read it)

    def get(self, header: bytes, layout: AdapterLayout, size: int) -> PackRecipe | None:
        """The recipe for files of ``size`` bytes with ``header`` packed into ``layout``'s
        places, if one was recorded."""
        with self._lock:
            recipe = self._by_header.get(header)
            if recipe is None or sum(recipe.runs) != size or not recipe.layout.same_pages(layout):
                return None
            self._by_header.move_to_end(header)
            self.hits += 1
            return recipe

    def known(self, header: bytes) -> bool:
        """Whether a load of a file with ``header`` was looked at already (a recipe or none)."""
        with self._lock:
            return header in self._by_header

    def put(self, header: bytes, recipe: PackRecipe | None) -> None:
        """Keep ``recipe`` for ``header``; None remembers that files with it need the full pack."""
        with self._lock:
            self._by_header[header] = recipe
            self._by_header.move_to_end(header)
            while len(self._by_header) > self.capacity:
                self._by_header.popitem(last=False)


def header_bytes(raw: torch.Tensor) -> bytes | None:
    """A safetensors file's length prefix and JSON header (its bytes as uint8), or None where
    the prefix does not fit the file (the full read reports that)."""
    if raw.numel() < 8:
        return None
    (n,) = struct.unpack("<Q", raw[:8].numpy().tobytes())
    if n > raw.numel() - 8:
        return None
    return raw[: 8 + n].numpy().tobytes()
