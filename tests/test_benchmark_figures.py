"""Each benchmark script's figures are the formulas docs/benchmarks.md gives them, checked with
the measuring stubbed by fixed numbers: no rank is spawned and nothing is timed, so a figure
computed over the wrong operands (a ratio upside down, the fastest rank for the slowest, a
warm-up round kept) shows as a number that differs from its formula over the other figures."""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from ctxpar.demo import DemoConfig  # noqa: E402

CALIBRATION = dict(attention_flops=5e10, bandwidth=1e9)


@pytest.fixture(autouse=True)
def _threads():
    """Some scripts' main() sets torch's threads to 1 for their ranks: the later tests get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run_main(monkeypatch, tmp_path, script: str, argv: list[str]) -> dict:
    """``script``'s main() on ``argv`` plus ``--json``: the report it wrote."""
    path = tmp_path / f"{script}.json"
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv, "--json", str(path)])
    importlib.import_module(script).main()
    return json.loads(path.read_text())


# plan_vs_measured.py


def test_plan_vs_measured_errors_are_predicted_over_measured_and_attn_is_the_mean_over_ranks() -> None:
    """The contiguous layout gives causal ranks unequal work, so the plan's attention seconds
    differ by rank: the row's is their mean (the measured column is a mean too), not the
    busiest rank's. Error = predicted / measured - 1: measured / predicted - 1 turns a plan
    50x too fast into a +5000% error."""
    pvm = importlib.import_module("plan_vs_measured")
    cfg = DemoConfig(nproc=2, seq=1024, strategy="ring", layout="contiguous")
    want = pvm.predict(cfg, CALIBRATION)
    assert want["attn_seconds"][0] != want["attn_seconds"][1]
    ranks = [dict(bytes_sent=want["bytes_sent"], bytes_received=want["bytes_sent"], attn_seconds=attn,
                  wall_seconds=wall, wall_seconds_rounds=[wall, wall + 1]) for attn, wall in ((0.1, 2.0), (0.3, 4.0))]
    row = pvm.compare(cfg, CALIBRATION, ranks)
    assert row["attn_seconds_predicted"] == pytest.approx(sum(want["attn_seconds"]) / 2)
    assert row["attn_seconds_measured"] == pytest.approx(0.2)
    assert row["attn_error"] == pytest.approx(row["attn_seconds_predicted"] / 0.2 - 1)
    assert row["wall_seconds_predicted"] == pytest.approx(want["wall_seconds"])
    assert row["wall_seconds_measured"] == pytest.approx(3.0)
    assert row["wall_error"] == pytest.approx(want["wall_seconds"] / 3.0 - 1)
    assert row["wall_seconds_rounds"] == pytest.approx([3.0, 4.0]) and row["bytes_match"] is True


def test_plan_vs_measured_drops_the_warm_up_round(monkeypatch) -> None:
    """measure() runs 1 + --repeat rounds and drops the first, which pays one-time costs: a
    kept warm-up would be a fourth round of 9 s among --repeat 3."""
    pvm = importlib.import_module("plan_vs_measured")

    def run_local(fn, nproc, args):
        cfgs, runs = args
        assert runs == 4
        return [[[dict(ok=True, ranks=[dict(bytes_sent=1, bytes_received=1,
                                            attn_seconds=9.0 if i == 0 else 1.0 + i + r,
                                            wall_seconds=9.0 if i == 0 else 2.0 + i + r) for r in range(nproc)])
                  for i in range(runs)] for _ in cfgs]]

    monkeypatch.setattr(pvm, "run_local", run_local)
    [ranks] = pvm.measure([DemoConfig(nproc=2, seq=1024, strategy="ring")], 3)
    for r, rank in enumerate(ranks):
        assert rank["wall_seconds_rounds"] == [3.0 + r, 4.0 + r, 5.0 + r]  # --repeat rounds, no 9 s
        assert rank["wall_seconds"] == 3.0 + r and rank["attn_seconds"] == 2.0 + r  # the best of them


# strategies.py


