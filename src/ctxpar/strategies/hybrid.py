"""The 2D hybrid: the all-to-all inside each Ulysses union of U ranks, the ring across R unions.

After ``SeqToHeads`` over the mesh's "ulysses" dim, each rank holds H/U heads of its
union's U*S tokens: exactly one rank's shard of the ``UnionLayout`` over the R unions.
Ring attention over the "ring" dim then treats the unions as ranks of that layout, and
``HeadsToSeq`` brings the output back. This module only puts the ring between the
exchanges of ``alltoall.py``.
"""

from __future__ import annotations

import torch

from ctxpar.layout import Layout, UnionLayout
from ctxpar.masks import Mask
from ctxpar.strategies.alltoall import HeadsToSeq, local_sinks, to_heads
from ctxpar.strategies.ring import RingAttention
from ctxpar.topology import Topology


def hybrid_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, *, layout: Layout, topo: Topology,
    mask: Mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    (ql, kl, vl), exchange = to_heads(q, k, v, layout, topo)
    unions = UnionLayout(topo.ring_degree, layout, topo.ulysses_degree)
    out, lse = RingAttention.apply(ql, kl, vl, local_sinks(sinks, topo), unions, topo.ring_group, topo.ring_rank,
                                   mask, scale)
    return HeadsToSeq.apply(out, lse, *exchange)
