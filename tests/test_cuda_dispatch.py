"""``kernels/cuda.py`` without a GPU: what each of torch's CUDA ops is handed, with the op
replaced by a stand-in that reads its arguments as torch's kernel does (tests/test_cuda.py
runs the real ops where there is a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import ctxpar
from ctxpar import blocks
from ctxpar.kernels import cuda, reference
from ctxpar.masks import make_mask
from ctxpar.strategies import allgather, alltoall


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(capability, cudnn)``: blocks run as on a GPU of that compute capability, where
    cuDNN's probe passes or not; torch's SDPA switches are restored afterwards."""
    backends = torch.backends.cuda
    switches = [(getattr(backends, f"enable_{name}_sdp"), getattr(backends, f"{name}_sdp_enabled")())
                for name in ("flash", "mem_efficient", "cudnn")]

    def use(capability: tuple[int, int] = (9, 0), cudnn: bool = True) -> None:
        monkeypatch.setattr(cuda, "_capability", lambda device: capability)
        monkeypatch.setattr(cuda, "_cudnn_honours_lse", lambda device, dtype: cudnn)

    yield use
    for enable, was in switches:
        enable(was)


def _block(h: int, hkv: int, s: int, d: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, h, s, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, hkv, s, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


@pytest.mark.parametrize("handed", ["dense", "rows of a dense out", "float32", "as the forward returns it"])
def test_the_efficient_backward_reads_the_out_it_is_handed(handed: str, gpu, monkeypatch) -> None:
    """bf16 at D = 264 (the efficient op): its kernel reads out's rows H * D apart whatever the
    tensor's strides (kernel_backward.h: o_strideM() = head_dim_value * num_heads); what it
    reads so must be the out the strategies handed over, e.g. rows of their dense (B, H, S, D)
    merged out."""
    gpu()
    q, k, v, dout = _block(4, 2, 40, 264, torch.bfloat16)
    out = torch.randn(1, 4, 40, 264).bfloat16()
    given = {"dense": out, "rows of a dense out": torch.cat([out, out.flip(2)], dim=2)[:, :, :40],
             "float32": out.float(), "as the forward returns it": out.transpose(1, 2).contiguous().transpose(1, 2)}
    read = []

    def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout, grad_mask, causal, *, scale):
        b, h, s, d = out.shape
        read.append(out.as_strided(out.shape, (out.stride(0), out.stride(1), h * d, 1)).clone())
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(cuda, "_eff_bwd", efficient_backward)
    monkeypatch.setattr(cuda, "_efficient_aux", lambda device, dtype: (None, None))
    assert cuda.op_for(q, k) == "efficient"
    dq, dk, dv = cuda.attention_backward(dout, q, k, v, given[handed], torch.zeros(1, 4, 40), causal=True, scale=0.1)
    assert torch.equal(read[0], out)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert dq.dtype == torch.bfloat16 and dk.dtype == dv.dtype == torch.float32  # K/V heads summed in fp32


def test_kv_gradients_of_repeated_heads_are_summed_and_returned_in_float32() -> None:
    """``_sum_kv`` folds the H/H_kv query heads' dK/dV back onto their KV head in float32 and
    returns it so: 1 + 2^-8 is exact in float32 and rounds to 1 in bf16. Once it summed in
    the input dtype, every GQA block's bf16 dK/dV was rounded a second time."""
    t = torch.tensor([1.0, 2.0 ** -8]).bfloat16().view(1, 2, 1, 1).expand(2, 2, 3, 4).contiguous()
    summed = cuda._sum_kv(t, 1)
    assert summed.dtype == torch.float32 and summed.shape == (2, 1, 3, 4)
    assert (summed == 1 + 2.0 ** -8).all()
    assert cuda._sum_kv(t, 2) is t  # heads that are not repeated come back as they are


H200, A10, RTX_5090, T4, V100 = (9, 0), (8, 6), (12, 0), (7, 5), (7, 0)
L40S, DGX_SPARK = (8, 9), (12, 1)  # the top of each range whose flash backward refuses D 193-224


