"""Host buffers for data written once and then kept: adapters' host-RAM copies and file reads.

Memory fresh from the kernel is mapped page by page as it is first written, and under a
hypervisor each 4 KB fault is costly. Writing 10.6 MB (a rank-16 adapter of the 100M bench model)
into a new ``torch.empty`` took 29 ms in isolation on the 2-vCPU machines this project runs on,
against 2.4 ms into memory advised for transparent huge pages (one fault per 2 MB). Inside a
replay pass the packed copy still took ~20 ms either way: there the VM's host was backing memory
the guest had handed back (bench/RESULTS.md, session 7), which no advice avoids. So these
buffers are anonymous mappings with ``MADV_HUGEPAGE``, which takes effect
where the system's THP mode is ``madvise`` (a common default) or ``always``; elsewhere, and off
Linux, they are plain ``torch.empty``. The mapping is unmapped when the last tensor viewing it
is freed. (PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` does the same for every large CPU allocation of a
process, but only when set before torch's first allocation, so it is not ours to set.)
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20  # below one huge page, advice has nothing to act on
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def host_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised CPU tensor, huge-page backed when it is large enough and the OS allows."""
    shape = (shape,) if isinstance(shape, int) else shape
    nbytes = math.prod(shape) * dtype.itemsize
    if _MADV_HUGEPAGE is None or nbytes < HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(_MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP: small pages, as torch.empty would have
        pass
    # The tensor holds the mapping: it is unmapped when the last view of it goes.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
