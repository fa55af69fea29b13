"""The block plan: which (query slice, key slice, mask kind) tiles a rank must compute.

Strategies never look at layout or mask names. They ask for the plan between a query
shard and a key shard, computed here from the two shards' global positions and the
``Mask`` (``ctxpar.masks``), and run one kernel call per tile. Tiles with no visible
(query, key) pair are never produced.

Mask kinds, drawn for a 4-query tile (``x`` = query row sees key column)::

    FULL            CAUSAL          ANTI_CAUSAL     PARTIAL (any rows, explicit mask)
    x x x x         x . . .         x x x x         . x x x .
    x x x x         x x . .         . x x x         . . x x x
    x x x x         x x x .         . . x x         . . . x x
    x x x x         x x x x         . . . x         . . . . x

(ANTI_CAUSAL is the causal tile read backwards: the kernels compute it as CAUSAL on the
rows and keys in reverse order; it is the trailing edge of a sliding window.)

Which layout yields which tiles (P ranks, plain causal, queries of rank r, keys of rank s):

    contiguous  s < r: FULL                      s == r: CAUSAL     s > r: nothing
    zigzag      s < r: FULL, all queries x first half of keys (the early chunk)
                s == r: CAUSAL over the whole shard
                s > r: FULL, second half of queries (the late chunk) x all keys
    striped     s <= r: CAUSAL                   s > r: CAUSAL, all queries but the first

The plan is derived, not tabulated. The mask gives each query an interval of visible
key positions; both shards are ascending, so each query row i sees a contiguous range
of key *indices* [lo_i, hi_i), and lo and hi never decrease from one row to the next.
Rows that share lo (plain causal, a document's rows) are cut like a prefix: runs where
hi stays constant become FULL tiles, runs where it grows by one per row a diagonal
(CAUSAL, or FULL + CAUSAL after a fully visible prefix). Rows whose lo
moves (a sliding window, short documents) are taken a band at a time (about the rows'
visible width, 16 to 1024 rows): the columns where lo moves are one ANTI_CAUSAL tile when
lo moves by exactly one key per row (a window over consecutive positions), else one
PARTIAL tile with an explicit mask; the rest is cut as a prefix from there. Runs of a few
rows whose hi jumps by more than one (a staircase: a hybrid's union of U striped ranks
against another's keys) are taken a band at a time too: the keys the whole band sees as
one FULL tile, the steps as one PARTIAL tile. Any other pattern still yields an exact, if
finer-grained, plan.
"""

from __future__ import annotations

import bisect
import enum
import functools
from dataclasses import dataclass

import torch

from ctxpar.layout import Layout
from ctxpar.masks import Mask

MIN_BAND_ROWS, MAX_BAND_ROWS = 16, 1024  # rows per band block: about the visible width, within these


class MaskKind(enum.Enum):
    FULL = "full"
    CAUSAL = "causal"
    ANTI_CAUSAL = "anti-causal"
    PARTIAL = "partial"


