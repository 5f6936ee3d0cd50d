"""The base model's dense projections on a CPU: oneDNN GEMMs over weights packed once at start-up.

``y = x @ W.T + b`` (the reference: ``torch.nn.functional.linear``). ``F.linear`` on a CPU calls
MKL's ``sgemm``, which re-lays ``W`` out into its panel format on every call and, on the AMD CPUs
these machines have, runs its AVX2 path whatever the ISA. oneDNN's linear over a weight reordered
once into its own blocked layout skips both: on a Zen 4 core, float32, the 512-wide bench model's
projections at 32 rows ran 1.3x faster on one thread and 2x on two (MKL's small GEMMs barely use a
second thread), the 4,096-row logits 1.4x / 2.8x; at 1-4 rows (a quiet server's decode) 2-3x.
Same products and sums in another order: results differ from ``F.linear`` by float rounding only.

A packed weight is an opaque oneDNN tensor (``Tensor.is_mkldnn``): the model keeps nothing else, so
code that edits a weight (merging an adapter into the base) unpacks it with :func:`dense_weight`
and stores the result with :func:`pack_weight` again.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger("lorapage.kernels")

_PACKED_DTYPES = (torch.float32,)  # what the cpu backend runs (bfloat16 models take the torch backend)


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build packs and runs oneDNN linears (checked once on a tiny weight
    against ``F.linear``; a build without oneDNN, or one whose op fails, keeps ``F.linear``)."""
    try:
        w, x = torch.randn(8, 16), torch.randn(3, 16)
        y = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [], ""
        )
        return bool(torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError) as exc:
        log.info("oneDNN linear unavailable (%s): the CPU projections run F.linear", exc)
        return False


def pack_weight(weight: Tensor) -> Tensor:
    """``weight`` [d_out, d_in] in oneDNN's layout for :func:`linear_cpu` where that runs (a CPU
    float32 weight and a torch with oneDNN), else ``weight`` itself."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES or not onednn_linear_available():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def dense_weight(weight: Tensor) -> Tensor:
    """A weight as a plain tensor: a packed one unpacked into a new tensor, any other as it is
    (``linear_int8.dense_weight`` dequantizes an int8 one too)."""
    return weight.to_dense() if weight.is_mkldnn else weight


def linear_cpu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [T, d_in]; a packed ``weight`` runs oneDNN's GEMM."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The reference and every other backend's projection: ``x @ weight.T + bias``."""
    return F.linear(x, weight, bias)


def keep_weight(weight: Tensor) -> Tensor:
    """The other backends' packing: none."""
    return weight
