"""Every CP strategy on the same problem, in one run: time, traffic and memory per rank.

    python benchmarks/strategies.py                   # T=16384 H=8 D=64 P=4 causal zigzag, H_kv 2 and 8
    python benchmarks/strategies.py --seq 4096 --json strategies.json

Each (strategy, H_kv) runs in its own group of P local gloo ranks, so each gets its own
process-memory peak: after a small warm-up call, the rank records its resident-set peak,
runs forward + backward once per repeat, and reports the growth of that peak (the
strategy's extra memory as the OS saw it; freed-and-reused memory is counted once).
Bytes are counted by ctxpar.comm and compared with the formulas of docs/strategies.md.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import ctxpar
from ctxpar.launch import run_local
from ctxpar.plan import traffic
from report import write_json

STRATEGIES = ("ring", "allgather", "alltoall", "hybrid")


def one_rank(rank: int, world: int, args: dict) -> dict:
    strategy, ulysses = args["strategy"], args["ulysses"]
    mesh = None
    if strategy == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // ulysses, ulysses), mesh_dim_names=("ring", "ulysses"))
    kwargs = dict(layout=args["layout"], causal=True, strategy=strategy, mesh=mesh)
    gen = torch.Generator().manual_seed(rank)
    s = args["seq"] // world
    shape_q, shape_kv = (1, args["heads"], s, args["head_dim"]), (1, args["kv_heads"], s, args["head_dim"])

    def step(shape_q, shape_kv) -> ctxpar.profile.Record:
        q, k, v = (torch.randn(sh, generator=gen).requires_grad_() for sh in (shape_q, shape_kv, shape_kv))
        dout = torch.randn(shape_q, generator=gen)
        with ctxpar.record() as rec:
            out = ctxpar.attention(q, k, v, **kwargs)
            out.backward(dout)
        return rec

    layout = ctxpar.get_layout(args["layout"], world)
    small = layout.multiple // world
    step((1, args["heads"], small, args["head_dim"]), (1, args["kv_heads"], small, args["head_dim"]))  # warm-up
    cpu = torch.device("cpu")
    before = ctxpar.profile.current_memory(cpu)
    walls, rec = [], None
    for _ in range(args["repeat"]):
        dist.barrier()
        start = time.perf_counter()
        rec = step(shape_q, shape_kv)
        walls.append(time.perf_counter() - start)
    return dict(wall_seconds=min(walls), compute_cpu_seconds=rec.compute_cpu_seconds,
                bytes_sent=rec.bytes_sent, bytes_received=rec.bytes_received,
                peak_growth_bytes=ctxpar.profile.peak_memory(cpu)[0] - before)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", default="2,8", help="comma-separated H_kv values")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ulysses-degree", type=int, default=2, help="for hybrid; ring degree = nproc / this")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--repeat", type=int, default=2, help="best wall time of N")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()

    rows = []
    for kv_heads in (int(h) for h in args.kv_heads.split(",")):
        for strategy in STRATEGIES:
            cfg = dict(strategy=strategy, ulysses=args.ulysses_degree, layout=args.layout, seq=args.seq,
                       heads=args.heads, kv_heads=kv_heads, head_dim=args.head_dim, repeat=args.repeat)
            ranks = run_local(one_rank, args.nproc, (cfg,))
            want = traffic.per_rank(strategy, batch=1, seq_len=args.seq, heads=args.heads, kv_heads=kv_heads,
                                    head_dim=args.head_dim, world=args.nproc, elem=4, acc=4,
                                    ulysses=args.ulysses_degree if strategy == "hybrid" else None)
            rows.append(dict(
                strategy=strategy, kv_heads=kv_heads,
                wall_seconds=max(r["wall_seconds"] for r in ranks),
                compute_cpu_seconds=max(r["compute_cpu_seconds"] for r in ranks),
                bytes_sent=[r["bytes_sent"] for r in ranks],
                formula_bytes=want.total,
                formula_matches=all(r["bytes_sent"] == r["bytes_received"] == want.total for r in ranks),
                peak_growth_bytes=[r["peak_growth_bytes"] for r in ranks],
            ))

    mib = 2**20
    hybrid = f"hybrid = ulysses {args.ulysses_degree} x ring {args.nproc // args.ulysses_degree}"
    print(f"T={args.seq} H={args.heads} D={args.head_dim} P={args.nproc} causal {args.layout} float32, "
          f"{args.nproc} gloo ranks; {hybrid}; wall = slowest rank, best of {args.repeat}")
    print(f"{'strategy':<10} {'H_kv':>4} {'fwd+bwd s':>10} {'compute s':>10} {'sent MiB/rank':>14} "
          f"{'= formula':>10} {'peak growth MiB/rank (max)':>27}")
    for r in rows:
        print(f"{r['strategy']:<10} {r['kv_heads']:>4} {r['wall_seconds']:>10.3f} {r['compute_cpu_seconds']:>10.3f} "
              f"{max(r['bytes_sent']) / mib:>14.2f} {'yes' if r['formula_matches'] else 'NO':>10} "
              f"{max(r['peak_growth_bytes']) / mib:>27.1f}")
    if args.json:
        write_json(args.json, args, rows=rows)


if __name__ == "__main__":
    main()