@pytest.mark.parametrize("op", ["flash", "efficient"])
def test_a_row_without_mass_comes_back_as_the_contracts_whatever_the_ops_convention(op: str, gpu,
                                                                                    monkeypatch) -> None:
    """Rows whose keys all score -inf, in each op's convention (torch's kernels, read: flash
    gives out 0 and lse +inf, the efficient op, which fp32 takes, lse -inf and out NaN: 0 x 1/0).
    The efficient op's NaN went through, and its merge made the whole row NaN on a GPU. A row
    that met a +inf score (out NaN, lse +inf, in either op) has mass, undefined: it stays NaN /
    +inf; once every +inf lse was read as "no mass", it came back (0, -inf) and hid the NaN."""
    gpu(H200, cudnn=False)
    dtype, d = (torch.bfloat16, 128) if op == "flash" else (torch.float32, 64)
    q, k, v, _ = _block(4, 2, 8, d, dtype)
    empty = torch.zeros(1, 4, 8, dtype=torch.bool)
    empty[0, 1, 2] = empty[0, 3, 5] = True  # two rows without mass
    poisoned = torch.zeros(1, 4, 8, dtype=torch.bool)
    poisoned[0, 2, 6] = True  # a row that met a +inf score
    finite = torch.randn(1, 4, 8, d).to(dtype)

    def ops_output(q, *args, **kwargs):
        out = finite.masked_fill(empty.unsqueeze(-1), 0.0 if op == "flash" else float("nan"))
        out = out.masked_fill(poisoned.unsqueeze(-1), float("nan"))
        lse = torch.zeros(1, 4, 8).masked_fill(empty, float("inf") if op == "flash" else float("-inf"))
        lse = lse.masked_fill(poisoned, float("inf"))
        if op == "efficient":
            lse = F.pad(lse, (0, 24))  # the op pads its lse rows to 32
        return out, lse, *([None] * 7)

    monkeypatch.setattr(cuda, "_flash_fwd" if op == "flash" else "_eff_fwd", ops_output)
    monkeypatch.setattr(cuda, "_flash_takes_gqa", lambda device, dtype: True)
    assert cuda.op_for(q, k) == op
    out, lse = cuda.attention_forward(q, k, v, causal=False, scale=0.1)
    assert out[poisoned].isnan().all() and torch.isposinf(lse[poisoned]).all()
    assert torch.equal(out[~poisoned], finite.masked_fill(empty.unsqueeze(-1), 0)[~poisoned])
    assert torch.equal(lse[~poisoned], torch.zeros(1, 4, 8).masked_fill(empty, float("-inf"))[~poisoned])


@pytest.mark.parametrize("capability, dtype, d, cudnn, op", [
    (H200, torch.bfloat16, 64, True, "cudnn"), (H200, torch.float16, 128, False, "flash"),
    (H200, torch.bfloat16, 208, True, "flash"), (H200, torch.bfloat16, 264, True, "efficient"),
    (H200, torch.float32, 64, True, "efficient"), (H200, torch.float64, 64, True, "reference"),
    (H200, torch.float32, 20, True, "reference"),
    (A10, torch.bfloat16, 192, False, "flash"), (A10, torch.bfloat16, 208, False, "efficient"),
    (A10, torch.bfloat16, 256, False, "flash"), (RTX_5090, torch.float16, 224, False, "efficient"),
    (L40S, torch.bfloat16, 208, False, "efficient"), (L40S, torch.bfloat16, 128, False, "flash"),
    (DGX_SPARK, torch.float16, 200, False, "efficient"), (DGX_SPARK, torch.bfloat16, 256, False, "flash"),
    (T4, torch.float16, 64, True, "efficient"), (T4, torch.float16, 264, False, "efficient"),
    (T4, torch.bfloat16, 128, True, "reference"), (T4, torch.float32, 64, False, "efficient"),
    (V100, torch.float16, 128, False, "efficient"),
])
def test_each_block_goes_to_an_op_its_gpu_runs(capability, dtype, d, cudnn, op, gpu) -> None:
    """As torch's SDPA selects (sdp_utils.cpp): flash and cuDNN from sm80 on, the efficient op
    from sm50 (bf16 from sm80); sm86-89 and sm120-121 refuse the flash backward at D 193-224.
    A T4 or V100 was sent to the flash op, which raises there; the L40S / RTX 4090 (sm89) and
    sm121 rows pin the ranges' upper ends (once sm89 was left out and sent D 208 to flash)."""
    gpu(capability, cudnn)
    q = torch.empty(1, 8, 128, d, dtype=dtype)
    assert cuda.op_for(q, torch.empty_like(q)) == op


