"""Hardware presets: one table of accelerators, plus ``local`` for this machine's measured figures.

Figures are per GPU, from the vendors' datasheets (dense tensor-core peak, no sparsity;
NVLink per direction = half the quoted
bidirectional total; the inter-node link is one NIC per GPU as in the DGX/HGX reference
systems), except device memory: the total NVML (nvidia-smi) reports, in MiB, which is
about 7% more than the datasheets' round "80GB" read as 1e9 bytes (the B200's as Vultr's HGX
B200 overview reports it; docs/planner.md section 6).

Kernel rates (achieved FLOP/s; docs/planner.md section 6 gives every figure, its source and
how the ones not published for a GPU were derived): attention forward and backward are
FlashAttention-2's published rates at head dim 128 in bf16, causal where published, except
on the H200, where they, how they fall for small kernels (size curves) and the cost of a
kernel call were measured with ctxpar's own kernels (torch's cuDNN op) by ``make
gpu-check``; matmuls are the Maximum Achievable Matmul FLOPS (bf16) of
stas00/ml-engineering. ``--flops`` / ``--efficiency`` replace all three with one rate,
peak x efficiency (``efficiency`` is 0.5 in the presets: the rate before separate kernel
rates). ``--fp8`` runs matmuls at the fp8 dense peak times the
matmul efficiency (matmul rate / peak); attention stays in the compute dtype.

Fixed costs: ``latency`` per message, ``launch_overhead`` per kernel call, the tile
overheads per tile of a block plan (and per byte it accumulates), ``step_overhead`` per
pipeline stage (for ``local`` per strategy, and a part per byte the stage sends); 0 in the
presets unless given or measured (the H200's launch overhead), measured for ``local``.

``local`` has no datasheet: its rates, latency and bandwidth come from ``ctxpar plan
--calibrate`` (``ctxpar.calibrate``), measured here, and its memory is this machine's RAM.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import asdict, dataclass, replace

from ctxpar.limits import plain_values
from ctxpar.plan.units import BANDWIDTH_RANGE, FLOPS_RANGE, LATENCY_RANGE, check_seconds
from ctxpar.strategy_rules import STRATEGY_NAMES


def _is_number(value, *, positive: bool = False) -> bool:
    """A finite int or float (not a bool), > 0 if ``positive`` else >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value > 0 if positive else value >= 0


def _check_figure(key: str, value, *, positive: bool = False) -> None:
    if not _is_number(value, positive=positive):
        raise ValueError(f"Hardware {key} {value!r} must be a finite number {'> 0' if positive else '>= 0'}")


def _strategy_rows_ok(rows) -> bool:
    """(strategy, seconds) ``rows`` name known strategies with finite seconds within ``LATENCY_RANGE``."""
    return isinstance(rows, (tuple, list)) and all(
        isinstance(row, (tuple, list)) and len(row) == 2 and row[0] in STRATEGY_NAMES and _is_number(row[1])
        and row[1] <= LATENCY_RANGE[1] for row in rows)


SIZE_FRACTIONS = (1e-3, 1e3)  # of the attention rate, by kernel size: measured 0.39-1.2


def _size_curve_problem(rows) -> str | None:
    """What is wrong with (tokens, forward, backward) ``rows``, to follow the rows in a message:
    not rows of three numbers at ascending tokens >= 1, or fractions of the rate beyond
    ``SIZE_FRACTIONS``; None where nothing is."""
    try:
        curve = tuple((int(t), float(f), float(b)) for t, f, b in rows)
    except (TypeError, ValueError, OverflowError):
        curve = ()
    if not curve or any(t < 1 for t, _, _ in curve) or any(a[0] >= b[0] for a, b in zip(curve, curve[1:])):
        return ", not ascending [tokens, forward, backward] rows"
    low, high = SIZE_FRACTIONS
    if not all(low <= f <= high and low <= b <= high for _, f, b in curve):
        return f": its rate fractions must be within {low:g} .. {high:g}"
    return None