@dataclass(frozen=True)
class Tile:
    """One kernel call: queries ``q_start:q_stop`` against keys ``kv_start:kv_stop``.

    ``rows`` (PARTIAL only): for each query row, the keys [a, b) it sees, counted from
    ``kv_start``; the kernel gets them as an explicit mask (``visible``).
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    kind: MaskKind
    rows: tuple[tuple[int, int], ...] | None = None

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
        if self.kind in (MaskKind.CAUSAL, MaskKind.ANTI_CAUSAL):
            return nq * (nq + 1) // 2
        return sum(b - a for a, b in self.rows)

    def visible(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """(queries, keys) bool mask of a PARTIAL tile, on ``device``, made there per call from
        its row bounds (cached there: no host-to-device copy per call); None for the other
        kinds."""
        if self.kind is not MaskKind.PARTIAL:
            return None
        device = torch.device(device)
        bounds = _rows_bounds(self.rows, device)  # (queries, 2)
        cols = torch.arange(self.kv_stop - self.kv_start, device=device).unsqueeze(0)
        return (cols >= bounds[:, :1]) & (cols < bounds[:, 1:])

    def kernel_args(self, device: torch.device | str = "cpu") -> tuple[slice, slice, bool, torch.Tensor | None]:
        """(query slice, key slice, is_causal, mask): CAUSAL is the kernels' square causal
        mask; PARTIAL tiles pass their explicit mask (True = visible), on ``device``."""
        return self.q, self.kv, self.kind is MaskKind.CAUSAL, self.visible(device)

    def __post_init__(self) -> None:
        nq, nk = self.q_stop - self.q_start, self.kv_stop - self.kv_start
        if self.kind is MaskKind.PARTIAL:
            ok = (self.rows is not None and len(self.rows) == nq and nk > 0
                  and all(0 <= a < b <= nk for a, b in self.rows))
            if not ok:
                raise ValueError(f"malformed partial tile: {nq} queries x {nk} keys, rows {self.rows}")
            return
        expected_nk = nk if self.kind is MaskKind.FULL else nq
        if nq <= 0 or nk <= 0 or nk != expected_nk or self.rows is not None:
            raise ValueError(f"malformed {self.kind.value} tile: {nq} queries x {nk} keys")


@functools.lru_cache(maxsize=1024)
def _rows_bounds(rows: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """A PARTIAL tile's row bounds on ``device``: 16 bytes a row. Cached masks (queries x keys)
    outlived the plans that made them: with documents changing every batch, up to 4 GiB per GPU."""
    return to_device(torch.tensor(rows, dtype=torch.int64), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (plan data made on the host: a tile's row bounds, an index) on ``device``. To a
    GPU from pinned memory, queued behind the GPU's work: a copy from pageable memory
    (``torch.tensor(..., device=)``, ``.to(device)``) first waits for all of it, a host
    synchronisation inside the strategies' loops at every plan a new mask makes."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tiles_between(q_positions: torch.Tensor, kv_positions: torch.Tensor, mask: Mask, seq_len: int) -> tuple[Tile, ...]:
    """Tiles covering exactly the visible pairs between a query and a key shard.

    Args:
        q_positions: (Sq,) strictly ascending global positions of the queries.
        kv_positions: (Sk,) strictly ascending global positions of the keys.
        mask: what each query may see (``ctxpar.masks.Mask``).
        seq_len: T, the length of the whole row the positions are taken from.
    """
    for name, pos in (("query", q_positions), ("key", kv_positions)):
        if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
            raise ValueError(f"{name} positions must be strictly ascending for a block plan")
    first, stop = mask.intervals(q_positions, seq_len)
    kv = kv_positions.to(torch.int64)
    lo, hi = torch.searchsorted(kv, first), torch.searchsorted(kv, stop)  # row i sees key indices [lo_i, hi_i)
    seen = hi > lo
    if not bool(seen.any()):  # a shard wholly out of sight (a window's, a causal future's): no walk
        return ()
    lo, hi, seen = lo.tolist(), hi.tolist(), seen.tolist()
    tiles: list[Tile] = []
    # The walk jumps from run to run of rows (bisect, list.index and slice comparisons: C
    # loops, not one Python step per row; a 1M-token window plan walks tens of millions).
    sq, i = len(lo), seen.index(True)
    while i < sq:
        # rows i..j-1 share lo and see something: as hi never decreases, rows sharing lo see
        # something from the first that does on
        j = bisect.bisect_right(lo, lo[i], i)
        band = min(MAX_BAND_ROWS, max(MIN_BAND_ROWS, hi[i] - lo[i]))
        if j - i >= band or j == sq or not seen[j]:
            _cut_prefix(hi, i, j, lo[i], tiles)
        else:  # lo moves within the next few rows: a band block, up to the first row that sees nothing
            j = _first_index(seen, False, i + 1, min(sq, i + band))
            _cut_band(lo, hi, i, j, tiles)
        i = _first_index(seen, True, j, sq)
    return tuple(tiles)


def _first_index(items: list[bool], value: bool, start: int, stop: int) -> int:
    """The first index in start..stop-1 holding ``value``; ``stop`` if there is none."""
    try:
        return items.index(value, start, stop)
    except ValueError:
        return stop


def _cut_band(lo: list[int], hi: list[int], start: int, stop: int, tiles: list[Tile]) -> None:
    """Rows start..stop-1, row r seeing keys [lo[r], hi[r]), non-empty and nondecreasing: the
    keys up to the last row's first one as one ANTI_CAUSAL tile (lo moving by one key per
    row) or PARTIAL tile, the rest as a prefix from there."""
    first, left_stop = lo[start], lo[stop - 1] + 1  # every row sees something left of left_stop
    if lo[start:stop] == list(range(first, left_stop)) and hi[start] >= left_stop:  # row r sees keys r.. of the square
        tiles.append(Tile(start, stop, first, left_stop, MaskKind.ANTI_CAUSAL))
    else:
        rows = tuple((a - first, min(b, left_stop) - first) for a, b in zip(lo[start:stop], hi[start:stop]))
        tiles.append(Tile(start, stop, first, left_stop, MaskKind.PARTIAL, rows))
    _cut_prefix(hi, start, stop, left_stop, tiles)


def _cut_prefix(hi: list[int], start: int, stop: int, base: int, tiles: list[Tile]) -> None:
    """Rows start..stop-1, row r seeing keys [base, hi[r]), hi nondecreasing: runs of rows
    that see the same keys become FULL tiles, runs that see one key more per row diagonals."""
    r = bisect.bisect_right(hi, base, start, stop)  # the rows before see nothing from base on
    while r < stop:
        n = hi[r] - base
        if r + 1 < stop and hi[r + 1] == hi[r] + 1:  # a diagonal: row r + a sees n + a keys
            e = _diagonal_end(hi, r, stop)
            if n > 1:
                tiles.append(Tile(r, e + 1, base, base + n - 1, MaskKind.FULL))
            tiles.append(Tile(r, e + 1, base + n - 1, base + n + e - r, MaskKind.CAUSAL))
        else:
            e = bisect.bisect_right(hi, hi[r], r, stop) - 1  # a run of rows that all see the same keys
            # runs of one row (striped queries against every key) stay a tile per row: the all-gather
            # takes such keys shard by shard instead, as diagonals
            band = _staircase_band(hi, r, e + 1, stop, base) if e > r else None
            if band is not None:
                e = _cut_staircase(hi, r, e + 1, band, base, tiles)
            else:
                tiles.append(Tile(r, e + 1, base, base + n, MaskKind.FULL))
        r = e + 1


def _staircase_band(hi: list[int], start: int, step: int, stop: int, base: int) -> int | None:
    """Where a band cut as a staircase from row ``start`` ends (``step``: the first row past
    its first run of rows seeing the same keys), or None where no staircase pays: a band
    whose steps span a quarter of the keys its first row sees (at least 16, at most 1024
    rows), ended at a run's end, must hold three runs or more."""
    if step + 1 >= stop:  # no room for three runs
        return None
    first = hi[start]
    end = bisect.bisect_right(hi, first + max(MIN_BAND_ROWS, (first - base) // 4), step,
                              min(stop, start + MAX_BAND_ROWS))
    if end < stop and hi[end] == hi[end - 1]:  # capped within a run: end where it begins
        end = bisect.bisect_left(hi, hi[end - 1], step, end)
    second_end = bisect.bisect_right(hi, hi[step], step, end)
    return end if second_end < end else None


def _cut_staircase(hi: list[int], start: int, step: int, end: int, base: int, tiles: list[Tile]) -> int:
    """Rows ``start``..``end``-1 in runs that see the same keys, ``step`` the first row past the
    first run: a staircase (a hybrid's union on the striped layout sees another's keys U more
    every U rows). Cut as one FULL tile of the keys every row of the band sees and one
    PARTIAL tile of the steps, rather than a tile per run (T/P tiles of U rows): 38 tiles
    where there were 1023 (P=4, U=2, T=4096), about 10% more pairs computed than visible;
    the hybrid's forward and backward 2.8x faster on 4 CPU ranks (docs/benchmarks.md).
    Returns the band's last row."""
    tiles.append(Tile(start, end, base, hi[start], MaskKind.FULL))
    first = hi[start]  # rows step.. see keys past it, each at least one
    rows = tuple((0, b - first) for b in hi[step:end])
    tiles.append(Tile(step, end, first, hi[end - 1], MaskKind.PARTIAL, rows))
    return end - 1


def _diagonal_end(hi: list[int], r: int, stop: int) -> int:
    """The last row e < stop with hi[r..e] = h, h + 1, ..., h = hi[r]: found by galloping
    (rows compared a slice at a time, the slices doubling, then halving), which compares
    about three times the diagonal's rows in C, not one Python step per row."""
    h, rows = hi[r], stop - r

    def continues(a: int, b: int) -> bool:  # rows r+a..r+b-1 carry the diagonal on
        return hi[r + a:r + b] == list(range(h + a, h + b))

    known, step = 1, 1  # rows r..r+known-1 are on the diagonal
    while known < rows and continues(known, min(known + step, rows)):
        known, step = min(known + step, rows), step * 2
    while step > 1:  # the row that leaves it lies within the next step rows
        step //= 2
        if known < rows and continues(known, min(known + step, rows)):
            known = min(known + step, rows)
    return r + known - 1


@functools.lru_cache(maxsize=256)  # a mask with documents may change every batch: keep few plans
def layout_tiles(layout: Layout, seq_len: int, q_rank: int, kv_rank: int, mask: Mask) -> tuple[Tile, ...]:
    """The tiles of ``q_rank``'s queries against ``kv_rank``'s keys under ``layout`` (cached)."""
    return tiles_between(layout.positions(seq_len, q_rank), layout.positions(seq_len, kv_rank), mask, seq_len)


@functools.lru_cache(maxsize=16)  # a mask with documents may change every batch
def gathered_key_order(layout: Layout, seq_len: int, rank: int, mask: Mask):
    """How ``rank`` attends to every rank's keys gathered (the all-gather strategy), whichever
    takes fewer kernel calls:

    ("global", tiles, index): keys put in position order, tiles against 0..T-1;
        ``index`` (T,): each position's arrival slot (source rank * S + local index).
    ("by_rank", tiles_per_rank, None): keys left as they arrived, tiles against each shard.
    """
    whole = tiles_between(layout.positions(seq_len, rank), torch.arange(seq_len), mask, seq_len)
    # Each shard the queries see costs the arrival order at least one tile: with fewer tiles
    # in position order (zigzag's few against P or more), its P plans need not be walked.
    in_sight = shards_in_sight(layout, seq_len, rank, mask)
    if len(whole) >= sum(in_sight):
        by_rank = tiles_per_shard(layout, seq_len, rank, mask, in_sight)
        if len(whole) >= sum(len(t) for t in by_rank):
            return "by_rank", by_rank, None
    arrival = _every_shard(layout, seq_len).flatten()
    index = torch.empty_like(arrival)
    index[arrival] = torch.arange(seq_len)
    return "global", whole, index


def tiles_per_shard(layout: Layout, seq_len: int, rank: int, mask: Mask,
                    in_sight: tuple[bool, ...] | None = None) -> tuple[tuple[Tile, ...], ...]:
    """``rank``'s tiles against each rank's shard (``layout_tiles``), the shards out of sight
    skipped without a walk (``shards_in_sight``, found here unless the caller has it)."""
    in_sight = in_sight or shards_in_sight(layout, seq_len, rank, mask)
    return tuple(layout_tiles(layout, seq_len, rank, src, mask) if seen else () for src, seen in enumerate(in_sight))


def shards_in_sight(layout: Layout, seq_len: int, rank: int, mask: Mask) -> tuple[bool, ...]:
    """For each rank, whether its shard holds a key ``rank``'s queries see, i.e. whether the
    block plan between them has a tile: found for all shards at once, looking up the
    spans the queries see rather than every query (a window's far shards cost nothing)."""
    first, stop = mask.intervals(layout.positions(seq_len, rank), seq_len)
    # the union of the queries' intervals, as disjoint spans: as first and stop never decrease,
    # a span opens only past the previous query's stop (one per layout chunk or document
    # mostly; one per query where striped's are further apart than a window or a document)
    opens = torch.ones(len(first), dtype=torch.bool)
    opens[1:] = first[1:] > stop[:-1]
    closes = torch.cat([opens[1:], torch.ones(1, dtype=torch.bool)])
    keys = _every_shard(layout, seq_len)
    spans = (len(keys), int(opens.sum()))
    starts, stops = (bound.expand(spans).contiguous() for bound in (first[opens], stop[closes]))
    return tuple((torch.searchsorted(keys, stops) > torch.searchsorted(keys, starts)).any(dim=1).tolist())


@functools.lru_cache(maxsize=2)  # T int64 each: 8 MB at 1M tokens
def _every_shard(layout: Layout, seq_len: int) -> torch.Tensor:
    """(P, S): each rank's positions, ascending, a row per rank (read-only: cached for the
    planner, which asks for every rank's plan against every shard)."""
    return torch.stack([layout.positions(seq_len, src) for src in range(layout.world_size)])
