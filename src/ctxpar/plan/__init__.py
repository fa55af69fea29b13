"""The CP planner: memory, traffic and time per GPU, and at what length CP pays off.

Pure arithmetic over the library's own formulas (``ctxpar.strategies.traffic`` for bytes,
``ctxpar.blocks.rank_pairs`` for per-rank work); nothing here communicates, except
``ctxpar.plan.calibrate``, which measures this machine when asked to.
Formulas and sources: docs/planner.md.
"""

from ctxpar.plan.calibrate import check_calibration_flags, format_calibration, load_calibration, plan_calibration
from ctxpar.plan.hardware import HARDWARE_NAMES, Hardware, check_overrides, get_hardware, gpus_per_node
from ctxpar.plan.planner import Plan, check_plan_size, make_plan
from ctxpar.plan.plot import check_plot_support, write_plot
from ctxpar.plan.report import format_plan, to_json
from ctxpar.plan.units import parse_bandwidth, parse_flops
from ctxpar.plan.workload import (CHECKPOINTING, DEFAULT_MODEL, ELEMENT_BYTES, STRATEGY_NAMES, Workload,
                                  default_ulysses, resolve_model)

__all__ = [
    "CHECKPOINTING", "DEFAULT_MODEL", "ELEMENT_BYTES", "HARDWARE_NAMES", "STRATEGY_NAMES", "Hardware", "Plan",
    "Workload", "check_calibration_flags", "check_overrides", "check_plan_size", "check_plot_support",
    "default_ulysses", "format_calibration", "format_plan", "get_hardware", "gpus_per_node", "load_calibration",
    "make_plan", "parse_bandwidth", "parse_flops", "plan_calibration", "resolve_model", "to_json", "write_plot",
]
