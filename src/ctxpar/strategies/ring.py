"""Ring attention: K/V shards travel around the ring while each rank attends to them.

Forward, P ranks, rank r, step i holds the K/V of rank s = (r - i) mod P::

    step 0      step 1      ...   step P-1
    kv[r]  -->  kv[r-1] -->  ...  kv[r+1]     (received from rank r-1, sent on to r+1)

At every step the transfer of the next shard is posted before the current shard is
computed, so communication hides behind compute when a block takes longer to compute
than to send. Partial (out, lse) are merged in float32 (float64 for float64 inputs);
blocks the plan says are invisible are skipped (their shard still passes through).

Backward re-circulates K/V the same way and also circulates a dK/dV accumulator (in the
accumulation dtype: float32, or float64 for float64 inputs) for each shard: it starts on
rank s+1, collects each rank's share, and after P-1 hops lands back on rank s, which adds
its own share. dQ never moves.

Traffic per rank (elements of size e, local length S = T/P):
    forward:  (P-1) * 2*B*H_kv*S*D*e    sent and received
    backward: (P-1) * 2*B*H_kv*S*D*(e + a),  a = 4 (8 for float64): the accumulator
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ctxpar import profile
from ctxpar.blocks import layout_tiles
from ctxpar.comm import RingComm
from ctxpar.layout import Layout
from ctxpar.strategies.blockwise import (backward_tiles, finish_forward, forward_tiles, gradient_accumulators,
                                         output_accumulators)
from ctxpar.topology import Topology

_KV_TAG, _DKV_TAG = 0, 1


class RingAttention(torch.autograd.Function):
    """Inputs already validated by ``ctxpar.attention``; returns (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: Layout, group, rank: int, causal: bool, scale: float):
        world = layout.world_size
        seq_len = q.shape[2] * world
        acc_out, acc_lse = output_accumulators(q)  # (B, H, S, D), (B, H, S)
        kv = torch.stack([k, v])  # (2, B, H_kv, S, D): one message per step
        comm = RingComm(group, tag=_KV_TAG) if world > 1 else None
        spare = torch.empty_like(kv) if comm else None
        for step in range(world):
            last = step == world - 1
            if not last:
                comm.start(send=kv, recv=spare)
            with profile.timed("compute", q.device):
                tiles = layout_tiles(layout, seq_len, rank, (rank - step) % world, causal)
                forward_tiles(q, kv[0], kv[1], tiles, acc_out, acc_lse, scale)
            if not last:
                comm.wait()
                kv, spare = spare, kv
        ctx.layout, ctx.group, ctx.rank, ctx.causal, ctx.scale = layout, group, rank, causal, scale
        return finish_forward(ctx, q, k, v, acc_out, acc_lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, rank, causal, scale = ctx.layout, ctx.rank, ctx.causal, ctx.scale
        world = layout.world_size
        seq_len = q.shape[2] * world
        dout = dout.contiguous()
        dq, own = gradient_accumulators(q, k)  # own: dK/dV of our own shard
        kv = torch.stack([k, v])
        if world > 1:
            kv_comm, dkv_comm = RingComm(ctx.group, tag=_KV_TAG), RingComm(ctx.group, tag=_DKV_TAG)
            kv_spare = torch.empty_like(kv)
            # travelling accumulators: one being sent, one being received, one to compute into
            send_acc, recv_acc, scratch = (torch.empty_like(own) for _ in range(3))
        for step in range(world):
            last = step == world - 1
            if not last:
                kv_comm.start(send=kv, recv=kv_spare)
            # At step i this rank holds shard s = r - i and computes its share of s's dK/dV:
            # step 0 into `own`; step 1 into a fresh accumulator it starts sending on; from
            # step 2 into `scratch`, added to the accumulator for s arriving from rank r-1,
            # which it sends on. Traced for P = 3 on rank 0:
            #   step 0  shard 0: own += share
            #   step 1  shard 2: send_acc = share                     -> rank 1
            #   step 2  shard 1: recv_acc (from rank 2, started there at its step 1) += share
            #                                                         -> rank 1, shard 1's owner
            #   end     recv_acc (shard 0's: started by rank 1, via rank 2) is added to own
            # Every accumulator makes P - 1 hops and lands on its owner after the last step.
            target = own if step == 0 else send_acc if step == 1 else scratch
            if step >= 1:
                target.zero_()
            with profile.timed("compute", q.device):
                tiles = layout_tiles(layout, seq_len, rank, (rank - step) % world, causal)
                backward_tiles(dout, q, kv[0], kv[1], out, lse, tiles, scale, dq, target[0], target[1])
            if step >= 2:  # add our share to the accumulator arriving from rank-1
                dkv_comm.wait()
                recv_acc += scratch
                send_acc, recv_acc = recv_acc, send_acc
            if step >= 1:
                dkv_comm.start(send=send_acc, recv=recv_acc)
            if not last:
                kv_comm.wait()
                kv, kv_spare = kv_spare, kv
        if world > 1:  # our own shard's accumulator, after visiting every other rank
            dkv_comm.wait()
            own += recv_acc
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout, topo: Topology, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return RingAttention.apply(q, k, v, layout, topo.ring_group, topo.ring_rank, causal, scale)
