"""``ctxpar demo``: CP attention on P ranks, checked against the unsplit computation.

Every rank builds the same seeded sequence, keeps its layout shard, runs CP forward and
backward, and reports its work (pairs), time, traffic and peak memory. Rank 0 gathers
the shards and compares them with single-process attention over the whole sequence in
float64 (inputs cast up).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import ctxpar
from ctxpar.layout import LAYOUT_NAMES
from ctxpar.masks import Mask
from ctxpar.plan.work import union_pairs
from ctxpar import launch, limits, strategy_rules
from ctxpar.verify import TENSORS, max_abs_errors, rounded_partials_on, tolerances, torch_sdpa, unsplit_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DemoConfig:
    nproc: int = 4
    seq: int = 16384
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    layout: str = "zigzag"
    strategy: str = "ring"
    dtype: str = "float32"
    causal: bool = True
    batch: int = 1
    seed: int = 0
    ulysses_degree: int | None = None  # hybrid only; the ring degree is nproc / ulysses_degree
    device: str | None = None  # "cpu" | "cuda"; None: launch.resolve_device_type's default

    def validate(self, world: int, seq_flag: str = "--seq") -> None:
        """Reject a bad configuration before any communication (``world`` = ranks used;
        ``seq_flag``: the flag the length came from, a benchmark's ``--seqs``)."""
        limits.plain_values(self)
        for field in ("seq", "heads", "kv_heads", "head_dim", "batch"):
            limits.check_count(field, getattr(self, field))
        limits.check_seed(self.seed)
        limits.check_splits(ctxpar.get_layout(self.layout, world), self.seq, seq_flag)
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        u = strategy_rules.call_ulysses_degree(self.strategy, world, self.ulysses_degree, name="--ulysses-degree")
        strategy_rules.check_heads_split(self.strategy, self.heads, self.kv_heads, u)

    def check_memory(self, ranks: int) -> None:
        """Refuse a run this machine cannot hold: ``ranks`` local ranks each build the whole
        sequence, and rank 0 also a float64 copy of it for the check (a lower bound)."""
        elements = self.batch * self.seq * self.head_dim * 2 * (self.heads + self.kv_heads)  # q, dout; k, v
        needed = elements * (ranks * DTYPES[self.dtype].itemsize + 8)
        launch.check_local_memory(
            needed, f"--seq {self.seq} with --batch {self.batch}, --heads {self.heads}, --kv-heads {self.kv_heads} "
                    f"and --head-dim {self.head_dim} on {ranks} ranks (each builds the whole sequence)",
            "lower --seq (or --batch, --heads, --head-dim, or the ranks on this machine: --nproc, or torchrun's "
            "--nproc-per-node)")


def _inputs(cfg: DemoConfig) -> tuple[torch.Tensor, ...]:
    """Global q, k, v, dout (B, H, T, D) in the demo dtype, identical on every rank."""
    gen = torch.Generator().manual_seed(cfg.seed)
    b, t, d = cfg.batch, cfg.seq, cfg.head_dim
    shapes = [(b, cfg.heads, t, d), (b, cfg.kv_heads, t, d), (b, cfg.kv_heads, t, d), (b, cfg.heads, t, d)]
    return tuple(torch.randn(s, generator=gen).to(DTYPES[cfg.dtype]) for s in shapes)


def _work_pairs(cfg: DemoConfig, strategy: str, layout: ctxpar.Layout, rank: int) -> float:
    """(query, key) pairs this rank computes per head, averaged over the H heads.

    Ring and all-gather: the pairs of the rank's own queries. All-to-all over U ranks:
    all pairs of the U shards of its group, for H/U heads, i.e. those pairs / U.
    """
    u = {"alltoall": layout.world_size, "hybrid": cfg.ulysses_degree}.get(strategy, 1)
    return union_pairs(layout, cfg.seq, rank, Mask(causal=cfg.causal), u) / u


def _mesh(cfg: DemoConfig, world: int, device: torch.device):
    if cfg.strategy != "hybrid":
        return None
    return launch.hybrid_mesh(device.type, world, cfg.ulysses_degree)


def demo_rank(rank: int, world: int, cfg: DemoConfig, device: torch.device | None = None) -> dict | None:
    """One rank's part; returns the full report on rank 0 and None elsewhere.

    Every rank builds the whole seeded sequence (the check needs it on rank 0), so the
    CPU peak memory includes the unsplit inputs, not just this rank's CP working set.
    """
    device = device or torch.device("cpu")
    cfg.validate(world)
    layout = ctxpar.get_layout(cfg.layout, world)
    mesh = _mesh(cfg, world, device)
    kwargs = dict(layout=layout, causal=cfg.causal, strategy=cfg.strategy, mesh=mesh)
    if mesh is not None and ctxpar.hybrid_rank(mesh) != rank:
        raise RuntimeError("the hybrid mesh is expected to number CP ranks like the global ranks")
    q, k, v, dout = _inputs(cfg)
    local = [layout.shard(t, rank, dim=2).to(device).requires_grad_() for t in (q, k, v)]
    dout_local = layout.shard(dout, rank, dim=2).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    _warm_up(cfg, device, kwargs)
    dist.barrier()
    with ctxpar.record() as rec:
        start = time.perf_counter()
        out, lse = ctxpar.attention_with_lse(*local, **kwargs)
        out.backward(dout_local)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    chosen = dict(rec.strategy_choices)  # strategy="auto": {strategy: why}
    peak, peak_source = ctxpar.profile.peak_memory(device)
    stats = dict(
        rank=rank,
        pairs=_work_pairs(cfg, next(iter(chosen), cfg.strategy), layout, rank),
        attn_seconds=rec.compute_cpu_seconds if device.type == "cpu" else rec.compute_seconds,
        wall_seconds=wall,
        wait_seconds=rec.wait_seconds,
        compute_wall_seconds=rec.compute_seconds,
        bytes_sent=rec.bytes_sent,
        bytes_received=rec.bytes_received,
        peak_memory_bytes=peak,
    )
    results = dict(out=out, lse=lse, dq=local[0].grad, dk=local[1].grad, dv=local[2].grad)
    gathered = {name: _gather(results[name].detach().float().contiguous(), rank, world) for name in TENSORS}
    all_stats = [None] * world
    dist.gather_object(stats, all_stats if rank == 0 else None, dst=0)
    if rank != 0:
        return None

    torch.set_num_threads(os.cpu_count() or 1)  # the other ranks are done computing
    got = {name: layout.unshard(pieces, dim=2) for name, pieces in gathered.items()}
    scale = cfg.head_dim**-0.5
    # on the rank's device: a GPU's float64 is far faster than the CPU's, and the low-precision
    # baseline is then what single-device SDPA gives on that same device
    on_device = [t.to(device) for t in (q, k, v, dout)]
    ref = _to_cpu(unsplit_attention(*(t.double() for t in on_device), causal=cfg.causal, scale=scale))
    baseline = None
    if cfg.dtype != "float32":
        baseline = max_abs_errors(_to_cpu(torch_sdpa(*on_device, causal=cfg.causal, scale=scale)), ref)
    rounded = rounded_partials_on(on_device[0], world)  # q is in the demo dtype
    errors, tol = max_abs_errors(got, ref), tolerances(DTYPES[cfg.dtype], ref, baseline, rounded_partials=rounded)
    mean = lambda key: sum(s[key] for s in all_stats) / world  # noqa: E731
    return {
        "config": dict(asdict(cfg), nproc=world),
        "strategy_chosen": chosen,
        "ok": all(errors[n] <= tol[n] for n in TENSORS),
        "max_abs_err": errors,
        "tolerance": tol,
        "imbalance": {
            "pairs": max(s["pairs"] for s in all_stats) / mean("pairs"),
            "seconds": max(s["attn_seconds"] for s in all_stats) / mean("attn_seconds"),
        },
        "ranks": all_stats,
        "device": str(device),
        "backend": dist.get_backend(),
        "attn_seconds_source": "CPU time in kernels and merges (the computing thread's)"
        if device.type == "cpu"
        else "wall time in kernels and merges",
        "peak_memory_source": peak_source,
    }


def _to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.cpu() for name, t in tensors.items()}


