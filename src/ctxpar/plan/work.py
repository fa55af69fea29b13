"""Attention work per rank: exact (query, key) pair counts, for the planner and the reports.

Equal to the pairs of the block plan a rank computes (``ctxpar.blocks``; tested against
it), but counted directly from the layout's positions in O(T/P).
"""

from __future__ import annotations

from ctxpar.layout import Layout


def rank_pairs(layout: Layout, seq_len: int, rank: int, causal: bool) -> int:
    """Exact (query, key) pairs ``rank`` computes against every rank's keys: its attention work.

    Equal to the pairs of its block plans against all P shards (tested); computed
    directly, in O(T/P), since the keys are then all positions: the query at position p
    sees the p + 1 keys 0..p.
    """
    positions = layout.positions(seq_len, rank)
    return int((positions + 1).sum()) if causal else positions.numel() * seq_len


def union_pairs(layout: Layout, seq_len: int, rank: int, causal: bool, ulysses: int) -> int:
    """Pairs of every query held by the ``ulysses`` consecutive ranks ``rank`` is one of.

    An all-to-all over those ranks computes exactly these, for H / ulysses heads on each of
    them; with ulysses = 1 this is ``rank_pairs``.
    """
    first = rank - rank % ulysses
    return sum(rank_pairs(layout, seq_len, m, causal) for m in range(first, first + ulysses))