def test_strategies_rows_are_the_slowest_ranks_median_over_the_limits(monkeypatch, tmp_path) -> None:
    """A row's time is the median over repeats of the slowest rank; /limit and /ring divide it
    by the limit's and the ring's of the same H_kv. The fastest rank would be the limit's
    waiting ranks' 0 s; /limit upside down is below 1 for a row 14x slower. The ranks get
    --ulysses-degree for the hybrid (4 here, not the default 2)."""
    strategies = importlib.import_module("strategies")
    got = {}

    def run_local(fn, nproc, args, threads=1):
        cfg = got["cfg"] = args[0]
        keys = [(s, h) for h in cfg["kv_heads"] for s in (*strategies.STRATEGIES, strategies.LIMIT)]

        def times(key, rank):  # rank r of row (s, h): 1 + r + h/10 + i/100 in repeat i; the limit on rank 0 only
            if key[0] == strategies.LIMIT:
                return [0.5 + key[1] / 100] * cfg["repeat"] if rank == 0 else [0.0] * cfg["repeat"]
            return [1.0 + strategies.STRATEGIES.index(key[0]) + 2 * rank + key[1] / 10 + i / 100
                    for i in (2, 0, 1)]
        return [dict(times={key: times(key, r) for key in keys}, syncs={}) for r in range(nproc)]

    monkeypatch.setattr(strategies, "run_local", run_local)
    report = _run_main(monkeypatch, tmp_path, "strategies",
                       ["--seq", "64", "--nproc", "4", "--heads", "8", "--kv-heads", "4,8", "--ulysses-degree", "4",
                        "--repeat", "3", "--no-memory"])
    assert got["cfg"]["ulysses"] == 4
    rows = {(r["strategy"], r["kv_heads"]): r for r in report["rows"]}
    assert len(rows) == 10
    for (name, h), r in rows.items():
        if name == strategies.LIMIT:
            assert r["seconds"] == [0.5 + h / 100] * 3
            continue
        slowest = 1.0 + strategies.STRATEGIES.index(name) + 2 * 3 + h / 10  # rank 3
        assert r["seconds"] == pytest.approx([slowest + 0.02, slowest, slowest + 0.01])
        assert r["median_seconds"] == pytest.approx(slowest + 0.01)
        assert r["over_limit"] == pytest.approx(r["median_seconds"] / (0.5 + h / 100))
        assert r["over_ring"] == pytest.approx(r["median_seconds"] / rows[("ring", h)]["median_seconds"])
    assert rows[("ring", 4)]["over_limit"] == pytest.approx(7.41 / 0.54)


# plan_vs_published.py


def test_plan_vs_published_metric_error_and_target(monkeypatch, tmp_path) -> None:
    """torchtitan's TPS/GPU is tokens per second per GPU of the CP group (T / CP / step
    seconds: T / step seconds is CP times too many); each row's error is predicted /
    published - 1 and within_target is |error| <= 25% for every row and both
    checkpointings (published / predicted - 1 passes NeMo's 16K row at +29%)."""
    pub = importlib.import_module("plan_vs_published")
    report = _run_main(monkeypatch, tmp_path, "plan_vs_published", [])
    assert report["target"] == 0.25 and len(report["rows"]) == len(pub.ROWS)
    flags = []
    for row, published in zip(report["rows"], pub.ROWS):
        for checkpointing in ("none", "full"):
            p = row[checkpointing]
            if row["metric"] == "tokens_per_second_per_gpu":
                assert p["predicted"] == pytest.approx(row["seq"] / row["cp"] / p["step_seconds"])
            else:
                flops = pub.nemo_model_flops(pub.get_config(row["model"]), row["seq"])
                assert p["predicted"] == pytest.approx(flops / p["step_seconds"] / (row["tp"] * row["cp"]) / 1e12)
            assert p["error"] == pytest.approx(p["predicted"] / published.value - 1)
            assert p["within_target"] == (abs(p["error"]) <= 0.25)
            flags.append(p["within_target"])
    assert True in flags and False in flags


# memory.py


