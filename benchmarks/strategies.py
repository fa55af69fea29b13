"""Every CP strategy against the machine's limit, in one run: time, synchronisation, traffic, memory.

    python benchmarks/strategies.py                   # T=16384 H=8 D=64 P=4 causal zigzag fp32, H_kv 2 and 8
    python benchmarks/strategies.py --contention      # the same with a busy-loop process pinned beside the ranks
    python benchmarks/strategies.py --seq 4096 --repeat 5 --json strategies.json

Timing: one spawned group of P gloo ranks (one thread each) runs, in every repeat and in a
rotating order, forward + backward of every (strategy, H_kv), PyTorch's own ring when it
is importable (its private ``_templated_ring_attention``, same kernels and layout), and
the **limit**: rank 0 alone running one fused forward + backward over the unsplit sequence
on all the machine's cores while the others wait (the best this machine does for this
work); every row is called once untimed first, alike. A row's time is the median over
repeats of its slowest rank's wall time; ratios are taken against the limit and against
ctxpar's ring of the same H_kv, measured in the same repeats.

Synchronisation points per attention call (one layer), from ``ctxpar.record``:
communications posted and waits, forward and backward.

Memory: each (strategy, H_kv) then runs once in a fresh group of its own, so each gets its
own process-memory peak; the growth of the resident-set peak over a small warm-up call.
Bytes are counted by ctxpar.comm and compared with the formulas of docs/strategies.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import ctxpar
from ctxpar.demo import DemoConfig
from ctxpar.launch import hybrid_mesh, run_local
from ctxpar.layout import LAYOUT_NAMES
from ctxpar.plan import traffic
from ctxpar.verify import unsplit_attention
import flags
from report import write_json

STRATEGIES = ("ring", "allgather", "alltoall", "hybrid")
LIMIT, TORCH_RING = "limit (1 process, all cores)", "torch ring"


def _inputs(shape: tuple[int, ...], kv_heads: int, seed: int) -> list[torch.Tensor]:
    b, h, s, d = shape
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sh, generator=gen) for sh in ((b, h, s, d), (b, kv_heads, s, d), (b, kv_heads, s, d),
                                                       (b, h, s, d))]


def _ctxpar_step(strategy: str, mesh, layout: str):
    kwargs = dict(layout=layout, causal=True, strategy=strategy, mesh=mesh if strategy == "hybrid" else None)

    def step(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        ctxpar.attention(q, k, v, **kwargs).backward(dout)

    return step


def _torch_ring_step(scale: float):
    """PyTorch's own ring (zigzag load balancing, fused CPU op), or None if not importable."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as impl

        forward, backward = impl._templated_ring_attention, impl._templated_ring_attention_backward
    except (ImportError, AttributeError):
        return None
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def step(q, k, v, dout):
        group = dist.group.WORLD
        out, lse = forward(group, 2, fwd, q, k, v, is_causal=True, dropout_p=0.0, scale=scale)[:2]
        backward(group, 2, bwd, dout, "grad_out", q, k, v, out, lse, True, dropout_p=0.0, scale=scale)

    return step


