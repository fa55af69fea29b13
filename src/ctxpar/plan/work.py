"""Attention work per rank: exact (query, key) pair counts, for the planner and the reports.

Equal to the pairs of the block plan a rank computes (``ctxpar.blocks``; tested against
it), but counted directly from the layout's positions in O(T/P).
"""

from __future__ import annotations

from ctxpar.layout import Layout
from ctxpar.masks import Mask


def rank_pairs(layout: Layout, seq_len: int, rank: int, mask: Mask) -> int:
    """Exact (query, key) pairs ``rank`` computes against every rank's keys: its attention work.

    Equal to the pairs of its block plans against all P shards (tested); computed
    directly, in O(T/P), since the keys are then all positions: each query sees the
    whole interval the mask gives it (plain causal: the p + 1 keys 0..p).
    """
    first, stop = mask.intervals(layout.positions(seq_len, rank), seq_len)
    return int((stop - first).sum())


def union_pairs(layout: Layout, seq_len: int, rank: int, mask: Mask, ulysses: int) -> int:
    """Pairs of every query held by the ``ulysses`` consecutive ranks ``rank`` is one of.

    An all-to-all over those ranks computes exactly these, for H / ulysses heads on each of
    them; with ulysses = 1 this is ``rank_pairs``.
    """
    first = rank - rank % ulysses
    return sum(rank_pairs(layout, seq_len, m, mask) for m in range(first, first + ulysses))