def test_memory_per_token_and_largest_seq_are_the_two_points_line(monkeypatch, tmp_path) -> None:
    """MiB/1K tok is the sequence part over T - T0 tokens (over T it halves here), and the
    largest T is where that line from (T0, step T0) meets the budget, on the layout's multiple."""
    memory = importlib.import_module("memory")
    mib = 2**20
    growth = {(1, 64): 16 * mib, (1, 128): 32 * mib, (2, 64): 12 * mib, (2, 128): 20 * mib}
    monkeypatch.setattr(memory, "step_growth", lambda nproc, seq, args: growth[nproc, seq])
    report = _run_main(monkeypatch, tmp_path, "memory", ["--model", "tiny", "--seq", "128", "--short-seq", "64",
                                                         "--nprocs", "1,2", "--budget-gib", "1"])
    p1, p2 = report["rows"]
    assert p1["bytes_per_token"] == 16 * mib / 64 and p2["bytes_per_token"] == 8 * mib / 64
    assert p1["largest_seq_in_budget"] == (1024 - 16) * 4 + 64  # (budget - step T0) / per token + T0
    assert p2["largest_seq_in_budget"] == (1024 - 12) * 8 + 64  # 8160, a multiple of zigzag's 4
    assert p2["sequence_part_vs_p1"] == 0.5


# rank_work.py


def test_rank_work_error_is_planned_over_timed(monkeypatch, tmp_path) -> None:
    """Error = sum(planned) / sum(timed) - 1, forward + backward: timed / planned - 1 gives a
    plan twice too slow -50%, not +100%."""
    rank_work = importlib.import_module("rank_work")
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(CALIBRATION))
    timed = {0: (1e-3, 3e-3), 1: (2e-3, 6e-3)}
    monkeypatch.setattr(rank_work, "rank_compute", lambda cfg, rank, repeat, mask: timed[rank])
    report = _run_main(monkeypatch, tmp_path, "rank_work", ["--nprocs", "2", "--seqs", "512", "--strategies", "ring",
                                                            "--repeat", "1", "--calibration", str(calibration)])
    assert [r["rank"] for r in report["rows"]] == [0, 1]
    for r in report["rows"]:
        assert (r["forward_timed"], r["backward_timed"]) == timed[r["rank"]]
        planned = r["forward_planned"] + r["backward_planned"]
        assert planned > 0
        assert r["error"] == pytest.approx(planned / sum(timed[r["rank"]]) - 1)


# masks.py


def test_masks_imbalance_is_the_busiest_rank_over_the_mean() -> None:
    """The busiest rank's visible pairs over the mean over ranks (over the least busy rank,
    documents on zigzag at T=4096 P=4 read 1.575)."""
    masks = importlib.import_module("masks")
    rows = masks.balance_table(4096, 4)
    for row in rows:
        assert row["imbalance"] == pytest.approx(max(row["rank_pairs"]) / (sum(row["rank_pairs"]) / 4))
    [documents_zigzag] = [r for r in rows if r["mask"] == "documents" and r["layout"] == "zigzag"]
    assert round(documents_zigzag["imbalance"], 3) == 1.225


