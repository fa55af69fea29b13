"""The online-softmax merge against a softmax over the concatenated scores."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.merge import merge, merge_into, merge_packed


def partial(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised (out, lse) of one part; rows with no visible key give (0, -inf)."""
    s = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    return p @ values, lse


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 6),
    split=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    magnitude=st.sampled_from([0.1, 1.0, 30.0, 300.0]),
    seed=st.integers(0, 2**16),
    masked_fraction=st.sampled_from([0.0, 0.3, 0.7]),
)
def test_merging_parts_equals_softmax_over_all_keys(rows, split, magnitude, seed, masked_fraction) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = sum(split)
    scores = torch.randn(rows, n, generator=gen, dtype=torch.float64) * magnitude
    values = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, n, generator=gen) >= masked_fraction
    mask[0] = False  # a row that never sees a key
    want_out, want_lse = partial(scores, values, mask)

    out = torch.zeros(rows, 3, dtype=torch.float32)
    lse = torch.full((rows,), -math.inf, dtype=torch.float32)
    start = 0
    for width in split:
        cols = slice(start, start + width)
        o, l_ = partial(scores[:, cols], values[cols], mask[:, cols])
        merge_into(out, lse, o.float(), l_.float())
        start += width
    assert torch.isfinite(out).all(), "no NaN/inf, even for rows that saw nothing"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    # float32 holds an lse of magnitude L to about L * 2^-24; a weight exp(lse_b - lse)
    # inherits that as a relative error, hence the L-dependent part of the tolerance
    lse_scale = want_lse[~torch.isneginf(want_lse)].abs().max().item() if (~torch.isneginf(want_lse)).any() else 0
    rel = 1e-5 + 8 * torch.finfo(torch.float32).eps * lse_scale
    assert torch.allclose(out.double(), want_out, atol=rel * max(1.0, want_out.abs().max().item()))
    seen = ~torch.isneginf(want_lse)
    assert torch.allclose(lse.double()[seen], want_lse[seen], rtol=1e-6, atol=1e-5)
    assert (out[0] == 0).all() and lse[0] == -math.inf


def test_merge_is_symmetric_and_leaves_inputs_alone() -> None:
    a, b = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    la, lb = torch.randn(2, 5), torch.randn(2, 5)
    la[0, 0] = -math.inf
    lb[0, 0] = -math.inf
    snapshot = (a.clone(), la.clone())
    o1, l1 = merge(a, la, b, lb)
    o2, l2 = merge(b, lb, a, la)
    assert torch.allclose(o1, o2) and torch.equal(l1, l2)
    assert torch.equal(a, snapshot[0]) and torch.equal(la, snapshot[1])
    assert torch.equal(o1[0, 0], torch.zeros(4)) and l1[0, 0] == -math.inf


def test_merge_into_a_slice_updates_the_accumulator() -> None:
    acc = torch.zeros(1, 6, 2)
    acc_lse = torch.full((1, 6), -math.inf)
    merge_into(acc[:, 2:4], acc_lse[:, 2:4], torch.ones(1, 2, 2), torch.zeros(1, 2))
    assert acc[:, 2:4].eq(1).all() and acc[:, :2].eq(0).all() and acc[:, 4:].eq(0).all()
    assert acc_lse[:, 2:4].eq(0).all() and torch.isneginf(acc_lse[:, 4:]).all()


def test_a_row_without_a_defined_softmax_gets_lse_plus_inf_and_a_nan_output() -> None:
    """A kernel reports a row that met a +inf score as lse NaN or +inf (torch's fused op
    does both); merged, it is +inf, so the backward confines the poison to that key."""
    out = torch.zeros(1, 3, 2)
    lse = torch.full((1, 3), -math.inf)
    merge_into(out, lse, torch.randn(1, 3, 2), torch.tensor([[0.5, 0.5, 0.5]]))
    partial = torch.tensor([[[math.nan] * 2, [math.nan] * 2, [0.0] * 2]])  # row 2 saw no key: (0, -inf)
    merge_into(out, lse, partial, torch.tensor([[math.nan, math.inf, -math.inf]]))
    assert lse[0, 0] == math.inf and lse[0, 1] == math.inf and lse[0, 2] == 0.5
    assert out[0, :2].isnan().all() and out[0, 2].isfinite().all()