def _warm_up(cfg: DemoConfig, device: torch.device, kwargs: dict) -> None:
    """A tiny call first, so that connecting the peers and lazy imports are not timed. Of a length
    every layout splits: ranks given other --layout values were told of other local lengths too."""
    world = kwargs["layout"].world_size
    local = math.lcm(*(ctxpar.get_layout(name, world).multiple for name in LAYOUT_NAMES)) // world
    q = torch.zeros((1, cfg.heads, local, cfg.head_dim), device=device, dtype=DTYPES[cfg.dtype], requires_grad=True)
    kv = torch.zeros((1, cfg.kv_heads, *q.shape[2:]), device=device, dtype=q.dtype, requires_grad=True)
    out = ctxpar.attention(q, kv, kv, **kwargs)
    out.backward(torch.ones_like(out))  # the first backward with a given gradient imports sympy: ~1 s


def _gather(t: torch.Tensor, rank: int, world: int) -> list[torch.Tensor] | None:
    """Rank 0 receives every rank's ``t``; gloo gathers host tensors only, so a GPU's are staged through the host."""
    if dist.get_backend() == "gloo":
        t = t.cpu()
    pieces = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
    dist.gather(t, pieces, dst=0)
    return [p.cpu() for p in pieces] if rank == 0 else None


