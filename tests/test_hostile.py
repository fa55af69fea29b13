"""Hostile input to ``ctxpar.attention`` and the layouts: what hurried users pass.

Issue 8's silently-wrong cases, each reproduced here (the code before the fix fails them):
strided inputs (item 1, also every strategy x world size in ``test_distributed``), the
layout's sequence dim (item 4), ranks that disagree (item 5), non-finite values
(item 11). The Hugging Face, training and launcher cases live in ``test_hf_fidelity``,
``test_checkpoints`` and ``test_faults``; docs/reliability.md lists them all.
"""

from __future__ import annotations

import pytest
import torch

import ctxpar
import hostile_cases
import spawned
from ctxpar.kernels.reference import reference_attention

def results() -> list[dict]:
    """Per-rank results of ``hostile_cases.run``; a call that hangs is cut short by the 60 s
    collective timeout, and the failure is reported by every test, spawned once."""
    return spawned.results("hostile")


spawned.declare("hostile", hostile_cases.run, hostile_cases.WORLD, timeout_s=60)


# -- item 1: strided inputs -----------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_q_k_v_unbound_from_an_interleaved_projection(strategy: str) -> None:
    """(B, S, H, D, 3) projection output unbound on the last dim: the last dim has stride 3."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 16, 4, 8, 3, generator=gen, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in qkv.requires_grad_().unbind(-1))  # (B, H, S, D), stride(-1) == 3
    assert q.stride(-1) == 3
    out = ctxpar.attention(q, k, v, layout="zigzag", strategy=strategy)
    (grad,) = torch.autograd.grad(out.sum(), qkv)
    leaf = qkv.detach().clone().requires_grad_()
    want = reference_attention(*(t.transpose(1, 2) for t in leaf.unbind(-1)))[0]
    (want_grad,) = torch.autograd.grad(want.sum(), leaf)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("overlapping", ["rows", "heads", "size_one_dim"])
def test_q_with_another_dim_of_stride_one_is_exact(strategy: str, overlapping: str) -> None:
    """q as ``Tensor.unfold`` makes it, rows (or heads) one element apart, or a size-1 dim of
    stride 1 beside expanded rows: torch's fused CPU op misread it beside a dense last dim (out
    off by up to 1e38, or NaN, varying run to run; rows where they are fewer than the head dim)."""
    b, h, s, d = 1, 4, 6, 8
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    if overlapping == "rows":
        base = torch.randn(b, h, s + d - 1, generator=gen, dtype=torch.float64, requires_grad=True)
        view = lambda t: t.unfold(2, d, 1)  # noqa: E731
    elif overlapping == "heads":
        base = torch.randn(b, s, h + d - 1, generator=gen, dtype=torch.float64, requires_grad=True)
        view = lambda t: t.unfold(2, d, 1).transpose(1, 2)  # noqa: E731
    else:  # the batch dim (of size 1) of stride 1, the rows expanded (stride 0): not overlapping in a dim of size > 1
        base = torch.randn(h * (d + 1), generator=gen, dtype=torch.float64, requires_grad=True)
        view = lambda t: t.as_strided((b, h, s, d), (1, d + 1, 0, 1))  # noqa: E731
    q = view(base)
    assert 1 in q.stride()[:-1] and q.stride(-1) == 1
    out = ctxpar.attention(q, k, v, layout="zigzag", strategy=strategy)
    (grad,) = torch.autograd.grad(out.sum(), base)
    leaf = base.detach().clone().requires_grad_()
    want = reference_attention(view(leaf), k, v)[0]
    (want_grad,) = torch.autograd.grad(want.sum(), leaf)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)


def test_kernels_get_a_dense_last_dim_made_once_per_shard() -> None:
    """Strided q on 4 ranks (zigzag: several blocks per rank): every block the kernels get is
    dense in its last dim and a view of one copy made for the call, not a copy per block."""
    for rank, res in enumerate(results()):
        r = res["dense_once"]
        assert r["blocks"] > 1 and r["dense"], f"rank {rank}: {r}"
        assert r["query_storages"] == 1, f"rank {rank}: a copy per block ({r['query_storages']} storages)"


def test_layouts_of_the_user_that_compare_equal_but_deal_otherwise_each_run_their_own_deal() -> None:
    for rank, res in enumerate(results()):
        errors = res["equal_layouts"]
        assert len(errors) == 8 and max(errors.values()) < 1e-12, f"rank {rank}: {errors}"


# -- item 4: the sequence dim of Layout.shard is never guessed --------------------------


def test_shard_without_dim_refuses_instead_of_splitting_heads() -> None:
    layout = ctxpar.get_layout("zigzag", 2)
    q = torch.randn(1, 4, 8, 16)  # (B, H, T, D): the old default dim=1 split the 4 heads
    with pytest.raises(ValueError, match="needs dim="):
        layout.shard(q, 0)
    assert layout.shard(q, 0, dim=2).shape == (1, 4, 4, 16)


# -- item 5: ranks that disagree ------------------------------------------------------

DISAGREEMENTS = {  # case -> what the ranks that called correctly are told
    # each rank's value where the signature holds it as such, by value (it said only which field differed)
    "kv_shape_same_bytes": "different local_len (4 on ranks 0, 1, 2; 8 on rank 3), head_dim (8 on ranks 0, 1, 2; 4 "
                           "on rank 3)",
    "layout": "different layout",
    "causal": "different causal (True on ranks 0, 1, 2; False on rank 3)",
    "scale": f"different scale ({8 ** -0.5!r} on ranks 0, 1, 2; 0.5 on rank 3)",
    "strategy_invalid": "rejected their attention inputs",
    "strategy_other": "different strategy (ring on ranks 0, 1, 2; allgather on rank 3; or the one",
    "requires_grad": "different requires_grad",
    "sinks_requires_grad": "rank 2: q, k, v; rank 3: q, k, v, sinks)",  # once accepted: sinks.grad None elsewhere
    "hybrid_one_rank_invalid": "rejected their attention inputs",
    "hybrid_one_rank_causal": "called attention with different",
    "hybrid_vs_ring": "rejected their attention inputs",
    "layout_not_a_name": "rejected their attention inputs",  # once a TypeError that left the others waiting
    "layout_of_the_users": "different layout",
    "scale_overflows_a_float": "rejected their attention inputs",  # once an OverflowError, likewise
    "sinks_on_meta": "rejected their attention inputs",  # once NotImplementedError from the signature
    "k_sparse": "rejected their attention inputs",
    "q_nested": "rejected their attention inputs",
    "sinks_values": "different sinks",
    "dtype_same_bytes": "different dtype (torch.bfloat16 on ranks 0, 1, 2; torch.float16 on rank 3)",
    "window": "different documents/window",
    "batch": "different batch (1 on ranks 0, 1, 2; 2 on rank 3)",
    "kv_heads": "different kv_heads (2 on ranks 0, 1, 2; 1 on rank 3)",
    "window_with_documents": "different documents/window",
    "sinks_values_bf16": "different sinks",  # 1.001 against 1.0, both bfloat16's 1.0
    "grad_mode": "different requires_grad",
}


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_ranks_that_disagree_all_raise_by_default(case: str) -> None:
    for rank, res in enumerate(results()):
        message = res["disagree"][case]
        assert message != "ok", f"rank {rank} went on computing"
        culprit = rank == 0 if case.startswith("hybrid_one_rank") else rank == hostile_cases.WORLD - 1
        if culprit and DISAGREEMENTS[case] == "rejected their attention inputs":
            continue  # the culprit raises its own error, checked below
        assert DISAGREEMENTS[case] in message, f"rank {rank}: {message}"
        if case == "hybrid_one_rank_causal":  # seen by the row and the column alike: described once
            assert message.count("causal (") <= 1, f"rank {rank}: {message}"
    assert all(res["disagree"]["agreeing"] == "ok" for res in results())
    assert all(res["disagree"]["agreeing_signed_zero"] == "ok" for res in results())


def test_the_ranks_checksums_of_their_values_need_no_numpy(monkeypatch) -> None:
    """torch runs without numpy; Tensor.numpy() then raises, and the checksums it gave read as
    unreadable (-1) on every rank: ranks passing other sinks or prompts were taken to agree."""
    from ctxpar import agreement

    tensors = [torch.arange(12).view(3, 4).t(), torch.randn(5).bfloat16(), torch.empty(0), torch.tensor(-0.0)]
    want = [agreement.tensor_code(t, t.dtype) for t in tensors] + [agreement.values_code(tensors[1])]

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert [agreement.tensor_code(t, t.dtype) for t in tensors] + [agreement.values_code(tensors[1])] == want
    assert agreement.values_code(tensors[1] + 1) != want[-1]


def test_a_row_without_mass_and_a_nan_query_row_on_one_rank() -> None:
    """Row 0 sees only key 0, which it scores past float32's range (-inf) from finite inputs:
    out 0 and dq 0, as from SDPA. A NaN in a query makes its output row NaN at every length,
    where torch's fused CPU op returns it finite below 16 tokens (docs/reliability.md)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    q[:, :, 0, 0], k[:, :, 0, 0] = 3e19, -3e19
    for attend in (lambda *t: ctxpar.attention(*t, layout="zigzag"),
                   lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True)):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        out = attend(q_, k_, v_)
        out.backward(torch.ones_like(out))
        assert (out[:, :, 0] == 0).all() and (q_.grad[:, :, 0] == 0).all(), (out[:, :, 0], q_.grad[:, :, 0])
    for length in (12, 32):
        q, k, v = torch.randn(1, 4, length, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)
        q[0, 0, 5, 3] = float("nan")
        out = ctxpar.attention(q, k, v, layout="zigzag")
        nan_rows = out.isnan().any(-1)
        assert nan_rows[0, 0, 5] and nan_rows.sum() == 1, (length, nan_rows.nonzero())


