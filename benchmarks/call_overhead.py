"""Host time per ``ctxpar.attention`` call outside the fused kernels and the collectives.

Each rank's thread CPU time of a forward + backward (B=1, float32, one thread per rank),
split into the fused CPU attention ops, the calls that post collectives, and the rest: the
host work of the call (validation, the consistency check's signature, plan lookups, merges,
accumulators, autograd), which on a GPU is what the launches wait behind.

    python benchmarks/call_overhead.py                  # P=2, T=512,1024, ring/allgather/alltoall
    python benchmarks/call_overhead.py --seq 4096 --documents 64 --json overhead.json
    git worktree add /tmp/before HEAD~1 && \\
    python benchmarks/call_overhead.py --baseline /tmp/before/src   # before/after, alternating

With ``--baseline SRC`` the ctxpar package under SRC (another checkout's ``src``) is loaded
beside this one, each rank alternates the two call by call, and every row says whether their
out, lse and dQ, dK, dV (and d sinks) are bit-identical. Figures: medians of --repeat calls,
the slowest rank's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from ctxpar.demo import DemoConfig
from ctxpar.launch import run_local
from ctxpar.layout import LAYOUT_NAMES
from ctxpar.strategy_rules import STRATEGY_NAMES
import flags
from baseline import bits, check_baseline, ctxpar_modules, load_baseline, write_and_judge

PARTS = ("kernels", "collectives")
INSTRUMENTED = ("kernels.cpu", "comm", "agreement")  # the modules whose calls are timed


class Instrumented:
    """One ctxpar package with its fused ops and collective posts timed (thread CPU time)."""

    def __init__(self, modules: dict) -> None:
        self.attention = modules["ctxpar"].attention_with_lse
        self.spent = dict.fromkeys(PARTS, 0.0)
        cpu, comm, agreement = (modules[f"ctxpar.{name}"] for name in INSTRUMENTED)
        cpu._cpu_fwd, cpu._cpu_bwd = self._timed(cpu._cpu_fwd, "kernels"), self._timed(cpu._cpu_bwd, "kernels")
        comm.all_gather_into = agreement.all_gather_into = self._timed(comm.all_gather_into, "collectives")
        comm._reduce_scatter = self._timed(comm._reduce_scatter, "collectives")
        comm.dist = _Posting(self._timed)  # the ring's batch_isend_irecv, the all-to-all's all_to_all_single

    def _timed(self, fn, part: str):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.thread_time() - start
        return timed

    def call(self, q, k, v, dout, sinks, **kwargs) -> tuple[dict[str, float], list[torch.Tensor]]:
        """One forward + backward: its (total, kernels, collectives) seconds and its results."""
        self.spent.update(dict.fromkeys(PARTS, 0.0))
        start = time.thread_time()
        out, lse = self.attention(q, k, v, sinks=sinks, **kwargs)
        out.backward(dout)
        total = time.thread_time() - start
        leaves = [t for t in (q, k, v, sinks) if t is not None]
        results = [out.detach(), lse, *(t.grad for t in leaves)]
        for t in leaves:
            t.grad = None
        return dict(total=total, **self.spent), results


class _Posting:
    """``torch.distributed`` as ``ctxpar.comm`` sees it, its posting calls timed."""

    def __init__(self, timed) -> None:
        self._posts = {name: timed(getattr(dist, name), "collectives")
                       for name in ("batch_isend_irecv", "all_to_all_single")}

    def __getattr__(self, name: str):
        return self._posts.get(name) or getattr(dist, name)


def inputs(rank: int, row: dict, cfg: dict) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(rank)
    s = row["seq"] // cfg["nproc"]
    q, dout = (torch.randn(1, cfg["heads"], s, cfg["head_dim"], generator=gen) for _ in range(2))
    k, v = (torch.randn(1, cfg["kv_heads"], s, cfg["head_dim"], generator=gen) for _ in range(2))
    sinks = torch.randn(cfg["heads"], generator=torch.Generator().manual_seed(-1)) if cfg["sinks"] else None  # alike
    return q, k, v, dout, sinks


def call_kwargs(row: dict, cfg: dict) -> dict:
    kwargs = dict(layout=row["layout"], strategy=row["strategy"], check_consistency=row["check"])
    if cfg["documents"]:
        n = cfg["documents"]
        kwargs["documents"] = [n] * (row["seq"] // n) + ([row["seq"] % n] if row["seq"] % n else [])
    if cfg["window"]:
        kwargs["window"] = cfg["window"]
    return kwargs


def one_rank(rank: int, world: int, cfg: dict) -> list[dict]:
    impls = {"after": Instrumented(ctxpar_modules())}
    if cfg["baseline"]:
        impls = {"before": Instrumented(load_baseline(cfg["baseline"], INSTRUMENTED)), **impls}
    rows = []
    for row in cfg["rows"]:
        q, k, v, dout, sinks = inputs(rank, row, cfg)
        for t in (q, k, v, sinks):
            if t is not None:
                t.requires_grad_()
        kwargs = call_kwargs(row, cfg)
        times = {name: [] for name in impls}
        results = {}
        for i in range(cfg["warmup"] + cfg["repeat"]):  # alternating: drift on the machine hits both alike
            for name, impl in impls.items():
                spent, results[name] = impl.call(q, k, v, dout, sinks, **kwargs)
                if i >= cfg["warmup"]:
                    times[name].append(spent)
        same = (all(torch.equal(a, b) for a, b in zip(results["before"], results["after"]))
                if "before" in results else None)
        rows.append(dict(row, identical=same, **{
            f"{name}_{part}": statistics.median(t[part] for t in ts) for name, ts in times.items()
            for part in ("total", *PARTS)}))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=flags.counts, default="512,1024", help="comma-separated global lengths T")
    p.add_argument("--strategies", type=flags.names([s for s in STRATEGY_NAMES if s != "hybrid"]),
                   default="ring,allgather,alltoall")
    p.add_argument("--layouts", type=flags.names(LAYOUT_NAMES), default="zigzag,contiguous")
    p.add_argument("--check", type=flags.names(("on", "off")), default="off",
                   help="check_consistency: on, off, or on,off")
    p.add_argument("--heads", type=flags.count, default=8)
    p.add_argument("--kv-heads", type=flags.count, default=2)
    p.add_argument("--head-dim", type=flags.count, default=64)
    p.add_argument("--nproc", type=flags.ranks, default=2)
    p.add_argument("--documents", type=flags.count, help="equal documents of this many tokens (the last shorter)")
    p.add_argument("--window", type=flags.count, help="causal sliding window")
    p.add_argument("--sinks", action="store_true", help="per-head attention sinks")
    p.add_argument("--repeat", type=flags.count, default=21, help="timed calls per row (median)")
    p.add_argument("--warmup", type=flags.count, default=3)
    p.add_argument("--baseline", metavar="SRC", help="another checkout's src/, alternated with this one")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    with flags.refusals(p):
        for seq in args.seq:
            for layout in args.layouts:
                for strategy in args.strategies:
                    DemoConfig(nproc=args.nproc, seq=seq, heads=args.heads, kv_heads=args.kv_heads,
                               head_dim=args.head_dim, layout=layout, strategy=strategy).validate(args.nproc)
        if args.baseline:
            check_baseline(args.baseline)
    return args


def main() -> None:
    args = parse_args()
    rows = [dict(strategy=s, layout=layout, seq=seq, check=check == "on") for seq in args.seq
            for s in args.strategies for layout in args.layouts for check in args.check]
    cfg = dict(vars(args), rows=rows)
    ranks = run_local(one_rank, args.nproc, (cfg,), threads=1)
    names = ("before", "after") if args.baseline else ("after",)
    slowest = []
    for i in range(len(rows)):  # the slowest rank's figures, by its total
        worst = {name: max((r[i] for r in ranks), key=lambda x, n=name: x[f"{n}_total"]) for name in names}
        merged = dict(rows[i], identical=None if not args.baseline else all(r[i]["identical"] for r in ranks))
        for name in names:
            merged.update({key: value for key, value in worst[name].items() if key.startswith(name)})
        slowest.append(merged)

    mask = ", ".join(f for f in (f"documents of {args.documents}" if args.documents else "",
                                 f"window {args.window}" if args.window else "", "sinks" if args.sinks else "") if f)
    print(f"P={args.nproc} B=1 H={args.heads} H_kv={args.kv_heads} D={args.head_dim} float32 causal"
          f"{', ' + mask if mask else ''}; thread CPU time per forward + backward, median of {args.repeat}, "
          f"slowest rank (ms)")
    head = f"{'strategy':<10} {'layout':<11} {'T':>6} {'check':<5}"
    for name in names:
        head += f" {name + ' total':>13} {'kernels':>8} {'collect.':>8} {'host rest':>9}"
    if args.baseline:
        head += f" {'total':>7} {'rest':>7} {'bits':>9}"
    print(head)
    for row in slowest:
        line = f"{row['strategy']:<10} {row['layout']:<11} {row['seq']:>6} {'on' if row['check'] else 'off':<5}"
        for name in names:
            total, kernels, collectives = (row[f"{name}_{part}"] * 1e3 for part in ("total", *PARTS))
            row[f"{name}_rest"] = (total - kernels - collectives) / 1e3
            line += f" {total:>13.2f} {kernels:>8.2f} {collectives:>8.2f} {total - kernels - collectives:>9.2f}"
        if args.baseline:
            line += (f" {row['after_total'] / row['before_total'] - 1:>+7.1%}"
                     f" {row['after_rest'] / row['before_rest'] - 1:>+7.1%}{bits(row)}")
        print(line)
    write_and_judge(args, slowest, "results differ from the baseline's")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
