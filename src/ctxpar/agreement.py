"""Checking that every rank of the CP group called attention with the same arguments.

Local validation catches inputs that are wrong everywhere. Inputs that differ between
ranks are worse: one rank with another causal flag, scale or layout, or K/V of another
shape but the same byte count, gives silently wrong results; one rank that rejects its
inputs leaves the others waiting inside a collective. So, by default, every rank first
contributes a small signature of its call to one all-gather per process group the
strategy uses; then all ranks raise together, or all go on.

A hybrid strategy uses two groups (ulysses rows and ring columns of the mesh). A rank
learns of trouble in its own row in the first exchange and passes it on in the second,
so after both every rank knows whether any rank of the mesh rejected or disagreed:
every ring column holds one member of every row.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ctxpar import profile
from ctxpar.comm import all_gather_into, collective_device
from ctxpar.strategy_rules import CALL_STRATEGIES
from ctxpar.topology import Topology

# bits of the first field: what this rank knows went wrong so far
OWN_INPUTS_REJECTED, SAW_REJECTED, SAW_DIFFERENT = 1, 2, 4
# Every exchange sends this many integers, the call's kind first, whatever the call: ranks
# that are in different calls (one in a decode step, another in a prefill) then compare and
# raise, where messages of different sizes would abort the process inside gloo.
SIGNATURE_WIDTH = 24
CALLS = ("attention", "prefill", "decode step", "partial prefill", "generate call", "generate forward", "forward",
         "sharded attention")
FIELDS = ("trouble", "batch", "heads", "kv_heads", "local_len", "head_dim", "dtype", "causal", "scale",
          "strategy", "layout", "requires_grad", "documents/window", "sinks")


def text_code(text: str) -> int:
    """A checksum of ``text`` every rank computes alike (for names in a signature)."""
    return zlib.crc32(text.encode())


def float_code(x) -> int:
    """``float(x)``'s 64 bits as an integer: equal on ranks passing equal numbers."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def tensor_code(t: torch.Tensor, dtype: torch.dtype, start: int = 0) -> int:
    """A checksum of ``t``'s values taken in ``dtype`` on the host: equal on ranks holding equal
    values. ``start``: a checksum to continue (of tensors taken one after another)."""
    host = t.detach().to("cpu", dtype).contiguous()
    if host.dim() and host.stride(-1) != 1:  # a one-element last dim keeps any stride through .contiguous()
        host = host.clone(memory_format=torch.contiguous_format)
    # read in place as bytes, not copied, and without numpy: were it missing, Tensor.numpy() would raise, every
    # rank's checksum read as unreadable (-1) and ranks holding other values taken to agree
    return zlib.crc32((ctypes.c_char * (host.numel() * host.element_size())).from_address(host.data_ptr()), start)


def values_code(t: torch.Tensor) -> int:
    """A checksum of floating-point ``t``'s values, equal on ranks whose values compute alike:
    + 0.0 makes -0.0 the +0.0 it computes alike with (their bytes differ)."""
    return tensor_code(t.detach().double() + 0.0, torch.float64)


def needs_grad(*tensors) -> bool:
    """Whether a backward will run through a call on ``tensors`` (non-tensors ignored):
    grad mode is on and one of them requires grad."""
    return grad_flags(*tensors) != 0


GRAD_TENSORS = ("q", "k", "v", "sinks")  # the order ``signature`` passes them to ``grad_flags``


def grad_flags(*tensors) -> int:
    """Which of ``tensors`` a backward will reach: bit i set where the i-th requires grad
    (non-tensors never do), none with grad mode off."""
    if not torch.is_grad_enabled():
        return 0
    return sum(1 << i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad)


def grad_names(flags: int) -> str:
    """The tensors ``grad_flags``' bits name (of q, k, v, sinks), or "none"."""
    return ", ".join(name for bit, name in enumerate(GRAD_TENSORS) if flags >> bit & 1) or "none"


