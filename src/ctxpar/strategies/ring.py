"""Ring attention: K/V shards travel around the ring while each rank attends to them.

Forward, P ranks, rank r, step i holds the K/V of rank s = (r - i) mod P::

    step 0      step 1      ...   step P-1
    kv[r]  -->  kv[r-1] -->  ...  kv[r+1]     (received from rank r-1, sent on to r+1)

At every step the transfer of the next shard is posted before the current shard is
computed, so communication hides behind compute when a block takes longer to compute
than to send. Partial (out, lse) are merged in float32 (float64 for float64 inputs).

Under documents or a window, what travels is what the mask lets someone see
(``RingSchedule``): a shard goes only as far round the ring as some rank still sees part
of it, and only the keys those ranks see are sent. A sliding window on the contiguous
layout sends each rank's last w-1 keys one hop (the halo) and stops the ring after
ceil((w-1)/S) steps. Plain (non-)causal attention sends every shard P-1 hops, whole: the
busiest rank sees every key it is sent in every layout, so trimming would only shorten
the transfers of ranks that wait for it anyway, at the cost of messages of many sizes.

Backward re-circulates K/V the same way and also circulates a dK/dV accumulator (in the
accumulation dtype: float32, or float64 for float64 inputs) for each shard: it starts on
rank s+1, collects each rank's share, and after the last step is sent straight back to
rank s, which adds its own share. dQ never moves.

Traffic per rank, plain masks (elements of size e, local length S = T/P):
    forward:  (P-1) * 2*B*H_kv*S*D*e    sent and received
    backward: (P-1) * 2*B*H_kv*S*D*(e + a),  a = 4 (8 for float64): the accumulator
Sliding window w on the contiguous layout, w-1 <= S, ranks 1..P-1 receive and 0..P-2 send:
    forward:  2*B*H_kv*(w-1)*D*e;   backward: 2*B*H_kv*(w-1)*D*(e + a)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ctxpar import profile
from ctxpar.blocks import Tile, tiles_between
from ctxpar.comm import RingComm, settled
from ctxpar.layout import Layout
from ctxpar.masks import Mask
from ctxpar.strategies.blockwise import (backward_tiles, finish_forward, first_order_only, forward_tiles,
                                         gradient_accumulators, output_accumulators, refuse_lse_gradient,
                                         saved_for_backward, sink_gradient, stacked_kv)
from ctxpar.topology import Topology

_KV_TAG, _DKV_TAG, _HOME_TAG = 0, 1, 2


@dataclass(frozen=True)
class RingSchedule:
    """Which keys travel, for every step and rank (the same on every rank), and this
    rank's tiles.

    steps: the last step at which some rank still sees keys of the shard it holds (the
        ring runs steps 0..steps; P-1 for plain masks).
    held[i][r]: (a, b), the keys a:b of shard (r - i) mod P that rank r holds at step i:
        what it and the ranks after it on the ring will see of that shard. Empty where
        nobody will.
    tiles[i]: this rank's tiles at step i, key indices counted from its a.
    """

    steps: int
    held: tuple[tuple[tuple[int, int], ...], ...]
    tiles: tuple[tuple[Tile, ...], ...]


@functools.lru_cache(maxsize=16)  # a mask with documents may change every batch: keep few schedules
def ring_schedule(layout: Layout, seq_len: int, mask: Mask, rank: int) -> RingSchedule:
    world, local = layout.world_size, seq_len // layout.world_size
    positions = [layout.positions(seq_len, r) for r in range(world)]
    if mask.is_plain:
        held = ((((0, local),) * world),) * world
        steps = world - 1
    else:
        seen = [[_seen(positions[r], positions[(r - i) % world], mask, seq_len) for r in range(world)]
                for i in range(world)]  # seen[i][r]: the keys rank r sees at step i
        steps = max((i for i in range(1, world) for r in range(world) if seen[i][r]), default=0)
        rows = [[(0, local)] * world]
        for i in range(1, steps + 1):  # the hull of what this rank and the later ones see
            row = []
            for r in range(world):
                later = [x for j in range(i, steps + 1) if (x := seen[j][(r + j - i) % world])]
                row.append((min(a for a, _ in later), max(b for _, b in later)) if later else (0, 0))
            rows.append(row)
        held = tuple(map(tuple, rows))
    tiles = tuple(tiles_between(positions[rank], positions[(rank - i) % world][a:b], mask, seq_len) if b > a else ()
                  for i, (a, b) in ((i, held[i][rank]) for i in range(steps + 1)))
    return RingSchedule(steps, held, tiles)


def _seen(q_positions: torch.Tensor, kv_positions: torch.Tensor, mask: Mask, seq_len: int) -> tuple[int, int] | None:
    """The hull (a, b) of the keys any of the queries sees, or None: from the mask's
    intervals directly, in O(S log S), without cutting tiles."""
    first, stop = mask.intervals(q_positions, seq_len)
    kv = kv_positions.to(torch.int64)
    lo, hi = torch.searchsorted(kv, first), torch.searchsorted(kv, stop)
    sees = hi > lo
    return (int(lo[sees].min()), int(hi[sees].max())) if bool(sees.any()) else None


def _keys(buf: torch.Tensor, held: tuple[int, int], part: tuple[int, int]) -> torch.Tensor:
    """The keys ``part`` of a shard, from ``buf`` holding its keys ``held`` (dim 3),
    contiguous: what is sent on."""
    if part == held:
        return buf
    return buf[:, :, :, part[0] - held[0]:part[1] - held[0]].contiguous()


def _buffer(like: torch.Tensor, held: tuple[int, int], dtype: torch.dtype | None = None) -> torch.Tensor:
    shape = (*like.shape[:3], held[1] - held[0], like.shape[4])
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


class RingAttention(torch.autograd.Function):
    """Inputs already validated by ``ctxpar.attention``; returns (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, layout: Layout, group, rank: int, mask: Mask, scale: float):
        world = layout.world_size
        plan = ring_schedule(layout, q.shape[2] * world, mask, rank)
        acc_out, acc_lse = output_accumulators(q)  # (B, H, S, D), (B, H, S)
        kv = stacked_kv(k, v)  # (2, B, H_kv, S, D): one message per step
        comm = RingComm(group, tag=_KV_TAG) if plan.steps else None
        with settled(comm):
            for step in range(plan.steps + 1):
                last = step == plan.steps
                if not last:  # send on what the next rank holds next step; receive ours
                    onward = _keys(kv, plan.held[step][rank], plan.held[step + 1][(rank + 1) % world])
                    arriving = _buffer(kv, plan.held[step + 1][rank])
                    comm.start(send=onward, recv=arriving)
                with profile.timed("compute", q.device):
                    forward_tiles(q, kv[0], kv[1], plan.tiles[step], acc_out, acc_lse, scale)
                if not last:
                    comm.wait()
                    kv = arriving
        ctx.plan, ctx.group, ctx.rank, ctx.scale = plan, group, rank, scale
        return finish_forward(ctx, q, k, v, sinks, acc_out, acc_lse)

    @staticmethod
    @first_order_only
    def backward(ctx, dout, dlse):
        refuse_lse_gradient(dlse)
        q, k, v, sinks, out, lse = saved_for_backward(ctx)
        plan, rank, scale = ctx.plan, ctx.rank, ctx.scale
        world, held, steps = len(plan.held[0]), plan.held, plan.steps
        dout = dout.contiguous()
        dq, own = gradient_accumulators(q, k)  # own: dK/dV of our own shard
        kv = stacked_kv(k, v)
        comms = (RingComm(ctx.group, tag=_KV_TAG), RingComm(ctx.group, tag=_DKV_TAG),
                 RingComm(ctx.group, tag=_HOME_TAG, shift=-steps)) if steps else ()
        kv_comm, dkv_comm, home_comm = comms or (None, None, None)
        # The accumulator for shard s starts on rank s+1 at step 1, covering the keys that
        # rank holds, held[1][s+1]; every later holder adds its share into its part of
        # it; after the last step it goes straight home. Traced for P = 3 on rank 0:
        #   step 0  shard 0: own += share
        #   step 1  shard 2: acc = share                                  -> rank 1
        #   step 2  shard 1: acc (from rank 2, started there at its step 1) += share
        #                                                                 -> rank 1 (home)
        #   end     the accumulator for shard 0 (started by rank 1, via rank 2) is added to own
        acc = incoming = None
        with settled(*comms):
            for step in range(steps + 1):
                last = step == steps
                if not last:
                    onward = _keys(kv, held[step][rank], held[step + 1][(rank + 1) % world])
                    arriving = _buffer(kv, held[step + 1][rank])
                    kv_comm.start(send=onward, recv=arriving)
                share = own if step == 0 else torch.zeros_like(kv, dtype=own.dtype)
                with profile.timed("compute", q.device):
                    backward_tiles(dout, q, kv[0], kv[1], out, lse, plan.tiles[step], scale, dq, share[0], share[1])
                if step == 1:
                    acc = share
                elif step >= 2:  # add our share to the accumulator arriving from rank-1
                    dkv_comm.wait()
                    acc = incoming
                    first = held[1][(rank - step + 1) % world][0]  # the keys acc covers start here
                    a, b = held[step][rank]
                    acc[:, :, :, a - first:b - first] += share
                if step >= 1:
                    if not last:  # the accumulator of shard rank-step-1 arrives next step
                        incoming = _buffer(kv, held[1][(rank - step) % world], own.dtype)
                        dkv_comm.start(send=acc, recv=incoming)
                    else:  # ours comes home from the rank that held it last
                        incoming = _buffer(kv, held[1][(rank + 1) % world], own.dtype)
                        home_comm.start(send=acc, recv=incoming)
                if not last:
                    kv_comm.wait()
                    kv = arriving
            if steps:  # our own shard's accumulator, after visiting every rank that sees it
                home_comm.wait()
                a, b = held[1][(rank + 1) % world]
                own[:, :, :, a:b] += incoming
        return (dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), sink_gradient(sinks, dout, out, lse),
                None, None, None, None, None)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, *, layout: Layout, topo: Topology,
    mask: Mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return RingAttention.apply(q, k, v, sinks, layout, topo.ring_group, topo.ring_rank, mask, scale)
