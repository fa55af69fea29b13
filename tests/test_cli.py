"""``ctxpar demo`` end to end on a short sequence: exit status, table, JSON."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ctxpar.cli", *args], capture_output=True, text=True, timeout=300)


def test_demo_matches_and_writes_the_documented_json(tmp_path) -> None:
    path = tmp_path / "demo.json"
    proc = run_cli("demo", "--nproc", "3", "--seq", "384", "--layout", "striped", "--dtype", "bfloat16",
                   "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: CP matches" in proc.stdout
    report = json.loads(path.read_text())
    assert report["config"] == {
        "nproc": 3, "seq": 384, "heads": 8, "kv_heads": 2, "head_dim": 64, "layout": "striped",
        "strategy": "ring", "dtype": "bfloat16", "causal": True, "batch": 1, "seed": 0, "ulysses_degree": None,
    }
    assert report["ok"] is True
    assert set(report["max_abs_err"]) == {"out", "lse", "dq", "dk", "dv"}
    assert set(report["imbalance"]) == {"pairs", "seconds"}
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for r in ranks:
        assert {"pairs", "attn_seconds", "bytes_sent", "bytes_received", "peak_memory_bytes"} <= set(r)
        assert r["bytes_sent"] == r["bytes_received"] > 0
    assert sum(r["pairs"] for r in ranks) == 384 * 385 // 2
    assert report["imbalance"]["pairs"] < 1.02


def test_demo_contiguous_shows_the_causal_imbalance(tmp_path) -> None:
    path = tmp_path / "demo.json"
    proc = run_cli("demo", "--nproc", "4", "--seq", "256", "--layout", "contiguous", "--heads", "2",
                   "--kv-heads", "1", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert abs(json.loads(path.read_text())["imbalance"]["pairs"] - 1.75) < 0.01


def test_demo_hybrid_reports_its_strategy(tmp_path) -> None:
    path = tmp_path / "demo.json"
    proc = run_cli("demo", "--nproc", "4", "--seq", "256", "--heads", "4", "--kv-heads", "2",
                   "--strategy", "hybrid", "--ulysses-degree", "2", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hybrid (ulysses 2 x ring 2)" in proc.stdout
    report = json.loads(path.read_text())
    assert report["config"]["strategy"] == "hybrid" and report["config"]["ulysses_degree"] == 2
    assert report["ok"] and report["imbalance"]["pairs"] < 1.02


def test_demo_rejects_a_bad_length_before_starting_ranks() -> None:
    proc = run_cli("demo", "--nproc", "4", "--seq", "1004")
    assert proc.returncode == 2
    assert "sequence length 1004 is not a multiple of 2*P=8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_demo_rejects_strategy_shapes_before_starting_ranks() -> None:
    proc = run_cli("demo", "--nproc", "3", "--seq", "384", "--strategy", "alltoall")
    assert proc.returncode == 2 and "--heads 8 over 3 ranks" in proc.stderr
    proc = run_cli("demo", "--nproc", "4", "--seq", "256", "--strategy", "hybrid", "--ulysses-degree", "3")
    assert proc.returncode == 2 and "--ulysses-degree dividing the 4 ranks" in proc.stderr
