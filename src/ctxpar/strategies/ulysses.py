"""All-to-all (DeepSpeed-Ulysses) and the 2D hybrid (all-to-all inside, ring across).

Ulysses trades the sequence split for a head split with one all-to-all per tensor::

    rank u holds all H heads of its S tokens      (B, H, S, D)
        ── all-to-all over U ranks ──▶
    rank u holds H/U heads of all U*S tokens      (B, H/U, U*S, D)

then attends locally and sends the output back the same way. The U*S gathered tokens
are put in ascending global position, so the causal mask is the layout's. With a ring
degree R > 1 (hybrid, P = U*R), the gathered tokens are one shard of the
``UnionLayout`` over the R Ulysses groups, and ring attention over the "ring" mesh
dim replaces the local attention: this module only adds the all-to-alls around the
ring strategy.

GQA: K/V heads are split over the U ranks too. When H_kv is not a multiple of U, each
KV head is repeated f = U / gcd(H_kv, U) times before the all-to-all (the fewest copies
that make H_kv*f a multiple of U); autograd sums the copies' gradients. The copies are
real traffic and are counted.

Traffic per rank, all-to-all only (S = T/P, e element size, H_kv' = H_kv*f; each
all-to-all moves (U-1)/U of its tensor): forward q, k, v in and out back,
(U-1)/U * B*S*D*e*(2H + 2H_kv') plus the lse back, (U-1)/U * B*S*H*a (a = 4, 8 for float64);
backward dout in,
dq, dk, dv back, (U-1)/U * B*S*D*e*(2H + 2H_kv').
"""

from __future__ import annotations

import functools

import torch

from ctxpar import comm
from ctxpar.layout import UnionLayout, Layout
from ctxpar.strategies.ring import RingAttention
from ctxpar.strategy_rules import kv_copies
from ctxpar.topology import Topology


class _AllToAll(torch.autograd.Function):
    """``comm.all_to_all`` whose backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return comm.all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return comm.all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


@functools.lru_cache(maxsize=256)
def _arrival_order(layout: Layout, seq_len: int, ring_rank: int, u: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, restore): the gathered tokens arrive member by member; ``order`` sorts them
    into global position order and ``restore`` undoes it. Cached: the same every layer."""
    members = range(ring_rank * u, (ring_rank + 1) * u)
    order = torch.argsort(torch.cat([layout.positions(seq_len, m) for m in members]))
    return order, torch.argsort(order)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout, topo: Topology, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    u, group = topo.ulysses_degree, topo.ulysses_group
    copies = kv_copies(k.shape[1], u)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)

    order, restore = (t.to(q.device) for t in _arrival_order(layout, q.shape[2] * layout.world_size,
                                                            topo.ring_rank, u))

    def seq_to_heads(x: torch.Tensor) -> torch.Tensor:  # (B, H, S, D) -> (B, H/U, U*S, D), ascending
        return _AllToAll.apply(x, 1, 2, group).index_select(2, order)

    inner = UnionLayout(topo.ring_degree, layout, u)
    out, lse = RingAttention.apply(
        seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), inner, topo.ring_group, topo.ring_rank, causal, scale
    )  # (B, H/U, U*S, D), (B, H/U, U*S)
    out = _AllToAll.apply(out.index_select(2, restore), 2, 1, group)  # (B, H, S, D)
    with torch.no_grad():
        lse = comm.all_to_all(lse.index_select(2, restore).unsqueeze(-1), 2, 1, group).squeeze(-1)
    return out, lse