@dataclass(frozen=True)
class Hardware:
    """One accelerator as the planner sees it.

    Args:
        name: preset name.
        peak_flops: dense peak FLOP/s in the compute dtype (bf16/fp16 tensor cores).
        efficiency: fraction of ``peak_flops`` every kernel achieves where no kernel rate is given.
        hbm_bytes: device memory, bytes.
        gpus_per_node: GPUs joined by the intra-node link; larger groups, and those straddling
            two nodes, cross nodes.
        intra_node_bandwidth: bytes/s per GPU per direction inside a node.
        inter_node_bandwidth: bytes/s per GPU per direction between nodes.
        source: where the figures come from.
        memory_bandwidth: device memory bytes/s (HBM; decoding reads the weights and the
            KV cache once per token); 0 where unknown.
        latency: seconds every message costs whatever its size (a ring hop, a collective);
            0 where not measured (the presets: docs/planner.md).
        attention_forward_rate: achieved FLOP/s of the attention forward; None: ``flops``.
        attention_backward_rate: achieved FLOP/s of the attention backward (FLOPs counted
            as 2.5x the forward's); None: ``flops``.
        matmul_rate: achieved FLOP/s of the model's matmuls in the compute dtype; None: ``flops``.
        fp8_peak_flops: dense fp8 tensor-core peak FLOP/s; 0 where the GPU has none.
        fp8: matmuls run in fp8, at ``fp8_peak_flops`` x the matmul efficiency.
        fp32_peak_flops: float32 peak FLOP/s without tensor cores (torch's default for float32
            matmuls: no TF32); a float32 workload runs every kernel at the rates above x
            fp32_peak_flops / peak_flops (``for_dtype``); 0: the rates stand for every dtype
            (``local``: measured in the dtype the calibration ran).
        launch_overhead: seconds every kernel call costs whatever its size.
        step_overhead: seconds every pipeline stage (ring step) costs besides its kernels
            and messages.
        strategy_step_overheads: ((strategy, seconds), ...): a step overhead measured for
            each listed strategy (``local``: each strategy's steps do different work);
            the others pay ``step_overhead``. None: ``step_overhead`` for all.
        strategy_step_byte_overheads: ((strategy, seconds per byte), ...): what each of the
            strategy's stages costs besides, serially, per byte it sends: the work that grows
            with what a stage moves but is neither kernel nor overlapped link time (packing
            and unpacking buffers, the all-to-all's re-layouts, collectives slower than the
            one hop ``intra_node_bandwidth`` is measured on), measured for ``local``; None:
            nothing for any.
        attention_size_curve: ((tokens, forward, backward), ...) ascending: the attention
            rates of a square full (unmasked) kernel over ``tokens`` queries and keys as
            fractions of the rates above (small tiles run below the large-tile rate);
            None: every size at the full rate.
        attention_causal_size_curve: the same for causal kernels, whose tiles on the
            diagonal are computed whole: what the plan's causal tiles run at.
        size_curve_by_keys: the curves are looked up at a tile's keys (measured so for
            ``local``'s CPU kernels, docs/planner.md section 6); else at the rank's shard,
            for every tile of its plan (the GPU presets, until measured there).
        tile_forward_overhead, tile_backward_overhead: seconds every kernel call of a block
            plan's tile costs in the forward (backward) besides the kernel: the merge of its
            output into the accumulators (the adds of its gradients into dQ, dK, dV) and,
            for ``local``, the strategy's Python around the call, fixed part.
        tile_forward_seconds_per_byte: and per byte of output the forward merges (B·q·H·D
            accumulator elements); tile_backward_seconds_per_byte: per byte of gradients
            the backward adds (B·(q·H + 2·k·H_kv)·D). All four measured for ``local``, 0 in
            the presets (``make gpu-check`` measures the tile loop's on a GPU).
        shared_memory: ``hbm_bytes`` is one machine's memory that all ranks of a run share
            (``local``: CPU ranks in its RAM), each holding its 1/world share
            (``memory_per_rank``); False: every GPU's own.
    """

    name: str
    peak_flops: float
    efficiency: float
    hbm_bytes: int
    gpus_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    source: str
    memory_bandwidth: float = 0.0
    latency: float = 0.0
    attention_forward_rate: float | None = None
    attention_backward_rate: float | None = None
    matmul_rate: float | None = None
    fp8_peak_flops: float = 0.0
    fp8: bool = False
    fp32_peak_flops: float = 0.0
    launch_overhead: float = 0.0
    step_overhead: float = 0.0
    strategy_step_overheads: tuple[tuple[str, float], ...] | None = None
    strategy_step_byte_overheads: tuple[tuple[str, float], ...] | None = None
    attention_size_curve: tuple[tuple[int, float, float], ...] | None = None
    attention_causal_size_curve: tuple[tuple[int, float, float], ...] | None = None
    size_curve_by_keys: bool = False
    tile_forward_overhead: float = 0.0
    tile_backward_overhead: float = 0.0
    tile_forward_seconds_per_byte: float = 0.0
    tile_backward_seconds_per_byte: float = 0.0
    shared_memory: bool = False

    def __post_init__(self) -> None:
        """Refuse figures no machine has, naming the field: the cost model would divide by a zero
        rate, or choose by a NaN or a negative one without a word (``auto.set_hardware``)."""
        plain_values(self, "Hardware")  # numpy's numbers become floats and ints, or the JSON report fails
        for key in ("peak_flops", "hbm_bytes", "intra_node_bandwidth", "inter_node_bandwidth"):
            _check_figure(key, getattr(self, key), positive=True)
        for key in ("memory_bandwidth", "latency", "fp8_peak_flops", "fp32_peak_flops", "launch_overhead",
                    "step_overhead", *TILE_OVERHEADS):
            _check_figure(key, getattr(self, key))
        for key in ("attention_forward_rate", "attention_backward_rate", "matmul_rate"):
            if getattr(self, key) is not None:
                _check_figure(key, getattr(self, key), positive=True)
        if not (_is_number(self.efficiency, positive=True) and self.efficiency <= 1):
            raise ValueError(f"Hardware efficiency {self.efficiency!r} must be in (0, 1]: the achieved fraction "
                             f"of peak")
        if self.fp8 and not self.fp8_peak_flops:  # matmul_flops scales by it: a ZeroDivisionError later
            raise ValueError(f"Hardware fp8=True needs fp8_peak_flops > 0 ({self.name} has none given): give the "
                             f"fp8 dense peak, or leave fp8 False")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or not 1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE:
            raise ValueError(f"Hardware gpus_per_node {self.gpus_per_node!r} must be an integer between 1 and "
                             f"{MAX_GPUS_PER_NODE}")
        # the calibration loader's checks: a misspelt strategy was ignored, a short row raised an
        # IndexError later, a descending curve gave wrong figures without a word
        # and rows given as lists become the tuples the fields hold: a Hardware is a cache key
        # (``auto.choose_for_shapes``), and a list in it made every later auto call a TypeError
        for key in ("strategy_step_overheads", "strategy_step_byte_overheads"):
            table = getattr(self, key)
            if table is None:
                continue
            if not _strategy_rows_ok(table):
                unit = "seconds per byte" if key == "strategy_step_byte_overheads" else "seconds"
                raise ValueError(f"Hardware {key} is {str(table)[:80]}, not ((strategy, {unit}), ...) with strategies "
                                 f"among {', '.join(STRATEGY_NAMES)} and {unit} within {LATENCY_RANGE[2]}; or None")
            object.__setattr__(self, key, tuple((name, float(seconds)) for name, seconds in table))
        for key in ("attention_size_curve", "attention_causal_size_curve"):
            curve = getattr(self, key)
            if curve is None:
                continue
            if problem := _size_curve_problem(curve):
                raise ValueError(f"Hardware {key} is {str(curve)[:80]}{problem}; or None: every size at the full rate")
            object.__setattr__(self, key, tuple((int(t), float(f), float(b)) for t, f, b in curve))

    @property
    def flops(self) -> float:
        """Achievable FLOP/s where no kernel rate is given: peak x efficiency."""
        return self.peak_flops * self.efficiency

    @property
    def forward_flops(self) -> float:
        """Achieved FLOP/s of an attention forward."""
        return self.attention_forward_rate or self.flops

    @property
    def backward_flops(self) -> float:
        """Achieved FLOP/s of an attention backward."""
        return self.attention_backward_rate or self.flops

    @property
    def matmul_flops(self) -> float:
        """Achieved FLOP/s of the matmuls: in fp8, the fp8 peak x (matmul rate / peak)."""
        rate = self.matmul_rate or self.flops
        return rate * self.fp8_peak_flops / self.peak_flops if self.fp8 else rate

    def for_dtype(self, dtype: str) -> Hardware:
        """The rates a workload in ``dtype`` (a planner name: bfloat16, float16, float32) gets:
        float32 runs on the CUDA cores, every kernel rate scaled by fp32_peak_flops / peak_flops
        (the fraction of peak each achieves kept); other dtypes, or no fp32 figure, unchanged."""
        if dtype != "float32" or not self.fp32_peak_flops:
            return self
        # fp8 matmuls (rate x fp8 peak / peak) keep their speed: rate and peak scale alike
        return replace(self, peak_flops=self.fp32_peak_flops, fp32_peak_flops=0.0,
                       **self._kernel_rates_times(self.fp32_peak_flops / self.peak_flops))

    def _kernel_rates_times(self, share: float) -> dict[str, float | None]:
        """The three kernel rates times ``share`` (None stays None: peak x efficiency)."""
        return {key: None if getattr(self, key) is None else getattr(self, key) * share
                for key in ("attention_forward_rate", "attention_backward_rate", "matmul_rate")}

    def step_overhead_for(self, strategy: str) -> float:
        """Seconds per pipeline stage of ``strategy`` (``strategy_step_overheads``, else ``step_overhead``)."""
        return dict(self.strategy_step_overheads or ()).get(strategy, self.step_overhead)

    def step_overhead_per_byte(self, strategy: str) -> float:
        """Seconds per pipeline stage of ``strategy`` per byte the stage sends
        (``strategy_step_byte_overheads``; a strategy not measured, the hybrid, pays the
        ring's, as it does ``step_overhead``; 0 where nothing was measured)."""
        table = dict(self.strategy_step_byte_overheads or ())
        return table.get(strategy, table.get("ring", 0.0))

    def attention_size_scale(self, tokens: float, causal: bool = False) -> tuple[float, float]:
        """(forward, backward) rate fractions for a full (or ``causal``) kernel over ``tokens``:
        the size curve interpolated in log tokens, its end values beyond its ends (a causal
        kernel beyond its curve's end: ``_causal_beyond_curve``); (1, 1) without one."""
        curve = self.attention_causal_size_curve if causal else self.attention_size_curve
        if not curve:
            return 1.0, 1.0
        if tokens <= curve[0][0]:
            return curve[0][1], curve[0][2]
        for (t0, f0, b0), (t1, f1, b1) in zip(curve, curve[1:]):
            if tokens <= t1:
                x = math.log(tokens / t0) / math.log(t1 / t0)
                return f0 + x * (f1 - f0), b0 + x * (b1 - b0)
        if causal and self.attention_size_curve:
            return self._causal_beyond_curve(tokens)
        return curve[-1][1], curve[-1][2]

    def _causal_beyond_curve(self, tokens: float) -> tuple[float, float]:
        """A causal kernel longer than its curve's last T: where a full kernel of T runs
        faster per visible pair (rate f against the causal c), the causal one loses the
        share w = 1 - c/f of its time to the diagonal's tiles it computes whole; that
        diagonal grows as T and the pairs as T², so at ``tokens`` the loss is w·T/tokens
        and the rate f·(1 - w·T/tokens), rising from c toward f (on this CPU, 8192 tokens:
        1.065 of the 4096-token causal kernel's rate predicted, 1.045-1.063 measured). Where
        the full kernel is not faster (the H200's cuDNN), the curve's last value."""
        end, *causal = self.attention_causal_size_curve[-1]
        full = self.attention_size_scale(end)
        return tuple(f * (1 - (1 - c / f) * end / tokens) if f > c else c for c, f in zip(causal, full))

    def with_compute_share(self, share: float) -> Hardware:
        """Ranks time-sharing cores, each with ``share`` of one: every rate times ``share``, and
        the per-call, per-tile and per-step CPU costs (launch, tile and step overheads) over it."""
        return replace(self, peak_flops=self.peak_flops * share, fp8_peak_flops=self.fp8_peak_flops * share,
                       **self._kernel_rates_times(share), launch_overhead=self.launch_overhead / share,
                       step_overhead=self.step_overhead / share,
                       strategy_step_overheads=_over(self.strategy_step_overheads, share),
                       strategy_step_byte_overheads=_over(self.strategy_step_byte_overheads, share),
                       **{key: getattr(self, key) / share for key in TILE_OVERHEADS})

    def bandwidth(self, span: int, world: int | None = None) -> float:
        """Bytes/s per GPU per direction for a collective over groups spanning ``span``
        consecutive GPUs, laid side by side over ``world`` GPUs (None: one group).

        A group that spans nodes is paced by its slowest hop, the inter-node link, and the
        slowest group sets the step: one group leaving a node prices them all so.
        """
        return self.inter_node_bandwidth if self.crosses_nodes(span, world) else self.intra_node_bandwidth

    def all_to_all_bandwidth(self, span: int, stride: int, world: int | None = None) -> float:
        """Bytes/s per GPU per direction of an all-to-all among the GPUs ``stride`` apart in
        each group of ``span`` consecutive GPUs (TP innermost: stride = TP), laid side by side
        over ``world`` GPUs. Each GPU sends an equal share to every peer at once: those in its
        node over the intra-node link, the others through its own inter-node one; the GPU with
        the most peers off its node paces the exchange. (Priced wholly at the inter-node rate
        it took 1.88x too long across 2 nodes of 8, the share that stays in a node included.)
        Links of one figure (a local machine's loopback, ``--bandwidth``) are taken for one
        link, which every byte crosses."""
        members = span // stride
        one_link = self.intra_node_bandwidth == self.inter_node_bandwidth
        if members < 2 or one_link or not self.crosses_nodes(span, world):
            return self.bandwidth(span, world)
        n = self.gpus_per_node
        slowest = 0.0  # seconds per byte a GPU sends
        for start in self._group_starts(span, world):
            for first in range(start, start + stride):
                nodes = Counter((first + i * stride) // n for i in range(members))
                for together in nodes.values():
                    inside, off = together - 1, members - together
                    slowest = max(slowest, inside / self.intra_node_bandwidth, off / self.inter_node_bandwidth)
        return (members - 1) / slowest

    def crosses_nodes(self, span: int, world: int | None = None) -> bool:
        """Whether a group spanning ``span`` consecutive GPUs (its members and the GPUs between
        them), or one of its copies side by side over ``world`` GPUs, leaves one node."""
        return self.straddling_group(span, world) is not None

    def straddling_group(self, span: int, world: int | None = None) -> int | None:
        """The first GPU of the first group that leaves a node, of the ``world / span`` groups
        of ``span`` consecutive GPUs starting at multiples of ``span`` (Megatron's rank order);
        None if all stay in one. A group fitting a node may still straddle two: 6 GPUs a
        node, groups of 4 on GPUs 4-7."""
        n = self.gpus_per_node
        return next((start for start in self._group_starts(span, world) if start % n + span > n), None)

    def _group_starts(self, span: int, world: int | None) -> range:
        """The first GPU of each group of ``span`` consecutive GPUs over ``world`` (None: one
        group) that can differ in how it lies over the nodes: where a group starts within its
        node repeats after n / gcd(span, n) groups."""
        n = self.gpus_per_node
        return range(0, min((world or span) // span, n // math.gcd(span, n)) * span, span)

    def memory_per_rank(self, world: int) -> int:
        """Bytes each of ``world`` ranks may fill: ``hbm_bytes``, or its 1/world share where all
        ranks share it (``shared_memory``)."""
        return self.hbm_bytes // world if self.shared_memory else self.hbm_bytes

    def as_dict(self) -> dict:
        return dict(asdict(self), achievable_flops=self.flops, attention_forward_flops=self.forward_flops,
                    attention_backward_flops=self.backward_flops, matmul_flops=self.matmul_flops)


def _datasheets(memory: str) -> str:
    return f"NVIDIA datasheets (dense peak); memory: {memory}; NVLink per direction; one NDR/HDR NIC per GPU"


_DATASHEETS = _datasheets("NVML's total")
_KERNELS = "kernel rates: FlashAttention-2 and MAMF benchmarks, docs/planner.md section 6"
MiB = 2**20
T = 10**12
# (tokens, forward, backward): one kernel over ``tokens`` queries and keys (H=32, H_kv=8, D=128,
# bf16) as a fraction of the preset's rates, the causal 32K kernel's (make gpu-check, H200)
_H200_CAUSAL_CURVE = ((1024, 0.112, 0.136), (2048, 0.297, 0.398), (4096, 0.584, 0.676), (8192, 0.782, 0.878),
                      (16384, 0.931, 1.019), (32768, 1.0, 1.0))
_H200_FULL_CURVE = ((1024, 0.243, 0.355), (2048, 0.545, 0.677), (4096, 0.823, 0.892), (8192, 0.941, 1.013),
                    (16384, 1.011, 1.009), (32768, 0.954, 0.983))
TILE_OVERHEADS = ("tile_forward_overhead", "tile_backward_overhead", "tile_forward_seconds_per_byte",
                  "tile_backward_seconds_per_byte")  # what a tile costs beyond its kernel (``Hardware``)
MIN_EFFICIENCY = 0.01  # below 1% of peak, kernels are not what the cost model describes
MAX_GPUS_PER_NODE = 2**16  # a "node" is the domain of the fast link (an NVL72 rack is 72)
BACKWARD_FLOPS_RATIO = 2.5  # FlashAttention's convention: backward = 2.5 x forward FLOPs

PRESETS: dict[str, Hardware] = {
    h.name.lower(): h
    for h in (
        Hardware("H100-SXM", 989e12, 0.5, 81559 * MiB, 8, 450e9, 50e9,
                 _DATASHEETS + " (NVLink 4 900 GB/s, 400 Gb/s, HBM3 3.35 TB/s); " + _KERNELS,
                 memory_bandwidth=3.35e12, attention_forward_rate=335 * T, attention_backward_rate=322 * T,
                 matmul_rate=794.5 * T, fp8_peak_flops=1979 * T, fp32_peak_flops=67 * T),
        Hardware("H200", 989e12, 0.5, 143771 * MiB, 8, 450e9, 50e9,
                 _DATASHEETS + " (NVLink 4 900 GB/s, 400 Gb/s, HBM3e 4.8 TB/s); attention rates, their size curves "
                 "and the launch overhead measured with ctxpar's kernels (cuDNN) by `make gpu-check` on one H200, "
                 "docs/planner.md section 6; matmuls: MAMF",
                 memory_bandwidth=4.8e12, attention_forward_rate=652 * T, attention_backward_rate=558 * T,
                 matmul_rate=794.5 * T, fp8_peak_flops=1979 * T, fp32_peak_flops=67 * T, launch_overhead=33e-6,
                 attention_size_curve=_H200_FULL_CURVE, attention_causal_size_curve=_H200_CAUSAL_CURVE),
        Hardware("A100-80GB", 312e12, 0.5, 81920 * MiB, 8, 300e9, 25e9,
                 _DATASHEETS + " (NVLink 3 600 GB/s, 200 Gb/s, HBM2e 2.0 TB/s); " + _KERNELS,
                 memory_bandwidth=2.039e12, attention_forward_rate=0.73 * 312 * T,
                 attention_backward_rate=0.63 * 312 * T, matmul_rate=271.2 * T, fp32_peak_flops=19.5 * T),
        Hardware("B200", 2250e12, 0.5, 179 * 1024 * MiB, 8, 900e9, 50e9,
                 _datasheets("Vultr's HGX B200 overview, not checked to the MiB")
                 + " (HGX B200, NVLink 5 1.8 TB/s, 400 Gb/s, HBM3e 8 TB/s); " + _KERNELS
                 + " (attention: H100's fractions of peak)",
                 memory_bandwidth=8e12, attention_forward_rate=335 / 989 * 2250 * T,
                 attention_backward_rate=322 / 989 * 2250 * T, matmul_rate=1745 * T, fp8_peak_flops=4500 * T,
                 fp32_peak_flops=75 * T),
    )
}
LOCAL = "local"
HARDWARE_NAMES = (*(h.name for h in PRESETS.values()), LOCAL)


def local_hardware(calibration: dict) -> Hardware:
    """This machine from measured figures: ``ctxpar.calibrate.calibrate()``'s result.

    The peak is one CPU rank's (one thread) attention forward + backward FLOP/s, taken as
    achieved (efficiency 1); the attention forward and backward rates, the matmul rate and
    the per-call launch, per-tile and per-stage step overheads (fixed and per byte sent, per
    strategy) are their own measurements where the calibration has them (older
    calibrations: the combined rate, no overheads). Each core counts as a "GPU" and the
    loopback bandwidth joins them all, so intra- and inter-node links are the same; the
    RAM is shared by all ranks of a run (``shared_memory``).
    """
    # within the ranges the flags take: a hand-edited figure beyond them gave NaN or inf times
    for key, bounds in (("attention_flops", FLOPS_RANGE), ("bandwidth", BANDWIDTH_RANGE)):
        if key not in calibration:
            raise ValueError(f"calibration has no {key!r}; produce one with `ctxpar plan --hardware local --calibrate "
                             f"--json PATH` and pass --calibration PATH")
        value = calibration[key]
        if not _is_number(value, positive=True):
            raise ValueError(f"calibration {key!r} is {value!r}, not a positive rate; {MEASURE_AGAIN}")
        _check_calibrated(key, value, bounds)
    for key in ("memory_bandwidth", "latency", "launch_overhead", "step_overhead", *TILE_OVERHEADS):
        value = calibration.get(key, 0.0)
        if not _is_number(value):
            raise ValueError(f"calibration {key!r} is {value!r}, not a number >= 0; {MEASURE_AGAIN}")
        if value:  # 0: not measured
            _check_calibrated(key, value, BANDWIDTH_RANGE if key == "memory_bandwidth" else LATENCY_RANGE)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bw = calibration["bandwidth"]
    attention = calibration.get("attention", {})
    if not isinstance(attention, dict) or not all(_is_number(attention.get(key, 1), positive=True) for key in (
            "forward_flops", "forward_seconds", "backward_seconds")):
        raise ValueError(f"calibration 'attention' is {str(attention)[:80]}, not {{forward_flops, forward_seconds, "
                         f"backward_seconds}} (positive numbers); {MEASURE_AGAIN}")
    if calibration.get("matmul_flops") is not None:
        _check_calibrated("matmul_flops", calibration["matmul_flops"], FLOPS_RANGE)

    def rate(flops: float, seconds: float | None) -> float | None:
        if not seconds:
            return None
        _check_calibrated("attention", flops / seconds, FLOPS_RANGE)
        return flops / seconds

    flops = attention.get("forward_flops", 0)
    return Hardware(LOCAL, calibration["attention_flops"], 1.0, ram, _node_size(LOCAL), bw, bw,
                    f"measured on this machine ({calibration.get('machine', 'unknown CPU')}); memory = RAM",
                    memory_bandwidth=calibration.get("memory_bandwidth", 0.0), latency=calibration.get("latency", 0.0),
                    attention_forward_rate=rate(flops, attention.get("forward_seconds")),
                    attention_backward_rate=rate(BACKWARD_FLOPS_RATIO * flops, attention.get("backward_seconds")),
                    matmul_rate=calibration.get("matmul_flops"),
                    launch_overhead=calibration.get("launch_overhead", 0.0),
                    step_overhead=calibration.get("step_overhead", 0.0),
                    strategy_step_overheads=_strategy_overheads(calibration, "strategy_step_overheads"),
                    strategy_step_byte_overheads=_strategy_overheads(calibration, "strategy_step_byte_overheads"),
                    attention_size_curve=_size_curve(calibration.get("attention_size_curve")),
                    attention_causal_size_curve=_size_curve(calibration.get("attention_causal_size_curve"),
                                                            "attention_causal_size_curve"),
                    size_curve_by_keys=True, **{key: calibration.get(key, 0.0) for key in TILE_OVERHEADS},
                    shared_memory=True)


MEASURE_AGAIN = "measure again with `ctxpar plan --hardware local --calibrate --json PATH`"


def _check_calibrated(key: str, value: float, bounds: tuple[float, float, str]) -> None:
    low, high, written = bounds
    if not (_is_number(value) and low <= value <= high):
        raise ValueError(f"calibration {key!r} is {value!r}, outside {written}; {MEASURE_AGAIN}")


def _over(table: tuple[tuple[str, float], ...] | None, share: float) -> tuple[tuple[str, float], ...] | None:
    """Every strategy's figure in ``table`` over ``share``."""
    return None if table is None else tuple((name, seconds / share) for name, seconds in table)


def _strategy_overheads(calibration: dict, key: str) -> tuple[tuple[str, float], ...] | None:
    """A calibration's {strategy: seconds} under ``key``, checked: known strategies, finite seconds >= 0."""
    table = calibration.get(key)
    if table is None:
        return None
    if not (isinstance(table, dict) and _strategy_rows_ok(tuple(table.items()))):
        unit = "seconds per byte" if key == "strategy_step_byte_overheads" else "seconds"
        raise ValueError(f"calibration {key!r} is {str(table)[:80]}, not {{strategy: {unit}}} within "
                         f"{LATENCY_RANGE[2]}; {MEASURE_AGAIN}")
    return tuple(sorted((name, float(v)) for name, v in table.items()))


def _size_curve(rows, name: str = "attention_size_curve"):
    """A calibration's [[tokens, forward, backward], ...], checked (``_size_curve_problem``) and
    refused as a calibration's; ``Hardware`` holds it as tuples."""
    if rows is not None and (problem := _size_curve_problem(rows)):
        raise ValueError(f"calibration {name!r} is {str(rows)[:80]}{problem}; {MEASURE_AGAIN}")
    return rows


def gpus_per_node(name: str) -> int:
    """GPUs per node of the preset ``name`` (``local``: this machine's cores), before any measurement."""
    return _node_size(name)


def _node_size(name: str) -> int:
    if not isinstance(name, str):
        raise ValueError(f"hardware {name!r} must be a name, one of {', '.join(HARDWARE_NAMES)}")
    key = name.lower()
    if key == LOCAL:
        return os.cpu_count() or 1
    if key not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE_NAMES)} "
                         f"(--flops, --bandwidth and --efficiency override a preset's figures)")
    return PRESETS[key].gpus_per_node


