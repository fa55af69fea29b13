"""The ``ctxpar`` command: thin argparse over the library."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ctxpar.demo import DTYPES, DemoConfig, format_report, run_demo
from ctxpar.layout import LAYOUT_NAMES
from ctxpar.strategies import STRATEGIES
from ctxpar.train import TRAIN_STRATEGIES, TrainConfig, run_train
from ctxpar.train import format_report as format_train_report


def _demo_parser(sub) -> None:
    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="run CP attention on local CPU ranks (or torchrun's) and check it against unsplit attention",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=d.nproc, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--seq", type=int, default=d.seq, help="global sequence length T")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--heads", type=int, default=d.heads, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads H_kv (GQA)")
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--layout", choices=LAYOUT_NAMES, default=d.layout)
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default=d.strategy)
    p.add_argument("--ulysses-degree", type=int, default=d.ulysses_degree,
                   help="hybrid only: all-to-all degree; the ring degree is nproc / this")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=d.causal)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON")


def _run_demo(args: argparse.Namespace) -> int:
    cfg = DemoConfig(
        nproc=args.nproc, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        layout=args.layout, strategy=args.strategy, dtype=args.dtype, causal=args.causal,
        batch=args.batch, seed=args.seed, ulysses_degree=args.ulysses_degree,
    )
    report = run_demo(cfg)
    if report is None:  # a non-zero rank under torchrun
        return 0
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


def _train_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train the reference model with CP (x FSDP data parallelism) on a long-range recall task",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=d.nproc, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree; CP degree = ranks / dp")
    p.add_argument("--cp", type=int, help="CP degree; if given, must equal ranks / dp")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length T")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per data-parallel group per step")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--model", default=d.model, help="model preset (ctxpar.models.PRESETS)")
    p.add_argument("--strategy", choices=TRAIN_STRATEGIES, default=d.strategy)
    p.add_argument("--layout", choices=LAYOUT_NAMES, default=d.layout)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compare", action="store_true",
                   help="also train on unsplit sequences in one process and compare the losses")
    p.add_argument("--checkpoint-dir", help="where torch.distributed.checkpoint saves and resumes")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", metavar="PATH", help="write losses (and reference losses) as JSON")


def _run_train(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    if args.cp is not None and args.cp * args.dp != world:
        raise ValueError(f"--cp {args.cp} x --dp {args.dp} must equal the {world} ranks")
    cfg = TrainConfig(
        nproc=args.nproc, dp=args.dp, seq=args.seq, batch=args.batch, steps=args.steps, lr=args.lr,
        model=args.model, strategy=args.strategy, layout=args.layout, seed=args.seed,
        activation_checkpointing=args.activation_checkpointing, compare=args.compare,
        checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, resume=args.resume, progress=args.progress,
    )
    report = run_train(cfg)
    if report is None:  # a non-zero rank under torchrun
        return 0
    print(format_train_report(report))
    if args.json:
        keep = {k: v for k, v in report.items() if not k.endswith("parameters")}
        with open(args.json, "w") as f:
            json.dump(keep, f, indent=2)
    return 0


COMMANDS = {"demo": (_demo_parser, _run_demo), "train": (_train_parser, _run_train)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctxpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser, _ in COMMANDS.values():
        add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except ValueError as e:
        print(f"ctxpar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
