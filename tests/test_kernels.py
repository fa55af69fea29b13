"""Block kernels: fused CPU op vs the fp64 math reference, and the global-lse backward."""

from __future__ import annotations

import math
import time

import pytest
import torch

from ctxpar import kernels, verify
from ctxpar.kernels import cpu, cuda, reference
from ctxpar.merge import merge


def make(h: int, hkv: int, s: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, s, 16, generator=gen, dtype=dtype)
    k = torch.randn(2, hkv, s, 16, generator=gen, dtype=dtype)
    v = torch.randn(2, hkv, s, 16, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("backend", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernel_matches_autograd_reference(backend, heads, causal) -> None:
    """Scale 0.3, not D**-0.5 = 0.25: a kernel falling back to the default scale shows."""
    q, k, v = make(*heads, s=33)
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = reference.reference_attention(*leaves, causal=causal, scale=0.3)
    want_out.backward(dout)
    out, lse = backend.attention_forward(q, k, v, causal=causal, scale=0.3)
    dq, dk, dv = backend.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=0.3)
    assert out.dtype == lse.dtype == dq.dtype == dk.dtype == torch.float64 and dk.shape == k.shape
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=1e-12)


def test_block_gradients_from_global_lse_add_up_to_the_full_gradient() -> None:
    """Split keys in two blocks: merged forward and summed backward equal the unsplit ones."""
    q, k, v = make(4, 2, 24, dtype=torch.float32)
    dout = torch.randn_like(q)
    full_out, full_lse = kernels.attention_forward(q, k, v, causal=False, scale=0.3)
    full = kernels.attention_backward(dout, q, k, v, full_out, full_lse, causal=False, scale=0.3)
    halves = (slice(0, 10), slice(10, 24))
    parts = [kernels.attention_forward(q, k[:, :, s], v[:, :, s], causal=False, scale=0.3) for s in halves]
    out, lse = merge(*parts[0], *parts[1])
    torch.testing.assert_close(out, full_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-6)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for s in halves:
        g_q, g_k, g_v = kernels.attention_backward(dout, q, k[:, :, s], v[:, :, s], out, lse, causal=False, scale=0.3)
        dq += g_q
        dk[:, :, s] += g_k
        dv[:, :, s] += g_v
    for got, want in zip((dq, dk, dv), full):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("tile", ["causal", "masked"])
def test_low_precision_blocks_are_computed_and_returned_in_float32(backend, tile) -> None:
    """bf16 blocks, a causal one and a PARTIAL one (explicit mask, one row that sees no key),
    give what the same kernel gives on the inputs upcast to float32: computed in float32, not
    only returned in it. Once the reference kernel accumulated in the input dtype, its bf16
    blocks came back bf16 and off by bf16's rounding; only the default (cpu) kernel was asked."""
    q, k, v = make(4, 2, 16, dtype=torch.bfloat16)
    mask = None
    if tile == "masked":
        mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(5)) < 0.5
        mask[3] = False
        mask[4, 15] = True
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    seen = torch.ones(16, dtype=torch.bool) if mask is None else mask.any(-1)
    dout = dout.masked_fill(~seen.view(1, 1, 16, 1), 0)
    kw = dict(causal=tile == "causal", scale=0.25, mask=mask)
    out, lse = backend.attention_forward(q, k, v, **kw)
    want_out, want_lse = backend.attention_forward(q.float(), k.float(), v.float(), **kw)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.isneginf(lse[:, :, ~seen]).all() and (out[:, :, ~seen] == 0).all()
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)
    global_lse = lse.masked_fill(~seen.view(1, 1, 16), 0.0)  # the empty row sees keys elsewhere
    grads = backend.attention_backward(dout, q, k, v, out, global_lse, **kw)
    want = backend.attention_backward(dout.float(), q.float(), k.float(), v.float(), out, global_lse, **kw)
    assert all(g.dtype == torch.float32 for g in grads)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def strided_views() -> dict:
    """Ways a hurried user's (B, H, S, D) tensor can sit in memory."""
    return {
        "interleaved_qkv": lambda t: torch.stack([t, t.neg(), t], -1)[..., 0],  # unbound from (..., D, 3)
        "d_major": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
        "bshd": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
        "every_other_token": lambda t: torch.stack([t, t], 3).flatten(2, 3)[:, :, ::2],
        "sliced_head_dim": lambda t: torch.cat([t, t], -1)[..., : t.shape[-1]],
        "expanded_batch": lambda t: t[:1].expand_as(t),
        # rows (heads) one element apart, overlapping (as Tensor.unfold makes them): a second dim of
        # stride 1 beside the last, which torch's fused CPU op misreads in some shapes (garbage, run to
        # run: the heads here; rows fewer than the head dim in test_hostile.py)
        "overlapping_rows": lambda t: t.as_strided(t.shape, (t.stride(0), t.stride(1), 1, 1)),
        "overlapping_heads": lambda t: t.as_strided(t.shape, (t.stride(0), 1, t.shape[-1], 1)),
    }