def test_masks_wall_time_is_the_slowest_ranks_median(monkeypatch, tmp_path) -> None:
    """A case's fwd+bwd seconds is the median over repeats of the slowest rank (rank 3 here;
    the fastest's would read 1 s); the kernel sum is over every rank, over the unsplit call."""
    masks = importlib.import_module("masks")
    names = list(masks._cases(dict(seq=128), 4))

    def run_local(fn, world, args, threads=1):
        return [{name: dict(wall=[1.0 + r, 5.0 + r, 0.5 + r], compute=[0.1 * (r + 1)] * 3, sent=100)
                 for name in names} for r in range(world)]

    monkeypatch.setattr(masks, "run_local", run_local)
    monkeypatch.setattr(masks, "unsplit_kernel_seconds", lambda cfg: dict.fromkeys(names, 0.5))
    report = _run_main(monkeypatch, tmp_path, "masks", ["--seq", "128", "--nproc", "4", "--repeat", "3"])
    assert [r["case"] for r in report["timed"]] == names
    for row in report["timed"]:
        assert row["wall_seconds"] == 4.0
        assert row["rank_kernel_seconds"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
        assert row["kernel_sum_over_unsplit"] == pytest.approx(1.0 / 0.5)


# overhead.py


def test_overhead_ratios_and_the_unsplit_baselines_mask(monkeypatch, tmp_path) -> None:
    """max/min rank is the slowest rank's best over the fastest's (over the mean it reads 1.5
    for ranks at 1 and 3 s); sum/unsplit is over the best unsplit call, which runs with the
    ranks' mask: with --no-causal, a causal baseline would be half the work."""
    overhead = importlib.import_module("overhead")
    calls = []
    last = {}
    monkeypatch.setattr(overhead, "rank_step", lambda layout, seq, rank, shards, causal, scale:
                        last.update(key=(layout.name, rank), causal=causal))
    monkeypatch.setattr(overhead, "unsplit_attention", lambda q, k, v, dout, causal, scale:
                        (calls.append(causal), last.update(key="unsplit")))
    spent = {"unsplit": [2.0, 1.5], ("zigzag", 0): [1.2, 1.0], ("zigzag", 1): [3.0, 3.3],
             ("contiguous", 0): [0.5, 0.4], ("contiguous", 1): [1.6, 1.9]}

    def seconds(fn):
        fn()
        return spent[last["key"]].pop(0)

    monkeypatch.setattr(overhead, "seconds", seconds)
    report = _run_main(monkeypatch, tmp_path, "overhead", ["--seq", "64", "--nproc", "2", "--heads", "2",
                                                           "--kv-heads", "1", "--layouts", "zigzag,contiguous",
                                                           "--no-causal", "--repeat", "2"])
    assert calls == [False, False] and last["causal"] is False
    assert report["unsplit_seconds"] == 1.5
    zigzag, contiguous = report["layouts"]
    assert zigzag["rank_seconds"] == [1.0, 3.0] and contiguous["rank_seconds"] == [0.4, 1.6]
    assert zigzag["max_over_min"] == pytest.approx(3.0) and contiguous["max_over_min"] == pytest.approx(4.0)
    assert zigzag["sum_over_unsplit"] == pytest.approx(4.0 / 1.5)


# consistency.py


def test_consistency_ratio_is_on_over_off(monkeypatch, tmp_path) -> None:
    """on/off of the slowest rank's medians: off / on reads 0.8 for a check costing 25%."""
    consistency = importlib.import_module("consistency")

    def run_local(fn, nproc, args):
        if fn is consistency.one_rank:
            return [dict(check_seconds=1e-4 * (r + 1), rows=[dict(seq=seq, on=1.25 * (r + 1) * seq / 1024,
                                                                 off=(r + 1) * seq / 1024) for seq in args[0]["seqs"]])
                    for r in range(nproc)]
        return [dict(on=0.3 * (r + 1), off=0.2 * (r + 1)) for r in range(nproc)]

    monkeypatch.setattr(consistency, "run_local", run_local)
    monkeypatch.setattr(consistency, "batch_checksum", lambda seqs, world, repeat: [])
    report = _run_main(monkeypatch, tmp_path, "consistency", ["--seq", "1024,4096", "--nproc", "2"])
    assert report["check_seconds"] == 2e-4
    for row in report["rows"]:
        assert row["forward_off_seconds"] == 2 * row["seq"] / 1024
        assert row["forward_on_seconds"] == pytest.approx(1.25 * row["forward_off_seconds"])
        assert row["ratio"] == pytest.approx(1.25)
        assert row["check_share"] == pytest.approx(2e-4 / row["forward_off_seconds"])
    assert report["generate"]["ratio"] == pytest.approx(1.5)


# decode_host.py, call_overhead.py


def test_decode_host_leaves_the_warm_up_steps_untimed(monkeypatch) -> None:
    """The first --warmup steps are not timed: timed, three warm-up steps of 100 s would be
    the median of five."""
    decode_host = importlib.import_module("decode_host")
    from baseline import ctxpar_modules

    args = decode_host.parse_args(["--layers", "1", "--repeat", "2", "--warmup", "3", "--prompt", "8"])
    calls = []

    def thread_seconds(fn):  # step i: the decode step 10 + i s, the plain forward i s; warm-up steps 100 s
        step, forward = divmod(len(calls), 2)
        calls.append(fn)
        return (100.0 if step < 3 else (float(step) if forward else 10.0 + step)), fn()

    monkeypatch.setattr(decode_host, "thread_seconds", thread_seconds)
    row = decode_host.measure(1, args, {"after": ctxpar_modules()})
    assert len(calls) == 2 * 5
    assert row["after_step"] == statistics.median([13.0, 14.0]) and row["after_forward"] == 3.5
    assert row["after_added"] == 10.0


def test_call_overhead_leaves_the_warm_up_calls_untimed(monkeypatch) -> None:
    """The first --warmup calls of every row are not timed (three warm-up calls of 100 s
    would be the median of five)."""
    call_overhead = importlib.import_module("call_overhead")

    class Instrumented:
        def __init__(self, modules):
            self.calls = 0

        def call(self, q, k, v, dout, sinks, **kwargs):
            self.calls += 1
            total = 100.0 if self.calls <= 3 else float(self.calls)
            return dict(total=total, kernels=total / 2, collectives=total / 4), [q]

    monkeypatch.setattr(call_overhead, "Instrumented", Instrumented)
    cfg = dict(rows=[dict(strategy="ring", layout="zigzag", seq=64, check=False)], nproc=2, heads=2, kv_heads=1,
               head_dim=8, sinks=False, documents=None, window=None, warmup=3, repeat=2, baseline=None)
    [row] = call_overhead.one_rank(0, 2, cfg)
    assert row["after_total"] == 4.5 and row["after_kernels"] == 2.25 and row["after_collectives"] == 1.125


# inference.py, heap.py, plan_walk.py, gpu_check.py


def test_inference_figures(monkeypatch, tmp_path) -> None:
    """TTFT/TPOT the slowest rank's; speed-up = first P's TTFT / this P's; KV ratio = this P's / first's;
    chunks sorted before the crossover; fraction = T_new / (T_cached + T_new); error = planner / measured - 1;
    --repeat and --dtype reach the ranks."""
    inf = importlib.import_module("inference")
    seen = {}
    ratios = {8: 1.5, 16: 1.2, 32: 0.8, 64: 0.7}

    def run_local(fn, world, args, **kwargs):
        if fn is inf.generation_rank:
            seen["generation"] = args
            return [dict(ttft_s=1.0 / world + 0.1 * r, tpot_s=0.01 * world + 0.001 * r,
                         kv_cache_bytes=1000 // world, tokens=[1, 2]) for r in range(world)]
        seen["crossover"] = args
        return [[{"pass-kv": ratios[n] * 1e-3, "pass-q": 1e-3} for n in args[1]]] * world

    monkeypatch.setattr(inf, "run_local", run_local)
    monkeypatch.setattr(inf, "calibrate", lambda: None)
    report = _run_main(monkeypatch, tmp_path, "inference", ["--nproc", "1,2", "--prompt", "64", "--repeat", "3",
                                                             "--cached", "64", "--chunks", "32,8,64,16",
                                                             "--dtype", "bfloat16"])
    p1, p2 = report["generation"]
    assert (p2["ttft_s"], p2["tpot_s"]) == (pytest.approx(0.6), pytest.approx(0.021))
    assert p2["speedup"] == pytest.approx(1.0 / 0.6) and p2["kv_ratio"] == 0.5
    assert p2["tpot_ratio"] == pytest.approx(0.021 / 0.01)
    assert seen["generation"] == (64, 16, 3) and seen["crossover"] == (64, [8, 16, 32, 64], 3, "bfloat16")
    rows = report["partial_prefill"]
    assert [r["chunk"] for r in rows] == [8, 16, 32, 64]
    assert [r["fraction"] for r in rows] == pytest.approx([n / (64 + n) for n in (8, 16, 32, 64)])
    c = report["crossover"]
    assert c["measured"] == pytest.approx(16 * 2 ** (0.2 / 0.4))
    assert c["error"] == pytest.approx(c["predicted"] / c["measured"] - 1)


def test_inference_chunk_rank_drops_the_warm_up_pair(monkeypatch) -> None:
    """A chunk's first pass-KV / pass-Q pair warms up, untimed: kept, a 50 ms first call is a
    pass-Q 25x slower than pass-KV."""
    inf = importlib.import_module("inference")
    calls, clock = [], [0.0]

    def partial_prefill(model, cache, chunk, method, check_consistency):
        calls.append(method)
        clock[0] += 50.0 if len(calls) <= 2 else 1.0

    monkeypatch.setattr(inf, "partial_prefill", partial_prefill)
    monkeypatch.setattr(inf, "prefill", lambda *a, **k: None)
    monkeypatch.setattr(inf.KVCache, "rewind", lambda self, n: None)
    monkeypatch.setattr(inf.dist, "barrier", lambda: None)
    monkeypatch.setattr(inf.dist, "all_reduce", lambda t, op=None: None)
    monkeypatch.setattr(inf.time, "perf_counter", lambda: clock[0])
    rows = inf.chunk_rank(0, 1, 64, [8], 1, "float32", torch.device("cpu"))
    assert calls == ["pass-kv", "pass-q"] * 2 and rows == [{"pass-kv": 1.0, "pass-q": 1.0}]


def test_heap_rows_labels_and_ratio(monkeypatch, tmp_path) -> None:
    """The default heap's rows are measured with the off switch set; ratio = default / kept; faults the median."""
    bench = importlib.import_module("heap")
    from ctxpar import heap

    monkeypatch.setattr(heap, "on_glibc", lambda: True)
    monkeypatch.delenv(heap.OFF_SWITCH, raising=False)  # the benchmark sets and pops it: restored after
    kept = lambda: heap.OFF_SWITCH not in os.environ  # noqa: E731
    monkeypatch.setattr(bench, "measure_link", lambda: dict(seconds=1e-3 if kept() else 2e-3, bandwidth=1e9))
    faults = lambda: (0, 0, 9) if kept() else (1, 2, 30)  # noqa: E731
    monkeypatch.setattr(bench, "run_local", lambda fn, world, args, threads=None: [
        {bench.PROBE_TOKENS[-1]: {s: [dict(faults=f, seconds=0.01) for f in faults()] for s in bench.PROBE_STRATEGIES}}
    ] * 2)
    report = _run_main(monkeypatch, tmp_path, "heap", ["--rounds", "1"])
    default, kept_row = report["rows"]
    s = bench.PROBE_STRATEGIES[0]
    assert (default["kept"], default["link_seconds"], default["faults"][s], default["most_faults"][s]) == (
        False, 2e-3, 2, 30)
    assert (kept_row["kept"], kept_row["link_seconds"]) == (True, 1e-3)
    assert report["hop_default_over_kept"] == pytest.approx(2.0)


def test_plan_walk_best_and_plan_repeat(monkeypatch, tmp_path) -> None:
    """A walk's time is the best of --repeat (the worst reads 5x), and each plan command runs
    --plan-repeat times, not --repeat."""
    pw = importlib.import_module("plan_walk")
    clock, runs = [0.0], []
    walks = iter([5.0] * pw.WALK_RANKS + [1.0] * 2 * pw.WALK_RANKS)

    def tiles_between(q, k, mask, seq):
        clock[0] += next(walks)
        return [0, 0]

    monkeypatch.setattr(pw, "tiles_between", tiles_between)
    monkeypatch.setattr(pw.time, "perf_counter", lambda: clock[0])
    assert pw.time_rank_walk("zigzag", pw.Mask(), 3) == (pytest.approx(pw.WALK_RANKS * 1.0), 2 * pw.WALK_RANKS)
    monkeypatch.setattr(pw.subprocess, "run", lambda *a, **k: runs.append(a))
    monkeypatch.setattr(pw, "time_rank_walk", lambda *a: (0.1, 16))
    _run_main(monkeypatch, tmp_path, "plan_walk", ["--repeat", "5", "--plan-repeat", "2"])
    assert len(runs) == 2 * len(pw.PLAN_COMMANDS)


def test_gpu_check_finish_tests_a_failed_and_a_timed_out_group(tmp_path) -> None:
    """The test groups' counts summed from each pytest summary's last line ("error" and
    "errors" one key), the exit status the worst group's, a group stopped at the timeout said
    so, one killed by a signal from elsewhere not taken for the timeout, FAILED lines shown."""
    gc = importlib.import_module("gpu_check")
    codes = {"P1": "print('FAILED tests/test_cuda.py::test_x - boom'); print('== 1 failed, 2 passed in 1s =='); "
                   "raise SystemExit(1)",
             "P2": "print('== 3 passed, 1 error in 1.0s ==')", "P3": "import time; time.sleep(60)",
             "P4": "import os, signal; print('== 2 errors in 1s ==', flush=True); os.kill(os.getpid(), signal.SIGKILL)"}
    running = {}
    for name, code in codes.items():
        path = tmp_path / f"{name}.log"
        log = open(path, "w")
        running[name] = (subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True), log, str(path))
    for name in ("P1", "P2", "P4"):  # done before the timeout, which P3 alone runs into
        running[name][0].wait()
    t = gc.finish_tests(dict(started=gc.time.perf_counter(), running=running), 1)
    assert t["counts"] == {"failed": 1, "passed": 5, "errors": 3} and t["returncode"] == 9
    assert {n: g["timed_out"] for n, g in t["groups"].items()} == {"P1": False, "P2": False, "P3": True, "P4": False}
    report = dict(dry_run=True, environment=dict(gpu=None, device="cpu", torch="x", cuda=None, driver=None),
                  seconds=1, calibration=dict(error="x"), kernels={}, efficiency=[], targets={}, generation=[],
                  exactness=[], tests=t)
    text = gc.format_report(report)
    assert "P3: stopped at --tests-timeout" in text and "FAILED tests/test_cuda.py::test_x - boom" in text
    assert "P4: killed by SIGKILL (not this check's timeout: the OOM killer?)" in text and "P1: " not in text


def test_gpu_check_targets_efficiency_and_timeout_flag(monkeypatch, tmp_path) -> None:
    """Each target holds only where every row meets it (the max/min one over zigzag rows);
    efficiency's TFLOP/s are the slowest rank's; --tests-timeout reaches finish_tests."""
    gc = importlib.import_module("gpu_check")
    from ctxpar.masks import Mask
    from ctxpar.plan.work import rank_pairs
    import ctxpar

    row = lambda layout, s, m: dict(layout=layout, sum_over_unsplit=s, max_over_min=m,  # noqa: E731
                                    rank_peak_growth_bytes=[None], rank_o_s_bytes=1)
    assert gc.targets([row("zigzag", 1.05, 1.02), row("zigzag", 1.3, 1.01), row("striped", 1.0, 1.5)]) == dict(
        sum_over_unsplit_le_1_10=False, zigzag_max_over_min_le_1_05=True, no_s_squared_allocation=True)
    assert not gc.targets([row("zigzag", 1.0, 1.2), row("striped", 1.0, 1.0)])["zigzag_max_over_min_le_1_05"]
    seconds = iter([1.0, 0.6, 0.4, 1.0, 1.0])  # unsplit; zigzag ranks 0, 1; striped ranks 0, 1
    monkeypatch.setattr(gc, "_timed", lambda fn, device, repeat: next(seconds))
    e = gc.efficiency(torch.device("cpu"), torch.float32, [(64, 2)], 1, dict(heads=2, kv_heads=1, head_dim=8))[0]
    pairs = rank_pairs(ctxpar.get_layout("zigzag", 2), 64, 0, Mask())
    assert e["slowest_rank_tflops"] == pytest.approx(gc.causal_flops(pairs, 2, 8) / 0.6 / 1e12)
    assert e["sum_over_unsplit"] == pytest.approx(1.0) and e["max_over_min"] == pytest.approx(1.5)
    got = {}
    for name in ("calibration", "kernels", "efficiency", "targets", "generation", "exactness", "start_tests"):
        monkeypatch.setattr(gc, name, lambda *a: {})
    monkeypatch.setattr(gc, "finish_tests", lambda tests, timeout: got.update(timeout=timeout) or {})
    monkeypatch.setattr(gc, "format_report", lambda r: "")
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--tests-timeout", "30",
                                      "--json", str(tmp_path / "g.json")])
    gc.main()
    assert got["timeout"] == 30
