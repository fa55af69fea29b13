"""``--plot PATH``: a PNG of the sweep against sequence length, and memory per GPU by category.

Top left: parallel efficiency (CP-1 step time on the same GPUs / (P x CP-P step time):
each degree against its own CP-1, ``SweepPoint.cp1_step_seconds``) over the sweep, one
colour per CP degree, one line style per strategy; a cross where a degree stops fitting
in HBM, a dot where CP-P starts beating CP-1 (when that is inside the sweep), and a
vertical line at the longest sequence CP-1 holds. Top right: the memory per GPU of the
plan's strategy at its sequence length, stacked by category, for every degree, against
HBM. Bottom: step time and memory per GPU against sequence length for every
configuration (strategy x CP degree) of the sweep, one line style per strategy (CP-1 thick and solid), each length
that does not fit in HBM marked with a dot.

Needs matplotlib (``pip install 'ctxpar[plot]'``).
"""

from __future__ import annotations

import importlib.util
import math
import os

from ctxpar.plan.memory import MemoryEstimate, memory_on
from ctxpar.plan.planner import Plan
from ctxpar.plan.recommend import variant
from ctxpar.plan.report import mask_words, memory_labels
from ctxpar.plan.units import format_tokens
from ctxpar.plan.workload import Workload

STYLES = {"ring": "-", "allgather": "--", "alltoall": ":", "hybrid": "-."}
GIB = 2**30


def check_plot_support(path: str | None = None) -> None:
    """Refuse ``--plot`` up front, not after the plan is computed: matplotlib missing, or a
    ``path`` whose extension names no image format it writes (none: PNG)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'ctxpar[plot]' (or pip install matplotlib)")
    extension = os.path.splitext(path or "")[1].lstrip(".").lower()
    if extension:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if extension not in formats:
            raise ValueError(f"--plot {path!r}: matplotlib writes no {extension!r} images; end the path with one of "
                             f"{', '.join('.' + name for name in sorted(formats))} (e.g. plan.png)")


def write_plot(plan: Plan, path: str) -> None:
    """Draw the panels into ``path`` (in the format its extension names; none: PNG)."""
    check_plot_support()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((left, right), (times, memory)) = plt.subplots(2, 2, figsize=(15, 11), gridspec_kw=dict(width_ratios=[3, 2]))
    _efficiency_panel(plan, left)
    _memory_panel(plan, right)
    _sweep_panel(plan, times, "step_seconds", 1.0, "seconds per step", "Step time against sequence length")
    _sweep_panel(plan, memory, "memory_bytes", GIB, "GiB per GPU", "Memory per GPU against sequence length")
    shared = " (all ranks' together)" if plan.hardware.shared_memory else ""
    memory.axhline(plan.hardware.hbm_bytes / GIB, color="red", linewidth=1.5,
                   label=f"{plan.hardware.name} memory{shared}")
    _legend(memory, ncol=2, loc="upper left")
    w, m, hw = plan.workload, plan.workload.model, plan.hardware
    fig.suptitle(f"ctxpar plan: L={m.layers} d={m.hidden} H={m.heads} H_kv={m.kv_heads} D={m.head_dim}, "
                 f"B={w.batch} {w.dtype}, {w.layout}, TP={w.tp}, FSDP={w.fsdp}{_pipeline_words(w)}, "
                 f"checkpointing {w.checkpointing}, on {hw.name}\nmask: {mask_words(plan)}")
    fig.tight_layout()
    try:
        # the format named, so that matplotlib writes ``path`` itself: given none, it added ".png"
        # to a path without an extension, writing a file other than the one checked (the JSON's)
        fig.savefig(path, dpi=110, format=os.path.splitext(path)[1].lstrip(".").lower() or "png")
    finally:  # a failed write (a full disk) must not leave the figure open in a long-lived caller
        plt.close(fig)


def _efficiency_panel(plan: Plan, ax) -> None:
    import matplotlib.pyplot as plt

    degrees = sorted({p.cp for p in plan.sweep if p.cp > 1})
    colours = dict(zip(degrees, plt.get_cmap("viridis")([i / max(len(degrees) - 1, 1) for i in range(len(degrees))])))
    limits = {(c.strategy, c.cp): c for c in plan.crossovers}
    for (strategy, cp), cross in limits.items():
        points = sorted((p for p in plan.sweep if p.cp == cp and p.strategy == strategy), key=lambda p: p.seq)
        if not points:
            continue
        seqs, eff = [p.seq for p in points], [p.efficiency for p in points]
        ax.plot(seqs, eff, STYLES[strategy], color=colours[cp], label=f"CP-{cp} {strategy}")
        fitting = [p for p in points if p.seq <= cross.fits_up_to]
        if fitting and fitting[-1] is not points[-1]:
            ax.plot(fitting[-1].seq, fitting[-1].efficiency, "x", color=colours[cp], markersize=9)
        if cross.faster_from and cross.faster_from > seqs[0]:
            ax.plot(cross.faster_from, _interpolate(seqs, eff, cross.faster_from), "o", color=colours[cp])
    # a limit beyond the lengths swept only widened the axis past the data, its label under the legend
    if plan.cp1_fits_up_to and plan.cp1_fits_up_to <= max(p.seq for p in plan.sweep):
        ax.axvline(plan.cp1_fits_up_to, color="grey", linewidth=1)
        ax.annotate(f"CP-1 fits up to {format_tokens(plan.cp1_fits_up_to)}", (plan.cp1_fits_up_to, 0.02),
                    xycoords=("data", "axes fraction"), rotation=90, fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T (x: last length that fits in HBM; o: CP-P beats CP-1 from here)")
    ax.set_ylabel("parallel efficiency (against CP-1 on the same GPUs)")
    ax.set_title("Efficiency against sequence length")
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, ncol=2, loc="lower right")


def _sweep_panel(plan: Plan, ax, field: str, unit: float, ylabel: str, title: str) -> None:
    """``field`` of every sweep point / ``unit`` against T, a line per (strategy, CP degree)
    in its strategy's style, a dot on each length that does not fit in HBM."""
    import matplotlib.pyplot as plt

    degrees = sorted({p.cp for p in plan.sweep})
    colours = dict(zip(degrees, plt.get_cmap("viridis")([i / max(len(degrees) - 1, 1) for i in range(len(degrees))])))
    for strategy, cp in dict.fromkeys((p.strategy, p.cp) for p in plan.sweep):
        points = sorted((p for p in plan.sweep if (p.strategy, p.cp) == (strategy, cp)), key=lambda p: p.seq)
        xs, ys = [p.seq for p in points], [getattr(p, field) / unit for p in points]
        # CP-1 on the requested degree's GPUs: a degree on other GPUs divides by its own (the table's)
        label = f"CP-1 on {points[0].gpus} GPUs" if cp == 1 else f"CP-{cp} {strategy}"
        ax.plot(xs, ys, STYLES[strategy] if cp > 1 else "-", color=colours[cp], linewidth=2 if cp == 1 else 1,
                label=label)
        unfit = [(x, y) for p, x, y in zip(points, xs, ys) if not p.fits]
        if unfit:
            ax.plot(*zip(*unfit), ".", color=colours[cp], markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (dots: does not fit in HBM)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, ncol=2, loc="upper left")