@pytest.mark.parametrize("backend", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("view", list(strided_views()))
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernel_accepts_any_strides(backend, view, causal) -> None:
    """Every tensor of the contract as a strided view: the same results as its dense copy."""
    as_view = strided_views()[view]
    q, k, v = map(as_view, make(4, 2, 20))
    dout = as_view(torch.randn(q.shape, dtype=q.dtype))
    assert not q.is_contiguous()
    dense = lambda *ts: [t.contiguous() for t in ts]  # noqa: E731
    out, lse = backend.attention_forward(*dense(q, k, v), causal=causal, scale=0.3)
    out_given = as_view(out)  # an overlapping view holds other values than the tensor it views: both get these
    grads = backend.attention_backward(*dense(dout, q, k, v, out_given), lse, causal=causal, scale=0.3)
    out_v, lse_v = backend.attention_forward(q, k, v, causal=causal, scale=0.3)
    grads_v = backend.attention_backward(dout, q, k, v, out_given, lse, causal=causal, scale=0.3)
    for got, want in zip((out_v, lse_v, *grads_v), (out, lse, *grads)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("heads", [(2, 3, 3), (2, 4, 4), (3, 2, 2), (6, 4, 4), (4, 2, 1), (4, 0, 0)])
def test_heads_that_do_not_group_are_refused_by_every_backend_and_by_verify(heads) -> None:
    """q's heads a multiple of K/V's, k and v alike: torch's fused CPU op stopped the
    interpreter with SIGFPE where H_kv > H (2 against 3 or 4) and returned a result for 3
    against 2; the reference kernel failed in a view, SDPA with a RuntimeError."""
    h, h_k, h_v = heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, 16, 8, generator=gen)
    k, v = torch.randn(1, h_k, 16, 8, generator=gen), torch.randn(1, h_v, 16, 8, generator=gen)
    lse = torch.zeros(1, h, 16)
    calls = {
        "unsplit_attention": lambda: verify.unsplit_attention(q, k, v, q, causal=True, scale=0.3),
        "torch_sdpa": lambda: verify.torch_sdpa(q, k, v, q, causal=True, scale=0.3),
        "reference_attention": lambda: reference.reference_attention(q, k, v),
    }
    for backend in (cpu, cuda, reference):  # cuda's check comes before it looks for a GPU
        calls[f"{backend.__name__}.forward"] = lambda b=backend: b.attention_forward(q, k, v, causal=True, scale=0.3)
        calls[f"{backend.__name__}.backward"] = lambda b=backend: b.attention_backward(q, q, k, v, q, lse, causal=True,
                                                                                       scale=0.3)
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"q has {h} heads and k .*H % H_kv == 0"):
            call()
            pytest.fail(f"{name} took heads {heads}")


