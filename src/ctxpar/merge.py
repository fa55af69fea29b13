"""Exact combination of partial attention results (the online-softmax merge).

A kernel that attended to one block of keys returns its normalised output ``o_b`` and
log-sum-exp ``lse_b`` per query row. Two partials over disjoint key sets combine as

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

which is the same identity as m = max(m_a, m_b), l = l_a e^(m_a-m) + l_b e^(m_b-m).
Both exponents are <= 0, so nothing overflows. A row that has seen no key carries
lse = -inf and output 0; merging two such rows must give (0, -inf), not NaN, so the
weights are computed against a finite stand-in for lse in that case.

Non-finite inputs: a row with a +inf (or NaN) score has no defined softmax. Its merged
lse is +inf, never NaN, and its output NaN. A NaN lse would make the backward's
probabilities exp(s - lse) NaN for every key the row sees, poisoning dV at all of them;
with +inf they are 0 at finite scores and NaN only at the keys that caused it, which is
what single-process attention gives (docs/reliability.md).
"""

from __future__ import annotations

import torch


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partials over disjoint keys.

    Args:
        out_a, out_b: (..., S, D) partial outputs, each normalised over its own keys.
        lse_a, lse_b: (..., S) log-sum-exp of the scaled scores; -inf = no keys.

    Returns:
        (out, lse), shapes (..., S, D) and (..., S), in float32 or wider.
    """
    acc = torch.promote_types(out_a.dtype, torch.float32)
    acc_out, acc_lse = out_a.to(acc, copy=True), lse_a.to(acc, copy=True)
    merge_into(acc_out, acc_lse, out_b, lse_b)
    return acc_out, acc_lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In-place ``merge``: fold partial (out_b, lse_b) into the (float32 or wider) accumulators.

    ``acc_out`` (..., S, D) and ``acc_lse`` (..., S) may be views (slices along S of a
    larger accumulator); they are updated through the view. Start them at 0 and -inf.
    """
    inf = float("inf")
    lse = torch.logaddexp(acc_lse, lse_b).nan_to_num_(nan=inf, posinf=inf, neginf=-inf)  # "Non-finite inputs"
    # lse is -inf only where both are: any finite stand-in gives both weights exp(-inf) = 0
    ref = lse.clamp_min(torch.finfo(lse.dtype).min)
    acc_out.mul_(torch.sub(acc_lse, ref).exp_().unsqueeze(-1))
    acc_out.add_(torch.sub(lse_b, ref).exp_().unsqueeze(-1) * out_b)
    acc_lse.copy_(lse)


def merge_packed(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partials packed as (P, ..., S, D+1): each one's output in the first D columns
    and its lse in the last. Merged in index order, so every rank holding the same stack gets
    the same bits. Returns (out (..., S, D), lse (..., S)) in the stack's dtype."""
    if parts.dim() < 3 or parts.shape[0] == 0 or parts.shape[-1] < 2:
        raise ValueError(f"merge_packed takes a stack (P >= 1, ..., S, D+1 >= 2) of packed partials, got shape "
                         f"{tuple(parts.shape)}")
    out, lse = parts[0, ..., :-1].clone(), parts[0, ..., -1].clone()
    for part in parts[1:]:
        merge_into(out, lse, part[..., :-1], part[..., -1])
    return out, lse

