"""Measure this machine for the ``local`` hardware preset: attention FLOP/s, gloo link, memory.

The system measuring itself for the planner (which only reads the result): imported only
for ``ctxpar plan --calibrate`` and ``--calibration``.

- Attention: ``ctxpar.kernels.attention_forward`` + ``attention_backward`` on one CPU
  thread (what each local rank of ``ctxpar demo`` gets), causal attention over 4096
  tokens with the demo's head shape, CPU seconds, best of ``repeats``. The rate is
  3.5 x 4·B·H·D·T(T+1)/2 FLOPs over forward + backward seconds: the planner's own FLOP
  convention (visible pairs only), so its predictions use the measured time per FLOP
  directly. Causal, like FlashAttention's benchmark reports causal throughput, because
  kernels compute the key tiles that straddle the diagonal whole: a causal rate carries
  that waste, a full block's would not.
- Attention forward and backward rates separately: the same FLOPs (backward 2.5x) over
  each one's seconds.
- Matmuls: one thread multiplying two 1024 x 1024 float32 matrices, 2·n³ FLOPs over CPU
  seconds, best of ``repeats``.
- Launch overhead: the wall seconds of one attention kernel call on a tiny tile (one head,
  16 tokens), whose arithmetic is negligible: what every kernel call costs whatever its
  size (dispatch, checks, allocation), the planner's ``launch_overhead``.
- Tile overheads: what a tile of a block plan costs beyond its kernel call, merging its
  output into the accumulators (forward) or adding its gradients into dQ, dK, dV
  (backward): fixed and per byte accumulated, from a tiny and a 256 x 256 tile
  (``measure_tile_overheads``); and, fixed, what the strategies' calls spend around each
  tile beyond that loop, from the step probes below.
- Step overheads: two local ranks run ``ctxpar.attention`` (zigzag, causal, the block's
  heads) forward + backward on 8-token and on 1024-token shards by ring, allgather and
  alltoall, 12 rounds, the slower rank's call with the least residual (as the benchmarks
  time the strategies: what a call takes without scheduling noise on top), in three
  process groups, the median over them of each probe's residual. What the planner's
  pipeline does not already account for (compute, latency, launches), per pipeline
  stage, is on the tiny shards that strategy's fixed step overhead
  (``step_overhead`` is the ring's): the Python of a step, and a share of the call's
  checks (the consistency all-gather, the layout), which small shards cannot hide; the
  compute around each tile is a tile overhead (above). Its growth to the larger shards,
  per byte a stage sends, is the step overhead per byte: the serial work that grows with
  what a stage moves (packing and unpacking buffers, the all-to-all's re-layouts, gloo's
  all-gather, reduce-scatter and all-to-all, slower than the ring hop the bandwidth is
  measured on). At the larger shards the pipeline is given the call's measured compute,
  not the rates' prediction, whose few-% miss is as large as the overheads
  (``measure_step_overheads``).
- Bandwidth: two local gloo ranks exchange a buffer over ``ctxpar.comm.RingComm`` (each
  sends and receives ``message_bytes`` at once, as a ring hop does); bytes per second per
  direction, best of ``repeats``, after the latency: the time of a 4-byte hop, which
  every message pays whatever its size.
- Memory: one thread copying 256 MiB, bytes read + written per second (decoding reads
  the weights and the KV cache once per token).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from ctxpar import kernels
from ctxpar.auto import CANDIDATES
from ctxpar.launch import run_local
from ctxpar.limits import whole
from ctxpar.models.config import attention_only
from ctxpar.plan import cost
from ctxpar.plan.hardware import BACKWARD_FLOPS_RATIO, LOCAL, TILE_OVERHEADS, Hardware, local_hardware
from ctxpar.plan.workload import Workload

BLOCK = dict(batch=1, heads=8, kv_heads=2, head_dim=64, tokens=4096)  # the demo's head shape
MESSAGE_BYTES = 16 * 2**20  # the size of a ring hop at T=16384 in the demo (8-16 MiB)
LINK_ATTEMPTS = 3  # link measurements a busy machine gets before the calibration gives up


def _is_count(n) -> bool:
    """An integer >= 1: a bool (True counting as 1 run) or a float is none."""
    return whole(n) is not None and n >= 1


def _check_counts(what: str, **counts) -> None:
    """Refuse, before anything is measured, counts that are not integers >= 1, naming them:
    0 repeats left min() of nothing to fail, 0 calls divided by zero, tokens=0 measured the
    default size."""
    bad = ", ".join(f"{name}={n!r}" for name, n in counts.items() if not _is_count(n))
    if bad:
        raise ValueError(f"{what} needs {', '.join(counts)} >= 1 (integers), got {bad}")


@contextlib.contextmanager
def _threads(n: int):
    """torch runs on ``n`` threads inside, on as many as before after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def measure_attention(repeats: int = 3, threads: int = 1, tokens: int | None = None, causal: bool = True) -> dict:
    """Forward and backward CPU seconds of attention over ``tokens`` (None: the block's
    4096), causal unless told; FLOP/s in the planner's convention (visible pairs). The
    result's ``block`` is the shape measured, ``tokens`` included."""
    tokens = BLOCK["tokens"] if tokens is None else tokens
    _check_counts("measuring attention", repeats=repeats, threads=threads, tokens=tokens)
    (b, h, h_kv, d), s = (BLOCK[k] for k in ("batch", "heads", "kv_heads", "head_dim")), tokens
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, h, s, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, h_kv, s, d, generator=gen) for _ in range(2))
    scale = d**-0.5
    with _threads(threads):
        out, lse = kernels.attention_forward(q, k, v, causal=causal, scale=scale)  # warm-up

        def forward() -> None:
            kernels.attention_forward(q, k, v, causal=causal, scale=scale)

        def backward() -> None:
            kernels.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)

        backward()
        fwd = min(_cpu_seconds(forward) for _ in range(repeats))
        bwd = min(_cpu_seconds(backward) for _ in range(repeats))
    flops = 4 * b * h * d * (s * (s + 1) // 2 if causal else s * s)  # visible (query, key) pairs
    return dict(block=dict(BLOCK, tokens=s), causal=causal, threads=threads, forward_seconds=fwd, backward_seconds=bwd,
                forward_flops=flops, backward_to_forward_seconds=bwd / fwd,
                attention_flops=3.5 * flops / (fwd + bwd))


CURVE_TOKENS = (64, 128, 256, 512, 1024, 2048)  # kernel sizes below the block's, where small tiles lose efficiency
CURVE_ROUNDS = 5  # rounds of every size of a size curve, each size's best kept


def measure_size_curve(rounds: int = CURVE_ROUNDS, causal: bool = False, reference: dict | None = None
                       ) -> list[list[float]]:
    """[tokens, forward, backward]: the rates of a kernel of ``tokens`` queries and keys,
    full (unmasked) or causal, for each of CURVE_TOKENS below the block's size and the
    block's own, as fractions of the block's causal kernel's (``reference``, measured here
    if not given): the rates the hardware takes (``local_hardware``). A causal kernel
    computes the tiles straddling its diagonal whole, so its rate falls faster as it
    shrinks, and a full kernel of the block's size runs above 1 (1.12-1.15 here).

    Each of ``rounds`` rounds times every size once (the small ones several times: they
    take microseconds), and each size keeps its best forward and backward: a slow spell of
    the machine, which lasts seconds, then spoils one round of every size, not every run of
    one (run back to back, a size's three runs once came out 20% slow: docs/benchmarks.md,
    run 11)."""
    _check_counts("a size curve", rounds=rounds)
    reference = reference or measure_attention()
    if not reference.get("causal", True):  # measurements from before the key was kept were causal
        raise ValueError("the size curves are fractions of the block's causal kernel's rates: pass its measurement")

    def fractions(forward: float, backward: float, flops: int) -> list[float]:
        return [reference["forward_seconds"] / reference["forward_flops"] * flops / forward,
                reference["backward_seconds"] / reference["forward_flops"] * flops / backward]

    block = reference["block"]["tokens"]
    sizes = [t for t in CURVE_TOKENS if t < block] + ([] if causal else [block])
    best = {tokens: (float("inf"), float("inf"), 0) for tokens in sizes}  # forward, backward seconds; FLOPs
    for _ in range(rounds):
        for tokens in sizes:
            m = measure_attention(repeats=max(1, 1024 // tokens), tokens=tokens, causal=causal)
            forward, backward, _ = best[tokens]
            best[tokens] = (min(forward, m["forward_seconds"]), min(backward, m["backward_seconds"]),
                            m["forward_flops"])
    curve = [[tokens, *fractions(*best[tokens])] for tokens in sizes]
    return curve if not causal else curve + [[block, 1.0, 1.0]]


def measure_matmul(n: int = 1024, repeats: int = 3, threads: int = 1) -> dict:
    """FLOP/s of one thread multiplying two (n, n) float32 matrices (2·n³ FLOPs), best of ``repeats``."""
    _check_counts("measuring matmuls", n=n, repeats=repeats, threads=threads)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen) for _ in range(2))
    with _threads(threads):
        a @ b  # warm-up
        seconds = min(_cpu_seconds(lambda: a @ b) for _ in range(repeats))
    return dict(n=n, threads=threads, seconds=seconds, matmul_flops=2 * n**3 / seconds)


def measure_launch_overhead(calls: int = 200, repeats: int = 5, threads: int = 1) -> float:
    """Wall seconds per ``kernels.attention_forward`` call on a (1, 1, 16, 8) causal tile, whose
    arithmetic (~4K FLOPs) is negligible: the fixed cost of one kernel call. Best of
    ``repeats`` means over ``calls`` calls."""
    _check_counts("measuring the launch overhead", calls=calls, repeats=repeats, threads=threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 8, generator=gen) for _ in range(3))
    with _threads(threads):
        kernels.attention_forward(q, k, v, causal=True, scale=0.125)  # warm-up

        def many() -> None:
            for _ in range(calls):
                kernels.attention_forward(q, k, v, causal=True, scale=0.125)

        return min(_wall_seconds(many) for _ in range(repeats)) / calls


