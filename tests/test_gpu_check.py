"""``make gpu-check``'s script runs end to end on the CPU (--dry-run) and writes every key.

The GPU figures need a GPU; this keeps the plumbing that produces them from rotting.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from ctxpar.plan import parse_tile_overhead

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402


def test_gpu_check_dry_run_writes_every_section(tmp_path) -> None:
    path = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--skip-tests", "--repeat", "1",
                           "--json", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    assert set(report) == {"dry_run", "environment", "calibration", "tests", "exactness", "generation", "efficiency",
                           "kernels", "targets", "seconds"}
    assert [(g["strategy"], g["prompt_len"], g["temperature"], g["ok"]) for g in report["generation"]] == [
        ("ring", 64, 0.0, True), ("auto", 64, 0.0, True), ("ring", 69, 0.9, True)]  # 69: partial prefill, sampled
    cal = report["calibration"]
    assert [(a["seq"], a["causal"]) for a in cal["attention"]] == [(256, True), (512, True), (256, False),
                                                                   (512, False)]
    assert all(a["forward_flops"] > 0 and a["backward_flops"] > 0 for a in cal["attention"])
    assert cal["size_curve"]["causal"][-1][1:] == [1.0, 1.0] and cal["launch_overhead"] > 0
    assert [(r["queries"], r["keys"]) for r in cal["rectangles"]] == [(256, 128), (128, 256), (512, 256), (256, 512)]
    assert all(r["forward_over_square"] > 0 and r["backward_over_square"] > 0 for r in cal["rectangles"])
    tiles = cal["tile_overheads"]  # a tiny tile and one of the smallest size, at the dry run's heads
    assert [(r["queries"], r["keys"]) for r in tiles["tiles"]] == [(16, 16), (256, 256)]
    assert tiles["calls_per_sample"] == 10
    assert tiles["tiles"][1]["forward_bytes"] == 4 * 256 * 4 * 32 and tiles["tile_forward_overhead"] >= 0
    assert "a tile beyond its kernel (merge, gradient adds): forward " in proc.stdout
    flag = re.search(r"ctxpar plan --tile-overhead (\S+)\)", proc.stdout).group(1)  # what the planner takes
    assert parse_tile_overhead(flag) == (pytest.approx(tiles["tile_forward_overhead"], abs=1e-7),
                                         pytest.approx(tiles["tile_backward_overhead"], abs=1e-7))
    assert [e["strategy"] for e in report["exactness"]] == ["ring", "allgather", "alltoall", "hybrid"]
    assert all(e["ok"] for e in report["exactness"])
    assert {(e["seq"], e["world"], e["layout"]) for e in report["efficiency"]} == {
        (2048, 4, "zigzag"), (2048, 4, "striped"), (1024, 2, "zigzag"), (1024, 2, "striped")}
    for e in report["efficiency"]:
        assert len(e["rank_seconds"]) == e["world"] and e["sum_over_unsplit"] > 0
    assert set(report["targets"]) == {"sum_over_unsplit_le_1_10", "zigzag_max_over_min_le_1_05",
                                      "no_s_squared_allocation"}
    assert "gpu-check (dry run, CPU)" in proc.stdout


def test_generation_is_timed_before_the_cuda_tests_start(monkeypatch, tmp_path) -> None:
    """TTFT and TPOT are timings: measured on a quiet GPU, not beside the pytest processes."""
    calls = []
    for name in ("calibration", "kernels", "efficiency", "targets", "generation", "exactness", "start_tests",
                 "finish_tests"):
        monkeypatch.setattr(gpu_check, name, lambda *args, name=name: calls.append(name) or {})
    monkeypatch.setattr(gpu_check, "format_report", lambda report: "")
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--json", str(tmp_path / "gpu_check.json")])
    gpu_check.main()
    assert calls == ["calibration", "kernels", "efficiency", "targets", "generation", "start_tests", "exactness",
                     "finish_tests"]


def test_an_op_failing_with_an_empty_message_is_reported(monkeypatch) -> None:
    """A refusal's first line is what the report keeps; an empty message has none (it raised
    IndexError, and the section's other figures were lost)."""
    from ctxpar.kernels import cuda

    def refuse(*args, **kwargs):
        raise RuntimeError()

    monkeypatch.setattr(cuda, "_cudnn_fwd", refuse)
    monkeypatch.setattr(cuda, "_flash_fwd", refuse)
    found = gpu_check.cudnn_candidates(torch.device("cpu"))
    assert found["cudnn_takes_gqa"] == "no: RuntimeError: "
    assert found["cudnn_first_call_error"] == found["flash_first_call_error"] == "RuntimeError: "


def test_a_failing_demo_or_test_group_fails_the_check(monkeypatch, tmp_path) -> None:
    """The dry run passes everywhere, so it never showed a failure being reported: a demo out
    of tolerance in dq alone is not ok; one test group exiting 1 among groups exiting 0 is the
    check's exit status (counts and FAILED lines kept); and without a GPU and --dry-run the
    script says so in one line, not torch's traceback."""
    errors = dict(out=1e-3, lse=1e-3, dq=0.5, dk=1e-3, dv=1e-3)
    monkeypatch.setattr(gpu_check, "run_demo", lambda cfg: dict(
        ok=False, max_abs_err=errors, tolerance={name: 1e-2 for name in errors}, ranks=[dict(bytes_sent=1)]))
    assert [row["ok"] for row in gpu_check.exactness(torch.device("cpu"), 64, "float32", True)] == [False] * 4

    class Exited:
        def __init__(self, returncode: int) -> None:
            self.returncode, self.pid = returncode, 0

        def wait(self, timeout=None) -> None:
            pass

    running = {}
    for group, status, log in (("P1", 0, "3 passed in 1s"), ("P2", 1, "FAILED tests/test_cuda.py::x\n1 failed, 2 "
                                                                      "passed in 1s"), ("P3", 0, "3 passed in 1s")):
        path = tmp_path / f"{group}.log"
        path.write_text(log + "\n")
        running[group] = (Exited(status), open(os.devnull), str(path))
    tests = gpu_check.finish_tests(dict(started=0.0, running=running), 1e9)
    assert (tests["returncode"], tests["counts"]) == (1, dict(passed=8, failed=1))
    assert tests["failures"] == ["FAILED tests/test_cuda.py::x"]
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--skip-tests", "--json",
                               str(tmp_path / "gpu_check.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert (proc.returncode, proc.stderr.strip()) == (1, "gpu_check: no CUDA device visible; run with --dry-run "
                                                             "to check the plumbing on the CPU")
