"""CP attention on 1-4 gloo ranks against the float64 reference, bad inputs, traffic."""

from __future__ import annotations

import pytest

import dist_cases
from ctxpar.launch import run_local
from ctxpar.verify import TENSORS

WORLD_SIZES = (1, 2, 3, 4)
_results: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    """Per-rank results of ``dist_cases.run_all``, spawned once per world size."""
    if world not in _results:
        _results[world] = run_local(dist_cases.run_all, world, timeout_s=300)
    return _results[world]


@pytest.mark.parametrize("case", dist_cases.exactness_cases(), ids=lambda c: c.id)
@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_matches_fp64_reference(world: int, case: dist_cases.Case) -> None:
    for rank, res in enumerate(results(world)):
        r = res["exactness"][case.id]
        assert "exception" not in r, f"rank {rank}:\n{r.get('exception')}"
        assert r["finite"], f"rank {rank}: non-finite values"
        assert r["dtypes_ok"], f"rank {rank}: output or gradient dtype differs from the input dtype"
        for name in TENSORS:
            err, tol = r["errors"][name], r["tolerances"][name]
            assert err <= tol, f"rank {rank} {name}: max abs error {err:.3g} > tolerance {tol:.3g}"


EXPECTED_MESSAGES = {
    "length": ["sequence length", "2*P=", "zigzag", "pad to"],
    "heads": ["H=4", "H_kv=3"],
    "dtype": ["dtypes differ"],
    "device": ["different devices"],
    "kv_shape": ["same shape"],
    "seq_mismatch": ["must agree"],
    "rank3": ["4-D"],
    "layout_world": ["built for P=", "process group has"],
    "layout_name": ["unknown layout", "zigzag"],
    "strategy": ["unknown strategy", "ring"],
    "scale": ["scale"],
    "int_dtype": ["not supported"],
    "non_member": ["not a member"],
}


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_bad_inputs_raise_clear_errors_without_hanging(world: int) -> None:
    for rank, res in enumerate(results(world)):
        messages = res["bad_inputs"]
        assert messages.pop("after") == "ok", "attention after the rejected calls did not work"
        for name, message in messages.items():
            for fragment in EXPECTED_MESSAGES[name]:
                assert fragment in message, f"rank {rank} {name}: {fragment!r} not in {message!r}"
        expected = set(EXPECTED_MESSAGES) - ({"non_member"} if world == 1 or rank != 0 else set())
        assert set(messages) == expected


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_counted_bytes_equal_ring_volume(world: int) -> None:
    for res in results(world):
        t = res["traffic"]
        b, h, hkv, s, d = t["shape"]
        kv_message = 2 * b * hkv * s * d  # K and V in one buffer, elements
        forward = (world - 1) * kv_message * t["element_size"]
        backward = (world - 1) * kv_message * (t["element_size"] + 4)  # K/V again + fp32 dK/dV
        assert t["forward"] == (forward, forward)
        assert t["backward"] == (backward, backward)


def test_any_process_group_not_only_world() -> None:
    for rank, res in enumerate(results(4)):
        r = res["subgroups"]
        assert "exception" not in r
        for name in TENSORS:
            assert r["errors"][name] <= r["tolerances"][name], f"rank {rank} {name}"
