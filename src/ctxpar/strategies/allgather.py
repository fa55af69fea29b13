"""All-gather attention (Llama 3 style): every rank gathers all K/V and keeps its queries.

K/V are gathered in groups of KV heads (at most eight, ``strategy_rules.MAX_GATHERS``),
each group's gather posted before the previous group is computed, so transfers hide behind
compute; only the first group's gather is exposed, and no more than two groups' K/V of the
whole sequence are alive (three buffers for a moment: a group's arrival buffer until its
position-order copy replaces it, as the next gather is posted; docs/strategies.md)::

    KV heads, group 0:   gather ──wait──▶ compute (their query heads x all T keys)
    KV heads, group 1:          gather ─────────────wait──▶ compute
    ...

Eight groups bound what is alive (two groups of ceil(H_kv/8) heads, 2*ceil(H_kv/8)/H_kv of
the whole sequence's K/V: two eighths for multiples of 8; below 8, one KV head at a time,
the peak of gathering head by head) and the
synchronisation points (a rank descheduled at each costs its peers a wait); with four, the
measured peak at H_kv = 8 grew by 40-80% (docs/benchmarks.md).

The gathered shards arrive rank by rank. Where it takes fewer kernel calls (zigzag,
contiguous), they are put in global position order once, and a rank's queries attend to
the whole sequence through the tiles between its positions and 0..T-1: the few large calls
the unsplit computation would make (zigzag: two per query chunk), not one or two per
shard. Where it does not (striped, whose rows each see a different prefix of the ordered
keys), the tiles are taken against each rank's shard as it arrived. ``blocks.gathered_key_order``
asks the block plan for both and keeps the one with fewer tiles.

Backward gathers K/V again, computes dQ and this rank's share of every position's dK/dV
(fp32), puts that back in rank order and reduce-scatters it, so each rank receives the sum
for its own shard; each group's reduce-scatter overlaps the next group's compute.

Traffic per rank (S = T/P local length, e element size): forward (P-1)*2*B*H_kv*S*D*e;
backward (P-1)*2*B*H_kv*S*D*e for the re-gather plus (P-1)*2*B*H_kv*S*D*a for dK/dV
(a = 4, or 8 for float64: the accumulation dtype). Per head group: one gather forward;
one gather and one reduce-scatter backward.
"""

from __future__ import annotations

import functools

import torch

from ctxpar import profile
from ctxpar.blocks import gathered_key_order, to_device
from ctxpar.comm import PendingAllGather, PendingReduceScatter
from ctxpar.layout import Layout
from ctxpar.masks import Mask
from ctxpar.strategies.blockwise import (backward_tiles, finish_forward, first_order_only, forward_tiles,
                                         gradient_accumulators, output_accumulators, refuse_lse_gradient,
                                         saved_for_backward, sink_gradient, stacked_kv)
from ctxpar.strategy_rules import gather_group_heads
from ctxpar.topology import Topology


def head_groups(kv_heads: int) -> list[slice]:
    """The KV heads in at most ``strategy_rules.MAX_GATHERS`` equal groups, one gather each."""
    size = gather_group_heads(kv_heads)
    return [slice(start, min(start + size, kv_heads)) for start in range(0, kv_heads, size)]


@functools.lru_cache(maxsize=4)  # one (T,) int64 index on the device each
def _key_order(layout: Layout, seq_len: int, rank: int, mask: Mask, device: torch.device):
    """``gathered_key_order`` with its arrival index on ``device``, copied there once per plan
    (``blocks.to_device``: without a host synchronisation)."""
    kind, tiles, index = gathered_key_order(layout, seq_len, rank, mask)
    return kind, tiles, None if index is None else to_device(index, device)


