"""Plain-PyTorch attention: the fp64 truth for tests, and the kernel of last resort.

``reference_attention`` is attention by definition, differentiable by autograd; tests run
it in float64 as the ground truth. ``attention_forward`` / ``attention_backward`` meet the
kernel contract for dtypes and devices without a fused op (float64 on CUDA, head dims the
fused ops refuse, devices other than CPU and CUDA). They work tile by tile, so that no call
holds more than one (tile x tile) block of scores per head, however long the sequence:

    keys ->   tile 0   tile 1   tile 2
    q tile 0  [\\ ]                        causal: tiles above the diagonal are skipped,
    q tile 1  [##]     [\\ ]               diagonal tiles masked, the rest full
    q tile 2  [##]     [##]     [\\ ]
"""

from __future__ import annotations

import math

import torch

from ctxpar.kernels.contract import accumulation_dtype, check_heads
from ctxpar.masks import Mask
from ctxpar.merge import merge_into

SCORE_BUDGET_BYTES = 256 * 2**20  # one tile's scores for all (B, H) at once


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H_kv, G, S, D): query heads grouped by the KV head they use."""
    b, h, s, d = q.shape
    return q.view(b, num_kv_heads, h // num_kv_heads, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(q, k.shape[1]), k) * scale  # (B, H_kv, G, Sq, Sk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _causal_mask(q_positions: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
    """(Sq, Sk) bool, True where the key is visible (its position <= the query's)."""
    return kv_positions.unsqueeze(0) <= q_positions.unsqueeze(1)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    mask: Mask | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsplit attention by definition, differentiable by autograd (use float64 for truth).

    Args:
        q: (B, H, Sq, D); k, v: (B, H_kv, Sk, D) with H % H_kv == 0.
        causal: mask key positions greater than the query position.
        q_positions, kv_positions: global positions (default 0..S-1) that define the mask.
        mask: documents / window (``ctxpar.masks.Mask``, over a row of Sk tokens); replaces
            ``causal`` when given.
        sinks: (H,) per-head sink logits: one more term exp(sink) in every row's softmax
            denominator, with no value (gpt-oss).

    Returns:
        out (B, H, Sq, D) and lse (B, H, Sq), the sink included in lse; rows with no
        visible key (and no sink) give out 0 and lse -inf. Memory: the whole (Sq, Sk)
        score matrix per head.
    """
    check_heads(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qp = torch.arange(q.shape[2], device=q.device) if q_positions is None else q_positions.to(q.device)
    kp = torch.arange(k.shape[2], device=q.device) if kv_positions is None else kv_positions.to(q.device)
    visible = None
    if mask is not None:
        visible = mask.visible(qp.cpu(), kp.cpu(), k.shape[2]).to(q.device)
    elif causal:
        visible = _causal_mask(qp, kp)
    s = _scores(q, k, scale, visible)  # (B, H_kv, G, Sq, Sk)
    if sinks is not None:
        sink = sinks.to(s.dtype).view(1, k.shape[1], -1, 1, 1).expand(*s.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)  # (B, H_kv, G, Sq); -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v)
    return out.flatten(1, 2), lse.flatten(1, 2)


def tile_size(batch: int, heads: int, elem: int) -> int:
    """Rows (and columns) of a score tile such that all B*H tiles fit in ``SCORE_BUDGET_BYTES``."""
    return max(16, math.isqrt(SCORE_BUDGET_BYTES // max(1, batch * heads * elem)))


def _tiles(n: int, tile: int) -> list[slice]:
    return [slice(i, min(i + tile, n)) for i in range(0, n, tile)]


def _tile_mask(qs: slice, ks: slice, causal: bool, mask: torch.Tensor | None, device: torch.device
               ) -> torch.Tensor | None:
    """The causal or explicit mask restricted to one tile; None when the tile is fully visible."""
    if mask is not None:
        return mask[qs, ks].to(device)
    if not causal or ks.stop - 1 <= qs.start:
        return None
    return _causal_mask(torch.arange(qs.start, qs.stop, device=device), torch.arange(ks.start, ks.stop, device=device))


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel contract (see ``ctxpar.kernels``): out and lse in the accumulation dtype."""
    check_heads(q, k, v)
    c = accumulation_dtype(q.dtype)
    q, k, v = q.to(c), k.to(c), v.to(c)
    out = torch.zeros(q.shape, dtype=c, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=c, device=q.device)
    tile = tile_size(q.shape[0], q.shape[1], q.element_size())
    for qs in _tiles(q.shape[2], tile):
        for ks in _tiles(k.shape[2], tile):
            if causal and ks.start > qs.stop - 1:
                break  # this and every later key tile is above the diagonal
            s = _scores(q[:, :, qs], k[:, :, ks], scale, _tile_mask(qs, ks, causal, mask, q.device))
            tile_lse = torch.logsumexp(s, dim=-1)  # (B, H_kv, G, tq)
            p = torch.exp(s - torch.where(torch.isneginf(tile_lse), 0.0, tile_lse).unsqueeze(-1))
            tile_out = torch.einsum("bhgqk,bhkd->bhgqd", p, v[:, :, ks]).flatten(1, 2)
            merge_into(out[:, :, qs], lse[:, :, qs], tile_out, tile_lse.flatten(1, 2))
    return out, lse


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
    """Gradients of one block given the *global* (out, lse) of the whole attention.

    With P = exp(s - lse_global) the block's slice of the global probabilities and
    delta = rowsum(dout * out_global), dS = P * (dout v^T - delta); the per-block
    (dq, dk, dv) then simply add up over blocks, and so do the per-tile ones here.
    """
    check_heads(q, k, v)
    kv_heads, c = k.shape[1], accumulation_dtype(q.dtype)
    q, k, v, dout = q.to(c), k.to(c), v.to(c), dout.to(c)
    delta = (dout * out.to(c)).sum(-1, keepdim=True)  # (B, H, Sq, 1)
    dq = torch.zeros(q.shape, dtype=c, device=q.device)
    dk = torch.zeros(k.shape, dtype=c, device=q.device)
    dv = torch.zeros(v.shape, dtype=c, device=q.device)
    tile = tile_size(q.shape[0], q.shape[1], q.element_size())
    for qs in _tiles(q.shape[2], tile):
        do = _grouped(dout[:, :, qs], kv_heads)
        qg = _grouped(q[:, :, qs], kv_heads)
        d = _grouped(delta[:, :, qs], kv_heads)
        row_lse = _grouped(lse[:, :, qs].to(c).unsqueeze(-1), kv_heads)
        for ks in _tiles(k.shape[2], tile):
            if causal and ks.start > qs.stop - 1:
                break
            s = _scores(q[:, :, qs], k[:, :, ks], scale, _tile_mask(qs, ks, causal, mask, q.device))
            p = torch.exp(s - row_lse)  # (B, H_kv, G, tq, tk)
            dv[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", p, do)
            ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", do, v[:, :, ks]) - d) * scale
            dq[:, :, qs] += torch.einsum("bhgqk,bhkd->bhgqd", ds, k[:, :, ks]).flatten(1, 2)
            dk[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qg)
    return dq, dk, dv
