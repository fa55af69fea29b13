"""What the default consistency checks cost: one tiny all-gather per attention call, and
the checksum by which a forward tells shards of different batches apart.

    python benchmarks/consistency.py                      # P=4 gloo ranks, T = 1024, 4096, 16384
    python benchmarks/consistency.py --seq 2048,8192 --json consistency.json

For each length, every rank runs the same causal zigzag ring attention forward with
``check_consistency`` on and off, alternating (so drift hits both alike), and reports
the median wall time of each; the check alone (``agreement.check_ranks_agree`` on a
signature) is timed over many calls. The ratio is the median on/off of the slowest rank.

``model.generate()`` under CP (--generate-prompt tokens, --generate-tokens new ones, a
tiny Llama, P ranks): seconds per generated token with its per-step agreement on when to
stop and on the token appended (``AgreedStop``, one tiny all-reduce) and without it,
alternating; medians of --repeat, slowest rank.

The batch checksum (one process, --batch-seq lengths, one row of tokens): what
``shard_batch`` spends on it (crc32 of the whole batch's tokens and shifted labels) against
the whole ``shard_batch`` call, and what a forward spends finding its shard's batch
(``batch_code``); medians of --repeat.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist

import ctxpar
from ctxpar import agreement, parallelize, topology
from ctxpar.demo import DemoConfig
from ctxpar.launch import run_local
from ctxpar.limits import check_splits
import flags
from report import write_json


def one_rank(rank: int, world: int, args: dict) -> dict:
    torch.manual_seed(rank)
    topo = topology.from_group(None, "the benchmark")
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


def generate_steps(rank: int, world: int, args: dict) -> dict:
    """Seconds per new token of generate under CP, with and without ``AgreedStop``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    from ctxpar.integrations.transformers import enable_context_parallel

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = enable_context_parallel(LlamaForCausalLM(config).eval(), layout=ctxpar.get_layout("zigzag", world))
    agreed = model._get_stopping_criteria
    plain = functools.partial(type(model)._get_stopping_criteria, model)  # the check left out: measurement only
    prompt = torch.randint(0, 2048, (1, args["prompt"]), generator=torch.Generator().manual_seed(1))
    new = args["new_tokens"]
    times = {True: [], False: []}
    for i in range(2 * args["repeat"] + 2):
        checked = i % 2 == 0
        model._get_stopping_criteria = agreed if checked else plain
        dist.barrier()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new)
        if i >= 2:  # the first pair warms up
            times[checked].append((time.perf_counter() - start) / new)
    return dict(on=statistics.median(times[True]), off=statistics.median(times[False]))


def batch_checksum(seqs: list[int], world: int, repeat: int) -> list[dict]:
    """Seconds of the batch checksum inside shard_batch, of shard_batch, and of batch_code."""
    layout = ctxpar.get_layout("zigzag", world)
    rows = []
    for seq in seqs:
        tokens = torch.randint(0, 128_000, (1, seq))
        targets = parallelize.shift_labels(tokens)

        def median(fn) -> float:
            times = []
            for _ in range(repeat + 1):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times[1:])

        shard = parallelize.shard_batch(tokens, layout=layout, rank=1).tokens
        checksum = median(lambda: parallelize._batch_checksum(tokens, targets))
        whole = median(lambda: parallelize.shard_batch(tokens, layout=layout, rank=1))
        lookup = median(lambda: parallelize.batch_code(shard))
        rows.append(dict(seq=seq, checksum_seconds=checksum, shard_batch_seconds=whole, lookup_seconds=lookup))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every length checked against zigzag on --nproc ranks, before any rank starts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=flags.counts, default="1024,4096,16384", help="comma-separated global lengths T")
    p.add_argument("--heads", type=flags.count, default=8)
    p.add_argument("--kv-heads", type=flags.count, default=2)
    p.add_argument("--head-dim", type=flags.count, default=64)
    p.add_argument("--nproc", type=flags.ranks, default=4)
    p.add_argument("--repeat", type=flags.count, default=7, help="timed calls per setting (median)")
    p.add_argument("--calls", type=flags.count, default=500, help="calls of the check alone")
    p.add_argument("--batch-seq", type=flags.counts, default="131072,1048576",
                   help="comma-separated batch lengths for the batch checksum (one process)")
    p.add_argument("--generate-prompt", type=flags.count, default=512, help="generate's prompt length")
    p.add_argument("--generate-tokens", type=flags.count, default=32, help="tokens each generate call adds")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    with flags.refusals(p):
        for seq in args.seq:
            DemoConfig(nproc=args.nproc, seq=seq, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim).validate(args.nproc)
        for seq in args.batch_seq:
            check_splits(ctxpar.get_layout("zigzag", args.nproc), seq, "--batch-seq")
    return args


def main() -> None:
    args = parse_args()
    cfg = dict(seqs=args.seq, heads=args.heads, kv_heads=args.kv_heads,
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
    steps = run_local(generate_steps, args.nproc, (dict(prompt=args.generate_prompt,
                                                        new_tokens=args.generate_tokens, repeat=args.repeat),))
    on, off = max(r["on"] for r in steps), max(r["off"] for r in steps)
    generated = dict(prompt=args.generate_prompt, new_tokens=args.generate_tokens, on_seconds_per_token=on,
                     off_seconds_per_token=off, ratio=on / off)
    print(f"generate, tiny Llama (4 layers, d=256), prompt {args.generate_prompt}, {args.generate_tokens} new tokens: "
          f"{on * 1e3:.2f} ms per token with the per-step agreement, {off * 1e3:.2f} ms without; on/off "
          f"{on / off:.3f}")
    batches = batch_checksum(args.batch_seq, args.nproc, args.repeat)
    print(f"batch checksum (shard_batch, zigzag P={args.nproc}, one row of int64 tokens): median of {args.repeat}")
    print(f"{'T':>8} {'checksum ms':>12} {'shard_batch ms':>15} {'share':>7} {'forward lookup ms':>18}")
    for r in batches:
        print(f"{r['seq']:>8} {r['checksum_seconds'] * 1e3:>12.2f} {r['shard_batch_seconds'] * 1e3:>15.2f} "
              f"{r['checksum_seconds'] / r['shard_batch_seconds']:>7.0%} {r['lookup_seconds'] * 1e3:>18.3f}")
    if args.json:
        write_json(args.json, args, check_seconds=check, rows=rows, generate=generated, batch_checksum=batches)


if __name__ == "__main__":
    main()
