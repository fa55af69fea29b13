"""Decode: one new token per sequence over the sharded KV cache, exactly.

The new token's q, k, v are tiny (one position), so every rank computes them: the whole
model runs replicated on the (B, 1) tokens. Attention is the only part that needs every
rank: the query must see the keys of all of them. So at each layer

    1. the rank that owns the new position (``cache.owner``) writes its k, v to its shard;
    2. every rank attends the query to its own shard with the local kernel, giving a
       partial (out, lse) normalised over its keys (a rank holding none gives lse = -inf);
    3. one all-gather of the P partials, (B, H, 1, D + 1) float32 each, and every rank
       merges them in rank order with the online-softmax identity (``ctxpar.merge``).

Nothing of the cache moves; the traffic per layer is P * B * H * (D + 1) * 4 bytes
whatever the context length. Every rank merges the same numbers in the same order, so
the logits, and hence greedy or seeded sampling, are bit-identical on every rank.

Before any of that, one tiny all-gather per step compares the ranks' positions and
tokens: a rank a step ahead or behind, or sampling another token, makes every rank
raise instead of silently mixing K/V of different sequences.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ctxpar import agreement, kernels, limits, topology
from ctxpar.attention import SUPPORTED_DTYPES, as_sdpa_under_autocast, check_scale, check_sinks
from ctxpar.inference.cache import SHARD_FULL_WHY, KVCache
from ctxpar.inference.hooks import attention_replaced, check_cache, check_model_fits
from ctxpar.inference.prefill import check_tokens, is_dense
from ctxpar.merge import merge_packed
from ctxpar.parallelize import SAME_MODEL, model_code


def decode_step(model: nn.Module, cache: KVCache, tokens: torch.Tensor, *,
                check_consistency: bool = True) -> torch.Tensor:
    """Feed one token per sequence at the next position; append its K/V to the cache.

    Args:
        model: the reference ``ctxpar.models.Transformer`` that prefilled ``cache``.
        cache: the ``KVCache`` after ``prefill`` (and earlier decode steps).
        tokens: (B,) or (B, 1) token ids for position ``cache.seq_len``, the same on
            every rank.
        check_consistency: compare the ranks' positions and tokens first (one tiny
            all-gather per step); turn off only on every rank at once.

    Returns:
        (B, vocab) logits for the following position, in the model's dtype, identical
        on every rank.

    Raises:
        ValueError: decoding before prefill, a full cache, a batch or shape mismatch,
            ranks at different steps or with different tokens: on every rank, before
            any K/V is written.
    """
    check_cache(cache)
    modules = None
    with agreement.Refusal() as refusal:
        limits.check_flag("check_consistency", check_consistency)
        tokens, modules = _check(model, cache, tokens)
    refusal.join(lambda: _signature(model, cache, tokens, modules), cache.group, "decode step",
                 world_size=cache.world_size, check_consistency=check_consistency)

    position = cache.seq_len
    mine = cache.owner(position) == cache.rank
    slot = cache.length
    held = slot + int(mine)
    scale = cache.head_dim**-0.5  # the model's SDPA default
    peers = topology.from_group(cache.group, "decode_step")

    def make(layer: int):
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q (B, H, 1, D); k, v (B, H_kv, 1, D), the new position's, after RoPE
            if mine:
                cache.write(layer, slot, k, v)
            return sharded_attention_over(q, cache.keys(layer, held), cache.values(layer, held), peers, scale=scale)
        return attend

    pos = torch.tensor([position], device=cache.device)
    with torch.no_grad(), attention_replaced(model, make, modules):
        logits = model(tokens, pos)[:, -1]  # (B, vocab)
    cache.commit(pos if mine else pos[:0], seq_len=position + 1, tokens=tokens)
    return logits


@as_sdpa_under_autocast
def sharded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | None,
                      scale: float | None, sinks: torch.Tensor | None = None, mesh=None,
                      check_consistency: bool = True) -> torch.Tensor:
    """Attention of queries every rank shares to keys spread over the ranks of ``group``.

    Args:
        q: (B, H, S, D), the same on every rank; each query sees every key (the keys
            are earlier positions, or the query's own).
        k, v: (B, H_kv, n, D) this rank's keys and values, q's dtype and device; n may
            differ between ranks, and be 0.
        group: the ranks holding the keys (None: WORLD, or one process without one).
        scale: the softmax scale (None: D ** -0.5).
        sinks: None, or (H,) sink logits (gpt-oss's): one more term per head in each
            softmax's denominator, with no value, as in ``ctxpar.attention``.
        mesh: instead of ``group``, a hybrid 2D DeviceMesh (``ctxpar.attention``'s): its
            ranks hold the keys.
        check_consistency: the ranks first compare their calls (one tiny all-gather: q's
            shape, dtype and values, the key shapes but n, scale, sinks), so a rank whose
            inputs are invalid or differ makes every rank raise instead of leaving the
            others waiting or merging partials of different queries; turn off only on
            every rank at once.

    Returns:
        (B, H, S, D) in q's dtype, identical on every rank: softmax over the keys of
        all ranks, from one all-gather of the partial (out, lse).

    Raises:
        ValueError: bad input (shapes that do not fit, dtypes, devices, scale, sinks), q,
            k, v or sinks that require grad under grad mode (it is inference only: no
            gradient flows through the all-gather), or ranks that disagree: before the
            all-gather, on every rank together; both group and mesh.
    """
    peers = topology.of(group, mesh, "sharded_attention")
    with agreement.Refusal() as refusal:
        limits.check_flag("check_consistency", check_consistency)
        scale = _check_inputs(q, k, v, scale, sinks)
    refusal.join(lambda: _attention_signature(q, k, v, scale, sinks), peers.process_groups, "sharded attention",
                 world_size=peers.world_size, check_consistency=check_consistency)
    return _merged_attention(q, k, v, peers, scale, sinks)


@as_sdpa_under_autocast
def sharded_attention_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, peers: topology.Topology, *,
                           scale: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``sharded_attention`` over the ranks of ``peers`` (a group's or a mesh's, resolved
    once by a caller that attends at every layer, and that has made the ranks agree on
    the call it runs, as a decode step does), without an exchange of its own."""
    return _merged_attention(q, k, v, peers, _check_inputs(q, k, v, scale, sinks), sinks)


def _merged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, peers: topology.Topology, scale: float,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    acc = kernels.accumulation_dtype(q.dtype)
    if k.shape[2]:
        out, lse = kernels.attention_forward(q, k, v, causal=False, scale=scale)  # (B, H, S, D), (B, H, S)
    else:  # no keys here: contributes nothing to the merge
        out, lse = q.new_zeros(q.shape, dtype=acc), q.new_full(q.shape[:-1], float("-inf"), dtype=acc)
    packed = torch.cat([out.to(acc), lse.to(acc).unsqueeze(-1)], dim=-1)  # (B, H, S, D+1)
    out, lse = merge_packed(topology.all_gather(packed, peers))  # of (P, B, H, S, D+1), in layout order
    if sinks is not None:  # merging a partial with out 0: only the rescaling is left
        out = out * torch.exp(lse - torch.logaddexp(lse, sinks.to(acc).view(1, -1, 1))).unsqueeze(-1)
    return out.to(q.dtype)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                  sinks: torch.Tensor | None) -> float:
    """Shapes, dtypes, devices and sinks of a sharded attention call; returns its scale."""
    if not all(is_dense(t) and t.dim() == 4 for t in (q, k, v)):
        raise ValueError("sharded_attention takes dense 4-D tensors: q (B, H, S, D), k and v (B, H_kv, n, D)")
    if (k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or not k.shape[1]
            or q.shape[1] % k.shape[1]):
        raise ValueError(f"sharded_attention: q {tuple(q.shape)} and k, v {tuple(k.shape)}, {tuple(v.shape)} must "
                         f"share batch and head dim, k and v one shape, and H a multiple of H_kv (GQA)")
    if 0 in q.shape:
        raise ValueError(f"sharded_attention: q {tuple(q.shape)} is empty; every dim of (B, H, S, D) must be >= 1 "
                         f"(only a rank's number of keys n may be 0)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"sharded_attention: q, k, v are {q.dtype}, {k.dtype}, {v.dtype}; they must share one "
                         f"of {', '.join(map(str, SUPPORTED_DTYPES))}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"sharded_attention: q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    check_sinks(sinks, q)
    flags = agreement.grad_flags(q, k, v, sinks)
    if flags:  # the all-gather cuts the graph and the kernel's lse has no gradient: a backward would be wrong
        raise ValueError(f"sharded_attention is inference only, but grad mode is on and "
                         f"{agreement.grad_names(flags)} set requires_grad, which would get no exact gradient; call "
                         f"it under torch.no_grad() or torch.inference_mode(), or use ctxpar.attention for training")
    return check_scale(scale, q)


def _attention_signature(q, k, v, scale, sinks) -> dict[str, agreement.Value]:
    """What every rank's sharded attention call must share (-1 where unreadable); the
    number of keys is each rank's own."""
    def dim(t, i: int) -> int:
        return agreement.readable(lambda: int(t.shape[i]) if t.dim() == 4 else -1)

    return {
        **{f"q {name}": dim(q, i) for i, name in enumerate(("batch", "heads", "queries", "head dim"))},
        "k/v heads": dim(k, 1),
        "dtype": agreement.Text(getattr(q, "dtype", "?")),
        "q values (crc32)": agreement.readable(lambda: agreement.values_code(q)),
        "scale": agreement.Real(scale),
        "sinks (crc32)": 0 if sinks is None else agreement.readable(lambda: agreement.values_code(sinks)),
    }


def _check(model: nn.Module, cache: KVCache, tokens) -> tuple[torch.Tensor, list[nn.Module]]:
    """The tokens as (B, 1), and the model's attention modules."""
    modules = check_model_fits(model, cache)
    if cache.prompt_len == 0:
        raise ValueError("decode before prefill: the KV cache holds no prompt; call prefill(model, cache, prompt, "
                         "...) first")
    if is_dense(tokens) and tokens.dim() == 1:
        tokens = tokens.unsqueeze(1)  # (B, 1)
    one_each = "a decode step takes one token per sequence, (B,) or (B, 1), got {}"
    if is_dense(tokens) and tokens.dim() != 2:  # a 0-d token (argmax() of one row) was told "(B, n) ... per prompt"
        raise ValueError(one_each.format(tuple(tokens.shape)) + (" (one sequence's: tokens.view(1))"
                                                                 if tokens.dim() == 0 else ""))
    check_tokens(tokens, cache, model.cfg.vocab, "decode tokens")
    if tokens.shape[1] != 1:
        raise ValueError(one_each.format(tuple(tokens.shape)))
    if cache.seq_len >= cache.capacity:
        raise ValueError(f"the KV cache is full: {cache.seq_len} positions = its capacity; build it with capacity "
                         f">= prompt + new tokens")
    if cache.owner(cache.seq_len) == cache.rank and cache.length >= cache.local_capacity:
        raise ValueError(f"rank {cache.rank}'s KV cache shard is full ({cache.length} of its {cache.local_capacity} "
                         f"slots) though the sequence is not: {SHARD_FULL_WHY}")
    return tokens, modules


def _signature(model: nn.Module, cache: KVCache, tokens, modules: list[nn.Module] | None
               ) -> dict[str, agreement.Value]:
    """Every rank must be at the same step of the same sequence, dealt alike, with the same tokens."""
    ok = is_dense(tokens)
    return {
        "position (prompt + steps)": cache.seq_len,
        "sequence so far (crc32)": cache.history,
        "prompt dealt by": agreement.Text(cache.dealt_by),
        SAME_MODEL: model_code(model, modules),
        "capacity": cache.capacity,
        "batch": tokens.shape[0] if ok and tokens.dim() else -1,
        "dtype": agreement.Text(cache.dtype),
        "tokens (crc32)": agreement.readable(lambda: agreement.tensor_code(tokens, torch.int64)) if ok else -1,
    }
