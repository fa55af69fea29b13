"""Prefill: the model's forward over a prompt sharded by a layout, filling the KV cache.

Each rank runs the model on its T/P prompt tokens (RoPE from their global positions);
every attention layer keeps this rank's K/V (after RoPE) in the cache, then attends
with ``ctxpar.attention``, exactly as in training: any layout, any strategy (hybrid
with its mesh), or ``"auto"``, which ``ctxpar.attention`` resolves at every layer from
the planner's cost model (``ctxpar.auto``), alike on every rank. Sampling needs the
logits of the last position only, which one rank holds: it alone applies the LM head to
that row and broadcasts the (B, vocab) logits, so every rank samples the same token from
the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ctxpar import agreement, comm, limits, strategy_rules, topology
from ctxpar.attention import attention
from ctxpar.inference.cache import KVCache
from ctxpar.inference.hooks import attention_replaced, check_cache, check_model_fits
from ctxpar.layout import Layout, fingerprint, get_layout
from ctxpar.parallelize import SAME_MODEL, SAME_WEIGHTS, model_code, weights_code

INFERENCE_STRATEGIES = strategy_rules.CALL_STRATEGIES


def prefill(model: nn.Module, cache: KVCache, prompt: torch.Tensor, *, layout: str | Layout,
            strategy: str = "ring", mesh=None, check_consistency: bool = True) -> torch.Tensor:
    """Run the prompt through the model over the cache's CP group, filling the cache.

    Args:
        model: the reference ``ctxpar.models.Transformer``, the same weights on every rank.
        cache: an empty ``KVCache`` on the CP group (its group is the one attention uses).
        prompt: (B, T) token ids, the whole prompt, the same on every rank; each rank
            takes its own positions with ``layout``.
        layout: ``"contiguous" | "zigzag" | "striped"`` or a ``Layout`` for the group's P;
            T must suit it (its error says how to pad).
        strategy: ``"ring" | "allgather" | "alltoall" | "hybrid" | "auto"``
            (``ctxpar.attention``'s; "auto": the planner picks among ring, allgather and
            alltoall at each layer, ``ctxpar.record()`` lists the choices).
        mesh: hybrid only: the 2D DeviceMesh ("ulysses", "ring") over the cache's ranks;
            each rank takes the prompt positions of its place in the mesh
            (``topology.hybrid_rank``), and keeps them in the cache.
        check_consistency: the ranks first compare their calls (one tiny all-gather), so
            a rank whose inputs are invalid or differ makes every rank raise instead of
            leaving the others waiting; and each attention call checks its own.

    Returns:
        (B, vocab) logits of position T-1 in the model's dtype, identical on every rank.

    Raises:
        ValueError: bad input (prompt longer than the cache, batch or shape mismatch, a
            length the layout cannot split, a filled cache, ...), before any collective;
            with ``check_consistency`` on every rank together.
    """
    check_cache(cache)
    layout_rank = cache.rank
    with agreement.Refusal() as refusal:
        limits.check_flag("check_consistency", check_consistency)
        layout, layout_rank = _check(model, cache, prompt, layout, strategy, mesh)
    refusal.join(lambda: _signature(model, cache, prompt, layout, strategy), cache.group, "prefill",
                 world_size=cache.world_size, check_consistency=check_consistency)

    seq_len = prompt.shape[1]
    positions = layout.positions(seq_len, layout_rank, device=prompt.device)  # (T/P,) global, for RoPE
    tokens = layout.shard(prompt, layout_rank, dim=1)  # (B, T/P)
    groups = dict(mesh=mesh) if strategy == "hybrid" else dict(group=cache.group)
    # hybrid: the rank in the cache's group at each place of the layout
    group_ranks = [topology.hybrid_group_rank(mesh, place, cache.group) for place in range(cache.world_size)
                   ] if strategy == "hybrid" else []

    def make(layer: int):
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write(layer, 0, k, v)  # (B, H_kv, T/P, D), after RoPE
            return attention(q, k, v, layout=layout, strategy=strategy, causal=True,
                             check_consistency=check_consistency, **groups)
        return attend

    with torch.no_grad(), attention_replaced(model, make):
        hidden = model.hidden_states(tokens, positions)  # (B, T/P, d)
        owner = last_position_owner(layout, seq_len)
        logits = last_logits(model, hidden, group_ranks[owner] if group_ranks else owner, cache)
    cache.commit(positions, seq_len=seq_len, tokens=prompt)
    cache.dealt_by = fingerprint(layout) + (f", hybrid mesh places of ranks {group_ranks}" if group_ranks else "")
    return logits


def last_position_owner(layout: Layout, seq_len: int) -> int:
    """The rank holding position T-1 (contiguous, striped: P-1; zigzag: 0)."""
    return next(r for r in range(layout.world_size) if int(layout.positions(seq_len, r)[-1]) == seq_len - 1)


def is_dense(t: object) -> bool:
    """Whether ``t`` is a dense (strided) tensor, whose shape and values can be read: not a
    nested one (prompts of several lengths), nor a sparse one."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested


