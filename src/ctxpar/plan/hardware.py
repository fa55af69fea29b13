"""Hardware presets: one table of accelerators, plus ``local`` for this machine's measured figures.

Figures are per GPU, from the vendors' datasheets (dense tensor-core peak, no sparsity;
HBM in GB = 1e9 bytes as the datasheets give it; NVLink per direction = half the quoted
bidirectional total; the inter-node link is one NIC per GPU as in the DGX/HGX reference
systems). ``efficiency`` is the fraction of peak the planner assumes kernels achieve:
FlashAttention-2 reports 50-73% of peak forward and up to 63% backward on A100
(Dao 2023, arXiv:2307.08691), so 0.5 is a deliberately modest default; override it with
``--efficiency`` or the whole rate with ``--flops``.

``local`` has no datasheet: its rate and bandwidth come from ``ctxpar plan --calibrate``
(``ctxpar.plan.calibrate``), measured here, and its memory is this machine's RAM.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Hardware:
    """One accelerator as the planner sees it.

    Args:
        name: preset name.
        peak_flops: dense peak FLOP/s in the compute dtype (bf16/fp16 tensor cores).
        efficiency: fraction of ``peak_flops`` that attention and matmuls achieve.
        hbm_bytes: device memory, bytes.
        gpus_per_node: GPUs joined by the intra-node link; larger CP groups cross nodes.
        intra_node_bandwidth: bytes/s per GPU per direction inside a node.
        inter_node_bandwidth: bytes/s per GPU per direction between nodes.
        source: where the figures come from.
        memory_bandwidth: device memory bytes/s (HBM; decoding reads the weights and the
            KV cache once per token); 0 where unknown.
        latency: seconds every message costs whatever its size (a ring hop, a collective);
            0 where not measured (the presets: docs/planner.md).
        attention_forward_rate: achieved FLOP/s of the attention forward alone (prefill);
            None: ``flops``, the forward + backward figure.
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

    @property
    def flops(self) -> float:
        """Achievable FLOP/s: peak x efficiency."""
        return self.peak_flops * self.efficiency

    @property
    def forward_flops(self) -> float:
        """Achievable FLOP/s of an attention forward (prefill)."""
        return self.attention_forward_rate or self.flops

    def bandwidth(self, group_size: int) -> float:
        """Bytes/s per GPU per direction for a collective over ``group_size`` consecutive GPUs.

        A group that spans nodes is paced by its slowest hop, the inter-node link.
        """
        return self.inter_node_bandwidth if self.crosses_nodes(group_size) else self.intra_node_bandwidth

    def crosses_nodes(self, span: int) -> bool:
        """Whether ``span`` consecutive GPUs (a group and the GPUs between its members) leave one node."""
        return span > self.gpus_per_node

    def as_dict(self) -> dict:
        return dict(asdict(self), achievable_flops=self.flops)


_DATASHEETS = "NVIDIA datasheets (dense peak, HBM in GB); NVLink per direction; one NDR/HDR NIC per GPU"
GB = 10**9
MIN_EFFICIENCY = 0.01  # below 1% of peak, kernels are not what the cost model describes
MAX_GPUS_PER_NODE = 2**16  # a "node" is the domain of the fast link (an NVL72 rack is 72)

PRESETS: dict[str, Hardware] = {
    h.name.lower(): h
    for h in (
        Hardware("H100-SXM", 989e12, 0.5, 80 * GB, 8, 450e9, 50e9,
                 _DATASHEETS + " (NVLink 4 900 GB/s, 400 Gb/s, HBM3 3.35 TB/s)", memory_bandwidth=3.35e12),
        Hardware("H200", 989e12, 0.5, 141 * GB, 8, 450e9, 50e9,
                 _DATASHEETS + " (NVLink 4 900 GB/s, 400 Gb/s, HBM3e 4.8 TB/s)", memory_bandwidth=4.8e12),
        Hardware("A100-80GB", 312e12, 0.5, 80 * GB, 8, 300e9, 25e9,
                 _DATASHEETS + " (NVLink 3 600 GB/s, 200 Gb/s, HBM2e 2.0 TB/s)", memory_bandwidth=2.039e12),
        Hardware("B200", 2250e12, 0.5, 180 * GB, 8, 900e9, 50e9,
                 _DATASHEETS + " (HGX B200, NVLink 5 1.8 TB/s, 400 Gb/s, HBM3e 8 TB/s)", memory_bandwidth=8e12),
    )
}
LOCAL = "local"
HARDWARE_NAMES = (*(h.name for h in PRESETS.values()), LOCAL)