def _legend(ax, **where) -> None:
    """A legend where something has a label: for none (a sweep of CP-1 alone), matplotlib warns."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, **where)


def _interpolate(xs: list[int], ys: list[float], x: int) -> float:
    """y at x on the plotted polyline (log-x, like the axis)."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return ys[-1]


def _pipeline_words(w) -> str:
    """', PP=4 (v=2), 8 micro-batches' where there are any."""
    pp = f", PP={w.pp}" + (f" (v={w.virtual_stages})" if w.virtual_stages > 1 else "") if w.pp > 1 else ""
    return pp + (f", {w.microbatches} micro-batches" if w.microbatches > 1 else "")


def memory_bars(plan: Plan) -> list[tuple[Workload, MemoryEstimate]]:
    """The memory panel's bars: the plan's strategy at every degree of the sweep, at T or the
    next length the degree splits (as the table shows it), CP-1 as the table builds it
    (``Workload.unsplit``: the same GPUs, so on ``local`` the same share of the RAM)."""
    w, hw = plan.workload, plan.hardware
    bars = []
    for cp in sorted({p.cp for p in plan.sweep}):
        v = w.unsplit() if cp == 1 else variant(w, hw, strategy=w.strategy, cp=cp, seq=w.padded(w.seq, cp))
        if v is not None:
            bars.append((v, memory_on(v, hw)))
    return bars


def _memory_panel(plan: Plan, ax) -> None:
    w, hw = plan.workload, plan.hardware
    skipped = "activations_checkpointed" if w.checkpointing != "full" else "activations"
    bars = memory_bars(plan)
    bottom = [0.0] * len(bars)
    x = [str(v.cp) if v.seq == w.seq else f"{v.cp}\nT={v.seq}" for v, _ in bars]
    for key, label in memory_labels(w).items():
        if key == skipped:
            continue
        heights = [mem.categories()[key] / GIB for _, mem in bars]
        ax.bar(x, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if hw.shared_memory:  # each degree's ranks share the RAM: one rank's share over its bar
        ax.hlines([mem.hbm_bytes / GIB for _, mem in bars], [i - 0.4 for i in range(len(bars))],
                  [i + 0.4 for i in range(len(bars))], color="red", linewidth=1.5,
                  label=f"one rank's share of {hw.name} memory")
    else:
        ax.axhline(hw.hbm_bytes / GIB, color="red", linewidth=1.5, label=f"{hw.name} memory")
    ax.set_xlabel(f"CP degree ({w.strategy}; CP-1 without CP)")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"Memory per GPU at T={format_tokens(w.seq)}")
    _legend(ax, loc="upper right")