# (queries, keys) of the tiles timed for the tile overheads on this CPU: one whose merge and
# adds are almost all fixed cost, and one as large as the tiles of the small shards, where
# these costs weigh most; a larger tile's accumulators leave the caches and cost 2-3x more
# per byte (1024 x 1024: 1.4-1.6 ms beyond its forward kernel, 5% of it, against this
# line's 0.55), which its kernel's rate hides (docs/planner.md section 6)
TILE_PROBES = ((16, 16), (256, 256))


def measure_tile_overheads(calls: int = 30000, threads: int = 1, *, device: torch.device | str = "cpu",
                           dtype: torch.dtype = torch.float32, shape: dict | None = None,
                           probes: tuple[tuple[int, int], ...] = TILE_PROBES, calls_per_sample: int = 1) -> dict:
    """What a tile of a block plan costs beyond its kernel call, forward and backward: the
    wall seconds of ``blockwise.forward_tiles`` (``backward_tiles``) on one full tile of
    each of ``probes``' shapes at ``shape``'s heads (default the block's), less those of its
    kernel call alone on the same inputs: the median over pairs of samples, one of each,
    taken back to back (so that the machine's drift, as large as the difference between
    them, hits both alike); a tile of q x k gets ``calls`` / (q + k) calls of each (at least
    16 samples). A sample is ``calls_per_sample`` calls issued back to back and drained
    once (on a GPU, as a block loop issues them: the host's time to issue the merge's small
    kernels counts only where it outpaces the device). The line through the two tiles
    against the bytes each accumulates (``cost.accumulated_bytes``) gives the fixed
    ``tile_*_overhead`` and the ``tile_*_seconds_per_byte``, neither negative."""
    from ctxpar.blocks import MaskKind, Tile
    from ctxpar.strategies.blockwise import (backward_tiles, forward_tiles, gradient_accumulators,
                                             output_accumulators)

    shape = shape or BLOCK
    if not all(_is_count(n) for n in (calls, calls_per_sample)) or len(probes) != 2 \
            or not all(len(tile) == 2 and all(_is_count(n) for n in tile) for tile in probes) \
            or not (probes[0][0] < probes[1][0] and probes[0][1] <= probes[1][1]):
        raise ValueError(f"tile overheads need two tiles (queries, keys), the second with more queries and no fewer "
                         f"keys (a line through both), and calls, calls_per_sample >= 1; got probes={probes!r}, "
                         f"calls={calls!r}, calls_per_sample={calls_per_sample!r}")
    if not (all(_is_count(shape.get(key)) for key in ("heads", "kv_heads", "head_dim"))
            and _is_count(shape.get("batch", 1)) and shape["heads"] % shape["kv_heads"] == 0):
        raise ValueError(f"shape needs heads, kv_heads (dividing heads) and head_dim, and batch if given, all >= 1; "
                         f"got {shape!r}")
    b, h, h_kv, d = shape.get("batch", 1), shape["heads"], shape["kv_heads"], shape["head_dim"]
    acc = kernels.accumulation_dtype(dtype).itemsize
    device = torch.device(device)
    scale = d**-0.5
    gen = torch.Generator(device=device).manual_seed(0)

    def sample(fn) -> float:
        _drain(device)
        start = time.perf_counter()
        for _ in range(calls_per_sample):
            fn()
        _drain(device)
        return (time.perf_counter() - start) / calls_per_sample

    rows = []
    with _threads(threads):
        for queries, keys in probes:
            q, dout = (torch.randn(b, h, queries, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
            k, v = (torch.randn(b, h_kv, keys, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
            tile = (Tile(0, queries, 0, keys, MaskKind.FULL),)
            out, lse = output_accumulators(q)
            forward_tiles(q, k, v, tile, out, lse, scale)  # warm-up, and the (out, lse) the backward reads
            dq, dkv = gradient_accumulators(q, k)
            timed = dict(
                forward_kernel=lambda: kernels.attention_forward(q, k, v, causal=False, scale=scale),
                forward_tile=lambda: forward_tiles(q, k, v, tile, out, lse, scale),
                backward_kernel=lambda: kernels.attention_backward(dout, q, k, v, out, lse, causal=False,
                                                                   scale=scale),
                backward_tile=lambda: backward_tiles(dout, q, k, v, out, lse, tile, scale, dq, dkv[0], dkv[1]))
            seconds = {name: [] for name in timed}
            for _ in range(max(16, calls // ((queries + keys) * calls_per_sample))):
                for name, fn in timed.items():
                    seconds[name].append(sample(fn))
            merged, added = cost.accumulated_bytes(batch=b, queries=queries, keys=keys, heads=h, kv_heads=h_kv,
                                                   head_dim=d, acc=acc)
            rows.append(dict(queries=queries, keys=keys, forward_bytes=merged, backward_bytes=added,
                             **{f"{name}_seconds": statistics.median(t) for name, t in seconds.items()},
                             **{f"{p}_extra_seconds": statistics.median(
                                 tile - kernel for kernel, tile in zip(seconds[f"{p}_kernel"], seconds[f"{p}_tile"]))
                                for p in ("forward", "backward")}))
    fitted = {}
    for p in ("forward", "backward"):
        fixed, per_byte = _line_through(*((r[f"{p}_bytes"], r[f"{p}_extra_seconds"]) for r in rows))
        fitted.update({f"tile_{p}_overhead": fixed, f"tile_{p}_seconds_per_byte": per_byte})
    return dict(threads=threads, calls_per_sample=calls_per_sample, tiles=rows, **fitted)


def _drain(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PROBE_STRATEGIES = CANDIDATES  # the strategies auto chooses among


# a probe of at most 1/SMALL_PROBE_SHARE the largest's tokens makes SMALL_PROBE_CALLS calls a
# round: each takes milliseconds, and the least noisy of more of them is cheap
SMALL_PROBE_SHARE, SMALL_PROBE_CALLS = 8, 8


def _probe_rank(rank: int, world: int, sizes: tuple[int, ...], repeats: int) -> dict[int, dict[str, list[dict]]]:
    """Per shard size (tokens per rank), per strategy, every timed call of one attention
    forward + backward: {seconds, forward_compute, backward_compute, faults}, the compute
    being the wall seconds of its compute blocks: kernels, merges and the Python around them
    (``ctxpar.record()``). Each round calls every size and strategy (interleaved, so drift
    hits them alike), a small size ``SMALL_PROBE_CALLS`` times."""
    import torch.distributed as dist

    from ctxpar import profile
    from ctxpar.attention import attention

    b, h, h_kv, d = (BLOCK[k] for k in ("batch", "heads", "kv_heads", "head_dim"))
    gen = torch.Generator().manual_seed(rank)
    inputs = {}
    for tokens in sizes:
        q = torch.randn(b, h, tokens, d, generator=gen, requires_grad=True)
        k, v = (torch.randn(b, h_kv, tokens, d, generator=gen, requires_grad=True) for _ in range(2))
        inputs[tokens] = (q, k, v)
    calls = {tokens: {s: [] for s in PROBE_STRATEGIES} for tokens in sizes}
    for i in range(repeats + 2):  # two untimed rounds connect the ranks and warm the allocator
        for tokens in sizes:
            for strategy in PROBE_STRATEGIES:
                for _ in range(SMALL_PROBE_CALLS if SMALL_PROBE_SHARE * tokens <= sizes[-1] else 1):
                    dist.barrier()
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    with profile.record() as rec:
                        start = time.perf_counter()
                        out = attention(*inputs[tokens], layout="zigzag", strategy=strategy)
                        forward = rec.compute_seconds
                        out.sum().backward()
                        seconds = time.perf_counter() - start
                    if i >= 2:
                        calls[tokens][strategy].append(dict(
                            seconds=seconds, forward_compute=forward, backward_compute=rec.compute_seconds - forward,
                            faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    return calls


def step_probe_workload(tokens_per_rank: int, strategy: str) -> Workload:
    """The planner's description of the step-overhead probe: one attention layer of the block's heads."""
    b, h, h_kv, d = (BLOCK[k] for k in ("batch", "heads", "kv_heads", "head_dim"))
    return Workload(attention_only(h, h_kv, d), batch=b, seq=2 * tokens_per_rank, dtype="float32", cp=2,
                    strategy=strategy)


# tokens per rank of the step probes: a tiny shard (fixed costs), then a shard as large as
# the benchmarks' middle ones (what grows with the bytes a stage sends)
PROBE_TOKENS = (8, 1024)


# process groups the step probes run in: a group's least residuals moved the per-byte
# overheads fitted through them by up to 2.8x from one group to the next (the ring's
# 0.58-1.61 ns/B over ten groups: docs/benchmarks.md), more than more rounds in one group
# did; the line goes through the groups' medians
PROBE_GROUPS = 3


def measure_step_overheads(hw: Hardware, sizes: tuple[int, int] = PROBE_TOKENS, repeats: int = 12,
                           groups: int = PROBE_GROUPS) -> dict:
    """What real attention calls cost beyond what ``hw`` (this machine without step
    overheads) predicts for them: per kernel call, the compute the tile-loop probe
    misses; then, per strategy, per pipeline stage, against the bytes it sends per stage
    (``cost.layer_traffic`` over the stages), the step overheads: the line through the
    probes' residuals on a tiny shard (``sizes[0]`` tokens per rank) and a larger one
    (``sizes[1]``), its value at 0 bytes the fixed step overhead and its slope the step
    overhead per byte sent. Neither is negative: a falling line has no slope (the tiny
    probe's residual is the fixed overhead), one crossing 0 above 0 bytes goes through 0
    and the larger probe instead.

    Each of ``groups`` fresh process groups of two ranks, one thread each, makes the
    calls of ``repeats`` rounds. In each, each probe's residual is its call with the
    least one (what the steps cost without scheduling noise), on the slower of the two
    ranks; the line goes through the median over the groups of each probe's residual.
    The tiny calls' compute (their least, forward and backward) beyond ``hw``'s kernel
    rates and tile overheads is the Python a strategy runs around each kernel call (its
    block plan's lookups, views and bookkeeping), which the tile-loop probe
    (``measure_tile_overheads``) does not run: over all strategies' tiny calls, per
    kernel call, the median over the groups, it is added to the fixed tile overheads
    (``tile_overheads_in_calls``, 0.12-0.14 ms a call forward on this CPU, twice the tile
    loop's own) before any residual is taken. It is compute, so the compute-time
    predictions carry it and the pipeline overlaps it with transfers. The tiny probe's
    compute is then what that ``hw`` predicts; the larger probe's its measured compute
    (the rates miss it by a few %, as much as the overheads there, and the rates' error
    is not a step overhead). Each group's probes are kept under "groups"."""
    if len(sizes) != 2 or not all(_is_count(t) for t in sizes) or sizes[0] >= sizes[1] \
            or not all(_is_count(n) for n in (repeats, groups)):
        raise ValueError(f"step probes need two shard sizes, tokens per rank, ascending, and repeats, groups >= 1; "
                         f"got sizes={sizes!r}, repeats={repeats!r}, groups={groups!r}")
    slower = [_slower_calls(run_local(_probe_rank, 2, (sizes, repeats), threads=1), sizes) for _ in range(groups)]
    bare = replace(hw, step_overhead=0.0, strategy_step_overheads=None, strategy_step_byte_overheads=None)
    tiny = {strategy: step_probe_workload(sizes[0], strategy) for strategy in PROBE_STRATEGIES}
    calls = {strategy: _tile_calls(w, bare) for strategy, w in tiny.items()}
    excess = [{strategy: tuple(min(call[f"{p}_compute"] for call in group[strategy][0]) - c
                               for p, c in zip(("forward", "backward"), cost.compute_seconds(w, bare)))
               for strategy, w in tiny.items()} for group in slower]
    in_calls = [tuple(max(0.0, sum(e[i] for e in group.values()) / sum(calls.values())) for i in (0, 1))
                for group in excess]
    pooled = tuple(statistics.median(group[i] for group in in_calls) for i in (0, 1))
    bare = replace(bare, tile_forward_overhead=hw.tile_forward_overhead + pooled[0],
                   tile_backward_overhead=hw.tile_backward_overhead + pooled[1])
    out, probes = {}, {}
    for strategy in PROBE_STRATEGIES:
        larger = step_probe_workload(sizes[1], strategy)
        at_rates = cost.compute_seconds(tiny[strategy], bare)
        probes[strategy] = [[_step_probe(tiny[strategy], bare, group[strategy][0], lambda call: at_rates),
                             _step_probe(larger, bare, group[strategy][1],
                                         lambda call: (call["forward_compute"], call["backward_compute"]))]
                            for group in slower]
        points = [(p["bytes_per_stage"], statistics.median(g[i]["residual_per_stage"] for g in probes[strategy]))
                  for i, p in enumerate(probes[strategy][0])]
        out[strategy] = dict(bytes_per_stage=[x for x, _ in points], residual_per_stage=[y for _, y in points],
                             tile_calls=calls[strategy], **_fit_step_overhead(*points))
    per_group = [dict(tile_overheads_in_calls=dict(forward=forward, backward=backward),
                      strategies={strategy: dict(probes=probes[strategy][g], compute_excess_seconds=list(e[strategy]))
                                  for strategy in PROBE_STRATEGIES})
                 for g, ((forward, backward), e) in enumerate(zip(in_calls, excess))]
    return dict(tokens_per_rank=list(sizes), world=2, strategies=out,
                tile_overheads_in_calls=dict(forward=pooled[0], backward=pooled[1]), groups=per_group)


def _slower_calls(per_rank: list[dict], sizes: tuple[int, int]) -> dict[str, list[list[dict]]]:
    """Per strategy, per size, each of one process group's calls (``_probe_rank``'s, per
    rank) on the slower rank: the ranks make theirs in the same order."""
    return {strategy: [[max(same, key=lambda call: call["seconds"])
                        for same in zip(*(r[tokens][strategy] for r in per_rank))] for tokens in sizes]
            for strategy in PROBE_STRATEGIES}


def _tile_calls(w: Workload, hw: Hardware) -> int:
    """Kernel calls of the tiles of the rank ``cost.compute_seconds(w, hw)`` times (of the
    busiest, the one with the most compute), forward or backward alike: what a fixed tile
    overhead is paid on."""
    rank = max(cost.busiest_ranks(w), key=lambda r: sum(cost.compute_seconds(w, hw, r)))
    unit = replace(hw, tile_forward_overhead=1.0, tile_forward_seconds_per_byte=0.0)
    return round(cost.tile_overhead_seconds(w, unit, rank)[0])


def _step_probe(w: Workload, bare: Hardware, calls: list[dict], compute: Callable[[dict], tuple[float, float]]) -> dict:
    """One probe of ``measure_step_overheads``: of ``calls``, the one with the least residual
    over ``bare``'s pipelines given the (forward, backward) compute seconds ``compute(call)``."""
    pipelines = cost.attention_time(w, bare)
    stages = pipelines.forward.stages + pipelines.backward.stages

    def predicted(call: dict) -> float:
        return sum(replace(p, compute=seconds / p.stages).seconds
                   for p, seconds in zip((pipelines.forward, pipelines.backward), compute(call)))

    residual, call = min(((c["seconds"] - predicted(c), c) for c in calls), key=lambda pair: pair[0])
    return dict(tokens_per_rank=w.local_len, bytes_per_stage=cost.layer_traffic(w).total / stages,
                seconds=call["seconds"], forward_compute_seconds=call["forward_compute"],
                backward_compute_seconds=call["backward_compute"], predicted_seconds=call["seconds"] - residual,
                stages=stages, residual_per_stage=residual / stages)


def _fit_step_overhead(small: tuple[float, float], large: tuple[float, float]) -> dict[str, float]:
    """{step_overhead, step_overhead_per_byte} from two (bytes per stage, residual seconds
    per stage) probes (``measure_step_overheads``)."""
    fixed, per_byte = _line_through(small, large)
    return dict(step_overhead=fixed, step_overhead_per_byte=per_byte)


def _line_through(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(seconds at 0 bytes, seconds per byte) of the line through two (bytes, seconds) points,
    neither negative: a falling line has no slope (the smaller point's seconds are the
    fixed part), one crossing 0 above 0 bytes goes through 0 and the larger point."""
    (x0, y0), (x1, y1) = small, large
    per_byte = max(0.0, (y1 - y0) / (x1 - x0))
    fixed = y0 - per_byte * x0
    if fixed < 0:
        return 0.0, max(0.0, y1 / x1)
    return fixed, per_byte


def _exchange_rank(rank: int, world: int, sizes: tuple[int, ...], repeats: int) -> list[float]:
    """Best seconds for one ring hop of each message size (bytes) on this rank. The sizes take
    turns, so that a stall of a few milliseconds (another process starting) cannot cover every
    sample of the small hop, which takes well under one."""
    import torch.distributed as dist

    from ctxpar.comm import RingComm

    comm = RingComm()
    buffers = [(torch.ones(max(1, size // 4)), torch.empty(max(1, size // 4))) for size in sizes]
    for send, recv in buffers:  # the first exchange of a size connects / allocates: not timed
        comm.start(send=send, recv=recv)
        comm.wait()
    best = [float("inf")] * len(sizes)
    for _ in range(repeats):
        for i, (send, recv) in enumerate(buffers):
            dist.barrier()
            start = time.perf_counter()
            comm.start(send=send, recv=recv)
            comm.wait()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


class MeasurementError(RuntimeError):
    """A measurement the machine's load swamped: nothing to fix but measuring when it is quiet."""


def measure_link(message_bytes: int = MESSAGE_BYTES, repeats: int = 5) -> dict:
    """Two local gloo ranks: bytes/s per direction from a ``message_bytes`` hop, and the
    per-message latency from a 4-byte hop (each the best of ``4 * repeats`` samples; the
    slower rank's).

    A 4-byte hop that took half as long as the large one or more measured the machine's
    load, not the link (bandwidth is the large hop's bytes over the difference, which such
    a latency would inflate by 2x or more): that is measured again, and refused if it
    persists."""
    for _ in range(LINK_ATTEMPTS):
        per_rank = run_local(_exchange_rank, 2, ((message_bytes, 4), 4 * repeats), threads=1)
        seconds, latency = (max(t[i] for t in per_rank) for i in range(2))
        if latency < seconds / 2:
            return dict(message_bytes=message_bytes, seconds=seconds, bandwidth=message_bytes / (seconds - latency),
                        latency=latency)
    raise MeasurementError(f"measuring the gloo link: {LINK_ATTEMPTS} tries in a row, a 4-byte hop took half as long "
                           f"as a {message_bytes}-byte hop or more (on the last, {latency * 1e6:.0f} against "
                           f"{seconds * 1e6:.0f} us): the machine is too busy to calibrate; calibrate again when it "
                           f"is quiet")


def measure_memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 3, threads: int = 1) -> float:
    """Bytes/s one thread reads plus writes copying a large buffer (what decoding's reads
    of weights and KV cache are paced by)."""
    _check_counts("measuring memory bandwidth", repeats=repeats, threads=threads)
    if whole(nbytes) is None or nbytes < 4 or nbytes % 4:
        raise ValueError(f"measuring memory bandwidth copies float32s: nbytes must be a positive multiple of 4, "
                         f"got {nbytes!r}")
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    with _threads(threads):
        dst.copy_(src)
        best = min(_wall_seconds(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best


def _wall_seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine() -> str:
    """CPU model and core count, as docs/benchmarks.md states machines."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores, torch {torch.__version__}"


def calibrate() -> dict:
    """Every measurement (about 75 s on a 2-core CPU); the dict ``hardware.local_hardware`` reads.
    The link first: the measurement a busy machine can refuse (``MeasurementError``)."""
    link = measure_link()
    attention = measure_attention()
    curve, causal_curve = (measure_size_curve(causal=causal, reference=attention) for causal in (False, True))
    matmul = measure_matmul()
    tiles = measure_tile_overheads()
    measured = dict(machine=machine(), attention_flops=attention["attention_flops"], bandwidth=link["bandwidth"],
                    latency=link["latency"], memory_bandwidth=measure_memory_bandwidth(),
                    matmul_flops=matmul["matmul_flops"], launch_overhead=measure_launch_overhead(),
                    attention_size_curve=curve, attention_causal_size_curve=causal_curve,
                    **{key: tiles[key] for key in TILE_OVERHEADS},
                    attention=attention, matmul=matmul, link=link, tiles=tiles)
    step = measure_step_overheads(local_hardware(measured))
    fixed = {s: m["step_overhead"] for s, m in step["strategies"].items()}
    per_byte = {s: m["step_overhead_per_byte"] for s, m in step["strategies"].items()}
    in_calls = step["tile_overheads_in_calls"]
    return dict(measured, step_overhead=fixed["ring"], strategy_step_overheads=fixed,
                strategy_step_byte_overheads=per_byte, step=step,
                tile_forward_overhead=tiles["tile_forward_overhead"] + in_calls["forward"],
                tile_backward_overhead=tiles["tile_backward_overhead"] + in_calls["backward"])


def check_calibration_flags(hardware: str, *, measure: bool, path: str | None) -> None:
    """``--calibrate`` / ``--calibration`` go with ``--hardware local``, and only one of them."""
    if (measure or path) and hardware.lower() != LOCAL:
        raise ValueError(f"--calibrate and --calibration describe this machine; use them with --hardware local, "
                         f"not {hardware!r}")
    if measure and path:
        raise ValueError("give --calibrate (measure now) or --calibration PATH (measured before), not both")


class OldCalibration(UserWarning):
    """A calibration file that loads, but from an older measurement than this version makes."""


_CALIBRATION_ENTRIES = {"attention_flops", "bandwidth", "latency", "memory_bandwidth", "matmul_flops",
                        "launch_overhead", "attention_size_curve", "attention_causal_size_curve", "attention", "matmul",
                        "link", "tiles"}
# every entry ``calibrate`` writes (a file may lack the later ones, measured by later versions)
_CALIBRATION_KEYS = _CALIBRATION_ENTRIES | {"machine", "step_overhead", "strategy_step_overheads",
                                            "strategy_step_byte_overheads", "step", *TILE_OVERHEADS}


def load_calibration(path: str) -> dict:
    """The calibration in ``path``: a JSON written by ``ctxpar plan --calibrate --json`` (its
    "calibration" entry) or the calibration object itself."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:  # a directory too: --json refuses one, so a file in it is suggested
        written = os.path.join(path, "calibration.json") if os.path.isdir(path) else path
        raise ValueError(f"--calibration {path!r} cannot be read ({e.strerror}); write one with `ctxpar plan "
                         f"--hardware local --calibrate --json {written}`") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--calibration {path!r} is not JSON ({e}); give the file --calibrate --json wrote") from e
    found = (data.get("calibration") or data) if isinstance(data, dict) else None
    # a calibration lacking its rate, told from another file (a benchmark's results name their machine too,
    # and the advice to measure again into it would overwrite them) by two of its own entries
    if not isinstance(found, dict) or ("attention_flops" not in found and len(_CALIBRATION_ENTRIES & set(found)) < 2):
        raise ValueError(f"--calibration {path!r} holds no calibration; write one into a new file (this one holds "
                         f"something else) with `ctxpar plan --hardware local --calibrate --json calibration.json`")
    if "attention_flops" not in found:
        raise ValueError(f"--calibration {path!r} has no \"attention_flops\" entry (the measured attention FLOP/s); "
                         f"measure again with `ctxpar plan --hardware local --calibrate --json {path}`")
    unknown = sorted(set(found) - _CALIBRATION_KEYS)
    if unknown:  # a misspelt figure, or one a calibration does not set, would be ignored without a word
        raise ValueError(f"--calibration {path!r} has entries a calibration does not: {', '.join(unknown)}; it holds "
                         f"what --calibrate measured (set other figures with ctxpar plan's flags: --gpus-per-node, "
                         f"--bandwidth, --latency, ...)")
    attention = found.get("attention", {})
    if not isinstance(attention, dict):
        raise ValueError(f"--calibration {path!r}: its \"attention\" entry must be an object of measured rates, got "
                         f"{type(attention).__name__}; give the file --calibrate --json wrote")
    if "attention_size_curve" in found and "causal" not in attention:
        warnings.warn(OldCalibration(
            f"{path} was calibrated before 2026-12-01: its full-kernel size curve is a fraction of a full kernel's "
            f"rate, not of the causal kernel's the rates are, and charges full tiles 12-14% too slowly; measure "
            f"again with `ctxpar plan --hardware local --calibrate --json {path}`"), stacklevel=2)
    return found


def plan_calibration(hardware: str, *, measure: bool, path: str | None) -> dict | None:
    """The calibration ``ctxpar plan`` uses: measured now, read from ``path``, or none."""
    check_calibration_flags(hardware, measure=measure, path=path)
    if measure:
        return calibrate()
    return None if path is None else load_calibration(path)


def format_calibration(c: dict) -> str:
    a, link = c["attention"], c["link"]
    blk = a["block"]
    return "\n".join([
        f"calibration on {c['machine']}",
        f"  attention kernel, {a['threads']} thread, block H={blk['heads']} H_kv={blk['kv_heads']} "
        f"D={blk['head_dim']} T={blk['tokens']} causal float32: forward {a['forward_seconds'] * 1e3:.1f} ms, "
        f"backward {a['backward_seconds'] * 1e3:.1f} ms ({a['backward_to_forward_seconds']:.2f}x)",
        f"  -> {c['attention_flops'] / 1e9:.1f} GFLOP/s = 3.5 x {a['forward_flops']:,} FLOPs / (forward + backward); "
        f"forward {a['forward_flops'] / a['forward_seconds'] / 1e9:.1f}, backward "
        f"{BACKWARD_FLOPS_RATIO * a['forward_flops'] / a['backward_seconds'] / 1e9:.1f} GFLOP/s",
        *(["  full attention kernels by size (rate as a fraction of the causal T=4096 kernel's, forward / "
           "backward): " + ", ".join(
            f"T={int(t)} {f:.2f}/{b:.2f}" for t, f, b in c["attention_size_curve"])]
          if "attention_size_curve" in c else []),
        *(["  causal attention kernels by size (likewise): " + ", ".join(
            f"T={int(t)} {f:.2f}/{b:.2f}" for t, f, b in c["attention_causal_size_curve"])]
          if "attention_causal_size_curve" in c else []),
        *([f"  matmul, 1 thread, {c['matmul']['n']}^3 float32: {c['matmul_flops'] / 1e9:.1f} GFLOP/s"]
          if "matmul" in c else []),
        *([f"  one tiny attention kernel call: {c['launch_overhead'] * 1e6:.1f} us (launch overhead)"]
          if "launch_overhead" in c else []),
        *([f"  a tile beyond its kernel call (merging its output, adding its gradients): forward "
           f"{c['tile_forward_overhead'] * 1e6:.0f} us + {c['tile_forward_seconds_per_byte'] * 1e9:.2f} ns/B merged, "
           f"backward {c['tile_backward_overhead'] * 1e6:.0f} us + {c['tile_backward_seconds_per_byte'] * 1e9:.2f} "
           f"ns/B added" + _in_calls_words(c)] if all(key in c for key in TILE_OVERHEADS) else []),
        *([_format_steps(c["step"])] if "step" in c else []),
        f"  gloo ring hop between 2 local ranks: {link['message_bytes'] / 2**20:.0f} MiB in "
        f"{link['seconds'] * 1e3:.2f} ms -> {c['bandwidth'] / 1e9:.3f} GB/s per direction; a 4-byte hop "
        f"{link.get('latency', 0) * 1e6:.0f} us (latency)",
        f"  memory copy, 1 thread: {c.get('memory_bandwidth', 0) / 1e9:.1f} GB/s read + write",
    ])


def _in_calls_words(c: dict) -> str:
    """' (fixed parts: 60 / 35 us in the tile loop + 120 / 90 us around it in attention
    calls)' where the step probes measured the latter (``measure_step_overheads``)."""
    in_calls = c.get("step", {}).get("tile_overheads_in_calls")
    if not in_calls or "tiles" not in c:
        return ""
    loop = (c["tiles"]["tile_forward_overhead"], c["tiles"]["tile_backward_overhead"])
    return (f" (fixed parts: {loop[0] * 1e6:.0f} / {loop[1] * 1e6:.0f} us in the tile loop + "
            f"{in_calls['forward'] * 1e6:.0f} / {in_calls['backward'] * 1e6:.0f} us around it in attention calls)")


def _format_steps(step: dict) -> str:
    """The step probes' lines of ``format_calibration``."""
    head = ("  attention forward + backward, 2 ranks, measured / predicted without step overheads (the larger "
            "shards' from their measured compute)")
    if not isinstance(step.get("groups"), list):  # before the line through the groups' medians
        return f"{head}, per pipeline stage: " + "; ".join(
            f"{strategy} {_format_fits(m)}" for strategy, m in step["strategies"].items())
    lines = [f"{head}, in {len(step['groups'])} process groups; the line through each probe's median residual "
             f"per pipeline stage:"]
    for strategy, m in step["strategies"].items():
        residuals = " / ".join(f"{r * 1e3:.2f}" for r in m["residual_per_stage"])
        sent = " / ".join(f"{b / 2**10:.0f}" for b in m["bytes_per_stage"])
        groups = "; ".join(_format_probes(g["strategies"][strategy]) for g in step["groups"])
        lines.append(f"    {strategy} {_overheads(m)} (residuals {residuals} ms at {sent} KiB sent a stage; {groups})")
    return "\n".join(lines)


def _format_fits(m: dict) -> str:
    """'8 tok 4.00 / 1.00 ms, 1024 tok 9.00 / 5.00 ms -> 750 us + 1.20 ns/B sent'; for
    calibrations of commit 3c63fc3, the median of each group's fitted figures, and each
    group's probes and fit."""
    if "groups" not in m:
        return f"{_format_probes(m)} -> {_overheads(m)}"
    fits = "; ".join(f"{_format_probes(g)} -> {_overheads(g)}" for g in m["groups"])
    return f"{_overheads(m)}, the median of {len(m['groups'])} groups' fits ({fits})"


def _format_probes(m: dict) -> str:
    """'8 tok 4.00 / 1.00 ms, 1024 tok 9.00 / 5.00 ms' (older calibrations: one probe, '4.00 / 1.00 ms')."""
    probes = m.get("probes") or [dict(m, tokens_per_rank=None)]
    return ", ".join(("" if p["tokens_per_rank"] is None else f"{p['tokens_per_rank']} tok ")
                     + f"{p['seconds'] * 1e3:.2f} / {p['predicted_seconds'] * 1e3:.2f} ms" for p in probes)


def _overheads(m: dict) -> str:
    """'750 us + 1.20 ns/B sent' (older calibrations: no per-byte part)."""
    per_byte = f" + {m['step_overhead_per_byte'] * 1e9:.2f} ns/B sent" if "step_overhead_per_byte" in m else ""
    return f"{m['step_overhead'] * 1e6:.0f} us{per_byte}"
