"""Tile plans: exact coverage of the visible pairs, and the shapes each layout gets."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ctxpar.blocks import (MaskKind, Tile, gathered_key_order, layout_tiles, shards_in_sight,
                           tiles_between)
from ctxpar.layout import LAYOUT_NAMES, UnionLayout, get_layout
from ctxpar.masks import Mask
from ctxpar.plan.work import rank_pairs, union_pairs


def covered(blocks: tuple[Tile, ...], sq: int, sk: int) -> torch.Tensor:
    """(Sq, Sk) count of how many blocks cover each pair, from the mask kinds' definitions."""
    hits = torch.zeros(sq, sk, dtype=torch.int64)
    for b in blocks:
        nq, nk = b.q_stop - b.q_start, b.kv_stop - b.kv_start
        a = torch.arange(nq).unsqueeze(1)
        c = torch.arange(nk).unsqueeze(0)
        visible = {
            MaskKind.FULL: torch.ones(nq, nk, dtype=torch.bool),
            MaskKind.CAUSAL: c <= a,
            MaskKind.ANTI_CAUSAL: c >= a,
            MaskKind.PARTIAL: b.visible(),
        }[b.kind]
        hits[b.q, b.kv] += visible.long()
    return hits


def brute_force(q_pos: torch.Tensor, kv_pos: torch.Tensor, causal: bool) -> torch.Tensor:
    if not causal:
        return torch.ones(len(q_pos), len(kv_pos), dtype=torch.int64)
    return (kv_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).long()


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_plans_cover_exactly_the_visible_pairs(name: str, world: int, causal: bool) -> None:
    layout = get_layout(name, world)
    seq_len = 2 * world * 6
    for r in range(world):
        for s in range(world):
            blocks = layout_tiles(layout, seq_len, r, s, Mask(causal=causal))
            want = brute_force(layout.positions(seq_len, r), layout.positions(seq_len, s), causal)
            assert torch.equal(covered(blocks, *want.shape), want), (r, s)
            assert sum(b.pairs for b in blocks) == int(want.sum())
            assert all(b.pairs > 0 for b in blocks), "blocks with nothing visible must be skipped"
        plans = [layout_tiles(layout, seq_len, r, s, Mask(causal=causal)) for s in range(world)]
        assert rank_pairs(layout, seq_len, r, Mask(causal=causal)) == sum(b.pairs for plan in plans for b in plan)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 60), min_size=1, max_size=20, unique=True),
    st.lists(st.integers(0, 60), min_size=1, max_size=20, unique=True),
)
def test_any_ascending_positions_get_an_exact_plan(q_pos: list[int], kv_pos: list[int]) -> None:
    q, kv = torch.tensor(sorted(q_pos)), torch.tensor(sorted(kv_pos))
    blocks = tiles_between(q, kv, Mask(), 61)
    assert torch.equal(covered(blocks, len(q), len(kv)), brute_force(q, kv, True))


def test_a_diagonal_of_any_length_is_one_tile() -> None:
    """Queries at the positions after a prefix of keys: one FULL tile for the prefix and one
    CAUSAL for the diagonal, however long either (the walk finds where a diagonal ends by
    comparing doubling, then halving slices: an end found a row early would still cover
    the pairs, in one tile more; one a row late, past 128 rows, ran a tile past the keys, which
    no shorter diagonal shows)."""
    lengths = itertools.chain(range(2, 140), (255, 256, 257, 511, 1023, 1100))
    for n, prefix, after in itertools.product(lengths, (0, 1, 5, 64), (0, 1, 100)):
        queries = torch.arange(prefix, prefix + n + after)  # after: rows past the keys, which see them all
        tiles = tiles_between(queries, torch.arange(prefix + n), Mask(), prefix + n + after)
        expected = (Tile(0, n, 0, prefix, MaskKind.FULL),) if prefix else ()
        expected += (Tile(0, n, prefix, prefix + n, MaskKind.CAUSAL),)
        expected += (Tile(n, n + after, 0, prefix + n, MaskKind.FULL),) if after else ()
        assert tiles == expected, (n, prefix, after)


