"""Inference under CP on this machine: prefill and decode time vs P, and where pass-Q stops paying.

    python benchmarks/inference.py                        # prompt 8192 on P = 1, 2, 4; chunks on 8192 at P = 2
    python benchmarks/inference.py --json inference.json
    torchrun --nproc-per-node 2 benchmarks/inference.py --parts crossover --device cuda --dtype bfloat16 \
        --cached 131072 --chunks 256,1024,4096,16384          # the crossover on two GPUs, NCCL

1. **Prefill and decode vs P**: ``generate`` with the reference model (L=4, H=8, H_kv=2,
   D=64, float32; one thread per rank) on a ``--prompt``-token prompt, ``--new-tokens``
   greedy tokens, for each P of ``--nproc``, each P in its own process group, in one run:
   time to first token (the median of ``--repeat`` prefills), its speed-up over the first P
   (P=1 by default), time per output token, and KV-cache bytes per rank against that P's.
2. **pass-KV vs pass-Q**: on P=``--cross-nproc`` ranks, a cache prefilled with ``--cached``
   tokens, then ``partial_prefill`` of each ``--chunks`` length by both methods,
   alternating, ``--repeat`` times each (the cache rewound after each), median wall time
   of the slowest rank. The measured crossover is the chunk length where pass-KV stops
   being the slower, interpolated (in log length) between the two chunks around it; the
   planner's (``plan.inference.partial_prefill_crossover``) comes from this machine's
   calibration (``ctxpar.calibrate``), the ranks' rate scaled by cores / P when they
   share cores, as in plan_vs_measured.py. With ``--device cuda`` the ranks are torchrun's
   (NCCL, one GPU each) or local ones on the GPUs there are, and the planner predicts on
   the preset of the GPU's name (``ctxpar.auto.hardware_for``), no calibration: on GPUs
   the stage compute covers pass-KV's hop only from thousands of new tokens, so the
   crossover is a real crossing, where on this CPU the two methods run together within
   the noise beyond a few dozen tokens (docs/benchmarks.md). Under torchrun on CPUs the
   planner takes ``ctxpar.auto.CPU_DEFAULT`` (no calibration inside a launched rank).

``--parts`` picks ``generation`` (local CPU ranks only), ``crossover``, or both; only the
crossover's planner needs this machine's calibration (about a minute), so only it runs one.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from ctxpar import auto
from ctxpar.calibrate import calibrate, format_calibration
from ctxpar.inference import KVCache, generate, partial_prefill, prefill
from ctxpar.launch import launched_by_torchrun, resolve_device_type, run, run_local, world_size
from ctxpar.layout import get_layout
from ctxpar.limits import MAX_COUNT, check_splits
from ctxpar.models import ModelConfig, Transformer
from ctxpar.plan import ELEMENT_BYTES
from ctxpar.plan.hardware import local_hardware
from ctxpar.plan.inference import partial_prefill_crossover, pass_q_fraction
import flags
from report import write_json

MODEL = ModelConfig(layers=4, hidden=256, heads=8, kv_heads=2, head_dim=64, ffn=512, vocab=256)
METHODS = ("pass-kv", "pass-q")
PARTS = ("generation", "crossover")


def _model(cfg: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, MODEL.vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def generation_rank(rank: int, world: int, prompt_len: int, new_tokens: int, repeat: int) -> dict:
    """TTFT: median of ``repeat`` prefills (after one warm-up); TPOT from one generation."""
    model, prompt = _model(MODEL), _tokens(prompt_len, 1)
    cache = KVCache.for_model(MODEL, batch=1, capacity=prompt_len)
    ttft = []
    for i in range(repeat + 1):
        cache.reset()
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        prefill(model, cache, prompt, layout="zigzag")
        if i:
            ttft.append(time.perf_counter() - start)
    result = generate(model, prompt, layout="zigzag", new_tokens=new_tokens)
    return dict(ttft_s=statistics.median(ttft), tpot_s=result.tpot_s, kv_cache_bytes=result.kv_cache_bytes,
                tokens=result.tokens.tolist())


def chunk_rank(rank: int, world: int, cached: int, chunks: list[int], repeat: int, dtype: str,
               device: torch.device) -> list[dict]:
    """Median seconds of ``partial_prefill`` by each method for each chunk length, the slowest
    rank's (every rank returns the same rows)."""
    model = _model(MODEL).to(device=device, dtype=getattr(torch, dtype))
    cache = KVCache.for_model(MODEL, batch=1, capacity=cached + max(chunks), dtype=getattr(torch, dtype),
                              device=device)
    prefill(model, cache, _tokens(cached, 1).to(device), layout="zigzag")
    medians = []
    for n in chunks:
        chunk = _tokens(n, 2).to(device)
        times = {m: [] for m in METHODS}
        for i in range(2 * (repeat + 1)):  # alternating, so drift hits both alike; the first pair warms up
            method = METHODS[i % 2]
            dist.barrier()
            start = time.perf_counter()
            partial_prefill(model, cache, chunk, method=method, check_consistency=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times[method].append(time.perf_counter() - start)
            cache.rewind(cached)
        medians.append([statistics.median(times[m]) for m in METHODS])
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [dict(zip(METHODS, row)) for row in slowest.tolist()]


def measured_crossover(chunks: list[int], ratios: list[float]) -> float | None:
    """The chunk length from which pass-KV is no slower than pass-Q (pass-KV / pass-Q <= 1 at
    every longer chunk measured), interpolated in log length from the last chunk where pass-KV
    was slower; None if it never was, or is at the longest chunk (a dip below 1 before it once
    read as a crossover)."""
    slower = [i for i, ratio in enumerate(ratios) if ratio > 1]
    if not slower or slower[-1] == len(chunks) - 1:
        return None
    i = slower[-1] + 1
    a, b = math.log(chunks[i - 1]), math.log(chunks[i])
    t = (ratios[i - 1] - 1) / (ratios[i - 1] - ratios[i])
    return math.exp(a + t * (b - a))


def check_cache_size(what: str, positions: int) -> None:
    """Refuse a KV cache of more positions than one holds (it was refused in the ranks, after the work)."""
    if positions > MAX_COUNT:
        raise ValueError(f"{what} = {positions} positions, more than a KV cache holds ({MAX_COUNT})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every length they give checked against the layout of each P, before any rank starts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=flags.names(PARTS), default="generation,crossover",
                   help="generation, crossover, or both")
    p.add_argument("--prompt", type=flags.count, default=8192, help="prompt length for prefill and decode vs P")
    p.add_argument("--new-tokens", type=flags.count, default=16)
    p.add_argument("--nproc", type=flags.ranks_list, default="1,2,4", help="CP degrees for prefill and decode")
    p.add_argument("--cached", type=flags.count, default=8192, help="tokens in the cache before the chunk")
    p.add_argument("--chunks", type=flags.counts, default="8,16,32,48,64,96,128,192,256,512,1024",
                   help="chunk lengths T_new")
    p.add_argument("--cross-nproc", type=flags.ranks, default=2,
                   help="P for pass-KV vs pass-Q (under torchrun: its ranks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="of the crossover's ranks")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the crossover's model")
    p.add_argument("--repeat", type=flags.count, default=7, help="timed runs per setting (median)")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    if "generation" in args.parts and (args.device != "cpu" or launched_by_torchrun()):
        p.error("--parts generation runs on local CPU ranks; with --device cuda or under torchrun give "
                "--parts crossover")
    with flags.refusals(p):
        if not launched_by_torchrun():
            resolve_device_type(args.device, "--device")
        if "generation" in args.parts:
            for world in args.nproc:
                check_splits(get_layout("zigzag", world), args.prompt, "--prompt")
            check_cache_size("--prompt + --new-tokens - 1", args.prompt + args.new_tokens - 1)
        if "crossover" in args.parts:
            check_splits(get_layout("zigzag", world_size(args.cross_nproc)), args.cached, "--cached")
            check_cache_size("--cached + the longest of --chunks", args.cached + max(args.chunks))
    return args


def main() -> None:
    args = parse_args()
    # the crossover's planner on local CPU ranks: this machine, calibrated; on GPUs or torchrun's ranks: the
    # preset for the device. Prefill and decode vs P need no calibration.
    calibrated = "crossover" in args.parts and args.device == "cpu" and not launched_by_torchrun()
    report = dict(calibration=calibrate() if calibrated else None)
    if report["calibration"] is not None:
        print(format_calibration(report["calibration"]) + "\n")
    if "generation" in args.parts:
        report["generation"] = generation_part(args)
    if "crossover" in args.parts:
        report.update(crossover_part(args, report["calibration"]))
    if args.json and (not launched_by_torchrun() or os.environ["RANK"] == "0"):
        write_json(args.json, args, **report)


def generation_part(args: argparse.Namespace) -> list[dict]:
    """Prefill and decode against P on local CPU ranks: printed, and the rows for JSON."""
    generation = []
    for world in args.nproc:
        ranks = run_local(generation_rank, world, (args.prompt, args.new_tokens, args.repeat), threads=1)
        generation.append(dict(nproc=world, ttft_s=max(r["ttft_s"] for r in ranks),
                               tpot_s=max(r["tpot_s"] for r in ranks),
                               kv_cache_bytes=max(r["kv_cache_bytes"] for r in ranks), tokens=ranks[0]["tokens"]))
    base = generation[0]
    print(f"prefill of {args.prompt} tokens and {args.new_tokens} greedy tokens, L={MODEL.layers} H={MODEL.heads} "
          f"H_kv={MODEL.kv_heads} D={MODEL.head_dim} float32, zigzag ring, one thread per rank, "
          f"{os.cpu_count()} cores")
    first = f"P{base['nproc']}"  # the ratios are against the first --nproc, P=1 by default
    print(f"{'P':>3} {'TTFT s':>8} {'speed-up':>9} {'TPOT ms':>8} {'vs ' + first:>6} {'KV MiB/rank':>12} "
          f"{'vs ' + first:>6} {'tokens = ' + first:>11}")
    for g in generation:
        g.update(speedup=base["ttft_s"] / g["ttft_s"], tpot_ratio=g["tpot_s"] / base["tpot_s"],
                 kv_ratio=g["kv_cache_bytes"] / base["kv_cache_bytes"], same_tokens=g["tokens"] == base["tokens"])
        print(f"{g['nproc']:>3} {g['ttft_s']:>8.3f} {g['speedup']:>8.2f}x {g['tpot_s'] * 1e3:>8.2f} "
              f"{g['tpot_ratio']:>5.2f}x {g['kv_cache_bytes'] / 2**20:>12.2f} {g['kv_ratio']:>5.3f} "
              f"{'yes' if g['same_tokens'] else 'NO':>11}")
    return generation


def crossover_part(args: argparse.Namespace, calibration: dict | None) -> dict:
    """pass-KV against pass-Q on P ranks (torchrun's, or local ones on ``--device``), the
    measured crossover and the planner's: printed on rank 0, and the JSON entries."""
    chunks = sorted(args.chunks)
    shape = (args.cached, chunks, args.repeat, args.dtype)
    world = world_size(args.cross_nproc)
    if launched_by_torchrun():
        timings = run(chunk_rank, world, shape, device_type=args.device)
    else:
        timings = run_local(chunk_rank, world, shape, threads=1 if args.device == "cpu" else None,
                            device_type=args.device)[0]
    rows = [dict(chunk=n, fraction=n / (args.cached + n), pass_kv_s=t["pass-kv"], pass_q_s=t["pass-q"],
                 ratio=t["pass-kv"] / t["pass-q"]) for n, t in zip(chunks, timings)]
    measured = measured_crossover(chunks, [r["ratio"] for r in rows])
    if calibration is not None:  # CPU ranks: this machine, each rank's share of the cores
        hw = local_hardware(calibration).with_compute_share(min(1.0, (os.cpu_count() or 1) / world))
    else:
        hw = auto.hardware_for(torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else
                               torch.device("cpu"))
    elem = ELEMENT_BYTES[args.dtype]
    predicted = partial_prefill_crossover(model=MODEL, batch=1, cached=args.cached, world=world, elem=elem, hw=hw)
    error = predicted / measured - 1 if predicted and measured else None
    bytes_rule = pass_q_fraction(MODEL, elem)
    if not launched_by_torchrun() or os.environ["RANK"] == "0":
        print(f"\npartial prefill on {args.cached} cached tokens, P={world} on {args.device}, {args.dtype}: median "
              f"of {args.repeat}, slowest rank; planner on {hw.name}")
        print(f"{'T_new':>6} {'fraction':>8} {'pass-KV ms':>10} {'pass-Q ms':>10} {'KV / Q':>7}")
        for r in rows:
            print(f"{r['chunk']:>6} {r['fraction']:>8.4f} {r['pass_kv_s'] * 1e3:>10.2f} "
                  f"{r['pass_q_s'] * 1e3:>10.2f} {r['ratio']:>7.3f}")
        print(f"crossover T_new: measured {measured:.0f}" if measured else "crossover T_new: not within the chunks",
              f"| planner {predicted}" + (f" ({error:+.1%})" if error is not None else ""),
              f"| bytes rule T_new/(T_cached+T_new) < {bytes_rule:.3f}: T_new "
              f"{bytes_rule * args.cached / (1 - bytes_rule):.0f}")
    return dict(partial_prefill=rows, crossover=dict(measured=measured, predicted=predicted, error=error,
                                                     bytes_rule_fraction=bytes_rule, hardware=hw.name, world=world,
                                                     device=args.device, dtype=args.dtype))


if __name__ == "__main__":
    main()
