"""Plain-PyTorch attention: the fp64 reference for tests, and the fallback kernel.

Nothing here is fused: scores are materialised, so memory is O(Sq * Sk) per head.
Tests run it in float64 as the ground truth; the kernel dispatcher uses it for
devices or dtypes without a fused op.
"""

from __future__ import annotations

import torch


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H_kv, G, S, D): query heads grouped by the KV head they use."""
    b, h, s, d = q.shape
    return q.view(b, num_kv_heads, h // num_kv_heads, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(q, k.shape[1]), k) * scale  # (B, H_kv, G, Sq, Sk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _causal_mask(
    sq: int, sk: int, device: torch.device, q_positions: torch.Tensor | None, kv_positions: torch.Tensor | None
) -> torch.Tensor:
    """(Sq, Sk) bool, True where the key is visible; default positions give a square tril."""
    qp = torch.arange(sq, device=device) if q_positions is None else q_positions.to(device)
    kp = torch.arange(sk, device=device) if kv_positions is None else kv_positions.to(device)
    return kp.unsqueeze(0) <= qp.unsqueeze(1)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are computed, merged and summed in: >= float32."""
    return torch.promote_types(dtype, torch.float32)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel contract (see ``ctxpar.kernels``)."""
    c = accumulation_dtype(q.dtype)
    return reference_attention(q.to(c), k.to(c), v.to(c), causal=causal, scale=scale)


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
    """Gradients of one block given the *global* (out, lse) of the whole attention.

    With P = exp(s - lse_global) the block's slice of the global probabilities and
    delta = rowsum(dout * out_global), dS = P * (dout v^T - delta); the per-block
    (dq, dk, dv) then simply add up over blocks.
    """
    kv_heads, c = k.shape[1], accumulation_dtype(q.dtype)
    q, k, v = q.to(c), k.to(c), v.to(c)
    mask = _causal_mask(q.shape[2], k.shape[2], q.device, None, None) if causal else None
    s = _scores(q, k, scale, mask)
    p = torch.exp(s - _grouped(lse.to(s.dtype).unsqueeze(-1), kv_heads))  # (B, H_kv, G, Sq, Sk)
    do = _grouped(dout.to(s.dtype), kv_heads)
    delta = (do * _grouped(out.to(s.dtype), kv_heads)).sum(-1, keepdim=True)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", do, v) - delta) * scale
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k).flatten(1, 2)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, _grouped(q, kv_heads))
    return dq, dk, dv


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsplit attention by definition, differentiable by autograd (use float64 for truth).

    Args:
        q: (B, H, Sq, D); k, v: (B, H_kv, Sk, D) with H % H_kv == 0.
        causal: mask key positions greater than the query position.
        q_positions, kv_positions: global positions (default 0..S-1) that define the mask.

    Returns:
        out (B, H, Sq, D) and lse (B, H, Sq); rows with no visible key give out 0 and
        lse -inf.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = _causal_mask(q.shape[2], k.shape[2], q.device, q_positions, kv_positions) if causal else None
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # (B, H_kv, G, Sq); -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v)
    return out.flatten(1, 2), lse.flatten(1, 2)
