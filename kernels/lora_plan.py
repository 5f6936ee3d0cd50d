"""How the CPU LoRA path batches one step's segments: planned once per step, on the host.

Each op (one group's shrink, one module's expand, in every layer) runs one ``bmm`` per
:class:`LoraBatch`. A batch is a set of *cells*, one per adapter, whose matrices are one
``[cells, rows, cols]`` tensor: a strided view of the pool when the adapters' pages sit at one
stride (adapters loaded back to back, or on the page grid evictions leave, where a cell with no
token of this step, a *hole*, is read and its result dropped), else a per-op copy of the covering
pages (an adapter whose own pages are not one run). Each cell's tokens are its rows: straight
views of ``x`` / ``h`` / ``y`` when the cells' tokens are consecutive and equally many, otherwise
gathered into ``[cells, length, ...]`` (padding rows repeat a token) and scattered back.

Why this shape: on a CPU every op costs ~10 µs of dispatch and decode rows are bound by reading
each adapter's weights, so a step should read each distinct adapter once, in as few ops as
possible, with no copy of the weights. Long segments (prefill) get a batch of their own: their
FLOPs dwarf the dispatch and padding them to a common length would not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# Segments of up to this many tokens are batched across adapters, padded to the longest in their
# class; a longer one is a batch alone. Decode rows read weights rather than compute, so padding
# 2 rows to 4 costs little next to one more batch (~11 ops per layer); past 4 rows a segment alone
# runs 2-D matmuls on every thread, where a small bmm splits its few batch entries over threads.
LENGTH_CLASSES = (1, 4)
# A hole costs reading one adapter's matrices; splitting the run instead costs one more batch of
# ops. About 1 MiB per layer read is what one batch's dispatch costs on a CPU.
HOLE_BYTES = 1 << 20


# With the C kernels built (lora_cpu.c), segments of up to this many tokens run there, grouped by
# adapter: each adapter's matrices are read once for all its tokens, which are addressed through an
# index rather than gathered. Longer ones stay on MKL's 2-D matmuls, which compute faster than the
# C loops once FLOPs, not bytes, bound the segment.
CELL_TOKENS = 64


@dataclass(frozen=True)
class LoraCells:
    """The step's short segments grouped by adapter, for the C kernels: cell i is adapter slot
    ``slots[i]`` with the tokens ``tokens[begin[i]:begin[i + 1]]``."""

    slots: Tensor  # [cells] int64: each cell's lora slot
    begin: Tensor  # [cells + 1] int64: where each cell's tokens start in ``tokens``
    tokens: Tensor  # [n] int64: token rows, ascending within a cell

    @property
    def args(self) -> tuple[int, ...]:
        """The C kernels' cell arguments: count, then the three tables' addresses."""
        return (self.slots.shape[0], self.slots.data_ptr(), self.begin.data_ptr(), self.tokens.data_ptr())


def split_cells(
    segments: tuple[tuple[int, int, int], ...],
) -> tuple[LoraCells | None, tuple[tuple[int, int, int], ...]]:
    """The short segments as cells (None if there are none), and the long segments left over."""
    tokens: dict[int, list[int]] = {}
    long = []
    for start, end, slot in segments:
        if end - start > CELL_TOKENS:
            long.append((start, end, slot))
        elif slot:
            tokens.setdefault(slot, []).extend(range(start, end))
    if not tokens:
        return None, tuple(long)
    sizes = [len(t) for t in tokens.values()]
    cells = LoraCells(
        slots=torch.tensor(list(tokens), dtype=torch.int64),
        begin=torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int64),
        tokens=torch.tensor([t for ts in tokens.values() for t in ts], dtype=torch.int64),
    )
    return cells, tuple(long)


@dataclass(frozen=True)
class LoraBatch:
    """Cells computed together. ``view_*`` places them in the pool, ``pages`` when copied."""

    slots: Tensor  # [cells] int64: each cell's lora slot, 0 for a hole
    rep: int  # a slot of the batch: its table rows give every cell's offsets, ranks, widths
    length: int  # rows per cell
    first_page: int  # page where cell 0's adapter buffer starts (when viewed in place)
    stride_pages: int  # pages between consecutive cells (when viewed in place)
    pages: Tensor | None  # [cells, n] int64: each cell's pages, copied per op; None: viewed in place
    start: int  # direct rows: cell j's tokens are [start + j * length, start + (j + 1) * length)
    gather: Tensor | None  # [cells * length] int64: token of each padded row; None: direct rows
    # With gathered rows: the padded row holding each real token, in token order (the
    # inverse of ``gather``); ``span`` the tokens when they are one range [lo, hi) (a decode
    # batch usually is), else ``tokens`` lists them ascending. Results go back as one
    # ``index_select`` then a slice copy / ``add_``: ``index_add_`` on CPU costs ~5x as much.
    real_rows: Tensor | None
    span: slice | None
    tokens: Tensor | None

    @property
    def cells(self) -> int:
        return self.slots.shape[0]

    @property
    def alone(self) -> slice | None:
        """The token rows of a batch of one cell with direct rows (a long segment), else None:
        those run 2-D ``mm`` / ``addmm_``, which use every thread where a 1-batch ``bmm`` uses one."""
        return slice(self.start, self.start + self.length) if self.cells == 1 and self.gather is None else None

    def matrices(self, slab: Tensor, offset: int, rows: int, cols: int) -> Tensor:
        """``[cells, rows, cols]``: the matrix at ``offset`` of each cell's flat buffer."""
        page_size = slab.shape[1]
        if self.pages is None:
            start = slab.storage_offset() + self.first_page * page_size + offset
            return slab.as_strided((self.cells, rows, cols), (self.stride_pages * page_size, cols, 1), start)
        first, last = offset // page_size, (offset + rows * cols - 1) // page_size
        covering = slab[self.pages[:, first : last + 1]].view(self.cells, -1)
        inner = offset - first * page_size
        return covering[:, inner : inner + rows * cols].unflatten(1, (rows, cols))

    def rows_of(self, t: Tensor) -> Tensor:
        """``[cells, length, t.shape[1]]``: each cell's rows of a per-token tensor."""
        if self.gather is None:
            return t[self.start : self.start + self.cells * self.length].view(self.cells, self.length, -1)
        return t.index_select(0, self.gather).view(self.cells, self.length, -1)

    def _real(self, out: Tensor) -> Tensor:
        assert self.real_rows is not None
        return out.reshape(-1, out.shape[-1]).index_select(0, self.real_rows)

    def write(self, t: Tensor, out: Tensor) -> None:
        """``t[token] = out`` for each real row of ``out`` ``[cells, length, cols]``."""
        if self.gather is None:
            t[self.start : self.start + self.cells * self.length] = out.view(-1, out.shape[-1])
        elif self.span is not None:
            t[self.span] = self._real(out)
        else:
            assert self.tokens is not None
            t.index_copy_(0, self.tokens, self._real(out))

    def add_product(self, t: Tensor, hm: Tensor, b: Tensor) -> None:
        """``t[token] += hm @ b.T`` for each real row; ``hm`` ``[cells, length, r]``, ``b`` ``[cells, w, r]``."""
        if self.gather is None:
            # bmm into a new tensor, then one add_: ``t`` is a column slice of ``y``, and a
            # ``baddbmm_`` into a strided output falls back to one ``addmm_`` per cell on CPU.
            rows = t[self.start : self.start + self.cells * self.length]
            rows.add_(torch.bmm(hm, b.transpose(1, 2)).view(rows.shape))
        elif self.span is not None:
            t[self.span].add_(self._real(hm @ b.transpose(1, 2)))
        else:
            assert self.tokens is not None  # tokens are distinct: an accumulating put adds each once
            t.index_put_((self.tokens,), self._real(hm @ b.transpose(1, 2)), accumulate=True)