def check_fp8(name: str) -> None:
    """Refuse ``--fp8`` for hardware without fp8 tensor cores (A100, a CPU), naming it."""
    key = name.lower()
    if key == LOCAL or not PRESETS[key].fp8_peak_flops:
        fp8 = ", ".join(h.name for h in PRESETS.values() if h.fp8_peak_flops)
        raise ValueError(f"--fp8: {name} has no fp8 tensor cores (fp8 matmuls need one of {fp8}); drop --fp8")


def check_overrides(
    *, bandwidth: float | None = None, peak_flops: float | None = None, efficiency: float | None = None,
    latency: float | None = None, gpus_per_node: int | None = None, launch_overhead: float | None = None,
    step_overhead: float | None = None, tile_overhead: tuple[float, float] | None = None, hardware: str = "",
) -> None:
    """Refuse override figures that are not positive finite numbers (efficiency: in [0.01, 1];
    GPUs per node: an integer >= 1), and latency and overheads outside the flags' 0 .. 1 s
    (``units.check_seconds``, the flags' own check; the tile overhead a (forward, backward)
    pair), and an efficiency for ``hardware`` "local". Rates beyond the flags' ranges stay
    allowed: 1e30 B/s stands for free links."""
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or not 1 <= gpus_per_node <= MAX_GPUS_PER_NODE):
        raise ValueError(f"--gpus-per-node {gpus_per_node} must be an integer between 1 and {MAX_GPUS_PER_NODE}")
    for flag, value in (("--bandwidth", bandwidth), ("--flops", peak_flops)):
        if value is not None and not _is_number(value, positive=True):
            raise ValueError(f"{flag} {value} must be a positive finite rate")
    if efficiency is not None and not (_is_number(efficiency) and MIN_EFFICIENCY <= efficiency <= 1):
        raise ValueError(f"--efficiency {efficiency!r} must be in [{MIN_EFFICIENCY}, 1]: the achieved fraction of "
                         f"peak FLOP/s")
    if efficiency is not None and hardware.lower() == LOCAL:  # its "peak" is the measured attention rate
        raise ValueError("--efficiency scales a preset's peak FLOP/s; --hardware local's rates are measured (the "
                         "matmuls' above the attention rate it calls peak): give --flops for one rate instead")
    for flag, value in (("--latency", latency), ("--launch-overhead", launch_overhead),
                        ("--step-overhead", step_overhead)):
        if value is not None:
            if not _is_number(value):
                raise ValueError(f"{flag} {value} must be a finite number of seconds >= 0")
            check_seconds(value, flag, example="2e-05 (seconds)")
    if tile_overhead is not None:
        if not (isinstance(tile_overhead, (tuple, list)) and len(tile_overhead) == 2
                and all(_is_number(value) for value in tile_overhead)):
            raise ValueError(f"--tile-overhead {tile_overhead!r} must be (forward, backward) seconds, finite and >= 0")
        for value in tile_overhead:
            check_seconds(value, "--tile-overhead", example="(2e-05, 4e-05) (seconds)")


