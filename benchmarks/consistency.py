"""What the default consistency check costs: one tiny all-gather per attention call.

    python benchmarks/consistency.py                      # P=4 gloo ranks, T = 1024, 4096, 16384
    python benchmarks/consistency.py --seq 2048,8192 --json consistency.json

For each length, every rank runs the same causal zigzag ring attention forward with
``check_consistency`` on and off, alternating (so drift hits both alike), and reports
the median wall time of each; the check alone (``agreement.check_ranks_agree`` on a
signature) is timed over many calls. The ratio is the median on/off of the slowest rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ctxpar
from ctxpar import agreement, topology
from ctxpar.launch import run_local
from report import write_json


def one_rank(rank: int, world: int, args: dict) -> dict:
    torch.manual_seed(rank)
    topo = topology.from_group(None)
    q = torch.randn(1, args["heads"], 4, args["head_dim"])
    sig = agreement.signature(q, q, q, layout_name="zigzag", causal=True, scale=0.125, strategy="ring",
                              rejected=False)
    for _ in range(10):  # connect and warm up
        agreement.check_ranks_agree(sig, topo, None)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args["calls"]):
        agreement.check_ranks_agree(sig, topo, None)
    check_seconds = (time.perf_counter() - start) / args["calls"]

    rows = []
    for seq in args["seqs"]:
        s = seq // world
        q = torch.randn(1, args["heads"], s, args["head_dim"])
        k, v = (torch.randn(1, args["kv_heads"], s, args["head_dim"]) for _ in range(2))
        times = {True: [], False: []}
        with torch.no_grad():
            for i in range(2 * args["repeat"] + 2):
                checked = i % 2 == 0
                dist.barrier()
                start = time.perf_counter()
                ctxpar.attention(q, k, v, layout="zigzag", check_consistency=checked)
                if i >= 2:  # the first pair warms up
                    times[checked].append(time.perf_counter() - start)
        rows.append(dict(seq=seq, on=statistics.median(times[True]), off=statistics.median(times[False])))
    return dict(check_seconds=check_seconds, rows=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", default="1024,4096,16384", help="comma-separated global lengths T")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7, help="timed calls per setting (median)")
    p.add_argument("--calls", type=int, default=500, help="calls of the check alone")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()

    cfg = dict(seqs=[int(t) for t in args.seq.split(",")], heads=args.heads, kv_heads=args.kv_heads,
               head_dim=args.head_dim, repeat=args.repeat, calls=args.calls)
    ranks = run_local(one_rank, args.nproc, (cfg,))
    check = max(r["check_seconds"] for r in ranks)
    rows = []
    for i, seq in enumerate(cfg["seqs"]):
        on = max(r["rows"][i]["on"] for r in ranks)
        off = max(r["rows"][i]["off"] for r in ranks)
        rows.append(dict(seq=seq, forward_on_seconds=on, forward_off_seconds=off, ratio=on / off,
                         check_share=check / off))
    print(f"consistency check, {args.nproc} gloo ranks, H={args.heads} H_kv={args.kv_heads} D={args.head_dim}, "
          f"ring zigzag causal float32 forward; slowest rank, median of {args.repeat}")
    print(f"check alone: {check * 1e6:.0f} us per call (mean of {args.calls})")
    print(f"{'T':>7} {'fwd on s':>10} {'fwd off s':>10} {'on/off':>7} {'check/fwd':>10}")
    for r in rows:
        print(f"{r['seq']:>7} {r['forward_on_seconds']:>10.4f} {r['forward_off_seconds']:>10.4f} "
              f"{r['ratio']:>7.3f} {r['check_share']:>10.2%}")
    if args.json:
        write_json(args.json, args, check_seconds=check, rows=rows)


if __name__ == "__main__":
    main()
