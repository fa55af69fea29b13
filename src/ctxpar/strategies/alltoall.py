"""All-to-all (DeepSpeed-Ulysses): trade the sequence split for a head split, and back.

    rank u holds all H heads of its S tokens                       q (B, H, S, D), k, v (B, H_kv', S, D)
        ── one all-to-all, q, k and v packed in one buffer ──▶
    rank u holds H/U heads of all U*S tokens, in position order    (B, H/U, U*S, D), (B, H_kv'/U, U*S, D)
        local attention over those tokens (the tiles of one ``UnionLayout`` rank)
        ── one all-to-all each for out and lse, posted together ──▶
    back to (B, H, S, D) and (B, H, S)

The backward is the mirror image: dout in (one all-to-all), dq, dk, dv out (one, packed).
``SeqToHeads`` and ``HeadsToSeq`` are those exchanges; the hybrid strategy puts the ring
between them instead of the local attention (``strategies/hybrid.py``).

GQA: K/V heads are split over the U ranks too. When H_kv is not a multiple of U each KV
head is sent f = U / gcd(H_kv, U) times (``strategy_rules.kv_copies``; autograd sums the
copies' gradients). The copies are real traffic and are counted.

Traffic per rank (S = T/P, e element size, H_kv' = H_kv*f; each all-to-all moves (U-1)/U
of its buffer): forward (U-1)/U * B*S*D*e*(2H + 2H_kv') plus the lse, (U-1)/U * B*S*H*a
(a = 4, 8 for float64); backward (U-1)/U * B*S*D*e*(2H + 2H_kv').
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from ctxpar import comm
from ctxpar.blocks import layout_tiles, to_device
from ctxpar.layout import Layout, UnionLayout
from ctxpar.masks import Mask
from ctxpar.strategies.blockwise import LocalAttention, refuse_lse_gradient
from ctxpar.strategy_rules import kv_copies
from ctxpar.topology import Topology


@functools.lru_cache(maxsize=16)  # two (U*S,) int64 on the device each
def _position_order(layout: Layout, seq_len: int, union: int, u: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, loc), each (U*S,) on ``device``: the tokens of union ``union`` (ranks union*U ..
    union*U+U-1) arrive rank by rank; the token at ascending position t is local index loc[t]
    of member src[t]. Cached: the same for every layer, and copied to the device once
    (``blocks.to_device``: without a host synchronisation)."""
    members = range(union * u, (union + 1) * u)
    arrival = torch.cat([layout.positions(seq_len, m) for m in members])
    order = torch.argsort(arrival)  # arrival slot of each token, in position order
    local = seq_len // layout.world_size
    return to_device(order // local, device), to_device(order % local, device)


class SeqToHeads(torch.autograd.Function):
    """(q, k, v) of this rank's tokens -> H/U heads of the union's tokens, position order."""

    @staticmethod
    def forward(ctx, q, k, v, group, u: int, src: torch.Tensor, loc: torch.Tensor):
        b, h, s, d = q.shape
        hq, hk = h // u, k.shape[1] // u
        send = q.new_empty((u, b, hq + 2 * hk, s, d))  # chunk j: member j's heads of q, k, v
        send[:, :, :hq] = q.unflatten(1, (u, hq)).transpose(0, 1)
        send[:, :, hq:hq + hk] = k.unflatten(1, (u, hk)).transpose(0, 1)
        send[:, :, hq + hk:] = v.unflatten(1, (u, hk)).transpose(0, 1)
        (recv,) = comm.all_to_all(send, group=group)  # (U, B, C, S, D): chunk j holds member j's tokens
        ctx.group, ctx.u, ctx.src, ctx.loc, ctx.heads = group, u, src, loc, (hq, hk)
        tokens = recv.permute(1, 2, 0, 3, 4)[:, :, src, loc]  # (B, C, U*S, D), position order
        return tokens[:, :hq], tokens[:, hq:hq + hk], tokens[:, hq + hk:]

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        (hq, hk), u, src, loc = ctx.heads, ctx.u, ctx.src, ctx.loc
        b, _, t, d = dq.shape
        send = dq.new_empty((u, b, hq + 2 * hk, t // u, d))  # back in arrival order, chunk j for member j
        by_arrival = send.permute(1, 2, 0, 3, 4)
        by_arrival[:, :hq, src, loc] = dq
        by_arrival[:, hq:hq + hk, src, loc] = dk
        by_arrival[:, hq + hk:, src, loc] = dv
        (recv,) = comm.all_to_all(send, group=ctx.group)  # chunk j: member j's heads of our tokens
        heads = lambda part: part.transpose(0, 1).flatten(1, 2)  # noqa: E731  (U, B, h, S, D) -> (B, U*h, S, D)
        return (heads(recv[:, :, :hq]), heads(recv[:, :, hq:hq + hk]), heads(recv[:, :, hq + hk:]),
                None, None, None, None)


class HeadsToSeq(torch.autograd.Function):
    """(out, lse) for H/U heads of the union's tokens -> all H heads of this rank's tokens."""

    @staticmethod
    def forward(ctx, out, lse, group, u: int, src: torch.Tensor, loc: torch.Tensor):
        b, hq, t, d = out.shape
        send_out = out.new_empty((u, b, hq, t // u, d))
        send_out.permute(1, 2, 0, 3, 4)[:, :, src, loc] = out
        send_lse = lse.new_empty((u, b, hq, t // u))
        send_lse.permute(1, 2, 0, 3)[:, :, src, loc] = lse
        recv_out, recv_lse = comm.all_to_all(send_out, send_lse, group=group)
        ctx.group, ctx.u, ctx.src, ctx.loc = group, u, src, loc
        ctx.set_materialize_grads(False)  # an lse nobody differentiated arrives as None
        return recv_out.transpose(0, 1).flatten(1, 2), recv_lse.transpose(0, 1).flatten(1, 2)  # (B, H, S, D), (B, H, S)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        refuse_lse_gradient(dlse)
        b, h, s, d = dout.shape
        send = dout.unflatten(1, (ctx.u, h // ctx.u)).transpose(0, 1).contiguous()  # chunk j: member j's heads
        (recv,) = comm.all_to_all(send, group=ctx.group)  # (U, B, H/U, S, D): chunk j holds member j's tokens
        return recv.permute(1, 2, 0, 3, 4)[:, :, ctx.src, ctx.loc], None, None, None, None, None


def local_sinks(sinks: torch.Tensor | None, topo: Topology) -> torch.Tensor | None:
    """The sinks of the H/U query heads ``SeqToHeads`` gives this rank (member j gets heads
    j*H/U .. (j+1)*H/U - 1), differentiable."""
    if sinks is None:
        return None
    heads = sinks.shape[0] // topo.ulysses_degree
    return sinks[topo.ulysses_rank * heads:(topo.ulysses_rank + 1) * heads]


def to_heads(q, k, v, layout: Layout, topo: Topology):
    """The all-to-all into the union of this rank's Ulysses ranks (KV heads copied as needed)."""
    u, seq_len = topo.ulysses_degree, q.shape[2] * layout.world_size
    copies = kv_copies(k.shape[1], u)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    src, loc = _position_order(layout, seq_len, topo.ring_rank, u, q.device)
    return SeqToHeads.apply(q, k, v, topo.ulysses_group, u, src, loc), (topo.ulysses_group, u, src, loc)


def alltoall_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, *, layout: Layout, topo: Topology,
    mask: Mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    (ql, kl, vl), exchange = to_heads(q, k, v, layout, topo)
    seq_len = q.shape[2] * layout.world_size
    tiles = layout_tiles(UnionLayout(1, layout, topo.ulysses_degree), seq_len, 0, 0, mask)
    out, lse = LocalAttention.apply(ql, kl, vl, local_sinks(sinks, topo), tiles, scale)  # (B, H/U, T, D), (B, H/U, T)
    return HeadsToSeq.apply(out, lse, *exchange)