@dataclass
class _Cell:
    slot: int
    first_page: int  # -1: the adapter's pages are not one run
    tokens: list[int]


def plan_lora_batches(
    segments: tuple[tuple[int, int, int], ...], page_table: Tensor, layout: list[np.ndarray], slab: Tensor
) -> tuple[LoraBatch, ...]:
    """The step's batches. ``layout`` holds per-slot table rows (slot on axis 0): slots whose rows
    are equal share every offset and rank, so they may share a batch. ``slab`` is one layer of the
    pool (its page size, dtype and device)."""
    pages = page_table.numpy() if page_table.device.type == "cpu" else page_table.cpu().numpy()
    tokens: dict[int, list[int]] = {}
    batches: list[LoraBatch] = []
    for start, end, slot in segments:
        if not slot:
            continue
        if end - start > LENGTH_CLASSES[-1]:
            batches.append(_batch([_Cell(slot, _first_page(pages[slot]), list(range(start, end)))], 1, pages, slab))
        else:
            tokens.setdefault(slot, []).extend(range(start, end))
    if tokens:
        slots = np.fromiter(tokens, dtype=np.int64)
        _, kind = np.unique(
            np.concatenate([t[slots].reshape(len(slots), -1) for t in layout], axis=1), axis=0, return_inverse=True
        )
        classes: dict[tuple[int, int, bool], list[_Cell]] = {}
        for slot, k in zip(slots.tolist(), kind.reshape(-1).tolist()):
            cell = _Cell(slot, _first_page(pages[slot]), tokens[slot])
            if len(cell.tokens) > LENGTH_CLASSES[-1]:  # short segments of one adapter add up: a batch alone
                batches.append(_batch([cell], 1, pages, slab))
                continue
            length = next(c for c in LENGTH_CLASSES if len(cell.tokens) <= c)
            classes.setdefault((k, length, cell.first_page < 0), []).append(cell)
        for (_, _, copied), cells in classes.items():
            if copied:
                batches.append(_batch(cells, 1, pages, slab))
            else:
                batches.extend(_batch(run, stride, pages, slab) for run, stride in _runs(cells, pages, slab))
    return tuple(batches)


