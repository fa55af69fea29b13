"""torch's fused attention ops for one block: (out, lse) forward, and backward from lse.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), which
takes K/V with fewer heads than Q (GQA) directly and returns a float32 lse for every
dtype. Its backward recomputes probabilities as exp(q k^T * scale - lse) and uses
rowsum(dout * out) as delta, so handing it the merged, global (out, lse) yields this
block's exact share of the gradient.
"""

from __future__ import annotations

import torch

_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def supports(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _cpu_fwd(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


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
    # The op wants lse in its own accumulation dtype: float64 for float64 inputs.
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    return _cpu_bwd(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
