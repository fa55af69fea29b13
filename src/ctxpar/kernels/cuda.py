"""torch's fused CUDA attention ops for one block: forward, and backward from the global lse.

Which op computes a block (q's dtype, head dim D, the GPU's compute capability)::

    bf16 / fp16, 64 <= D <= 128, D % 8 == 0,  cudnn     aten._scaled_dot_product_cudnn_attention
        sm80+, where the probe below passes, and
        K/V dense with q's heads or Sq >= 512
    bf16 / fp16, D % 8 == 0, D <= 256, sm80+  flash     aten._scaled_dot_product_flash_attention
    fp32, fp16 (bf16 from sm80), D % 8 == 0   efficient aten._scaled_dot_product_efficient_attention
        (D > 256; every fp16 block before sm80)
    anything else (fp64, odd D, bf16 before   reference ctxpar.kernels.reference, tiled (bounded memory)
        sm80)
    a PARTIAL tile (explicit mask)            reference, tiled: the fused ops here take no mask. Their
                                              share of the work grows as windows and documents
                                              shrink (about half of it at window 128); the efficient
                                              op's attn_bias is the candidate, once measured on a GPU

As torch's own SDPA selects them (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp):
flash and cuDNN run from sm80 (A100) on, the efficient op from sm50 and in bf16 from sm80;
on sm86-89 and sm120-121 the flash backward refuses 192 < D <= 224, which go to the
efficient op. An op turned off (``torch.backends.cuda.enable_flash_sdp(False)``,
``enable_mem_efficient_sdp``, ``enable_cudnn_sdp``) is skipped for the next one down.

cuDNN's op: on an H200 (torch 2.11, cuDNN 9) its forward + backward over one causal
block of 32768 tokens (H=32, D=128, bf16) took 49-54 ms against the flash op's 93-94 ms
(``make gpu-check``, docs/benchmarks.md). It is used only where one probe per device and
dtype (``_cudnn_honours_lse``) finds that it runs and that its backward takes the lse it
is handed (a merged, global lse) rather than one of its own: the gradient from lse + ln 2
must be half the gradient from lse. Elsewhere (other GPUs, builds without it) the flash op.

The fused ops' backwards recompute probabilities as exp(q k^T * scale - lse) and use
rowsum(dout * out) as delta, so, as on CPU, handing them the merged, *global* (out, lse)
yields this block's exact share of the gradient. Their outputs and gradients come back in
q's dtype (bf16 stays bf16; the kernels accumulate in fp32 inside): each block's partial
result is rounded once before the strategies merge and sum blocks in fp32 accumulators,
so a row split over P blocks carries up to P + 1 roundings where single-GPU attention
carries one (``partial_dtype``; the tests allow for it). lse is fp32.

GQA: the flash op takes K/V with fewer heads than Q. Whether this build's op does is
checked once per device against K/V repeated to H heads (``_flash_takes_gqa``); if not,
K/V are repeated per block and dK/dV summed back to H_kv heads in float32, as for the
efficient and cuDNN ops (cuDNN's own GQA is not used: not yet checked on a GPU). The
repeated K/V are a per-call workspace of H/H_kv times the block's K/V, which the planner's
memory model does not count. The efficient op's lse is padded to a multiple of 32 rows;
the global lse handed to its backward is padded the same way.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ctxpar.kernels import reference
from ctxpar.kernels.contract import accumulation_dtype, check_heads, unit_stride

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention.default
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
_eff_fwd = torch.ops.aten._scaled_dot_product_efficient_attention.default
_eff_bwd = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
_cudnn_fwd = torch.ops.aten._scaled_dot_product_cudnn_attention.default
_cudnn_bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
_LSE_ROWS = 32  # the efficient op pads lse rows to a multiple of this
# cuDNN's op is called here with K/V dense and with q's heads: a decode step's K/V (a view of
# the cache, H_kv heads) would be copied whole, repeated to H heads, for every query token of
# every layer, where the flash op reads them in place. The copy writes and reads back about
# 8 x Sk x H x D bytes per call; cuDNN's forward saves about half the flash op's
# 4 x Sq x Sk x H x D FLOPs: at the H200's 4.1 TB/s copy rate and the flash forward's
# ~350 TFLOP/s the copy costs more below ~380 queries (an estimate; not measured).
_CUDNN_COPY_MIN_QUERIES = 512


def op_for(q: torch.Tensor, k: torch.Tensor | None = None) -> str:
    """"cudnn" | "flash" | "efficient" | "reference": which op computes blocks like ``q`` (see
    above) against keys like ``k`` (None: dense, with q's heads). Not cuDNN for a single key
    (its backward refused one query against one key on the H200; torch's own SDPA never gives
    it one key), nor where the user turned it off or asked for deterministic algorithms, which
    torch does not count it among, nor where it would copy K/V for too few queries
    (``_CUDNN_COPY_MIN_QUERIES``)."""
    d, capability = q.shape[-1], _capability(q.device)
    if q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and capability >= (8, 0):
        copies_kv = k is not None and (k.shape[1] != q.shape[1] or not k.is_contiguous())
        if (64 <= d <= 128 and (k is None or k.shape[2] != 1) and torch.backends.cuda.cudnn_sdp_enabled()
                and not torch.are_deterministic_algorithms_enabled()
                and not (copies_kv and q.shape[2] < _CUDNN_COPY_MIN_QUERIES) and _cudnn_honours_lse(q.device, q.dtype)):
            return "cudnn"
        flash_backward_refuses = 192 < d <= 224 and ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1))
        if d <= 256 and torch.backends.cuda.flash_sdp_enabled() and not flash_backward_refuses:
            return "flash"
    dtype_runs = q.dtype in (torch.float32, torch.float16) or q.dtype == torch.bfloat16 and capability >= (8, 0)
    if dtype_runs and d % 8 == 0 and capability >= (5, 0) and torch.backends.cuda.mem_efficient_sdp_enabled():
        return "efficient"
    return "reference"


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability, asked once per device (op_for runs for every block)."""
    return torch.cuda.get_device_capability(device)


def partial_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype a block's out and gradients come back in: q's for the fused ops."""
    return accumulation_dtype(q.dtype) if op_for(q) == "reference" else q.dtype


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H, S, D), each KV head repeated for its query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H_kv, S, D): the gradient of ``_repeat_kv``, summed in float32 (or
    wider) and returned so, like the CPU kernels' gradients: no second rounding per block."""
    b, h, s, d = t.shape
    if h == kv_heads:
        return t
    return t.view(b, kv_heads, h // kv_heads, s, d).sum(2, dtype=accumulation_dtype(t.dtype))


@functools.lru_cache(maxsize=None)
def _flash_aux(device: torch.device, dtype: torch.dtype) -> tuple:
    """What the flash backward takes besides tensors: the (unused, dropout 0) RNG state
    its forward returns, from one tiny forward."""
    x = torch.zeros(1, 1, 8, 8, device=device, dtype=dtype)
    _, _, _, _, _, _, seed, offset, _ = _flash_fwd(x, x, x, 0.0, False, False, scale=1.0)
    return seed, offset


@functools.lru_cache(maxsize=None)
def _efficient_aux(device: torch.device, dtype: torch.dtype) -> tuple:
    x = torch.zeros(1, 1, 8, 8, device=device, dtype=dtype)
    _, _, seed, offset = _eff_fwd(x, x, x, None, True, 0.0, False, scale=1.0)
    return seed, offset


@functools.lru_cache(maxsize=None)
def _flash_takes_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the flash op gives K/V with fewer heads the same result as K/V repeated."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 4, 16, 8, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, 2, 16, 8, device=device, dtype=dtype, generator=gen) for _ in range(2))
    try:
        grouped = _flash_fwd(q, k, v, 0.0, True, False, scale=0.3)[0]
    except RuntimeError:
        return False
    repeated = _flash_fwd(q, _repeat_kv(k, 4), _repeat_kv(v, 4), 0.0, True, False, scale=0.3)[0]
    return bool(torch.equal(grouped, repeated))


def _forward_layout(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (B, H, Sq, D) in ``dtype``, laid out in memory as (B, Sq, H, D) as the efficient
    forward returns it (one copy at most). For bf16/fp16 the efficient backward's kernel
    computes rowsum(dout * out) itself, taking out's batch and head strides from the tensor
    but its row stride as H * D whatever the tensor says (``o_strideM`` in torch's
    mem_eff_attention/kernel_backward.h): the rows of a dense (B, H, S, D) out that the
    strategies hand over would be read as other rows, giving wrong dQ and dK without an
    error. For float32 torch computes that sum from the real strides."""
    if dtype == torch.float32:
        return unit_stride(out.to(dtype))
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format).contiguous().transpose(1, 2)


def _cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """cuDNN's forward on dense tensors with K/V repeated to H heads: (out, lse (B, H, Sq), rest)."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    out, lse, *rest = _cudnn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False,
                                 scale=scale)
    return out, lse.reshape(q.shape[:3]), rest


def _cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """cuDNN's backward from a given (out, lse); dk, dv with H_kv heads."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = _repeat_kv(k, heads).contiguous(), _repeat_kv(v, heads).contiguous()
    seed, offset, cum_q, cum_k, lse_dims = _cudnn_aux(q.device, q.dtype)
    lse = lse.float().reshape(*q.shape[:3], *([1] if lse_dims == 4 else [])).contiguous()
    dq, dk, dv = _cudnn_bwd(dout.contiguous(), q.contiguous(), k, v, out.contiguous(), lse, seed, offset, None,
                            cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, scale=scale)
    return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)


@functools.lru_cache(maxsize=None)
def _cudnn_aux(device: torch.device, dtype: torch.dtype) -> tuple:
    """What cuDNN's backward takes besides tensors, from one tiny forward: the (unused, dropout
    0) RNG state, the (empty: no packed sequences) cumulative lengths, and the lse's rank."""
    x = torch.zeros(1, 1, 64, 64, device=device, dtype=dtype)
    _, lse, cum_q, cum_k, _, _, seed, offset, _ = _cudnn_fwd(x, x, x, None, True, 0.0, False, False, scale=1.0)
    return seed, offset, cum_q, cum_k, lse.dim()


@functools.lru_cache(maxsize=None)
def _cudnn_honours_lse(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's op runs here and its backward uses the lse it is handed: from lse + ln 2
    every probability halves, and with it dV (delta = rowsum(dout * out) is unchanged)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 128, 64, device=device, dtype=dtype, generator=gen) for _ in range(4))
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    try:  # any failure (an op missing from this build, an output list of another length, a CUDA error) means no
        out, lse, _ = _cudnn_forward(q, k, v, True, 0.125)
        dv = _cudnn_backward(dout, q, k, v, out, lse, True, 0.125)[2].float()
        dv_half = _cudnn_backward(dout, q, k, v, out, lse + math.log(2.0), True, 0.125)[2].float()
        flash = _flash_fwd(q, k, v, 0.0, True, False, scale=0.125)
        same_forward = bool(torch.allclose(out.float(), flash[0].float(), rtol=2 * ulp, atol=2 * ulp)
                            and torch.allclose(lse, flash[1].float(), rtol=1e-4, atol=1e-4))
        halves = bool(torch.allclose(dv_half, dv / 2, rtol=2 * ulp, atol=2 * ulp * float(dv.abs().max())))
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001
        return False
    return same_forward and halves


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel contract (see ``ctxpar.kernels``); out in q's dtype, lse float32 (B, H, Sq)."""
    check_heads(q, k, v)
    op = op_for(q, k)
    if op == "reference" or mask is not None:
        return reference.attention_forward(q, k, v, causal=causal, scale=scale, mask=mask)
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    heads = q.shape[1]
    if op == "cudnn":
        out, lse = _cudnn_forward(q, k, v, causal, scale)[:2]
    elif op == "flash":
        if not _flash_takes_gqa(q.device, q.dtype):
            k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
        out, lse = _flash_fwd(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = _eff_fwd(q, _repeat_kv(k, heads), _repeat_kv(v, heads), None, True, 0.0, causal, scale=scale)[:2]
        lse = lse[:, :, : q.shape[2]]
    # A row whose keys all scored -inf (no mass): FlashAttention-2 gives it out 0 and lse +inf, which
    # merges as "no defined softmax" (NaN); the efficient kernel lse -inf and out NaN (0 x 1/0), which
    # poisons the merged row. The contract's no-mass row is out 0, lse -inf. A NaN or +inf score
    # leaves out NaN and lse NaN or +inf, so those rows keep them.
    lse = lse.masked_fill_(torch.isposinf(lse) & (out == 0).all(-1), float("-inf"))
    return out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0), lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel contract; ``out`` and ``lse`` are the global (merged) values for these rows.
    Gradients in q's dtype; dk, dv with H_kv heads."""
    check_heads(q, k, v)
    op = op_for(q, k)
    if op == "reference" or mask is not None:
        return reference.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask)
    if op == "cudnn":
        return _cudnn_backward(dout, q, k, v, out.to(q.dtype), lse, causal, scale)
    heads, kv_heads = q.shape[1], k.shape[1]
    dout, q, k, v = (unit_stride(t) for t in (dout, q, k, v))
    lse = lse.float().contiguous()  # a slice of the global lse: the ops index it as dense (B, H, Sq)
    if op == "flash":
        out = unit_stride(out.to(q.dtype))
        seed, offset = _flash_aux(q.device, q.dtype)
        if not _flash_takes_gqa(q.device, q.dtype):
            k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
        dq, dk, dv = _flash_bwd(dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
                                seed, offset, scale=scale)
        return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)
    seed, offset = _efficient_aux(q.device, q.dtype)
    out = _forward_layout(out, q.dtype)
    rows = -(-q.shape[2] // _LSE_ROWS) * _LSE_ROWS
    lse = F.pad(lse, (0, rows - q.shape[2]))
    dq, dk, dv, _ = _eff_bwd(dout, q, _repeat_kv(k, heads), _repeat_kv(v, heads), None, out, lse, seed, offset,
                             0.0, [True, True, True, False], causal, scale=scale)
    return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)