def test_the_device_of_the_block_is_asked_its_capability(monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or T4)
    monkeypatch.setattr(cuda, "_cudnn_honours_lse", lambda device, dtype: True)
    cuda._capability.cache_clear()
    try:
        for _ in range(2):
            assert cuda.op_for(torch.empty(1, 8, 128, 64, dtype=torch.float16)) == "efficient"
    finally:
        cuda._capability.cache_clear()
    assert asked == [torch.device("cpu")]  # once per device


@pytest.mark.parametrize("off, dtype, d, op", [
    (("flash",), torch.bfloat16, 192, "efficient"), (("flash",), torch.bfloat16, 64, "cudnn"),
    (("flash", "cudnn"), torch.float16, 64, "efficient"), (("mem_efficient",), torch.float32, 64, "reference"),
    (("mem_efficient",), torch.bfloat16, 264, "reference"), (("flash", "mem_efficient"), torch.bfloat16, 128, "cudnn"),
    (("flash", "mem_efficient", "cudnn"), torch.bfloat16, 128, "reference"),
])
def test_an_op_torch_was_told_not_to_use_is_not_used(off, dtype, d, op, gpu) -> None:
    """``torch.backends.cuda.enable_{flash,mem_efficient,cudnn}_sdp(False)`` as SDPA honours them."""
    gpu(H200, cudnn=True)
    for name in off:
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(False)
    q = torch.empty(1, 8, 128, d, dtype=dtype)
    assert cuda.op_for(q, torch.empty_like(q)) == op


def test_deterministic_algorithms_keep_blocks_off_cudnn(gpu) -> None:
    """``torch.use_deterministic_algorithms(True)``: torch does not count cuDNN's attention among
    its deterministic algorithms, so a bf16 D = 128 block that would go to cuDNN goes to flash
    (once the switch was not asked, it went to cuDNN)."""
    gpu(H200, cudnn=True)
    q = torch.empty(1, 8, 1024, 128, dtype=torch.bfloat16)
    assert cuda.op_for(q, torch.empty_like(q)) == "cudnn"
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    # the switch torch.use_deterministic_algorithms sets, without its first-call import of
    # torch._inductor (0.8 s), which only mirrors the setting into inductor's config
    torch._C._set_deterministic_algorithms(True, warn_only=False)
    try:
        assert cuda.op_for(q, torch.empty_like(q)) == "flash"
    finally:
        torch._C._set_deterministic_algorithms(was, warn_only=warn_only)


@pytest.mark.parametrize("dtype, d, cudnn, op", [
    (torch.bfloat16, 128, True, "cudnn"), (torch.bfloat16, 128, False, "flash"), (torch.float32, 64, True, "efficient"),
])
def test_a_partial_tile_goes_to_the_reference_kernel_whatever_op_its_block_gets(dtype, d, cudnn, op, gpu,
                                                                               monkeypatch) -> None:
    """The fused ops here take no mask: a PARTIAL tile (``mask=``) runs the reference kernel, forward
    and backward, with every fused op replaced by a stand-in that fails. Once the forward dropped
    the mask test, a masked block went to its fused op, which attended to every key."""
    gpu(H200, cudnn=cudnn)
    for name in ("_cudnn_fwd", "_cudnn_bwd", "_flash_fwd", "_flash_bwd", "_eff_fwd", "_eff_bwd"):
        monkeypatch.setattr(cuda, name, lambda *args, _name=name, **kwargs: pytest.fail(f"{_name} ran a masked tile"))
    q, k, v, dout = _block(4, 4, 8, d, dtype)  # K/V with q's heads: cuDNN's, at 8 queries
    assert cuda.op_for(q, k) == op
    mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) < 0.5
    mask[:, 0] = True
    out, lse = cuda.attention_forward(q, k, v, causal=False, scale=0.1, mask=mask)
    want_out, want_lse = cuda.reference.attention_forward(q, k, v, causal=False, scale=0.1, mask=mask)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    grads = cuda.attention_backward(dout, q, k, v, out, lse, causal=False, scale=0.1, mask=mask)
    want = cuda.reference.attention_backward(dout, q, k, v, out, lse, causal=False, scale=0.1, mask=mask)
    assert all(torch.equal(got, expected) for got, expected in zip(grads, want, strict=True))