def signature(q, k, v, *, layout_name: str, causal, scale, strategy, rejected: bool, mask=None, sinks=None
              ) -> list[int]:
    """Integers describing one call; shape fields are -1 where the inputs are not tensors or have no
    readable shape (a nested tensor).

    ``mask``: the call's documents and window (a ``Mask``, or None where it was invalid);
    ``sinks``: their values, which every rank must share (a replicated parameter).

    ``requires_grad``: which of q, k, v and sinks a backward will reach (it communicates
    too), so a rank whose inputs lack ``requires_grad`` is caught here rather than left out
    there, and so is one whose sinks alone lack it (their gradient would be None on that
    rank only, for the user's own reduction to trip over).
    """
    shape = [readable(lambda: int(q.shape[i])) if isinstance(q, torch.Tensor) and q.dim() == 4 else -1
             for i in range(4)]
    kv_heads = readable(lambda: int(k.shape[1])) if isinstance(k, torch.Tensor) and k.dim() == 4 else -1
    dtype = text_code(str(q.dtype)) if isinstance(q, torch.Tensor) else -1
    scale_bits = readable(lambda: float_code(scale))
    mask_code = -1 if mask is None else text_code(f"{mask.documents}/{mask.window}")
    sinks_code = 0 if sinks is None else readable(lambda: values_code(sinks))
    return [OWN_INPUTS_REJECTED if rejected else 0, shape[0], shape[1], kv_heads, shape[2], shape[3], dtype,
            readable(lambda: int(bool(causal))), scale_bits, text_code(str(strategy)), text_code(layout_name),
            grad_flags(q, k, v, sinks), mask_code, sinks_code]


def readable(code) -> int:
    """``code()``, or -1 for an argument it cannot read (a meta tensor, an int too large for a
    float or for int64, a tensor as a flag): the signature of a rejected call must still be sent."""
    try:
        return code()
    except Exception:  # noqa: BLE001  whatever the argument raises, the rank must join the exchange
        return -1


def check_ranks_agree(sig: list[int], topo: Topology, error: Exception | None) -> None:
    """All-gather ``sig`` over every group ``topo`` communicates on; raise on every rank if
    any rank rejected its inputs or the signatures differ. Re-raises ``error`` on the
    rank that had it. Every rank runs every exchange, whatever it has learnt, so that no
    rank is left waiting in one."""
    descriptions = _agree(list(sig), topo.process_groups, "attention", FIELDS[1:], error, _attention_differences)
    if descriptions is not None:
        what = f"different {', '.join(descriptions)}" if descriptions else "different arguments (seen by another rank)"
        raise ValueError(f"the ranks of the CP group called attention with {what}; every rank must pass the same "
                         f"shapes, dtype, causal flag, scale, strategy, layout, documents, window, sinks and "
                         f"requires_grad")


def _attention_differences(differing: dict[str, list[int]], group: dist.ProcessGroup | None) -> dict[str, str]:
    """The differing fields of attention's signature described, keyed by field (the first group
    that sees a field names its ranks' values), but requires_grad by its description: a hybrid
    mesh's row and column each say which tensors their ranks' backward reaches."""
    return {description if name == "requires_grad" else name: description
            for name, description in ((name, _described(name, column, group)) for name, column in differing.items())}


