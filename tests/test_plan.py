"""The planner: its figures against hand-computed references, and ``ctxpar plan`` end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ctxpar.masks import Mask
from ctxpar.models.config import ModelConfig
from ctxpar.plan import cost, get_hardware, make_plan, parse_bandwidth, parse_flops, resolve_model
from ctxpar.cli import main
from ctxpar import calibrate
from ctxpar.calibrate import measure_link, measure_memory_bandwidth
from ctxpar.plan import traffic
from ctxpar.plan.cost import Pipeline
from ctxpar.plan.documents import pack, parse_doc_dist, parse_lengths, sample_lengths
from ctxpar.plan.hardware import local_hardware
from ctxpar.plan.memory import memory_per_gpu, saved_tensors_per_token, sequence_tensors
from ctxpar.plan.recommend import crossover, fits_up_to, recommend
from ctxpar.plan.units import format_bytes, format_seconds
from ctxpar.plan.work import pairs_per_rank, union_pairs
from ctxpar.plan.workload import Workload

MiB, GiB = 2**20, 2**30
WORKED = ["--seq", "32768", "--cp", "4", "--hidden", "4096", "--kv-heads", "8", "--head-dim", "128", "--layers", "32",
          "--batch", "1", "--dtype", "bfloat16", "--bandwidth", "100GB/s"]


def worked(**changes) -> Workload:
    """The worked example of the issue and docs/planner.md: Llama-3-8B's attention shape."""
    model = resolve_model(hidden=4096, kv_heads=8, head_dim=128, layers=32)
    return Workload(model, batch=1, seq=32768, dtype="bfloat16", cp=4).with_(**changes)


def attention_only(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    """A one-layer model: only the attention shape matters to traffic and attention time."""
    return resolve_model(layers=1, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads, head_dim=head_dim)


# -- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("100GB/s", 100e9), ("400Gb/s", 50e9), ("25GiB/s", 25 * 2**30), ("1.5e11", 1.5e11), ("3.2 Tb/s", 400e9),
])
def test_bandwidth_units(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == expected


def test_bad_units_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"'100G' has no unit; write 100GB/s \(bytes\) or 100Gb/s \(bits\)"):
        parse_bandwidth("100G")
    with pytest.raises(ValueError, match="'fast' is not understood"):
        parse_flops("fast")
    assert parse_flops("989T") == parse_flops("989TFLOPS") == 989e12 and parse_flops("2.25P") == 2.25e15


def test_formatting() -> None:
    assert (format_bytes(256 * MiB), format_bytes(8 * GiB), format_bytes(36.09375 * MiB)) == \
        ("256 MiB", "8 GiB", "36.094 MiB")
    assert format_seconds(96 * MiB / 100e9) == "1.007 ms" and format_seconds(0) == "0 s"


# -- the worked example ------------------------------------------------------------------------


def test_worked_example_sizes_and_ring_transfer() -> None:
    w = worked()
    t = sequence_tensors(w)
    assert (t.hidden_state.total, t.hidden_state.per_gpu) == (256 * MiB, 64 * MiB)
    assert (t.hidden_states_all_layers.total, t.hidden_states_all_layers.per_gpu) == (8 * GiB, 2 * GiB)
    assert (t.kv_one_layer.total, t.kv_one_layer.per_gpu) == (128 * MiB, 32 * MiB)
    assert cost.layer_traffic(w).forward == 96 * MiB  # (P-1) shards of 32 MiB
    assert cost.layer_traffic(w).forward / parse_bandwidth("100GB/s") == pytest.approx(1.00663296e-3, rel=1e-12)


def test_traffic_matches_the_strategies_doc_table() -> None:
    """docs/strategies.md: T=16384, H=8, D=64, P=4, fp32, forward + backward per rank."""
    for kv_heads, expected in ((2, {"ring": 36, "allgather": 36, "alltoall": 36.09375, "hybrid": 32.0625}),
                               (8, {"ring": 144, "allgather": 144, "alltoall": 48.09375, "hybrid": 80.0625})):
        for strategy, mib in expected.items():
            w = Workload(attention_only(8, kv_heads, 64), batch=1, seq=16384, dtype="float32", cp=4,
                         strategy=strategy, ulysses=2 if strategy == "hybrid" else None)
            assert cost.layer_traffic(w).total == mib * MiB, (strategy, kv_heads)


