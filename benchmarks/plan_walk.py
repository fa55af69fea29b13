"""How long block plans take to walk on this machine: the planner's commands and a rank's plans.

    cd benchmarks && python plan_walk.py --json ../docs/plan_walk.json
    python plan_walk.py --walks-only                  # the rank's plans only (seconds, not minutes)

Two tables:

- ``ctxpar plan`` at cluster scale (1M tokens, sweeps up to 128-256 ranks; a sliding window
  and packed documents make the planner walk the real row for every degree of its sweep):
  wall seconds of a fresh ``python -m ctxpar.cli plan`` process each, imports included,
  best of ``--repeat``;
- one rank's block plans against every shard of a 1M-token row (``blocks.tiles_between``,
  what a strategy computes when a shape or a document mask is new, every batch under
  documents), per layout and mask, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from ctxpar.blocks import tiles_between
from ctxpar.layout import get_layout
from ctxpar.masks import Mask
from ctxpar.plan.documents import pack, parse_doc_dist, sample_lengths
import flags
from report import write_json

PLAN_COMMANDS = (
    "--model llama-3-70b --seq 1048576 --cp 256 --tp 8 --hardware h200 --max-cp 256",
    "--model llama-3-8b --seq 1048576 --cp 64 --max-cp 128 --tp 8 --checkpointing full --hardware h200 "
    "--window 8192",
    "--model llama-3-8b --seq 1048576 --cp 64 --max-cp 128 --tp 8 --checkpointing full --hardware h200 "
    "--doc-dist lognormal:16384,1.5",
    "--model llama-3-8b --window 4096 --seq 131072 --cp 8 --hardware H200",
)
WALK_SEQ, WALK_RANKS, WALK_RANK = 1 << 20, 8, 3
DOC_DIST = "lognormal:16384,1.5"


def time_plan_command(args: str, repeat: int) -> float:
    """Best wall seconds of ``ctxpar plan <args>`` in a fresh process (its output discarded)."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ctxpar.cli", "plan", *args.split()], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - start)
    return best


def time_rank_walk(layout_name: str, mask: Mask, repeat: int) -> tuple[float, int]:
    """(best seconds, tiles) of rank ``WALK_RANK``'s plans against every shard of the row."""
    layout = get_layout(layout_name, WALK_RANKS)
    queries = layout.positions(WALK_SEQ, WALK_RANK)
    shards = [layout.positions(WALK_SEQ, src) for src in range(WALK_RANKS)]
    best, tiles = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        tiles = sum(len(tiles_between(queries, keys, mask, WALK_SEQ)) for keys in shards)
        best = min(best, time.perf_counter() - start)
    return best, tiles


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=flags.count, default=3, help="runs of each rank's walk (best taken)")
    p.add_argument("--plan-repeat", type=flags.count, default=1, help="runs of each ctxpar plan command (best taken)")
    p.add_argument("--walks-only", action="store_true", help="skip the ctxpar plan commands (about 70 s)")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()

    documents = pack(sample_lengths(parse_doc_dist(DOC_DIST), WALK_SEQ), WALK_SEQ)
    masks = {"plain causal": Mask(), f"{len(documents)} documents ({DOC_DIST})": Mask(documents=documents),
             "window 4096": Mask(window=4096)}
    walks = []
    print(f"one rank's block plans against all {WALK_RANKS} shards, T={WALK_SEQ} (rank {WALK_RANK}, "
          f"best of {args.repeat})")
    print(f"{'layout':<11} {'mask':<40} {'seconds':>8} {'tiles':>7}")
    for layout_name in ("zigzag", "striped", "contiguous"):
        for name, mask in masks.items():
            seconds, tiles = time_rank_walk(layout_name, mask, args.repeat)
            walks.append(dict(layout=layout_name, mask=name, seconds=seconds, tiles=tiles))
            print(f"{layout_name:<11} {name:<40} {seconds:>8.3f} {tiles:>7}")

    commands = []
    if not args.walks_only:
        print(f"\nctxpar plan, wall seconds of a fresh process (best of {args.plan_repeat})")
        for command in PLAN_COMMANDS:
            seconds = time_plan_command(command, args.plan_repeat)
            commands.append(dict(command=f"ctxpar plan {command}", seconds=seconds))
            print(f"{seconds:>8.1f}  ctxpar plan {command}")
    if args.json:
        write_json(args.json, args, rank_walks=walks, plan_commands=commands)


if __name__ == "__main__":
    main()
