"""``make_plan``: every figure the planner has for one workload on one piece of hardware.

    from ctxpar.plan import Workload, get_hardware, make_plan, resolve_model
    w = Workload(resolve_model("llama-3-70b"), batch=1, seq=131072, dtype="bfloat16", cp=8, tp=8)
    plan = make_plan(w, get_hardware("H100-SXM"))
    plan.recommendation.reasons, plan.step.seconds, plan.memory.total, plan.baseline.verdict
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ctxpar.plan import cost
from ctxpar.plan.baseline import Baseline, baseline
from ctxpar.plan.hardware import Hardware
from ctxpar.plan.memory import MemoryEstimate, SequenceTensors, memory_on, sequence_tensors
from ctxpar.plan.recommend import (Crossover, Recommendation, SweepPoint, crossovers, fits_up_to, recommend,
                                    sweep)
from ctxpar.plan.workload import MAX_PLAN_SEQ, Workload
from ctxpar.plan.traffic import TensorParallelTraffic, Traffic

MIN_SWEEP_SEQ = 2**10
MAX_SWEEP_SEQ = 2**20
MIN_MAX_CP = 16  # the sweep covers at least two 8-GPU nodes
MAX_PLAN_CP = 1024


@dataclass(frozen=True)
class Plan:
    workload: Workload
    hardware: Hardware
    tensors: SequenceTensors
    memory: MemoryEstimate
    traffic: Traffic  # CP bytes per GPU per layer
    tp_traffic: TensorParallelTraffic  # TP bytes per GPU per layer
    links: dict[str, cost.Link]  # "tp", "cp" (and "ulysses", "fsdp", "replicas" or "dp", "pp": ``cost.links``)
    step: cost.StepTime
    cp1_step: cost.StepTime
    efficiency: float
    cp1_fits_up_to: int  # longest T one GPU holds (0: none)
    head_pairs: tuple[int, ...]  # per rank, one sequence
    sweep: list[SweepPoint]
    crossovers: list[Crossover]
    recommendation: Recommendation
    baseline: Baseline  # the best without CP on the same TP·P GPUs, and whether CP beats it
    recommended_baseline: Baseline  # the same for the recommended CP degree (the requested one's without one)
    calibration: dict | None = None

    @property
    def load_balance(self) -> float:
        return max(self.head_pairs) * len(self.head_pairs) / sum(self.head_pairs)


def check_plan_size(seq: int, cp: int, max_cp: int | None = None) -> None:
    """Refuse a length or degrees beyond what ``make_plan`` evaluates in reasonable time."""
    if max_cp is not None and (isinstance(max_cp, bool) or not isinstance(max_cp, numbers.Integral)):
        raise ValueError(f"--max-cp (max_cp) {max_cp!r} must be an integer: the largest CP degree to compare")
    if seq > MAX_PLAN_SEQ:
        raise ValueError(f"--seq {seq} is longer than the planner evaluates ({MAX_PLAN_SEQ} = 16M tokens: it counts "
                         f"each rank's work token by token); plan for {MAX_PLAN_SEQ} or less")
    for flag, degree in (("--cp", cp), ("--max-cp", max_cp)):
        if degree is not None and degree > MAX_PLAN_CP:
            raise ValueError(f"{flag} {degree} is beyond the largest CP degree the planner compares "
                             f"({MAX_PLAN_CP}); lower it")
    if max_cp is not None and max_cp < cp:
        raise ValueError(f"--max-cp {max_cp} is below --cp {cp}; raise it to at least {cp}")


def sweep_degrees(cp: int, max_cp: int | None = None) -> list[int]:
    """1, 2, 4, ... up to ``max_cp`` (default max(cp, 16)), plus ``cp`` itself (``check_plan_size`` first)."""
    top = max(cp, MIN_MAX_CP) if max_cp is None else max_cp
    degrees = {1, cp}
    d = 2
    while d <= top:
        degrees.add(d)
        d *= 2
    return sorted(degrees)


def sweep_seqs(seq: int) -> list[int]:
    """Powers of two from 1K to max(1M, seq), plus ``seq``."""
    seqs = {seq}
    t = MIN_SWEEP_SEQ
    while t <= max(MAX_SWEEP_SEQ, seq):
        seqs.add(t)
        t *= 2
    return sorted(seqs)


def make_plan(w: Workload, hw: Hardware, *, max_cp: int | None = None, calibration: dict | None = None) -> Plan:
    """Memory, traffic, time, the sweep, crossovers and a recommendation for ``w`` on ``hw``."""
    if not isinstance(w, Workload):
        raise ValueError(f"make_plan w must be a Workload, got a {type(w).__name__}")
    if not isinstance(hw, Hardware):
        raise ValueError(f"make_plan hw {hw!r} must be a Hardware, e.g. get_hardware('H100-SXM')")
    check_plan_size(w.seq, w.cp, max_cp)
    hw = hw.for_dtype(w.dtype)
    degrees, seqs = sweep_degrees(w.cp, max_cp), sweep_seqs(w.seq)
    requested, recommendation = baseline(w, hw), recommend(w, hw, degrees)
    chosen = recommendation.workload
    return Plan(
        workload=w,
        hardware=hw,
        tensors=sequence_tensors(w),
        memory=memory_on(w, hw),
        traffic=cost.layer_traffic(w),
        tp_traffic=cost.tp_traffic(w),
        links=cost.links(w, hw),
        step=cost.step_time(w, hw),
        cp1_step=cost.step_time(w.unsplit(), hw),
        efficiency=cost.efficiency(w, hw),
        cp1_fits_up_to=fits_up_to(w.unsplit(), hw),
        head_pairs=cost.head_pairs(w),
        sweep=sweep(w, hw, degrees, seqs),
        crossovers=crossovers(w, hw, degrees, seqs),
        recommendation=recommendation,
        baseline=requested,
        recommended_baseline=baseline(chosen, hw) if chosen is not None and chosen.cp > 1 and chosen != w
        else requested,
        calibration=calibration,
    )