def get_hardware(
    name: str,
    *,
    calibration: dict | None = None,
    bandwidth: float | None = None,
    peak_flops: float | None = None,
    efficiency: float | None = None,
    latency: float | None = None,
    gpus_per_node: int | None = None,
    launch_overhead: float | None = None,
    step_overhead: float | None = None,
    tile_overhead: tuple[float, float] | None = None,
    fp8: bool = False,
) -> Hardware:
    """A preset by name (case-insensitive), with optional overrides.

    ``bandwidth`` replaces both links (intra- and inter-node); ``peak_flops`` the peak and
    ``efficiency`` the achieved fraction: either one replaces the kernel rates with one rate,
    peak x efficiency (a ``peak_flops`` given stands for float32 too: ``for_dtype``);
    ``latency`` the seconds per message, ``launch_overhead`` per kernel call,
    ``step_overhead`` per pipeline stage, ``tile_overhead`` (forward, backward) per tile
    beyond its kernel (both replace the measured figures, fixed and per byte);
    ``gpus_per_node`` the GPUs the intra-node link joins; ``fp8`` runs matmuls at the fp8
    peak x the matmul efficiency (refused for hardware without fp8). ``local`` needs
    ``calibration``.
    """
    _node_size(name)  # refuses an unknown name
    if not isinstance(fp8, bool):  # "no" would be true
        raise ValueError(f"fp8 {fp8!r} must be True or False (--fp8)")
    check_overrides(bandwidth=bandwidth, peak_flops=peak_flops, efficiency=efficiency, latency=latency,
                    gpus_per_node=gpus_per_node, launch_overhead=launch_overhead, step_overhead=step_overhead,
                    tile_overhead=tile_overhead, hardware=name)
    key = name.lower()
    if key == LOCAL:
        if calibration is None:
            raise ValueError("--hardware local needs measured figures: add --calibrate (about 75 s on 2 cores) or "
                             "--calibration PATH (a JSON written by --calibrate --json PATH)")
        hw = local_hardware(calibration)
    else:
        hw = PRESETS[key]
    if fp8:
        check_fp8(name)
    changes = dict(intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, peak_flops=peak_flops,
                   efficiency=efficiency, latency=latency, gpus_per_node=gpus_per_node,
                   launch_overhead=launch_overhead, step_overhead=step_overhead)
    if tile_overhead is not None:  # the fixed parts given, replacing measured ones and their per-byte parts
        changes.update(tile_forward_overhead=tile_overhead[0], tile_backward_overhead=tile_overhead[1],
                       tile_forward_seconds_per_byte=0.0, tile_backward_seconds_per_byte=0.0)
    changes = {k: v for k, v in changes.items() if v is not None}
    if step_overhead is not None:  # one step overhead for every strategy, replacing measured ones
        changes.update(strategy_step_overheads=None, strategy_step_byte_overheads=None)
    if peak_flops is not None or efficiency is not None:  # one rate for every kernel, as before kernel rates
        changes.update(attention_forward_rate=None, attention_backward_rate=None, matmul_rate=None)
    if peak_flops is not None:  # the peak given stands for every dtype: float32 is not scaled back to the preset's
        changes.update(fp32_peak_flops=0.0)
        # fp8 keeps the preset's fp8 / 16-bit ratio: with the preset's own fp8 peak, a --flops
        # cancelled out of the fp8 matmul rate (2 PFLOP/s made fp8 slower than 16-bit)
        changes.update(fp8_peak_flops=hw.fp8_peak_flops * peak_flops / hw.peak_flops)
    if changes:
        given = sorted(k for k in changes if not k.endswith(("_rate", "_per_byte"))
                       and not k.startswith(("strategy_", "fp32_")))
        hw = replace(hw, source=hw.source + "; overridden: " + ", ".join(given), **changes)
    if fp8:
        hw = replace(hw, fp8=True, source=hw.source + "; fp8 matmuls")
    return hw