@pytest.mark.parametrize("queries, kv_heads, a_cache_view, op, keys", [
    (1, 2, True, "flash", 3000), (1, 8, True, "flash", 3000), (1, 8, False, "cudnn", 3000),
    (1, 2, False, "flash", 3000), (511, 2, False, "flash", 3000), (512, 2, False, "cudnn", 3000),
    (512, 8, True, "cudnn", 3000), (64, 8, False, "cudnn", 3000),
    (1, 8, False, "flash", 1), (2, 8, False, "flash", 1), (1, 8, False, "cudnn", 2),
])
def test_a_block_whose_kv_cudnn_would_copy_goes_to_flash_unless_the_queries_pay_for_it(
        queries, kv_heads, a_cache_view, op, keys, gpu) -> None:
    """cuDNN's op is handed K/V dense with q's heads: a decode step's K/V (a strided view of the
    cache, H_kv heads) would be copied whole for one query token; the flash op reads them in place.
    A block of a single key goes to flash however it is laid out: cuDNN's backward refused one
    query against one key on the H200 (once the one-key rule was dropped, that block got cuDNN)."""
    gpu(H200, cudnn=True)
    q = torch.empty(1, 8, queries, 128, dtype=torch.bfloat16)
    k = torch.empty(1, kv_heads, keys + 1096 if a_cache_view else keys, 128, dtype=torch.bfloat16)[:, :, :keys]
    assert cuda.op_for(q, k) == op


def test_a_decode_step_hands_the_cached_kv_to_the_kernel_in_place(gpu, monkeypatch) -> None:
    gpu(H200, cudnn=True)
    handed = []

    def flash_forward(q, k, v, dropout, causal, debug, *, scale):
        handed.append((k, v))
        return torch.zeros_like(q), torch.zeros(q.shape[:3]), *([None] * 7)

    monkeypatch.setattr(cuda, "_flash_fwd", flash_forward)
    monkeypatch.setattr(cuda, "_flash_takes_gqa", lambda device, dtype: True)
    monkeypatch.setattr(cuda, "_cudnn_fwd", lambda *args, **kwargs: pytest.fail("cuDNN's op copies the cache"))
    cache = torch.zeros(2, 1, 2, 64, 128, dtype=torch.bfloat16)  # K and V: (B, H_kv, capacity, D) each
    keys, values = cache[0, :, :, :40], cache[1, :, :, :40]  # KVCache.keys(layer, held): views
    out, lse = cuda.attention_forward(torch.randn(1, 8, 1, 128).bfloat16(), keys, values, causal=False, scale=0.1)
    (k, v), = handed
    assert (k.data_ptr(), v.data_ptr(), k.shape, v.shape) == (keys.data_ptr(), values.data_ptr(), keys.shape,
                                                              values.shape)


