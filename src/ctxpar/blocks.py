"""The block plan: which (query slice, key slice, mask kind) tiles a rank must compute.

Strategies never look at layout names. They ask for the plan between a query shard and
a key shard, computed here from the two shards' global positions, and run one kernel
call per tile. Tiles with no visible (query, key) pair are never produced.

Mask kinds, drawn for a 4-query tile (``x`` = query row sees key column)::

    FULL            CAUSAL          CAUSAL_STRICT (keys = queries - 1)
    x x x x         x . . .         . . .
    x x x x         x x . .         x . .
    x x x x         x x x .         x x .
    x x x x         x x x x         x x x

Which layout yields which tiles (P ranks, causal, queries of rank r, keys of rank s):

    contiguous  s < r: FULL                      s == r: CAUSAL     s > r: nothing
    zigzag      s < r: FULL, all queries x first half of keys (the early chunk)
                s == r: CAUSAL over the whole shard
                s > r: FULL, second half of queries (the late chunk) x all keys
    striped     s <= r: CAUSAL                   s > r: CAUSAL_STRICT

The plan is derived, not tabulated: for each query row, the number of visible keys
n_i = #{kv positions <= q position} is a prefix length (both shards are ascending).
Runs where n_i stays constant become FULL tiles over the first n_i keys; runs where
n_i grows by one per row become a diagonal (CAUSAL, CAUSAL_STRICT, or FULL + CAUSAL
when the diagonal starts after a fully visible prefix). Any other position pattern
still yields an exact, if finer-grained, plan.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from ctxpar.layout import Layout


class MaskKind(enum.Enum):
    FULL = "full"
    CAUSAL = "causal"
    CAUSAL_STRICT = "causal-strict"


@dataclass(frozen=True)
class Tile:
    """One kernel call: queries ``q_start:q_stop`` against keys ``kv_start:kv_stop``."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    kind: MaskKind

    @property
    def q(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def kv(self) -> slice:
        return slice(self.kv_start, self.kv_stop)

    @property
    def pairs(self) -> int:
        """Number of visible (query, key) pairs in this tile."""
        nq, nk = self.q_stop - self.q_start, self.kv_stop - self.kv_start
        if self.kind is MaskKind.FULL:
            return nq * nk
        if self.kind is MaskKind.CAUSAL:
            return nq * (nq + 1) // 2
        return nq * (nq - 1) // 2

    def kernel_args(self) -> tuple[slice, slice, bool]:
        """(query slice, key slice, is_causal) for a kernel whose causal mask is square.

        CAUSAL_STRICT's first query row sees no key in this tile, so it is left out and
        the remaining rows against the keys form an ordinary square causal tile.
        """
        if self.kind is MaskKind.CAUSAL_STRICT:
            return slice(self.q_start + 1, self.q_stop), self.kv, True
        return self.q, self.kv, self.kind is MaskKind.CAUSAL

    def __post_init__(self) -> None:
        nq, nk = self.q_stop - self.q_start, self.kv_stop - self.kv_start
        expected_nk = {MaskKind.FULL: nk, MaskKind.CAUSAL: nq, MaskKind.CAUSAL_STRICT: nq - 1}[self.kind]
        if nq <= 0 or nk <= 0 or nk != expected_nk:
            raise ValueError(f"malformed {self.kind.value} tile: {nq} queries x {nk} keys")


def tiles_between(q_positions: torch.Tensor, kv_positions: torch.Tensor, causal: bool) -> tuple[Tile, ...]:
    """Tiles covering exactly the visible pairs between a query and a key shard.

    Args:
        q_positions: (Sq,) ascending global positions of the queries.
        kv_positions: (Sk,) ascending global positions of the keys.
        causal: whether query at position i may only see keys at positions <= i.
    """
    sq, sk = q_positions.numel(), kv_positions.numel()
    if not causal:
        return (Tile(0, sq, 0, sk, MaskKind.FULL),)
    for name, pos in (("query", q_positions), ("key", kv_positions)):
        if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
            raise ValueError(f"{name} positions must be strictly ascending for a block plan")
    visible = torch.searchsorted(kv_positions, q_positions, right=True).tolist()  # n_i per row
    tiles: list[Tile] = []
    i = 0
    while i < sq:
        n = visible[i]
        step = visible[i + 1] - n if i + 1 < sq else None
        if step == 1:  # a diagonal: row i + a sees keys [0, n + a)
            j = i + 1
            while j + 1 < sq and visible[j + 1] == visible[j] + 1:
                j += 1
            length = j - i + 1
            if n == 0:
                tiles.append(Tile(i, j + 1, 0, length - 1, MaskKind.CAUSAL_STRICT))
            else:
                if n > 1:
                    tiles.append(Tile(i, j + 1, 0, n - 1, MaskKind.FULL))
                tiles.append(Tile(i, j + 1, n - 1, n - 1 + length, MaskKind.CAUSAL))
            i = j + 1
            continue
        j = i  # a run of rows that all see the same first n keys
        while j + 1 < sq and visible[j + 1] == n:
            j += 1
        if n > 0:
            tiles.append(Tile(i, j + 1, 0, n, MaskKind.FULL))
        i = j + 1
    return tuple(tiles)


def count_pairs(tiles: tuple[Tile, ...] | list[Tile]) -> int:
    return sum(t.pairs for t in tiles)


@functools.lru_cache(maxsize=4096)
def layout_tiles(layout: Layout, seq_len: int, q_rank: int, kv_rank: int, causal: bool) -> tuple[Tile, ...]:
    """The tiles of ``q_rank``'s queries against ``kv_rank``'s keys under ``layout`` (cached)."""
    return tiles_between(layout.positions(seq_len, q_rank), layout.positions(seq_len, kv_rank), causal)