def _arrange(gathered: torch.Tensor, order) -> torch.Tensor:
    """What the kernels read: the shards as they arrived (P, 2, B, h, S, D) for "by_rank",
    else one copy in position order (2, B, h, T, D); the arrival buffer can then go."""
    kind, _, index = order
    if kind == "by_rank":
        return gathered
    local = gathered.shape[4]
    return gathered.permute(1, 2, 3, 0, 4, 5)[:, :, :, index // local, index % local]


def _attend_forward(q, keys, order, acc_out, acc_lse, scale) -> None:
    """Merge attention to the gathered keys (``_arrange``d) into the accumulators."""
    kind, tiles, _ = order
    if kind == "by_rank":
        for src, src_tiles in enumerate(tiles):
            forward_tiles(q, keys[src, 0], keys[src, 1], src_tiles, acc_out, acc_lse, scale)
        return
    forward_tiles(q, keys[0], keys[1], tiles, acc_out, acc_lse, scale)


def _attend_backward(dout, q, keys, out, lse, order, scale, dq) -> torch.Tensor:
    """dQ into ``dq``; returns this rank's dK/dV share of every key, laid out like ``keys``:
    (P, 2, B, h, S, D) for "by_rank", (2, B, h, T, D) in position order for "global"."""
    kind, tiles, _ = order
    shares = torch.zeros(keys.shape, dtype=dq.dtype, device=dq.device)
    if kind == "by_rank":
        for src, src_tiles in enumerate(tiles):
            backward_tiles(dout, q, keys[src, 0], keys[src, 1], out, lse, src_tiles, scale, dq,
                           shares[src, 0], shares[src, 1])
    else:
        backward_tiles(dout, q, keys[0], keys[1], out, lse, tiles, scale, dq, shares[0], shares[1])
    return shares


def _by_arrival(shares: torch.Tensor, order, world: int) -> torch.Tensor:
    """Shares in rank order (P, 2, B, h, S, D), as the reduce-scatter takes them."""
    kind, _, index = order
    if kind == "by_rank":
        return shares
    two, b, h, t, d = shares.shape
    local = t // world
    arrived = shares.new_empty((world, two, b, h, local, d))
    arrived.permute(1, 2, 3, 0, 4, 5)[:, :, :, index // local, index % local] = shares
    return arrived


def _post_gather(k: torch.Tensor, v: torch.Tensor, heads: slice, group) -> PendingAllGather:
    """The gather of KV heads ``heads``, K and V stacked (2, B, h, S, D) in one copy (slicing
    a stack of all heads took a second copy to make each group's slice dense)."""
    return PendingAllGather(stacked_kv(k[:, heads], v[:, heads]), group)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, layout: Layout, group, rank: int, mask: Mask, scale: float):
        order = _key_order(layout, q.shape[2] * layout.world_size, rank, mask, q.device)
        g = q.shape[1] // k.shape[1]  # query heads per KV head
        acc_out, acc_lse = output_accumulators(q)  # (B, H, S, D), (B, H, S)
        groups = head_groups(k.shape[1])
        pending = _post_gather(k, v, groups[0], group)
        for i, kvh in enumerate(groups):
            keys = _arrange(pending.wait(), order)
            pending = _post_gather(k, v, groups[i + 1], group) if i + 1 < len(groups) else None
            qh = slice(kvh.start * g, kvh.stop * g)
            with profile.timed("compute", q.device):
                _attend_forward(q[:, qh], keys, order, acc_out[:, qh], acc_lse[:, qh], scale)
            del keys
        ctx.args = (group, order, scale, layout.world_size)
        return finish_forward(ctx, q, k, v, sinks, acc_out, acc_lse)

    @staticmethod
    @first_order_only
    def backward(ctx, dout, dlse):
        refuse_lse_gradient(dlse)
        q, k, v, sinks, out, lse = saved_for_backward(ctx)
        group, order, scale, world = ctx.args
        g = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        dq, dkv = gradient_accumulators(q, k)  # dkv: our shard's dK, dV, filled group by group
        groups = head_groups(k.shape[1])
        pending = _post_gather(k, v, groups[0], group)
        reducing = None  # (heads, PendingReduceScatter) of the previous group, still in flight
        for i, kvh in enumerate(groups):
            keys = _arrange(pending.wait(), order)
            pending = _post_gather(k, v, groups[i + 1], group) if i + 1 < len(groups) else None
            qh = slice(kvh.start * g, kvh.stop * g)
            with profile.timed("compute", q.device):
                shares = _attend_backward(dout[:, qh], q[:, qh], keys, out[:, qh], lse[:, qh], order, scale,
                                          dq[:, qh])
                del keys  # before the rank-order copy of the shares is made: one buffer fewer at the peak
                shares = _by_arrival(shares, order, world)
            if reducing is not None:
                dkv[:, :, reducing[0]] = reducing[1].wait()
            reducing = (kvh, PendingReduceScatter(shares, group))
            del shares
        dkv[:, :, reducing[0]] = reducing[1].wait()
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), sink_gradient(sinks, dout, out, lse),
                None, None, None, None, None)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    *,
    layout: Layout,
    topo: Topology,
    mask: Mask,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return AllGatherAttention.apply(q, k, v, sinks, layout, topo.group, topo.rank, mask, scale)
