"""Partial prefill: a new chunk of T_new tokens on top of the T_cached a KV cache holds
(the next turn of a conversation), exactly, by passing K/V or passing Q.

The chunk's positions are dealt as decoding deals them, position p to rank p mod P, so
the caches stay balanced within one token whatever mix of prefill, chunks and decode
steps filled them, and every rank knows every position's owner. Each rank runs the
model on its new tokens; at every layer it first appends their K/V to its cache shard,
so a rank's keys are then all it holds, cached and new (ascending positions). Each new
query must see every earlier key, on every rank. Two exact ways to bring them together:

    pass-KV  the ring of training: every rank's K/V (cached + new) travels P-1 hops;
             each rank merges its queries' partial (out, lse) against each shard as it
             passes. Moves (P-1)·2·H_kv·ceil((T_cached+T_new)/P)·D elements per rank.
    pass-Q   the queries travel instead: each rank attends every visiting chunk of
             queries to its own keys and sends the partial (out, lse) straight back to
             the queries' owner (overlapping its next step), who merges them in rank order.
             Moves (P-1)·H·ceil(T_new/P)·D elements, plus the float32 partials back.

Pass-Q wins when the chunk is small next to the cache, in bytes when
T_new / (T_cached + T_new) < 2·H_kv·D·e / (H·(D·e + 4(D+1))) (``plan.inference.pass_q_fraction``;
about H_kv/H); ``method="auto"`` asks the planner (``plan.inference.choose_partial_prefill``):
the lower predicted time on ``hardware`` if given, else the fewer bytes. Both give the same
result up to float rounding (the merge order differs).

Every rank needs to know what every other holds: one all-gather of the held positions per
call (int64, the size of one layer's positions, not of the K/V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ctxpar import agreement, kernels, limits
from ctxpar.auto import planner_dtype
from ctxpar.blocks import Tile, tiles_between
from ctxpar.comm import PendingAllGather, RingComm, collective_device, settled
from ctxpar.inference.cache import SHARD_FULL_WHY, KVCache
from ctxpar.inference.hooks import attention_replaced, check_cache, check_model_fits
from ctxpar.inference.prefill import check_tokens, is_dense, last_logits
from ctxpar.masks import Mask
from ctxpar.merge import merge_packed
from ctxpar.parallelize import SAME_MODEL, model_code
from ctxpar.plan.hardware import Hardware
from ctxpar.plan.inference import PARTIAL_PREFILL_METHODS, choose_partial_prefill
from ctxpar.strategies.blockwise import forward_tiles, output_accumulators

METHODS = ("auto", *PARTIAL_PREFILL_METHODS)
_CAUSAL = Mask(causal=True)


def auto_method(model: nn.Module, cache: KVCache, new: int, hardware: Hardware | None = None) -> tuple[str, str]:
    """(method, why): what ``method="auto"`` picks for ``new`` tokens on top of ``cache``."""
    return choose_partial_prefill(model=model.cfg, batch=cache.batch, cached=cache.seq_len, new=new,
                                  world=cache.world_size, elem=cache.element_size,
                                  acc=kernels.accumulation_dtype(cache.dtype).itemsize,
                                  hw=hardware and hardware.for_dtype(planner_dtype(cache.dtype)))


def partial_prefill(model: nn.Module, cache: KVCache, chunk: torch.Tensor, *, method: str = "auto",
                    hardware: Hardware | None = None, check_consistency: bool = True) -> torch.Tensor:
    """Run ``chunk`` through the model at the positions after the cache's, extending the cache.

    Args:
        model: the reference ``ctxpar.models.Transformer`` that filled ``cache``.
        cache: a ``KVCache`` holding T_cached positions (``prefill``, decode steps or
            earlier chunks; empty is allowed: the chunk is then the whole prompt).
        chunk: (B, T_new) token ids, the same on every rank, T_new >= 1.
        method: ``"pass-kv" | "pass-q" | "auto"`` (module docstring).
        hardware: for ``"auto"``, the planner's hardware (``ctxpar.plan.get_hardware``) to
            predict times on; None: choose by bytes moved.
        check_consistency: the ranks compare their calls first (one tiny all-gather).

    Returns:
        (B, vocab) logits of the chunk's last position, identical on every rank.

    Raises:
        ValueError: bad input (chunk past the cache's capacity, batch or shape mismatch,
            unknown method), before any collective; with ``check_consistency`` on every
            rank together, also when ranks are at different positions or hold other tokens.
    """
    check_cache(cache)
    with agreement.Refusal() as refusal:
        limits.check_flag("check_consistency", check_consistency)
        chunk = _check(model, cache, chunk, method, hardware)
        if method == "auto":  # resolved before the ranks compare calls: each rank's hardware= could differ
            method, _ = auto_method(model, cache, chunk.shape[1], hardware)
    refusal.join(lambda: _signature(model, cache, chunk, method), cache.group, "partial prefill",
                 world_size=cache.world_size, check_consistency=check_consistency)

    world, rank = cache.world_size, cache.rank
    cached, new = cache.seq_len, chunk.shape[1]
    seq_len = cached + new
    queries = [cache.next_positions(new, s) for s in range(world)]
    mine = queries[rank]
    tokens = chunk[:, mine - cached]  # (B, m)
    held_positions = _gather_positions(torch.cat([cache.positions(), mine]), cache)
    start, held = cache.length, cache.length + mine.numel()
    attend = _pass_kv if method == "pass-kv" else _pass_q
    if method == "pass-kv":  # tiles of my queries against each rank's keys
        tiles = [tiles_between(mine, held_positions[s], _CAUSAL, seq_len) for s in range(world)]
    else:  # tiles of each rank's queries against my keys
        tiles = [tiles_between(queries[s], held_positions[rank], _CAUSAL, seq_len) for s in range(world)]
    counts = [(p.numel(), q.numel()) for p, q in zip(held_positions, queries)]
    scale = cache.head_dim**-0.5
    rings = _Rings.build(cache, method)

    def make(layer: int):
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write(layer, start, k, v)  # the new positions' K/V, after RoPE
            return attend(q, cache.keys(layer, held), cache.values(layer, held), tiles, counts, cache, scale, rings)
        return run

    with torch.no_grad(), attention_replaced(model, make), settled(rings.forward, *rings.home.values()):
        positions = mine.to(chunk.device)
        hidden = model.hidden_states(tokens, positions)  # (B, m, d)
        owner = (seq_len - 1) % world
        logits = last_logits(model, hidden, owner, cache)
    cache.commit(mine, seq_len=seq_len, tokens=chunk)
    return logits


@dataclass(frozen=True)
class _Rings:
    """The point-to-point exchanges of one partial prefill, built once per call and reused
    by every layer: a layer waits for everything it posted before it returns, and a
    ``RingComm`` holds no buffer between transfers. ``forward`` sends to rank + 1 (the
    K/V of pass-KV, the queries of pass-Q); ``home[i]`` (pass-Q only) sends a partial
    back to rank - i, i = 1..P-1. None and empty on one rank."""

    forward: RingComm | None
    home: dict[int, RingComm]

    @staticmethod
    def build(cache: KVCache, method: str) -> _Rings:
        world = cache.world_size
        home = range(1, world) if method == "pass-q" else ()
        return _Rings(RingComm(cache.group) if world > 1 else None,
                      {step: RingComm(cache.group, tag=1, shift=-step) for step in home})


def _around_the_ring(first: torch.Tensor, cache: KVCache, ring: RingComm | None, compute) -> None:
    """Pass this rank's buffer ``first`` around the ring: at step i, ``compute(i, s, buffer)``
    with rank s = r - i's buffer, while the next hop is in flight."""
    world, rank = cache.world_size, cache.rank
    current = first
    arriving = torch.empty_like(first) if world > 1 else None
    for step in range(world):
        if step < world - 1:
            ring.start(send=current, recv=arriving)
        compute(step, (rank - step) % world, current)
        if step < world - 1:
            ring.wait()
            current, arriving = arriving, current


