"""CP attention strategies: each moves K/V (or heads) differently, all compute the same thing.

Every strategy is ``fn(q, k, v, sinks, *, layout, topo, mask, scale) -> (out, lse)`` with
inputs already validated (``mask`` a ``ctxpar.masks.Mask``, ``sinks`` None or (H,));
``check(heads, kv_heads, topo)`` raises ValueError for head counts the strategy
cannot take, before anything is sent (and before a model is changed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ctxpar.strategies.allgather import allgather_attention
from ctxpar.strategies.ring import ring_attention
from ctxpar.strategies.alltoall import alltoall_attention
from ctxpar.strategies.hybrid import hybrid_attention
from ctxpar.strategy_rules import STRATEGY_NAMES, check_heads_split
from ctxpar.topology import Topology


def _no_constraint(heads: int, kv_heads: int, topo: Topology) -> None:
    return None


def _heads_split_over_ulysses(heads: int, kv_heads: int, topo: Topology) -> None:
    check_heads_split("hybrid" if topo.hybrid else "alltoall", heads, kv_heads, topo.ulysses_degree)


@dataclass(frozen=True)
class Strategy:
    run: Callable
    check: Callable[[int, int, Topology], None]  # (H, H_kv, topo)
    axis: str  # "ring" or "ulysses": how it uses a plain process group; "mesh": needs a 2D DeviceMesh


STRATEGIES = {  # keyed by strategy_rules.STRATEGY_NAMES
    "ring": Strategy(ring_attention, _no_constraint, "ring"),
    "allgather": Strategy(allgather_attention, _no_constraint, "ring"),
    "alltoall": Strategy(alltoall_attention, _heads_split_over_ulysses, "ulysses"),
    "hybrid": Strategy(hybrid_attention, _heads_split_over_ulysses, "mesh"),
}
assert tuple(STRATEGIES) == STRATEGY_NAMES

__all__ = ["STRATEGIES", "Strategy"]
