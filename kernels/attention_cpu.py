"""The CPU path's paged attention: float32, float16 or bfloat16 KV pages (``kv_cache_dtype``)
read in place by the C kernel of ``attention_cpu.h`` (built with the LoRA kernels), the PyTorch
reference for anything else.

Same signatures and results as :func:`lorapage.kernels.attention_ref.paged_decode_attention_ref`
and :func:`~lorapage.kernels.attention_ref.prefill_attention_ref`. A prompt's token is a decode
row of its own to the kernel: its sequence's pages, and a context that ends at its own position
(causal; a window counted back from it), so a prefill runs the same C loop over every token and
head at once instead of PyTorch's ops sequence by sequence (8 ms a layer for 32 prompts of 8
tokens on the 512-wide bench model).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from lorapage.kernels.attention_ref import paged_decode_attention_ref, prefill_attention_ref
from lorapage.kernels.cpu_build import KV_DTYPES, cpu_kernels


def _c_layout(out: Tensor, q: Tensor, kv: Tensor, block_table: Tensor, context_lens: Tensor) -> bool:
    """Whether the C kernel reads these as they are: float32 q and out, pages in a dtype it reads
    (``KV_DTYPES``), each row's heads and each page's positions packed, int32 tables on the CPU."""
    return (
        q.dtype == out.dtype == torch.float32
        and kv.dtype in KV_DTYPES
        and q.device.type == out.device.type == kv.device.type == "cpu"
        and q.stride()[1:] == (q.shape[2], 1)
        and out.stride()[1:] == (out.shape[2], 1)
        and kv[0].is_contiguous()
        and block_table.dtype == context_lens.dtype == torch.int32
        and block_table.stride(1) == 1
        and context_lens.is_contiguous()
        and q.shape[1] % kv.shape[3] == 0
    )


def paged_decode_attention_cpu(
    out: Tensor,
    q: Tensor,
    kv: Tensor,
    block_table: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Same as :func:`paged_decode_attention_ref`: ``out[b] = softmax(cap(q[b] @ K_b.T * scale)) @ V_b``
    over the first ``context_lens[b]`` positions, the last ``window`` of them when given (GQA:
    query head h reads KV head ``h // (H / H_kv)``)."""
    lib = cpu_kernels()
    if lib is None or not decode_attention_c(lib, out, q, kv, block_table, context_lens, scale, window, softcap):
        paged_decode_attention_ref(out, q, kv, block_table, context_lens, scale, window, softcap)


def prefill_attention_cpu(
    out: Tensor,
    q: Tensor,
    kv: Tensor,
    block_table: Tensor,
    query_starts: list[int],
    context_lens: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Same as :func:`prefill_attention_ref`: sequence ``i``'s query rows ``query_starts[i] :
    query_starts[i + 1]``, the last of its ``context_lens[i]`` positions, each attending to the
    positions up to its own (the last ``window`` of them when given)."""
    lib = cpu_kernels()
    if lib is not None and q.shape[0] and block_table.dtype == torch.int32:
        seq: list[int] = []
        lens: list[int] = []
        for i, ctx in enumerate(context_lens):
            n = query_starts[i + 1] - query_starts[i]
            seq += [i] * n
            lens += range(ctx - n + 1, ctx + 1)
        tables = block_table[torch.tensor(seq, dtype=torch.int64)]  # each token's sequence's pages
        ends = torch.tensor(lens, dtype=torch.int32)
        if decode_attention_c(lib, out, q, kv, tables, ends, scale, window, softcap):
            return
    prefill_attention_ref(out, q, kv, block_table, query_starts, context_lens, scale, window, softcap)


def decode_attention_c(
    lib: ctypes.CDLL,
    out: Tensor,
    q: Tensor,
    kv: Tensor,
    block_table: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> bool:
    """The C kernel of ``lib`` into ``out``; False (``out`` untouched or partly written) where it
    cannot take these tensors or could not allocate its buffers."""
    if not _c_layout(out, q, kv, block_table, context_lens) or q.shape[0] == 0:
        return False
    rows, heads, dim = q.shape
    kernel = {
        torch.float32: lib.decode_attention_f32,
        torch.float16: lib.decode_attention_f16,
        torch.bfloat16: lib.decode_attention_bf16,
    }[kv.dtype]
    failed = kernel(
        out.data_ptr(),
        out.stride(0),
        q.data_ptr(),
        q.stride(0),
        kv.data_ptr(),
        kv.stride(0),
        kv.shape[2],  # block size
        kv.shape[3],  # KV heads
        dim,
        heads,
        block_table.data_ptr(),
        block_table.stride(0),
        context_lens.data_ptr(),
        rows,
        scale,
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    return not failed
