"""The answer: step time and efficiency against sequence length, crossovers, a recommendation.

For each CP degree and strategy the planner evaluates ``cost.step_time`` and
``memory.memory_per_gpu`` over a grid of sequence lengths, then finds by bisection (on
lengths the layout accepts):

- the length from which CP-P is faster than CP-1 (the step-time crossover), and
- the longest sequence that fits each degree in HBM, so that beyond CP-1's limit CP is
  necessary, not merely faster.

The recommendation takes the smallest degree that fits (more GPUs per sequence only pays
if the efficiency stays high: any GPU not used for CP can run data parallelism at
efficiency ~1), then the fastest strategy at that degree, each on the layout that splits T
and gives it the shortest step, and prints why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ctxpar.layout import LAYOUT_NAMES
from ctxpar.plan import cost
from ctxpar.plan.hardware import Hardware
from ctxpar.plan.memory import memory_on
from ctxpar.plan.units import format_bytes, format_seconds, format_tokens
from ctxpar.plan.workload import Workload, default_ulysses
from ctxpar.strategy_rules import STRATEGY_NAMES

MAX_SEQ = 2**30  # search bound for "fits up to"
MAX_FSDP = 1024  # search bound for the FSDP degree that would make a step fit


@dataclass(frozen=True)
class SweepPoint:
    strategy: str
    cp: int
    seq: int
    layout: str
    ulysses: int | None
    gpus: int  # TP·P·PP·DP: the world this degree runs on, and so its CP-1 (``Workload.unsplit``)
    step_seconds: float
    cp1_step_seconds: float  # CP-1 on the same GPUs: what ``efficiency`` divides
    efficiency: float
    memory_bytes: int
    fits: bool
    transfer_hidden: bool
    load_balance: float


@dataclass(frozen=True)
class Crossover:
    """``faster_from``: the length from which CP-P beats CP-1 at every length searched up to
    ``searched_to`` (None: it loses at ``searched_to``); equal to ``searched_from``, it is a
    bound: CP-P may be faster below it too."""

    strategy: str
    cp: int
    faster_from: int | None
    searched_to: int
    fits_up_to: int  # longest sequence that fits, 0 if none
    searched_from: int


@dataclass(frozen=True)
class Recommendation:
    workload: Workload | None  # None: nothing fits
    step_seconds: float | None
    efficiency: float | None
    reasons: list[str] = field(default_factory=list)


def variant(w: Workload, hw: Hardware, *, strategy: str, cp: int, seq: int | None = None) -> Workload | None:
    """``w`` with another strategy / degree / length, or None where that combination is
    invalid (``_changed``'s refusal)."""
    try:
        return _changed(w, hw, strategy=strategy, cp=cp, seq=seq)
    except ValueError:  # e.g. alltoall with heads not divisible by P, or a length the layout rejects
        return None


def _changed(w: Workload, hw: Hardware, *, strategy: str, cp: int, seq: int | None = None,
             layout: str | None = None) -> Workload:
    """``variant``, raising ValueError where the combination is invalid, saying why.

    The same TP, FSDP and PP; the same DP replicas where FSDP still divides DP·P, else the
    fewest it needs (``Workload.dp`` None). DP sets the group that reduces gradients.
    """
    ulysses = default_ulysses(w.model.heads, cp, hw.gpus_per_node, w.tp) if strategy == "hybrid" else None
    if strategy == "hybrid" and w.strategy == "hybrid" and cp == w.cp and w.ulysses:
        ulysses = w.ulysses
    if strategy == "hybrid" and ulysses is None:
        raise ValueError(f"no Ulysses degree U > 1 divides CP-{cp} and the heads within a node")
    return w.with_(strategy=strategy, cp=cp, seq=w.seq if seq is None else seq, ulysses=ulysses,
                   dp=_replicas(w, cp), layout=w.layout if layout is None else layout)


def _replicas(w: Workload, cp: int) -> int | None:
    """``w``'s DP replicas at degree ``cp``, where FSDP still divides DP·P; None: the fewest it needs."""
    return w.dp if w.dp is not None and (w.dp * cp) % w.fsdp == 0 else None


def evaluate(w: Workload, hw: Hardware) -> SweepPoint:
    mem = memory_on(w, hw)
    step, cp1 = cost.step_time(w, hw), cost.step_time(w.unsplit(), hw).seconds
    return SweepPoint(w.strategy, w.cp, w.seq, w.layout, w.ulysses, w.world_size, step.seconds, cp1,
                      cost.scaling(cp1, w.cp, step.seconds), mem.total, mem.fits, step.attention.forward.hidden,
                      cost.load_balance(w))


def sweep(w: Workload, hw: Hardware, degrees: Iterable[int], seqs: Iterable[int]) -> list[SweepPoint]:
    """Every valid (strategy, degree, length) on the grid, each length padded up to one the
    degree splits (``Workload.padded``: CP-3 on zigzag takes multiples of 6, which no power
    of two is); degree 1 once, as "ring": the baseline the efficiencies and crossovers
    divide by (``Workload.unsplit``: the CP group's GPUs as data-parallel replicas, whose
    gradients are reduced too)."""
    points, seen = [], set()
    for seq in seqs:
        for cp in degrees:
            at = w.padded(seq, cp)
            if (cp, at) in seen:  # two lengths padded to the same one
                continue
            seen.add((cp, at))
            for strategy in STRATEGY_NAMES if cp > 1 else ("ring",):
                v = variant(w, hw, strategy=strategy, cp=cp, seq=at) if cp > 1 else _unsplit_at(w, at)
                if v is not None:
                    points.append(evaluate(v, hw))
    return sorted(points, key=lambda p: (p.seq, p.cp))  # a padded length may come before a shorter degree's


def _unsplit_at(w: Workload, seq: int) -> Workload | None:
    try:
        return w.unsplit().with_(seq=seq)
    except ValueError:  # a length sequence parallelism cannot split
        return None


def _faster(w: Workload, hw: Hardware) -> bool:
    return cost.step_time(w, hw).seconds < cost.step_time(w.unsplit(), hw).seconds


def _first_true(lo: int, hi: int, pred) -> int:
    """Smallest k in (lo, hi] with pred(k), given pred(lo) false and pred(hi) true (monotone)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(mid) else (mid, hi)
    return hi


def fits_up_to(w: Workload, hw: Hardware) -> int:
    """Longest sequence (a multiple the layout and sequence parallelism accept) whose step
    fits in HBM; 0 if none.

    Memory grows with T, so bisect on the multiple.
    """
    step = w.seq_multiple

    def fits(k: int) -> bool:
        return memory_on(w.with_(seq=k * step), hw).fits

    if not fits(1):
        return 0
    hi = 2
    while fits(hi) and hi * step < MAX_SEQ:
        hi *= 2
    if fits(hi):
        return hi * step
    return (_first_true(1, hi, lambda k: not fits(k)) - 1) * step


def crossover(w: Workload, hw: Hardware, seqs: list[int]) -> Crossover:
    """From where CP-P beats CP-1 at every length of the grid (``seqs`` padded as the sweep
    pads them): bisected between the last length it loses at and the next; and how far it
    fits. Not the first win: each T's row is the first T tokens of one document stream
    (--documents, --doc-dist), so its mix of documents changes with T, and CP can win at 8K,
    lose at 16K and win again."""
    step = w.seq_multiple  # CP-1's multiple divides it
    grid = sorted({w.padded(s, w.cp) for s in seqs})
    wins = [_faster(w.with_(seq=seq), hw) for seq in grid]
    faster = None
    if wins[-1]:
        last_loss = max((i for i, won in enumerate(wins) if not won), default=None)
        faster = grid[0] if last_loss is None else step * _first_true(
            grid[last_loss] // step, grid[last_loss + 1] // step, lambda k: _faster(w.with_(seq=k * step), hw))
    return Crossover(w.strategy, w.cp, faster, grid[-1], fits_up_to(w, hw), grid[0])


def crossovers(w: Workload, hw: Hardware, degrees: Iterable[int], seqs: list[int]) -> list[Crossover]:
    """A crossover for every (strategy, degree) of the sweep, over the lengths it sweeps."""
    out = []
    for cp in (d for d in degrees if d > 1):
        for strategy in STRATEGY_NAMES:
            v = variant(w, hw, strategy=strategy, cp=cp, seq=w.padded(max(seqs), cp))
            if v is not None:
                out.append(crossover(v, hw, seqs))
    return out


def best_layout(w: Workload, hw: Hardware) -> tuple[str, dict[str, float], dict[str, float]]:
    """The layout with the shortest step for ``w``'s strategy (ties: the lower load-balance
    factor, then ``w.layout``), and every layout's step seconds and load-balance factor. By
    balance alone, a sliding window's striped layout (balanced to 1e-5) was chosen over a
    contiguous or zigzag one whose ring sends only the window's keys, at 1.7x the step."""
    times, factors = {}, {}
    for name in LAYOUT_NAMES:
        try:
            v = w.with_(layout=name)
            times[name], factors[name] = cost.step_time(v, hw).seconds, cost.load_balance(v)
        except ValueError:  # the length does not split under this layout
            continue
    best = min(times, key=lambda name: (times[name], factors[name], name != w.layout))
    return best, times, factors


