"""Overhead of splitting attention into a ring's blocks, without communication.

Every rank's attention work (forward and backward, with the merges and gradient
accumulation) runs here one rank at a time, in one process, against the other ranks'
K/V shards held locally: exactly the compute the ring strategy does, with the
communication taken out. Its sum over ranks is compared with one fused forward +
backward over the unsplit sequence, in the same run, on one thread.

    python benchmarks/overhead.py                       # T=16384, H=8, H_kv=2, D=64, P=4
    python benchmarks/overhead.py --seq 4096 --json overhead.json

Reports, per layout: each rank's CPU seconds (best of --repeat), the sum / unsplit ratio (the cost of
splitting) and max / min over ranks (how evenly the layout spreads the work).
"""

from __future__ import annotations

import argparse
import time

import torch

import ctxpar
from ctxpar.blocks import layout_tiles
from ctxpar.demo import DemoConfig
from ctxpar.layout import LAYOUT_NAMES
from ctxpar.strategies.blockwise import backward_tiles, forward_tiles, gradient_accumulators, output_accumulators
from ctxpar.masks import Mask
from ctxpar.verify import unsplit_attention
import flags
from report import write_json


def rank_step(layout, seq_len: int, rank: int, shards: dict, causal: bool, scale: float) -> None:
    """Rank ``rank``'s share of CP forward + backward, every K/V shard already local."""
    q, dout = shards["q"][rank], shards["dout"][rank]
    acc_out, acc_lse = output_accumulators(q)
    for src in range(layout.world_size):
        tiles = layout_tiles(layout, seq_len, rank, src, Mask(causal=causal))
        forward_tiles(q, shards["k"][src], shards["v"][src], tiles, acc_out, acc_lse, scale)
    out = acc_out.to(q.dtype)
    dq, dkv = gradient_accumulators(q, shards["k"][rank])
    for src in range(layout.world_size):
        dkv.zero_()  # each source's dK/dV share, as the ring's scratch accumulator
        tiles = layout_tiles(layout, seq_len, rank, src, Mask(causal=causal))
        backward_tiles(dout, q, shards["k"][src], shards["v"][src], out, acc_lse, tiles, scale, dq, dkv[0], dkv[1])


def seconds(fn) -> float:
    """CPU seconds of ``fn`` (one thread): on a shared machine, wall time also counts the
    moments the process was not running, which are noise, not work."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=flags.count, default=16384)
    p.add_argument("--heads", type=flags.count, default=8)
    p.add_argument("--kv-heads", type=flags.count, default=2)
    p.add_argument("--head-dim", type=flags.count, default=64)
    p.add_argument("--nproc", type=flags.count, default=4, help="P, the simulated ranks")
    p.add_argument("--layouts", type=flags.names(LAYOUT_NAMES), default="zigzag,striped,contiguous")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--threads", type=flags.count, default=1)
    p.add_argument("--repeat", type=flags.count, default=3, help="best of N for every measurement")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    with flags.refusals(p):
        for layout in args.layouts:
            DemoConfig(nproc=args.nproc, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, layout=layout, causal=args.causal).validate(args.nproc)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    shape_q = (1, args.heads, args.seq, args.head_dim)
    shape_kv = (1, args.kv_heads, args.seq, args.head_dim)
    q, k, v, dout = (torch.randn(s, generator=gen) for s in (shape_q, shape_kv, shape_kv, shape_q))
    scale = args.head_dim**-0.5
    layouts = [ctxpar.get_layout(name, args.nproc) for name in args.layouts]
    shards = {
        layout.name: {
            name: [layout.shard(t, r, dim=2) for r in range(args.nproc)]
            for name, t in dict(q=q, k=k, v=v, dout=dout).items()
        }
        for layout in layouts
    }

    unsplit = []
    per_rank = {layout.name: [[] for _ in range(args.nproc)] for layout in layouts}
    for _ in range(args.repeat):  # interleaved, so drift on the machine hits every column alike
        unsplit.append(seconds(lambda: unsplit_attention(q, k, v, dout, causal=args.causal, scale=scale)))
        for layout in layouts:
            for r in range(args.nproc):
                step = lambda: rank_step(layout, args.seq, r, shards[layout.name], args.causal, scale)  # noqa: E731
                per_rank[layout.name][r].append(seconds(step))

    base = min(unsplit)
    rows = []
    for layout in layouts:
        times = [min(ts) for ts in per_rank[layout.name]]
        rows.append(dict(layout=layout.name, rank_seconds=times, sum_seconds=sum(times),
                         sum_over_unsplit=sum(times) / base, max_over_min=max(times) / min(times)))

    print(f"T={args.seq} H={args.heads} H_kv={args.kv_heads} D={args.head_dim} P={args.nproc} "
          f"{'causal' if args.causal else 'non-causal'} float32, {args.threads} thread(s), best of {args.repeat}")
    print(f"unsplit fused forward+backward: {base:.3f} s (CPU time)")
    print(f"{'layout':<11} " + " ".join(f"{'rank ' + str(r) + ' s':>9}" for r in range(args.nproc))
          + f" {'sum s':>8} {'sum/unsplit':>12} {'max/min rank':>13}")
    for row in rows:
        print(f"{row['layout']:<11} " + " ".join(f"{t:>9.3f}" for t in row["rank_seconds"])
              + f" {row['sum_seconds']:>8.3f} {row['sum_over_unsplit']:>12.3f} {row['max_over_min']:>13.3f}")
    if args.json:
        write_json(args.json, args, unsplit_seconds=base, layouts=rows)


if __name__ == "__main__":
    main()
