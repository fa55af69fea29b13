"""The planner's predictions against ``ctxpar demo`` runs on this machine: bytes and seconds per rank.

    python benchmarks/plan_vs_measured.py       # P in {2,4}, T in {4096,8192,16384}, ring, allgather, alltoall
    python benchmarks/plan_vs_measured.py --json plan_vs_measured.json

First calibrates the ``local`` hardware preset (``ctxpar.calibrate``: one-thread
attention kernel FLOP/s, gloo bandwidth), then for every case runs the demo (P local gloo
ranks, one thread each; H=8, H_kv=2, D=64, float32, causal, zigzag) and compares per rank:

- bytes sent: ``ctxpar.plan.cost.layer_traffic`` (one layer), which must equal the
  counted bytes exactly;
- attention CPU seconds (the demo's ``attn_seconds``: CPU time of the computing thread in
  kernels and merges, forward + backward, not of gloo's threads moving data meanwhile):
  4·B·D·(pairs·heads of the rank) FLOPs forward and 2.5x backward at the calibrated
  forward and backward rates, each tile of the rank's block plan at the size curve's rate
  for its keys, plus what each tile costs beyond its kernel (``cost.compute_seconds``;
  the rank's work alone against the same prediction: ``rank_work.py``). CPU time does not
  grow when ranks time-share cores, so no oversubscription term;
- wall seconds of the forward + backward: the planner's pipeline
  (``cost.attention_time``) with each rank's FLOP/s scaled by cores / P when P ranks
  share fewer cores (time-sharing), at the calibrated bandwidth.

Measured seconds are each rank's best of ``--repeat`` warm runs of the demo's code, the
strategies of one (P, T) interleaved in one group of ranks with the order rotated each
round (see ``measure``; this machine's speed drifts, and 4 ranks time-sharing 2 cores
make single runs noisy). Error = predicted / measured - 1, of the mean over ranks.
``strategy="auto"`` is judged against the other strategies both by best rounds and round
by round (``auto_verdicts``); give time-shared cases ten or more rounds.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch

from ctxpar import auto
from ctxpar.demo import DemoConfig, demo_rank
from ctxpar.launch import run_local
from ctxpar.masks import Mask
from ctxpar.models.config import attention_only
from ctxpar.plan import cost
from ctxpar.calibrate import calibrate, format_calibration
from ctxpar.plan.hardware import local_hardware
from ctxpar.plan.workload import Workload
from ctxpar.strategy_rules import STRATEGY_NAMES
import flags
from report import write_json


def predict(cfg: DemoConfig, calibration: dict) -> dict:
    """The planner's figures for one demo configuration (one attention layer)."""
    model = attention_only(cfg.heads, cfg.kv_heads, cfg.head_dim)
    w = Workload(model, batch=cfg.batch, seq=cfg.seq, dtype=cfg.dtype, cp=cfg.nproc, strategy=cfg.strategy,
                 layout=cfg.layout, causal=cfg.causal, ulysses=cfg.ulysses_degree)
    hw = local_hardware(calibration)
    share = min(1.0, (os.cpu_count() or 1) / cfg.nproc)  # of a core, per rank
    shared = hw.with_compute_share(share)
    return dict(bytes_sent=cost.layer_traffic(w).total,
                attn_seconds=[sum(cost.compute_seconds(w, hw, rank)) for rank in range(cfg.nproc)],
                wall_seconds=cost.attention_time(w, shared).seconds)


def repeated_demo(rank: int, world: int, cfgs: list[DemoConfig], runs: int) -> list[list[dict]] | None:
    """``demo_rank`` for every configuration, ``runs`` rounds in the same processes, the order
    rotated from round to round so that this machine's drift hits every configuration alike:
    rank 0's reports per configuration, None elsewhere."""
    threads = torch.get_num_threads()
    reports: list[list[dict]] = [[] for _ in cfgs]
    for i in range(runs):
        for j in range(len(cfgs)):
            k = (i + j) % len(cfgs)
            torch.set_num_threads(threads)  # rank 0's check of the previous run took every core
            reports[k].append(demo_rank(rank, world, cfgs[k]))
    return reports if rank == 0 else None


def measure(cfgs: list[DemoConfig], repeat: int) -> list[list[dict]]:
    """Per configuration (one P, any strategies), per rank: bytes, the best attention and
    wall seconds of ``repeat`` warm demo runs, and the wall seconds of each.

    The demo's own code (``run_demo`` runs ``demo_rank`` once on fresh local ranks), run
    1 + ``repeat`` rounds in one group of ranks, the configurations interleaved: the first
    round pays one-time costs (fresh memory, first full-size messages) that the planner
    does not model, so it is dropped.
    """
    for cfg in cfgs:
        cfg.validate(cfg.nproc, seq_flag="--seqs")
    measured = []
    for cfg, reports in zip(cfgs, run_local(repeated_demo, cfgs[0].nproc, (cfgs, repeat + 1))[0]):
        if not all(report["ok"] for report in reports):
            raise RuntimeError(f"the demo's result does not match unsplit attention for {cfg}")
        runs = [report["ranks"] for report in reports[1:]]
        measured.append([dict(runs[0][r], **{key: min(run[r][key] for run in runs)
                                            for key in ("attn_seconds", "wall_seconds")},
                              wall_seconds_rounds=[run[r]["wall_seconds"] for run in runs])
                         for r in range(cfg.nproc)])
    return measured