def _pass_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[tuple[Tile, ...]],
             counts: list[tuple[int, int]], cache: KVCache, scale: float, rings: _Rings) -> torch.Tensor:
    """This rank's queries (B, H, m, D) against every rank's keys, the K/V travelling the ring."""
    acc_out, acc_lse = output_accumulators(q)
    width = max(n for n, _ in counts)  # every rank's buffer has room for the largest shard
    kv = k.new_zeros((2, *k.shape[:2], width, k.shape[3]))
    kv[0, :, :, : k.shape[2]], kv[1, :, :, : k.shape[2]] = k, v

    def attend(step: int, source: int, shard: torch.Tensor) -> None:
        n = counts[source][0]
        forward_tiles(q, shard[0, :, :, :n], shard[1, :, :, :n], tiles[source], acc_out, acc_lse, scale)

    _around_the_ring(kv, cache, rings.forward, attend)
    return acc_out.to(q.dtype)


def _pass_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[tuple[Tile, ...]],
            counts: list[tuple[int, int]], cache: KVCache, scale: float, rings: _Rings) -> torch.Tensor:
    """Every rank's queries visit this rank's keys; each partial (out, lse) is sent home as
    soon as it is computed, overlapping the next step's compute; only the last is exposed.

    At step i this rank holds the queries of rank s = r - i and sends their partial to s,
    while receiving from rank r + i the partial of its own queries computed there at the
    same step (``rings.home[i]``). The partials are merged in the order of the rank that
    computed them, so the result does not depend on arrival order.
    """
    world, rank = cache.world_size, cache.rank
    b, h, m, d = q.shape
    queries = q.new_zeros((b, h, max(n for _, n in counts), d))
    queries[:, :, :m] = q
    acc = kernels.accumulation_dtype(q.dtype)
    partials = torch.zeros((world, *queries.shape[:3], d + 1), dtype=acc, device=q.device)  # [s]: for rank s
    partials[..., d] = float("-inf")
    mine = torch.empty_like(partials)  # [s]: rank s's partial of this rank's queries

    def attend(step: int, source: int, visiting: torch.Tensor) -> None:
        n = counts[source][1]
        out, lse = partials[source, :, :, :n, :d], partials[source, :, :, :n, d]
        forward_tiles(visiting[:, :, :n], k, v, tiles[source], out, lse, scale)
        if step:  # home: to rank r - step; this rank's own partial comes from rank r + step
            rings.home[step].start(send=partials[source], recv=mine[(rank + step) % world])

    _around_the_ring(queries, cache, rings.forward, attend)
    for back in rings.home.values():
        back.wait()
    mine[rank] = partials[rank]
    return merge_packed(mine[:, :, :, :m])[0].to(q.dtype)


