"""The CP planner: memory, traffic and time per GPU, and at what length CP pays off.

A model of the system that stands on its own: pure arithmetic (``traffic`` for bytes,
``work`` for per-rank pairs, the rules of ``ctxpar.strategy_rules``); nothing here
imports the strategies, ``ctxpar.comm`` or torch.distributed, and tests and benchmarks
check it against the system. Measuring this machine is ``ctxpar.calibrate``'s job.
Formulas and sources: docs/planner.md.
"""

from ctxpar.plan.hardware import HARDWARE_NAMES, Hardware, check_fp8, check_overrides, get_hardware, gpus_per_node
from ctxpar.plan.documents import parse_doc_dist, parse_lengths, sample_lengths
from ctxpar.plan.inference import InferencePlan, make_inference_plan
from ctxpar.plan.inference_report import format_inference_plan, inference_to_json
from ctxpar.plan.planner import Plan, check_plan_size, make_plan, sweep_seqs
from ctxpar.plan.plot import check_plot_support, write_plot
from ctxpar.plan.report import format_plan, to_json
from ctxpar.plan.units import parse_bandwidth, parse_flops, parse_latency, parse_tile_overhead
from ctxpar.plan.workload import (CHECKPOINTING, DEFAULT_MODEL, ELEMENT_BYTES, Workload,
                                  default_ulysses, resolve_model)

__all__ = [
    "CHECKPOINTING", "DEFAULT_MODEL", "ELEMENT_BYTES", "HARDWARE_NAMES", "Hardware", "InferencePlan", "Plan",
    "Workload", "check_fp8", "check_overrides", "check_plan_size", "check_plot_support",
    "default_ulysses", "format_inference_plan", "format_plan", "get_hardware", "gpus_per_node",
    "inference_to_json", "make_inference_plan", "make_plan", "parse_bandwidth", "parse_doc_dist", "parse_flops",
    "parse_latency", "parse_lengths", "parse_tile_overhead", "resolve_model",
    "sample_lengths", "sweep_seqs", "to_json", "write_plot",
]
