"""The CP planner: memory, traffic and time per GPU, and at what length CP pays off.

Pure arithmetic over the library's own formulas (``ctxpar.strategies.traffic`` for bytes,
``ctxpar.blocks.rank_pairs`` for per-rank work); nothing here communicates, except
``ctxpar.plan.calibrate``, which measures this machine when asked to.
Formulas and sources: docs/planner.md.
"""

from ctxpar.plan.calibrate import format_calibration, plan_calibration
from ctxpar.plan.hardware import HARDWARE_NAMES, Hardware, get_hardware
from ctxpar.plan.planner import Plan, make_plan
from ctxpar.plan.plot import write_plot
from ctxpar.plan.report import format_plan, to_json
from ctxpar.plan.units import parse_bandwidth, parse_flops
from ctxpar.plan.workload import (CHECKPOINTING, DEFAULT_MODEL, ELEMENT_BYTES, STRATEGY_NAMES, Workload,
                                  default_ulysses, resolve_model)

__all__ = [
    "CHECKPOINTING", "DEFAULT_MODEL", "ELEMENT_BYTES", "HARDWARE_NAMES", "STRATEGY_NAMES", "Hardware", "Plan",
    "Workload", "default_ulysses", "format_calibration", "format_plan", "get_hardware", "make_plan",
    "parse_bandwidth", "parse_flops", "plan_calibration", "resolve_model", "to_json", "write_plot",
]