def local_hardware(calibration: dict) -> Hardware:
    """This machine from measured figures: ``ctxpar.plan.calibrate.calibrate()``'s result.

    The rate is one CPU rank's (one thread) attention forward + backward FLOP/s, taken as
    achieved (efficiency 1); each core counts as a "GPU" and the loopback bandwidth joins
    them all, so intra- and inter-node links are the same measured figure.
    """
    for key in ("attention_flops", "bandwidth"):
        if key not in calibration:
            raise ValueError(f"calibration has no {key!r}; produce one with `ctxpar plan --hardware local --calibrate "
                             f"--json PATH` and pass --calibration PATH")
        value = calibration[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"calibration {key!r} is {value!r}, not a positive rate; measure again with "
                             f"`ctxpar plan --hardware local --calibrate --json PATH`")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bw = calibration["bandwidth"]
    attention = calibration.get("attention", {})
    forward = attention.get("forward_flops", 0) / attention["forward_seconds"] if attention.get("forward_seconds") \
        else None
    return Hardware(LOCAL, calibration["attention_flops"], 1.0, ram, _node_size(LOCAL), bw, bw,
                    f"measured on this machine ({calibration.get('machine', 'unknown CPU')}); memory = RAM",
                    memory_bandwidth=calibration.get("memory_bandwidth", 0.0), latency=calibration.get("latency", 0.0),
                    attention_forward_rate=forward)


def gpus_per_node(name: str) -> int:
    """GPUs per node of the preset ``name`` (``local``: this machine's cores), before any measurement."""
    return _node_size(name)


def _node_size(name: str) -> int:
    key = name.lower()
    if key == LOCAL:
        return os.cpu_count() or 1
    if key not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE_NAMES)} "
                         f"(--flops, --bandwidth and --efficiency override a preset's figures)")
    return PRESETS[key].gpus_per_node


def check_overrides(
    *, bandwidth: float | None = None, peak_flops: float | None = None, efficiency: float | None = None,
    latency: float | None = None, gpus_per_node: int | None = None,
) -> None:
    """Refuse override figures that are not positive finite numbers (efficiency: in [0.01, 1];
    latency: finite, >= 0; GPUs per node: an integer >= 1)."""
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or not 1 <= gpus_per_node <= MAX_GPUS_PER_NODE):
        raise ValueError(f"--gpus-per-node {gpus_per_node} must be an integer between 1 and {MAX_GPUS_PER_NODE}")
    for flag, value in (("--bandwidth", bandwidth), ("--flops", peak_flops)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} {value} must be a positive finite rate")
    if efficiency is not None and not MIN_EFFICIENCY <= efficiency <= 1:
        raise ValueError(f"--efficiency {efficiency} must be in [{MIN_EFFICIENCY}, 1]: the achieved fraction of "
                         f"peak FLOP/s")
    if latency is not None and not (math.isfinite(latency) and latency >= 0):
        raise ValueError(f"--latency {latency} must be a finite number of seconds >= 0")


def get_hardware(
    name: str,
    *,
    calibration: dict | None = None,
    bandwidth: float | None = None,
    peak_flops: float | None = None,
    efficiency: float | None = None,
    latency: float | None = None,
    gpus_per_node: int | None = None,
) -> Hardware:
    """A preset by name (case-insensitive), with optional overrides.

    ``bandwidth`` replaces both links (intra- and inter-node); ``peak_flops`` the peak;
    ``efficiency`` the achieved fraction; ``latency`` the seconds per message;
    ``gpus_per_node`` the GPUs the intra-node link joins. ``local`` needs ``calibration``.
    """
    _node_size(name)  # refuses an unknown name
    check_overrides(bandwidth=bandwidth, peak_flops=peak_flops, efficiency=efficiency, latency=latency,
                    gpus_per_node=gpus_per_node)
    key = name.lower()
    if key == LOCAL:
        if calibration is None:
            raise ValueError("--hardware local needs measured figures: add --calibrate (a few seconds) or "
                             "--calibration PATH (a JSON written by --calibrate --json PATH)")
        hw = local_hardware(calibration)
    else:
        hw = PRESETS[key]
    changes = dict(intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, peak_flops=peak_flops,
                   efficiency=efficiency, latency=latency, gpus_per_node=gpus_per_node)
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes:
        hw = replace(hw, source=hw.source + "; overridden: " + ", ".join(sorted(changes)), **changes)
    return hw