def timing_rank(rank: int, world: int, cfg: dict) -> dict:
    """Every row's wall time per repeat on this rank, and ctxpar's synchronisation counts."""
    mesh = hybrid_mesh("cpu", world, cfg["ulysses"])
    layout = ctxpar.get_layout(cfg["layout"], world)
    h, d, seq = cfg["heads"], cfg["head_dim"], cfg["seq"]
    scale = d**-0.5
    rows: dict[tuple, callable] = {}
    shards: dict[int, list[torch.Tensor]] = {}
    full: dict[int, list[torch.Tensor]] = {}
    for kv_heads in cfg["kv_heads"]:
        full[kv_heads] = _inputs((1, h, seq, d), kv_heads, seed=kv_heads)
        shards[kv_heads] = [layout.shard(t, rank, dim=2).contiguous() for t in full[kv_heads]]
        for strategy in STRATEGIES:
            rows[(strategy, kv_heads)] = _ctxpar_step(strategy, mesh, cfg["layout"])
        ring = _torch_ring_step(scale) if cfg["layout"] == "zigzag" else None
        if ring is not None:
            rows[(TORCH_RING, kv_heads)] = ring
        rows[(LIMIT, kv_heads)] = None

    syncs = {}
    for (name, kv_heads), step in rows.items():  # the synchronisation counts
        if name not in STRATEGIES:
            continue
        q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(shards[kv_heads]))
        kwargs = dict(layout=cfg["layout"], causal=True, strategy=name, mesh=mesh if name == "hybrid" else None)
        with ctxpar.record() as fwd:
            out = ctxpar.attention(q, k, v, **kwargs)
        with ctxpar.record() as bwd:
            out.backward(dout)
        syncs[(name, kv_heads)] = dict(forward_collectives=fwd.collectives, forward_waits=fwd.waits,
                                       backward_collectives=bwd.collectives, backward_waits=bwd.waits,
                                       bytes_sent=fwd.bytes_sent + bwd.bytes_sent)

    def timed(key: tuple) -> float:
        """Wall seconds of one call of row ``key`` (the limit's: rank 0's, the others wait at the next barrier)."""
        name, kv_heads = key
        dist.barrier()
        start = time.perf_counter()
        if name == LIMIT:
            if rank == 0:
                torch.set_num_threads(os.cpu_count() or 1)
                unsplit_attention(*full[kv_heads][:3], full[kv_heads][3], causal=True, scale=scale)
                torch.set_num_threads(1)
        else:
            rows[key](*shards[kv_heads])
        return time.perf_counter() - start if (name != LIMIT or rank == 0) else 0.0

    order = list(rows)
    for key in order:  # warm-up, every row alike: first calls pay for plans, kernels' setup, allocator growth
        timed(key)
    times = {key: [] for key in order}
    for i in range(cfg["repeat"]):
        for key in order[i % len(order):] + order[: i % len(order)]:  # rotate: drift hits every row alike
            times[key].append(timed(key))
    return dict(times=times, syncs=syncs)


def memory_rank(rank: int, world: int, cfg: dict) -> dict:
    """Peak growth of one forward + backward in a fresh process, and the bytes it moved."""
    strategy, kv_heads = cfg["strategy"], cfg["kv_heads"]
    mesh = hybrid_mesh("cpu", world, cfg["ulysses"]) if strategy == "hybrid" else None
    layout = ctxpar.get_layout(cfg["layout"], world)
    small = [layout.shard(t, rank, dim=2).contiguous()
             for t in _inputs((1, cfg["heads"], layout.multiple, cfg["head_dim"]), kv_heads, seed=1)]
    step = _ctxpar_step(strategy, mesh, cfg["layout"])
    step(*small)  # warm-up
    shards = [layout.shard(t, rank, dim=2).contiguous()
              for t in _inputs((1, cfg["heads"], cfg["seq"], cfg["head_dim"]), kv_heads, seed=kv_heads)]
    cpu = torch.device("cpu")
    before = ctxpar.profile.current_memory(cpu)
    with ctxpar.record() as rec:
        step(*shards)
    return dict(peak_growth_bytes=ctxpar.profile.peak_memory(cpu)[0] - before, bytes_sent=rec.bytes_sent,
                bytes_received=rec.bytes_received)


def busy_loop() -> subprocess.Popen:
    """A process spinning on core 0 beside the ranks (the ``--contention`` load)."""
    code = "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every row they make checked as ``ctxpar.attention`` would check it, before any rank starts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=flags.count, default=16384)
    p.add_argument("--heads", type=flags.count, default=8)
    p.add_argument("--kv-heads", type=flags.counts, default="2,8", help="comma-separated H_kv values")
    p.add_argument("--head-dim", type=flags.count, default=64)
    p.add_argument("--nproc", type=flags.ranks, default=4)
    p.add_argument("--ulysses-degree", type=flags.count, default=2, help="for hybrid; ring degree = nproc / this")
    p.add_argument("--layout", choices=LAYOUT_NAMES, default="zigzag")
    p.add_argument("--repeat", type=flags.count, default=5, help="timed repeats of every row (median)")
    p.add_argument("--contention", action="store_true", help="a busy-loop process pinned to core 0 while timing")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the per-strategy memory runs")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    with flags.refusals(p):
        for kv_heads in args.kv_heads:
            for strategy in STRATEGIES:
                DemoConfig(nproc=args.nproc, seq=args.seq, heads=args.heads, kv_heads=kv_heads,
                           head_dim=args.head_dim, layout=args.layout, strategy=strategy,
                           ulysses_degree=args.ulysses_degree if strategy == "hybrid" else None).validate(args.nproc)
    return args