def check_dense_tokens(tokens: object, what: str, dims: str) -> None:
    """Refuse token ids that are not a dense 2-D tensor (``dims`` names its two dims), naming
    what they are: torch's own errors came from deep inside for nested and sparse ones."""
    if is_dense(tokens) and tokens.dim() == 2:
        return
    if not isinstance(tokens, torch.Tensor):
        got = type(tokens).__name__
    elif tokens.is_nested:
        got = "a nested tensor (of several lengths); make one call per length"
    elif tokens.layout != torch.strided:
        got = f"a {str(tokens.layout).removeprefix('torch.')} tensor; convert it with .to_dense()"
    else:
        got = tuple(tokens.shape)
    raise ValueError(f"{what}: expected token ids as a dense {dims} tensor, one length for every prompt, got {got}")


def check_tokens(tokens: object, cache: KVCache, vocab: int, what: str) -> None:
    """Token ids: a dense 2-D integer tensor (B, n) on the cache's device, B = the cache's
    batch, every id a row of the embedding."""
    check_dense_tokens(tokens, what, "(B, n)")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what}: expected integer token ids (int64), got {tokens.dtype}")
    if tokens.shape[0] != cache.batch:
        if what == "decode tokens" and tokens.shape == (1, cache.batch) and cache.batch > 1:
            fix = f"pass them as (B, n) = ({cache.batch}, 1) or (B,), one token per sequence, not (1, B)"
        elif tokens.shape[0] == 0:
            fix = "pass at least one sequence"
        else:
            fix = f"build the cache with batch={tokens.shape[0]}"
        raise ValueError(f"{what}: batch B={tokens.shape[0]} but the KV cache was built for batch {cache.batch}; "
                         f"{fix}")
    if tokens.device != cache.device:
        raise ValueError(f"{what}: on {tokens.device} but the model and cache are on {cache.device}")
    limits.check_token_range(tokens, vocab, "the model", f" in its {what}")


def last_logits(model: nn.Module, hidden: torch.Tensor, owner: int, cache: KVCache) -> torch.Tensor:
    """(B, vocab) logits of the sequence's last position on every rank of the cache's group:
    the rank holding it (``owner``, its rank in that group; positions ascend, so it is that
    rank's last row) runs the output layer and broadcasts. The others receive in the dtype
    the layer gives, which under autocast is not the hidden states' (a float32 buffer took
    the owner's bfloat16 bytes as float32 numbers): the layer run on no rows says which."""
    if cache.rank == owner:
        last = model.output(hidden[:, -1])
    else:
        dtype = model.output(hidden.new_empty((0, hidden.shape[-1]))).dtype  # (0, vocab) logits: no work
        last = hidden.new_empty((hidden.shape[0], model.output.out_features), dtype=dtype)
    return comm.broadcast(last, owner, cache.group)


