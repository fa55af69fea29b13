"""``benchmarks/plan_vs_measured.py``'s verdict on ``strategy="auto"``: the same-round ratio and its interval."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plan_vs_measured import auto_verdicts, median_interval  # noqa: E402


@pytest.mark.parametrize("n, ranks", [(10, (2, 9)), (20, (6, 15)), (30, (10, 21)), (6, (1, 6))])
def test_the_median_interval_is_the_order_statistics_of_the_binomial_table(n: int, ranks: tuple[int, int]) -> None:
    values = [float(v) for v in range(100, 100 + n)][::-1]  # any order
    low, high, coverage = median_interval(values)
    assert (low, high) == (100 + ranks[0] - 1, 100 + ranks[1] - 1)
    k = ranks[0]
    assert coverage == pytest.approx(1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n) and coverage >= 0.95


def test_too_few_rounds_give_their_range_and_say_how_sure_it_is() -> None:
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, 1 - 2 / 32)


def test_auto_is_judged_against_the_strategy_it_loses_most_to_round_by_round() -> None:
    """Ten rounds: the all-to-all 8% slower than the ring in the same round but for two, the
    all-gather slower still in none; auto's choice is whatever the planner picks, so the
    rows are built around it."""
    calibration = dict(attention_flops=5e10, bandwidth=1e9)
    probe = auto_verdicts([dict(nproc=2, seq=1024, strategy=s, wall_seconds_measured=1.0, wall_seconds_rounds=[1.0] * 10)
                           for s in ("ring", "alltoall")], calibration)[0]
    choice = probe["auto"]
    other = "ring" if choice != "ring" else "alltoall"
    ratios = [1.08] * 8 + [0.9, 1.3]
    rows = [dict(nproc=2, seq=1024, strategy=choice, wall_seconds_measured=0.9,
                 wall_seconds_rounds=[r * 0.1 for r in ratios]),
            dict(nproc=2, seq=1024, strategy=other, wall_seconds_measured=0.1, wall_seconds_rounds=[0.1] * 10)]
    v = auto_verdicts(rows, calibration)[0]
    assert v["auto_over_others_per_round"] == pytest.approx(1.08)
    assert v["auto_over_others_per_round_interval"] == pytest.approx([1.08, 1.08])
    assert v["interval_coverage"] == pytest.approx(1 - 2 * 11 / 1024)
    assert v["auto_over_fastest"] == pytest.approx(9.0) and v["fastest"] == other
