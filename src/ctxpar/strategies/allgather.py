"""All-gather attention (Llama 3 style): every rank gathers all K/V, keeps its queries.

K/V are gathered one KV head at a time (with the query heads that use it), the next
head's gather posted before the current head is computed, so at most two gathered heads
are alive: the gathered buffer is bounded by 2 * P * 2*B*S*D elements whatever H_kv::

    KV head 0:  gather ──wait──▶ compute (its query heads x every rank's K/V, block plan)
    KV head 1:         gather ─────────────wait──▶ compute
                                                  ...

Queries see only the key blocks the plan lists: for causal layouts, invisible shards
are never computed. Backward gathers K/V again, computes dQ locally and every shard's
dK/dV share, and reduce-scatters those (fp32) so each rank receives the sum for its own
shard. GQA: only H_kv heads are gathered, which makes this cheap for small H_kv.

Traffic per rank (S = T/P local length, e element size): forward (P-1)*2*B*H_kv*S*D*e;
backward (P-1)*2*B*H_kv*S*D*e for the re-gather plus (P-1)*2*B*H_kv*S*D*a for dK/dV
(a = 4, or 8 for float64: the accumulation dtype).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ctxpar import profile
from ctxpar.blocks import layout_tiles
from ctxpar.comm import PendingAllGather, PendingReduceScatter
from ctxpar.layout import Layout
from ctxpar.strategies.blockwise import backward_tiles, forward_tiles, gradient_accumulators, output_accumulators
from ctxpar.topology import Topology


def _head_groups(kv_heads: int) -> list[slice]:
    return [slice(h, h + 1) for h in range(kv_heads)]


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: Layout, group, rank: int, causal: bool, scale: float):
        world, seq_len = layout.world_size, q.shape[2] * layout.world_size
        g = q.shape[1] // k.shape[1]  # query heads per KV head
        acc_out, acc_lse = output_accumulators(q)  # (B, H, S, D), (B, H, S)
        kv = torch.stack([k, v])  # (2, B, H_kv, S, D)
        heads = _head_groups(k.shape[1])
        pending = PendingAllGather(kv[:, :, heads[0]], group)
        for i, kvh in enumerate(heads):
            gathered = pending.wait()  # (P, 2, B, 1, S, D)
            if i + 1 < len(heads):
                pending = PendingAllGather(kv[:, :, heads[i + 1]], group)
            qh = slice(kvh.start * g, kvh.stop * g)
            with profile.timed("compute", q.device):
                for src in range(world):
                    tiles = layout_tiles(layout, seq_len, rank, src, causal)
                    forward_tiles(q[:, qh], gathered[src, 0], gathered[src, 1], tiles,
                                   acc_out[:, qh], acc_lse[:, qh], scale)
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.args = (layout, group, rank, causal, scale)
        ctx.mark_non_differentiable(acc_lse)
        return out, acc_lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, rank, causal, scale = ctx.args
        world, seq_len = layout.world_size, q.shape[2] * layout.world_size
        g = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        dq, dkv = gradient_accumulators(q, k)  # dkv: our shard's dK, dV, filled head by head
        kv = torch.stack([k, v])
        heads = _head_groups(k.shape[1])
        pending = PendingAllGather(kv[:, :, heads[0]], group)
        reducing = None  # (heads, PendingReduceScatter) of the previous group, still in flight
        for i, kvh in enumerate(heads):
            gathered = pending.wait()
            if i + 1 < len(heads):
                pending = PendingAllGather(kv[:, :, heads[i + 1]], group)
            qh = slice(kvh.start * g, kvh.stop * g)
            shares = torch.zeros(gathered.shape, dtype=dkv.dtype, device=q.device)  # (P, 2, B, 1, S, D)
            with profile.timed("compute", q.device):
                for src in range(world):
                    tiles = layout_tiles(layout, seq_len, rank, src, causal)
                    backward_tiles(dout[:, qh], q[:, qh], gathered[src, 0], gathered[src, 1], out[:, qh],
                                    lse[:, qh], tiles, scale, dq[:, qh], shares[src, 0], shares[src, 1])
            if reducing is not None:
                dkv[:, :, reducing[0]] = reducing[1].wait()
            reducing = (kvh, PendingReduceScatter(shares, group))
        dkv[:, :, reducing[0]] = reducing[1].wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: Layout,
    topo: Topology,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return AllGatherAttention.apply(q, k, v, layout, topo.group, topo.rank, causal, scale)
