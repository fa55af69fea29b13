"""torch's fused attention ops for one block: (out, lse) forward, and backward from lse.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), which
takes K/V with fewer heads than Q (GQA) directly. Its backward recomputes probabilities as exp(q k^T * scale - lse) and uses
rowsum(dout * out) as delta, so handing it the merged, global (out, lse) yields this
block's exact share of the gradient.

bfloat16 / float16 blocks are computed in float32 (inputs upcast per block, a copy of
O(S*D) against O(S^2*D) work). Rounding each block's output and dK/dV to bf16 before
they are merged and summed over P blocks would add P roundings to the one that
single-process attention makes; K/V still travel between ranks in bf16.

The op reads the last dim as dense whatever its stride says: q, k, v unbound from an
interleaved qkv projection (last-dim stride 3) silently give wrong results. Every tensor
handed to it goes through ``unit_stride`` (a no-op for tensors strategies already made
dense once per shard).
"""

from __future__ import annotations

import torch

from ctxpar.kernels.reference import accumulation_dtype

_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def supports(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last dim is dense (stride 1), else a contiguous copy. Other dims may
    have any stride (transposed, sliced, expanded views are fine for the op)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _prepare(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the op needs: the accumulation dtype and a dense last dim."""
    c = accumulation_dtype(tensors[0].dtype)
    return tuple(unit_stride(t.to(c)) for t in tensors)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _cpu_fwd(*_prepare(q, k, v), 0.0, causal, scale=scale)
    return out, lse.to(out.dtype)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout, q, k, v, out, lse = _prepare(dout, q, k, v, out, lse)
    return _cpu_bwd(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