def compare(cfg: DemoConfig, calibration: dict, ranks: list[dict]) -> dict:
    """The planner's figures for ``cfg`` against its measured ``ranks`` (``measure``)."""
    want = predict(cfg, calibration)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    measured_attn = mean([r["attn_seconds"] for r in ranks])
    measured_wall = mean([r["wall_seconds"] for r in ranks])
    return dict(
        nproc=cfg.nproc, seq=cfg.seq, strategy=cfg.strategy, load_average=os.getloadavg()[0],
        bytes_predicted=want["bytes_sent"], bytes_measured=[r["bytes_sent"] for r in ranks],
        bytes_match=all(r["bytes_sent"] == r["bytes_received"] == want["bytes_sent"] for r in ranks),
        attn_seconds_predicted=mean(want["attn_seconds"]), attn_seconds_measured=measured_attn,
        attn_error=mean(want["attn_seconds"]) / measured_attn - 1,
        attn_seconds_per_rank=[r["attn_seconds"] for r in ranks],
        wall_seconds_predicted=want["wall_seconds"], wall_seconds_measured=measured_wall,
        wall_error=want["wall_seconds"] / measured_wall - 1,
        wall_seconds_rounds=[mean(walls) for walls in zip(*(r["wall_seconds_rounds"] for r in ranks))],
    )


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): a distribution-free interval for the median of ``values``,
    their k-th least and k-th greatest, k the largest with P(Binomial(n, 1/2) < k) at most
    (1 - ``confidence``) / 2, and the coverage it has (at least ``confidence``); with too
    few values for any k, their range and its coverage. It takes the values for
    independent draws: rounds run side by side, drift between them shared."""
    if not values or not 0 < confidence < 1:
        raise ValueError(f"an interval needs values and a confidence between 0 and 1; got {len(values)} values, "
                         f"confidence {confidence!r}")
    n, ordered = len(values), sorted(values)
    tail = lambda k: sum(math.comb(n, i) for i in range(k)) / 2**n  # noqa: E731  P(fewer than k below the median)
    k = max((k for k in range(1, n // 2 + 1) if tail(k) <= (1 - confidence) / 2), default=1)
    return ordered[k - 1], ordered[n - k], 1 - 2 * tail(k)


def auto_verdicts(rows: list[dict], calibration: dict) -> list[dict]:
    """For each (P, T) measured with more than one strategy: ``strategy="auto"``'s choice on
    this machine's calibration (each rank's rate scaled by its share of the cores, as the
    wall-time predictions are), the measured fastest, and auto's measured time over it
    two ways:

    - best over best (``auto_over_fastest``);
    - same-round (``auto_over_others_per_round``): against each other strategy, the median
      over rounds of auto's time over that strategy's in the same round (run side by side,
      so drift between rounds cancels), and the largest of these: how far auto is from
      the strategy it loses most to. Where ranks time-share cores, a strategy's best
      round is one lucky schedule (at P=4 T=1024 the ring's and the all-to-all's best
      of 20 rounds were 8% apart while their medians were 1% apart), so this is the
      verdict there; ``fastest_by_median`` names the strategy with the least median round.

    With each same-round median its interval (``median_interval``), 95% for all the other
    strategies at once (each at 1 - 0.05/m against m others; ``intervals_coverage``, at
    least, for all of them), in ``auto_over_each_other_per_round``: ``slower_shown`` where
    some interval lies wholly
    above 1.05, the rounds showing auto more than 5% slower than that strategy; where
    none does, they do not, however far a median is (four ranks on two cores at T=1024
    spread one strategy's rounds by 20-30%)."""
    out = []
    for (nproc, seq) in dict.fromkeys((r["nproc"], r["seq"]) for r in rows):
        case = {r["strategy"]: r for r in rows if (r["nproc"], r["seq"]) == (nproc, seq)
                and r["strategy"] in auto.CANDIDATES}  # what auto chooses among (not the hybrid)
        measured = {strategy: r["wall_seconds_measured"] for strategy, r in case.items()}
        if len(measured) < 2:
            continue
        d = DemoConfig(nproc=nproc, seq=seq)
        hw = local_hardware(calibration)
        share = min(1.0, (os.cpu_count() or 1) / nproc)
        hw = hw.with_compute_share(share)
        choice, why = auto.choose_for_shapes(d.batch, d.heads, d.kv_heads, d.head_dim, seq, nproc, d.dtype,
                                             d.layout, Mask(causal=d.causal), True, hw)
        rounds = {strategy: r["wall_seconds_rounds"] for strategy, r in case.items()}
        medians = {strategy: statistics.median(times) for strategy, times in rounds.items()}
        fastest = min(measured, key=measured.get)
        each = coverage = None
        if choice in measured:
            others = [other for other in rounds if other != choice]
            each = {}
            for other in others:
                ratios = [a / b for a, b in zip(rounds[choice], rounds[other])]
                low, high, one = median_interval(ratios, 1 - 0.05 / len(others))
                each[other] = dict(median=statistics.median(ratios), interval=[low, high])
            coverage = 1 - len(others) * (1 - one)  # all at once, at least (Bonferroni)
        out.append(dict(nproc=nproc, seq=seq, auto=choice, why=why, fastest=fastest, measured=measured,
                        fastest_by_median=min(medians, key=medians.get), median_rounds=medians,
                        auto_over_fastest=measured[choice] / measured[fastest] if choice in measured else None,
                        auto_over_others_per_round=None if each is None else max(v["median"] for v in each.values()),
                        auto_over_each_other_per_round=each, intervals_coverage=coverage,
                        slower_shown=None if each is None else any(v["interval"][0] > 1.05 for v in each.values())))
    return out


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[list[DemoConfig]]]:
    """The flags and the demo runs they make (per (P, T), one per strategy), every one checked before the
    minute of calibration."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=flags.ranks_list, default="2,4")
    p.add_argument("--seqs", type=flags.counts, default="4096,8192,16384")
    p.add_argument("--strategies", type=flags.names(STRATEGY_NAMES), default="ring,allgather,alltoall")
    p.add_argument("--ulysses-degree", type=flags.count, default=2, help="the hybrid's all-to-all degree U")
    p.add_argument("--repeat", type=flags.count, default=10, help="demo runs per case; best seconds per rank")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    cases = [[DemoConfig(nproc=nproc, seq=seq, strategy=strategy,
                         ulysses_degree=args.ulysses_degree if strategy == "hybrid" else None)
              for strategy in args.strategies] for nproc in args.nprocs for seq in args.seqs]
    with flags.refusals(p):
        for cfgs in cases:
            for cfg in cfgs:
                cfg.validate(cfg.nproc, seq_flag="--seqs")
    return args, cases


def main() -> None:
    args, cases = parse_args()
    calibration = calibrate()
    print(format_calibration(calibration))
    rows = []
    for cfgs in cases:
        rows += [compare(cfg, calibration, ranks) for cfg, ranks in zip(cfgs, measure(cfgs, args.repeat))]
    mib = 2**20
    print(f"{'P':>2} {'T':>6} {'strategy':<10} {'sent MiB':>9} {'= plan':>6} {'attn s plan':>11} {'measured':>9} "
          f"{'error':>7} {'wall s plan':>11} {'measured':>9} {'error':>7}")
    for r in rows:
        print(f"{r['nproc']:>2} {r['seq']:>6} {r['strategy']:<10} {r['bytes_predicted'] / mib:>9.2f} "
              f"{'yes' if r['bytes_match'] else 'NO':>6} {r['attn_seconds_predicted']:>11.3f} "
              f"{r['attn_seconds_measured']:>9.3f} {r['attn_error']:>+7.1%} {r['wall_seconds_predicted']:>11.3f} "
              f"{r['wall_seconds_measured']:>9.3f} {r['wall_error']:>+7.1%}")
    verdicts = auto_verdicts(rows, calibration)
    if verdicts:
        print("\nstrategy='auto' against the measured fastest (wall seconds, forward + backward, mean over ranks)")
        print("(best: each strategy's best round; same round: the median over rounds of auto's time over each "
              "other's in the same round, the largest, and its interval, 95% for all the others at once; * where "
              "an interval lies wholly above 1.05, that one)")
        print(f"{'P':>2} {'T':>6} {'auto':<10} {'fastest':<10} {'by median':<10} {'auto / fastest':>14} "
              f"{'same round':>23}  best, median rounds")
        for v in verdicts:
            ratio = "not measured" if v["auto_over_fastest"] is None else f"{v['auto_over_fastest']:.3f}"
            paired = "not measured"
            each = v["auto_over_each_other_per_round"]
            if each is not None:
                # the largest median's interval, or where the rounds show auto slower, that strategy's
                worst = max(each.values(), key=lambda o: (o["interval"][0] > 1.05, o["median"]))
                paired = "{:.3f} ({:.3f}-{:.3f}){}".format(worst["median"], *worst["interval"],
                                                           "*" if v["slower_shown"] else " ")
                if v["intervals_coverage"] < 0.95:
                    paired += f" only {max(v['intervals_coverage'], 0):.0%} sure"
            times = ", ".join(f"{k} {t:.3f} {v['median_rounds'][k]:.3f}" for k, t in v["measured"].items())
            print(f"{v['nproc']:>2} {v['seq']:>6} {v['auto']:<10} {v['fastest']:<10} {v['fastest_by_median']:<10} "
                  f"{ratio:>14} {paired:>23}  {times}")
    if args.json:
        write_json(args.json, args, calibration=calibration, rows=rows, auto=verdicts)


if __name__ == "__main__":
    main()