def main() -> None:
    args = parse_args()
    cfg = dict(seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
               ulysses=args.ulysses_degree, layout=args.layout, repeat=args.repeat)
    load = busy_loop() if args.contention else None
    try:
        ranks = run_local(timing_rank, args.nproc, (cfg,), threads=1)
    finally:
        if load is not None:
            load.kill()

    rows = []
    for key in ranks[0]["times"]:
        name, kv_heads = key
        slowest = [max(r["times"][key][i] for r in ranks) for i in range(args.repeat)]
        rows.append(dict(strategy=name, kv_heads=kv_heads, median_seconds=statistics.median(slowest),
                         seconds=slowest, **ranks[0]["syncs"].get(key, {})))
    by = {(r["strategy"], r["kv_heads"]): r for r in rows}
    for r in rows:
        r["over_limit"] = r["median_seconds"] / by[(LIMIT, r["kv_heads"])]["median_seconds"]
        r["over_ring"] = r["median_seconds"] / by[("ring", r["kv_heads"])]["median_seconds"]

    if args.memory:
        for r in rows:
            if r["strategy"] not in STRATEGIES:
                continue
            mem = run_local(memory_rank, args.nproc, (dict(cfg, strategy=r["strategy"], kv_heads=r["kv_heads"]),),
                            threads=1)
            want = traffic.per_rank(r["strategy"], batch=1, seq_len=args.seq, heads=args.heads,
                                    kv_heads=r["kv_heads"], head_dim=args.head_dim, world=args.nproc, elem=4, acc=4,
                                    ulysses=args.ulysses_degree if r["strategy"] == "hybrid" else None)
            r["peak_growth_bytes"] = [m["peak_growth_bytes"] for m in mem]
            r["formula_bytes"] = want.total
            r["formula_matches"] = all(m["bytes_sent"] == m["bytes_received"] == want.total for m in mem)

    print(format_table(args, rows))
    if args.json:
        write_json(args.json, args, rows=rows)


def format_table(args: argparse.Namespace, rows: list[dict]) -> str:
    mib = 2**20
    hybrid = f"hybrid = ulysses {args.ulysses_degree} x ring {args.nproc // args.ulysses_degree}"
    lines = [f"T={args.seq} H={args.heads} D={args.head_dim} P={args.nproc} causal {args.layout} float32, "
             f"{args.nproc} gloo ranks x 1 thread; {hybrid}; median of {args.repeat} (slowest rank)"
             + ("; with a busy loop on core 0" if args.contention else ""),
             f"{'row':<30} {'H_kv':>4} {'fwd+bwd s':>10} {'/limit':>7} {'/ring':>6} {'syncs fwd':>10} "
             f"{'syncs bwd':>10} {'sent MiB':>9} {'=formula':>8} {'peak MiB':>9}"]
    for r in rows:
        syncs = lambda d: f"{r[d + '_collectives']}+{r[d + '_waits']}w" if d + "_waits" in r else ""  # noqa: E731
        peak = f"{max(r['peak_growth_bytes']) / mib:>9.1f}" if "peak_growth_bytes" in r else f"{'':>9}"
        sent = f"{r['bytes_sent'] / mib:>9.2f}" if "bytes_sent" in r else f"{'':>9}"
        match = ("yes" if r["formula_matches"] else "NO") if "formula_matches" in r else ""
        lines.append(f"{r['strategy']:<30} {r['kv_heads']:>4} {r['median_seconds']:>10.3f} {r['over_limit']:>7.3f} "
                     f"{r['over_ring']:>6.3f} {syncs('forward'):>10} {syncs('backward'):>10} {sent} {match:>8} {peak}")
    lines.append("syncs: communications posted + waits (w) per attention call, this rank")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
