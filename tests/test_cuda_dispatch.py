"""``kernels/cuda.py`` without a GPU: what each of torch's CUDA ops is handed, with the op
replaced by a stand-in that reads its arguments as torch's kernel does (tests/test_cuda.py
runs the real ops where there is a GPU)."""

from __future__ import annotations

import pytest
import torch

from ctxpar.kernels import cuda


def _block(h: int, hkv: int, s: int, d: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, h, s, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, hkv, s, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


@pytest.mark.parametrize("handed", ["dense", "rows of a dense out", "float32", "as the forward returns it"])
def test_the_efficient_backward_reads_the_out_it_is_handed(handed: str, monkeypatch) -> None:
    """bf16 at D = 264 (the efficient op): its kernel reads out's rows H * D apart whatever the
    tensor's strides (kernel_backward.h: o_strideM() = head_dim_value * num_heads); what it
    reads so must be the out the strategies handed over, e.g. rows of their dense (B, H, S, D)
    merged out."""
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
    assert cuda.op_for(q, k.shape[2]) == "efficient"
    dq, dk, dv = cuda.attention_backward(dout, q, k, v, given[handed], torch.zeros(1, 4, 40), causal=True, scale=0.1)
    assert torch.equal(read[0], out)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