# -- work and time -----------------------------------------------------------------------------


def test_flops_follow_the_flashattention_convention() -> None:
    w = Workload(attention_only(8, 2, 64), batch=2, seq=1024, dtype="bfloat16", cp=1, causal=False)
    assert cost.attention_forward_flops(w) == 4 * 2 * 1024**2 * 8 * 64
    causal = cost.attention_forward_flops(w.with_(causal=True))
    assert causal == 4 * 2 * (1024 * 1025 // 2) * 8 * 64  # halved, counting the diagonal exactly


def test_load_balance_from_exact_pair_counts() -> None:
    w = Workload(attention_only(8, 2, 64), batch=1, seq=4096, dtype="float32", cp=4)
    assert cost.load_balance(w) == 1.0  # zigzag: every rank holds the same pairs
    s = 1024  # contiguous: the last rank's queries see 3*S + its own triangle
    assert cost.load_balance(w.with_(layout="contiguous")) == (3 * s * s + s * (s + 1) // 2) * 4 / (4096 * 4097 // 2)
    assert cost.load_balance(w.with_(layout="contiguous", strategy="alltoall")) == 1.0  # heads split, not tokens


def test_pipeline_hides_transfers_only_when_compute_covers_them() -> None:
    assert Pipeline(4, compute=1.0, transfer=0.5).seconds == 4.0
    slow = Pipeline(4, compute=1.0, transfer=2.0)
    assert (slow.seconds, slow.exposed, slow.hidden) == (7.0, 3.0, False)
    assert Pipeline(1, compute=1.0, transfer=0.0, lead=0.25).hidden is False  # all-to-all: nothing overlaps


@pytest.mark.parametrize("kv_heads, causal, factor", [(32, False, 1.0), (32, True, 2.0), (8, True, 0.5)])
def test_overlap_condition_is_the_ring_attention_papers(kv_heads: int, causal: bool, factor: float) -> None:
    """Liu et al.: block size >= F/B for MHA, bf16, non-causal; causal halves per-step work,
    GQA shrinks the K/V message by H_kv/H."""
    hw = get_hardware("H100-SXM")
    w = Workload(attention_only(32, kv_heads, 128), batch=1, seq=65536, dtype="bfloat16", cp=4, causal=causal)
    fwd = cost.attention_time(w, hw).forward
    assert cost.overlap_local_len(w, fwd) == pytest.approx(factor * hw.flops / hw.bandwidth(4), rel=1e-3)


def test_efficiency_is_one_with_free_communication_and_balance() -> None:
    hw = get_hardware("H100-SXM", bandwidth=1e30)
    assert cost.efficiency(worked(), hw) == pytest.approx(1.0, abs=1e-9)
    assert cost.efficiency(worked(layout="contiguous"), hw) < 0.95


# -- masks: windows and documents --------------------------------------------------------------


def masked(seq: int, cp: int, **changes) -> Workload:
    """A small MHA-divisible shape (H = 12 splits over 2, 3, 4 ranks) for brute-force checks."""
    return Workload(attention_only(12, 2, 8), batch=1, seq=seq, dtype="float32", cp=cp).with_(**changes)


def brute_force_pairs(w: Workload, mask: Mask) -> list[int]:
    """Per rank, the visible (query, key) pairs x heads of its (all-to-all: its group's) queries, by Mask.visible."""
    layout, u = w.layout_obj, w.ulysses_degree
    keys = torch.arange(w.seq)
    own = [int(mask.visible(layout.positions(w.seq, r), keys, w.seq).sum()) for r in range(w.cp)]
    return [sum(own[r - r % u:r - r % u + u]) * (w.model.heads // u) for r in range(w.cp)]


def test_documents_are_packed_by_repeating_and_cutting() -> None:
    assert pack((5, 17, 3), 48) == (5, 17, 3, 5, 17, 1) and pack((5, 17, 3), 20) == (5, 15)
    assert pack((100,), 48) == (48,) and pack((16,), 48) == (16, 16, 16)
    drawn = sample_lengths(parse_doc_dist("lognormal:2048,1.5"), 2**22, seed=3)
    assert sum(drawn) == 2**22 and drawn == sample_lengths(parse_doc_dist("lognormal:2048,1.5"), 2**22, seed=3)
    assert sum(drawn[:-1]) / len(drawn[:-1]) == pytest.approx(2048, rel=0.1)  # E[X] = MEAN
    assert max(drawn) > 20 * 2048  # the long tail users have
    assert sample_lengths(parse_doc_dist("fixed:512"), 2**20) == (512,)


@pytest.mark.parametrize("cp, layout", [(2, "contiguous"), (3, "zigzag"), (4, "striped"), (4, "zigzag")])
@pytest.mark.parametrize("strategy", ["ring", "alltoall"])
def test_pairs_under_masks_equal_brute_force(cp: int, layout: str, strategy: str) -> None:
    seq = 48
    row = pack((5, 17, 3), seq)
    cases = [  # (workload fields, the mask they mean over the row)
        (dict(window=7), Mask(window=7)),
        (dict(window=1), Mask(window=1)),
        (dict(window=seq), Mask()),  # sees every earlier key: plain causal
        (dict(documents=(5, 17, 3)), Mask(documents=row)),
        (dict(documents=(5, 17, 3), window=4), Mask(documents=row, window=4)),
        (dict(documents=(5, 17, 3), causal=False), Mask(causal=False, documents=row)),
    ]
    for fields, mask in cases:
        w = masked(seq, cp, layout=layout, strategy=strategy, **fields)
        assert w.mask == mask
        assert list(cost.head_pairs(w)) == brute_force_pairs(w, mask), fields
        u = w.ulysses_degree  # every rank at once, as union_pairs one rank at a time
        assert pairs_per_rank(w.layout_obj, seq, mask, u) == \
            tuple(union_pairs(w.layout_obj, seq, r, mask, u) for r in range(cp))
        assert cost.attention_forward_flops_per_rank(w) == tuple(4 * w.model.head_dim * p for p in cost.head_pairs(w))


def test_window_work_is_about_w_over_t_of_full_attention() -> None:
    seq, window = 2**16, 1024
    for layout in ("contiguous", "zigzag", "striped"):
        w = masked(seq, 8, layout=layout, window=window)
        total = sum(cost.head_pairs(w)) // w.model.heads
        assert total == seq * window - window * (window - 1) // 2  # each query sees w keys, the first w-1 fewer
        full = sum(cost.head_pairs(w.with_(window=None))) // w.model.heads
        assert total / full == pytest.approx(2 * window / seq, rel=0.01)  # causal full attention: T²/2 pairs
        assert total / seq**2 == pytest.approx(window / seq, rel=0.01)
    balance = {layout: cost.load_balance(masked(seq, 8, layout=layout, window=window))
               for layout in ("contiguous", "zigzag")}
    assert balance["contiguous"] == pytest.approx(1.0, abs=0.01)  # every rank but the first sees w keys a query
    assert balance["zigzag"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("window", [1, 100, 2048, 5000, 3 * 2048 + 1])
def test_contiguous_window_traffic_is_the_rings_halo(window: int) -> None:
    w = masked(8192, 4, layout="contiguous", window=window)
    m = w.model
    halo = [traffic.ring_window(batch=1, local_len=2048, kv_heads=m.kv_heads, head_dim=m.head_dim, world=4,
                                window=window, rank=r, elem=4, acc=4) for r in range(4)]
    assert cost.ring_window_per_rank(w) == halo
    tr = cost.layer_traffic(w)
    assert tr.forward == max(max(s.forward, r.forward) for s, r in halo)
    assert tr.backward == max(max(s.backward, r.backward) for s, r in halo)
    assert cost.traffic_bound(w) is None
    kv = 2 * m.kv_heads * m.head_dim
    if window <= 2049:  # the halo, one hop: w-1 keys' K/V, and once more with its accumulator backward
        assert (tr.forward, tr.backward) == ((window - 1) * kv * 4, (window - 1) * kv * 8)
    steps = traffic.window_steps(local_len=2048, world=4, window=window)
    assert cost.attention_time(w, get_hardware("H100-SXM")).forward.stages == steps + 1
    assert tr.total <= cost.layer_traffic(w.with_(window=None)).total


def test_traffic_elsewhere_is_the_plain_bound_and_says_so() -> None:
    plain = masked(8192, 4)
    for changes in (dict(window=100), dict(documents=(1000, 3000)), dict(layout="striped", window=100)):
        w = plain.with_(**changes)
        assert cost.layer_traffic(w) == cost.layer_traffic(plain)
        assert cost.traffic_bound(w).startswith("upper bound: the plain ring's")
    both = plain.with_(layout="contiguous", window=100, documents=(1000, 3000))
    assert cost.layer_traffic(both) == cost.layer_traffic(both.with_(documents=None))
    assert cost.traffic_bound(both).startswith("upper bound: the window's halo")
    for strategy in ("allgather", "alltoall"):  # they move every shard (or head) whatever the mask
        w = plain.with_(strategy=strategy, layout="contiguous", window=100, documents=(1000, 3000))
        assert cost.layer_traffic(w) == cost.layer_traffic(w.with_(window=None, documents=None))
        assert cost.traffic_bound(w) is None


def test_mask_values_are_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--window must be between 1 and"):
        masked(64, 2, window=0)
    with pytest.raises(ValueError, match="--window 8 is a causal sliding window; drop --no-causal or --window"):
        masked(64, 2, window=8, causal=False)
    with pytest.raises(ValueError, match="--documents must be a non-empty tuple"):
        masked(64, 2, documents=(8, 0))
    with pytest.raises(ValueError, match="--documents must be a non-empty tuple"):
        masked(64, 2, documents=[8, 8])
    with pytest.raises(ValueError, match=r"--documents '8,x' must be comma-separated document lengths"):
        parse_lengths("8,x")
    for text, message in (("zipf:1.1", "unknown distribution 'zipf'"), ("fixed:0", "fixed takes one length"),
                          ("lognormal:2048", "lognormal takes MEAN,SIGMA"), ("lognormal:0.5,1", "MEAN 0.5 must be"),
                          ("lognormal:100,nan", "SIGMA nan must be between 0 and 5")):
        with pytest.raises(ValueError, match=message):
            parse_doc_dist(text)


# -- memory ------------------------------------------------------------------------------------


def test_memory_categories() -> None:
    w = worked()
    mem = memory_per_gpu(w, 80 * 10**9)
    n = w.model.parameters
    assert (mem.parameters, mem.gradients, mem.optimizer_states) == (2 * n, 2 * n, 12 * n)  # ZeRO's 16 bytes/param
    assert memory_per_gpu(w.with_(dtype="float32"), 1).optimizer_states == 8 * n  # no master copy
    sharded = memory_per_gpu(w.with_(fsdp=8), 1)
    assert sharded.optimizer_states == -(-12 * n // 8) and sharded.fsdp_buffers > 0
    m = w.model  # a Llama block's saved tensors, per token and layer
    per_token = (4 * m.hidden + (2 * m.heads + 2 * m.kv_heads) * m.head_dim + 4 * m.ffn) * 2 + m.heads * 4
    assert sum(saved_tensors_per_token(w).values()) == per_token
    assert mem.activations == 32 * 8192 * per_token
    assert mem.activations_checkpointed == 32 * 8192 * 4096 * 2 + 8192 * per_token
    assert memory_per_gpu(w.with_(cp=8), 1).activations == mem.activations // 2
    assert not mem.fits and mem.total == sum(v for k, v in mem.categories().items() if k != "activations_checkpointed")


def test_fits_up_to_is_the_longest_fitting_length() -> None:
    hw = get_hardware("H100-SXM")
    w = worked(fsdp=8, checkpointing="full")
    limit = fits_up_to(w, hw)
    step = w.layout_obj.multiple
    assert memory_per_gpu(w.with_(seq=limit), hw.hbm_bytes).fits
    assert not memory_per_gpu(w.with_(seq=limit + step), hw.hbm_bytes).fits


# -- the answer --------------------------------------------------------------------------------


def test_crossover_is_where_cp_starts_to_win() -> None:
    hw = get_hardware("H100-SXM", bandwidth=parse_bandwidth("1GB/s"))  # slow links: CP loses on short sequences
    w = Workload(resolve_model("small"), batch=1, seq=2**16, dtype="bfloat16", cp=4)
    c = crossover(w, hw, [2**k for k in range(10, 21)])
    assert 2**10 < c.faster_from < 2**20

    def faster(seq: int) -> bool:
        v = w.with_(seq=seq)
        return cost.step_time(v, hw).seconds < cost.step_time(v.with_(cp=1), hw).seconds

    assert faster(c.faster_from) and not faster(c.faster_from - w.layout_obj.multiple)


def test_recommendation_picks_the_smallest_fitting_degree() -> None:
    hw = get_hardware("H100-SXM")
    rec = recommend(worked(fsdp=8), hw, [1, 2, 4, 8])
    assert (rec.workload.cp, rec.workload.layout) == (4, "zigzag")
    assert rec.reasons[0].startswith("CP-1 needs") and rec.reasons[2].startswith("CP-4 fits")
    assert any("load-balance factor" in r and "contiguous 1.7500" in r for r in rec.reasons)
    short = recommend(worked(fsdp=64, seq=4096), hw, [1, 2, 4])
    assert short.workload.cp == 1 and "data parallelism" in short.reasons[-1]
    none = recommend(worked(), hw, [1, 2, 4])
    assert none.workload is None and none.reasons[-1].endswith("with --fsdp 8, CP-4 fits (64.036 GiB)")


def test_make_plan_sweeps_every_valid_combination() -> None:
    plan = make_plan(worked(), get_hardware("H100-SXM"), max_cp=8)
    combos = {(p.cp, p.strategy) for p in plan.sweep}
    assert combos == {(1, "ring"), *((p, s) for p in (2, 4, 8) for s in ("ring", "allgather", "alltoall")),
                      (4, "hybrid"), (8, "hybrid")}  # hybrid needs a ring degree > 1
    assert plan.efficiency == pytest.approx(plan.cp1_step.seconds / (4 * plan.step.seconds))


# -- hardware and calibration -------------------------------------------------------------------


def test_hardware_errors_and_overrides() -> None:
    with pytest.raises(ValueError, match="unknown hardware 'TPU'; choose one of H100-SXM, H200, A100-80GB, B200, lo"):
        get_hardware("TPU")
    with pytest.raises(ValueError, match="--hardware local needs measured figures: add --calibrate"):
        get_hardware("local")
    hw = get_hardware("h200", bandwidth=1e11, efficiency=0.4)
    assert (hw.bandwidth(4), hw.bandwidth(64), hw.flops) == (1e11, 1e11, 989e12 * 0.4)
    assert get_hardware("H200").bandwidth(16) == 50e9  # beyond one node: the NIC


def test_local_hardware_from_a_calibration_file(tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"calibration": {"attention_flops": 1e11, "bandwidth": 2e9, "machine": "test"}}))
    hw = local_hardware(calibrate.plan_calibration("local", measure=False, path=str(path)))
    assert (hw.flops, hw.bandwidth(2)) == (1e11, 2e9)
    with pytest.raises(ValueError, match="use them with --hardware local"):
        calibrate.plan_calibration("H100-SXM", measure=False, path=str(path))


def test_gloo_link_and_memory_are_measured() -> None:
    link = measure_link(message_bytes=MiB, repeats=2)
    assert 0 < link["latency"] < link["seconds"]
    assert link["bandwidth"] == pytest.approx(MiB / (link["seconds"] - link["latency"])) and link["bandwidth"] > 1e6
    assert measure_memory_bandwidth(nbytes=16 * MiB, repeats=1) > 1e8


# -- the command -------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ctxpar.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_prints_the_worked_example() -> None:
    proc = run_cli(*WORKED)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def row(start: str) -> list[str]:
        return next(line for line in lines if line.strip().startswith(start)).split()

    assert row("one hidden-state tensor")[-4:] == ["256", "MiB", "64", "MiB"]
    assert row("one per layer, 32 layers")[-4:] == ["8", "GiB", "2", "GiB"]
    assert row("K/V for one layer")[-4:] == ["128", "MiB", "32", "MiB"]
    assert row("forward   (P-1)")[-4:] == ["96", "MiB", "1.007", "ms"]
    assert "GB/s = 1e9 B/s" in proc.stdout and "at 100 GB/s" in proc.stdout


def test_cli_json_carries_exact_bytes_and_seconds_and_plots(tmp_path) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    proc = run_cli(*WORKED, "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    tensors = report["sequence_tensors"]
    assert tensors["hidden_state"] == {"total_bytes": 268435456, "per_gpu_bytes": 67108864}
    assert tensors["hidden_states_all_layers"] == {"total_bytes": 8589934592, "per_gpu_bytes": 2147483648}
    assert tensors["kv_one_layer"] == {"total_bytes": 134217728, "per_gpu_bytes": 33554432}
    traffic = report["traffic_per_layer"]
    assert (traffic["forward_bytes"], traffic["link_bandwidth"]) == (100663296, 1e11)
    assert traffic["forward_transfer_seconds"] == 100663296 / 1e11
    assert report["memory_per_gpu"]["total_bytes"] > report["memory_per_gpu"]["hbm_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plans_windows_and_document_distributions(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", *WORKED, "--layout", "contiguous", "--window", "4096", "--max-cp", "4"]
    assert main([*args, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "contiguous layout, causal, window 4096, FSDP=1" in table
    assert "(ring; halo of w-1 = 4095 keys, busiest rank)" in table
    report = json.loads(out.read_text())
    assert report["inputs"]["window"] == 4096 and report["mask"]["halo_tokens"] == 4095
    assert report["mask"]["traffic"] == "exact"
    assert report["traffic_per_layer"]["forward_bytes"] == 4095 * 2 * 8 * 128 * 2  # the halo's K/V, one hop
    assert [r["received_forward_bytes"] for r in report["mask"]["halo_per_rank"]] == [0] + [4095 * 4096] * 3

    assert main([*args, "--doc-dist", "lognormal:2048,1.5", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "documents lognormal:2048,1.5 seed 0 (" in table and "upper bound: the window's halo" in table
    first = json.loads(out.read_text())
    lengths = first["inputs"]["documents"]["lengths"]
    assert sum(lengths) == 32768 and first["mask"]["documents_in_row"]["count"] == len(lengths)
    assert first["inputs"]["documents_from"] == "lognormal:2048,1.5 seed 0"
    assert main([*args, "--doc-dist", "lognormal:2048,1.5", "--json", str(out)]) == 0  # reproducible
    assert json.loads(out.read_text())["work"] == first["work"]
    assert main([*args, "--doc-dist", "lognormal:2048,1.5", "--doc-seed", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["work"] != first["work"]
    capsys.readouterr()


def test_cli_errors_name_the_flag(capsys) -> None:
    assert main(["plan", "--calibrate"]) == 2
    assert "ctxpar plan: error: --calibrate and --calibration describe this machine; use them with --hardware local, " \
        "not 'H100-SXM'" in capsys.readouterr().err
    assert main(["plan", "--bandwidth", "100G"]) == 2
    assert "'100G' has no unit" in capsys.readouterr().err
    assert main(["plan", "--seq", "1004", "--cp", "4"]) == 2
    assert "sequence length 1004 is not a multiple of 2*P=8" in capsys.readouterr().err