def _check(model: nn.Module, cache: KVCache, prompt: torch.Tensor, layout: str | Layout, strategy: str,
           mesh) -> tuple[Layout, int]:
    """The layout, and this rank's index in it."""
    check_model_fits(model, cache)
    layout_rank = check_inference_strategy(model, cache.rank, cache.world_size, strategy, mesh, cache.group)
    check_tokens(prompt, cache, model.cfg.vocab, "prompt")
    seq_len = prompt.shape[1]
    if seq_len == 0:
        raise ValueError("the prompt holds no tokens: give at least one (B, T >= 1)")
    layout = get_layout(layout, cache.world_size)
    layout.validate(seq_len)
    if seq_len > cache.capacity:
        raise ValueError(f"the prompt of {seq_len} tokens is longer than the KV cache's capacity of "
                         f"{cache.capacity} positions; build the cache with capacity >= prompt + new tokens")
    if cache.seq_len:
        raise ValueError(f"the KV cache already holds a sequence of {cache.seq_len} positions; reset() it (or "
                         f"build another) before prefilling a new prompt")
    return layout, layout_rank


def check_inference_strategy(model: nn.Module, rank: int, world_size: int, strategy: str, mesh,
                   group: dist.ProcessGroup | None, cache_from_group: bool = False) -> int:
    """The strategy and ``mesh=`` of a prefill over a cache on ``group`` (``world_size`` ranks,
    ``rank`` this one's), heads included; returns this rank's index in the layout.
    ``cache_from_group``: the caller (``generate``) builds the cache on its ``group=``, so a
    mesh over other ranks is mended there, not by building the cache."""
    if strategy not in INFERENCE_STRATEGIES:
        raise ValueError(f"inference strategy {strategy!r}: choose one of {', '.join(INFERENCE_STRATEGIES)}")
    layout_rank = rank
    if strategy == "hybrid":
        if mesh is None:
            raise ValueError("strategy='hybrid' takes mesh= (a 2D DeviceMesh with dims 'ulysses' and 'ring' over the "
                             "cache's ranks)")
        topo = topology.from_mesh(mesh)
        in_mesh = sorted(topology.global_ranks(None, mesh))
        cache_group, fix = (("group= (generate builds the KV cache on it)",
                             "pass group= the process group of the mesh's ranks (for a mesh taken from a larger one, "
                             "each rank's own: dist.new_subgroups_by_enumeration makes them on every rank)")
                            if cache_from_group else
                            ("the KV cache's group", "build the cache on the group the mesh spans"))
        if topo.world_size != world_size:
            raise ValueError(f"the hybrid mesh holds {topo.world_size} ranks but {cache_group} holds {world_size}; "
                             f"{fix}")
        in_group = sorted(topology.global_ranks(group))
        if in_mesh != in_group:  # attention would run on the mesh's ranks, the cache's logits on the group's
            raise ValueError(f"the hybrid mesh spans global ranks {in_mesh} but {cache_group} holds {in_group}; "
                             f"{fix}, or build the mesh over the group's ranks")
        layout_rank, ulysses = topo.rank, topo.ulysses_degree
    elif mesh is not None:
        raise ValueError(f"mesh= is for strategy='hybrid'; {strategy!r} runs on the cache's group")
    else:
        ulysses = strategy_rules.call_ulysses_degree(strategy, world_size)
    strategy_rules.check_heads_split(strategy, model.cfg.heads, model.cfg.kv_heads, ulysses)
    return layout_rank


def prompt_signature(prompt) -> dict[str, agreement.Value]:
    """A prompt's shape and tokens, as the ranks compare them; -1 where it is not a (B, T) tensor."""
    ok = is_dense(prompt) and prompt.dim() == 2
    return {
        "batch": prompt.shape[0] if ok else -1,
        "prompt length": prompt.shape[1] if ok else -1,
        "prompt tokens (crc32)": agreement.readable(lambda: agreement.tensor_code(prompt, torch.int64)) if ok else -1,
    }


def _signature(model: nn.Module, cache: KVCache, prompt, layout, strategy) -> dict[str, agreement.Value]:
    """What every rank's prefill call must share; -1 where the input was not even a tensor."""
    return {
        **prompt_signature(prompt),
        SAME_MODEL: model_code(model),
        SAME_WEIGHTS: agreement.readable(lambda: weights_code(model)),
        "capacity": cache.capacity,
        "dtype": agreement.Text(cache.dtype),
        "cached positions": cache.seq_len,
        "layout": agreement.Text(fingerprint(layout) if isinstance(layout, Layout) else layout),
        "strategy": agreement.Text(strategy),
    }