def _options(w: Workload, hw: Hardware, cp: int) -> tuple[list[Workload], str]:
    """``w`` at degree ``cp`` with every strategy that runs there, each on the first layout
    (the requested one first) that splits T, for ``best_layout`` to improve on; and, where
    none runs, why: the ring's refusal on the layout that asks least of T (contiguous), e.g.
    'sequence length 18006 is not a multiple of P=4'. At 1, the CP-1 of the table and the
    efficiencies (``Workload.unsplit``: the same GPUs, the CP group's as data parallelism)."""
    if cp == 1:
        return [w.unsplit()], ""
    options, why = [], ""
    for strategy in STRATEGY_NAMES:
        for layout in dict.fromkeys((w.layout, *LAYOUT_NAMES)):
            try:
                options.append(_changed(w, hw, strategy=strategy, cp=cp, layout=layout))
                break
            except ValueError as e:
                why = str(e) if (strategy, layout) == ("ring", "contiguous") else why
    return options, why


def recommend(w: Workload, hw: Hardware, degrees: Iterable[int]) -> Recommendation:
    """Smallest fitting degree, fastest strategy there, each on its fastest layout; with reasons."""
    degrees = sorted(set(degrees) | {1})
    gib = format_bytes
    reasons = []
    evaluated = []
    for cp in degrees:
        placed = {}  # strategy -> (on its fastest layout, every layout's step seconds, balance factors)
        runnable, why = _options(w, hw, cp)
        for v in runnable:
            layout, steps, factors = best_layout(v, hw)
            placed[v.strategy] = (v.with_(layout=layout), steps, factors)
        options = [v for v, _, _ in placed.values()]
        if not options:
            reasons.append(f"CP-{cp} not evaluated: {why}")
            continue
        evaluated.append(cp)
        memory = {v.strategy: memory_on(v, hw) for v in options}
        fitting = [v for v in options if memory[v.strategy].fits]
        if not fitting:
            need = min(options, key=lambda v: memory[v.strategy].total)
            reasons.append(f"CP-{cp} needs {gib(memory[need.strategy].total)} per GPU > "
                           f"{_budget_words(need, hw, ' HBM')} ({hw.name})")
            continue
        times = {v.strategy: placed[v.strategy][1][v.layout] for v in fitting}
        best = min(fitting, key=lambda v: times[v.strategy])
        reasons.append(f"CP-{cp} fits: {gib(memory[best.strategy].total)} of {_budget_words(best, hw)} per GPU")
        if cp == 1:
            holds = "one GPU holds" if best.tp == 1 else f"one TP group of {best.tp} GPUs holds"
            reasons.append(f"{holds} the whole sequence, so CP would only add communication; "
                           "use the other GPUs for data parallelism")
            return Recommendation(best, times["ring"], 1.0, reasons)
        ranked = ", ".join(f"{s} {format_seconds(t)} ({placed[s][0].layout})"
                           for s, t in sorted(times.items(), key=lambda kv: kv[1]))
        reasons.append(f"fastest step at CP-{cp}, each strategy on its fastest layout: {ranked}")
        reasons += _why_strategy(best, hw)
        _, steps, factors = placed[best.strategy]
        by_step = ", ".join(f"{k} {format_seconds(v)}" for k, v in steps.items())
        listed = ", ".join(f"{k} {v:.4f}" for k, v in factors.items())
        reasons.append(f"{best.layout} layout: {best.strategy}'s step {by_step}; load-balance factor (max/mean pairs "
                       f"per rank) {listed}")
        eff = cost.efficiency(best, hw)
        reasons.append(f"parallel efficiency {eff:.3f} (CP-1 step time / ({cp} x CP-{cp} step time))")
        if best.data_parallel != w.data_parallel:  # FSDP must divide DP x CP: the global batch changes with DP
            reasons.append(f"DP={best.data_parallel} at CP-{cp} (--fsdp {w.fsdp} must divide DP x CP; "
                           f"DP={w.data_parallel} at CP-{w.cp}): {sequences_per_step(best)} sequences per step on "
                           f"{best.world_size} GPUs, against {sequences_per_step(w)} on {w.world_size}")
        return Recommendation(best, times[best.strategy], eff, reasons)
    tried = (f"no CP degree up to {max(degrees)} fits" if evaluated == degrees else
             f"none of the CP degrees evaluated ({', '.join(map(str, evaluated))}) fits")
    reasons.append(f"{tried}; " + _remedies(w, hw, degrees))
    return Recommendation(None, None, None, reasons)


