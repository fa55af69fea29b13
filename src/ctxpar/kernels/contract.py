"""What every kernel backend takes and gives, shared by all of them (see ``ctxpar.kernels``)."""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged and summed in: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse K/V heads that q's heads do not group evenly (H a multiple of H_kv, k and v alike).

    torch's fused CPU op divides by H // H_kv: where H_kv > H it stops the interpreter with
    SIGFPE, and H=3 against H_kv=2 returns a result without an error. Three shape
    reads per block, so every backend checks its own inputs.
    """
    h, h_k, h_v = q.shape[1], k.shape[1], v.shape[1]
    if h_k != h_v or h_k < 1 or h % h_k:
        kv = f"k and v have {h_k}" if h_k == h_v else f"k has {h_k} and v {h_v}"
        raise ValueError(f"q has {h} heads and {kv}: k and v need one number of heads H_kv >= 1 that divides q's "
                         f"H (GQA: H % H_kv == 0); give k and v such heads")


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last dim alone is dense (stride 1), else a contiguous copy.

    torch's fused ops read the last dim as dense whatever its stride says: q, k, v unbound
    from an interleaved qkv projection (last-dim stride 3) would silently give wrong
    results. Nor may another dim have stride 1, whatever its size (rows or heads one element
    apart, overlapping, as ``Tensor.unfold`` makes them; a size-1 dim of stride 1 beside an
    expanded one): the CPU op misreads those too. Other strides are fine (transposed, sliced,
    expanded views).
    """
    if t.shape[-1] == 1:
        return t
    return t if t.stride(-1) == 1 and 1 not in t.stride()[:-1] else t.contiguous()
