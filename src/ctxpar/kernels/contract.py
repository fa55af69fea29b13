"""What every kernel backend takes and gives, shared by all of them (see ``ctxpar.kernels``)."""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged and summed in: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last dim is dense (stride 1), else a contiguous copy.

    torch's fused ops read the last dim as dense whatever its stride says: q, k, v unbound
    from an interleaved qkv projection (last-dim stride 3) would silently give wrong
    results. Other dims may have any stride (transposed, sliced, expanded views are fine).
    """
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
