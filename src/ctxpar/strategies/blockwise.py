"""One rank's attention work against one key/value shard, following the block plan.

Every strategy reduces to these two loops; they differ only in how the K/V shards
(and dK/dV) reach the rank. Benchmarks call them directly to time a rank's work
without communication.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from ctxpar import kernels, profile
from ctxpar.blocks import MaskKind, Tile
from ctxpar.merge import merge_into


def first_order_only(backward):
    """``once_differentiable`` for an attention backward. Its gradients depend on q, k and v,
    so under ``create_graph=True`` they always get a node that refuses to be differentiated
    ("differentiate twice"), as single-process SDPA refuses. once_differentiable adds that
    node only where an incoming gradient requires grad: with a loss linear in the output
    (``out.sum()``) the gradients came back detached and a gradient penalty on them
    silently added nothing."""
    once = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():  # a backward with create_graph=True
            grads = tuple(g.detach().requires_grad_() if isinstance(g, torch.Tensor) else g for g in grads)
        return once(ctx, *grads)

    return wrapper


def output_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) to merge partials into: zeros (B, H, S, D) and -inf (B, H, S), in the
    accumulation dtype (float32, or float64 for float64 inputs)."""
    acc = kernels.accumulation_dtype(q.dtype)
    return (torch.zeros(q.shape, dtype=acc, device=q.device),
            torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device))


def stacked_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as one dense (2, B, H_kv, S, D) tensor: one message per transfer. Not
    ``torch.stack``, which keeps its inputs' memory format: K/V with heads innermost
    (channels_last memory) stacked into a tensor no transfer can send."""
    kv = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
    kv[0].copy_(k)
    kv[1].copy_(v)
    return kv


def gradient_accumulators(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed dQ (B, H, S, D) and dK/dV stacked (2, B, H_kv, S, D), accumulation dtype."""
    acc = kernels.accumulation_dtype(q.dtype)
    return (torch.zeros(q.shape, dtype=acc, device=q.device),
            torch.zeros((2, *k.shape), dtype=acc, device=k.device))


def finish_forward(ctx, q, k, v, sinks, acc_out: torch.Tensor, acc_lse: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The end of every strategy's forward: the sinks (if any) merged in; ``out`` in q's
    dtype; out, lse and the inputs saved for the backward. lse (accumulation dtype) stays
    in the graph, so that a loss built on it reaches the backward and is refused there
    (``refuse_lse_gradient``) instead of silently contributing nothing.

    A sink is one more term exp(sink_h) in each row's softmax denominator with no value:
    merging it is merging a partial with out 0 and lse sink_h. The backward then hands
    the kernels the final (out, lse), which is all they need for exact dQ, dK, dV.
    """
    if sinks is not None:  # merging a partial with out 0: only the rescaling is left
        lse = torch.logaddexp(acc_lse, sinks.to(acc_lse.dtype).view(1, -1, 1))
        acc_out.mul_(torch.exp(acc_lse - lse).unsqueeze(-1))
        acc_lse.copy_(lse)
    out = acc_out.to(q.dtype)
    ctx.save_for_backward(q, k, v, sinks, out, acc_lse)
    ctx.set_materialize_grads(False)  # an lse nobody differentiated arrives as None
    return out, acc_lse


def saved_for_backward(ctx) -> tuple[torch.Tensor, ...]:
    """What ``finish_forward`` saved: q, k, v, sinks, out and the merged lse, in which a row
    whose keys all scored -inf (no mass anywhere: lse -inf, out 0) reads +inf, so that the
    kernels' probabilities exp(s - lse) are 0 rather than exp(-inf + inf) = NaN."""
    q, k, v, sinks, out, lse = ctx.saved_tensors
    return q, k, v, sinks, out, lse.masked_fill(torch.isneginf(lse), float("inf"))


def refuse_lse_gradient(dlse: torch.Tensor | None) -> None:
    """No strategy differentiates the lse it returns (its gradient would change every
    kernel's backward); a loss that uses it is refused rather than left without that term."""
    if dlse is not None:
        raise RuntimeError("a gradient reached the lse returned by ctxpar.attention_with_lse, which is not "
                           "differentiable: a loss term on it would add nothing to the gradients of q, k and v. "
                           "Use lse.detach() where it only weighs or inspects, or compute the term from the "
                           "attention scores of an unsplit reference")


def sink_gradient(sinks, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor | None:
    """d loss / d sinks from this rank's rows, (H,): a sink's probability is
    exp(sink - lse) and d out / d sink = -p_sink * out, so the gradient is
    -sum over rows of p_sink * (dout . out). None without sinks."""
    if sinks is None:
        return None
    c = lse.dtype
    p_sink = torch.exp(sinks.to(c).view(1, -1, 1) - lse)  # (B, H, S)
    return -(p_sink * (dout.to(c) * out.to(c)).sum(-1)).sum((0, 2)).to(sinks.dtype)


def forward_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: tuple[Tile, ...],
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    scale: float,
) -> None:
    """Attend ``q`` to ``(k, v)`` block by block and merge into the accumulators.

    Args:
        q: (B, H, Sq, D) local queries; k, v: (B, H_kv, Sk, D) one key/value shard.
        blocks: the plan between the two shards (``ctxpar.blocks``).
        acc_out: (B, H, Sq, D), acc_lse: (B, H, Sq), in the accumulation dtype
            (``kernels.accumulation_dtype``), updated in place.
    """
    for block in blocks:
        qs, ks, causal, mask = block.kernel_args(q.device)
        if block.kind is MaskKind.ANTI_CAUSAL:  # the causal tile on rows and keys in reverse order
            out, lse = kernels.attention_forward(*_reversed(q[:, :, qs], k[:, :, ks], v[:, :, ks]), causal=True,
                                                 scale=scale)
            out, lse = _reversed(out, lse)
        else:
            out, lse = kernels.attention_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal=causal, scale=scale,
                                                 mask=mask)
        merge_into(acc_out[:, :, qs], acc_lse[:, :, qs], out, lse)