def _first_page(row: np.ndarray) -> int:
    """The adapter's first page when its pages are one run, else -1."""
    n = int(np.count_nonzero(row))
    first = int(row[0])
    return first if n and int(row[n - 1]) - first == n - 1 else -1


def _runs(cells: list[_Cell], pages: np.ndarray, slab: Tensor) -> list[tuple[list[_Cell | None], int]]:
    """In-place cells split into runs at one page stride (None marks a hole), in page order."""
    n_pages = int(np.count_nonzero(pages[cells[0].slot]))
    hole_cells = HOLE_BYTES // (n_pages * slab.shape[1] * slab.element_size())
    cells = sorted(cells, key=lambda c: c.first_page)
    runs: list[tuple[list[_Cell | None], int]] = [([cells[0]], n_pages)]
    for cell in cells[1:]:
        run, stride = runs[-1]
        last = run[-1]
        assert last is not None
        gap = cell.first_page - last.first_page
        if len(run) == 1 and (gap % n_pages or gap // n_pages - 1 > hole_cells):
            stride = gap  # two adapters at any distance are one run of two
        holes = gap // stride - 1
        if gap % stride == 0 and holes <= hole_cells:
            run.extend([None] * holes + [cell])
            runs[-1] = (run, stride)
        else:
            runs.append(([cell], n_pages))
    return runs


def _batch(cells: Sequence[_Cell | None], stride: int, pages: np.ndarray, slab: Tensor) -> LoraBatch:
    real = [c for c in cells if c is not None]
    length = max(len(c.tokens) for c in real)
    device = slab.device
    slots = torch.tensor([c.slot if c else 0 for c in cells], dtype=torch.int64)
    first = real[0].tokens[0]
    direct = all(
        c is not None and c.tokens == list(range(first + j * length, first + (j + 1) * length))
        for j, c in enumerate(cells)
    )
    gather = real_rows = tokens = None
    span = None
    if not direct:
        padded = [(c.tokens + [c.tokens[0]] * (length - len(c.tokens))) if c else [first] * length for c in cells]
        gather = torch.tensor(padded, dtype=torch.int64, device=device).view(-1)
        row_of = sorted((t, j * length + i) for j, c in enumerate(cells) if c for i, t in enumerate(c.tokens))
        real_rows = torch.tensor([r for _, r in row_of], dtype=torch.int64, device=device)
        lo, hi = row_of[0][0], row_of[-1][0] + 1
        if hi - lo == len(row_of):
            span = slice(lo, hi)
        else:
            tokens = torch.tensor([t for t, _ in row_of], dtype=torch.int64, device=device)
    in_place = real[0].first_page >= 0
    page_ids = None
    if not in_place:
        n = max(int(np.count_nonzero(pages[c.slot])) for c in real)
        page_ids = torch.from_numpy(pages[[c.slot for c in real], :n].astype(np.int64)).to(device)
    return LoraBatch(
        slots=slots.to(device),
        rep=real[0].slot,
        length=length,
        first_page=max(real[0].first_page, 0),
        stride_pages=stride,
        pages=page_ids,
        start=first,
        gather=gather,
        real_rows=real_rows,
        span=span,
        tokens=tokens,
    )