def test_zigzag_off_diagonal_steps_are_half_size_blocks() -> None:
    layout, seq_len = get_layout("zigzag", 4), 64  # local shard 16 = two chunks of 8
    (early,) = layout_tiles(layout, seq_len, 2, 1, Mask())  # keys from an earlier rank
    assert (early.q, early.kv, early.kind) == (slice(0, 16), slice(0, 8), MaskKind.FULL)
    (late,) = layout_tiles(layout, seq_len, 1, 2, Mask())  # keys from a later rank
    assert (late.q, late.kv, late.kind) == (slice(8, 16), slice(0, 16), MaskKind.FULL)
    (diag,) = layout_tiles(layout, seq_len, 1, 1, Mask())
    assert (diag.q, diag.kv, diag.kind) == (slice(0, 16), slice(0, 16), MaskKind.CAUSAL)


def test_striped_later_ranks_give_the_shifted_causal_block() -> None:
    layout, seq_len = get_layout("striped", 4), 32
    (later,) = layout_tiles(layout, seq_len, 1, 2, Mask())  # its first query sees no key of rank 2
    assert (later.q, later.kv, later.kind) == (slice(1, 8), slice(0, 7), MaskKind.CAUSAL)
    (earlier,) = layout_tiles(layout, seq_len, 2, 1, Mask())
    assert earlier.kind is MaskKind.CAUSAL


def test_contiguous_skips_future_ranks_and_is_imbalanced() -> None:
    layout, seq_len = get_layout("contiguous", 4), 64
    assert layout_tiles(layout, seq_len, 0, 3, Mask()) == ()
    pairs = [rank_pairs(layout, seq_len, r, Mask()) for r in range(4)]
    assert sum(pairs) == seq_len * (seq_len + 1) // 2
    assert max(pairs) / (sum(pairs) / 4) == pytest.approx(1.75, abs=0.02)


@pytest.mark.parametrize("name", ["zigzag", "striped"])
def test_balanced_layouts_split_causal_work_evenly(name: str) -> None:
    layout, seq_len = get_layout(name, 4), 16384
    pairs = [rank_pairs(layout, seq_len, r, Mask()) for r in range(4)]
    assert sum(pairs) == seq_len * (seq_len + 1) // 2
    assert max(pairs) / (sum(pairs) / 4) <= 1.001


