"""Masks under CP: balance for packed documents, what a sliding window saves, kernel overhead.

    python benchmarks/masks.py                       # T=65536 P=4 H=2 H_kv=1 D=64 fp32
    python benchmarks/masks.py --seq 16384 --repeat 3 --json masks.json

Three tables, one run:

1. **Balance** (arithmetic, exact): packed documents drawn from a long-tailed (log-normal,
   mean T/32, sigma 1.2) length distribution, alone and with a window; the busiest rank's visible (query, key)
   pairs over the mean, for every layout and the document-balanced one.
2. **Sliding window vs causal** (P gloo ranks, one thread each, the ring): forward +
   backward wall time (median of the slowest rank) and the bytes each rank sent, for plain
   causal and a window of T/16 on the contiguous and zigzag layouts, in the same repeats.
   For the contiguous layout the counted bytes are compared with the halo formula
   (``traffic.ring_window``).
3. **Kernel overhead of the split**: the sum over ranks of the kernel ("compute") seconds
   of one forward + backward over the unsplit masked call's kernel seconds, the same mask
   on one process with one thread (each rank has one thread too).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ctxpar
from ctxpar.demo import DemoConfig
from ctxpar.launch import run_local
from ctxpar.masks import Mask
from ctxpar.plan import traffic
from ctxpar.plan.documents import DocDist, sample_lengths
from ctxpar.plan.work import rank_pairs
import flags
from report import write_json


def long_tailed_documents(seq_len: int, seed: int = 0) -> tuple[int, ...]:
    """Log-normal lengths, mean T/32 and sigma 1.2 (a few documents of a quarter of T next
    to many short ones), drawn as ``ctxpar plan --doc-dist`` draws them; the same every run."""
    return sample_lengths(DocDist("lognormal", seq_len / 32, 1.2), seq_len, seed)


def balance_table(seq_len: int, world: int) -> list[dict]:
    documents = long_tailed_documents(seq_len)
    rows = []
    for label, mask in (("documents", Mask(documents=documents)),
                        ("documents + window T/16", Mask(documents=documents, window=seq_len // 16)),
                        ("window T/16", Mask(window=seq_len // 16)),
                        ("plain causal", Mask())):
        layouts = [ctxpar.get_layout(n, world) for n in ("contiguous", "zigzag", "striped")]
        layouts.append(ctxpar.BalancedLayout(world, seq_len, mask))
        for layout in layouts:
            pairs = [rank_pairs(layout, seq_len, r, mask) for r in range(world)]
            rows.append(dict(mask=label, layout=layout.name, documents=len(documents) if mask.documents else 1,
                             imbalance=max(pairs) / (sum(pairs) / world), rank_pairs=pairs,
                             chunks_per_rank=getattr(layout, "chunks_per_rank", None)))
    return rows


def _cases(cfg: dict, world: int) -> dict[str, tuple]:
    """name -> (layout, attention kwargs) for the timed and the kernel-overhead tables."""
    seq, window = cfg["seq"], cfg["seq"] // 16
    documents = long_tailed_documents(seq)
    return {
        "causal contiguous": (ctxpar.get_layout("contiguous", world), {}),
        "causal zigzag": (ctxpar.get_layout("zigzag", world), {}),
        "window contiguous": (ctxpar.get_layout("contiguous", world), dict(window=window)),
        "window zigzag": (ctxpar.get_layout("zigzag", world), dict(window=window)),
        "documents zigzag": (ctxpar.get_layout("zigzag", world), dict(documents=documents)),
        "documents balanced": (ctxpar.balanced_layout(world, seq, documents=documents), dict(documents=documents)),
    }


def _inputs(cfg: dict, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, h, hkv, t, d = 1, cfg["heads"], cfg["kv_heads"], cfg["seq"], cfg["head_dim"]
    return [torch.randn(shape, generator=gen) for shape in ((b, h, t, d), (b, hkv, t, d), (b, hkv, t, d), (b, h, t, d))]


def _step(layout, kwargs: dict, shards: list[torch.Tensor]) -> tuple[float, float, int]:
    """(wall seconds, kernel CPU seconds, bytes sent) of one forward + backward on this rank;
    kernel time is CPU time, which ranks time-sharing the cores do not inflate."""
    q, k, v = (t.detach().requires_grad_() for t in shards[:3])
    start = time.perf_counter()
    with ctxpar.record() as rec:
        ctxpar.attention(q, k, v, layout=layout, strategy="ring", **kwargs).backward(shards[3])
    return time.perf_counter() - start, rec.compute_cpu_seconds, rec.bytes_sent


def timing_rank(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    cases = _cases(cfg, world)
    full = _inputs(cfg)
    results = {name: dict(wall=[], compute=[], sent=0) for name in cases}
    shards = {name: [layout.shard(t, rank, dim=2).contiguous() for t in full] for name, (layout, _) in cases.items()}
    names = list(cases)
    for name in names:  # warm-up: first calls pay for plans and allocator growth
        dist.barrier()
        _step(cases[name][0], cases[name][1], shards[name])
    for i in range(cfg["repeat"]):
        for name in names[i % len(names):] + names[: i % len(names)]:
            layout, kwargs = cases[name]
            dist.barrier()
            wall, compute, sent = _step(layout, kwargs, shards[name])
            results[name]["wall"].append(wall)
            results[name]["compute"].append(compute)
            results[name]["sent"] = sent
    return results


def unsplit_kernel_seconds(cfg: dict) -> dict[str, float]:
    """Kernel CPU seconds of each case's mask on one process, one thread (after a warm-up
    call on a short row; CPU time varies little between repeats, so one is taken)."""
    torch.set_num_threads(1)
    full = _inputs(cfg)
    layout = ctxpar.get_layout("contiguous", 1)
    _step(layout, {}, [t[:, :, :256] for t in full])
    return {name: _step(layout, kwargs, full)[1] for name, (_, kwargs) in _cases(cfg, 1).items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, the shape checked on each layout the ring runs, before any rank starts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=flags.count, default=65536)
    p.add_argument("--nproc", type=flags.ranks, default=4)
    p.add_argument("--heads", type=flags.count, default=2)
    p.add_argument("--kv-heads", type=flags.count, default=1)
    p.add_argument("--head-dim", type=flags.count, default=64)
    p.add_argument("--repeat", type=flags.count, default=3)
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    if args.seq < 16:
        p.error(f"--seq {args.seq} must be at least 16: the window is T/16 keys")
    with flags.refusals(p):
        for layout in ("contiguous", "zigzag"):
            DemoConfig(nproc=args.nproc, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, layout=layout).validate(args.nproc)
    return args


def main() -> None:
    args = parse_args()
    cfg = dict(seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, repeat=args.repeat)
    world = args.nproc

    balance = balance_table(args.seq, world)
    print(f"1. balance: T={args.seq} P={world}, {balance[0]['documents']} documents, log-normal lengths "
          f"(mean T/32, sigma 1.2); busiest rank's visible pairs / mean")
    print(f"{'mask':26} {'layout':11} {'max/mean':>9} {'chunks/rank':>12}")
    for row in balance:
        chunks = "" if row["chunks_per_rank"] is None else str(row["chunks_per_rank"])
        print(f"{row['mask']:26} {row['layout']:11} {row['imbalance']:9.3f} {chunks:>12}")

    per_rank = run_local(timing_rank, world, (cfg,), threads=1)
    unsplit = unsplit_kernel_seconds(cfg)
    window = args.seq // 16
    kv_bytes = 2 * cfg["kv_heads"] * cfg["head_dim"] * 4
    timed = []
    for name in per_rank[0]:
        walls = [statistics.median(r[name]["wall"]) for r in per_rank]
        computes = [statistics.median(r[name]["compute"]) for r in per_rank]
        sent = [r[name]["sent"] for r in per_rank]
        row = dict(case=name, wall_seconds=max(walls), rank_kernel_seconds=computes, sent_bytes_per_rank=sent,
                   unsplit_kernel_seconds=unsplit[name], kernel_sum_over_unsplit=sum(computes) / unsplit[name])
        if name == "window contiguous":
            halo = [traffic.ring_window(batch=1, local_len=args.seq // world, kv_heads=cfg["kv_heads"],
                                        head_dim=cfg["head_dim"], world=world, window=window, rank=r, elem=4,
                                        acc=4)[0] for r in range(world)]
            row["halo_formula_bytes"] = [h.total for h in halo]
            row["halo_formula_holds"] = [h.total for h in halo] == sent
        timed.append(row)
    causal = {row["case"].split()[1]: row["wall_seconds"] for row in timed if row["case"].startswith("causal")}
    causal["balanced"] = causal["zigzag"]  # documents on the balanced layout: against causal zigzag
    print(f"\n2./3. ring, T={args.seq} P={world} H={cfg['heads']} H_kv={cfg['kv_heads']} D={cfg['head_dim']} fp32, "
          f"window w=T/16={window}; median of {args.repeat}; one K/V token = {kv_bytes} B")
    print(f"{'case':20} {'fwd+bwd s':>10} {'/causal':>8} {'max sent MiB':>13} {'halo formula':>13} "
          f"{'kernels sum/unsplit':>20}")
    for row in timed:
        layout = row["case"].split()[1]
        ratio = row["wall_seconds"] / causal[layout]
        formula = {True: "exact", False: "DIFFERS"}.get(row.get("halo_formula_holds"), "")
        sent = max(row["sent_bytes_per_rank"]) / 2**20
        print(f"{row['case']:20} {row['wall_seconds']:10.3f} {ratio:8.3f} {sent:13.2f} {formula:>13} "
              f"{row['kernel_sum_over_unsplit']:20.3f}")
    if args.json:
        write_json(args.json, args, balance=balance, timed=timed)


if __name__ == "__main__":
    main()