def test_scales_are_judged_in_the_type_attention_is_computed_in_and_a_bool_is_no_scale() -> None:
    """float16 q is computed in float32: scale 1e-5 and 7e4, outside float16's range, run
    exactly (judged in q's dtype, they were refused); scale=True is refused, not taken as 1."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    for scale in (1e-5, 7e4):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        got = ctxpar.attention(q.half(), k.half(), v.half(), layout="zigzag", scale=scale)
        assert (got.double() - want).abs().max() < 2e-3, scale
    with pytest.raises(ValueError, match="scale must be a positive finite number, got True"):
        ctxpar.attention(q, k, v, layout="zigzag", scale=True)


def test_a_sum_of_checksums_tells_every_rank_that_they_differ() -> None:
    """The all-reduced (codes, squares, ranks) of codes 1, 2, 3: by their sum alone, the rank
    holding the mean took them to agree and went on while the others refused."""
    from ctxpar import agreement

    summed = [sum(column) for column in zip(*(agreement.sums_of(code) for code in (1, 2, 3)))]
    assert [agreement.differ(code, summed) for code in (1, 2, 3)] == [True, True, True]
    alike = [sum(column) for column in zip(*(agreement.sums_of(2) for _ in range(3)))]
    assert not agreement.differ(2, alike)


def test_a_tensor_scale_is_refused_naming_how_to_scale_by_a_tensor() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="scale must be a number, got a tensor .* multiply q by it"):
        ctxpar.attention(q, q, q, layout="zigzag", scale=torch.tensor(0.5))  # once "must be a positive finite number"


def test_a_layout_for_several_ranks_without_a_process_group_says_to_initialise_one() -> None:
    """ctxpar.attention and inference's entries said "the process group has 1; build it with
    world_size=1", which invites each rank to attend over its own shard alone."""
    from ctxpar.inference import generate
    from ctxpar.models import Transformer, get_config

    assert not torch.distributed.is_initialized()
    said = "the zigzag layout is for P=2 ranks but torch.distributed is not initialised; call " \
           "torch.distributed.init_process_group first"
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=said):
        ctxpar.attention(q, q, q, layout=ctxpar.get_layout("zigzag", 2))
    with pytest.raises(ValueError, match=said):
        generate(Transformer(get_config("tiny")), torch.zeros(1, 8, dtype=torch.long),
                 layout=ctxpar.get_layout("zigzag", 2), new_tokens=2)


