"""Host time of a reference-model decode step, against the model's own one-token forward.

One process, no group (the host work a step adds is the same on each rank of a group, less
the collectives): thread CPU time of ``ctxpar.inference.decode_step`` on a prefilled cache
(B=1, one thread), of the model's plain forward of that one token beside it, and their
difference: the step's checks, its swap of every layer's attention, attention over the cache
and its bookkeeping. On a GPU the kernels are queued, so host time per step is what time per
output token waits behind; it grows with the layers.

    python benchmarks/decode_host.py                                # L = 4, 16, 32, 64
    git worktree add /tmp/before HEAD~1 && \\
    python benchmarks/decode_host.py --baseline /tmp/before/src    # before/after, alternating

With ``--baseline SRC`` the ctxpar package under SRC (another checkout's ``src``) runs beside
this one on the same weights, alternating step by step, and each row says whether their
logits are bit-identical. Figures: medians of --repeat steps.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time

import torch

from baseline import bits, check_baseline, ctxpar_modules, load_baseline, write_and_judge
import flags

USED = ("models", "inference")  # the baseline's modules this benchmark calls


def thread_seconds(fn) -> tuple[float, object]:
    start = time.thread_time()
    result = fn()
    return time.thread_time() - start, result


def measure(layers: int, args: argparse.Namespace, packages: dict) -> dict:
    """Per package: the step's and the plain forward's median thread time; their logits alike at
    every step?"""
    steps, plain, runs, identical = {}, {}, {}, True
    for name, modules in packages.items():
        models, inference = modules["ctxpar.models"], modules["ctxpar.inference"]
        cfg = models.ModelConfig(layers=layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                                 head_dim=args.hidden // args.heads, ffn=2 * args.hidden, vocab=args.vocab)
        torch.manual_seed(0)  # the same weights in every package
        model = models.Transformer(cfg).eval()
        cache = inference.KVCache.for_model(cfg, batch=1, capacity=args.prompt + args.warmup + args.repeat + 1)
        inference.prefill(model, cache, torch.randint(0, args.vocab, (1, args.prompt),
                                                      generator=torch.Generator().manual_seed(1)),
                          layout="contiguous")
        runs[name] = (model, cache, inference.decode_step)
        steps[name], plain[name] = [], []
    token = torch.tensor([3])
    for i in range(args.warmup + args.repeat):  # alternating: drift on the machine hits both alike
        logits = {}
        for name, (model, cache, decode_step) in runs.items():
            seconds, logits[name] = thread_seconds(lambda: decode_step(model, cache, token))
            position = torch.tensor([cache.seq_len - 1])
            with torch.no_grad():
                forward, _ = thread_seconds(lambda: model(token[:, None], position))
            if i >= args.warmup:
                steps[name].append(seconds)
                plain[name].append(forward)
        identical = identical and (len(logits) < 2 or torch.equal(*logits.values()))
    row = dict(layers=layers, identical=identical if len(runs) == 2 else None)
    for name in runs:
        row[f"{name}_step"] = statistics.median(steps[name])
        row[f"{name}_forward"] = statistics.median(plain[name])
        row[f"{name}_added"] = row[f"{name}_step"] - row[f"{name}_forward"]
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=flags.counts, default="4,16,32,64", help="comma-separated layer counts L")
    p.add_argument("--hidden", type=flags.count, default=64)
    p.add_argument("--heads", type=flags.count, default=2)
    p.add_argument("--kv-heads", type=flags.count, default=1)
    p.add_argument("--vocab", type=flags.count, default=64)
    p.add_argument("--prompt", type=flags.count, default=64, help="tokens prefilled before the steps")
    p.add_argument("--repeat", type=flags.count, default=60, help="timed steps per row (median)")
    p.add_argument("--warmup", type=flags.count, default=3)
    p.add_argument("--baseline", metavar="SRC", help="another checkout's src/, alternated with this one")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    with flags.refusals(p):
        if args.hidden % args.heads:
            raise ValueError(f"--heads {args.heads} must divide --hidden {args.hidden}")
        if args.heads % args.kv_heads:
            raise ValueError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
        if args.baseline:
            check_baseline(args.baseline)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    for name in USED:
        importlib.import_module(f"ctxpar.{name}")
    packages = {"after": ctxpar_modules()}
    if args.baseline:
        packages = {"before": load_baseline(args.baseline, USED), **packages}
    rows = [measure(layers, args, packages) for layers in args.layers]
    names = list(packages)
    print(f"decode step of the reference model, B=1 d={args.hidden} H={args.heads} H_kv={args.kv_heads}, prompt "
          f"{args.prompt}, one thread; thread CPU time, median of {args.repeat} (us)")
    head = f"{'L':>4}"
    for name in names:
        head += f" {name + ' step':>12} {'forward':>8} {'added':>8}"
    print(head + (f" {'step':>7} {'bits':>9}" if args.baseline else ""))
    for row in rows:
        line = f"{row['layers']:>4}"
        for name in names:
            line += " ".join(f" {row[f'{name}_{part}'] * 1e6:>{w}.0f}" for part, w in
                             (("step", 11), ("forward", 7), ("added", 7)))
        if args.baseline:
            line += f" {row['after_step'] / row['before_step'] - 1:>+7.1%}{bits(row)}"
        print(line)
    write_and_judge(args, rows, "logits differ from the baseline's")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