def test_malformed_blocks_are_rejected() -> None:
    with pytest.raises(ValueError):
        Tile(0, 4, 0, 3, MaskKind.CAUSAL)
    # a PARTIAL row that sees no key (its softmax empty) or runs past the keys
    for tile in (lambda: Tile(0, 2, 0, 2, MaskKind.PARTIAL, rows=((0, 0), (0, 2))),
                 lambda: Tile(0, 1, 0, 2, MaskKind.PARTIAL, rows=((0, 3),))):
        with pytest.raises(ValueError, match="malformed partial tile"):
            tile()
    with pytest.raises(ValueError, match="ascending"):
        tiles_between(torch.tensor([3, 1]), torch.tensor([0, 1]), Mask(), 4)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_gathered_keys_take_the_order_with_fewer_tiles(name: str) -> None:
    """The all-gather reads its gathered keys in arrival order (a plan per shard) or in
    position order (one plan against 0..T-1), whichever makes fewer kernel calls, ties to
    the arrival order; ``shards_in_sight`` says which shards' plans have tiles."""
    for world in (2, 3, 4, 8):
        lay = get_layout(name, world)
        seq = lay.multiple * 12
        everything = torch.arange(seq)
        arrival = torch.cat([lay.positions(seq, src) for src in range(world)])
        for mask in (Mask(), Mask(causal=False), Mask(window=seq // 5), Mask(documents=(seq // 3, seq - seq // 3))):
            for rank in range(world):
                per_shard = tuple(layout_tiles(lay, seq, rank, src, mask) for src in range(world))
                assert shards_in_sight(lay, seq, rank, mask) == tuple(bool(tiles) for tiles in per_shard)
                whole = tiles_between(lay.positions(seq, rank), everything, mask, seq)
                kind, tiles, index = gathered_key_order(lay, seq, rank, mask)
                if kind == "by_rank":
                    assert tiles == per_shard and len(whole) >= sum(map(len, per_shard))
                else:
                    assert tiles == whole and len(whole) < sum(map(len, per_shard))
                    assert torch.equal(arrival[index], everything)  # index: where each position arrived


def test_gathered_keys_in_position_order_skip_the_per_shard_plans() -> None:
    """Every shard a rank's queries see costs the arrival order a tile at least, so zigzag's
    few tiles in position order win without walking its P per-shard plans (at 256 ranks,
    the planner's sweep spent 12 s walking them)."""
    lay, seq = get_layout("zigzag", 8), 16 * 64
    gathered_key_order.cache_clear()
    layout_tiles.cache_clear()
    assert all(gathered_key_order(lay, seq, rank, Mask())[0] == "global" for rank in range(8))
    assert layout_tiles.cache_info().misses == 0


def test_the_strategies_index_tensors_reach_the_device_once_not_per_call(monkeypatch) -> None:
    """All-gather's arrival index and all-to-all's position order are copied to the kernels'
    device once per plan: a copy from the host in every call (per head group and direction)
    waits for all the GPU's queued work. Here the device is the host: the second call must
    hand back the same tensors, and the per-call steps copy nothing."""
    from ctxpar import topology
    from ctxpar.strategies import allgather, alltoall

    lay, seq, host = get_layout("zigzag", 8), 16 * 64, torch.device("cpu")
    order = allgather._key_order(lay, seq, 1, Mask(), host)
    assert order[0] == "global" and allgather._key_order(lay, seq, 1, Mask(), host)[2] is order[2]
    arrived = torch.randn(8, 2, 1, 2, seq // 8, 4)  # (P, 2, B, h, S, D)
    q = torch.randn(1, 2, 64, 4)
    alltoall.to_heads(q, q, q, get_layout("zigzag", 1), topology.from_group(None, "to_heads"))  # the first call copies
    monkeypatch.setattr(torch.Tensor, "to", lambda *args, **kwargs: pytest.fail("copied in a call"))
    keys = allgather._arrange(arrived, order)  # (2, B, h, T, D)
    assert torch.equal(allgather._by_arrival(keys, order, 8), arrived)
    (ql, _, _), _ = alltoall.to_heads(q, q, q, get_layout("zigzag", 1), topology.from_group(None, "to_heads"))
    assert torch.equal(ql, q)


def test_union_pairs_are_the_pairs_of_the_union_layout() -> None:

    layout, seq_len = get_layout("zigzag", 4), 64
    union = UnionLayout(2, layout, 2)
    for rank in range(4):
        assert union_pairs(layout, seq_len, rank, Mask(), 1) == rank_pairs(layout, seq_len, rank, Mask())
        assert union_pairs(layout, seq_len, rank, Mask(), 2) == rank_pairs(union, seq_len, rank // 2, Mask())


def _documents(draw_lengths: list[int], seq_len: int) -> tuple[int, ...] | None:
    """Cut ``seq_len`` into documents with the drawn lengths (the last one takes the rest)."""
    lengths, total = [], 0
    for n in draw_lengths:
        if total + n >= seq_len:
            break
        lengths.append(n)
        total += n
    return tuple(lengths + [seq_len - total]) if lengths else None


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(LAYOUT_NAMES),
    world=st.integers(1, 4),
    chunks=st.integers(1, 12),
    causal=st.booleans(),
    lengths=st.lists(st.integers(1, 40), max_size=12),
    window=st.one_of(st.none(), st.integers(1, 120)),
)
@example(name="contiguous", world=2, chunks=2, causal=False, lengths=[5], window=None)
def test_masked_plans_cover_exactly_the_visible_pairs(name, world, chunks, causal, lengths, window) -> None:
    """Documents (any lengths, 1-token ones included) and windows, every layout: the tiles
    cover each visible pair once and nothing else, and never an empty tile; and a shard is in
    sight (``shards_in_sight``) exactly where a query of the rank sees one of its keys. Once
    each span's last key was dropped there, a bidirectional document (5, 3) on 2 contiguous
    ranks left rank 1's key 4 out of rank 0's sight (the all-gather's output off by 0.70)."""
    layout = get_layout(name, world)
    seq_len = 2 * world * chunks
    mask = Mask(causal=causal, documents=_documents(lengths, seq_len), window=window if causal else None)
    for r in range(world):
        work, in_sight = 0, []
        for s in range(world):
            tiles = layout_tiles(layout, seq_len, r, s, mask)
            q_pos, kv_pos = layout.positions(seq_len, r), layout.positions(seq_len, s)
            want = mask.visible(q_pos, kv_pos, seq_len).long()
            assert torch.equal(covered(tiles, *want.shape), want), (r, s, tiles)
            assert all(t.pairs > 0 for t in tiles)
            work += sum(t.pairs for t in tiles)
            in_sight.append(bool(want.any()))
        assert rank_pairs(layout, seq_len, r, mask) == work
        assert shards_in_sight(layout, seq_len, r, mask) == tuple(in_sight), (r, mask)


def test_a_window_band_is_cut_into_few_large_tiles_without_explicit_masks() -> None:
    """One rank, T=4096, window 512: the band in blocks of 512 rows, each a CAUSAL triangle
    and an ANTI_CAUSAL one: no explicit mask, no pair computed that the window hides."""
    seq_len, window = 4096, 512
    positions = torch.arange(seq_len)
    tiles = tiles_between(positions, positions, Mask(window=window), seq_len)
    assert sum(t.pairs for t in tiles) == sum(min(p + 1, window) for p in range(seq_len))
    assert not any(t.kind is MaskKind.PARTIAL for t in tiles)
    assert len(tiles) <= 3 * seq_len // window + 2
    # the trailing edge of the window on another rank's keys (a halo): one triangle, not slices
    halo = tiles_between(torch.arange(1024, 2048), torch.arange(0, 1024), Mask(window=window), seq_len)
    assert [t.kind for t in halo] == [MaskKind.ANTI_CAUSAL]


def test_a_window_skips_shards_it_cannot_see() -> None:
    layout, seq_len = get_layout("contiguous", 4), 64  # 16 tokens per rank
    mask = Mask(window=8)
    assert [bool(layout_tiles(layout, seq_len, 3, s, mask)) for s in range(4)] == [False, False, True, True]


def test_documents_keep_plain_tiles() -> None:
    """Long documents cut into FULL and causal tiles only: no explicit mask."""
    layout, seq_len = get_layout("zigzag", 2), 4096
    mask = Mask(documents=(1000, 3000, 96))
    for r in range(2):
        for s in range(2):
            assert all(t.kind is not MaskKind.PARTIAL for t in layout_tiles(layout, seq_len, r, s, mask))


def test_a_staircase_is_cut_in_bands_not_a_tile_per_step() -> None:
    """A hybrid's union on the striped layout (P=4, U=2: positions 0, 1, 4, 5, ...) against
    the other union's keys sees 2 keys more every 2 rows: it was cut into a FULL tile per
    step, T/P kernel calls of 2 rows each (1023 at T=4096); now a band of rows at a time."""
    for world, u, seq_len in ((4, 2, 4096), (32, 16, 8192)):  # runs of 16 rows once stayed a tile each too
        positions = torch.arange(seq_len)
        first, second = positions[positions % world < u], positions[positions % world >= u]
        for q, kv in ((first, second), (second, first)):
            tiles = tiles_between(q, kv, Mask(), seq_len)
            assert torch.equal(covered(tiles, len(q), len(kv)), brute_force(q, kv, True))
            assert len(tiles) <= 64
            wasted = sum((t.q_stop - t.q_start) * (t.kv_stop - t.kv_start) - t.pairs for t in tiles)
            assert wasted < 0.12 * sum(t.pairs for t in tiles)  # the explicit masks' computed but unseen pairs


def test_a_partial_tiles_mask_is_made_per_call_from_cached_row_bounds() -> None:
    """Masks were cached (1024 of them, queries x keys each) and outlived the plans that made
    them: with documents redrawn every batch, 868 MiB per rank after 200 batches of a 128K ring
    plan with a window, toward 4 GiB. The cache holds each tile's row bounds, 16 bytes a row."""
    rows = tuple((r, r + 3000) for r in range(64))
    tile = Tile(0, 64, 0, 4000, MaskKind.PARTIAL, rows=rows)
    first, second = tile.visible(), tile.visible()
    assert first is not second and torch.equal(first, second) and first.shape == (64, 4000)
    assert [int(first[r].sum()) for r in (0, 63)] == [3000, 3000] and bool(first[63, 63]) and not first[63, 62]
    from ctxpar import blocks

    assert blocks._rows_bounds(rows, torch.device("cpu")).shape == (64, 2)