def _agree(mine: list[int], groups: list[dist.ProcessGroup | None], what: str, names: tuple[str, ...],
           error: Exception | None, show: Callable[[dict[str, list[int]], dist.ProcessGroup | None], dict[str, str]],
           where_known: tuple[str, ...] = ()) -> list[str] | None:
    """What both checks do: one all-gather of ``mine`` (the trouble bits, then one integer per
    name of ``names``; updated in place) over each of ``groups`` in turn, the trouble seen in
    one passed on in the next; then ``error`` re-raised on its rank, every other rank raising
    where any rank rejected its inputs. Returns None where the ranks agree, else what differs:
    ``show(differing columns, group)``'s descriptions, the first of each key (``show`` may make
    a collective on ``group``: every rank of a group holds the same table, so all of them or
    none call it), and "call ..." where ranks are in different calls. Values named in
    ``where_known`` may be unknown (-1) on some rank; they are compared only where every rank
    of the group knows them."""
    rejected: list[int] = []
    differs: dict[str, str] = {}
    for group in groups:
        table, kinds = _all_gather(mine, group, what)
        if len(set(kinds)) > 1:  # another call on some rank: its fields are not these
            differs.setdefault("call", f"call {_call_names(kinds)}")
            mine[0] |= SAW_DIFFERENT
            continue
        columns = list(zip(*table.tolist()))  # compared as Python tuples: a tensor comparison cost 13x as much
        bits = columns[0]
        rejected += [_global_rank(group, i) for i, b in enumerate(bits) if b & OWN_INPUTS_REJECTED]
        if any(b & (OWN_INPUTS_REJECTED | SAW_REJECTED) for b in bits):
            mine[0] |= SAW_REJECTED
        differing = {name: list(columns[i]) for i, name in enumerate(names, start=1)
                     if len(set(columns[i])) > 1 and not (name in where_known and -1 in columns[i])}
        if differing:
            for key, description in show(differing, group).items():
                differs.setdefault(key, description)
        if differing or any(b & SAW_DIFFERENT for b in bits):
            mine[0] |= SAW_DIFFERENT
    if error is not None:
        raise error
    if mine[0] & SAW_REJECTED:
        who = f"ranks {sorted(set(rejected))}" if rejected else "a rank"
        raise ValueError(f"{who} of the CP group rejected their {what} inputs; see their errors")
    return list(differs.values()) if mine[0] & SAW_DIFFERENT else None


def _described(field: str, column: list[int], group: dist.ProcessGroup | None) -> str:
    """A field that differs between ranks, named, with each rank's value where the signature
    holds it readably (a shape, the dtype, causal, the scale, the strategy); for
    ``requires_grad``, which tensors each rank's backward would reach (``grad_flags``'s bits)."""
    if field == "requires_grad":
        by_rank = "; ".join(f"rank {_global_rank(group, i)}: {grad_names(flags)}" for i, flags in enumerate(column))
        return f"requires_grad (of q, k, v, sinks: {by_rank})"
    shown = _shown_values(field)
    if shown is None:  # a checksum (layout, documents/window, sinks): it says only that they differ
        return field
    values = by_value({_global_rank(group, i): "unreadable" if code == -1 else shown(code)
                       for i, code in enumerate(column)})
    if field == "strategy":  # every rank may have passed "auto" and the planner chosen differently
        return (f"strategy ({values}; or the one strategy='auto' chose, which follows whether a backward will run "
                f"and the planner's hardware: requires_grad and ctxpar.auto.set_hardware must be alike on every "
                f"rank)")
    return f"{field} ({values})"


def by_value(values: dict[int, str]) -> str:
    """Each rank's value, the ranks grouped by value: "4 on ranks 0, 1, 2; 8 on rank 3"."""
    ranks: dict[str, list[int]] = {}
    for rank, value in values.items():
        ranks.setdefault(value, []).append(rank)
    return "; ".join(f"{value} on rank{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}"
                     for value, held in ranks.items())


def _shown_values(field: str) -> Callable[[int], str] | None:
    """How ``signature``'s code for ``field`` reads back as the value a rank passed, or None
    where it is a checksum of no value to show."""
    if field in ("batch", "heads", "kv_heads", "local_len", "head_dim"):
        return str
    if field == "causal":
        return lambda code: str(bool(code))
    if field == "scale":
        return lambda code: repr(Real.shown(code))
    names = {"dtype": [str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)],
             "strategy": list(CALL_STRATEGIES)}.get(field)
    if names is None:
        return None
    by_code = {text_code(name): name for name in names}
    return lambda code: by_code.get(code, "?")


