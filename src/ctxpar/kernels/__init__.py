"""Local attention on one block of queries and keys, and its backward.

The contract every backend meets (shapes as in ``scaled_dot_product_attention``):

    attention_forward(q, k, v, *, causal, scale, mask=None) -> (out, lse)
        q (B, H, Sq, D), k and v (B, H_kv, Sk, D) with H % H_kv == 0 (GQA: K/V keep
        their own heads, nothing is repeated before a backend sees them; other heads are
        refused with a ValueError by every backend, ``check_heads``), causal =
        square top-left mask (Sq == Sk, query i sees keys 0..i); mask = an explicit
        (Sq, Sk) bool mask, True where the key is visible (a PARTIAL tile; then causal
        is False). A row that sees no key, or whose visible keys all score -inf, gets
        out 0 and lse -inf (it merges as nothing). lse (B, H, Sq) is the
        natural log of the sum of exp(scaled scores), in float32 or wider
        (``accumulation_dtype``); out (B, H, Sq, D) in the accumulation dtype, or in q's
        dtype where a GPU op writes it so (merging stays in float32 either way).

    attention_backward(dout, q, k, v, out, lse, *, causal, scale, mask=None) -> (dq, dk, dv)
        out and lse are the *global* merged values for these query rows, so the block
        gradients of all blocks add up to the exact gradient; a row with no mass anywhere
        comes with lse +inf (``strategies.blockwise.saved_for_backward``), so that its
        probabilities exp(s - lse) are 0. dk, dv have H_kv heads.
        Gradients come in the accumulation dtype on CPU (partial results are summed over
        blocks before anything is rounded to a low-precision dtype), in q's dtype from
        the GPU ops; strategies sum them in float32 accumulators.

Inputs may have any strides: ``unit_stride`` makes what the fused ops need (a dense
last dim); callers apply it once per shard so that per-block calls copy nothing.

Backends, chosen by device:
    ``cpu``        torch's fused CPU flash op (every dtype, computed in float32 or wider)
    ``cuda``       torch's CUDA flash / efficient ops; the tiled reference for the rest
    ``reference``  plain PyTorch, tiled (bounded memory); other devices
"""

from __future__ import annotations

import torch

from ctxpar.kernels import cpu, cuda, reference
from ctxpar.kernels.contract import accumulation_dtype, check_heads, unit_stride


def _backend(q: torch.Tensor):
    if q.device.type == "cpu":
        return cpu
    if q.device.type == "cuda":
        return cuda
    return reference


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backend(q).attention_forward(q, k, v, causal=causal, scale=scale, mask=mask)


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
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backend(q).attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask)


def partial_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype a block's out and gradients come back in for blocks like ``q``: the
    accumulation dtype, or q's where a GPU op writes them so (each block then rounded once
    before the strategies merge and sum blocks)."""
    return cuda.partial_dtype(q) if q.device.type == "cuda" else accumulation_dtype(q.dtype)


__all__ = ["accumulation_dtype", "attention_forward", "attention_backward", "check_heads", "cpu", "cuda",
           "partial_dtype", "reference", "unit_stride"]
