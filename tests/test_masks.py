"""The mask description: intervals, what users may pass, chunked attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar.masks import Mask, chunked, document_lengths, make_mask, positions_in_documents


def test_intervals_follow_documents_and_the_window() -> None:
    mask = Mask(documents=(3, 5), window=2)
    first, stop = mask.intervals(torch.arange(8), 8)
    assert first.tolist() == [0, 0, 1, 3, 3, 4, 5, 6]
    assert stop.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    first, stop = Mask(causal=False, documents=(3, 5)).intervals(torch.arange(8), 8)
    assert (first.tolist(), stop.tolist()) == ([0, 0, 0, 3, 3, 3, 3, 3], [3, 3, 3, 8, 8, 8, 8, 8])


def test_intervals_are_the_definition_for_random_documents_and_windows() -> None:
    """Every exactness test's reference reads the mask through Mask.intervals: here they are
    held to the definition itself (same document, causal, fewer than window apart), built
    densely without them (one key too many under documents and a window passed all but one
    hand-written case)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        seq = int(torch.randint(1, 40, (1,), generator=gen))
        cuts = sorted(set(torch.randint(1, seq + 1, (int(torch.randint(0, 5, (1,), generator=gen)),),
                                        generator=gen).tolist()) | {seq})
        lengths = tuple(b - a for a, b in zip([0, *cuts], cuts))
        window = int(torch.randint(1, seq + 2, (1,), generator=gen))
        causal = bool(torch.randint(0, 2, (1,), generator=gen)) or window <= seq  # a window is causal
        document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
        dense = (document[:, None] == document[None, :]) & ((j <= i) & (i - j < window) if causal else True)
        mask = Mask(causal=causal, documents=lengths if len(lengths) > 1 else None,
                    window=window if causal else None)
        first, stop = mask.intervals(torch.arange(seq), seq)
        got = (j >= first[:, None]) & (j < stop[:, None])
        assert torch.equal(got, dense), (lengths, window, causal)


@pytest.mark.parametrize("window", [15, 16, 17])
def test_a_window_near_the_sequence_length_is_canonical_only_from_t(window: int) -> None:
    """make_mask drops a window of T or more (it sees all causal attention does); one of T-1
    still hides key 0 from the last query (a window of T-1 taken for none: 0.38 off, silently)."""
    mask = make_mask(16, causal=True, window=window)
    assert (mask.window is None) == (window >= 16)  # canonical: ranks passing 16 and None compare equal
    first, stop = mask.intervals(torch.arange(16), 16)
    assert stop.tolist() == list(range(1, 17))
    assert first.tolist() == [max(0, i - window + 1) for i in range(16)]


def test_documents_that_do_not_cover_the_row_are_refused_by_every_plan() -> None:
    """The block plan's entries take the mask and T separately: documents summing to another
    length get the mask's own message, not an IndexError from deep in the walk."""
    from ctxpar.blocks import gathered_key_order, layout_tiles, shards_in_sight, tiles_between
    from ctxpar.layout import get_layout

    lay, mask = get_layout("zigzag", 2), Mask(documents=(10, 20))
    for plan in (lambda: tiles_between(torch.arange(8), torch.arange(8), mask, 64),
                 lambda: layout_tiles(lay, 64, 0, 1, mask), lambda: shards_in_sight(lay, 64, 0, mask),
                 lambda: gathered_key_order(lay, 64, 1, mask), lambda: mask.intervals(torch.arange(64), 64)):
        with pytest.raises(ValueError, match="document lengths sum to 30 but the sequence has 64 tokens"):
            plan()


def test_documents_as_lengths_cu_seqlens_or_tensors() -> None:
    assert document_lengths([3, 5], 8) == (3, 5)
    assert document_lengths([0, 3, 8], 8) == (3, 5)  # cu_seqlens: a length is never 0
    assert document_lengths(torch.tensor([0, 3, 8]), 8) == (3, 5)
    assert document_lengths(list(torch.tensor([0, 3, 8], dtype=torch.int32)), 8) == (3, 5)  # 0-d tensors: refused
    assert make_mask(8, causal=True, documents=[8]).documents is None  # one document is none
    assert make_mask(8, causal=True, window=8).window is None  # a window of T sees what causal sees
    assert positions_in_documents(torch.tensor([2, 3, 7]), (3, 5)).tolist() == [2, 0, 4]