def _reversed(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (B, H, S, ...) tensor with its rows (dim 2) in reverse order: a copy, O(S*D)."""
    return tuple(t.flip(2) for t in tensors)


def backward_tiles(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blocks: tuple[Tile, ...],
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Add this shard's share of the gradients into ``dq``, ``dk``, ``dv`` (accumulation dtype).

    Args:
        dout, out: (B, H, Sq, D) and lse (B, H, Sq): the *global* (merged) values.
        dq: (B, H, Sq, D); dk, dv: (B, H_kv, Sk, D), updated in place.
    """
    for block in blocks:
        qs, ks, causal, mask = block.kernel_args(q.device)
        tile = (dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs])
        if block.kind is MaskKind.ANTI_CAUSAL:
            g_q, g_k, g_v = _reversed(*kernels.attention_backward(*_reversed(*tile), causal=True, scale=scale))
        else:
            g_q, g_k, g_v = kernels.attention_backward(*tile, causal=causal, scale=scale, mask=mask)
        dq[:, :, qs].add_(g_q)
        dk[:, :, ks].add_(g_k)
        dv[:, :, ks].add_(g_v)


class LocalAttention(torch.autograd.Function):
    """Attention of ``q`` to keys held on this rank, tile by tile: (out, lse), differentiable
    in q, k, v. The all-to-all strategy's compute between its two exchanges."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, tiles: tuple[Tile, ...], scale: float):
        acc_out, acc_lse = output_accumulators(q)  # (B, H, S, D), (B, H, S)
        with profile.timed("compute", q.device):
            forward_tiles(q, k, v, tiles, acc_out, acc_lse, scale)
        ctx.tiles, ctx.scale = tiles, scale
        return finish_forward(ctx, q, k, v, sinks, acc_out, acc_lse)

    @staticmethod
    @first_order_only
    def backward(ctx, dout, dlse):
        refuse_lse_gradient(dlse)
        q, k, v, sinks, out, lse = saved_for_backward(ctx)
        dout = dout.contiguous()
        dq, dkv = gradient_accumulators(q, k)
        with profile.timed("compute", q.device):
            backward_tiles(dout, q, k, v, out, lse, ctx.tiles, ctx.scale, dq, dkv[0], dkv[1])
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), sink_gradient(sinks, dout, out, lse),
                None, None)