def test_verify_refuses_results_it_cannot_compare_naming_what_differs() -> None:
    """max_abs_errors broadcast a 1-row result against a 16-row reference (plausible errors,
    no word); tolerances failed in torch's max() of an empty tensor, or with a bare KeyError."""
    q, k, v = make(2, 1, 16)
    ref = verify.unsplit_attention(q, k, v, torch.ones_like(q), causal=True, scale=0.25)
    one_row = {name: t[:, :, :1] for name, t in ref.items()}
    empty = {name: t[:, :, :0] for name, t in ref.items()}
    refused = [
        (lambda: verify.max_abs_errors(one_row, ref), r"got and ref differ in shape: out \(2, 2, 1, 16\) against "
                                                      r"\(2, 2, 16, 16\); lse \(2, 2, 1\) against \(2, 2, 16\)"),
        (lambda: verify.max_abs_errors(dict(ref, out=ref["out"][..., :1]), ref),
         r"differ in shape: out \(2, 2, 16, 1\) against \(2, 2, 16, 16\); compare"),
        (lambda: verify.max_abs_errors({"out": ref["out"]}, ref), "got has no lse, dq, dk, dv: it needs each of"),
        (lambda: verify.tolerances(torch.float32, {"out": ref["out"]}), "ref has no lse, dq, dk, dv"),
        (lambda: verify.tolerances(torch.float32, empty), r"ref has empty tensors \(out \(2, 2, 0, 16\)"),
        (lambda: verify.max_abs_errors(empty, empty), "got has empty tensors"),
        (lambda: verify.tolerances(torch.int64, ref), "tolerances are for the floating dtype attention ran in"),
    ]
    for call, said in refused:
        with pytest.raises(ValueError, match=said):
            call()
    assert verify.max_abs_errors(ref, ref) == dict.fromkeys(verify.TENSORS, 0.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_result_is_a_non_finite_error_that_no_tolerance_passes(bad: float) -> None:
    """One non-finite element of a result is its tensor's error, not a 0 that reads as exact
    (``ctxpar demo`` compares errors <= tolerances so)."""
    q, k, v = make(2, 1, 16)
    ref = verify.unsplit_attention(q, k, v, torch.ones_like(q), causal=True, scale=0.25)
    tol = verify.tolerances(torch.float64, ref)
    for name in verify.TENSORS:
        poisoned = ref[name].clone(memory_format=torch.contiguous_format)
        poisoned.view(-1)[3] = bad
        errors = verify.max_abs_errors(dict(ref, **{name: poisoned}), ref)
        # inf, NaN included: a NaN error passed a check written "error > tolerance"
        assert errors[name] == math.inf and errors[name] > tol[name], (name, errors)
        assert verify.max_abs_errors(poisoned_both := dict(ref, **{name: poisoned}), poisoned_both)[name] == (
            0.0 if math.isinf(bad) else math.inf), name  # an infinity equal on both sides is no error, a NaN is
        assert all(errors[other] == 0.0 for other in verify.TENSORS if other != name), (name, errors)
        baseline = dict.fromkeys(verify.TENSORS, 1e-3) | {name: errors[name]}  # the unsplit bf16 op's, overflowed
        with pytest.raises(ValueError, match="the single-process baseline's errors are not all finite"):
            verify.tolerances(torch.bfloat16, ref, baseline)  # an infinite tolerance would pass any result
        off = ref[name].clone(memory_format=torch.contiguous_format)
        off.view(-1)[-1] += 0.5  # the last batch element's: an error measured on the first alone read 0.0
        assert verify.max_abs_errors(dict(ref, **{name: off}), ref)[name] == pytest.approx(0.5), name


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_tolerances_are_the_dtypes_share_of_each_tensors_scale_and_a_vanishing_gradient_gets_the_others(
        dtype: torch.dtype, rtol: float) -> None:
    """The module's docstring: max |reference| x 1e-12 in float64, x 1e-5 in float32; dq, dk, dv
    held to at least the largest of the three (dq exactly 0 here, as under a 1-key window)."""
    ref = {name: torch.tensor([[-scale, 0.5 * scale]], dtype=torch.float64)
           for name, scale in dict(out=2.0, lse=3.0, dq=0.0, dk=0.5, dv=4.0).items()}
    assert verify.tolerances(dtype, ref) == dict(out=rtol * 2.0, lse=rtol * 3.0, dq=rtol * 4.0, dk=rtol * 4.0,
                                                 dv=rtol * 4.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_tolerance_is_twice_the_single_process_error(dtype: torch.dtype) -> None:
    """bfloat16 / float16: each tensor within 2x single-process SDPA's own error in that dtype,
    plus float32's share of its scale (once 20x the baseline, a bf16 demo said OK for numbers
    ten times worse than SDPA's; every demo test gave it right numbers)."""
    ref = {name: torch.tensor([[-scale, 0.5 * scale]], dtype=torch.float64)
           for name, scale in dict(out=2.0, lse=3.0, dq=0.0, dk=0.5, dv=4.0).items()}
    baseline = dict(out=1e-2, lse=2e-3, dq=3e-2, dk=4e-2, dv=5e-2)
    want = dict(out=2 * 1e-2 + 1e-5 * 2.0, lse=2 * 2e-3 + 1e-5 * 3.0, dq=2 * 3e-2 + 1e-5 * 4.0,
                dk=2 * 4e-2 + 1e-5 * 4.0, dv=2 * 5e-2 + 1e-5 * 4.0)
    assert verify.tolerances(dtype, ref, baseline) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("tile", ["causal", "full", "masked"])
def test_reference_kernel_bounds_its_score_tiles(tile, monkeypatch) -> None:
    """With a budget of a few tiles the reference kernel still gives the untiled result,
    an explicit mask too: each score tile takes its own keys' columns of it (the first
    tile's columns for every key tile passed unseen without a masked case)."""
    q, k, v = make(4, 2, 70)
    dout = torch.randn_like(q)
    causal, mask = tile == "causal", None
    if tile == "masked":  # random visibility, each row seeing its own key at least
        mask = (torch.rand(70, 70, generator=torch.Generator().manual_seed(5)) < 0.3) | torch.eye(70, dtype=torch.bool)
    want_out, want_lse = reference.attention_forward(q, k, v, causal=causal, scale=0.3, mask=mask)
    want = reference.attention_backward(dout, q, k, v, want_out, want_lse, causal=causal, scale=0.3, mask=mask)
    monkeypatch.setattr(reference, "SCORE_BUDGET_BYTES", 2 * 4 * 16 * 16 * 8)  # 16 x 16 tiles
    assert reference.tile_size(2, 4, 8) == 16
    out, lse = reference.attention_forward(q, k, v, causal=causal, scale=0.3, mask=mask)
    grads = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=0.3, mask=mask)
    for got, expected in zip((out, lse, *grads), (want_out, want_lse, *want)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_an_explicit_tile_mask_is_honoured_and_a_row_that_sees_nothing_gets_minus_inf(backend, heads) -> None:
    """A PARTIAL tile: random visibility with one row that sees no key. Its lse is -inf
    (it merges as nothing), and given the global lse of the rows that do see keys the
    backward gives exactly the masked gradients. Scale 0.3: at D**-0.5 = 0.25 (the default)
    a PARTIAL tile's backward that dropped the caller's scale passed unseen."""
    q, k, v = make(*heads, s=20)
    gen = torch.Generator().manual_seed(3)
    visible = torch.rand(20, 20, generator=gen) < 0.4
    visible[5] = False
    visible[6, 19] = True
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scores_mask = visible.clone()
    scores_mask[5, 0] = True  # the reference needs one key for row 5; its gradient is zeroed below
    s = torch.einsum("bhqd,bhkd->bhqk", leaves[0], leaves[1].repeat_interleave(heads[0] // heads[1], 1)) * 0.3
    s = s.masked_fill(~scores_mask, float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    want_out = torch.softmax(s, -1) @ leaves[2].repeat_interleave(heads[0] // heads[1], 1)
    (want_out * dout.masked_fill(~visible.any(-1).view(1, 1, 20, 1), 0)).sum().backward()
    out, lse = backend.attention_forward(q, k, v, causal=False, scale=0.3, mask=visible)
    assert torch.isneginf(lse[:, :, 5]).all() and (out[:, :, 5] == 0).all()
    rows = visible.any(-1)
    torch.testing.assert_close(out[:, :, rows], want_out[:, :, rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[:, :, rows], want_lse[:, :, rows], rtol=0, atol=1e-12)
    global_lse = lse.masked_fill(~rows.view(1, 1, 20), 0.0)  # row 5 sees keys in some other tile
    grads = backend.attention_backward(dout.masked_fill(~rows.view(1, 1, 20, 1), 0), q, k, v, out, global_lse,
                                       causal=False, scale=0.3, mask=visible)
    for got, leaf in zip(grads, leaves):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_masked_non_finite_key_leaves_the_rows_that_cannot_see_it_alone(bad: float) -> None:
    """Two packed documents in one PARTIAL tile, an inf (or NaN) in a key of the first: the
    outputs of the second are finite and exact (torch's CPU op adds the mask as -inf to the
    scores, and a hidden inf - inf made them NaN: document isolation lost), and the gradients
    are the reference kernel's (dQ sums 0 x the bad key, NaN as in single-process SDPA)."""
    q, k, v = (t.float() for t in make(4, 2, s=12))
    k[:, :, 1, 3] = bad
    documents = torch.arange(12) < 5
    visible = (documents[:, None] == documents[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    out, lse = cpu.attention_forward(q, k, v, causal=False, scale=0.3, mask=visible)
    want_out, want_lse = reference.attention_forward(q.double(), k.double(), v.double(), causal=False, scale=0.3,
                                                     mask=visible)
    second = ~documents
    assert torch.isfinite(out[:, :, second]).all() and torch.isfinite(lse[:, :, second]).all()
    torch.testing.assert_close(out[:, :, second].double(), want_out[:, :, second], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse[:, :, second].double(), want_lse[:, :, second], rtol=0, atol=1e-5)
    dout = torch.randn_like(q).masked_fill(documents.view(1, 1, 12, 1), 0)  # the first document's rows: no loss
    grads = cpu.attention_backward(dout, q, k, v, out, lse, causal=False, scale=0.3, mask=visible)
    want = reference.attention_backward(dout.double(), q.double(), k.double(), v.double(), want_out, want_lse,
                                        causal=False, scale=0.3, mask=visible)
    # the gradients are the reference kernel's, non-finite where its are (dQ's rows sum 0 x the bad key)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got[:, :, second].double(), expected[:, :, second], rtol=0, atol=1e-5,
                                   equal_nan=True)


@pytest.mark.parametrize("backend", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("tile", ["causal", "masked"])
def test_a_row_whose_visible_keys_all_score_minus_inf_carries_no_mass(backend, heads, tile, monkeypatch) -> None:
    """Keys 0-1 score -inf for every query (an -inf in k), key 2 for the query heads of K/V
    head 0 only (a product past float32's range, from finite inputs): rows that see only them
    have no softmax mass here, lse -inf. torch's CPU op gave them lse 0, which merged as a
    phantom key of weight 1 and value 0 (outputs off by 0.4 in CP). A row whose one key
    scores exactly 0 keeps lse 0. With the -inf at the same keys in every K/V head, rescoring
    the suspect rows of K/V head g on query heads g..g+G instead of g*G..(g+1)*G (8 query
    heads on 2: heads 1-4 against K/V head 1) passed unseen; here row 2 of heads 1-3 then
    keeps the op's lse 0."""
    monkeypatch.setattr(cpu, "_RESCORED_SCORES", 24)  # the CPU kernel rescores suspect rows two at a time
    q, k, v = (t.float() for t in make(*heads, s=12))
    q[..., 0] = q[..., 0].abs() + 3e19
    k[:, :, :2, 0] = float("-inf")
    k[:, 0, 2, 0] = -3e19  # finite; q.k overflows float32 (the other K/V heads' key 2 scores finitely)
    visible = torch.ones(12, 12, dtype=torch.bool).tril()
    if tile == "masked":
        visible[5], visible[9] = torch.arange(12) < 2, torch.arange(12) == 9
        k[:, :, 9], v[:, :, 9] = 0.0, 0.0  # row 9 sees only key 9, scored 0, of value 0
    repeat = heads[0] // heads[1]
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(repeat, 1)) * 0.25
    scores[..., :2] = scores[:, :repeat, :, 2] = float("-inf")  # as float32 sees them
    scores = scores.masked_fill(~visible, float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    massless = torch.isneginf(want_lse)
    want_out = (torch.softmax(scores, -1) @ v.double().repeat_interleave(repeat, 1)).masked_fill(
        massless.unsqueeze(-1), 0.0)
    if tile == "causal":  # rows 0-1 of every head, row 2 of K/V head 0's alone
        assert massless[..., :2].all() and massless[:, :repeat, 2].all() and not massless[:, repeat:, 2:].any()
        assert not massless[..., 3:].any()
    else:
        assert massless[..., 5].all()
    out, lse = backend.attention_forward(q, k, v, causal=tile == "causal", scale=0.25,
                                         mask=visible if tile == "masked" else None)
    assert torch.equal(torch.isneginf(lse), massless) and (out[massless] == 0).all()
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double()[~massless], want_lse[~massless], rtol=1e-6, atol=1e-6)
    if tile == "masked":
        assert (lse[:, :, 9] == 0).all() and (out[:, :, 9] == 0).all()


def test_compute_cpu_time_leaves_out_other_threads_work() -> None:
    """With torch on one thread (every local rank of the demo), a compute block's CPU time is
    its own thread's: work another thread does meanwhile (gloo moving the next K/V) is not
    compute. With more torch threads, the process's (the block's own helpers included)."""
    import threading

    from ctxpar import profile

    cpu_device = torch.device("cpu")
    a = torch.randn(256, 256)
    previous = torch.get_num_threads()

    def busy(seconds: float) -> None:  # torch ops release the GIL: CPU time on another thread
        # seconds of its own CPU time, not of wall time: on a loaded machine 0.3 s of wall gave
        # it 0.07 s of CPU, and the counted 0.072 s failed the > 0.1 below (a cap of a minute's
        # wall keeps a starved thread from hanging the test)
        end, give_up = time.thread_time() + seconds, time.perf_counter() + 60
        while time.thread_time() < end and time.perf_counter() < give_up:
            a @ a

    try:
        for threads, counted in ((1, False), (2, True)):
            torch.set_num_threads(threads)
            other = threading.Thread(target=busy, args=(0.3,))
            with profile.record() as rec:
                with profile.timed("compute", cpu_device):
                    other.start()
                    other.join()  # this thread waits: no CPU of its own
            assert (rec.compute_cpu_seconds > 0.1) is counted, (threads, rec.compute_cpu_seconds)
    finally:
        torch.set_num_threads(previous)


def test_timing_on_cuda_waits_for_the_current_stream_not_the_whole_device(monkeypatch) -> None:
    """A device-wide synchronize would also wait for NCCL's streams: a transfer in flight
    beside a compute block would count as compute, and the ring's overlap vanish from
    every record."""
    from ctxpar import profile

    synced = []

    class Stream:
        def __init__(self, device) -> None:
            self.device = device

        def synchronize(self) -> None:
            synced.append(self.device)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: pytest.fail("the whole device was synchronised"))
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    gpu = torch.device("cuda", 1)
    with profile.record() as rec, profile.timed("compute", gpu):
        pass
    assert synced == [gpu, gpu] and rec.compute_seconds >= 0


def test_a_record_without_timing_counts_everything_but_seconds() -> None:
    """``record(timing=False)`` (the training loop's) takes no time and so never synchronises
    a device; a timing record open beside it still gets the seconds, a wait's CPU time not
    counted as compute (the demo's "attn s" column)."""
    import time

    from ctxpar import profile

    cpu_device = torch.device("cpu")
    with profile.record(timing=False) as quiet, profile.record() as timed:
        with profile.timed("compute", cpu_device):
            sum(range(10000))
        with profile.timed("wait", cpu_device):
            spinning = time.process_time()
            while time.process_time() - spinning < 0.1:  # a wait that spins
                pass
        profile.note_strategy("ring", "why")
        profile.add_traffic(8, 4)
    assert (quiet.compute_seconds, quiet.compute_cpu_seconds, quiet.wait_seconds) == (0.0, 0.0, 0.0)
    assert timed.compute_seconds > 0 and 0 <= timed.compute_cpu_seconds < 0.05 and timed.wait_seconds > 0
    for rec in (quiet, timed):
        assert (rec.waits, rec.strategy_choices, rec.bytes_sent, rec.bytes_received) == (1, [("ring", "why")], 8, 4)


def test_a_record_counts_its_own_blocks_nested_reopened_or_decorating() -> None:
    """An inner record closing while its counts equal the outer's must close itself: records
    are told apart by identity, not by their (equal) counts. A record opened again adds up
    (it raised AttributeError: '_GeneratorContextManager' object has no attribute 'args'),
    counting once where it is open inside itself; one decorates a function
    (``@ctxpar.record`` without parentheses failed when called, naming no fix)."""
    from ctxpar import profile

    with profile.record() as outer:
        with profile.record() as inner:
            pass
        profile.add_traffic(8, 4)
    profile.add_traffic(16, 16)
    assert (outer.bytes_sent, outer.bytes_received) == (8, 4)
    assert (inner.bytes_sent, inner.bytes_received) == (0, 0)

    phase = profile.record(timing=False)
    for _ in range(2):
        with phase as rec:
            with phase:
                profile.add_traffic(8, 4)
    assert rec is phase and (phase.bytes_sent, phase.collectives) == (16, 2)

    @phase
    def step() -> None:
        profile.add_traffic(1, 1)

    step()
    step()
    assert (phase.bytes_sent, phase.collectives) == (18, 4)
    profile.add_traffic(1, 1)  # every block closed
    assert phase.collectives == 4
    with pytest.raises(ValueError, match="record's timing <function .* must be True or False; .* then @rec"):
        @profile.record
        def forgot_the_record() -> None:
            pass


@pytest.mark.parametrize("backend", [cpu, reference], ids=["cpu", "reference"])
def test_a_massless_row_is_told_from_a_true_lse_0_in_its_own_key_group(backend) -> None:
    """GQA, 4 query heads on 2 K/V heads. Only query head 2 (of K/V head 1) scores past
    float32's range against keys 0-2, so only its rows 0-2 have no mass (head 3 shares those
    keys and keeps its mass). Head 2's row 5 sees key 5 alone, scored exactly 0, of value 0:
    lse 0 and out 0, as a massless row is given before it is rescored. Rescoring head 2
    against the other group's keys, or not at all, would call row 5 massless too."""
    q, k, v = (t.float() for t in make(4, 2, s=8))
    q[:, 2, :, 0], q[:, 3, :, 0] = q[:, 2, :, 0].abs() + 3e19, 0.0
    k[:, 1, :3, 0] = -3e19  # finite; with head 2's q the product overflows float32 to -inf, with head 3's is 0
    k[:, 1, 5], v[:, 1, 5] = torch.eye(16)[1], 0.0
    q[:, 2, 5, 1], q[:, 3, 5, 1] = 0.0, 1.0  # row 5 scores key 5: 0 in head 2, 0.25 in head 3
    visible = torch.ones(8, 8, dtype=torch.bool).tril()
    visible[5] = torch.arange(8) == 5
    out, lse = backend.attention_forward(q, k, v, causal=False, scale=0.25, mask=visible)
    massless = torch.zeros(lse.shape, dtype=torch.bool)
    massless[:, 2, :3] = True
    assert (out[massless] == 0).all() and (lse[massless] == float("-inf")).all()
    assert (lse[:, 2, 5] == 0).all() and (out[:, 2, 5] == 0).all() and lse[~massless].isfinite().all()
    want_out, want_lse = cpu._cpu_fwd(q, k, v, 0.0, False, attn_mask=cpu._additive(visible, q), scale=0.25)[:2]
    torch.testing.assert_close(out[~massless], want_out[~massless], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse[~massless], want_lse[~massless], rtol=1e-6, atol=1e-6)


def test_a_tile_whose_sum_is_nan_without_a_nan_query_poisons_no_row() -> None:
    """The CPU kernel looks for NaN query rows only where the tile's one sum is NaN: -inf in
    one row and +inf in another make it so without a NaN anywhere, and no row is poisoned for
    it. Both rows score -inf against every key (no mass: out 0, lse -inf); the rest are the
    fused op's own."""
    q, k, v = (t.float() for t in make(4, 2, s=8))
    k[..., 0], k[..., 1] = k[..., 0].abs() + 0.1, -k[..., 1].abs() - 0.1
    q[0, 0, 1, 0], q[0, 3, 5, 1] = float("-inf"), float("inf")  # each row's every score: -inf
    assert bool(q.sum().isnan()) and not q.isnan().any()
    out, lse = cpu.attention_forward(q, k, v, causal=True, scale=0.25)
    massless = torch.zeros(lse.shape, dtype=torch.bool)
    massless[0, 0, 1] = massless[0, 3, 5] = True
    assert (out[massless] == 0).all() and (lse[massless] == float("-inf")).all()
    want_out, want_lse = cpu._cpu_fwd(q, k, v, 0.0, True, scale=0.25)[:2]
    assert torch.equal(out[~massless], want_out[~massless]) and torch.equal(lse[~massless], want_lse[~massless])
