"""The benchmarks refuse bad flags up front, as argparse errors (exit status 2) naming the flag,
before any calibration, rank or timing: ``parse_args`` of each script does every check."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ctxpar import calibrate

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

# (script, flags, what the refusal names)
REFUSED = [
    ("rank_work", ["--repeat", "0"], "--repeat"),  # was inf timings, -100% errors, exit 0
    ("rank_work", ["--repeat", "-3"], "--repeat"),
    ("rank_work", ["--nprocs", "3", "--seqs", "100"], "--seqs: sequence length 100"),  # a traceback, then "--seq:"
    ("rank_work", ["--strategies", "alltoall"], "--strategies"),
    ("rank_work", ["--window", "0"], "--window"),
    ("rank_work", ["--doc-len", "0"], "--doc-len"),
    ("overhead", ["--repeat", "0"], "--repeat"),  # was min() of an empty sequence
    ("overhead", ["--nproc", "0"], "--nproc"),
    ("overhead", ["--threads", "0"], "--threads"),
    ("overhead", ["--seq", "-8"], "--seq"),
    ("overhead", ["--seq", "100"], "--seq"),  # does not split over zigzag's 2P
    ("overhead", ["--layouts", "zigzag,foo"], "--layouts"),
    ("overhead", ["--heads", "3", "--kv-heads", "2"], "--kv-heads"),  # ran a shape attention refuses
    ("strategies", ["--repeat", "0"], "--repeat"),  # was a StatisticsError after the runs
    ("strategies", ["--ulysses-degree", "3"], "--ulysses-degree"),  # was an IndexError inside the ranks
    ("strategies", ["--kv-heads", "2,3"], "--kv-heads"),  # was a rank failure
    ("strategies", ["--nproc", "0"], "--nproc"),
    ("strategies", ["--nproc", "100000"], "--nproc"),
    ("strategies", ["--layout", "foo"], "--layout"),
    ("memory", ["--seq", "1024", "--short-seq", "1024"], "--short-seq"),  # divided by zero
    ("memory", ["--seq", "128", "--short-seq", "8"], "--short-seq 8 is too short"),  # said --seq 8
    ("memory", ["--seq", "128", "--short-seq", "51", "--nprocs", "1,2"], "--short-seq: sequence length 51"),
    ("memory", ["--nprocs", "2,4"], "--nprocs"),  # its ratio was labelled vs P=1 without a P=1 run
    ("memory", ["--nprocs", "0"], "--nprocs"),
    ("memory", ["--budget-gib", "0"], "--budget-gib"),
    ("memory", ["--budget-gib", "1e300"], "--budget-gib 1e+300 must be at most"),  # was an OverflowError after the runs
    ("memory", ["--strategy", "foo"], "--strategy"),
    ("memory", ["--strategy", "hybrid"], "invalid choice: 'hybrid'"),  # once asked for a flag memory.py has not
    ("memory", ["--seq", "1000"], "--seq"),
    ("memory", ["--model", "foo"], "--model: invalid choice: 'foo'"),  # once named no flag
    ("memory", ["--layout", "foo"], "--layout: invalid choice: 'foo'"),
    # refused inside the run, naming --batch and --nproc, which memory.py has not
    ("memory", ["--model", "llama-3-405b", "--seq", "2048", "--short-seq", "1024"], "on 1 rank with --short-seq "
     "1024 needs at least 1,512.4 GiB, more than this machine's"),
    ("inference", ["--repeat", "0"], "--repeat"),
    ("inference", ["--parts", "foo"], "--parts"),
    ("inference", ["--prompt", "100"], "--prompt"),
    ("inference", ["--parts", "crossover", "--cached", "101"], "--cached"),
    ("inference", ["--chunks", "8,0"], "--chunks"),
    ("inference", ["--cross-nproc", "0"], "--cross-nproc"),
    # refused in the ranks, after the work
    ("inference", ["--parts", "crossover", "--cached", "64", "--chunks", "2147483647"], "--cached + the longest of "
     "--chunks = 2147483711 positions, more than a KV cache holds"),
    ("inference", ["--parts", "generation", "--nproc", "1", "--prompt", "64", "--new-tokens", "2147483646"],
     "--prompt + --new-tokens - 1 = 2147483709 positions"),
    *([] if torch.cuda.is_available() else
      [("inference", ["--parts", "crossover", "--device", "cuda"], "--device cuda: this process sees no CUDA device")]),
    ("masks", ["--seq", "8", "--nproc", "2"], "--seq"),
    ("masks", ["--repeat", "0"], "--repeat"),
    ("masks", ["--heads", "3", "--kv-heads", "2"], "--kv-heads"),
    ("consistency", ["--calls", "0"], "--calls"),
    ("consistency", ["--seq", "1024,100"], "--seq"),
    ("consistency", ["--batch-seq", "7"], "--batch-seq"),
    ("heap", ["--rounds", "0"], "--rounds"),
    ("call_overhead", ["--repeat", "0"], "--repeat"),
    ("call_overhead", ["--seq", "102"], "--seq"),  # does not split over zigzag's 2P
    ("call_overhead", ["--strategies", "alltoall", "--heads", "6", "--kv-heads", "2", "--nproc", "4"], "H=6"),
    ("call_overhead", ["--baseline", "/nonexistent"], "--baseline"),
    # this checkout's src by another path (../src from benchmarks/) once ran, comparing ctxpar with itself
    ("call_overhead", ["--baseline", str(BENCHMARKS / ".." / "src")], "is this checkout's ctxpar"),
    ("decode_host", ["--baseline", "/nonexistent"], "--baseline"),
    ("decode_host", ["--baseline", str(BENCHMARKS / ".." / "src")], "is this checkout's ctxpar"),
    ("decode_host", ["--heads", "3"], "--heads 3 must divide --hidden 64"),
    ("decode_host", ["--heads", "4", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),  # once cut short
    ("decode_host", ["--layers", "4,0"], "--layers"),
    ("plan_walk", ["--plan-repeat", "0"], "--plan-repeat"),
    ("gpu_check", ["--tests-timeout", "nan"], "--tests-timeout"),
    ("gpu_check", ["--repeat", "0"], "--repeat"),
    ("plan_vs_measured", ["--strategies", "ring,foo"], "--strategies"),
    ("plan_vs_measured", ["--strategies", "hybrid", "--nprocs", "4", "--ulysses-degree", "3"], "--ulysses-degree"),
    ("plan_vs_measured", ["--repeat", "0"], "--repeat"),
    ("plan_vs_measured", ["--nprocs", "3"], "--seqs: sequence length 4096 is not a multiple of 2*P=6"),
    ("rank_start", ["--repeat", "0"], "--repeat"),
    ("rank_start", ["--nprocs", "2,0"], "--nprocs"),
]


@pytest.mark.parametrize("script, argv, named", REFUSED, ids=[f"{s} {' '.join(a)}" for s, a, _ in REFUSED])
def test_a_bad_flag_is_an_argparse_error_naming_it(script: str, argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(script).parse_args(argv)
    error = capsys.readouterr().err.split(" error: ", 1)[-1]  # not the usage above it, which names every flag
    assert stop.value.code == 2 and named in error, error


WRITING_JSON = sorted(path.stem for path in BENCHMARKS.glob("*.py") if '"--json"' in path.read_text())


@pytest.mark.parametrize("script", WRITING_JSON)
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(script: str, tmp_path, capsys) -> None:
    """A directory or a missing parent directory was found only when the report was written,
    after the run: a traceback, exit status 1, the run's figures lost. Checked by ``ctxpar
    demo``'s and ``plan``'s own check (``cli.check_output``)."""
    for path, said in ((tmp_path, "is a directory"), (tmp_path / "missing" / "x.json", "does not exist"),
                       ("-", "would write a file named '-' here")):  # once a file named '-', as `ctxpar` did
        with pytest.raises(SystemExit) as stop:
            importlib.import_module(script).parse_args(["--json", str(path)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"argument --json: {str(path)!r}" in err and said in err, err


def test_rank_work_reads_and_checks_its_calibration_before_it_measures(tmp_path, capsys) -> None:
    """--calibration was read in main(): a missing file or one local_hardware refuses was a
    traceback (exit status 1), though the other flags are checked before the minute of
    calibration."""
    other, out_of_range = tmp_path / "other.json", tmp_path / "latency.json"
    other.write_text("[]")
    out_of_range.write_text('{"attention_flops": 1e11, "bandwidth": 1e9, "latency": 1e9}')
    refused = {tmp_path / "missing.json": "cannot be read", other: "holds no calibration",
               out_of_range: "calibration 'latency' is 1000000000.0, outside 0 .. 1 s"}
    rank_work = importlib.import_module("rank_work")
    for path, said in refused.items():
        with pytest.raises(SystemExit) as stop:
            rank_work.parse_args(["--calibration", str(path)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"--calibration {str(path)!r}" in err and said in err, err
    measured = tmp_path / "measured.json"
    measured.write_text('{"attention_flops": 1e11, "bandwidth": 1e9}')
    assert rank_work.parse_args(["--calibration", str(measured)])[2]["attention_flops"] == 1e11


def test_memory_says_a_sequence_part_within_noise_is_noise_and_divides_by_no_zero(monkeypatch, capsys) -> None:
    """Tiny sequences: the resident set's noise made P=1's sequence part 0 (a ZeroDivisionError
    after every run) or negative (printed as memory the step freed)."""
    memory = importlib.import_module("memory")
    growth = {(1, 64): 16 * 2**20, (1, 128): 16 * 2**20, (2, 64): 15 * 2**20, (2, 128): 14 * 2**20}
    monkeypatch.setattr(memory, "step_growth", lambda nproc, seq, args: growth[nproc, seq])
    monkeypatch.setattr(sys, "argv", ["memory.py", "--model", "tiny", "--seq", "128", "--short-seq", "64",
                                      "--nprocs", "1,2"])
    memory.main()
    out = capsys.readouterr().out
    assert " 2         15.0        14.0          -1.0       - " in out, out
    assert "note: a sequence part at or below 0 is the resident set's noise" in out


def test_a_script_stops_with_status_2_before_it_spawns_a_rank() -> None:
    """The scripts' own entry: strategies.py's ulysses degree that does not divide the ranks
    once failed in init_device_mesh inside every rank."""
    proc = subprocess.run([sys.executable, "strategies.py", "--ulysses-degree", "3", "--seq", "64"], cwd=BENCHMARKS,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--ulysses-degree" in proc.stderr and "Traceback" not in proc.stderr


def test_the_measured_crossover_is_where_pass_kv_stays_no_slower() -> None:
    """From the last chunk where pass-KV was slower: a dip below 1 before a longer chunk where it
    was slower again once read as a crossover (ratios 1.2, 0.9, 1.3 gave 12.7)."""
    from inference import measured_crossover

    assert measured_crossover([8, 16, 32], [1.2, 0.9, 1.3]) is None
    assert measured_crossover([8, 16, 32], [0.9, 0.8, 0.7]) is None  # never slower
    assert measured_crossover([8, 16, 32, 64], [1.2, 0.9, 1.1, 0.9]) == pytest.approx(32 * 2 ** 0.5)
    assert measured_crossover([8, 16], [1.5, 0.5]) == pytest.approx(8 * 2 ** 0.5)


def test_decode_host_times_the_step_and_the_plain_forward(tmp_path) -> None:
    path = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "decode_host.py", "--layers", "1,3", "--repeat", "3", "--json", str(path)],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert [row["layers"] for row in rows] == [1, 3]
    # the machine as docs/benchmarks.md states machines (every benchmark's JSON once said "x86_64" alone)
    assert report["machine"] == calibrate.machine() and f"{os.cpu_count()} cores" in report["machine"]
    for row in rows:  # figures, not asserted against each other (timings are the benchmark's to report)
        assert row["after_step"] > 0 and row["after_forward"] > 0 and row["identical"] is None