def test_the_rank_with_invalid_arguments_raises_its_own_error() -> None:
    last = results()[-1]["disagree"]
    assert "unknown strategy 'rign'" in last["strategy_invalid"]
    assert "mesh= is for strategy='hybrid'" in last["hybrid_vs_ring"]
    assert "H_kv=3" in results()[0]["disagree"]["hybrid_one_rank_invalid"]
    assert "layout must be" in last["layout_not_a_name"] and "list" in last["layout_not_a_name"]
    assert "scale must be a positive finite number" in last["scale_overflows_a_float"]
    assert "sinks are on meta" in last["sinks_on_meta"]
    assert "k must be a dense (strided) tensor, got a sparse_coo tensor" in last["k_sparse"]
    assert "q must be a dense (strided) tensor, got a nested tensor" in last["q_nested"]


def test_every_strategy_is_usable_again_after_ctrl_c_in_a_step() -> None:
    for rank, res in enumerate(results()):
        assert len(res["interrupted_steps"]) == 12
        for case, err in res["interrupted_steps"].items():
            assert err == 0.0, f"rank {rank} {case}: {err}"


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall", "hybrid"])
def test_a_loss_on_the_returned_lse_is_refused_not_dropped(strategy: str) -> None:
    for rank, res in enumerate(results()):
        got = res["loss_on_lse"]
        assert "lse returned by ctxpar.attention_with_lse, which is not differentiable" in got[strategy], \
            (rank, got[strategy])
        assert got[f"{strategy} out only"] == "ok", rank


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall", "hybrid"])
def test_differentiating_a_gradient_again_is_refused_not_detached(strategy: str) -> None:
    """alltoall and hybrid once returned dq detached from the graph, so a gradient penalty
    silently contributed nothing to q.grad; every strategy did so after a loss linear in
    the output."""
    for rank, res in enumerate(results()):
        for loss in ("square", "linear"):
            message = res["double_backward"][strategy, loss]
            assert "differentiate twice" in message, f"rank {rank}, {loss} loss: {message}"