def sums_of(code: int) -> list[int]:
    """What a rank adds to an all-reduce (sum) so that ``differ`` can tell whether every rank
    had the same 24-bit ``code``: code, code^2 and 1."""
    return [code, code * code, 1]


def differ(code: int, summed: list[int]) -> bool:
    """Whether the ranks' codes differ, from this rank's own ``code`` and the summed
    ``sums_of``: they are all equal exactly when their variance is 0, i.e. when
    sum(c) = n * code and sum(c^2) = n * code^2. Unknown (False) from 2^15 ranks on, where
    n * code^2 may pass 2^63."""
    codes, squares, ranks = summed
    return ranks < 2**15 and (codes != ranks * code or squares != ranks * code * code)


def _int64(value) -> int:
    value = int(value)
    if not -2**63 <= value < 2**63:
        raise OverflowError(value)
    return value


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _code(value: Value) -> int:
    return value.code() if isinstance(value, (Real, Text)) else _int64(value)


def _gathered_texts(texts: dict[str, Text], group: dist.ProcessGroup | None) -> dict[str, list[str]]:
    """Every rank's names of ``texts``, by field: one all-gather of ``Text.exchanged`` each, where
    the ranks' checksums of them differed."""
    mine = torch.zeros(len(texts), TEXT_BYTES, dtype=torch.uint8)  # (texts, bytes), zero-padded
    for row, text in zip(mine, texts.values()):
        encoded = text.exchanged()
        row[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    rows = _gathered(mine, group)  # (W, texts, bytes)
    return {name: [bytes(per_rank[j].tolist()).rstrip(b"\0").decode(errors="replace") for per_rank in rows]
            for j, name in enumerate(texts)}


def _gathered(mine: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(W, *mine.shape) on the host: every rank's ``mine`` over ``group``, on the device its
    backend takes; a synchronisation point, whose few bytes are not the strategy's traffic."""
    mine = mine.to(collective_device(group))
    table = mine.new_empty(dist.get_world_size(group) * mine.shape[0], *mine.shape[1:])
    profile.add_traffic(0, 0)
    with profile.timed("wait", mine.device):
        all_gather_into(table, mine, group=group)
        return table.view(-1, *mine.shape).cpu()


def _all_gather(sig: list[int], group: dist.ProcessGroup | None, kind: str) -> tuple[torch.Tensor, list[int]]:
    """Every rank's ``sig`` (W, len(sig)) and the kind of call each rank is in (``CALLS``)."""
    row = [text_code(kind), *sig]
    assert len(row) <= SIGNATURE_WIDTH, f"a {kind} signature of {len(sig)} fields exceeds {SIGNATURE_WIDTH - 1}"
    table = _gathered(torch.tensor(row + [0] * (SIGNATURE_WIDTH - len(row)), dtype=torch.int64), group)
    return table[:, 1:len(row)], table[:, 0].tolist()


def _call_names(kinds: list[int]) -> list[str]:
    """The kind of call each rank is in, by name (``CALLS``)."""
    names = {text_code(name): name for name in CALLS}
    return [names.get(code, "?") for code in kinds]


class Real:
    """A number among the values ``check_values_agree`` compares: exchanged as its float64
    bits (equal on ranks passing equal numbers, 1 and 1.0 alike), shown as the number
    where the ranks differ."""

    def __init__(self, value) -> None:
        self.value = value

    def code(self) -> int:
        return float_code(self.value)

    @staticmethod
    def shown(code: int) -> float:
        return struct.unpack("<d", struct.pack("<q", code))[0]


class Text:
    """A name (a strategy, a dtype, a layout) among the values ``check_values_agree``
    compares: exchanged as a checksum; where the ranks differ, the names themselves (their
    first ``TEXT_BYTES`` bytes) follow in one more small all-gather, to be shown."""

    def __init__(self, value) -> None:
        self.value = value

    def code(self) -> int:
        return text_code(str(self.value))

    def exchanged(self) -> bytes:
        """Its name as exchanged: UTF-8, cut to ``TEXT_BYTES`` ("..." marking the cut); empty
        where it is (every rank must reach the all-gather with its row)."""
        try:
            text = str(self.value).encode(errors="replace")
        except Exception:  # noqa: BLE001  a name that cannot be read is still exchanged
            text = b"?"
        return text if len(text) <= TEXT_BYTES else text[:TEXT_BYTES - 3] + b"..."


TEXT_BYTES = 64
Value = int | Real | Text  # what ``check_values_agree`` compares


def check_values_agree(values: dict[str, Value],
                       group: dist.ProcessGroup | None | list[dist.ProcessGroup | None],
                       error: Exception | None, what: str, where_known: tuple[str, ...] = ()) -> None:
    """The same guarantee for calls other than attention (inference's prefill and decode
    steps, a model's forward): one all-gather of ``values`` (integers naming the call:
    lengths, the step, a checksum of the tokens; numbers as ``Real``, names as ``Text``,
    which a disagreement shows as themselves) over ``group``, or over each of a list of
    groups in turn (a hybrid mesh's rows, then its columns: trouble seen in the first
    reaches every rank in the second); every rank raises if any rank had an ``error`` (it
    raises its own) or any value differs between ranks, naming each rank's. ``what`` names
    the call. The values named in ``where_known`` may be unknown (-1) on some rank; they
    are compared only where every rank of the group knows them. A value's kind (int, Real,
    Text) must be the same on every rank: the callers' signatures fix it per field."""
    def show(differing: dict[str, list[int]], group) -> dict[str, str]:
        texts = {name: values[name] for name in differing if isinstance(values[name], Text)}
        names_shown = _gathered_texts(texts, group) if texts else {}  # one all-gather more, of the names
        shown = {name: names_shown[name] if name in names_shown else
                 [Real.shown(c) for c in column] if isinstance(values[name], Real) else column
                 for name, column in differing.items()}
        return {name: f"{name} {column}" for name, column in shown.items()}

    names = tuple(values)
    mine = [OWN_INPUTS_REJECTED if error is not None else 0, *(readable(lambda: _code(values[n])) for n in names)]
    descriptions = _agree(mine, group if isinstance(group, list) else [group], what, names, error, show, where_known)
    if descriptions is not None:
        raise ValueError(f"the ranks of the CP group disagree on the {what}: "
                         f"{'; '.join(descriptions) or '(seen by another rank)'} (one value per rank); every rank "
                         f"must make the same calls with the same tokens")


class Refusal:
    """A rank's refusal of a collective call, held until the ranks have compared the call:
    raised at once, it would leave the peers waiting in that exchange. Any ``Exception``
    is held, not only a ValueError; KeyboardInterrupt and SystemExit go through.

        with agreement.Refusal() as refusal:
            ...  # the call's checks
        refusal.join(lambda: signature, group, "prefill", world_size=P)
    """

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def __enter__(self) -> Refusal:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, Exception):
            self.error = error
            return True
        return False

    def join(self, values: Callable[[], dict[str, Value]],
             group: dist.ProcessGroup | None | list[dist.ProcessGroup | None], what: str, *, world_size: int,
             check_consistency: object = True, where_known: tuple[str, ...] = ()) -> None:
        """Where there are peers and ``check_consistency`` is not False (an invalid flag joins
        too, its peers hearing its refusal): ``check_values_agree`` of the call's
        ``values()``, every rank raising together. Else this rank's refusal, if any."""
        if check_consistency is not False and world_size > 1:
            check_values_agree(values(), group, self.error, what, where_known)
        elif self.error is not None:
            raise self.error
