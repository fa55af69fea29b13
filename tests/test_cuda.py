"""The CUDA path: kernels against fp64, every strategy on P = 1-4 ranks sharing the GPU,
and ``ctxpar train`` on four of them (``ctxpar demo`` per strategy is in gpu_check's
exactness section).

Skipped without a GPU (CI has none); ``make gpu-check`` runs it where there is one.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import cuda_cases  # noqa: E402
import spawned  # noqa: E402
from ctxpar import kernels  # noqa: E402
from ctxpar.kernels import cuda  # noqa: E402
from ctxpar.kernels.reference import reference_attention  # noqa: E402
from ctxpar.verify import TENSORS, max_abs_errors, tolerances, torch_sdpa  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)
for _world in WORLD_SIZES:
    spawned.declare(f"cuda-P{_world}", cuda_cases.run_all, _world, timeout_s=300, device_type="cuda")


def results(world: int) -> list[dict]:
    return spawned.results(f"cuda-P{world}")


CASES = [pytest.param(world, case, id=f"P{world}-{case.id}") for world in WORLD_SIZES
         for case in cuda_cases.cuda_cases() if case.runs_on(world)]


@pytest.mark.parametrize("world, case", CASES)
def test_matches_fp64_reference_on_cuda(world: int, case) -> None:
    for res in results(world):
        assert res[case.id] == "ok", res[case.id]


def _block(h: int, hkv: int, s: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, h, s, d), (2, hkv, s, d), (2, hkv, s, d), (2, h, s, d)]
    return [torch.randn(sh, generator=gen, dtype=torch.float64) for sh in shapes]


FUSED = ("cudnn", "flash")  # cuDNN where its probe passes (cuda.op_for), else flash


@pytest.mark.parametrize("dtype, d, ops", [(torch.bfloat16, 64, FUSED), (torch.float16, 128, FUSED),
                                           (torch.bfloat16, 192, ("flash",)), (torch.float32, 64, ("efficient",)),
                                           (torch.bfloat16, 264, ("efficient",)), (torch.float64, 64, ("reference",)),
                                           (torch.float32, 20, ("reference",))])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False])
def test_each_cuda_op_meets_the_kernel_contract(dtype, d, ops, heads, causal) -> None:
    """Forward, and backward from the global (out, lse), against fp64 on the CPU, within twice
    torch's own SDPA error in the same dtype; the backward handed out as the forward returns it
    and as the strategies hand it over (a dense (B, H, S, D) tensor, or rows of one)."""
    q, k, v, dout = _block(*heads, 520, d, dtype)  # 512+ queries: cuDNN takes GQA blocks too (cuda.op_for)
    op = cuda.op_for(q.to("cuda", dtype), k.to("cuda", dtype))
    assert op in ops
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = reference_attention(*leaves, causal=causal, scale=0.2)
    want_out.backward(dout)
    ref = dict(out=want_out.detach(), lse=want_lse.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    qc, kc, vc, dc = (t.to("cuda", dtype) for t in (q, k, v, dout))
    out, lse = kernels.attention_forward(qc, kc, vc, causal=causal, scale=0.2)
    baseline = None
    if dtype in (torch.bfloat16, torch.float16):
        sdpa = torch_sdpa(qc, kc, vc, dc, causal=causal, scale=0.2)
        baseline = max_abs_errors({n: t.cpu() for n, t in sdpa.items()}, ref)
    tol = tolerances(dtype, ref, baseline)
    rows_of_dense = torch.cat([out, out], dim=2)[:, :, :out.shape[2]]  # a (B, H, 2S, D) tensor's first S rows
    for handed in (out, out.contiguous(), rows_of_dense):
        grads = kernels.attention_backward(dc, qc, kc, vc, handed, lse, causal=causal, scale=0.2)
        assert lse.dtype in (torch.float32, torch.float64) and grads[1].shape == kc.shape
        errors = max_abs_errors({n: t.cpu() for n, t in zip(TENSORS, (out, lse, *grads))}, ref)
        for name in TENSORS:
            assert errors[name] <= tol[name], f"{op} {name}: {errors[name]:.3g} > {tol[name]:.3g}"


@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 5), (5, 1), (2, 2)])
def test_blocks_of_one_or_two_tokens_meet_the_contract(sq: int, sk: int) -> None:
    """Shards of one or two tokens (a warm-up call, P close to T): cuDNN's backward refuses one
    query against one key, so such a block goes to the flash op; each within bf16 rounding."""
    gen = torch.Generator().manual_seed(sq * 10 + sk)
    q, dout = (torch.randn(1, 8, sq, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, sk, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = reference_attention(*leaves, causal=False, scale=0.125)
    want_out.backward(dout)
    qc, kc, vc, dc = (t.to("cuda", torch.bfloat16) for t in (q, k, v, dout))
    out, lse = kernels.attention_forward(qc, kc, vc, causal=False, scale=0.125)
    grads = kernels.attention_backward(dc, qc, kc, vc, out, lse, causal=False, scale=0.125)
    for got, want in zip((out, lse, *grads), (want_out, want_lse, *(t.grad for t in leaves))):
        assert got.shape == want.shape
        assert (got.cpu().double() - want.detach()).abs().max() <= 2.0**-6 * (1 + want.abs().max())


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 64), (torch.bfloat16, 192), (torch.float32, 64),
                                      (torch.float64, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_a_row_whose_keys_all_score_minus_inf_carries_no_mass(dtype, d, causal) -> None:
    """Keys 0-2 score -inf for every query: under a causal block rows 0-2 see only them and
    must carry lse -inf and out 0 (merged, anything else is a phantom key; torch's CPU op
    gave lse 0); every other row is its softmax over the finite keys; the backward from
    the global lse, +inf for a row without mass, gives no NaN."""
    q, k, v, dout = _block(8, 2, 520, d, torch.float64)  # 512+ queries: cuDNN takes GQA blocks too
    q[..., 0] = q[..., 0].abs() + 1.0
    k[:, :, :3, 0] = float("-inf")
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(4, 1).nan_to_num(neginf=0.0)) * 0.2
    scores[..., :3] = float("-inf")
    if causal:
        scores = scores.masked_fill(~torch.ones(520, 520, dtype=torch.bool).tril(), float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    massless = torch.isneginf(want_lse)
    want_out = (torch.softmax(scores, -1) @ v.repeat_interleave(4, 1)).nan_to_num(nan=0.0)
    qc, kc, vc, dc = (t.to("cuda", dtype) for t in (q, k, v, dout))
    out, lse = kernels.attention_forward(qc, kc, vc, causal=causal, scale=0.2)
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.equal(torch.isneginf(lse), massless), f"{cuda.op_for(qc, kc)}: rows without mass {lse[massless]}"
    assert (out[massless] == 0).all()
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 2.0**-6)
    assert (out - want_out).abs().max() <= tolerance * (1 + want_out.abs().max())
    assert (lse[~massless] - want_lse[~massless]).abs().max() <= tolerance * (1 + want_lse[~massless].abs().max())
    global_lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # as the strategies hand it over
    grads = kernels.attention_backward(dc, qc, kc, vc, out.to("cuda", dtype), global_lse.to("cuda"), causal=causal,
                                       scale=0.2)
    assert not grads[2].isnan().any(), f"{cuda.op_for(qc, kc)}: dv NaN"  # dq, dk meet k's -inf (0 x inf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_no_block_allocates_memory_that_grows_with_s_squared(dtype) -> None:
    """One block of S=32K (16K in float64; 8 heads, D=128) forward + backward: peak memory
    stays a small multiple of the inputs, plus a few score tiles for the reference kernel
    (the whole scores would be 8 x S^2 x 4 bytes = 32 GiB, or 16 GiB in float64)."""
    s = 32768 if dtype != torch.float64 else 16384
    q = torch.randn(1, 8, s, 128, device="cuda", dtype=dtype)
    k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = kernels.attention_forward(q, k, v, causal=True, scale=128**-0.5)
    kernels.attention_backward(dout, q, k, v, out, lse, causal=True, scale=128**-0.5)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    inputs = 4 * q.numel() * 8  # q, k, v, dout in float64 bytes: a generous O(S) allowance
    budget = kernels.reference.SCORE_BUDGET_BYTES * 8 if dtype == torch.float64 else 0  # s, p, ds, temporaries
    assert grown <= inputs + budget, f"grew {grown / 2**30:.2f} GiB"


def test_the_plans_data_reaches_the_gpu_without_a_host_synchronisation() -> None:
    """A PARTIAL tile's mask, the all-gather's key order and the all-to-all's position order of a
    new plan (documents= changing every batch) are copied from pinned memory, queued:
    torch's sync debug mode raises at any copy that waits for the GPU (test_cuda_dispatch.py
    simulates it on the CPU)."""
    from ctxpar import blocks, get_layout
    from ctxpar.masks import make_mask
    from ctxpar.strategies import allgather, alltoall

    gpu, seq, layout = torch.device("cuda", torch.cuda.current_device()), 64, get_layout("zigzag", 4)
    documents = make_mask(seq, causal=True, documents=[7, 31, 26])  # a plan no other test made
    tile = blocks.Tile(0, 3, 0, 5, blocks.MaskKind.PARTIAL, rows=((0, 1), (1, 3), (2, 5)))
    for cached in (blocks._rows_bounds, allgather._key_order, alltoall._position_order):
        cached.cache_clear()  # else a plan an earlier test made would be taken from the cache, copying nothing
    torch.cuda._sleep(10**8)  # work queued ahead, which a synchronising copy would wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = tile.visible(gpu)
        index = allgather._key_order(layout, seq, 1, documents, gpu)[2]
        src, loc = alltoall._position_order(layout, seq, 1, 2, gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(mask.cpu(), tile.visible("cpu"))
    assert torch.equal(index.cpu(), allgather._key_order(layout, seq, 1, documents, torch.device("cpu"))[2])
    assert all(torch.equal(a.cpu(), b) for a, b in zip((src, loc), alltoall._position_order(
        layout, seq, 1, 2, torch.device("cpu")), strict=True))


def _cli(*args: str, tmp_path) -> dict:
    import json
    import subprocess
    import sys

    path = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "ctxpar.cli", *args, "--device", "cuda", "--json", str(path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(path.read_text())


def test_sampled_tokens_are_the_cpus_from_one_seed() -> None:
    """``generate --device cuda --temperature 0.9 --compare`` read MISMATCH: the ranks drew with a
    CUDA generator, the CPU reference with a CPU one, which draw other tokens from one seed."""
    from ctxpar.inference.generate import Sampler

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    drawn = [Sampler(0.9, seed=5)(logits.to(device)) for device in ("cpu", "cuda")]
    assert drawn[1].device.type == "cuda" and torch.equal(drawn[0], drawn[1].cpu())


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_train_on_four_ranks_sharing_the_gpu(strategy: str, tmp_path) -> None:
    report = _cli("train", "--nproc", "4", "--seq", "512", "--steps", "4", "--strategy", strategy, "--compare",
                  "--no-progress", tmp_path=tmp_path)
    assert report["max_abs_loss_diff"] <= 1e-3, report["max_abs_loss_diff"]