def test_torch_func_transforms_are_refused_by_name() -> None:
    for rank, res in enumerate(results()):
        found = dict(res["torch_func"])
        assert found.pop("after") == "ok", rank
        for case, message in found.items():
            assert "is inside a torch.func transform (grad, vmap, jvp, ...)" in message, (rank, case, message)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_under_autocast_q_k_v_are_cast_as_sdpa_casts_them(strategy: str) -> None:
    """Under torch.autocast (a Trainer's bf16=True), float32 q and k with a bfloat16 v were
    refused for differing dtypes; SDPA casts all three to the autocast dtype. Now so does
    ctxpar, within twice SDPA's own bfloat16 error for the output and every gradient."""
    for rank, res in enumerate(results()):
        r = res["under_autocast"][strategy]
        assert r["out dtype"] and r["grad dtypes"], f"rank {rank}: {r}"
        assert r["out"] <= 2 * r["out sdpa"] + 1e-6, f"rank {rank}: out {r['out']:.3g} vs SDPA {r['out sdpa']:.3g}"
        assert r["grads"] <= 2 * r["grads sdpa"] + 1e-6, f"rank {rank}: {r['grads']:.3g} vs {r['grads sdpa']:.3g}"


@pytest.mark.parametrize("argument", ["window", "documents", "sinks", "scale", "causal"])
def test_under_autocast_every_argument_is_honoured(argument: str) -> None:
    """Under autocast the call is made again on the cast tensors: it is the call without autocast
    on q, k, v cast first, bit for bit (a re-call that dropped window= matched attention without
    a window, silently, 1.8 off the windowed one)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 16, 8, generator=gen), torch.randn(1, 2, 16, 8, generator=gen), \
        torch.randn(1, 2, 16, 8, generator=gen)
    given = {"window": 3, "documents": [5, 11], "sinks": torch.randn(4, generator=gen), "scale": 0.7,
             "causal": False}[argument]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = ctxpar.attention_with_lse(q, k, v, layout="zigzag", **{argument: given})
    want, want_lse = ctxpar.attention_with_lse(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout="zigzag",
                                               **{argument: given})
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    plain, _ = ctxpar.attention_with_lse(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout="zigzag")
    assert not torch.equal(want, plain)  # the argument changes the result


def test_under_autocast_float64_q_k_v_stay_float64_and_exact() -> None:
    """SDPA leaves float64 inputs alone under autocast(bfloat16), as ctxpar does: the output,
    lse and every gradient stay float64 and within 1e-12 of float64 attention (cast down to
    bfloat16 like float32 inputs, they came back in bfloat16, 6e-3 off). One process:
    the cast is made before any strategy runs."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 16, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).dtype == torch.float64
        out, lse = ctxpar.attention_with_lse(q, k, v, layout="zigzag")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want, want_lse = reference_attention(q, k, v)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert [t.dtype for t in (out, lse, *grads)] == [torch.float64] * 5
    for got, exact in zip((out, lse, *grads), (want, want_lse, *want_grads)):
        torch.testing.assert_close(got, exact, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_bfloat16_attention_keeps_float32_sinks_and_lse(strategy: str) -> None:
    """Sinks that bfloat16 cannot hold (0.3, 1.3, ...) merge in float32, and lse stays float32:
    within float32 rounding of float64 attention of the bfloat16 inputs (sinks rounded to q's
    dtype moved lse by 5e-3, inside the bfloat16 tolerance the exactness tests allow)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 16, 8, generator=gen).bfloat16() for h in (4, 2, 2))
    sinks = torch.tensor([0.3, 1.3, 1.7, 2.9])
    _, lse = ctxpar.attention_with_lse(q, k, v, layout="zigzag", strategy=strategy, sinks=sinks)
    _, want = reference_attention(q.double(), k.double(), v.double(), sinks=sinks.double())
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=1e-5)


# -- item 11: non-finite inputs -------------------------------------------------------


@pytest.mark.parametrize("poison", list(hostile_cases.POISONS))
def test_non_finite_inputs_poison_what_single_process_attention_poisons(poison: str) -> None:
    """Guarantees (docs/reliability.md): every gradient is non-finite somewhere iff
    single-process SDPA's is, so NaN checks and loss scaling react the same; a row of the
    output is never non-finite where SDPA's is finite; rows finite in both agree; and
    an infinite key poisons dV exactly where SDPA does (the ring once poisoned ~30 rows); and
    the backward leaves the returned lse as it was."""
    found = results()[0]["nonfinite"]
    assert not [where for where in found["lse_changed"] if where[0] == poison], found["lse_changed"]
    for (name, causal, strategy), tensors in found["rows"].items():
        if name != poison:
            continue
        where = f"{poison} causal={causal} {strategy}"
        for tensor, r in tensors.items():
            assert bool(r["cp"].any()) == bool(r["single"].any()), f"{where} {tensor}: poisoned in one only"
            assert r["both_finite_err"] <= 1e-5 * max(1.0, r["scale"]), f"{where} {tensor}: finite rows differ"
        assert not (tensors["out"]["cp"] & ~tensors["out"]["single"]).any(), f"{where}: out rows SDPA keeps finite"
        if poison in ("k+inf", "k-inf"):
            assert torch.equal(tensors["dv"]["cp"], tensors["dv"]["single"]), f"{where}: dv rows differ"


def test_a_refusal_of_any_kind_is_held_until_the_ranks_compare_the_call(monkeypatch) -> None:
    """Every entry checks its call inside ``agreement.Refusal`` and then joins its peers'
    exchange: a rank's TypeError (a user layout failing in its own code) held as a ValueError
    is, or that rank alone left and its peers waited; Ctrl-C goes through at once. Without
    peers, or with check_consistency=False, the refusal is raised and nothing compared."""
    from ctxpar import agreement

    with agreement.Refusal() as refusal:
        raise TypeError("unsupported operand type(s) for //: 'int' and 'NoneType'")
    assert isinstance(refusal.error, TypeError)
    with pytest.raises(KeyboardInterrupt), agreement.Refusal():
        raise KeyboardInterrupt
    compared = []
    monkeypatch.setattr(agreement, "check_values_agree", lambda *args: compared.append(args))
    for world_size, flag in ((1, True), (2, False)):
        with pytest.raises(TypeError, match="unsupported operand"):
            refusal.join(lambda: pytest.fail("the signature built"), None, "prefill", world_size=world_size,
                         check_consistency=flag)
    assert compared == []
    refusal.join(lambda: {"batch": 2}, None, "prefill", world_size=2, check_consistency=None)  # an invalid flag joins
    assert compared == [({"batch": 2}, None, refusal.error, "prefill", ())]