def sequences_per_step(w: Workload) -> int:
    """Sequences one step of ``w`` takes: its batch, times micro-batches, times DP replicas."""
    return w.batch * w.microbatches * w.data_parallel


def _smallest_fitting(w: Workload, hw: Hardware, degrees: list[int]) -> tuple[int, int] | None:
    """(degree, bytes per GPU) of the smallest degree at which some strategy fits."""
    for cp in degrees:
        fitting = [mem.total for mem in (memory_on(v, hw) for v in _options(w, hw, cp)[0]) if mem.fits]
        if fitting:
            return cp, min(fitting)
    return None


def _budget_words(w: Workload, hw: Hardware, memory: str = "") -> str:
    """What one of ``w``'s ranks may fill: '79.647 GiB' + ``memory`` ('HBM'), or where its ranks
    share one machine's RAM '11.77 GiB (1/2 of 23.54 GiB RAM, shared by the 2 ranks)'."""
    if hw.shared_memory:
        return (f"{format_bytes(hw.memory_per_rank(w.world_size))} (1/{w.world_size} of {format_bytes(hw.hbm_bytes)} "
                f"RAM, shared by the {w.world_size} ranks)")
    return f"{format_bytes(hw.hbm_bytes)}{memory}"


def _remedies(w: Workload, hw: Hardware, degrees: list[int]) -> str:
    """What would make it fit: full checkpointing, the smallest FSDP degree (powers of two),
    and where neither alone does, the two together."""
    found = []
    if w.checkpointing != "full" and (hit := _smallest_fitting(w.with_(checkpointing="full"), hw, degrees)):
        found.append(f"with --checkpointing full, CP-{hit[0]} fits ({format_bytes(hit[1])})")
    if sharded := _smallest_fsdp(w, hw, degrees):
        found.append(f"with --fsdp {sharded[0]}, CP-{sharded[1]} fits ({format_bytes(sharded[2])})")
    if not found and w.checkpointing != "full" and (sharded := _smallest_fsdp(w.with_(checkpointing="full"), hw,
                                                                              degrees)):
        found.append(f"with --checkpointing full and --fsdp {sharded[0]}, CP-{sharded[1]} fits "
                     f"({format_bytes(sharded[2])})")
    if not found:
        tried = (f"neither --checkpointing full nor --fsdp up to {MAX_FSDP}, alone or together," if
                 w.checkpointing != "full" else f"no --fsdp up to {MAX_FSDP}")
        more_tp = w.model.kv_heads % (2 * w.tp) == 0  # TP splits the K/V heads
        return f"{tried} helps: raise {'--tp or ' if more_tp else ''}--max-cp"
    return "; ".join(found)


