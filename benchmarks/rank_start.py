"""How long ``run_local`` takes to start its ranks: spawned, each importing torch, against forked
from the rank server (``ctxpar.rank_server``).

    python benchmarks/rank_start.py                        # 1, 2 and 4 ranks, 5 runs each
    python benchmarks/rank_start.py --nprocs 2,4 --repeat 10 --json rank_start.json

Each run is a whole ``run_local`` of a function that returns at once: the ranks' start, the
rendezvous, the group's join, the results and the stop. Per number of ranks and repeat, spawned
(``CTXPAR_RANK_SERVER=0``) then forked, interleaved. The process's first forked run also starts
the server, which imports torch: timed first, apart (every command pays it once).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ctxpar import rank_server
from ctxpar.launch import run_local
import flags
from report import write_json


def returns_its_rank(rank: int, world: int) -> int:
    return rank


def timed_run(nproc: int, forked: bool) -> float:
    if forked:
        os.environ.pop(rank_server.OFF_SWITCH, None)
    else:
        os.environ[rank_server.OFF_SWITCH] = "0"
    try:
        start = time.perf_counter()
        assert run_local(returns_its_rank, nproc) == list(range(nproc))
        return time.perf_counter() - start
    finally:
        os.environ.pop(rank_server.OFF_SWITCH, None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=flags.ranks_list, default="1,2,4", help="numbers of local ranks")
    p.add_argument("--repeat", type=flags.count, default=5, help="runs of each mode per number of ranks")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not rank_server.usable():
        raise SystemExit("the rank server is not used on this machine (not Linux, no /proc, or CTXPAR_RANK_SERVER=0): "
                         "every run spawns")
    first = timed_run(args.nprocs[0], forked=True)
    seconds = {(nproc, forked): [] for nproc in args.nprocs for forked in (False, True)}
    for _ in range(args.repeat):
        for nproc in args.nprocs:
            for forked in (False, True):
                seconds[nproc, forked].append(timed_run(nproc, forked))
    print(f"first forked run of the process, {args.nprocs[0]} ranks, starting the server: {first:.2f} s\n")
    print(f"{'ranks':>5} {'spawned s':>10} {'(best)':>7} {'forked s':>9} {'(best)':>7} {'spawned/forked':>15}")
    rows = []
    for nproc in args.nprocs:
        spawned, forked = (statistics.median(seconds[nproc, mode]) for mode in (False, True))
        rows.append(dict(nproc=nproc, spawned_seconds=seconds[nproc, False], forked_seconds=seconds[nproc, True],
                         spawned_median=spawned, forked_median=forked, spawned_over_forked=spawned / forked))
        print(f"{nproc:>5} {spawned:>10.2f} {min(seconds[nproc, False]):>7.2f} {forked:>9.3f} "
              f"{min(seconds[nproc, True]):>7.3f} {spawned / forked:>14.1f}x")
    if args.json:
        write_json(args.json, args, first_forked_seconds=first, cpus=os.cpu_count(), rows=rows)


if __name__ == "__main__":
    main()
