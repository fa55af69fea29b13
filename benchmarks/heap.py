"""Local ranks with glibc's default heap thresholds against the kept heap (``ctxpar.heap``).

    python benchmarks/heap.py                     # 3 rounds, each: default, then kept
    python benchmarks/heap.py --rounds 5 --json heap.json

Each round runs, in fresh local ranks, first with ``CTXPAR_KEEP_FREED_MEMORY=0`` (glibc's
defaults), then without it (the launcher's thresholds):

- the calibration's gloo hop (``calibrate.measure_link``: 16 MiB each way between two
  ranks, best of 20): seconds and bytes per second per direction;
- the calibration's step-probe calls (``calibrate._probe_rank``: two ranks, one thread
  each, H=8, H_kv=2, D=64, zigzag, causal; per round of ``--probe-rounds``, eight calls on
  8-token shards and one on 1024-token shards per strategy, interleaved): per strategy,
  rank 0's page faults (``ru_minflt``) per 1024-token call, their median, and its best
  call's seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics

from ctxpar import heap
from ctxpar.calibrate import PROBE_STRATEGIES, PROBE_TOKENS, _probe_rank, measure_link
from ctxpar.launch import run_local
import flags
from report import write_json

def measure(kept: bool, probe_rounds: int) -> dict:
    """One setting's link and probe figures, in fresh ranks that inherit the switch."""
    if kept:
        os.environ.pop(heap.OFF_SWITCH, None)
    else:
        os.environ[heap.OFF_SWITCH] = "0"
    try:
        link = measure_link()
        calls = run_local(_probe_rank, 2, (PROBE_TOKENS, probe_rounds), threads=1)[0][PROBE_TOKENS[-1]]  # rank 0's
    finally:
        os.environ.pop(heap.OFF_SWITCH, None)
    return dict(kept=kept, link_seconds=link["seconds"], bandwidth=link["bandwidth"],
                faults={s: statistics.median(c["faults"] for c in cs) for s, cs in calls.items()},
                most_faults={s: max(c["faults"] for c in cs) for s, cs in calls.items()},
                best_seconds={s: min(c["seconds"] for c in cs) for s, cs in calls.items()})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=flags.count, default=3, help="rounds, each: glibc's defaults, then the kept heap")
    p.add_argument("--probe-rounds", type=flags.count, default=6, help="rounds of probe calls in each group of ranks")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not heap.on_glibc():
        raise SystemExit("glibc's heap thresholds: this machine does not run on glibc")

    rows = [measure(kept, args.probe_rounds) for _ in range(args.rounds) for kept in (False, True)]
    print(f"{'heap':<8} {'16 MiB hop ms':>13} {'GB/s':>6}  "
          f"page faults per 1024-token call, median (most); best call ms")
    for r in rows:
        calls = ", ".join(f"{s} {r['faults'][s]:.0f} ({r['most_faults'][s]}) {r['best_seconds'][s] * 1e3:.1f}"
                          for s in PROBE_STRATEGIES)
        print(f"{'kept' if r['kept'] else 'default':<8} {r['link_seconds'] * 1e3:>13.2f} {r['bandwidth'] / 1e9:>6.2f}  "
              f"{calls}")
    hops = {kept: statistics.median(r["link_seconds"] for r in rows if r["kept"] == kept) for kept in (False, True)}
    print(f"\nmedian 16 MiB hop: default {hops[False] * 1e3:.2f} ms, kept {hops[True] * 1e3:.2f} ms "
          f"({hops[False] / hops[True]:.2f}x)")
    if args.json:
        write_json(args.json, args, rows=rows, hop_default_over_kept=hops[False] / hops[True])


if __name__ == "__main__":
    main()
