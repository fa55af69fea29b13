"""Sequence layouts: which global token positions each rank of a CP group holds.

A layout maps a sequence of T tokens onto P ranks, T/P tokens each. Every rank's
positions are returned in ascending order, so a rank's local tokens keep their
relative order (the block plan relies on it). Example for T=16, P=4::

    contiguous  rank 0: 0 1 2 3      rank 1: 4 5 6 7      ...  rank 3: 12 13 14 15
    zigzag      rank 0: 0 1 14 15    rank 1: 2 3 12 13    ...  rank 3: 6 7 8 9
    striped     rank 0: 0 4 8 12     rank 1: 1 5 9 13     ...  rank 3: 3 7 11 15

Under causal attention a contiguous split gives the last rank (2P-1)/P times the mean
work; zigzag (2P chunks, rank r holds chunks r and 2P-1-r) and striped (token t on rank
t mod P) give every rank an equal share of early and late positions.

A rank of a layout is a rank in the CP group, ``dist.get_rank(group)`` (under a hybrid
mesh ``ctxpar.hybrid_rank(mesh)``): torch numbers a group's ranks by ascending global
rank, whatever order ``new_group`` was given them in (``new_group([3, 1])``: global rank 1
is the group's rank 0); for the group of a dim of a mesh built by ``init_device_mesh``,
that is ``mesh.get_local_rank("cp")``.
"""

from __future__ import annotations

import array
import functools
import hashlib
import math
import warnings
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ctxpar.limits import MAX_COUNT, whole
from ctxpar.masks import Mask, make_mask

