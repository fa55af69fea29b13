"""Peak memory per rank for one training step of the reference model, P = 1, 2, 4.

    python benchmarks/memory.py                          # model "small", T = 16384
    python benchmarks/memory.py --seq 8192 --budget-gib 2 --json memory.json

Every (P, T) runs ``ctxpar train`` for one step in fresh processes (the resident-set
peak is a process-lifetime high-water mark). A rank's peak growth over the step is its
resident-set peak minus its resident set just before the step.

Separating the sequence-dependent part: the step is run at the target T and at a short
T0; growth(T) - growth(T0) removes everything that does not scale with the sequence
(parameters, gradients, Adam state, fixed buffers), leaving activations, logits, K/V and
the strategy's buffers for T - T0 tokens. The largest T within a budget is extrapolated
from those two points (memory linear in T: attention is flash-style, O(T) per rank) and
stated as such.
"""

from __future__ import annotations

import argparse

import ctxpar
from ctxpar import launch
from ctxpar.layout import LAYOUT_NAMES
from ctxpar.models.config import PRESETS
from ctxpar.train import TRAIN_STRATEGIES, TrainConfig, run_train
import flags
from report import write_json


def step_growth(nproc: int, seq: int, args: argparse.Namespace) -> int:
    """Max over ranks of the peak growth during one training step, bytes."""
    report = run_train(TrainConfig(nproc=nproc, seq=seq, steps=1, model=args.model, strategy=args.strategy,
                                   layout=args.layout, progress=False,
                                   activation_checkpointing=args.activation_checkpointing))
    return max(report["rank_peak_growth_bytes"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every run they make checked as ``ctxpar train`` checks it, before the first starts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="small")
    p.add_argument("--seq", type=flags.count, default=16384)
    p.add_argument("--short-seq", type=flags.count, default=1024, help="T0, the short run subtracted (< --seq)")
    p.add_argument("--nprocs", type=flags.ranks_list, default="1,2,4",
                   help="P, 1 among them: each sequence part is compared with P=1's")
    # not hybrid: its all-to-all degree would have to divide every P of --nprocs, 1 among them
    p.add_argument("--strategy", choices=[s for s in TRAIN_STRATEGIES if s != "hybrid"], default="ring")
    p.add_argument("--layout", choices=LAYOUT_NAMES, default="zigzag")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--budget-gib", type=flags.positive, default=4.0,
                   help="per-rank memory budget for the largest-T estimate (at most 2**30 GiB)")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    if args.short_seq >= args.seq:
        p.error(f"--short-seq {args.short_seq} must be below --seq {args.seq}: the sequence part is their "
                f"difference")
    if args.budget_gib > 2**30:  # its bytes overflowed the estimate after every run
        p.error(f"--budget-gib {args.budget_gib:g} must be at most {2**30} GiB")
    if 1 not in args.nprocs:
        p.error(f"--nprocs {','.join(map(str, args.nprocs))} must include 1: each sequence part is compared with "
                f"P=1's")
    with flags.refusals(p):
        for nproc in args.nprocs:
            for seq, flag in ((args.short_seq, "--short-seq"), (args.seq, "--seq")):
                cfg = TrainConfig(nproc=nproc, seq=seq, steps=1, model=args.model, strategy=args.strategy,
                                  layout=args.layout, activation_checkpointing=args.activation_checkpointing)
                cfg.validate(nproc, seq_flag=flag)
                # refused inside run_train once, naming --batch and --nproc, which this script has not
                run = f"--model {args.model} on {nproc} rank{'s' * (nproc != 1)} with {flag} {seq}"
                launch.check_local_memory(cfg.memory_needed(nproc), run, "choose a smaller --model, or lower --seq or "
                                                                         "--nprocs")
    return args


def main() -> None:
    args = parse_args()
    rows = []
    for nproc in args.nprocs:
        short, full = step_growth(nproc, args.short_seq, args), step_growth(nproc, args.seq, args)
        per_token = (full - short) / (args.seq - args.short_seq)
        multiple = ctxpar.get_layout(args.layout, nproc).multiple
        budget = args.budget_gib * 2**30
        # None where the budget is below the step's fixed part, or nothing grows with T
        largest = (int((budget - short) / per_token + args.short_seq) // multiple * multiple
                   if per_token > 0 and budget > short else None)
        rows.append(dict(nproc=nproc, growth_short=short, growth_full=full, sequence_part=full - short,
                         bytes_per_token=per_token, largest_seq_in_budget=largest))
    base = next(row["sequence_part"] for row in rows if row["nproc"] == 1)
    for row in rows:  # None where P=1's part is not above 0: nothing to compare with
        row["sequence_part_vs_p1"] = row["sequence_part"] / base if base > 0 else None

    mib = 2**20

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print(f"model {args.model}, one training step, {args.strategy} {args.layout}, T={args.seq} (T0={args.short_seq}),"
          f" activation checkpointing {'on' if args.activation_checkpointing else 'off'}; resident-set peak growth,"
          f" max over ranks")
    print(f"{'P':>2} {'step T0 MiB':>12} {'step T MiB':>11} {'seq part MiB':>13} {'vs P=1':>7} "
          f"{'MiB/1K tok':>11} {f'largest T in {args.budget_gib:g} GiB (est.)':>30}")
    for r in rows:
        print(f"{r['nproc']:>2} {r['growth_short'] / mib:>12.1f} {r['growth_full'] / mib:>11.1f} "
              f"{r['sequence_part'] / mib:>13.1f} {ratio(r['sequence_part_vs_p1']):>7} "
              f"{r['bytes_per_token'] * 1024 / mib:>11.2f} {r['largest_seq_in_budget'] or '-':>30}")
    if any(r["sequence_part"] <= 0 for r in rows):
        print(f"\nnote: a sequence part at or below 0 is the resident set's noise (pages, the allocator), not memory "
              f"the step frees: T - T0 = {args.seq - args.short_seq} tokens add too little to measure; widen the gap "
              f"between --seq and --short-seq")
    if args.json:
        write_json(args.json, args, rows=rows)


if __name__ == "__main__":
    main()
