"""``ctxpar`` end to end: the demo on a short sequence (exit status, table, JSON), and every
command's refusal of bad values before any rank starts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ctxpar
from ctxpar import launch, rank_server
from ctxpar.cli import COMMANDS, RANK_IMPORTS, entry, main
from ctxpar import calibrate


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m ctxpar``, as a user without the console script on the PATH runs it (ranks spawned too)."""
    return subprocess.run([sys.executable, "-m", "ctxpar", *args], capture_output=True, text=True, timeout=300)


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
        "device": None,
    }
    assert report["ok"] is True and report["strategy_chosen"] == {}
    assert set(report["max_abs_err"]) == {"out", "lse", "dq", "dk", "dv"}
    assert set(report["imbalance"]) == {"pairs", "seconds"}
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for r in ranks:
        assert {"pairs", "attn_seconds", "bytes_sent", "bytes_received", "peak_memory_bytes"} <= set(r)
        assert r["bytes_sent"] == r["bytes_received"] > 0
    assert sum(r["pairs"] for r in ranks) == 384 * 385 // 2
    assert report["imbalance"]["pairs"] < 1.02


def test_demo_auto_on_contiguous_says_what_it_chose_and_shows_the_causal_imbalance(tmp_path) -> None:
    path = tmp_path / "demo.json"
    proc = run_cli("demo", "--nproc", "4", "--seq", "256", "--layout", "contiguous", "--heads", "2",
                   "--kv-heads", "1", "--strategy", "auto", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    (chosen, why), = report["strategy_chosen"].items()  # 2 heads on 4 ranks: no all-to-all
    assert chosen in ("ring", "allgather") and "predicted per layer forward + backward" in why
    assert f"auto -> {chosen} attention" in proc.stdout and f"auto chose {chosen}: {why}" in proc.stdout
    assert report["config"]["strategy"] == "auto" and report["ok"]
    assert abs(report["imbalance"]["pairs"] - 1.75) < 0.01


def test_demo_hybrid_reports_its_strategy(tmp_path) -> None:
    path = tmp_path / "demo.json"
    proc = run_cli("demo", "--nproc", "4", "--seq", "256", "--heads", "4", "--kv-heads", "2",
                   "--strategy", "hybrid", "--ulysses-degree", "2", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hybrid (ulysses 2 x ring 2)" in proc.stdout
    report = json.loads(path.read_text())
    assert report["config"]["strategy"] == "hybrid" and report["config"]["ulysses_degree"] == 2
    assert report["ok"] and report["imbalance"]["pairs"] < 1.02


def demo_verdicts_with_one_tensor_wrong(rank: int, world: int) -> dict | None:
    """The demo's report with rank 1's result off by 0.01 in one element of each tensor in turn
    (none: as computed); out and lse after the call, a gradient by a hook on its input. Rank 0's
    verdicts by the wrong tensor, its per-rank figures as computed ("figures") and with
    ctxpar.record stood in by known ones ("known"); None elsewhere."""
    import ctxpar
    from ctxpar import demo

    def off(t: torch.Tensor) -> torch.Tensor:
        bump = torch.zeros(t.shape, dtype=t.dtype)
        bump.view(-1)[0] = 0.01
        return t + bump

    computed, verdicts = ctxpar.attention_with_lse, {}
    for wrong in ("none", *demo.TENSORS):
        def corrupted(*args, **kwargs):
            out, lse = computed(*args, **kwargs)
            if rank == 1 and wrong in ("dq", "dk", "dv"):
                args["dq dk dv".split().index(wrong)].register_hook(off)
            if rank == 1 and wrong == "out":
                out = off(out)
            return out, off(lse) if rank == 1 and wrong == "lse" else lse

        ctxpar.attention_with_lse = corrupted
        try:
            report = demo.demo_rank(rank, world, demo.DemoConfig(nproc=world, seq=64, heads=4, kv_heads=2,
                                                                 head_dim=16, batch=1))
        finally:
            ctxpar.attention_with_lse = computed
        if report is not None:
            verdicts[wrong] = dict(ok=report["ok"], verdict=demo.format_report(report).splitlines()[-1],
                                   beyond=[n for n in demo.TENSORS if not report["max_abs_err"][n]
                                           <= report["tolerance"][n]])

    class Known:
        """What ctxpar.record measured, known: rank r's compute CPU seconds r + 1."""
        strategy_choices: dict = {}
        compute_cpu_seconds, compute_seconds, wait_seconds, bytes_sent, bytes_received = rank + 1.0, 20.0, 30.0, 5, 7

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    reference, dtypes = demo.unsplit_attention, set()

    def unsplit(*tensors, **kwargs):
        dtypes.update(str(t.dtype) for t in tensors)
        return reference(*tensors, **kwargs)

    # long enough that the backward's compute outweighs the host's work of the first call at this length
    report = demo.demo_rank(rank, world, demo.DemoConfig(nproc=world, seq=2048, heads=4, kv_heads=2, head_dim=16))
    if report is not None:
        verdicts["figures"] = report["ranks"]
    ctxpar.record, demo.unsplit_attention, recording = Known, unsplit, ctxpar.record
    try:
        report = demo.demo_rank(rank, world, demo.DemoConfig(nproc=world, seq=64, heads=4, kv_heads=2, head_dim=16))
    finally:
        ctxpar.record, demo.unsplit_attention = recording, reference
    if report is not None:
        figures = ("attn_seconds", "compute_wall_seconds", "wait_seconds", "bytes_sent", "bytes_received")
        verdicts["known"] = dict(ranks=[[s[key] for key in figures] for s in report["ranks"]],
                                 seconds_imbalance=report["imbalance"]["seconds"], reference_dtypes=dtypes)
    return verdicts if rank == 0 else None


def demo_with_a_layout_of_each_rank(rank: int, world: int) -> str:
    from ctxpar import demo

    try:
        demo.demo_rank(rank, world, demo.DemoConfig(nproc=world, seq=64, heads=4, kv_heads=2, head_dim=16,
                                                    layout=("zigzag", "contiguous")[rank]))
    except ValueError as e:
        return str(e)
    return "ran"


def test_ranks_given_other_layouts_are_told_of_the_layout_alone() -> None:
    """Flags per rank (a torchrun wrapper's): the demo's first, untimed call was of each layout's
    shortest length, so the refusal named other local lengths too, which no flag had set."""
    for said in launch.run_local(demo_with_a_layout_of_each_rank, 2, timeout_s=120):
        assert "the ranks of the CP group called attention with different layout; every rank" in said, said


def test_the_demo_says_mismatch_when_any_one_tensor_is_wrong() -> None:
    """Each of out, lse, dq, dk, dv off on one rank fails the verdict, that tensor alone past its
    tolerance (a verdict that skipped lse said OK of a wrong lse)."""
    verdicts = launch.run_local(demo_verdicts_with_one_tensor_wrong, 2, timeout_s=120)[0]
    assert verdicts.pop("none") == dict(ok=True, verdict="OK: CP matches unsplit attention", beyond=[])
    # each figure from its own field of ctxpar.record, the imbalance of the attention seconds, the reference in
    # float64 (each swapped for another, or the wall time counted without the backward, passed every test)
    known = verdicts.pop("known")
    assert known == dict(ranks=[[1.0, 20.0, 30.0, 5, 7], [2.0, 20.0, 30.0, 5, 7]], seconds_imbalance=2.0 / 1.5,
                         reference_dtypes={"torch.float64"}), known
    for figures in verdicts.pop("figures"):  # the call's wall time holds its compute and its waits
        assert figures["wall_seconds"] >= figures["compute_wall_seconds"] + figures["wait_seconds"] > 0, figures
        assert figures["peak_memory_bytes"] > 0, figures
    assert verdicts == {name: dict(ok=False, verdict="MISMATCH: CP differs from unsplit attention", beyond=[name])
                        for name in ("out", "lse", "dq", "dk", "dv")}


def test_the_demo_report_prints_each_figure_in_its_unit_and_a_hybrid_ranks_own_pairs() -> None:
    """Every tensor's row printed out's tolerance, and peak memory in MB under a MiB header,
    unseen (only the verdict line was read); the hybrid's pairs per rank divided by the ranks
    rather than the Ulysses degree read 8,224 on every rank of a contiguous layout, imbalance
    1.000 for 1.498."""
    import dataclasses

    from ctxpar import demo

    cfg = demo.DemoConfig(nproc=4, seq=256, heads=4, kv_heads=2, strategy="hybrid", ulysses_degree=2,
                          layout="contiguous")
    layout = ctxpar.get_layout("contiguous", 4)
    assert [demo._work_pairs(cfg, "hybrid", layout, r) for r in range(4)] == [4128, 4128, 12320, 12320]
    errors = dict(zip(demo.TENSORS, (1e-1, 2e-2, 3e-3, 4e-4, 5e-5)))
    tolerance = dict(zip(demo.TENSORS, (6e-6, 7e-7, 8e-8, 9e-9, 1e-9)))
    report = dict(config=dataclasses.asdict(demo.DemoConfig(nproc=1)), strategy_chosen={}, backend="gloo",
                  device="cpu", ok=False, max_abs_err=errors, tolerance=tolerance, imbalance=dict(pairs=1, seconds=1),
                  attn_seconds_source="CPU time", peak_memory_source="process_max_rss",
                  ranks=[dict(rank=0, pairs=10, attn_seconds=1.0, wall_seconds=2.0, wait_seconds=0.5,
                              bytes_sent=2**20, bytes_received=2**21, peak_memory_bytes=2**30)])
    lines = demo.format_report(report).splitlines()
    row = next(line.split() for line in lines if line.split()[:2] == ["0", "10"])
    assert row == ["0", "10", "1.000", "2.000", "0.500", "1.00", "2.00", "1024.0"], row
    printed = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines
               if line.split()[:1] and line.split()[0] in demo.TENSORS}
    assert printed == {name: [errors[name], tolerance[name]] for name in demo.TENSORS}, printed


def test_generate_equals_the_single_process_tokens_and_writes_the_documented_json(tmp_path) -> None:
    path = tmp_path / "generate.json"
    proc = run_cli("generate", "--nproc", "2", "--prompt-len", "64", "--new-tokens", "8", "--batch", "2",
                   "--layout", "striped", "--strategy", "allgather", "--compare", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: the tokens equal the single-process generation" in proc.stdout
    report = json.loads(path.read_text())
    assert {"tokens", "reference_tokens", "ttft_s", "tpot_s", "kv_cache_bytes_per_rank"} <= set(report)
    assert report["tokens"] == report["reference_tokens"] and len(report["tokens"]) == 2
    assert all(len(row) == 8 for row in report["tokens"])
    assert report["ttft_s"] > 0 and report["tpot_s"] > 0
    # tiny: 2 layers, K and V, 2 KV heads of 16, fp32; 64 + 7 positions over 2 ranks
    assert report["kv_cache_bytes_per_rank"] == [36 * 2 * 2 * 2 * 2 * 16 * 4] * 2
    assert report["strategy_chosen"] == {}  # an explicit strategy asks the planner nothing
    assert report["prompt_tail"] is None and "partial_prefill" not in proc.stdout  # striped splits 64 over 2
    # what ran, as the demo's says (the config's device is the flag: None)
    assert (report["device"], report["backend"], report["config"]["device"]) == ("cpu", "gloo", None)


def test_generate_with_strategy_auto_equals_the_single_process_tokens_and_reports_its_choice(tmp_path) -> None:
    """3 ranks: the tiny model's 4 query heads do not split over them, which refuses
    alltoall but not auto (it weighs ring and allgather only). Sampled with --seed 3, as the
    reference is (ranks sampling with seed 0 passed every greedy test)."""
    path = tmp_path / "generate.json"
    proc = run_cli("generate", "--nproc", "3", "--prompt-len", "24", "--new-tokens", "4", "--strategy", "auto",
                   "--temperature", "0.8", "--seed", "3", "--compare", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: the tokens equal the single-process generation" in proc.stdout
    report = json.loads(path.read_text())
    assert report["tokens"] == report["reference_tokens"] and len(report["tokens"][0]) == 4
    chosen = report["strategy_chosen"]
    assert chosen and set(chosen) <= {"ring", "allgather"}, chosen
    assert f"3 ranks (auto -> {', '.join(chosen)}, zigzag)" in proc.stdout
    for strategy, why in chosen.items():
        assert f"auto chose {strategy}: {why}" in proc.stdout and "P=3" in why


def test_the_generate_report_prints_its_timings_and_the_model_and_prompt_follow_the_seed() -> None:
    """The time per output token line printed the time to first token (the tests had them
    equal); the prompt drawn with a fixed seed gave every --seed one prompt, and a model seeded
    with 0 one model (and --compare, drawing them alike, said OK)."""
    from ctxpar.inference import command

    config = dict(model="tiny", prompt_len=16, batch=1, new_tokens=2, nproc=2, layout="zigzag", strategy="ring",
                  ulysses_degree=None)
    lines = command.format_report(dict(config=config, kv_cache_bytes_per_rank=[0] * 2, ttft_s=0.01, tpot_s=0.002,
                                       tokens=[[1, 2]])).splitlines()
    assert lines[1:3] == ["time to first token   10.00 ms", "time per output token 2.00 ms"]
    (model_1, prompt_1), (model_2, prompt_2) = (command.build(command.GenerateConfig(prompt_len=16, seed=seed),
                                                              torch.device("cpu")) for seed in (1, 2))
    assert not torch.equal(model_1.embed.weight, model_2.embed.weight)
    assert not torch.equal(prompt_1, prompt_2)
    assert torch.equal(prompt_2, torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3)))


def generate_rank_with_timings_stood_in(rank: int, world: int) -> dict:
    """``ctxpar generate``'s rank on one gloo rank, its generate giving ttft 1 s, tpot 2 s."""
    from ctxpar.inference import command
    from ctxpar.inference.generate import GenerationResult

    command.generate = lambda *args, **kwargs: GenerationResult(
        tokens=torch.zeros(1, 2, dtype=torch.int64), ttft_s=1.0, tpot_s=2.0, kv_cache_bytes=0, cache=None, tail=None)
    return command.generate_rank(rank, world, command.GenerateConfig(nproc=1, prompt_len=8, new_tokens=2,
                                                                     progress=False))


def test_the_generate_report_takes_each_timing_from_its_own_field() -> None:
    """ttft_s and tpot_s swapped in the report passed every test (they only checked both > 0)."""
    (report,) = launch.run_local(generate_rank_with_timings_stood_in, 1, timeout_s=60)
    assert (report["ttft_s"], report["tpot_s"]) == (1.0, 2.0)


def test_the_generate_report_says_when_no_prefill_ran() -> None:
    """A prompt under the layout's multiple goes to partial_prefill alone: the header named
    a strategy (hybrid's degrees, auto's choice) that moved nothing."""
    from ctxpar.inference.command import format_report

    def header(prompt_len: int, strategy: str) -> str:
        config = dict(model="tiny", prompt_len=prompt_len, batch=1, new_tokens=2, nproc=4, layout="zigzag",
                      strategy=strategy, ulysses_degree=2 if strategy == "hybrid" else None)
        report = dict(config=config, kv_cache_bytes_per_rank=[0] * 4, ttft_s=0.01, tpot_s=0.01, tokens=[[1, 2]])
        return format_report(report).splitlines()[0]

    assert header(7, "hybrid").endswith("4 ranks (no prefill: a prompt under 8 tokens goes to partial_prefill, "
                                        "zigzag)")
    assert header(9, "hybrid").endswith("4 ranks (hybrid: ulysses 2 x ring 2, zigzag)")

    def tail_line(prompt_len: int, tokens: int) -> list[str]:
        config = dict(model="tiny", prompt_len=prompt_len, batch=1, new_tokens=2, nproc=4, layout="zigzag",
                      strategy="ring", ulysses_degree=None)
        report = dict(config=config, kv_cache_bytes_per_rank=[0] * 4, ttft_s=0.01, tpot_s=0.01, tokens=[[1, 2]],
                      prompt_tail=dict(tokens=tokens, method="pass-q", why="fewer bytes"))
        return [line for line in format_report(report).splitlines() if "partial_prefill took" in line]

    assert tail_line(7, 7) == ["partial_prefill took the whole prompt (7 tokens) by pass-q: fewer bytes"]
    assert tail_line(9, 1) == ["partial_prefill took the last prompt token by pass-q: fewer bytes"]
    assert tail_line(11, 3) == ["partial_prefill took the last 3 prompt tokens by pass-q: fewer bytes"]
    config = dict(model="tiny", prompt_len=8, batch=1, new_tokens=2, nproc=1, layout="zigzag", strategy="ring",
                  ulysses_degree=None)
    one = dict(config=config, kv_cache_bytes_per_rank=[0], ttft_s=0.01, tpot_s=0.01, tokens=[[1, 2]])
    assert format_report(one).splitlines()[0].endswith(", 1 rank (ring, zigzag)")  # once "1 ranks"


def test_generate_with_the_hybrid_strategy_equals_the_single_process_tokens() -> None:
    """67 tokens: zigzag on 4 ranks splits 64 of them, the last 3 go to partial_prefill (a
    length the layout did not split was refused, advising padding, which generate has none of),
    the report and JSON say by which pass and why (they said nothing of them)."""
    proc = run_cli("generate", "--nproc", "4", "--prompt-len", "67", "--new-tokens", "6", "--strategy", "hybrid",
                   "--ulysses-degree", "2", "--compare", "--json", "-")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    # 3 new on 64 cached: pass-Q moves the fewer bytes
    assert report["prompt_tail"]["tokens"] == 3 and report["prompt_tail"]["method"] == "pass-q", report
    assert report["prompt_tail"]["why"].startswith("fewer bytes: pass-KV ")
    assert "4 ranks (hybrid: ulysses 2 x ring 2, zigzag)" in proc.stderr
    assert f"partial_prefill took the last 3 prompt tokens by pass-q: {report['prompt_tail']['why']}" in proc.stderr
    assert "OK: the tokens equal the single-process generation" in proc.stderr and report["tokens_match"] is True


# -- item 10: every value checked before any rank starts -----------------------------------------


@pytest.fixture
def no_ranks(monkeypatch) -> None:
    """Starting a rank (or measuring this machine) fails the test: every check must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started before the bad value was refused")

    monkeypatch.setattr(launch, "run_local", refuse)
    monkeypatch.setattr(calibrate, "run_local", refuse)


def bad_values(tmp: Path) -> list[tuple[tuple[str, ...], str]]:
    """(command line, what the message must say): values that used to fail late, crash or be taken."""
    not_json, bad_rate = tmp / "notes.txt", tmp / "calibration.json"
    not_json.write_text("measured on Tuesday")
    bad_rate.write_text(json.dumps({"attention_flops": "fast", "bandwidth": 1e9}))
    measured = tmp / "measured.json"
    measured.write_text(json.dumps({"attention_flops": 1e11, "bandwidth": 2e9}))
    other_json = tmp / "results.json"  # the fix once named this file: following it overwrote the user's results
    other_json.write_text(json.dumps({"loss": 2.5}))
    not_rates = tmp / "rates.json"  # once a TypeError's traceback
    not_rates.write_text(json.dumps({"attention_flops": 1e9, "bandwidth": 1e9, "attention_size_curve": [[1024, 1, 1]],
                                     "attention": 5}))
    no_rate = tmp / "no_rate.json"  # said to hold no calibration, not which entry it lacks
    no_rate.write_text(json.dumps({"bandwidth": 1e9, "attention": {"forward_flops": 1e9}}))
    results = tmp / "bench.json"  # a benchmark's results, naming their machine: once advised to measure into it
    results.write_text(json.dumps({"config": {}, "machine": "x86_64", "torch": "2.13.0", "rows": []}))
    missing = str(tmp / "no" / "such" / "dir" / "out.json")
    (tmp / "afile").write_text("")
    (tmp / "dangling").symlink_to(tmp / "gone")
    (tmp / "ck2").mkdir()
    (tmp / "to_ck2").symlink_to(tmp / "ck2")
    return [
        (("demo", "--nproc", "4", "--seq", "1004"), "sequence length 1004 is not a multiple of 2*P=8"),
        (("demo", "--nproc", "3", "--seq", "384", "--strategy", "alltoall"), "query heads H=8 (H_kv=2) over P=3 ranks"),
        (("demo", "--nproc", "4", "--seq", "256", "--strategy", "hybrid", "--ulysses-degree", "3"),
         "needs a --ulysses-degree dividing the 4 CP ranks"),
        (("demo", "--nproc", "4", "--seq", "256", "--strategy", "auto", "--ulysses-degree", "2"),
         "a --ulysses-degree is only for strategy 'hybrid', not 'auto'"),
        (("demo", "--nproc", "0"), "--nproc 0 must be >= 1"),
        (("demo", "--nproc", "100000"), "--nproc 100000 is more local ranks than this machine runs"),
        (("demo", "--timeout", "0"), "--timeout 0.0 must be a number of seconds"),
        (("demo", "--timeout", "nan"), "--timeout nan must be a number of seconds"),
        (("demo", "--timeout", "1e300"), "--timeout 1e+300 must be a number of seconds"),
        (("demo", "--strategy", "hybrid", "--ulysses-degree", "-2"), "--ulysses-degree dividing the 4 CP ranks"),
        (("demo", "--strategy", "hybrid", "--ulysses-degree", "0"), "--ulysses-degree dividing the 4 CP ranks"),
        (("plan", "--cp", "4", "--strategy", "hybrid", "--ulysses-degree", "0"),
         "--ulysses-degree dividing the 4 CP ranks"),
        (("demo", "--seq", str(2**40)), "--seq must be between 1 and"),
        (("demo", "--head-dim", "100000000"), "--head-dim 100000000 on 4 ranks (each builds the whole sequence) "
                                                "needs at least"),
        (("demo", "--json", str(tmp)), f"--json {str(tmp)!r} is a directory"),
        # a directory to be: once "not writable (Is a directory)", as if it existed
        (("demo", "--json", "not_there/"), "--json 'not_there/' ends in '/', so names a directory, not a file"),
        (("demo", "--json", missing), "does not exist; create it first"),
        (("demo", "--json", ""), "--json needs a file path"),
        *([(("demo", "--device", "cuda"), "--device cuda: this process sees no CUDA device"),
           (("train", "--device", "cuda"), "--device cuda: this process sees no CUDA device")]
          if not torch.cuda.is_available() else []),
        (("train", "--nproc", "0"), "--nproc 0 must be >= 1"),
        (("train", "--nproc", "2", "--dp", "-2"), "--dp -2 must be a whole number >= 1 dividing the 2 ranks"),
        (("train", "--nproc", "1", "--model", "llama-3-405b"), "--model llama-3-405b on 1 rank with --seq 2048 and "
                                                               "--batch 1 needs at least"),
        (("train", "--timeout", "-1"), "--timeout -1.0 must be a number of seconds"),
        (("train", "--timeout", "0.001"), "--timeout 0.001 must be a number of seconds from 1 to"),
        (("demo", "--timeout", "0.5"), "--timeout 0.5 must be a number of seconds from 1 to"),
        (("train", "--lr", "-0.1"), "--lr -0.1 must be a positive finite learning rate"),
        (("train", "--lr", "0"), "--lr 0.0 must be a positive finite learning rate"),  # trains nothing, silently
        (("train", "--lr", "1e38"), "where AdamW's first step size overflows float32"),  # once a late crash
        (("train", "--checkpoint-dir", " "), "--checkpoint-dir needs a directory path"),  # once "" saved nothing
        (("train", "--checkpoint-dir", "", "--resume"), "--checkpoint-dir needs a directory path"),
        # the fix suggested was a file inside the directory, refused as the directory did not exist yet
        (("train", "--checkpoint-dir", str(tmp / "ck"), "--json", str(tmp / "ck")),
         f"is the --checkpoint-dir; give the report a file of its own outside it (--resume names every file in it "
         f"that is not a checkpoint), e.g. {tmp / 'report.json'}"),
        # an existing directory (--resume's): a file inside it was suggested, which --resume then named a stray entry
        (("train", "--checkpoint-dir", str(tmp), "--json", str(tmp), "--resume"),
         f"is the --checkpoint-dir; give the report a file of its own outside it (--resume names every file in it "
         f"that is not a checkpoint), e.g. {tmp.parent / 'report.json'}"),
        (("train", "--checkpoint-dir", str(tmp / "ck"), "--json", str(tmp / "ck" / "out.json")),
         "is inside the --checkpoint-dir; give the report a file of its own outside it"),
        (("train", "--checkpoint-dir", str(tmp / "ck2"), "--json", str(tmp / "to_ck2" / "out.json")),  # by a link
         "is inside the --checkpoint-dir; give the report a file of its own outside it"),
        (("train", "--checkpoint-dir", ".", "--json", ""), "--json needs a file path"),  # not "is the --checkpoint-dir"
        # "is not writable (File exists)" for both
        (("train", "--checkpoint-dir", f"{tmp / 'afile'}/"), "/afile/' is a file, not a directory"),
        (("train", "--checkpoint-dir", str(tmp / "dangling")),
         f"is a symbolic link to {str(tmp / 'gone')!r}, which does not exist"),
        # named neither the flag nor the shortest length
        (("train", "--nproc", "2", "--seq", "48"), "--seq 48 is too short for the recall task (16 pairs, 8 queries): "
                                                   "at least 50, e.g. --seq 52 (a multiple of 4 for --layout zigzag"),
        (("train", "--lr", "nan"), "--lr nan must be a positive finite learning rate"),
        (("train", "--cp", "-2", "--dp", "-2"), "--cp -2 x --dp -2 must equal the 4 ranks"),
        # a product other than the ranks, above or below: once only "above" was refused, and --cp 1 on 2 ranks ran CP=2
        (("train", "--nproc", "4", "--dp", "1", "--cp", "2"), "--cp 2 x --dp 1 must equal the 4 ranks"),
        (("train", "--nproc", "2", "--dp", "2", "--cp", "2"), "--cp 2 x --dp 2 must equal the 2 ranks"),
        (("train", "--seed", str(2**70)), "--seed must be between 0 and"),
        (("train", "--model", "llama-3-405b"), "--model llama-3-405b on 4 ranks"),
        (("train", "--json", missing), "does not exist; create it first"),
        (("plan", "--ulysses-degree", "-2", "--strategy", "hybrid"), "--ulysses-degree dividing the 8 CP ranks"),
        (("plan", "--max-cp", "0"), "--max-cp 0 is below --cp 8"),
        (("plan", "--max-cp", "100000"), "--max-cp 100000 is beyond the largest CP degree"),
        (("plan", "--head-dim", "0"), "--head-dim must be between 1 and"),
        (("plan", "--kv-heads", "3"), "--heads 32 must be a multiple of --kv-heads 3"),
        (("plan", "--vocab", str(10**30)), "--vocab must be between 1 and"),
        (("plan", "--seq", str(2**40)), f"--seq {2**40} is longer than the planner evaluates"),
        (("plan", "--bandwidth", "1e400"), "--bandwidth '1e400' = inf bytes/s is outside"),
        (("plan", "--bandwidth", "fast"), "--bandwidth 'fast' is not understood"),
        (("plan", "--bandwidth=-1GB/s"), "--bandwidth '-1GB/s' = -1e+09 bytes/s is outside"),  # "not understood"
        (("plan", "--flops=-989T"), "--flops '-989T' = -9.89e+14 FLOP/s is outside"),
        (("plan", "--flops", "0.5"), "--flops '0.5' = 0.5 FLOP/s is outside"),
        (("plan", "--efficiency", "0.0001"), "--efficiency 0.0001 must be in [0.01, 1]"),
        (("plan", "--window", "0"), "--window must be between 1 and"),
        (("plan", "--window", "4096", "--no-causal"), "--window 4096 is a causal sliding window"),
        (("plan", "--documents", "8192,x"), "--documents '8192,x' must be comma-separated document lengths"),
        (("plan", "--documents", "8192,0"), "each an integer between 1 and"),
        (("plan", "--documents", ""), "--documents '' must be comma-separated"),
        (("plan", "--doc-dist", "zipf:1.1"), "--doc-dist 'zipf:1.1': unknown distribution 'zipf'"),
        (("plan", "--doc-dist", "lognormal:2048"), "lognormal takes MEAN,SIGMA"),
        (("plan", "--doc-dist", "lognormal:0,1"), "MEAN 0 must be a document length"),
        (("plan", "--doc-dist", "lognormal:2048,-1"), "SIGMA -1 must be between 0 and 5"),
        (("plan", "--doc-dist", "lognormal:inf,1"), "MEAN inf must be"),
        (("plan", "--doc-dist", "fixed:1.5"), "fixed takes one length"),
        (("plan", "--documents", "100", "--doc-dist", "fixed:100"), "give one of them"),
        (("plan", "--doc-seed", "3"), "--doc-seed seeds --doc-dist's draws"),
        (("plan", "--doc-dist", "fixed:100", "--doc-seed", "-1"), "--doc-seed must be between 0 and"),
        (("plan", "--json", missing), "does not exist; create it first"),
        (("plan", "--json", str(tmp)), f"--json {str(tmp)!r} is a directory"),
        (("plan", "--plot", str(tmp)), "plan.png"),
        (("plan", "--plot", str(tmp / "p.txt")), "matplotlib writes no 'txt' images; end the path with one of"),
        (("plan", "--json", str(tmp / "p.png"), "--plot", str(tmp / "p.png")),
         "--json and --plot both name"),  # the plot once overwrote the JSON
        (("demo", "--json", "/proc/ctxpar.json"), "is not writable (No such file or directory)"),  # writable bits
        (("plan", "--hardware", "local", "--calibration", missing), f"--calibration {missing!r} cannot be read"),
        # suggested `--calibrate --json` the directory, which --json refuses
        (("plan", "--hardware", "local", "--calibration", str(tmp)), "cannot be read (Is a directory); write one with "
         f"`ctxpar plan --hardware local --calibrate --json {tmp / 'calibration.json'}`"),
        (("plan", "--hardware", "local", "--calibration", str(not_json)), "is not JSON"),
        # it scaled the measured attention rate, matmuls 2.8x slower at 0.5 and slower than measured at 1
        (("plan", "--hardware", "local", "--calibration", str(measured), "--efficiency", "0.5"),
         "--efficiency scales a preset's peak FLOP/s; --hardware local's rates are measured"),
        (("plan", "--hardware", "LOCAL", "--calibration", str(measured), "--efficiency", "0.5"),  # names any case
         "--efficiency scales a preset's peak FLOP/s; --hardware local's rates are measured"),
        (("plan", "--hardware", "local", "--calibration", str(other_json)),
         "holds no calibration; write one into a new file (this one holds something else) with `ctxpar plan "
         "--hardware local --calibrate --json calibration.json`"),
        (("plan", "--hardware", "local", "--calibration", str(results)), "holds no calibration; write one into a new "
                                                                           "file (this one holds something else)"),
        (("plan", "--hardware", "local", "--calibration", str(bad_rate)), "calibration 'attention_flops' is 'fast'"),
        (("plan", "--hardware", "local", "--calibration", str(no_rate)),
         f"has no \"attention_flops\" entry (the measured attention FLOP/s); measure again with `ctxpar plan "
         f"--hardware local --calibrate --json {no_rate}`"),
        (("plan", "--hardware", "local", "--calibration", str(not_rates)), 'its "attention" entry must be an object'),
        (("plan", "--hardware", "local", "--calibrate", "--head-dim", "0"), "--head-dim must be between 1 and"),
        # refused once the machine was measured (106 s)
        (("plan", "--hardware", "local", "--calibrate", "--efficiency", "0.5"),
         "--efficiency scales a preset's peak FLOP/s; --hardware local's rates are measured"),
        *(((command, "--seq", "1001"), "--seq: sequence length 1001 is not a multiple of 2*P=")
          for command in ("demo", "train", "plan")),
        (("generate", "--new-tokens", "0"), "--new-tokens must be between 1 and"),
        (("generate", "--batch", "0"), "--batch must be between 1 and"),
        (("generate", "--nproc", "3", "--prompt-len", "1020", "--strategy", "alltoall"),
         "splits the query heads H=4 (H_kv=2) over P=3 ranks"),
        (("generate", "--strategy", "hybrid"), "dividing the 4 CP ranks (the ring degree is CP ranks / "
                                              "--ulysses-degree); none was given"),
        (("train", "--strategy", "hybrid", "--ulysses-degree", "4", "--dp", "2"),
         "--ulysses-degree dividing the 2 CP ranks"),
        (("train", "--ulysses-degree", "2"), "a --ulysses-degree is only for strategy 'hybrid', not 'ring'"),
        (("train", "--strategy", "hybrid", "--ulysses-degree", "8", "--model", "tiny", "--nproc", "8"),
         "splits the query heads H=4 (H_kv=2) over ulysses degree=8"),
        (("generate", "--ulysses-degree", "2"), "a --ulysses-degree is only for strategy 'hybrid'"),
        (("generate", "--strategy", "auto", "--ulysses-degree", "2"),
         "a --ulysses-degree is only for strategy 'hybrid', not 'auto'"),
        (("generate", "--temperature", "nan"), "--temperature must be a finite number >= 0"),
        (("generate", "--seed", "-1"), "--seed must be between 0 and"),
        (("generate", "--nproc", "0"), "--nproc 0 must be >= 1"),
        (("generate", "--model", "llama-3-405b"), "--model llama-3-405b on 4 ranks"),
        (("generate", "--json", missing), "does not exist; create it first"),
    ]


def test_every_bad_value_is_refused_up_front_naming_the_flag(tmp_path, no_ranks, capsys) -> None:
    wrong = []
    for argv, expected in bad_values(tmp_path):
        status = main(list(argv))
        err = capsys.readouterr().err
        if status != 2 or expected not in err or not err.startswith(f"ctxpar {argv[0]}: error: "):
            wrong.append(f"{' '.join(argv)} -> status {status}: {err.strip()!r}")
    assert not wrong, "\n".join(wrong)


def test_seeds_are_taken_from_0_to_the_largest_the_refusal_names(no_ranks, capsys) -> None:
    """"--seed must be between 0 and 4294967295": both ends are taken, one past either is refused,
    by every flag that takes a seed (an off-by-one bound refusing 4294967295, the largest seed
    the message offers, passed every test as a planted mutation). demo, train and generate got
    past every check when they start a rank (no_ranks: an AssertionError); plan's --doc-seed
    draws its documents."""
    from ctxpar.limits import MAX_SEED

    assert MAX_SEED == 2**32 - 1
    for command in ("demo", "train", "generate"):
        for seed in (0, MAX_SEED):
            with pytest.raises(AssertionError, match="a rank was started"):
                main([command, "--seed", str(seed)])
        for seed in (-1, MAX_SEED + 1):
            assert main([command, "--seed", str(seed)]) == 2
            assert f"--seed must be between 0 and {MAX_SEED}, got {seed}" in capsys.readouterr().err
    plan = ["plan", "--seq", "8192", "--cp", "2", "--max-cp", "2", "--doc-dist", "fixed:100", "--doc-seed"]
    for seed in (0, MAX_SEED):
        assert main([*plan, str(seed)]) == 0
        assert f"documents fixed:100 seed {seed} (82 in the row" in capsys.readouterr().out
    for seed in (-1, MAX_SEED + 1):
        assert main([*plan, str(seed)]) == 2
        assert f"--doc-seed must be between 0 and {MAX_SEED}, got {seed}" in capsys.readouterr().err


@pytest.mark.parametrize("off_by, gradient_off_by, start, status, says", [
    (1e-6, 1e-5, 0, 0, "OK: step 1's gradients within 0.0001 of the reference's (at most 1.00e-05 of its norm, in "
                       "output.weight) and the losses of the first 2 step(s) within 0.0001"),
    (3e-4, 0, 0, 0, "OK: step 1's gradients"),  # 6e-5 of the loss: the tolerance is relative, not 1e-4
    (1e-2, 0, 0, 1, "MISMATCH: a loss of the first 2 step(s) differs"),
    (float("nan"), 0, 0, 1, "MISMATCH"),
    (0, 1e-3, 0, 1, "MISMATCH: a gradient of step 1 differs from the reference's by more than 0.0001 (1.00e-03 of "
                    "its norm, in output.weight)"),
    (0, float("nan"), 0, 1, "MISMATCH: a gradient of step 1 differs"),
    (1e-2, 1, 1, 0, "not judged: resumed at step 1"),  # its weights carry earlier steps' rounding
])
def test_train_compare_exits_non_zero_when_an_early_loss_or_gradient_differs_from_the_reference(
        off_by, gradient_off_by, start, status, says, monkeypatch, capsys) -> None:
    """As demo and generate --compare do on a mismatch; train --compare exited 0 however large
    the difference. Step 1's gradients and the first two steps' losses are judged; a third
    step 10% off is shown, not judged (training amplifies float32 rounding: a run at --lr 0.01
    differed by up to 5e-2 within 60 steps, and an exact run would fail). Its ranks and reference run
    are stood in for: this is the verdict alone (test_train: wrong attention read MISMATCH)."""
    import dataclasses

    import ctxpar.train as train

    reference_gradients = {"embed.weight": torch.ones(4, 2), "output.weight": torch.ones(3)}
    gradients = {**reference_gradients, "output.weight": torch.ones(3) * (1 + gradient_off_by)}

    def ranks(fn, nproc, args, **kwargs):
        return dict(config=dict(dataclasses.asdict(args[0]), cp=1), start_step=start, loss=[5.0, 4.9, 4.5][start:],
                    recall_accuracy=[0.0] * (3 - start), tokens_per_second=[1.0] * (3 - start),
                    first_step_gradients=None if start else gradients)

    monkeypatch.setattr(train.launch, "run", ranks)
    monkeypatch.setattr(train, "train_reference", lambda cfg: dict(loss=[5.0, 4.9 + off_by, 4.0], parameters=None,
                                                                  first_step_gradients=reference_gradients))
    argv = ["train", "--nproc", "1", "--seq", "64", "--steps", "3", "--compare", "--no-progress"]
    assert main(argv) == status
    assert says in capsys.readouterr().out


def test_train_exits_1_with_one_message_when_the_run_is_stopped_on_purpose_in_this_process(monkeypatch,
                                                                                         capsys) -> None:
    """A stop raised to the command itself (a torchrun rank's, or --compare's reference run reaching a
    non-finite loss) exited 0 under a planted bug and no test saw it: local ranks' stops come as a
    RankFailure, by another path (test_checkpoints: the non-finite loss end to end)."""
    import ctxpar.cli as cli

    def stopped(cfg, **kwargs):
        raise cli.launch.StopRun("step 2: the loss is nan; stopped before anything of this step is saved")

    monkeypatch.setattr(cli, "run_train", stopped)
    assert main(["train", "--nproc", "1", "--seq", "64", "--steps", "2", "--compare", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "ctxpar train: error: step 2: the loss is nan" in err and "Traceback" not in err, err


# each command's flags at values other than their defaults, and the config the run must get
EVERY_FLAG = {
    "demo": (["--nproc", "3", "--seq", "36", "--batch", "2", "--heads", "6", "--kv-heads", "3", "--head-dim", "4",
              "--layout", "striped", "--strategy", "allgather", "--dtype", "bfloat16", "--no-causal", "--seed", "7",
              "--device", "cpu"],
             dict(nproc=3, seq=36, batch=2, heads=6, kv_heads=3, head_dim=4, layout="striped", strategy="allgather",
                  dtype="bfloat16", causal=False, seed=7, ulysses_degree=None, device="cpu")),
    "train": (["--nproc", "6", "--dp", "2", "--cp", "3", "--seq", "66", "--batch", "3", "--steps", "5", "--lr", "0.002",
               "--model", "small", "--strategy", "hybrid", "--ulysses-degree", "3", "--layout", "contiguous",
               "--seed", "7", "--activation-checkpointing", "--compare", "--checkpoint-dir", "CKPT",
               "--save-every", "2", "--no-progress", "--device", "cpu"],
              dict(nproc=6, dp=2, seq=66, batch=3, steps=5, lr=0.002, model="small", strategy="hybrid",
                   ulysses_degree=3, layout="contiguous", seed=7, activation_checkpointing=True, compare=True,
                   checkpoint_dir="CKPT", save_every=2, resume=False, progress=False, device="cpu",
                   return_parameters=False)),
    "generate": (["--nproc", "2", "--prompt-len", "13", "--new-tokens", "5", "--batch", "2", "--model", "small",
                  "--layout", "striped", "--strategy", "hybrid", "--ulysses-degree", "2", "--temperature", "0.7",
                  "--seed", "7", "--compare", "--no-progress", "--device", "cpu"],
                 dict(nproc=2, prompt_len=13, new_tokens=5, batch=2, model="small", layout="striped",
                      strategy="hybrid", ulysses_degree=2, temperature=0.7, seed=7, compare=True, progress=False,
                      device="cpu")),
}


@pytest.mark.parametrize("command", list(EVERY_FLAG))
def test_every_flag_reaches_the_run(command: str, monkeypatch, tmp_path) -> None:
    """Each flag given a value other than its default arrives in the config the run gets, and
    --timeout in the run's timeout: demo's --no-causal, train's --layout and
    --activation-checkpointing and generate's --layout and --timeout, dropped one at a time,
    passed every test (a dropped --layout even refused a length the asked layout splits)."""
    import dataclasses

    from ctxpar import cli
    from ctxpar.inference import command as generation

    got = {}

    def run(cfg, timeout_s):
        got.update(config=cfg, timeout_s=timeout_s)
        return None  # as a torchrun rank other than 0: nothing to print

    monkeypatch.setattr(cli, "run_demo", run)
    monkeypatch.setattr(cli, "run_train", run)
    monkeypatch.setattr(generation, "run_generate", run)
    flags, want = EVERY_FLAG[command]
    flags = [str(tmp_path / "ckpt") if flag == "CKPT" else flag for flag in flags]
    want = {key: str(tmp_path / "ckpt") if value == "CKPT" else value for key, value in want.items()}
    assert main([command, *flags, "--timeout", "9.5"]) == 0
    assert dataclasses.asdict(got["config"]) == want and got["timeout_s"] == 9.5
    defaults = dataclasses.asdict(type(got["config"])())
    not_flags = {"demo": ["ulysses_degree"], "train": ["resume", "return_parameters"], "generate": []}[command]
    assert [key for key in want if want[key] == defaults[key]] == not_flags, defaults  # --resume: a test of its own


def test_plan_without_sequence_parallelism_says_so_and_counts_all_reduces(capsys) -> None:
    """--no-sequence-parallel, dropped, planned Megatron's sequence parallelism without a word."""
    plan = ["plan", "--model", "llama-3-8b", "--seq", "32768", "--cp", "2", "--tp", "2"]
    assert main(plan) == 0
    with_sp = capsys.readouterr().out
    assert main([*plan, "--no-sequence-parallel"]) == 0
    without = capsys.readouterr().out
    assert "TP=2 (sequence parallel)" in with_sp and "TP=2 (no sequence parallelism)" in without, without


def test_demo_exits_1_when_cp_differs_from_unsplit_attention(monkeypatch, capsys) -> None:
    """Scripts read the status: a MISMATCH once exited 0 (the demo's run is stood in for)."""
    import ctxpar.cli as cli

    monkeypatch.setattr(cli, "format_report", lambda report: "OK" if report["ok"] else "MISMATCH")
    for ok, status in ((True, 0), (False, 1)):
        monkeypatch.setattr(cli, "run_demo", lambda cfg, ok=ok, **kwargs: {"ok": ok})
        assert main(["demo", "--nproc", "1", "--seq", "64"]) == status
        assert capsys.readouterr().out == ("OK\n" if ok else "MISMATCH\n")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_compare_judges_every_row_against_a_reference_drawn_alike(temperature: float, monkeypatch) -> None:
    """``generate --compare``'s verdict, the ranks stood in for by the exact answer: equal at
    temperature 0 and when sampling (a reference drawn greedily once said MISMATCH for a right
    sampled run), and not equal where row 1 alone differs (once only row 0 was compared), which
    the command's exit status says (it once exited 0 after printing MISMATCH)."""
    import dataclasses

    from ctxpar.inference import command
    from ctxpar.inference.generate import reference_generate

    changed = []

    def ranks(fn, nproc, args, **kwargs):
        cfg = args[0]
        model, prompt = command.build(cfg, torch.device("cpu"))
        tokens = reference_generate(model, prompt, new_tokens=cfg.new_tokens, temperature=cfg.temperature,
                                    seed=cfg.seed).tolist()
        if changed:
            tokens[1][-1] += 1
        return dict(tokens=tokens, config=dataclasses.asdict(cfg), ttft_s=0.01, tpot_s=0.002,
                    kv_cache_bytes_per_rank=[0, 0])

    monkeypatch.setattr(command.launch, "run", ranks)
    cfg = command.GenerateConfig(nproc=2, prompt_len=16, new_tokens=4, batch=2, temperature=temperature, seed=3,
                                 compare=True, progress=False)
    argv = ["generate", "--nproc", "2", "--prompt-len", "16", "--new-tokens", "4", "--batch", "2", "--temperature",
            str(temperature), "--seed", "3", "--compare", "--no-progress"]
    assert command.run_generate(cfg)["tokens_match"] is True and main(argv) == 0
    changed.append(True)
    assert command.run_generate(cfg)["tokens_match"] is False and main(argv) == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_report_that_cannot_be_written_once_the_work_is_done_exits_1_in_every_command(monkeypatch, capsys) -> None:
    """A full disk under --json (or --plot) after a complete run is no bad value: it exited with
    status 2, the status of values refused up front, as a stdout that cannot take the report
    exits 1. The runs of demo, train and generate are stood in for: this is the report alone."""
    import ctxpar.cli as cli

    for command, report in (("demo", {"ok": True}), ("train", {"loss": []}), ("generate", {"tokens": []})):
        run = {"demo": "run_demo", "train": "run_train", "generate": "run_generate"}[command]
        monkeypatch.setattr(cli.generation if command == "generate" else cli, run, lambda cfg, **kwargs: report)
    monkeypatch.setattr(cli, "format_report", lambda report: "the report")
    monkeypatch.setattr(cli, "format_train_report", lambda report: "the report")
    monkeypatch.setattr(cli.generation, "format_report", lambda report: "the report")
    wrong = []
    for argv, says in [
        *(((command, "--json", "/dev/full"), "--json '/dev/full' could not be written (No space left on device); the "
           "report above is complete") for command in ("demo", "train", "generate", "plan")),
        (("plan", "--plot", "/dev/full", "--seq", "4096", "--max-cp", "8"),  # once matplotlib's OSError traceback
         "--plot '/dev/full' could not be written (No space left on device); the report above is complete"),
    ]:
        status = main(list(argv))
        err = capsys.readouterr().err
        if status != 1 or err != f"ctxpar {argv[0]}: error: {says}\n":
            wrong.append(f"{' '.join(argv)} -> status {status}: {err.strip()!r}")
    assert not wrong, "\n".join(wrong)


def test_json_dash_writes_the_json_to_stdout_and_the_report_to_stderr(monkeypatch, capsys, tmp_path) -> None:
    """``ctxpar plan --json - | jq``: '-' was written as a file named '-' in the working directory,
    and stdout had the table. Each command's JSON is now stdout's whole content; --plot refuses '-'."""
    import ctxpar.cli as cli

    for command, report in (("demo", {"ok": True}), ("train", {"loss": [5.0]}), ("generate", {"tokens": [1]})):
        run = {"demo": "run_demo", "train": "run_train", "generate": "run_generate"}[command]
        monkeypatch.setattr(cli.generation if command == "generate" else cli, run, lambda cfg, r=report, **kw: r)
    for module, name in ((cli, "format_report"), (cli, "format_train_report"), (cli.generation, "format_report")):
        monkeypatch.setattr(module, name, lambda report: "the report")
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--model", "tiny", "--seq", "4096", "--cp", "2", "--max-cp", "4"]
    assert main([*argv, "--json", "plan.json"]) == 0
    table = capsys.readouterr().out
    for command, expected in (("demo", {"ok": True}), ("train", {"loss": [5.0]}), ("generate", {"tokens": [1]}),
                              ("plan", json.loads((tmp_path / "plan.json").read_text()))):
        assert main([*(argv if command == "plan" else [command]), "--json", "-"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out) == expected, command
        assert err == (table if command == "plan" else "the report\n"), command
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]
    assert main([*argv, "--plot", "-"]) == 2
    assert "--plot '-' would write a file named '-' here; give a file path, e.g. plan.png" in capsys.readouterr().err


def test_an_unknown_train_model_is_refused_by_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", "gpt-5"])
    assert e.value.code == 2 and "argument --model: invalid choice: 'gpt-5'" in capsys.readouterr().err


def test_a_flag_is_taken_by_its_whole_name_only_and_a_misspelt_one_named_with_the_nearest(no_ranks, capsys) -> None:
    """argparse's prefix matching ran --new-token 3 as --new-tokens 3 and --temp as --temperature:
    a flag misspelt into another's prefix would run as that one."""
    for argv, shown in ((["generate", "--new-token", "3"], "--new-token 3 (did you mean --new-tokens?)"),
                        (["generate", "--temp", "0.5"], "--temp 0.5 (did you mean --temperature?)"),
                        (["generate", "--JSON", "x"], "--JSON x (did you mean --json?)"),
                        (["plan", "--mod", "llama-3-8b"], "--mod llama-3-8b (did you mean --model?)"),
                        (["demo", "--nprocs", "2", "--layuot=zigzag"],
                         "--nprocs 2 --layuot=zigzag (did you mean --nproc, --layout?)"),
                        (["train", "--frobnicate", "3"], "--frobnicate 3"),
                        (["--nrpoc", "generate"], "--nrpoc")):  # the command's flags go after its name
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.endswith(f"error: unrecognized arguments: {shown}\n"), err
        who = "ctxpar" if argv[0].startswith("-") else f"ctxpar {argv[0]}"  # the usage of what was misspelt
        assert err.startswith(f"usage: {who} [-h]") and f"\n{who}: error: " in err, err


def test_bad_values_give_no_traceback_from_the_command() -> None:
    for args in (("plan", "--head-dim", "0"), ("demo", "--json", "/")):
        proc = run_cli(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr


def test_a_reader_gone_from_stdout_costs_neither_the_json_nor_a_traceback(tmp_path) -> None:
    """``ctxpar plan --json x.json | head``: the report's print fails with EPIPE. The JSON
    used to be written after it, so the file was lost, behind a BrokenPipeError traceback;
    the command's own exit status stands."""
    out = tmp_path / "plan.json"
    reader, writer = os.pipe()
    os.close(reader)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe's usual block buffering
    proc = subprocess.run([sys.executable, "-m", "ctxpar.cli", "plan", "--json", str(out)], stdout=writer,
                          stderr=subprocess.PIPE, text=True, timeout=300, env=env)
    os.close(writer)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(out.read_text())["recommendation"]


def test_a_calibration_loaders_warning_is_one_note_line(tmp_path, capsys) -> None:
    """An old calibration's warning was a raw UserWarning with the source line that raised it."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(dict(attention_flops=1e11, bandwidth=2e9, attention_size_curve=[[64, 0.5, 0.9],
                                                                                              [4096, 1, 1]])))
    assert main(["plan", "--hardware", "local", "--calibration", str(path), "--model", "tiny", "--seq", "4096",
                 "--cp", "2", "--max-cp", "2"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ctxpar plan: note: {path} was calibrated before 2026-12-01"), err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_stdout_that_cannot_take_the_report_is_said_in_one_line(tmp_path) -> None:
    """``ctxpar plan > file`` on a full disk: once an OSError traceback (status 1). The JSON,
    written first, is named as holding the report."""
    out = tmp_path / "plan.json"
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "ctxpar.cli", "plan", "--json", str(out)], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"ctxpar plan: error: the report could not be written to stdout (No "
                                                f"space left on device); --json {str(out)!r} holds it"], proc.stderr
    assert json.loads(out.read_text())["recommendation"]
    with open("/dev/full", "w") as full:  # both full: once only stdout was named
        proc = subprocess.run([sys.executable, "-m", "ctxpar.cli", "plan", "--json", "/dev/full"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.stderr.strip().splitlines() == ["ctxpar plan: error: the report could not be written to stdout (No "
                                                "space left on device); nor could --json '/dev/full' (No space left on "
                                                "device)"], proc.stderr
    # started with stdout closed (1>&-): print dropped the report, exit status 0, not a word
    proc = subprocess.run([sys.executable, "-m", "ctxpar.cli", "plan", "--json", str(out)], stderr=subprocess.PIPE,
                          text=True, timeout=300, preexec_fn=lambda: os.close(1))
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (1, [
        f"ctxpar plan: error: the report could not be written to stdout (it is closed); --json {str(out)!r} holds "
        f"it"]), proc.stderr


def test_a_report_reaches_a_stdout_whose_encoding_lacks_its_characters(tmp_path) -> None:
    """An ASCII stdout (a C locale, PYTHONIOENCODING=ascii): plan's report uses '·' and '≤',
    and the encoding error was taken for a bad value: nothing printed, exit status 2 naming
    no flag, --plot never written. Characters the encoding lacks now print as '?'."""
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "ctxpar.cli", "plan", "--model", "tiny", "--seq", "1024", "--cp", "2",
                           "--json", str(out)], capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0, proc.stderr.decode()
    report = proc.stdout.decode("ascii")
    assert "recommendation" in report.lower() and "?" in report
    assert json.loads(out.read_text())["recommendation"]


def test_probing_an_output_path_removes_only_what_it_created(tmp_path, monkeypatch) -> None:
    """Every torchrun rank probes --json before starting. Each used to create the file, or
    open another rank's, and remove it, so a rank could remove the file another was probing
    (a crash) or leave one behind. A probe now creates the file exclusively and removes
    only its own; one that finds it being created leaves it alone. A name too long for the
    file system and a link to a missing directory are still refused up front."""
    import ctxpar.cli as cli

    target = tmp_path / "out.json"
    real_open = os.open

    def another_rank_first(path, flags, *mode):
        real_open(path, flags, *mode)  # the other rank's probe, between our check and our create
        return real_open(path, flags, *mode)

    monkeypatch.setattr(os, "open", another_rank_first)
    cli.check_output("--json", str(target))
    assert target.exists()  # the other rank's probe file: that rank removes it, not this one
    monkeypatch.undo()
    target.unlink()
    cli.check_output("--json", str(target))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "link.json").symlink_to(tmp_path / "missing" / "out.json")
    for bad in (tmp_path / ("x" * 300 + ".json"), tmp_path / "link.json"):
        with pytest.raises(ValueError, match="is not writable"):
            cli.check_output("--json", str(bad))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_describes_every_flag_and_states_only_real_defaults(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "default: 0 for presets" not in text  # the H200 preset has a measured launch overhead
    sub = argparse.ArgumentParser().add_subparsers()
    COMMANDS[command][0](sub)
    undescribed = [a.option_strings for a in sub.choices[command]._actions if not a.help]
    assert not undescribed


def test_version_names_ctxpar_and_torch(capsys) -> None:
    """It answered "the following arguments are required: command"."""
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ctxpar {ctxpar.__version__} (torch {torch.__version__})"


@pytest.mark.parametrize("command", ["demo", "train"])
def test_timeout_reaches_the_ranks_and_no_deadline_is_set(command: str, monkeypatch) -> None:
    seen = {}

    def record(fn, nproc, args=(), **kwargs):
        seen.update(kwargs, nproc=nproc)
        raise KeyboardInterrupt  # stands for the run: the command stops as on Ctrl-C

    monkeypatch.setattr(launch, "run_local", record)
    assert main([command, "--nproc", "2", "--seq", "64", "--timeout", "7.5"]) == 130
    assert seen == {"nproc": 2, "timeout_s": 7.5, "deadline_s": None, "device_type": "cpu"}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_stderr_closed_or_full_costs_the_run_nothing(tmp_path) -> None:
    """``ctxpar train ... 2>&-``: a rank's progress check (``sys.stderr.isatty()``, stderr None)
    ended the run at its first step; ``2>/dev/full`` (a log on a full disk): the launch line's
    OSError ended it before any rank started, saying nothing. Notes are dropped, not fatal."""
    for name, stderr in (("closed", None), ("full", "/dev/full")):
        directory, report = tmp_path / name, tmp_path / f"{name}.json"
        argv = [sys.executable, "-m", "ctxpar.cli", "train", "--nproc", "1", "--seq", "64", "--steps", "2",
                "--checkpoint-dir", str(directory), "--json", str(report)]
        with open(stderr or os.devnull, "w") as err:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, timeout=300,
                                  preexec_fn=(lambda: os.close(2)) if stderr is None else None)
        assert proc.returncode == 0, (name, proc.stdout)
        assert "step-000002" in os.listdir(directory) and json.loads(report.read_text())["loss"], name


RANK_SERVER_STARTS = [
    (("plan", "--head-dim", "0"), None),
    (("plan", "--calibrate", "--head-dim", "0"), ()),
    (("demo", "--nproc", "0"), ()),
    (("generate", "--nproc", "0"), ()),
    (("train", "--steps", "0"), RANK_IMPORTS["train"]),
    (("--help",), None),
]


@pytest.mark.parametrize("argv, imports", RANK_SERVER_STARTS, ids=[" ".join(argv) for argv, _ in RANK_SERVER_STARTS])
def test_a_command_starts_a_rank_server_only_where_it_runs_local_ranks(argv, imports, monkeypatch, capsys) -> None:
    """ctxpar plan forked a server (and the server imported what ranks import: 1.3 s of CPU) that
    only --calibrate uses; the command that runs ranks starts it with what they import."""
    started = []
    monkeypatch.setattr(rank_server, "start_here", lambda preload=(): started.append(preload))
    monkeypatch.setattr(sys, "argv", ["ctxpar", *argv])
    with pytest.raises(SystemExit):
        entry()
    assert started == ([] if imports is None else [imports])
