"""The ``ctxpar`` command: thin argparse over the library."""

from __future__ import annotations

import argparse
import json
import sys

from ctxpar.demo import DTYPES, DemoConfig, format_report, run_demo
from ctxpar.layout import LAYOUT_NAMES
from ctxpar.strategies import STRATEGIES


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctxpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    args = parser.parse_args(argv)
    try:
        return _run_demo(args)
    except ValueError as e:
        print(f"ctxpar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
