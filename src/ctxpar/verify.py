"""Checking CP results against unsplit attention: the errors, and what counts as exact.

Used by the tests and by ``ctxpar demo``. Tolerances:

- float32: max |error| <= 1e-5 * max |reference| for each tensor; float64: 1e-12 *.
  For dq, dk, dv the scale is at least that of the largest of the three (a gradient
  that is exactly 0, as dq and dk are under a 1-key window, has rounding noise only).
- bfloat16 / float16: no worse than 2x the error that single-process attention in the
  same dtype makes against the float64 reference (``baseline``, from ``torch_sdpa``), plus the float32
  allowance so tensors a low-precision kernel happens to get exactly right don't turn
  into a zero tolerance.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ctxpar import kernels

TENSORS = ("out", "lse", "dq", "dk", "dv")
FP32_RTOL = 1e-5
FP64_RTOL = 1e-12
LOW_PRECISION_FACTOR = 2.0
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def unsplit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool, scale: float
) -> dict[str, torch.Tensor]:
    """Single-process attention over the whole sequence, forward and backward.

    Uses ctxpar's block kernels on one block (on CPU torch's fused op, on a GPU in float64
    ctxpar's tiled reference kernel: both memory-efficient, so T=16K in float64 fits).
    Returns out, lse, dq, dk, dv.
    """
    out, lse = kernels.attention_forward(q, k, v, causal=causal, scale=scale)
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def torch_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool, scale: float,
    mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """What a user gets from single-process ``F.scaled_dot_product_attention`` + autograd.

    This is the baseline for low-precision tolerances; lse, which SDPA does not return,
    comes from torch's fused forward op in the same dtype. ``mask``: an explicit (T, T)
    bool mask (documents, windows) in place of ``causal``.
    """
    kernels.check_heads(q, k, v)  # SDPA's own refusal is a RuntimeError
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                         enable_gqa=True)
    out.backward(dout)
    lse = kernels.attention_forward(q.detach(), k.detach(), v.detach(), causal=causal and mask is None, scale=scale,
                                    mask=mask)[1]
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)


def _check_results(what: str, results: dict[str, torch.Tensor]) -> None:
    """Refuse ``results`` without one of ``TENSORS`` or with an empty one, naming it (a bare
    KeyError, or torch's error from max() of nothing)."""
    missing = [name for name in TENSORS if name not in results]
    if missing:
        raise ValueError(f"{what} has no {', '.join(missing)}: it needs each of {', '.join(TENSORS)}, as "
                         f"unsplit_attention returns them")
    empty = [f"{name} {tuple(results[name].shape)}" for name in TENSORS if results[name].numel() == 0]
    if empty:
        raise ValueError(f"{what} has empty tensors ({', '.join(empty)}): there is nothing to measure")


def max_abs_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |got - ref| of each of ``TENSORS``, which must have the same shapes in both (torch
    would broadcast one row of ``got`` against every row of ``ref``, a plausible error).
    Equal values (infinities alike) differ by 0; a NaN on either side by inf, which no
    tolerance passes whichever way it is compared (a NaN error passed ``error > tol``)."""
    _check_results("got", got)
    _check_results("ref", ref)
    differ = [f"{name} {tuple(got[name].shape)} against {tuple(ref[name].shape)}" for name in TENSORS
              if got[name].shape != ref[name].shape]
    if differ:
        raise ValueError(f"got and ref differ in shape: {'; '.join(differ)}; compare them alike (a rank's shard "
                         f"against the reference sharded the same way, or the unsharded result)")
    return {name: _max_abs_error(got[name].double(), ref[name].double()) for name in TENSORS}


def _max_abs_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return torch.where(got == ref, 0.0, (got - ref).abs()).nan_to_num(nan=math.inf, posinf=math.inf).max().item()


def rounded_partials_on(block: torch.Tensor, world: int) -> int:
    """The partials ``tolerances`` allows for on ``world`` ranks when blocks like ``block``
    come back rounded to a low-precision dtype (``kernels.partial_dtype``): one per rank and
    the final rounding; 0 where blocks are computed and returned in float32 or wider."""
    return world + 1 if kernels.partial_dtype(block) in UNIT_ROUNDOFF else 0


def tolerances(
    dtype: torch.dtype, ref: dict[str, torch.Tensor], baseline: dict[str, float] | None = None,
    rounded_partials: int = 0,
) -> dict[str, float]:
    """Allowed max abs error per tensor; ``baseline`` = same-dtype unsplit errors (low precision).

    ``rounded_partials`` (``rounded_partials_on``): the partial results of a row the kernels
    round to ``dtype`` before they are merged or summed (GPU ops return each block's out and
    gradients in the input dtype); each is allowed one unit roundoff of the tensor's scale
    on out, dq, dk and dv. An allowance sized by the rank count, not a proven bound: a
    partial can exceed its merge, and a key's gradient can gather more partials than there
    are ranks (the all-gather in position order, windows). lse is never rounded (float32
    throughout), and float32 blocks not at all, so float32 cases hold the strategies'
    arithmetic to ``FP32_RTOL``."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"tolerances are for the floating dtype attention ran in, got {dtype!r}")
    _check_results("ref", ref)
    rtol = FP64_RTOL if dtype == torch.float64 else FP32_RTOL
    scale = {name: ref[name].double().abs().max().item() for name in TENSORS}
    gradients = max(scale["dq"], scale["dk"], scale["dv"])
    # a gradient that vanishes exactly (a 1-key window: every score's gradient is 0) is held
    # to the rounding scale of the others, not to a zero tolerance
    magnitude = {name: max(scale[name], gradients) if name in ("dq", "dk", "dv") else scale[name] for name in TENSORS}
    tol = {name: rtol * magnitude[name] for name in TENSORS}
    if dtype in (torch.bfloat16, torch.float16):
        if baseline is None:
            raise ValueError(f"{dtype} tolerances need the single-process baseline errors")
        if not all(math.isfinite(baseline[name]) for name in TENSORS):  # an infinite tolerance would pass anything
            raise ValueError(f"the single-process baseline's errors are not all finite ({baseline}): its {dtype} "
                             f"attention overflowed, so it sets no tolerance")
        roundoff = UNIT_ROUNDOFF[dtype] * rounded_partials
        tol = {name: LOW_PRECISION_FACTOR * baseline[name] + tol[name] + (name != "lse") * roundoff * magnitude[name]
               for name in TENSORS}
    return tol