def _gather_positions(positions: torch.Tensor, cache: KVCache) -> list[torch.Tensor]:
    """Every rank's held positions (after this chunk), on the host, from one all-gather padded
    to the largest shard (capacity / P slots), on the device the cache's group carries."""
    padded = torch.full((cache.local_capacity,), -1, dtype=torch.int64, device=collective_device(cache.group))
    padded[: positions.numel()] = positions
    table = PendingAllGather(padded, cache.group).wait().cpu()  # (P, slots)
    return [row[row >= 0] for row in table]


def _check(model: nn.Module, cache: KVCache, chunk, method: str, hardware) -> torch.Tensor:
    check_model_fits(model, cache)
    if method not in METHODS:
        raise ValueError(f"partial prefill method {method!r}: choose one of {', '.join(METHODS)}")
    if hardware is not None and not isinstance(hardware, Hardware):
        raise ValueError(f"hardware must be a ctxpar.plan.Hardware (ctxpar.plan.get_hardware(name)), got "
                         f"{type(hardware).__name__}")
    check_tokens(chunk, cache, model.cfg.vocab, "chunk")
    if chunk.shape[1] == 0:
        raise ValueError("the chunk holds no tokens: give at least one (B, T_new >= 1)")
    if cache.seq_len + chunk.shape[1] > cache.capacity:
        raise ValueError(f"{cache.seq_len} cached + {chunk.shape[1]} new positions exceed the KV cache's capacity of "
                         f"{cache.capacity}; build the cache with capacity >= everything it will hold")
    if cache.length + len(cache.next_positions(chunk.shape[1], cache.rank)) > cache.local_capacity:
        raise ValueError(f"rank {cache.rank}'s KV cache shard cannot take its share of the chunk "
                         f"({cache.length} of its {cache.local_capacity} slots held): {SHARD_FULL_WHY}")
    return chunk


def _signature(model: nn.Module, cache: KVCache, chunk, method: str) -> dict[str, agreement.Value]:
    ok = is_dense(chunk) and chunk.dim() == 2
    return {
        "cached positions": cache.seq_len,
        "sequence so far (crc32)": cache.history,
        "prompt dealt by": agreement.Text(cache.dealt_by),
        SAME_MODEL: model_code(model),
        "batch": chunk.shape[0] if ok else -1,
        "chunk length": chunk.shape[1] if ok else -1,
        "chunk tokens (crc32)": agreement.readable(lambda: agreement.tensor_code(chunk, torch.int64)) if ok else -1,
        "method": agreement.Text(method),
        "capacity": cache.capacity,
        "dtype": agreement.Text(cache.dtype),
    }