LAYOUT_NAMES = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Layout(ABC):
    """Base class: subclasses say which positions a rank holds and what T must divide by.

    ctxpar.attention checks a subclass's deal before anything is sent (``checked_deal``:
    each rank's positions ascending, together 0..T-1 once each; O(T), once per layout and
    T), and compares it across ranks; ctxpar's own layouts are compared by name. The deal
    checked is kept for that layout object and T, so ``_positions`` must be a pure function
    of (seq_len, rank), as layouts are frozen: one that reads state changed between calls
    would have ``shard`` deal the new way while attention runs the old.

    Args:
        world_size: P, the number of ranks in the CP group.
    """

    world_size: int

    name = "layout"
    multiple_formula = "P"  # how ``multiple`` is written in error messages

    def __post_init__(self) -> None:
        world_size = whole(self.world_size)
        if world_size is None or not 1 <= world_size <= MAX_COUNT:
            raise ValueError(f"world_size must be a positive int up to {MAX_COUNT}, got {self.world_size!r}")
        object.__setattr__(self, "world_size", world_size)

    # -- what subclasses define -------------------------------------------------------
    @property
    def multiple(self) -> int:
        """The sequence length must be a multiple of this."""
        return self.world_size

    @abstractmethod
    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        """Ascending global positions of ``rank`` (int64, T/P of them), the same for the same
        arguments every call; ``seq_len`` is already validated."""

    # -- shared behaviour ---------------------------------------------------------------
    def validate(self, seq_len: int) -> None:
        """Raise ValueError unless ``seq_len`` splits evenly under this layout."""
        _check_length(seq_len)
        m = self.multiple
        if seq_len <= 0:
            what = "an empty sequence (length 0)" if seq_len == 0 else f"sequence length {seq_len}"
            raise ValueError(f"{what} cannot be split: the {self.name} layout with P={self.world_size} ranks takes "
                             f"a positive multiple of {self.multiple_formula}={m} tokens")
        if seq_len % m:
            up, down = max(m, -(-seq_len // m) * m), seq_len // m * m
            fixes = [f"pad to {up}"] if up <= MAX_COUNT else []  # no fix that is refused in turn
            fixes += [f"trim to {down}"] if down > 0 else []
            raise ValueError(
                f"sequence length {seq_len} is not a multiple of {self.multiple_formula}={m} "
                f"required by the {self.name} layout with P={self.world_size} ranks; "
                f"{' or '.join(fixes)}"
            )

    def local_len(self, seq_len: int) -> int:
        self.validate(seq_len)
        return int(seq_len) // self.world_size

    def runs(self, seq_len: int, rank: int) -> tuple[tuple[int, int, int], ...] | None:
        """``rank``'s positions as ascending arithmetic runs (first, count, step), for work
        counted without listing them (the planner's pairs per rank); None where the layout
        does not give them so (a union, a deal, a layout of one's own)."""
        return None

    def positions(self, seq_len: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions held by ``rank``, ascending, int64 of shape (T/P,).

        Use them for RoPE and for any mask that depends on absolute position.
        """
        if whole(rank) is not None and not 0 <= rank < self.world_size and whole(seq_len) is not None \
                and 0 <= seq_len < self.world_size:  # shard(x, rank, ...) takes the rank first
            raise ValueError(f"rank {rank} is outside the {self.name} layout's P={self.world_size} ranks and "
                             f"seq_len {seq_len} would be one of them: positions takes (seq_len, rank); were they "
                             f"swapped?")
        self.validate(seq_len)
        held = self._positions(int(seq_len), self._check_rank(rank))
        if not isinstance(held, torch.Tensor) or held.is_meta:  # a list, an array: '... has no attribute to'
            what = "a tensor on meta" if isinstance(held, torch.Tensor) else type(held).__name__
            raise ValueError(f"the {self.name} layout's positions for rank {rank} of a sequence of {seq_len} must "
                             f"be an int64 tensor of T/P = {self.local_len(seq_len)} positions, got {what}")
        return held.to(device)

    def shard(self, x: torch.Tensor, rank: int, *, dim: int | None = None) -> torch.Tensor:
        """The part of ``x`` (global length T along ``dim``) that ``rank`` holds: its rank in
        the CP group, ``dist.get_rank(group)`` (the module's docstring: not its place in the
        list given to ``new_group``).

        ``dim`` is the sequence dim and has no default, because the library's tensors put
        it in different places: 2 for attention inputs (B, H, T, D), 1 for tokens (B, T)
        and hidden states (B, T, C). A wrong guess would silently shard another dim.
        """
        dim = _sequence_dim(x, dim, "shard")
        idx = self.positions(x.shape[dim], rank, device=x.device)
        return x.index_select(dim, idx)

    def unshard(self, pieces: list[torch.Tensor] | tuple[torch.Tensor, ...], *, dim: int | None = None) -> torch.Tensor:
        """Inverse of ``shard``: the P local pieces (in rank order) back to the global tensor."""
        if isinstance(pieces, torch.Tensor):  # iterating it would take its first dim for the ranks
            raise ValueError(f"unshard takes the {self.world_size} pieces as a list (one per rank), got one "
                             f"{tuple(pieces.shape)} tensor")
        pieces = list(pieces)
        if len(pieces) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} pieces (one per rank), got {len(pieces)}")
        if not all(isinstance(p, torch.Tensor) for p in pieces):
            raise ValueError(f"unshard pieces must be tensors, got {[type(p).__name__ for p in pieces]}")
        dim = _sequence_dim(pieces[0], dim, "unshard")
        if any(p.shape != pieces[0].shape for p in pieces):
            raise ValueError(f"unshard pieces differ in shape: {[tuple(p.shape) for p in pieces]}")
        if any(p.dtype != pieces[0].dtype or p.device != pieces[0].device for p in pieces):
            raise ValueError(f"unshard pieces differ in dtype or device: "
                             f"{[(str(p.dtype), str(p.device)) for p in pieces]}")
        seq_len = pieces[0].shape[dim] * self.world_size
        shape = list(pieces[0].shape)
        shape[dim] = seq_len
        out = pieces[0].new_empty(shape)
        for rank, piece in enumerate(pieces):
            out.index_copy_(dim, self.positions(seq_len, rank, device=piece.device), piece)
        return out

    def _check_rank(self, rank: int) -> int:
        """``rank`` as an int, if it is one of this layout's ranks."""
        index = whole(rank)
        if index is None:
            raise ValueError(f"rank must be an int, got {rank!r}")
        if not 0 <= index < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.name} layout's {self.world_size} ranks")
        return index


def _check_length(seq_len) -> None:
    if whole(seq_len) is None:  # a float length would give float positions, inexact beyond 2**24
        raise ValueError(f"the sequence length must be an int, got {seq_len!r}")
    if seq_len > MAX_COUNT:
        raise ValueError(f"sequence length {seq_len} is beyond the {MAX_COUNT} tokens ctxpar counts")


def _sequence_dim(x: torch.Tensor, dim: int | None, what: str) -> int:
    """``dim`` checked against ``x`` and made non-negative."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        got = "a 0-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} takes a tensor with a sequence dim, got {got}")
    if dim is None:
        raise ValueError(
            f"{what} needs dim=, the sequence dim of the {tuple(x.shape)} tensor: dim=2 for attention inputs "
            f"(B, H, T, D), dim=1 for tokens (B, T) or hidden states (B, T, C)"
        )
    index = whole(dim)
    if index is None or not -x.dim() <= index < x.dim():
        raise ValueError(f"dim={dim!r} is not a dim of the {x.dim()}-D tensor {tuple(x.shape)}")
    return index % x.dim()


@dataclass(frozen=True)
class _RunsLayout(Layout):
    """A layout whose ranks hold arithmetic runs of positions (``_runs``), listed from them."""

    @abstractmethod
    def _runs(self, seq_len: int, rank: int) -> tuple[tuple[int, int, int], ...]:
        """(first, count, step) of each run ``rank`` holds, ascending; ``seq_len`` validated."""

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        return torch.cat([torch.arange(first, first + count * step, step) for first, count, step in
                          self._runs(seq_len, rank)])

    def runs(self, seq_len: int, rank: int) -> tuple[tuple[int, int, int], ...] | None:
        if type(self)._positions is not _RunsLayout._positions:  # a subclass that deals otherwise
            return None
        self.validate(seq_len)
        return self._runs(int(seq_len), self._check_rank(rank))


@dataclass(frozen=True)
class ContiguousLayout(_RunsLayout):
    """Rank r holds tokens [r*T/P, (r+1)*T/P). Causal work grows with r."""

    name = "contiguous"

    def _runs(self, seq_len: int, rank: int) -> tuple[tuple[int, int, int], ...]:
        n = seq_len // self.world_size
        return ((rank * n, n, 1),)


@dataclass(frozen=True)
class ZigzagLayout(_RunsLayout):
    """2P chunks of T/(2P); rank r holds chunk r and chunk 2P-1-r. One rank holds all of any T:
    it splits nothing, so it asks for no even length."""

    name = "zigzag"

    @property
    def multiple_formula(self) -> str:  # type: ignore[override]
        return "2*P" if self.world_size > 1 else "P"

    @property
    def multiple(self) -> int:
        return 2 * self.world_size if self.world_size > 1 else 1

    def _runs(self, seq_len: int, rank: int) -> tuple[tuple[int, int, int], ...]:
        if self.world_size == 1:
            return ((0, seq_len, 1),)
        c = seq_len // (2 * self.world_size)
        return ((rank * c, c, 1), ((2 * self.world_size - 1 - rank) * c, c, 1))


@dataclass(frozen=True)
class StripedLayout(_RunsLayout):
    """Token t lives on rank t mod P (round-robin)."""

    name = "striped"

    def _runs(self, seq_len: int, rank: int) -> tuple[tuple[int, int, int], ...]:
        return ((rank, seq_len // self.world_size, self.world_size),)


@dataclass(frozen=True)
class UnionLayout(Layout):
    """``base`` seen through unions of ``span`` consecutive ranks: rank j of this layout holds
    the positions of ``base`` ranks j*U .. j*U+U-1 (U = span), ascending.

    The hybrid strategy uses it: after the all-to-all among U ranks, those U ranks hold the
    tokens of all U together (for H/U heads each), and the ring runs between such unions
    as if they were the ranks of this layout.
    """

    base: Layout
    span: int

    name = "union"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base.world_size != self.world_size * self.span:
            raise ValueError(
                f"{self.world_size} unions of {self.span} ranks do not cover the "
                f"{self.base.world_size} ranks of the {self.base.name} layout"
            )

    @property
    def multiple(self) -> int:
        return self.base.multiple

    @property
    def multiple_formula(self) -> str:  # type: ignore[override]
        return self.base.multiple_formula

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        members = range(rank * self.span, (rank + 1) * self.span)
        return torch.sort(torch.cat([self.base.positions(seq_len, m) for m in members])).values


@dataclass(frozen=True)
class OneLengthLayout(Layout):
    """A layout made for one sequence length, which alone it splits."""

    seq_len: int = 0

    other_length_fix = ""  # what a refusal of another length suggests

    @property
    def multiple(self) -> int:
        return self.seq_len

    def validate(self, seq_len: int) -> None:
        _check_length(seq_len)
        if seq_len != self.seq_len:
            raise ValueError(f"the {self.name} layout was built for sequence length {self.seq_len}, not "
                             f"{seq_len}{self.other_length_fix}")


@dataclass(frozen=True)
class BalancedLayout(OneLengthLayout):
    """Equal tokens and (nearly) equal attention work per rank under any mask: for packed
    documents of any lengths, sliding windows, or both.

    The row of ``seq_len`` tokens is cut into ``chunks`` equal chunks per rank, and the
    chunks are dealt out heaviest first, each to the rank with the least work so far that
    still has room (a chunk's work: the keys its queries see under ``mask``). Zigzag is
    the fixed deal of 2 chunks per rank that balances plain causal attention; documents
    make work uneven along the row in ways no fixed deal follows. ``chunks`` (0: chosen)
    is the fewest chunks per rank (2 to 64, dividing T/P) that bring the busiest rank within
    ``tolerance`` of the mean (fewer, longer chunks: fewer, larger kernel tiles); a warning
    says when none does (T/P with few divisors). Any document lengths: nothing has to be a
    multiple of P; T only needs P chunks of equal size.

    Build it with ``balanced_layout``; every rank must build the same one.
    """

    mask: Mask = Mask()
    chunks: int = 0
    tolerance: float = 1.01

    name = "balanced"
    other_length_fix = "; build one for this length (balanced_layout)"

    def __post_init__(self) -> None:
        super().__post_init__()
        seq_len, chunks = whole(self.seq_len), whole(self.chunks)
        if seq_len is None:
            raise ValueError(f"a balanced layout's seq_len (the sequence length it balances) must be an integer, got "
                             f"{self.seq_len!r} (a {type(self.seq_len).__name__})")
        if seq_len < self.world_size:
            raise ValueError(f"a balanced layout needs the sequence length it balances (>= P={self.world_size}), "
                             f"got seq_len={self.seq_len!r}")
        if chunks is None or chunks < 0:
            raise ValueError(f"chunks must be an integer >= 1 (chunks per rank), or 0 to choose, got {self.chunks!r}")
        object.__setattr__(self, "seq_len", seq_len)
        object.__setattr__(self, "chunks", chunks)
        if not isinstance(self.mask, Mask):
            raise ValueError(f"mask must be a ctxpar.masks.Mask (balanced_layout makes one from documents= and "
                             f"window=), got {type(self.mask).__name__}")
        self.mask.check(self.seq_len)
        if self.seq_len % self.world_size:
            raise ValueError(f"sequence length {self.seq_len} is not a multiple of P={self.world_size} ranks; "
                             f"pad to {-(-self.seq_len // self.world_size) * self.world_size}")
        if self.chunks and (self.seq_len // self.world_size) % self.chunks:
            raise ValueError(f"chunks={self.chunks} does not divide the {self.seq_len // self.world_size} tokens "
                             f"of each rank")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or not self.tolerance >= 1:
            raise ValueError(f"tolerance must be a number >= 1 (the busiest rank's work over the mean), "
                             f"got {self.tolerance!r}")
        _deal(self)  # now, so that a deal out of tolerance is said where the layout is built

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        return _deal(self)[1][rank].clone()  # the cached deal must not change under a caller's in-place edit

    @property
    def chunks_per_rank(self) -> int:
        return _deal(self)[0]

    @property
    def fingerprint(self) -> str:
        owners = _deal(self)[2]
        return f"{self.name}/{self.world_size}/{zlib.crc32(array.array('I', owners).tobytes())}"


@functools.lru_cache(maxsize=64)
def _deal(layout: BalancedLayout) -> tuple[int, tuple[torch.Tensor, ...], tuple[int, ...]]:
    """(chunks per rank, each rank's positions, each chunk's owner) of a balanced layout."""
    world, seq_len = layout.world_size, layout.seq_len
    work = layout.mask.keys_seen(torch.arange(seq_len), seq_len).to(torch.float64)
    local = seq_len // world
    options = [layout.chunks] if layout.chunks else [n for n in range(2, 65) if local % n == 0] or [1]
    best = None
    for n in options:
        per_chunk = work.view(world * n, -1).sum(1).tolist()
        load, room, owners = [0.0] * world, [n] * world, [0] * (world * n)
        for c in sorted(range(world * n), key=lambda i: (-per_chunk[i], i)):
            r = min((r for r in range(world) if room[r]), key=lambda r: (load[r], r))
            owners[c], load[r], room[r] = r, load[r] + per_chunk[c], room[r] - 1
        imbalance = max(load) / (sum(load) / world)
        if best is None or imbalance < best[0] - 1e-12:
            best = (imbalance, n, owners)
        if imbalance <= layout.tolerance:
            break
    imbalance, n, owners = best
    if imbalance > layout.tolerance:
        if layout.chunks:
            tried = f"with chunks={n} of {local // n} tokens per rank"
        elif options == [1]:
            tried = (f"T/P={local} has no divisor from 2 to 64, so each rank took one chunk; a length whose T/P has "
                     f"some balances better")
        else:  # the finest chunks tried came no closer: the deal is as even as equal, whole chunks get
            tried = (f"of {len(options)} chunk counts per rank (the divisors of T/P={local} from 2 to "
                     f"{options[-1]}), {n} chunks of {local // n} tokens came closest")
        warnings.warn(f"the balanced layout leaves the busiest rank {imbalance:.3f}x the mean work (tolerance "
                      f"{layout.tolerance}): {tried}; pass tolerance={math.ceil(imbalance * 1000) / 1000} to accept "
                      f"this deal without a warning",
                      stacklevel=5)  # balanced_layout's caller, through __init__ and __post_init__
    size = local // n
    positions = tuple(torch.cat([torch.arange(c * size, (c + 1) * size) for c in range(world * n) if owners[c] == r])
                      for r in range(world))
    return n, positions, tuple(owners)


def balanced_layout(world_size: int, seq_len: int, *, causal: bool = True, documents=None, window=None,
                    chunks: int = 0, tolerance: float = BalancedLayout.tolerance) -> BalancedLayout:
    """A ``BalancedLayout`` for a row of ``seq_len`` tokens attended to with this mask (the
    same ``documents=`` / ``window=`` the attention calls take)."""
    return BalancedLayout(world_size, seq_len, make_mask(seq_len, causal=causal, documents=documents, window=window),
                          chunks, tolerance)


@dataclass(frozen=True)
class DealtLayout(OneLengthLayout):
    """A layout of the user's as ctxpar runs it for one sequence length: its deal, checked
    (``checked_deal``), which its equality and hash compare. The block plans are cached by
    layout, and a subclass's own equality need not cover its deal: two instances dealing
    otherwise, their deal set outside their dataclass fields, compared equal, and the second
    ran the first one's plan (errors up to 2).

    Made by ``as_checked``; ``deal`` is every rank's positions, rank after rank.
    """

    digest: str = ""  # of the deal
    label: str = field(default="layout", compare=False)  # the user's layout's name, for messages
    deal: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        local = seq_len // self.world_size
        return self.deal[rank * local:(rank + 1) * local].clone()  # the deal must not change under an edit

    @property
    def fingerprint(self) -> str:
        return f"{self.name}/{self.world_size}/{self.digest}"


def as_checked(layout: Layout, seq_len: int) -> Layout:
    """The layout that ``attention`` runs for a sequence of ``seq_len``: one of ctxpar's own as
    it is, a layout defined outside ctxpar as the ``DealtLayout`` of its deal once
    ``checked_deal`` has checked it (O(T), once per layout and length)."""
    if type(layout) in _OWN_LAYOUTS:
        return layout
    key = (id(layout), int(seq_len))
    known = _CHECKED.get(key)
    if known is None or known[0] is not layout:
        deal = checked_deal(layout, seq_len)
        digest = hashlib.blake2b(deal.numpy().tobytes(), digest_size=16).hexdigest()
        known = (layout, DealtLayout(layout.world_size, int(seq_len), digest, layout.name, deal))
        if len(_CHECKED) >= 4:  # each holds a (T,) deal: 8 MB at 1M tokens
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = known
    return known[1]


# a user's layout's checked deal per (layout, T), by identity: every layer calls attention with
# the same layout. Layouts are frozen, so a deal checked stays right; the entry holds the layout,
# so its id is not reused while it is here
_CHECKED: dict[tuple[int, int], tuple[Layout, DealtLayout]] = {}


def fingerprint(layout: Layout) -> str:
    """What identifies a layout across ranks: its name and P, and for a balanced layout, or a
    user's layout ``as_checked``, its deal (two ranks whose layouts shared a name and P but
    dealt otherwise once computed another attention without a word)."""
    return getattr(layout, "fingerprint", f"{layout.name}/{layout.world_size}")


def written_positions(positions: torch.Tensor, most: int = 6) -> str:
    """1-D positions as their runs of consecutive ones, ``0..7, 24..31``: a zigzag shard's 16
    positions read whole where a list cut to its first few reads as another rank's. At most
    ``most`` runs, then ``...``."""
    runs: list[list[int]] = []
    for value in positions.reshape(-1).tolist():
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        elif len(runs) > most:  # one more than shown: the "..."
            break
        else:
            runs.append([value, value])
    text = ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}..{b}" for a, b in runs[:most])
    return text + (", ..." if len(runs) > most else "")


def positions_mismatch(given: torch.Tensor, want: torch.Tensor, world_size: int) -> str:
    """Where ``given`` positions first differ from ``want``, this rank's (both 1-D, one length),
    and, where they number the tokens 0..S-1 on P > 1 ranks, what that may mean: the whole
    sequence passed on each rank, read as the shard of a P times longer one."""
    first = int((given != want).nonzero()[0, 0])
    text = (f"{written_positions(given)}, where this rank's are {written_positions(want)} (its token {first} is at "
            f"{int(want[first])}, not {int(given[first])})")
    if world_size > 1 and bool((given == torch.arange(given.numel())).all()):
        text += (f"; numbered from 0 to {given.numel() - 1}: if they are the whole sequence's, passed on each "
                 f"rank, each of the {world_size} ranks must pass its shard of T/{world_size} tokens instead")
    return text


def checked_deal(layout: Layout, seq_len: int) -> torch.Tensor:
    """(T,) int64: every rank's positions for a sequence of ``seq_len``, rank after rank;
    refused unless each rank's are T/P strictly ascending int64 positions and together they
    hold 0..T-1 once each, which every strategy and the block plan take a layout to do."""
    local = layout.local_len(seq_len)
    parts = []
    for rank in range(layout.world_size):
        got = layout.positions(seq_len, rank)  # a tensor, refused otherwise
        if got.dtype != torch.int64 or tuple(got.shape) != (local,):
            raise ValueError(f"the {layout.name} layout's positions for rank {rank} of a sequence of {seq_len} must "
                             f"be an int64 tensor of T/P = {local} positions, got {got.dtype} {tuple(got.shape)}")
        got = got.cpu()
        if not bool((got[1:] > got[:-1]).all()):
            raise ValueError(f"the {layout.name} layout gives rank {rank} positions that are not strictly ascending "
                             f"for a sequence of {seq_len}: {got[:8].tolist()}{' ...' if local > 8 else ''}")
        parts.append(got)
    deal = torch.cat(parts)
    if int(deal.min()) < 0 or int(deal.max()) >= seq_len:
        raise ValueError(f"the {layout.name} layout gives positions outside 0..{seq_len - 1} for a sequence of "
                         f"{seq_len}: {int(deal.min())}..{int(deal.max())}")
    held = torch.bincount(deal, minlength=seq_len)
    if not bool((held == 1).all()):
        position = int((held != 1).nonzero()[0])
        raise ValueError(f"the {layout.name} layout gives position {position} of a sequence of {seq_len} to "
                         f"{int(held[position])} ranks; its ranks' positions must hold 0..{seq_len - 1} once each")
    return deal


_LAYOUTS = {cls.name: cls for cls in (ContiguousLayout, ZigzagLayout, StripedLayout)}
# ctxpar's own layouts, whose deals the tests check; any other subclass's is checked per call
_OWN_LAYOUTS = (ContiguousLayout, ZigzagLayout, StripedLayout, UnionLayout, BalancedLayout, DealtLayout)


def get_layout(layout: str | Layout, world_size: int) -> Layout:
    """A Layout from a name (``"contiguous" | "zigzag" | "striped"``) or an instance.

    An instance must have been built for ``world_size`` ranks: a layout for 4 ranks used
    with a group of 2 is an error, not a silent reinterpretation.
    """
    if isinstance(layout, Layout):
        if layout.world_size == world_size:
            return layout
        if world_size == 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError(f"the {layout.name} layout is for P={layout.world_size} ranks but torch.distributed is "
                             f"not initialised; call torch.distributed.init_process_group first (or start the ranks "
                             f"with ctxpar.launch.run_local or torchrun)")
        raise ValueError(f"the {layout.name} layout was built for P={layout.world_size} ranks but the process group "
                         f"has {world_size}; build it with world_size={world_size} or pass the group it was made for")
    if not isinstance(layout, str):
        raise ValueError(f"layout must be a name ({', '.join(LAYOUT_NAMES)}) or a Layout, got "
                         f"{type(layout).__name__} {layout!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUT_NAMES)}")
    return _LAYOUTS[layout](world_size)