def test_merge_packed_folds_a_stack_in_order_and_refuses_what_is_not_one() -> None:
    gen = torch.Generator().manual_seed(0)
    outs, lses = torch.randn(3, 2, 5, 4, generator=gen), torch.randn(3, 2, 5, generator=gen)
    lses[1, 0, 2] = float("-inf")  # a part that saw no key for one row
    out, lse = merge_packed(torch.cat([outs, lses.unsqueeze(-1)], dim=-1))
    want_out, want_lse = merge(outs[0], lses[0], outs[1], lses[1])
    want_out, want_lse = merge(want_out, want_lse, outs[2], lses[2])
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for bad in (torch.zeros(0, 2, 5, 5), torch.zeros(5, 5), torch.zeros(2, 3, 1)):
        with pytest.raises(ValueError, match="merge_packed takes a stack"):
            merge_packed(bad)


@pytest.mark.parametrize("lse", [torch.tensor([[0.0]]), torch.tensor([[1.0e4]]),
                                 torch.tensor([[0.0, 1.0e4, -1.0e4, -3.5, 88.0, -math.inf]])],
                         ids=["zero", "large", "mixed-row"])
def test_merging_a_partial_with_its_twin_doubles_its_mass(lse) -> None:
    """merge(o, l, o, l) is the same keys counted twice: out o, lse l + ln 2 (a row that saw no
    key stays (0, -inf)). Once the ln 2 was dropped where the two lse were equal, the weights
    summed to 2 and every such row came back as (2 o, l). float64, so l = 1e4 + ln 2 is exact
    to far below the tolerance (float32 rounds it to 1e-3)."""
    lse = lse.double()
    out = torch.randn(*lse.shape, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got_out, got_lse = merge(out, lse, out, lse)
    seen = ~torch.isneginf(lse)
    want_out = torch.where(seen.unsqueeze(-1), out, torch.zeros_like(out))
    torch.testing.assert_close(got_out, want_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_lse[seen], lse[seen] + math.log(2), rtol=1e-12, atol=1e-12)
    assert torch.isneginf(got_lse[~seen]).all()


@pytest.mark.parametrize("sinks_dtype", [torch.float32, torch.bfloat16])
def test_the_sinks_gradient_is_summed_at_the_lse_precision_from_low_precision_outputs(sinks_dtype) -> None:
    """-sum over rows of exp(sink - lse) (dout . out): from bf16 dout and out, summed in the
    lse's float32, within float32's rounding of the float64 sum of the same numbers (summed in
    bf16, 1e-2 off: the suite's tolerances for bf16 attention let it through)."""
    from ctxpar.strategies.blockwise import sink_gradient

    gen = torch.Generator().manual_seed(0)
    dout, out = (torch.randn(2, 4, 64, 16, generator=gen).bfloat16() for _ in range(2))
    lse = torch.randn(2, 4, 64, generator=gen) + 3.0
    sinks = (torch.randn(4, generator=gen) * 0.3).to(sinks_dtype)
    got = sink_gradient(sinks, dout, out, lse)
    want = -(torch.exp(sinks.double().view(1, -1, 1) - lse.double())
             * (dout.double() * out.double()).sum(-1)).sum((0, 2))
    assert got.dtype == sinks_dtype
    rounding = 1e-5 if sinks_dtype == torch.float32 else 2**-8  # the result's own dtype's
    torch.testing.assert_close(got.double(), want, rtol=rounding, atol=rounding * want.abs().max().item())