class HostToGpuCopies(TorchFunctionMode):
    """Runs code as on a GPU: tensors it makes for a CUDA device are made on the CPU, and each
    copy from the host to a GPU is counted: ``waits`` names those that synchronise with the
    GPU's queued work (from a Python list, or from pageable memory, or blocking: CUDA syncs
    the stream before a copy from pageable memory), ``queued`` counts the rest (pinned
    memory, ``non_blocking=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[torch.Tensor] = []
        self.waits: list[str] = []
        self.queued = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if name == "pin_memory":
            self.pinned.append(args[0])
            return args[0]
        if name in ("to", "cuda") and _cuda(args[1] if len(args) > 1 else kwargs.get("device", name == "cuda")):
            pinned = any(args[0] is t for t in self.pinned)
            if pinned and kwargs.get("non_blocking"):
                self.queued += 1
            else:
                self.waits.append(f"Tensor.{name} from {'pinned' if pinned else 'pageable'} memory, blocking")
            return args[0]
        if _cuda(kwargs.get("device")):
            if name in ("tensor", "as_tensor"):  # from Python data: a pageable copy
                self.waits.append(f"torch.{name}(..., device=cuda)")
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _cuda(device) -> bool:
    return device is True or isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


def test_a_partial_tiles_mask_and_the_strategies_orders_reach_a_gpu_without_waiting_for_it() -> None:
    """The block plan's data made on the host (a PARTIAL tile's row bounds, the all-gather's key
    order, the all-to-all's position order) goes to the GPU from pinned memory, queued: a
    PARTIAL tile's mask was a pageable copy from a list, which waits for the GPU's queued
    work, once per tile of every new plan (documents= changing every batch: inside the ring's
    and all-gather's compute loops). Their values are the CPU's."""
    gpu, seq = torch.device("cuda", 0), 64
    tile = blocks.Tile(0, 3, 0, 4, blocks.MaskKind.PARTIAL, rows=((0, 1), (1, 3), (0, 4)))
    documents = make_mask(seq, causal=True, documents=[5, 30, 29])
    layout = ctxpar.get_layout("zigzag", 4)
    for cached in (blocks._rows_bounds, allgather._key_order, alltoall._position_order):
        cached.cache_clear()
    try:
        with HostToGpuCopies() as copies:
            on_gpu = (tile.visible(gpu), allgather._key_order(layout, seq, 1, documents, gpu)[2],
                      *alltoall._position_order(layout, seq, 0, 2, gpu))
    finally:
        for cached in (blocks._rows_bounds, allgather._key_order, alltoall._position_order):
            cached.cache_clear()  # they hold CPU tensors for a GPU
    assert copies.waits == [] and copies.queued == 4
    on_cpu = (tile.visible("cpu"), allgather._key_order(layout, seq, 1, documents, torch.device("cpu"))[2],
              *alltoall._position_order(layout, seq, 0, 2, torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(on_gpu, on_cpu, strict=True))
    assert on_cpu[0].tolist() == [[True, False, False, False], [False, True, True, False], [True] * 4]


def _exact_ops(monkeypatch) -> None:
    """torch's CUDA attention ops replaced by float64 attention on the CPU that takes its
    arguments as each op documents them: flash K/V with fewer heads (GQA) or q's, the efficient
    op K/V with q's heads and its lse padded to 32 rows, cuDNN's lse (B, H, Sq, 1)."""
    def forward(q, k, v, causal, scale):
        out, lse = reference.attention_forward(q.double(), k.double(), v.double(), causal=causal, scale=scale)
        return out.to(q.dtype), lse.float()

    def backward(dout, q, k, v, out, lse, causal, scale):
        grads = reference.attention_backward(dout.double(), q.double(), k.double(), v.double(), out.double(),
                                             lse.double(), causal=causal, scale=scale)
        return [g.to(q.dtype) for g in grads]

    def efficient_forward(q, k, v, bias, compute_lse, dropout, causal, *, scale):
        assert k.shape[1] == v.shape[1] == q.shape[1], "the efficient op takes K/V with q's heads"
        out, lse = forward(q, k, v, causal, scale)
        return out, F.pad(lse, (0, -q.shape[2] % 32), value=1e30), None, None

    def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout, grad_mask, causal, *, scale):
        assert lse.shape[-1] % 32 == 0, "the efficient op reads lse padded to 32 rows"
        return (*backward(dout, q, k, v, out, lse[..., :q.shape[2]], causal, scale), None)

    def cudnn_forward(q, k, v, bias, compute_lse, dropout, causal, debug, *, scale):
        out, lse = forward(q, k, v, causal, scale)
        return out, lse.unsqueeze(-1).contiguous(), *[None] * 7

    def cudnn_backward(dout, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout, causal, *,
                       scale):
        return backward(dout, q, k, v, out, lse[..., 0], causal, scale)

    ops = dict(_flash_fwd=lambda q, k, v, dropout, causal, debug, *, scale: (*forward(q, k, v, causal, scale),
                                                                             *[None] * 7),
               _flash_bwd=lambda dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, seed, offset,
               *, scale: backward(dout, q, k, v, out, lse, causal, scale),
               _eff_fwd=efficient_forward, _eff_bwd=efficient_backward, _cudnn_fwd=cudnn_forward,
               _cudnn_bwd=cudnn_backward)
    for name, op in ops.items():
        monkeypatch.setattr(cuda, name, op)
    for name in ("_flash_aux", "_efficient_aux"):
        monkeypatch.setattr(cuda, name, lambda device, dtype: (None, None))
    monkeypatch.setattr(cuda, "_cudnn_aux", lambda device, dtype: (None, None, None, None, 4))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype, d, op, flash_gqa", [
    (torch.bfloat16, 64, "cudnn", False), (torch.bfloat16, 192, "flash", True), (torch.bfloat16, 192, "flash", False),
    (torch.float32, 64, "efficient", False)])
def test_each_op_handed_its_arguments_gives_the_contracts_attention(dtype, d, op, flash_gqa, kv_heads, causal, gpu,
                                                                     monkeypatch) -> None:
    """What the wrapper hands each op, read as the op reads it, is exact attention: K/V heads
    repeated for their query heads in order (H/H_kv copies of each, not the whole set tiled:
    out 3.8 off), the causal flag and the caller's scale passed on (a flash forward told
    non-causal: out 4.0 off; cuDNN's backward at D^-0.5: dq 3.1 off), cuDNN's lse read as
    (B, H, Sq) (dq 466 off), the efficient backward's lse padded again. At S = 520, no
    multiple of 32 and enough queries for cuDNN to take GQA blocks; scale 0.2."""
    gpu()
    _exact_ops(monkeypatch)
    monkeypatch.setattr(cuda, "_flash_takes_gqa", lambda device, dtype: flash_gqa)
    q, k, v, dout = _block(4, kv_heads, 520, d, dtype)
    assert cuda.op_for(q, k) == op
    want_out, want_lse = reference.attention_forward(q.double(), k.double(), v.double(), causal=causal, scale=0.2)
    want = reference.attention_backward(dout.double(), q.double(), k.double(), v.double(), want_out, want_lse,
                                        causal=causal, scale=0.2)
    out, lse = cuda.attention_forward(q, k, v, causal=causal, scale=0.2)
    grads = cuda.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=0.2)
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (want_out, want_lse, *want)):
        error = float((got.double() - expected).abs().max() / expected.abs().max())
        assert error < 8 * ulp, (name, error)


def test_cudnn_is_used_only_where_its_backward_reads_the_lse_it_is_handed(monkeypatch) -> None:
    """The probe gives cuDNN's backward lse + ln 2 and expects dV halved: a cuDNN that used
    its own lse passed a probe whose tolerance was dV's largest value, and then every block's
    gradient came from the block's lse instead of the merged one."""
    _exact_ops(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    probe = cuda._cudnn_honours_lse.__wrapped__
    assert probe(torch.device("cpu"), torch.bfloat16)
    honest = cuda._cudnn_bwd

    def own_lse(dout, q, k, v, out, lse, *rest, scale):  # rest: the RNG state, lengths, dropout, causal
        own = reference.attention_forward(q.double(), k.double(), v.double(), causal=rest[-1], scale=scale)[1]
        return honest(dout, q, k, v, out, own.float().unsqueeze(-1), *rest, scale=scale)

    monkeypatch.setattr(cuda, "_cudnn_bwd", own_lse)
    assert not probe(torch.device("cpu"), torch.bfloat16)


def test_blocks_of_a_fused_gpu_op_come_back_in_the_inputs_dtype(gpu) -> None:
    """``kernels.partial_dtype`` on a GPU is the op's: bf16 for a fused op (each block's out
    rounded once before the merge, which verify's tolerances count), float32 for the reference
    kernel (D = 20); the accumulation dtype for every block made the bf16 tolerances 6x tight."""
    from types import SimpleNamespace

    from ctxpar import kernels

    gpu()
    for d, dtype in ((64, torch.bfloat16), (192, torch.bfloat16), (20, torch.float32)):
        block = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, shape=(1, 8, 128, d))
        assert kernels.partial_dtype(block) == dtype, d
