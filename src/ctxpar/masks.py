"""What a query may see: one description of the attention mask, from the public call to the plan.

Every mask ctxpar supports gives each query an *interval* of visible key positions::

    query at position p, in the document that spans [start, end) of the packed row:

    causal                    keys [start, p]                  (start = 0 without documents)
    causal, window w          keys [max(start, p - w + 1), p]
    not causal                keys [start, end)                (no window: it is causal only)

Chunked attention (Llama 4: attention only within fixed-size chunks) is a document mask
whose documents are the chunks, counted from the start of each packed document (``chunked``).

The block plan (``ctxpar.blocks``) turns these intervals into kernel tiles; nothing else
needs to know which mask it is. ``Mask`` is hashable, so plans are cached per mask.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ctxpar.limits import check_flag


@dataclass(frozen=True)
class Mask:
    """causal: query at p sees no key after p. documents: the lengths of the documents
    packed into the row, in order (None: one document). window: a causal query at p sees
    only the w keys p-w+1..p (None: no limit)."""

    causal: bool = True
    documents: tuple[int, ...] | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        check_flag("causal", self.causal)
        if self.window is not None:
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
                raise ValueError(f"window must be an integer >= 1 (keys a query sees, itself included), "
                                 f"got {self.window!r}")
            if not self.causal:
                raise ValueError("window= is a causal sliding window; it needs causal=True")
        if self.documents is not None:
            ok = isinstance(self.documents, tuple) and self.documents and (
                all(type(n) is int for n in self.documents)  # the common case, fast: masks are made per call
                or all(isinstance(n, int) and not isinstance(n, bool) for n in self.documents)
            ) and min(self.documents) >= 1
            if not ok:
                raise ValueError(f"Mask.documents must be a non-empty tuple of lengths >= 1 (make_mask and "
                                 f"document_lengths also take cu_seqlens), got {self.documents!r}")

    @property
    def is_plain(self) -> bool:
        """Plain (non-)causal attention over the whole row: no documents, no window."""
        return self.documents is None and self.window is None

    def check(self, seq_len: int) -> None:
        """ValueError unless this mask describes a row of ``seq_len`` tokens."""
        if self.documents is not None and sum(self.documents) != seq_len:
            raise ValueError(f"the document lengths sum to {sum(self.documents)} but the sequence has "
                             f"{seq_len} tokens; documents= must cover the whole packed row")

    def intervals(self, positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, stop) int64 tensors like ``positions``: query at p sees keys first <= key < stop."""
        self.check(seq_len)  # documents that do not cover the row: a clear error, not an IndexError
        p = positions.to(torch.int64)
        if self.documents is None:
            first, end = torch.zeros_like(p), torch.full_like(p, seq_len)
        else:
            bounds = torch.tensor(list(itertools.accumulate(self.documents)), dtype=torch.int64)
            doc = torch.searchsorted(bounds, p, right=True)  # document index of each position
            end = bounds[doc]
            first = end - torch.tensor(self.documents, dtype=torch.int64)[doc]
        if not self.causal:
            return first, end
        if self.window is not None:
            first = torch.maximum(first, p - self.window + 1)
        return first, p + 1

    def keys_seen(self, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
        """(S,) int64: how many keys the query at each position sees (its attention work)."""
        first, stop = self.intervals(positions, seq_len)
        return stop - first

    def visible(self, q_positions: torch.Tensor, kv_positions: torch.Tensor, seq_len: int) -> torch.Tensor:
        """(Sq, Sk) bool: whether each query sees each key. O(Sq*Sk): for tests and tiles."""
        first, stop = self.intervals(q_positions, seq_len)
        kv = kv_positions.to(torch.int64).unsqueeze(0)
        return (kv >= first.unsqueeze(1)) & (kv < stop.unsqueeze(1))


def positions_in_documents(positions: torch.Tensor, documents: tuple[int, ...] | None) -> torch.Tensor:
    """Each global position's offset within its document (RoPE restarts at each document);
    ``positions`` themselves without documents."""
    if documents is None:
        return positions
    bounds = torch.tensor(list(itertools.accumulate(documents)), dtype=torch.int64, device=positions.device)
    doc = torch.searchsorted(bounds, positions, right=True)
    return positions - (bounds[doc] - torch.tensor(documents, device=positions.device)[doc])


# documents= given per row
_ONE_PACKING = ("one packing describes every row of the batch alike; rows packed otherwise go one forward per row "
                "(B=1), each with its own documents=")


def integer_values(documents) -> list[int]:
    """``documents`` as Python ints: a sequence, or a 1-D numpy array or tensor, of integers
    (numpy's integers and 0-d integer tensors included), non-empty. ValueError for anything
    else: a set or an iterator too (no order to read lengths in)."""
    if hasattr(documents, "__array__") and not isinstance(documents, torch.Tensor):  # a numpy array
        documents = _as_tensor(documents, "documents= must be lengths or cu_seqlens")
    if isinstance(documents, torch.Tensor):
        if documents.dim() > 1:
            raise ValueError(f"documents= must be a 1-D integer tensor or array, got shape "
                             f"{tuple(documents.shape)}: {_ONE_PACKING}")
        if documents.dim() != 1 or documents.dtype.is_floating_point or documents.dtype == torch.bool:
            raise ValueError(f"documents= must be a 1-D integer tensor or array, got {documents.dtype} of shape "
                             f"{tuple(documents.shape)}")
        if documents.is_meta:
            raise ValueError("documents= is a tensor on the meta device, which holds no values: pass the lengths")
        documents = documents.tolist()
    if not isinstance(documents, Sequence) or isinstance(documents, (str, bytes)) or not documents:
        raise ValueError(f"documents= must be a non-empty sequence of document lengths or cu_seqlens, "
                         f"got {documents!r}")
    values = list(documents)
    if not all(type(x) is int for x in values):  # plain ints (a tensor's tolist()) pass here, fast
        # numpy's integers, and the 0-d tensors list(cu_seqlens) holds, as window= takes one
        if not all(_is_integer(x) or _integer_scalar(x) for x in values):
            nested = any(isinstance(x, (Sequence, torch.Tensor)) or hasattr(x, "__array__") for x in values)
            raise ValueError(f"documents= must hold integers, got {values[:8]}"
                             + (f": {_ONE_PACKING}" if nested else ""))
        values = [int(x) for x in values]
    return values


def document_lengths(documents, seq_len: int) -> tuple[int, ...]:
    """Document lengths from what a user passes: lengths (a sequence or 1-D tensor summing
    to ``seq_len``) or ``cu_seqlens`` (a 1-D tensor or sequence starting at 0 and ending
    at ``seq_len``, as flash-attn's varlen functions take), numpy's integers and arrays
    and 0-d integer tensors included. ValueError for anything else."""
    values = integer_values(documents)
    if values[0] == 0:  # cu_seqlens: a document can't have length 0, so a leading 0 says which
        if values[-1] != seq_len:
            read_as = (f"; read as lengths (they sum to {seq_len}), it holds an empty document, which has no tokens"
                       if sum(values) == seq_len else "")
            raise ValueError(f"documents= starting with 0 is read as cu_seqlens, which must end at the sequence length "
                             f"{seq_len}, got {values[-8:]}{read_as}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if not lengths or any(n <= 0 for n in lengths):
            raise ValueError(f"cu_seqlens must be strictly increasing from 0 to {seq_len}, got {values[:8]}")
        return tuple(lengths)
    if any(n <= 0 for n in values):
        raise ValueError(f"document lengths must be >= 1, got {values[:8]}; an empty document has no tokens")
    if sum(values) != seq_len:
        raise ValueError(f"the document lengths sum to {sum(values)} but the sequence has {seq_len} tokens; "
                         f"documents= must cover the whole packed row (lengths, or cu_seqlens from 0 to {seq_len})")
    return tuple(values)


def chunked(seq_len: int, chunk: int, documents: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Document lengths for chunked attention (Llama 4): each document (the whole row if
    ``documents`` is None) cut into chunks of ``chunk`` tokens counted from its own start,
    the last one shorter, as transformers does for a packed row."""
    if not _is_integer(seq_len) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1 (tokens in the row), got {seq_len!r}")
    if not _is_integer(chunk) or chunk < 1:
        raise ValueError(f"chunk size must be an integer >= 1, got {chunk!r}")
    seq_len, chunk = int(seq_len), int(chunk)
    lengths = (seq_len,) if documents is None else document_lengths(documents, seq_len)
    return tuple(min(chunk, n - start) for n in lengths for start in range(0, n, chunk))


def make_mask(seq_len: int, *, causal, documents=None, window=None) -> Mask:
    """The ``Mask`` for a public call: every argument checked (ValueError naming it), and
    put in one canonical form, so that equal masks compare (and cache) equal: a window of
    T or more is no window, one document is none."""
    if hasattr(window, "__array__") and not isinstance(window, torch.Tensor):  # a numpy array
        window = _as_tensor(window, "window must be an integer")
    if _is_integer(window) or _integer_scalar(window):
        window = int(window)  # numpy's too, and a 0-d integer tensor or array as documents= takes them
    Mask(causal=causal, window=window)  # checks causal and window before they are compared
    lengths = None if documents is None else document_lengths(documents, seq_len)
    if window is not None and window >= seq_len:
        window = None  # sees everything causal attention does
    return Mask(causal=causal, documents=lengths if lengths and len(lengths) > 1 else None, window=window)


def _is_integer(x) -> bool:
    """A Python or numpy integer; not a bool (numpy's bool is no Integral)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _integer_scalar(x) -> bool:
    """A 0-d integer tensor holding a value (not a bool, not on the meta device)."""
    return (isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_meta and not x.dtype.is_floating_point
            and not x.dtype.is_complex and x.dtype != torch.bool)


def _as_tensor(array, expected: str) -> torch.Tensor:
    try:
        return torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{expected}, got an array torch cannot read: {e}") from None