def run_demo(cfg: DemoConfig, *, timeout_s: float = launch.DEFAULT_TIMEOUT_S) -> dict | None:
    """Run under torchrun if launched by it, else on ``cfg.nproc`` local gloo ranks.

    The configuration is checked before any rank starts. ``timeout_s`` bounds each wait at
    a collective. Returns the report on the process that holds it (rank 0, or the local
    parent).
    """
    cfg.validate(launch.world_size(cfg.nproc))
    cfg.check_memory(launch.local_ranks(cfg.nproc))
    return launch.run(demo_rank, cfg.nproc, (cfg,), device_type=cfg.device, timeout_s=timeout_s)


def format_report(report: dict) -> str:
    c = report["config"]
    mib = 2**20
    strategy = c["strategy"]
    if strategy == "hybrid":
        strategy += f" (ulysses {c['ulysses_degree']} x ring {c['nproc'] // c['ulysses_degree']})"
    strategy = strategy_rules.named_with_choice(strategy, report["strategy_chosen"])
    lines = [
        f"ctxpar demo: {strategy} attention, {c['layout']} layout, {c['nproc']} ranks "
        f"({report['backend']}, {report['device']}), B={c['batch']} T={c['seq']} H={c['heads']} "
        f"H_kv={c['kv_heads']} D={c['head_dim']}, {c['dtype']}, {'causal' if c['causal'] else 'non-causal'}",
        "",
        f"{'rank':>4} {'pairs':>14} {'attn s':>8} {'wall s':>8} {'wait s':>8} "
        f"{'sent MiB':>9} {'recv MiB':>9} {'peak MiB':>9}",
    ]
    for s in report["ranks"]:
        lines.append(
            f"{s['rank']:>4} {s['pairs']:>14,.0f} {s['attn_seconds']:>8.3f} {s['wall_seconds']:>8.3f} "
            f"{s['wait_seconds']:>8.3f} {s['bytes_sent'] / mib:>9.2f} {s['bytes_received'] / mib:>9.2f} "
            f"{s['peak_memory_bytes'] / mib:>9.1f}"
        )
    imb = report["imbalance"]
    lines += strategy_rules.choice_lines(report["strategy_chosen"])
    lines += [
        "",
        f"imbalance (max/mean): pairs {imb['pairs']:.3f}, attn seconds {imb['seconds']:.3f}",
        f"attn s = {report['attn_seconds_source']}; peak = {report['peak_memory_source']}",
        "",
        f"{'':>4} {'max abs err':>12} {'tolerance':>10}   vs unsplit attention in float64",
    ]
    for name in TENSORS:
        lines.append(f"{name:>4} {report['max_abs_err'][name]:>12.3e} {report['tolerance'][name]:>10.3e}")
    lines += ["", "OK: CP matches unsplit attention" if report["ok"] else "MISMATCH: CP differs from unsplit attention"]
    return "\n".join(lines)
