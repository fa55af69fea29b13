"""Attention work per rank: exact (query, key) pair counts, for the planner and the reports,
and the kernel calls the block plan makes for them.

Pairs equal those of the block plan a rank computes (``ctxpar.blocks``; tested against
it), but counted directly from the layout's positions in O(T/P).
"""

from __future__ import annotations

import functools

import torch

from ctxpar.blocks import Tile, gathered_key_order, tiles_between, tiles_per_shard
from ctxpar.layout import Layout
from ctxpar.masks import Mask


def rank_pairs(layout: Layout, seq_len: int, rank: int, mask: Mask) -> int:
    """Exact (query, key) pairs ``rank`` computes against every rank's keys: its attention work.

    Equal to the pairs of its block plans against all P shards (tested); computed
    directly, in O(T/P), since the keys are then all positions: each query sees the
    whole interval the mask gives it (plain causal: the p + 1 keys 0..p).
    """
    return int(mask.keys_seen(layout.positions(seq_len, rank), seq_len).sum())


def union_pairs(layout: Layout, seq_len: int, rank: int, mask: Mask, ulysses: int) -> int:
    """Pairs of every query held by the ``ulysses`` consecutive ranks ``rank`` is one of.

    An all-to-all over those ranks computes exactly these, for H / ulysses heads on each of
    them; with ulysses = 1 this is ``rank_pairs``.
    """
    first = rank - rank % ulysses
    return sum(rank_pairs(layout, seq_len, m, mask) for m in range(first, first + ulysses))


@functools.lru_cache(maxsize=2)
def _keys_seen(seq_len: int, mask: Mask) -> torch.Tensor:
    """(T,) int32: how many keys the query at each position sees (do not modify: cached)."""
    return mask.keys_seen(torch.arange(seq_len), seq_len).to(torch.int32)


def pairs_per_rank(layout: Layout, seq_len: int, mask: Mask, ulysses: int = 1) -> tuple[int, ...]:
    """``union_pairs`` for every rank at once (``rank_pairs`` with ulysses = 1), in O(T):
    the mask's intervals are built once for all positions, not once per rank, which
    matters under documents (each build walks the document list); in O(P) for a plain mask
    on the named layouts, whose shards are runs of positions."""
    own = _plain_pairs(layout, seq_len, mask)
    if own is None:
        keys = _keys_seen(seq_len, mask)
        own = [int(keys[layout.positions(seq_len, r)].sum()) for r in range(layout.world_size)]
    return tuple(sum(own[r - r % ulysses:r - r % ulysses + ulysses]) for r in range(layout.world_size))


def _plain_pairs(layout: Layout, seq_len: int, mask: Mask) -> list[int] | None:
    """Each rank's pairs under a plain mask where the layout gives its shards as runs of
    positions (``Layout.runs``), from their sums (a causal query at p sees p + 1 keys); None
    otherwise. The overlap threshold's search evaluates many lengths, each once O(T)."""
    p = layout.world_size
    if not mask.is_plain or seq_len % layout.multiple or layout.runs(seq_len, 0) is None:
        return None
    shard = seq_len // p
    if not mask.causal:
        return [shard * seq_len] * p
    return [sum(count * first + step * count * (count - 1) // 2 for first, count, step in layout.runs(seq_len, r))
            + shard for r in range(p)]


def stage_tiles(layout: Layout, seq_len: int, rank: int, mask: Mask, strategy: str) -> tuple[tuple[Tile, ...], ...]:
    """``rank``'s block plans, the tiles of each pipeline stage of ``strategy`` (each forward,
    and again each backward):

    - "ring": one stage per step, the tiles against that rank's keys;
    - "allgather": one head group's (every group's are the same), against all keys in the
      order the strategy takes them (``blocks.gathered_key_order``: arrival or position
      order, whichever has fewer tiles);
    - "alltoall": one pass's, the whole sequence against itself.
    """
    if strategy == "alltoall":
        everything = torch.arange(seq_len)
        return (tiles_between(everything, everything, mask, seq_len),)
    if strategy == "ring":
        return tiles_per_shard(layout, seq_len, rank, mask)
    kind, tiles, _ = gathered_key_order(layout, seq_len, rank, mask)
    return (sum(tiles, ()),) if kind == "by_rank" else (tiles,)