def test_numpy_integers_and_arrays_are_taken_as_python_integers_are() -> None:
    """cu_seqlens are often built with numpy: its integers and integer arrays mean what
    Python's do; its floats and bools are refused as Python's are. A 0-d integer tensor is a
    window as documents= takes tensors."""
    assert document_lengths(np.array([0, 3, 8]), 8) == (3, 5)
    assert document_lengths(np.array([3, 5], dtype=np.int16), 8) == (3, 5)
    assert document_lengths([np.int64(3), np.int32(5)], 8) == (3, 5)
    assert all(type(n) is int for n in document_lengths([np.int64(3), np.int32(5)], 8))
    assert make_mask(8, causal=True, window=np.int64(3)) == make_mask(8, causal=True, window=3)
    assert chunked(np.int64(20), np.int64(8), np.array([5, 15])) == chunked(20, 8, (5, 15))
    for documents in (np.array([3.0, 5.0]), np.array([True, False]), [np.bool_(True)] * 8, np.array(["3", "5"])):
        with pytest.raises(ValueError, match="documents="):
            document_lengths(documents, 8)
    for window in (np.bool_(True), np.float64(3.0), torch.tensor(3.0), torch.tensor(True), torch.tensor([3])):
        with pytest.raises(ValueError, match="window must be an integer"):
            make_mask(8, causal=True, window=window)
    assert make_mask(8, causal=True, window=torch.tensor(3)) == make_mask(8, causal=True, window=3)  # as documents=
    assert make_mask(8, causal=True, window=np.array(3)) == make_mask(8, causal=True, window=3)  # and numpy's 0-d
    for window in (np.array([3]), np.array(3.0)):
        with pytest.raises(ValueError, match="window must be an integer"):
            make_mask(8, causal=True, window=window)


@pytest.mark.parametrize("kwargs, message", [
    (dict(causal=False, window=4), "needs causal=True"),
    (dict(window=0), "window must be an integer >= 1"),
    (dict(window=True), "window must be an integer >= 1"),
    (dict(window=2.0), "window must be an integer >= 1"),
    (dict(documents=(0, 8)), "lengths >= 1"),
    (dict(documents=[3, 5]), "tuple"),
    (dict(causal=1), "causal must be True or False"),
])
def test_a_mask_refuses_what_cannot_be_one(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        Mask(**kwargs)


@pytest.mark.parametrize("documents, message", [
    ([3.0, 5.0], "integers"), ([3, -1, 6], ">= 1"), ([0, 3, 7], "end at the sequence length 8"),
    ([0, 5, 3, 8], "strictly increasing"), (torch.tensor([[3, 5]]), "1-D integer tensor"), ("35", "sequence"),
    (list(torch.tensor([3.0, 5.0])), "integers"), ([torch.tensor(3), torch.tensor([5])], "integers"),
    # an empty first document reads as cu_seqlens: the message says both readings (once only the first)
    ([0, 3, 5], "sum to 8.*it holds an empty document"),
    (torch.tensor([3, 5], device="meta"), "on the meta device"),  # once torch's NotImplementedError
    # a packing per row: once only "must hold integers", not that one packing goes for every row
    ([[3, 5], [4, 4]], "must hold integers.*one packing describes every row"),
    (torch.tensor([[3, 5], [4, 4]]), "got shape \\(2, 2\\): one packing describes every row"),
    ([3.0, 5.0], "integers, got \\[3.0, 5.0\\]$"),  # not a packing per row
])
def test_document_lengths_refuse_what_a_hurried_user_passes(documents, message) -> None:
    with pytest.raises(ValueError, match=message):
        document_lengths(documents, 8)


def test_chunks_count_from_each_document_start_as_transformers_does() -> None:
    assert chunked(20, 8) == (8, 8, 4)
    assert chunked(16, 8, (5, 11)) == (5, 8, 3)  # not (5, 3, 8): chunks restart with the document
    with pytest.raises(ValueError, match="chunk size"):
        chunked(16, 0)
    for seq_len in (0, -5, 24.5, True):  # once () for 0 and -5, and a TypeError for 24.5
        with pytest.raises(ValueError, match="seq_len must be an integer >= 1"):
            chunked(seq_len, 4)
