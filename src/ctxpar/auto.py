"""``strategy="auto"``: the planner's cost model picks how K/V move, for the shapes of the call.

    out = ctxpar.attention(q, k, v, layout="zigzag", strategy="auto")
    with ctxpar.record() as rec: ...; rec.strategy_choices   # [(strategy, why), ...]

For one call (B, H, H_kv, D, T = S·P, P, dtype, mask, layout) the planner predicts one
layer's attention time, forward + backward when a backward will run, forward alone
otherwise (``plan.cost.attention_time``: per-stage compute at the hardware's rate,
transfers at its bandwidth, overlapped as each strategy overlaps them) for every
strategy that can run on one process group: ring, allgather, and alltoall where P
divides H (hybrid needs a 2D mesh and is chosen explicitly). The fastest wins; ties go to
the earlier of ring, allgather, alltoall.

Hardware: ``set_hardware(hw)`` (any ``ctxpar.plan.Hardware``, e.g. a calibrated
``local_hardware``) for every later call; otherwise CUDA tensors use the preset named by
the GPU (H100, H200, A100, B200; H100-SXM for others) and CPU tensors ``CPU_DEFAULT``.
The choice depends only on the call's shapes and the hardware, so every rank makes the
same one without a message; the consistency check then compares the chosen strategy
(ranks that chose differently, on different hardware, raise together).
"""

from __future__ import annotations

import functools
import logging

import torch

from ctxpar import profile, strategy_rules
from ctxpar.layout import LAYOUT_NAMES
from ctxpar.masks import Mask
from ctxpar.models.config import attention_only
from ctxpar.plan import cost
from ctxpar.plan.hardware import PRESETS, Hardware
from ctxpar.plan.workload import Workload

AUTO = strategy_rules.AUTO
CANDIDATES = ("ring", "allgather", "alltoall")
_log = logging.getLogger("ctxpar")

# This project's CI machine kind, measured by ``ctxpar plan --hardware local --calibrate``
# (docs/benchmarks.md, "Planner against measurement"): one thread's attention rate, the gloo
# loopback bandwidth; no fixed costs, which move by 2x between calibrations here
# (``set_hardware(local_hardware(...))`` uses a calibration's, per strategy).
CPU_DEFAULT = Hardware("cpu-default", 113.2e9, 1.0, 24 * 10**9, 2, 2.455e9, 2.455e9,
                       "one CPU thread and gloo over loopback, measured on the CI machine (docs/benchmarks.md)")

_hardware: Hardware | None = None


def set_hardware(hw: Hardware | None) -> None:
    """The hardware ``strategy="auto"`` predicts on from now on (None: by device, the default)."""
    if hw is not None and not isinstance(hw, Hardware):
        raise ValueError(f"set_hardware takes a ctxpar.plan.Hardware (ctxpar.plan.get_hardware(name)) or None, got "
                         f"{type(hw).__name__}")
    global _hardware
    _hardware = hw
    choose_for_shapes.cache_clear()


def hardware_for(device: torch.device) -> Hardware:
    if _hardware is not None:
        return _hardware
    if device.type != "cuda":
        return CPU_DEFAULT
    name = torch.cuda.get_device_name(device).upper()
    for key in ("H200", "B200", "A100", "H100"):
        if key in name:
            return next(h for h in PRESETS.values() if key in h.name.upper())
    return PRESETS["h100-sxm"]


def planner_dtype(dtype: torch.dtype) -> str:
    """The planner's name for ``dtype``'s rates: bfloat16, float16, or float32 (which float64
    stands in for: the planner has no float64 rates)."""
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def choose(q: torch.Tensor, k: torch.Tensor, *, world: int, layout_name: str, mask: Mask, backward: bool
           ) -> tuple[str, str]:
    """(strategy, why) for one call; ``note`` records it once the call is known to run."""
    b, h, s, d = q.shape
    dtype = planner_dtype(q.dtype)
    hw = hardware_for(q.device)
    # the planner counts work on the named layouts; a balanced or union layout evens work out like zigzag,
    # or where its shards are of odd length (zigzag's halves would not be whole), like striped
    layout = layout_name if layout_name in LAYOUT_NAMES else "zigzag" if s % 2 == 0 else "striped"
    strategy, why = choose_for_shapes(b, h, k.shape[1], d, s * world, world, dtype, layout, mask, backward, hw)
    stand_ins = [f"{given} costed as {used}" for given, used in ((str(q.dtype).removeprefix("torch."), dtype),
                                                                   (layout_name, layout)) if given != used]
    if stand_ins and world > 1:
        why += f"; {', '.join(stand_ins)}"
    return strategy, why


def note(strategy: str, why: str) -> None:
    """Record ``choose``'s choice in ``ctxpar.record()`` and log it at debug level: after the
    ranks agreed on the call (a refused call once left a choice in some ranks' records)."""
    profile.note_strategy(strategy, why)
    _log.debug("strategy='auto' chose %s: %s", strategy, why)


@functools.lru_cache(maxsize=256)
def choose_for_shapes(batch: int, heads: int, kv_heads: int, head_dim: int, seq: int, world: int, dtype: str,
                      layout: str, mask: Mask, backward: bool, hw: Hardware) -> tuple[str, str]:
    """``choose`` from the shapes alone (T = ``seq`` over ``world`` ranks; ``dtype`` one of
    the planner's names): what benchmarks compare with measurement."""
    if world == 1:
        return "ring", "one rank: no K/V moves, every strategy is the local kernel"
    model = attention_only(heads, kv_heads, head_dim)
    hw = hw.for_dtype(dtype)
    documents = mask.documents
    times = {}
    for strategy in CANDIDATES:
        if strategy == "alltoall" and heads % world:
            continue
        try:
            w = Workload(model, batch=batch, seq=seq, dtype=dtype, cp=world, strategy=strategy, layout=layout,
                         causal=mask.causal, window=mask.window, documents=documents)
        except ValueError:  # a shape beyond what the planner evaluates
            continue
        t = cost.attention_time(w, hw)
        times[strategy] = t.seconds if backward else t.forward.seconds
    if not times:
        return "ring", f"the planner cannot evaluate T={seq} on P={world}: ring, which every shape allows"
    fastest = min(times.values())  # ties, to the last bits of rounding, go to the earlier in CANDIDATES
    best = next(strategy for strategy, seconds in times.items() if seconds <= fastest * (1 + 1e-9))
    table = ", ".join(f"{s} {t * 1e3:.4g} ms" for s, t in times.items())  # 4 digits: near-ties read apart
    costed = "".join((" non-causal" if not mask.causal else "", f" window {mask.window}" if mask.window else "",
                      f" {len(documents)} documents" if documents else ""))  # the mask the times are for
    return best, (f"predicted per layer {'forward + backward' if backward else 'forward'} on {hw.name}: {table} "
                  f"(B={batch} H={heads} H_kv={kv_heads} D={head_dim} T={seq} P={world} {dtype} {layout}{costed})")
