"""The one prepared GPU check: CUDA tests, exactness per strategy, and the kernels' efficiency.

    make gpu-check                                   # on a machine with one GPU and its own PyTorch
    python benchmarks/gpu_check.py --dry-run --json out.json     # the same plumbing on the CPU, tiny shapes

Installs nothing. Prints a table and writes JSON (default gpu_check.json, rewritten after every
section so a run stopped part-way keeps what it measured) with:

- ``environment``: torch, CUDA, GPU, driver.
- ``calibration``: what the planner's hardware preset states, measured (first, on a quiet
  GPU): attention forward and backward TFLOP/s at Llama-3-8B's attention shape by sequence
  length, full and causal, and the size curve they make; bf16 matmul rate; device copy
  bandwidth; the cost of one tiny kernel call (the planner's launch overhead); each beside
  the preset's figure for this GPU; and what a tile costs beyond its kernel (the planner's
  tile overheads, 0 in the presets until measured: ``calibrate.measure_tile_overheads``).
- ``tests``: ``pytest tests/test_cuda.py`` (kernels vs fp64, every strategy on P = 1-4 ranks
  sharing the GPU, train on four ranks, the block plans' masks and indices copied to the GPU
  without a host synchronisation), one process per world size side by side while the
  exactness section runs, each logging to ``gpu_check_pytest_<group>.log`` beside the JSON;
  stopped after ``--tests-timeout`` seconds.
- ``exactness``: ``ctxpar demo`` on 4 ranks sharing the GPU per strategy, bf16: max abs
  error of out, lse, dq, dk, dv against float64, and the tolerance.
- ``generation``: ``ctxpar generate --compare`` on 4 ranks sharing the GPU, ring and auto:
  tokens equal to the single-process generation, TTFT, TPOT, KV-cache bytes per rank
  (timed before the tests start, on a quiet GPU).
- ``efficiency``: each rank's forward + backward block loops of the ring (communication
  taken out, every K/V shard local, as ``benchmarks/overhead.py``) at Llama-3-8B's
  attention shape (H=32, H_kv=8, D=128, bf16), T=131072 on P=8 and T=32768 on P=4, zigzag
  and striped: the sum over ranks / one fused forward + backward over the unsplit
  sequence, max / min over ranks, TFLOP/s of the unsplit call and of the slowest rank,
  and each rank's peak memory against the O(S) of its tensors.
- ``kernels``: the flash op against the cuDNN op on one large block (time, and whether
  cuDNN gives the same result), which op ctxpar chose, and for the next decisions: whether
  cuDNN takes GQA without repeated K/V, and the first call's cost on new block shapes.
- ``targets``: sum / unsplit <= 1.10, max / min <= 1.05 (zigzag), no allocation growing
  with S^2 (peak growth <= 4x the rank's O(S) tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback

import torch

import ctxpar
from ctxpar.masks import Mask
from ctxpar.auto import hardware_for
from ctxpar.calibrate import measure_tile_overheads
from ctxpar.plan.hardware import BACKWARD_FLOPS_RATIO
from ctxpar.plan.work import rank_pairs
from ctxpar.demo import DemoConfig, run_demo
from ctxpar.inference.command import GenerateConfig, run_generate
from ctxpar.verify import unsplit_attention
import flags
from overhead import rank_step

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LLAMA3_8B = dict(heads=32, kv_heads=8, head_dim=128)


def environment(device: torch.device) -> dict:
    env = dict(torch=torch.__version__, python=platform.python_version(), device=str(device),
               cuda=torch.version.cuda, gpu=None, driver=None)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            env["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return env


TEST_GROUPS = {  # pytest -k expressions run side by side: the spawned world sizes, then the rest
    **{f"P{w}": f"P{w}-" for w in (1, 2, 3, 4)},
    "kernels-memory-train": "not P1- and not P2- and not P3- and not P4-",
}


def start_tests(log_dir: str) -> dict:
    """``pytest tests/test_cuda.py``, one process per TEST_GROUPS entry, all at once (they only
    check results, so sharing the GPU does not matter), each writing its log in ``log_dir``."""
    running = {}
    for name, expression in TEST_GROUPS.items():
        log_path = os.path.join(log_dir, f"gpu_check_pytest_{name}.log")
        log = open(log_path, "w")
        command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "tests/test_cuda.py",
                   "-k", expression]
        # a session of its own, so that stopping it stops what it started (ctxpar train and its ranks)
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        running[name] = (proc, log, log_path)
    return dict(started=time.perf_counter(), running=running)


def finish_tests(tests: dict, timeout_s: float) -> dict:
    """Waits for ``start_tests``' processes until ``timeout_s`` after their start, stopping any
    still running then; the counts pytest printed and its FAILED/ERROR lines, per group."""
    groups, counts = {}, {}
    for name, (proc, log, log_path) in tests["running"].items():
        timed_out = False  # stopped here; a SIGKILL from elsewhere (the OOM killer) is not a timeout
        try:
            proc.wait(timeout=max(1.0, tests["started"] + timeout_s - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        log.close()
        with open(log_path) as f:
            text = f.read()
        tail = text.strip().splitlines()[-60:]
        # pytest says "1 error" and "2 errors": one key, "errors"
        found = {"errors" if word.startswith("error") else word: int(n)
                 for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", tail[-1] if tail else "")}
        for word, n in found.items():
            counts[word] = counts.get(word, 0) + n
        groups[name] = dict(returncode=proc.returncode, counts=found, timed_out=timed_out,
                            failures=[line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))][:20])
    return dict(seconds=time.perf_counter() - tests["started"], counts=counts, groups=groups,
                returncode=max((abs(g["returncode"]) for g in groups.values()), default=0),
                failures=[f for g in groups.values() for f in g["failures"]][:40])


def exactness(device: torch.device, seq: int, dtype: str, dry_run: bool) -> list[dict]:
    """``ctxpar demo`` per strategy on 4 ranks sharing the device; on the dry run 2, but for
    the hybrid's 2 x 2 (spawning 4 CPU ranks costs seconds of the test suite's time)."""
    rows = []
    for strategy in ("ring", "allgather", "alltoall", "hybrid"):
        nproc = 2 if dry_run and strategy != "hybrid" else 4
        cfg = DemoConfig(nproc=nproc, seq=seq, heads=8, kv_heads=2, head_dim=64, strategy=strategy, dtype=dtype,
                         ulysses_degree=2 if strategy == "hybrid" else None, device=device.type)
        try:
            report = run_demo(cfg)
        except Exception as e:  # noqa: BLE001  the other strategies' verdicts still count
            rows.append(dict(strategy=strategy, ok=False, error=f"{type(e).__name__}: {e}"[-2000:]))
            continue
        rows.append(dict(strategy=strategy, ok=report["ok"], max_abs_err=report["max_abs_err"],
                         tolerance=report["tolerance"],
                         bytes_sent=max(r["bytes_sent"] for r in report["ranks"])))
    return rows


def generation(device: torch.device, dry_run: bool) -> list[dict]:
    """``ctxpar generate --compare`` on 4 ranks sharing the device (2 on the dry run), ring and
    auto, greedy; and ring sampling at temperature 0.9 from a prompt 5 tokens past what zigzag
    splits (its tail goes through partial prefill, and the draws must be the CPU reference's):
    whether the tokens equal the single-process generation, TTFT, TPOT, KV bytes."""
    rows = []
    prompt = 64 if dry_run else 2048
    for strategy, prompt_len, temperature in (("ring", prompt, 0.0), ("auto", prompt, 0.0),
                                              ("ring", prompt + 5, 0.9)):
        cfg = GenerateConfig(nproc=2 if dry_run else 4, prompt_len=prompt_len, new_tokens=4 if dry_run else 16,
                             batch=2, strategy=strategy, temperature=temperature, compare=True, progress=False,
                             device=device.type)
        case = dict(strategy=strategy, prompt_len=prompt_len, temperature=temperature)
        try:
            report = run_generate(cfg)
        except Exception as e:  # noqa: BLE001  the other cases' verdicts still count
            rows.append(dict(case, ok=False, error=f"{type(e).__name__}: {e}"[-2000:]))
            continue
        rows.append(dict(case, ok=report["tokens_match"], chosen=report["strategy_chosen"],
                         ttft_s=report["ttft_s"], tpot_s=report["tpot_s"],
                         kv_cache_bytes_per_rank=report["kv_cache_bytes_per_rank"]))
    return rows


def _timed(fn, device: torch.device, repeat: int) -> float:
    """Best wall seconds of ``fn`` over ``repeat`` calls, the device drained around each."""
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _peak_growth(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def causal_flops(pairs: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of ``pairs`` visible (query, key) pairs per head: the forward
    does QK^T and PV (4 * D FLOPs a pair), the backward 2.5x that (FlashAttention-2's count)."""
    return 3.5 * 4 * pairs * heads * head_dim


def efficiency(device: torch.device, dtype: torch.dtype, cases: list[tuple[int, int]], repeat: int,
               shape: dict) -> list[dict]:
    rows = []
    h, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    scale = d**-0.5
    for seq, world in cases:
        gen = torch.Generator(device=device).manual_seed(0)
        q, dout = (torch.randn(1, h, seq, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, hkv, seq, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        unsplit = _timed(lambda: unsplit_attention(q, k, v, dout, causal=True, scale=scale), device, repeat)
        unsplit_flops = causal_flops(seq * (seq + 1) // 2, h, d)
        for name in ("zigzag", "striped"):
            layout = ctxpar.get_layout(name, world)
            shards = {n: [layout.shard(t, r, dim=2) for r in range(world)]
                      for n, t in dict(q=q, k=k, v=v, dout=dout).items()}
            times, peaks = [], []
            for r in range(world):
                step = lambda: rank_step(layout, seq, r, shards, True, scale)  # noqa: E731
                step()  # warm-up: kernel selection, allocator
                times.append(_timed(step, device, repeat))
                peaks.append(_peak_growth(step, device))
            local, e = seq // world, q.element_size()
            # what a rank's step allocates that grows with S: fp32 accumulators for out and dQ, fp32
            # dK/dV, and out in the input dtype; a kernel's temporaries are of the same order
            o_s = local * d * (4 * 2 * h + 4 * 2 * hkv + e * h)
            slowest = max(range(world), key=lambda r: times[r])
            rows.append(dict(
                seq=seq, world=world, layout=name, unsplit_seconds=unsplit, rank_seconds=times,
                sum_over_unsplit=sum(times) / unsplit, max_over_min=max(times) / min(times),
                unsplit_tflops=unsplit_flops / unsplit / 1e12,
                slowest_rank_tflops=(causal_flops(rank_pairs(layout, seq, slowest, Mask()), h, d)
                                     / times[slowest] / 1e12),
                rank_peak_growth_bytes=peaks, rank_o_s_bytes=o_s,
            ))
    return rows


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message ("" for an empty one, which CUDA errors can carry)."""
    return next(iter(str(e).splitlines()), "")


def _flash_pass(q, k, v, dout, causal: bool, scale: float):
    """torch's flash op, forward and backward from its own lse: (out, (dq, dk, dv))."""
    from ctxpar.kernels import cuda

    out, lse = cuda._flash_fwd(q, k, v, 0.0, causal, False, scale=scale)[:2]
    seed, offset = cuda._flash_aux(q.device, q.dtype)
    return out, cuda._flash_bwd(dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed,
                                offset, scale=scale)


def _cudnn_pass(q, k, v, dout, causal: bool, scale: float):
    """cuDNN's op through ctxpar's wrapper, the same: (out, (dq, dk, dv))."""
    from ctxpar.kernels import cuda

    out, lse, _ = cuda._cudnn_forward(q, k, v, causal, scale)
    return out, cuda._cudnn_backward(dout, q, k, v, out, lse, causal, scale)


def kernels(device: torch.device, seq: int, repeat: int) -> dict:
    """torch's flash op against cuDNN's (through ctxpar's wrapper, lse handed back as the
    strategies do) on one causal bf16 block: seconds, how far apart their results are
    (max abs difference over out, dq, dk, dv, and that over the largest value), and which
    op ctxpar chose here."""
    if device.type != "cuda":
        return dict(skipped="no GPU")
    from ctxpar.kernels import cuda

    h, d = LLAMA3_8B["heads"], LLAMA3_8B["head_dim"]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, seq, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    scale = d**-0.5

    def flash():
        return _flash_pass(q, k, v, dout, True, scale)

    def cudnn():
        return _cudnn_pass(q, k, v, dout, True, scale)

    result = dict(seq=seq, heads=h, head_dim=d, ctxpar_op=cuda.op_for(q),
                  cudnn_honours_lse=cuda._cudnn_honours_lse(device, q.dtype),
                  flash_takes_gqa=cuda._flash_takes_gqa(device, q.dtype), flash_seconds=_timed(flash, device, repeat))
    try:
        result["cudnn_seconds"] = _timed(cudnn, device, repeat)
        (fo, fg), (co, cg) = flash(), cudnn()
        pairs = list(zip((fo, *fg), (co, *cg)))
        result["cudnn_max_abs_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        result["cudnn_max_rel_diff"] = max((a.float() - b.float()).abs().max().item() / a.float().abs().max().item()
                                           for a, b in pairs)
    except (RuntimeError, TypeError) as e:
        result["cudnn_error"] = first_line(e)[:300]
    result.update(cudnn_candidates(device))
    return result


def cudnn_candidates(device: torch.device) -> dict:
    """What ctxpar does not use yet, measured for the next decision:

    - ``cudnn_takes_gqa``: whether cuDNN's forward and backward given K/V with fewer heads
      match K/V repeated (ctxpar repeats them: a workspace of H/H_kv times K/V per call);
    - ``first_call_seconds``: a forward + backward on each of 8 block shapes never seen
      before (documents and windows make new tile shapes every batch; cuDNN builds a plan
      per shape) against the second call on the same shape, cuDNN and flash."""
    from ctxpar.kernels import cuda

    out = {}
    gen = torch.Generator(device=device).manual_seed(1)
    q, dout = (torch.randn(1, 8, 256, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 256, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    try:
        grouped = cuda._cudnn_fwd(q, k, v, None, True, 0.0, True, False, scale=0.1)
        repeated = cuda._cudnn_fwd(q, cuda._repeat_kv(k, 8), cuda._repeat_kv(v, 8), None, True, 0.0, True, False,
                                   scale=0.1)
        _, lse, cum_q, cum_k, _, _, seed, offset, _ = grouped
        grads = cuda._cudnn_bwd(dout, q, k, v, grouped[0], lse, seed, offset, None, cum_q, cum_k, 256, 256, 0.0,
                                True, scale=0.1)
        want = cuda._cudnn_backward(dout, q, k, v, grouped[0], lse, True, 0.1)
        out["cudnn_takes_gqa"] = bool(torch.equal(grouped[0], repeated[0]) and grads[1].shape == k.shape and all(
            torch.allclose(a.float(), b.float(), rtol=2**-6, atol=2**-6) for a, b in zip(grads, want)))
    except Exception as e:  # noqa: BLE001  a refusal is the answer
        out["cudnn_takes_gqa"] = f"no: {type(e).__name__}: {first_line(e)[:200]}"
    for op in ("cudnn", "flash"):
        first, second = [], []
        for i in range(8):
            sq, sk = 1000 + 37 * i, 900 + 53 * i
            qs, ds = (torch.randn(1, 8, sq, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
            ks, vs = (torch.randn(1, 8, sk, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))

            def call() -> None:
                (_cudnn_pass if op == "cudnn" else _flash_pass)(qs, ks, vs, ds, False, 0.1)

            try:
                first.append(_timed(call, device, 1))
                second.append(_timed(call, device, 1))
            except Exception as e:  # noqa: BLE001
                out[f"{op}_first_call_error"] = f"{type(e).__name__}: {first_line(e)[:200]}"
                break
        out[f"{op}_first_call_seconds"], out[f"{op}_second_call_seconds"] = first, second
    return out


def attention_rates(device: torch.device, dtype: torch.dtype, shape: dict, seq: int, causal: bool,
                    repeat: int, keys: int | None = None) -> dict:
    """One unsplit attention forward and backward of ``seq`` queries over ``keys`` (default as
    many) keys: seconds, and FLOP/s in the planner's convention (visible pairs; the
    backward's FLOPs 2.5x the forward's)."""
    from ctxpar import kernels as k_

    h, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    keys = keys or seq
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(1, h, seq, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, hkv, keys, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    scale = d**-0.5
    out, lse = k_.attention_forward(q, k, v, causal=causal, scale=scale)  # warm-up
    k_.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    forward = _timed(lambda: k_.attention_forward(q, k, v, causal=causal, scale=scale), device, repeat)
    backward = _timed(lambda: k_.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale),
                      device, repeat)
    flops = 4 * h * d * (seq * (seq + 1) // 2 if causal else seq * keys)
    return dict(seq=seq, keys=keys, causal=causal, forward_seconds=forward, backward_seconds=backward,
                forward_flops=flops / forward, backward_flops=BACKWARD_FLOPS_RATIO * flops / backward)


def calibration(device: torch.device, dtype: torch.dtype, shape: dict, sizes: tuple[int, ...], repeat: int,
                matmul_n: int, copy_bytes: int) -> dict:
    """What the planner's preset for this GPU states, measured: attention forward / backward
    rates by size (full and causal), matmul rate, memory bandwidth, and the fixed cost of a
    kernel call (a tiny attention forward, whose arithmetic is negligible: the host's time to
    issue it). Beside the preset's figures when the GPU has one."""
    from ctxpar import kernels as k_

    attention = [attention_rates(device, dtype, shape, seq, causal, repeat) for causal in (True, False)
                 for seq in sizes]
    a, b = (torch.randn(matmul_n, matmul_n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    matmul = 2 * matmul_n**3 / _timed(lambda: a @ b, device, max(repeat, 3))
    src = torch.ones(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    memory = 2 * copy_bytes / _timed(lambda: dst.copy_(src), device, max(repeat, 3))
    tiny = torch.randn(1, 1, 16, 64, device=device, dtype=dtype)
    calls = 200
    k_.attention_forward(tiny, tiny, tiny, causal=True, scale=0.125)

    def many() -> None:
        for _ in range(calls):
            k_.attention_forward(tiny, tiny, tiny, causal=True, scale=0.125)

    launch = _timed(many, device, max(repeat, 3)) / calls
    # what a block plan's tile costs beyond its kernel (its merge, its gradient adds): a tiny
    # tile and one of the smallest size a ring step of the presets' workloads runs
    tiles = measure_tile_overheads(device=device, dtype=dtype, shape=shape, calls_per_sample=10,
                                   probes=((16, 16), (sizes[0], sizes[0]) if device.type == "cpu" else (4096, 4096)))
    # the largest causal kernel's rates are the preset's: both size curves are fractions of them
    # (a full kernel runs above 1 per visible pair, having no diagonal tiles to compute whole)
    largest = max((r for r in attention if r["causal"]), key=lambda r: r["seq"])
    # the planner runs a tile at the size curve's rate for its keys (docs/planner.md section 6,
    # measured on CPU): half-key and half-query tiles of the two largest sizes, to check it here
    rectangles = []
    for seq in sizes[-2:]:
        square = next(r for r in attention if (r["seq"], r["causal"]) == (seq, False))
        for queries, keys in ((seq, seq // 2), (seq // 2, seq)):
            r = attention_rates(device, dtype, shape, queries, False, repeat, keys)
            rectangles.append(dict(queries=queries, keys=keys, forward_over_square=r["forward_flops"]
                                   / square["forward_flops"], backward_over_square=r["backward_flops"]
                                   / square["backward_flops"]))
    result = dict(shape=shape, dtype=str(dtype).removeprefix("torch."), attention=attention,
                  size_curve={("causal" if c else "full"): [[r["seq"], r["forward_flops"] / largest["forward_flops"],
                                                              r["backward_flops"] / largest["backward_flops"]]
                                                             for r in attention if r["causal"] == c]
                              for c in (True, False)},
                  rectangles=rectangles, matmul_n=matmul_n, matmul_flops=matmul, memory_bandwidth=memory,
                  launch_overhead=launch, tile_overheads=tiles)
    preset = hardware_for(device) if device.type == "cuda" else None  # the preset strategy="auto" uses here
    if preset is not None:
        measured = dict(attention_forward_rate=largest["forward_flops"],
                        attention_backward_rate=largest["backward_flops"], matmul_rate=matmul,
                        memory_bandwidth=memory)
        result["preset"] = dict(name=preset.name, **{key: dict(preset=getattr(preset, key), measured=value,
                                                              measured_over_preset=value / getattr(preset, key))
                                                     for key, value in measured.items()})
    return result


def targets(rows: list[dict]) -> dict:
    zigzag = [r for r in rows if r["layout"] == "zigzag"]
    peaks_ok = all(p is None or p <= 4 * r["rank_o_s_bytes"] for r in rows for p in r["rank_peak_growth_bytes"])
    return dict(sum_over_unsplit_le_1_10=all(r["sum_over_unsplit"] <= 1.10 for r in rows),
                zigzag_max_over_min_le_1_05=all(r["max_over_min"] <= 1.05 for r in zigzag),
                no_s_squared_allocation=peaks_ok)


SECTIONS = ("calibration", "kernels", "efficiency", "targets", "generation", "exactness", "tests")


def save(report: dict, path: str) -> None:
    """Written after every section, so a run stopped part-way still leaves what it measured."""
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def run_section(report: dict, name: str, fn, path: str) -> None:
    """``report[name] = fn()``; an exception is recorded there instead (and its traceback
    printed), so that one section failing on new hardware does not cost the others' figures."""
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        report[name] = dict(error=f"{type(e).__name__}: {e}"[-2000:])
    save(report, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="on the CPU with tiny shapes: the same steps and JSON keys")
    p.add_argument("--skip-tests", action="store_true", help="leave out pytest tests/test_cuda.py")
    p.add_argument("--tests-timeout", type=flags.positive, default=360, help="seconds the CUDA tests may take in all")
    p.add_argument("--repeat", type=flags.count, default=2, help="best of N for every timing")
    p.add_argument("--json", metavar="PATH", type=flags.output_file, default="gpu_check.json",
                   help="the report, rewritten after every section; pytest logs beside it")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; run with --dry-run to check the plumbing on the CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if args.dry_run:  # tiny shapes, float32 (the CPU op's native dtype)
        dtype, demo_seq, shape = torch.float32, 256, dict(heads=4, kv_heads=2, head_dim=32)
        cases, kernel_seq, sizes, matmul_n, copy_bytes = [(2048, 4), (1024, 2)], 1024, (256, 512), 256, 2**24
    else:
        dtype, demo_seq, shape = torch.bfloat16, 16384, LLAMA3_8B
        cases, kernel_seq = [(131072, 8), (32768, 4)], 32768
        sizes, matmul_n, copy_bytes = (1024, 2048, 4096, 8192, 16384, 32768), 8192, 2**30

    start = time.perf_counter()
    report = dict(dry_run=args.dry_run, environment=environment(device))
    # timings first (generation's TTFT and TPOT among them), on a quiet device; then the
    # correctness checks, side by side
    run_section(report, "calibration", lambda: calibration(device, dtype, shape, sizes, args.repeat, matmul_n,
                                                           copy_bytes), args.json)
    run_section(report, "kernels", lambda: kernels(device, kernel_seq, args.repeat), args.json)
    run_section(report, "efficiency", lambda: efficiency(device, dtype, cases, args.repeat, shape), args.json)
    run_section(report, "targets", lambda: targets(report["efficiency"]), args.json)
    run_section(report, "generation", lambda: generation(device, args.dry_run), args.json)
    tests = None if args.skip_tests else start_tests(os.path.dirname(os.path.abspath(args.json)))
    run_section(report, "exactness", lambda: exactness(device, demo_seq, "float32" if args.dry_run else "bfloat16",
                                                       args.dry_run), args.json)
    run_section(report, "tests", lambda: dict(skipped="--skip-tests") if tests is None
                else finish_tests(tests, args.tests_timeout), args.json)
    report["seconds"] = time.perf_counter() - start
    save(report, args.json)
    print(format_report(report))


def _killed(returncode: int) -> str:
    """A test group's death by a signal not this check's timeout sent."""
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name}" + (" (not this check's timeout: the OOM killer?)" if name == "SIGKILL" else "")


def format_report(r: dict) -> str:
    env = r["environment"]
    lines = [f"ctxpar gpu-check{' (dry run, CPU)' if r['dry_run'] else ''}: {env['gpu'] or env['device']}, "
             f"torch {env['torch']}, CUDA {env['cuda']}, driver {env['driver']}; {r['seconds']:.0f} s", ""]
    failed = [f"{name} FAILED: {r[name]['error']}" for name in SECTIONS
              if isinstance(r[name], dict) and "error" in r[name]]
    lines += failed + ([""] if failed else [])
    t = r["tests"]
    status = f" (exit {t['returncode']})" if "returncode" in t else ""
    lines.append(f"tests/test_cuda.py: {t.get('counts', t)}{status}")
    lines += [f"  {name}: stopped at --tests-timeout" if g["timed_out"] else f"  {name}: {_killed(g['returncode'])}"
              for name, g in t.get("groups", {}).items() if g["timed_out"] or g["returncode"] < 0]
    lines += [f"  {f}" for f in t.get("failures", [])]
    names = ("out", "lse", "dq", "dk", "dv")
    lines += ["", f"{'strategy':<10} {'ok':>3} " + " ".join(f"{n + ' err':>10}" for n in names)]
    for e in r["exactness"] if isinstance(r["exactness"], list) else []:
        lines.append(f"{e['strategy']:<10} {'yes' if e['ok'] else 'NO':>3} " + (
            e["error"] if "error" in e else " ".join(f"{e['max_abs_err'][n]:>10.2e}" for n in names)))
    for g in r["generation"] if isinstance(r["generation"], list) else []:
        lines.append(f"generate, {g['strategy']}, prompt {g.get('prompt_len', '?')}, temperature "
                     f"{g.get('temperature', 0.0)}: " + (g["error"] if "error" in g else (
            f"tokens {'equal' if g['ok'] else 'DIFFER from'} the single-process run, TTFT {g['ttft_s'] * 1e3:.0f} ms, "
            f"TPOT {g['tpot_s'] * 1e3:.1f} ms" + (f", auto chose {', '.join(g['chosen'])}" if g["chosen"] else ""))))
    lines += ["", f"{'T':>7} {'P':>2} {'layout':<8} {'unsplit s':>9} {'sum/unsplit':>11} {'max/min':>8} "
                  f"{'TFLOP/s unsplit':>15} {'slowest rank':>12} {'peak/O(S)':>9}"]
    for e in r["efficiency"] if isinstance(r["efficiency"], list) else []:
        peaks = [p for p in e["rank_peak_growth_bytes"] if p is not None]
        ratio = f"{max(peaks) / e['rank_o_s_bytes']:.2f}" if peaks else "n/a"
        lines.append(f"{e['seq']:>7} {e['world']:>2} {e['layout']:<8} {e['unsplit_seconds']:>9.4f} "
                     f"{e['sum_over_unsplit']:>11.3f} {e['max_over_min']:>8.3f} {e['unsplit_tflops']:>15.1f} "
                     f"{e['slowest_rank_tflops']:>12.1f} {ratio:>9}")
    c = r["calibration"]
    if "error" not in c:
        lines += ["", f"attention kernels, H={c['shape']['heads']} H_kv={c['shape']['kv_heads']} "
                      f"D={c['shape']['head_dim']} {c['dtype']}: TFLOP/s forward / backward (planner's FLOP count)"]
        for a in c["attention"]:
            lines.append(f"  T={a['seq']:>6} {'causal' if a['causal'] else 'full  '} "
                         f"{a['forward_flops'] / 1e12:7.1f} / {a['backward_flops'] / 1e12:7.1f}   "
                         f"({a['forward_seconds'] * 1e3:.2f} + {a['backward_seconds'] * 1e3:.2f} ms)")
        lines += [f"  full {t['queries']} queries x {t['keys']} keys over the square's rates: "
                  f"{t['forward_over_square']:.2f} / {t['backward_over_square']:.2f}" for t in c["rectangles"]]
        lines.append(f"  matmul {c['matmul_n']}^3: {c['matmul_flops'] / 1e12:.1f} TFLOP/s; copy: "
                     f"{c['memory_bandwidth'] / 1e12:.2f} TB/s read + write; one tiny kernel call: "
                     f"{c['launch_overhead'] * 1e6:.1f} us")
        t = c["tile_overheads"]
        lines.append(f"  a tile beyond its kernel (merge, gradient adds): forward "
                     f"{t['tile_forward_overhead'] * 1e6:.1f} us + {t['tile_forward_seconds_per_byte'] * 1e12:.2f} "
                     f"ps/B, backward {t['tile_backward_overhead'] * 1e6:.1f} us + "
                     f"{t['tile_backward_seconds_per_byte'] * 1e12:.2f} ps/B (for the planner: ctxpar plan "
                     f"--tile-overhead {t['tile_forward_overhead'] * 1e6:.1f}us,"
                     f"{t['tile_backward_overhead'] * 1e6:.1f}us)")
        if "preset" in c:
            lines.append(f"  measured / preset {c['preset']['name']}: " + ", ".join(
                f"{key} {v['measured_over_preset']:.2f}" for key, v in c["preset"].items() if key != "name"))
    k = r["kernels"]
    lines += ["", "kernels: " + str({key: value for key, value in k.items() if not key.endswith("call_seconds")})]
    for name in ("cudnn", "flash"):
        first, second = k.get(f"{name}_first_call_seconds"), k.get(f"{name}_second_call_seconds")
        if first and second:
            lines.append(f"  {name}, a block shape never seen before (8 shapes, median): first call "
                         f"{statistics.median(first) * 1e3:.2f} ms, second {statistics.median(second) * 1e3:.2f} ms")
    # a dry run's tiny shapes on the CPU are not what the targets are set for: shown, not judged
    lines.append(f"targets{' (dry run: tiny CPU shapes, not judged)' if r['dry_run'] else ''}: {r['targets']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