def _smallest_fsdp(w: Workload, hw: Hardware, degrees: list[int]) -> tuple[int, int, int] | None:
    """(FSDP degree, CP degree, bytes per GPU) at the smallest FSDP degree above ``w``'s
    (powers of two up to ``MAX_FSDP``) at which some degree fits."""
    fsdp = w.fsdp * 2
    while fsdp <= MAX_FSDP:
        if hit := _smallest_fitting(w.with_(fsdp=fsdp, dp=None), hw, degrees):
            return fsdp, *hit
        fsdp *= 2
    return None


def _why_strategy(w: Workload, hw: Hardware) -> list[str]:
    attn = cost.attention_time(w, hw)
    fwd = attn.forward
    if w.strategy == "alltoall":
        return [f"all-to-all moves {format_bytes(cost.layer_traffic(w).total)} per layer (falls as 1/P) and "
                f"runs one unsplit kernel per head group; its {format_seconds(fwd.lead)} forward transfer is not "
                f"overlapped"]
    verdict = "hides" if fwd.hidden else "does not hide"
    s_min = cost.overlap_local_len(w, hw)
    line = (f"{w.strategy}: each forward transfer ({format_seconds(fwd.transfer)}) {verdict} behind its "
            f"compute ({format_seconds(fwd.compute)})")
    if s_min is not None:
        line += f"; it hides from {format_tokens(s_min)} tokens per GPU (now {format_tokens(w.local_len)})"
    return [line]
