"""The configuration users have without CP, and whether CP beats it.

A team with G = TP·P GPUs per model replica (per pipeline stage under PP) can also run the
sequence without CP: more tensor parallelism, full recomputation, the GPUs left over
running data parallelism. For the requested length the planner tries every TP degree t
dividing G that splits the model (the request's own TP among them; beyond a node if t is
larger, at the inter-node bandwidth) with checkpointing none and full, same batch, micro-batches, dtype, FSDP and PP
degrees and sequence parallelism, and takes the fastest that fits in memory. Its time per
batch (m micro-batches of B sequences) on those G GPUs is

    step(TP = t, CP = 1) · t / G

since G/t replicas each run a batch in one step. Those replicas, and the request's DP
ones, reduce their gradients together: a candidate's DP degree is the request's
DP·TP·P / t GPUs holding each of its TP shards (at least its FSDP degree, as an implied
DP would be). Then, for the requested configuration:

    pays_off          it fits and is faster: speed-up = baseline per batch / requested step > 1
    does_not_pay_off  a configuration without CP fits and is at least as fast, or the requested one does not fit
    necessary         nothing without CP fits on G GPUs; the requested one does
    nothing_fits      nothing without CP fits, nor does the requested configuration
    no_cp             the request has CP = 1: the baseline is only the best TP x checkpointing
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ctxpar.plan import cost
from ctxpar.plan.hardware import Hardware
from ctxpar.plan.memory import MemoryEstimate, memory_on
from ctxpar.plan.units import format_bytes, format_seconds
from ctxpar.plan.workload import CHECKPOINTING, Workload

VERDICTS = ("pays_off", "does_not_pay_off", "necessary", "nothing_fits", "no_cp")


@dataclass(frozen=True)
class BaselinePoint:
    """One configuration without CP on the requested GPUs per replica (per stage under PP)."""

    tp: int
    checkpointing: str
    step_seconds: float  # one step (m micro-batches of B sequences) on t GPUs per stage
    seconds_per_batch: float  # step_seconds · t / G: the other G/t - 1 replicas run data parallelism
    memory_bytes: int  # per GPU
    fits: bool


@dataclass(frozen=True)
class Baseline:
    gpus: int  # G = TP·P of the request (one pipeline stage's under PP)
    points: list[BaselinePoint]  # every valid (TP, checkpointing), TP ascending
    best: BaselinePoint | None  # the fastest per batch that fits; None: nothing fits
    requested_seconds: float
    requested_fits: bool
    verdict: str  # one of VERDICTS
    summary: str
    skipped: dict[int, str] = field(default_factory=dict)  # TP degree -> why it cannot run

    @property
    def speedup(self) -> float | None:
        """Baseline seconds per batch / requested step seconds (> 1: CP is faster); None
        without a fitting baseline or a fitting request."""
        if self.best is None or not self.requested_fits:
            return None
        return self.best.seconds_per_batch / self.requested_seconds

    def as_dict(self) -> dict:
        return dict(gpus_per_stage=self.gpus, verdict=self.verdict, speedup=self.speedup,
                    requested_step_seconds=self.requested_seconds, requested_fits=self.requested_fits,
                    best=None if self.best is None else asdict(self.best),
                    candidates=[asdict(p) for p in self.points], skipped_tp={str(k): v for k, v in
                                                                              self.skipped.items()},
                    summary=self.summary)


def tp_degrees(gpus: int) -> list[int]:
    """Every divisor of ``gpus``, ascending (a few dozen at most: the request's own TP, 6 of
    12 GPUs say, among them; those the model's heads or FFN do not split are refused by
    ``Workload``)."""
    return [t for t in range(1, gpus + 1) if gpus % t == 0]


def baseline(w: Workload, hw: Hardware) -> Baseline:
    """The fastest configuration without CP on ``w``'s TP·P GPUs that fits, and the verdict."""
    gpus = w.gpus_per_stage  # under PP each stage's TP x CP GPUs; the stages stay as asked
    points, skipped = [], {}
    for t in tp_degrees(gpus):
        for checkpointing in CHECKPOINTING:
            try:
                v = w.unsplit(tp=t).with_(checkpointing=checkpointing)
            except ValueError as e:  # TP that does not split the heads or the sequence
                skipped[t] = str(e)
                break
            mem = memory_on(v, hw)
            step = cost.step_time(v, hw).seconds
            points.append(BaselinePoint(t, checkpointing, step, step * t / gpus, mem.total, mem.fits))
    fitting = [p for p in points if p.fits]
    best = min(fitting, key=lambda p: p.seconds_per_batch) if fitting else None
    requested = cost.step_time(w, hw).seconds
    asked_memory = memory_on(w, hw)
    verdict = _verdict(w, best, requested, asked_memory.fits)
    return Baseline(gpus, points, best, requested, asked_memory.fits, verdict,
                    _summary(w, hw, verdict, best, requested, asked_memory, points), skipped)


def _verdict(w: Workload, best: BaselinePoint | None, requested: float, requested_fits: bool) -> str:
    if w.cp == 1:
        return "no_cp"
    if best is None:
        return "necessary" if requested_fits else "nothing_fits"
    return "pays_off" if requested_fits and best.seconds_per_batch > requested else "does_not_pay_off"


def _summary(w: Workload, hw: Hardware, verdict: str, best: BaselinePoint | None, requested: float,
             asked_memory: MemoryEstimate, points: list[BaselinePoint]) -> str:
    g = w.gpus_per_stage
    per = "pipeline stage" if w.pp > 1 else "replica"
    asked = f"TP={w.tp} x CP={w.cp} {w.strategy}"
    if best is not None:
        replicas = g // best.tp
        without = (f"the best without CP on the same {g} GPUs per {per} is TP={best.tp} with checkpointing "
                   f"{best.checkpointing}: {format_seconds(best.step_seconds)} per step"
                   + (f", {format_seconds(best.seconds_per_batch)} per batch with {replicas} replicas in data "
                      f"parallelism" if replicas > 1 else ""))
    else:
        least = min((p.memory_bytes for p in points), default=None)
        budget = hw.memory_per_rank(w.world_size)  # the points keep w's GPUs
        tried = f"TP up to {max(p.tp for p in points)}, checkpointing none or full" if points else \
            "no TP degree can split this model"
        without = (f"no configuration without CP on {g} GPUs per {per} fits ({tried}"
                   + (f"; the smallest needs {format_bytes(least)} per GPU > {format_bytes(budget)}"
                      if least else "") + ")")
    if verdict == "no_cp":
        return f"no CP requested; {without}"
    if verdict == "nothing_fits":
        return f"CP is necessary: {without}; but {asked} does not fit either"
    if verdict == "necessary":
        return f"CP is necessary: {without}; {asked} fits, {format_seconds(requested)} per step"
    if not asked_memory.fits:  # no verdict on CP itself: a larger degree may fit and pay off (the recommendation's)
        return (f"{asked} as asked does not fit ({format_bytes(asked_memory.total)} per GPU > "
                f"{format_bytes(asked_memory.hbm_bytes)}); {without}")
    speedup = best.seconds_per_batch / requested
    words = "CP pays off" if verdict == "pays_off" else "CP does not pay off"
    digits = 2 if abs(speedup - 1) >= 0.005 else 4  # 0.9975x read as 1.00x beside "does not pay off"
    return (f"{words}: {asked} takes {format_seconds(requested)} per step, {speedup:.{digits}f}x the speed of the "
            f"best without CP; {without}")
