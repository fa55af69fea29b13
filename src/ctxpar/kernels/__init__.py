"""Local attention on one block of queries and keys, and its backward.

The contract every backend meets (shapes as in ``scaled_dot_product_attention``):

    attention_forward(q, k, v, *, causal, scale) -> (out, lse)
        q (B, H, Sq, D), k and v (B, H_kv, Sk, D) with H % H_kv == 0 (GQA: K/V keep
        their own heads, nothing is repeated), causal = square top-left mask
        (Sq == Sk, query i sees keys 0..i). out (B, H, Sq, D) and lse (B, H, Sq),
        the natural log of the sum of exp(scaled scores), both in
        ``accumulation_dtype(q.dtype)``: float32, or float64 for float64 inputs.

    attention_backward(dout, q, k, v, out, lse, *, causal, scale) -> (dq, dk, dv)
        out and lse are the *global* merged values for these query rows, so the block
        gradients of all blocks add up to the exact gradient. dk, dv have H_kv heads.
        Gradients come in the accumulation dtype like out: partial results are
        merged and summed over blocks before anything is rounded to a low-precision
        dtype.

Inputs may have any strides. ``unit_stride`` makes what the fused op needs (a dense
last dim); callers apply it once per shard so that per-block calls copy nothing.

Dispatch: torch's fused CPU flash op where it applies; the plain-PyTorch kernel
(``reference``) otherwise, which is exact but materialises the (Sq, Sk) scores.
"""

from __future__ import annotations

import torch

from ctxpar.kernels import reference, sdpa
from ctxpar.kernels.reference import accumulation_dtype
from ctxpar.kernels.sdpa import unit_stride


def _backend(q: torch.Tensor):
    return sdpa if sdpa.supports(q) else reference


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backend(q).attention_forward(q, k, v, causal=causal, scale=scale)


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
    return _backend(q).attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


__all__ = ["accumulation_dtype", "attention_forward", "attention_backward", "reference", "unit_stride"]
