"""Bytes each rank sends per attention call, by strategy: the formulas of docs/strategies.md.

Pure arithmetic, no torch.distributed: the planner uses these, and the tests assert
that the bytes counted by ``ctxpar.comm`` equal them exactly. Counting convention
(``ctxpar.comm``): what must leave the rank, never its own chunk; every rank sends as
many bytes as it receives.

Symbols: B batch, T global length, S = T/P local length, H query heads, H_kv KV heads,
D head dim, e element size of q/k/v, a element size of the accumulators (4, or 8 for
float64 inputs), U ulysses degree, R ring degree, f KV-head copies for all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxpar.strategy_rules import kv_copies, ulysses_degree


@dataclass(frozen=True)
class Traffic:
    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def ring(*, batch: int, local_len: int, kv_heads: int, head_dim: int, world: int, elem: int, acc: int) -> Traffic:
    """K/V (one buffer) P-1 hops forward; K/V again plus the dK/dV accumulator backward."""
    kv = 2 * batch * kv_heads * local_len * head_dim
    return Traffic(forward=(world - 1) * kv * elem, backward=(world - 1) * kv * (elem + acc))


def ring_window(
    *, batch: int, local_len: int, kv_heads: int, head_dim: int, world: int, window: int, rank: int, elem: int,
    acc: int,
) -> tuple[Traffic, Traffic]:
    """(sent, received) by ``rank`` of the ring under a sliding window w, contiguous layout.

    Only the halo travels: the w-1 keys before a rank's first query, from the ranks
    before it, over m = ceil((w-1)/S) steps (at most P-1). Rank r receives min(w-1, r*S)
    keys' K/V and sends min(w-1, (r+1)*S) (the last rank sends none), forward and again
    backward. Backward, the dK/dV accumulator of each shard but the last, min(w-1, S)
    keys, makes m hops (the last one straight home): rank r sends m of them, less one if
    r < m (the hop that would carry the last shard's), and receives m - 1, less one if
    0 < r < m, plus its own unless it is the last rank. With w-1 <= S (m = 1) that is the
    halo once: w-1 keys out and in per rank, and one accumulator of w-1 keys.
    """
    s, halo = local_len, window - 1
    kv = 2 * batch * kv_heads * head_dim
    steps = window_steps(local_len=local_len, world=world, window=window)
    kv_sent = min(halo, (rank + 1) * s) if rank < world - 1 else 0
    kv_received = min(halo, rank * s) if rank > 0 else 0
    acc_tokens = min(s, halo)
    acc_sent = steps - (rank < steps) if steps else 0
    acc_received = (steps - 1 - (0 < rank < steps) + (rank != world - 1)) if steps else 0
    sent = Traffic(forward=kv_sent * kv * elem, backward=kv_sent * kv * elem + acc_sent * acc_tokens * kv * acc)
    received = Traffic(forward=kv_received * kv * elem,
                       backward=kv_received * kv * elem + acc_received * acc_tokens * kv * acc)
    return sent, received


def window_steps(*, local_len: int, world: int, window: int) -> int:
    """m = min(P-1, ceil((w-1)/S)): the hops a ring on the contiguous layout makes under a
    sliding window w (it computes m + 1 steps); 0 for w = 1."""
    halo = window - 1
    return 0 if halo <= 0 else min(world - 1, -(-halo // local_len))


# All-gather of K/V forward; again backward, plus the reduce-scatter of dK/dV: counted
# per rank (its shard to P-1 ranks, P-1 chunks out), exactly the ring's volume.
allgather = ring


def alltoall(
    *, batch: int, local_len: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, elem: int, acc: int
) -> Traffic:
    """Ulysses over U ranks: q, k, v in and out (+ lse) back; dout in and dq, dk, dv back."""
    kv = kv_heads * kv_copies(kv_heads, ulysses)
    tokens = batch * local_len
    share = lambda n: n * (ulysses - 1) // ulysses  # noqa: E731  what leaves the rank
    tensors = share(tokens * head_dim * elem * (2 * heads + 2 * kv))
    return Traffic(forward=tensors + share(tokens * heads * acc), backward=tensors)


def hybrid(
    *, batch: int, local_len: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring_degree: int,
    elem: int, acc: int,
) -> Traffic:
    """All-to-all over U, then the ring over R groups with H/U heads of U*S tokens each."""
    a2a = alltoall(batch=batch, local_len=local_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   ulysses=ulysses, elem=elem, acc=acc)
    kv = kv_heads * kv_copies(kv_heads, ulysses)
    rng = ring(batch=batch, local_len=ulysses * local_len, kv_heads=kv // ulysses, head_dim=head_dim,
               world=ring_degree, elem=elem, acc=acc)
    return Traffic(forward=a2a.forward + rng.forward, backward=a2a.backward + rng.backward)


def per_rank(
    strategy: str, *, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, world: int,
    elem: int, acc: int, ulysses: int | None = None,
) -> Traffic:
    """Bytes one rank sends (and receives) for one forward and one backward."""
    s = seq_len // world
    if strategy in ("ring", "allgather"):
        fn = ring if strategy == "ring" else allgather
        return fn(batch=batch, local_len=s, kv_heads=kv_heads, head_dim=head_dim, world=world, elem=elem, acc=acc)
    if strategy == "alltoall":
        return alltoall(batch=batch, local_len=s, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        ulysses=world, elem=elem, acc=acc)
    if strategy == "hybrid":
        ulysses = ulysses_degree(strategy, world, ulysses)
        return hybrid(batch=batch, local_len=s, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      ulysses=ulysses, ring_degree=world // ulysses, elem=elem, acc=acc)
    raise ValueError(f"unknown strategy {strategy!r}")


@dataclass(frozen=True)
class TensorParallelTraffic:
    """Bytes one GPU sends per layer for tensor parallelism.

    ``forward`` and ``backward`` are the collectives on the critical path; ``regather`` the
    backward's all-gathers of the stored sequence-parallel inputs, which Megatron overlaps
    with the input-gradient matmul (``LinearWithGradAccumulationAndAsyncCommunication``).
    """

    forward: int
    backward: int
    regather: int
    collectives: int = 0  # on the critical path per layer and pass (each pays one latency)

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.regather


def tensor_parallel(*, batch: int, local_len: int, hidden: int, tp: int, elem: int,
                    sequence_parallel: bool) -> TensorParallelTraffic:
    """Megatron's TP collectives for one layer, each over a B·S·d activation (S = T/P tokens).

    One all-gather or reduce-scatter over t GPUs moves (t-1)/t of it off every GPU:
    (t-1)·B·(S/t)·d·e (each GPU's chunk to t-1 others); an all-reduce (ring: reduce-scatter
    then all-gather) twice that. Korthikanti et al. 2022 (arXiv:2205.05198, section 4.2.3):

        sequence parallel   forward   2 all-gathers (before q/k/v and gate/up) + 2 reduce-scatters
                                      (after o and down)
                            backward  the conjugates, 2 reduce-scatters + 2 all-gathers;
                                      regather: 2 all-gathers of the stored S/t-token inputs
        tensor parallel     forward   2 all-reduces (after o and down)
                            backward  2 all-reduces (the inputs' gradients of q/k/v and gate/up)
    """
    if tp == 1:
        return TensorParallelTraffic(0, 0, 0)
    if sequence_parallel:
        one = (tp - 1) * batch * (local_len // tp) * hidden * elem
        return TensorParallelTraffic(forward=4 * one, backward=4 * one, regather=2 * one, collectives=4)
    all_reduce = 2 * (tp - 1) * batch * local_len * hidden * elem // tp
    return TensorParallelTraffic(forward=2 * all_reduce, backward=2 * all_reduce, regather=0, collectives=2)


@dataclass(frozen=True)
class DataParallelTraffic:
    """Bytes one GPU sends per training step to keep its parameters and gradients in step
    with the G = DP·P GPUs holding the same TP shard (``data_parallel``)."""

    gather: int  # FSDP: one all-gather of the parameters over Z
    gradients: int  # their reduction: reduce-scatter over Z (FSDP), or all-reduce over G (Z = 1)
    replicate: int  # HSDP (1 < Z < G): all-reduce of the 1/Z gradient shard over the G/Z replicas
    gathers: int = 2  # all-gathers per step: the forward's and the backward's, or 1 kept across micro-batches

    @property
    def total(self) -> int:
        return self.gathers * self.gather + self.gradients + self.replicate


def data_parallel(*, parameters: int, elem: int, group: int, fsdp: int, microbatches: int = 1) -> DataParallelTraffic:
    """Per step, what one GPU sends for the N parameters it holds (one TP rank's share), b
    bytes each, kept in step over G GPUs of which Z shard them (Z divides G).

    Ring collectives over n GPUs (each GPU's 1/n chunk to the n-1 others; FSDP pads N to a
    multiple of n, so a chunk is ceil(N/n)):

        all-gather, reduce-scatter   (n-1)·ceil(N/n)·b
        all-reduce                   2·(n-1)·ceil(N/n)·b   (a reduce-scatter, then an all-gather)

    Z = 1 (DDP): the gradients' all-reduce over G. Z > 1 (FSDP, ZeRO-3): the parameters'
    all-gather over Z in the forward and again in the backward, the gradients'
    reduce-scatter over Z, and with G/Z > 1 replicas (HSDP) an all-reduce of the 1/Z shard
    over them. With m > 1 micro-batches the parameters stay gathered and the gradients
    unsharded until the last one (torchtitan's FSDP under PP, Llama 3's): one all-gather
    and one reduction per step. Gradients are reduced in b bytes, as ``memory`` holds them.
    """
    if group % fsdp:
        raise ValueError(f"FSDP degree {fsdp} does not divide the {group} GPUs that hold the same parameters")

    def chunk(n: int, of: int = parameters) -> int:
        return -(-of // n) * elem

    if fsdp == 1:
        return DataParallelTraffic(0, 2 * (group - 1) * chunk(group), 0)
    replicas, shard = group // fsdp, -(-parameters // fsdp)
    return DataParallelTraffic(gather=(fsdp - 1) * chunk(fsdp), gradients=(fsdp - 1) * chunk(fsdp),
                               replicate=2 * (replicas - 1) * chunk(replicas, shard),
                               gathers=1 if microbatches > 1 else 2)


def partial_prefill(method: str, *, batch: int, cached: int, new: int, heads: int, kv_heads: int, head_dim: int,
                    world: int, elem: int, acc: int) -> int:
    """Bytes one rank sends per layer when T_new tokens are prefilled on top of T_cached.

    The chunk's positions are dealt round-robin (position p to rank p mod P, as decoding
    deals them), so a rank holds at most N = ceil((T_cached + T_new) / P) positions and
    M = ceil(T_new / P) new queries; the buffers are sized for these.

    pass-kv: every rank's K/V (cached + new) makes P-1 ring hops:
        (P-1) · 2·B·H_kv·N·D · e
    pass-q: the new queries make P-1 ring hops, and each rank sends its partial (out, lse)
        of every other rank's queries back to their owner:
        (P-1) · B·H·M·D · e  +  (P-1) · B·H·M·(D+1) · a
    """
    if method not in ("pass-kv", "pass-q"):
        raise ValueError(f"partial prefill method {method!r}: 'pass-kv' or 'pass-q'")
    held, queries = -(-(cached + new) // world), -(-new // world)
    if method == "pass-kv":
        return (world - 1) * 2 * batch * kv_heads * held * head_dim * elem
    return (world - 1) * batch * heads * queries * (head_dim * elem + (head_dim + 1) * acc)
