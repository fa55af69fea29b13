"""Work, traffic and time of one training step on the slowest rank of a CP group.

Attention FLOPs follow FlashAttention's benchmark convention (Dao et al.,
flash-attention ``benchmarks/benchmark_flash_attention.py``): forward 4·T²·D·H per
sequence, halved for causal; backward 2.5x forward. Here T² (or T²/2) is replaced by the
exact number of visible (query, key) pairs the rank computes (``ctxpar.plan.work.rank_pairs``
on the layout), which also gives the load-balance factor max/mean over ranks.

Matmul FLOPs: 2 per parameter per token forward, 4 backward (Kaplan et al. 2020,
arXiv:2001.08361, C = 6N), N excluding the embedding table; full checkpointing adds one
more forward (Korthikanti et al. 2022).

Masks (``Workload.mask``: documents, a sliding window) change the pairs, hence the
FLOPs and the load balance, exactly. Bytes per rank are ``ctxpar.plan.traffic.per_rank``
(the formulas the tests check against counted traffic), per layer, except for the ring
on the contiguous layout under a window, whose halo is ``traffic.ring_window`` (the
busiest rank's). All-gather and all-to-all move the same bytes whatever the mask. The
ring elsewhere under documents or a window sends only what later ranks see, which has no
closed form: the plain ring's bytes are then an upper bound (``traffic_bound``).

Time: each strategy's attention is a pipeline of ``stages`` (a lead transfer nobody can
hide, then per stage max(compute, transfer) since the next transfer is posted before the
current compute, the last stage's compute, then a tail transfer nobody can hide):

    ring       forward  P stages, K/V hop per stage;      backward adds the dK/dV hop, the last one exposed
               (window on contiguous: m + 1 stages, m = min(P-1, ceil((w-1)/S)) hops of the halo)
    allgather  forward  G stages (a head group each: ceil(H_kv / ceil(H_kv/8)) groups, ``gather_groups``), the first
               gather exposed;
               backward the re-gather and the reduce-scatter per group, the first gather and last reduce-scatter exposed
    alltoall   one stage: all-to-all traffic, then compute (nothing overlaps)
    hybrid     the all-to-all over U as a lead, then the ring over R groups

Per-stage compute is the rank's pairs spread evenly over its stages: exact for zigzag
(every block holds S²/2 pairs), close for striped, optimistic for contiguous, where
ranks idle on hidden blocks. Rates: the forward at ``Hardware.forward_flops``, the
backward (2.5x the forward's FLOPs) at ``backward_flops``, each tile of the rank's block
plan at its size curve's fraction of them, an explicitly masked tile over its whole area
(``kernel_rate_fractions``), matmuls at ``matmul_flops``. Each tile also costs, beyond its
kernel, the merge of its output into the accumulators (forward) or the adds of its
gradients (backward): a fixed part and one per byte accumulated
(``tile_overhead_seconds``), compute like the kernels.

Fixed costs: every message a stage posts costs ``latency`` on top of its bytes (a ring
hop one, the backward's K/V and dK/dV hops two, an all-gather or reduce-scatter one, the
all-to-all two per pass); every stage pays one launch per kernel call of the busiest
rank's block plan (``kernels_per_stage``) and one step overhead, fixed
(``Hardware.step_overhead_for``) and per byte the stage sends (``step_overhead_per_byte``:
the pass's bytes over its stages; both measured per strategy for ``local``), serially
(``Pipeline.overhead``). So when shards get small, time stops falling as 1/P²: it
approaches stages x (overhead + latency). TP collectives pay one
latency each.

Tensor parallelism (t): each GPU computes H/t heads' attention and moves H_kv/t heads' K/V
over CP, and does 1/t of the matmul FLOPs. Its own collectives
(``traffic.tensor_parallel``) sit between the matmuls that need their results, so they
are counted as exposed, not overlapped (an upper bound where Megatron's TP-communication
overlap hides some); the backward's re-gathers of sequence-parallel inputs are counted
as overlapped with the input-gradient matmul, as Megatron runs them. Links (``links``),
Megatron's rank order, TP innermost, then CP, DP, PP: a TP group is t consecutive GPUs,
a CP group spans t·P, a hybrid's all-to-all t·U; each is paced by the inter-node link
once its span exceeds the GPUs per node, or once one of its groups straddles two nodes
(6 GPUs a node, TP 4: GPUs 4-7), as the slowest group sets the step.

Data parallelism (``data_parallel_time``): the DP·P GPUs holding one TP shard reduce its
gradients (DDP), or gather its parameters and reduce-scatter its gradients (FSDP over Z,
spanning t·Z GPUs; HSDP adds an all-reduce over the replicas), layer by layer behind the
compute: the step pays what the layers' compute does not hide.

Pipeline parallelism (``PipelineSchedule``): the busiest stage's layers (``Workload.stage``)
run m micro-batches plus the (k-1)/v of fill and drain, each micro-batch ending in 2·v
sends to the neighbouring stages.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, replace

from ctxpar.blocks import MaskKind
from ctxpar.layout import UnionLayout, get_layout
from ctxpar.masks import Mask
from ctxpar.plan.work import pairs_per_rank, stage_tiles
from ctxpar.plan.hardware import BACKWARD_FLOPS_RATIO, TILE_OVERHEADS, Hardware
from ctxpar.plan.workload import MAX_PLAN_SEQ, Workload
from ctxpar.plan import traffic
from ctxpar.strategy_rules import gather_groups

A2A_MESSAGES = 2  # all-to-alls per pass (strategies/alltoall.py): q/k/v to heads, then the results back


@functools.lru_cache(maxsize=4096)
def _union_pairs(layout: str, seq: int, cp: int, mask: Mask, ulysses: int) -> tuple[int, ...]:
    return pairs_per_rank(get_layout(layout, cp), seq, mask, ulysses)


@functools.lru_cache(maxsize=4096)  # read once per rank of a plan: O(P) each time would make P ranks O(P²)
def head_pairs(w: Workload) -> tuple[int, ...]:
    """Per rank, the (query, key) pairs x heads it computes for one sequence (exact).

    Ring / all-gather (U = 1): the rank's own queries against the keys ``w.mask`` lets them
    see, all H heads (H/t under tensor parallelism).
    All-to-all over U ranks: all queries of its group's U shards, H/U heads; a query's
    pairs do not depend on which rank holds it, so the group's pairs are its members' sum.
    """
    u, heads = w.ulysses_degree, w.heads_per_gpu
    return tuple(p * (heads // u) for p in _union_pairs(w.layout, w.seq, w.cp, w.mask, u))


def load_balance(w: Workload) -> float:
    """max / mean attention work over the ranks (1.0 = perfectly balanced)."""
    pairs = head_pairs(w)
    return max(pairs) * len(pairs) / sum(pairs)


def attention_forward_flops_per_rank(w: Workload) -> tuple[int, ...]:
    """Forward attention FLOPs of one layer on each rank: 4·B·D·(pairs·heads)."""
    return tuple(4 * w.batch * w.model.head_dim * p for p in head_pairs(w))


def matmul_flops_per_token(w: Workload) -> int:
    """Forward matmul FLOPs per token, all layers and the LM head: 2·(N - V·d) (the whole
    model's; each of t tensor-parallel GPUs does 1/t of them)."""
    m = w.model
    return 2 * (m.parameters - m.vocab * m.hidden)


def ring_window_per_rank(w: Workload) -> list[tuple[traffic.Traffic, traffic.Traffic]] | None:
    """Per rank, (sent, received) of a ring on the contiguous layout under a sliding window
    (``traffic.ring_window``: the halo); None for any other strategy, layout or mask."""
    m, window = w.model, w.mask.window
    if w.strategy != "ring" or w.layout != "contiguous" or window is None or w.cp == 1:
        return None
    return [traffic.ring_window(batch=w.batch, local_len=w.local_len, kv_heads=w.kv_heads_per_gpu, head_dim=m.head_dim,
                                world=w.cp, window=window, rank=r, elem=w.elem, acc=w.acc) for r in range(w.cp)]


def traffic_bound(w: Workload) -> str | None:
    """None when ``layer_traffic`` is the exact count; else why it is an upper bound."""
    if w.mask.is_plain or w.strategy in ("allgather", "alltoall") or w.cp == 1:
        return None
    if ring_window_per_rank(w) is not None:
        return None if w.mask.documents is None else \
            "upper bound: the window's halo; documents can only leave less of it for later ranks to see"
    return ("upper bound: the plain ring's (P-1) hops of every shard; under documents or a window the ring sends "
            "only what later ranks see (strategies/ring.py), which has no closed form")


def layer_traffic(w: Workload) -> traffic.Traffic:
    """Bytes one rank sends (= receives) for one layer's attention, forward and backward.

    A ring on the contiguous layout under a window: the most any rank sends or receives
    (the halo), forward and backward separately. Otherwise the mask does not change the
    figure (see ``traffic_bound``).
    """
    if (halo := ring_window_per_rank(w)) is not None:
        return traffic.Traffic(forward=max(max(s.forward, r.forward) for s, r in halo),
                               backward=max(max(s.backward, r.backward) for s, r in halo))
    return traffic.per_rank(w.strategy, batch=w.batch, seq_len=w.seq, heads=w.heads_per_gpu,
                            kv_heads=w.kv_heads_per_gpu, head_dim=w.model.head_dim, world=w.cp, elem=w.elem,
                            acc=w.acc, ulysses=w.ulysses if w.strategy == "hybrid" else None)


@dataclass(frozen=True)
class Pipeline:
    """lead + (stages - 1)·max(compute, transfer) + compute + tail + stages·overhead, in seconds.

    ``compute`` and ``transfer`` are per stage (a transfer includes its messages' latency);
    ``overhead`` is what every stage pays besides them and cannot overlap: its kernel
    launches and the step's own cost, fixed and per byte sent (``stage_overhead``).
    """

    stages: int
    compute: float
    transfer: float
    lead: float = 0.0
    tail: float = 0.0
    overhead: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.lead + (self.stages - 1) * max(self.compute, self.transfer) + self.compute + self.tail
                + self.stages * self.overhead)

    @property
    def hidden(self) -> bool:
        """The Ring Attention overlap condition: each stage's compute covers its transfer.

        A one-stage pipeline overlaps nothing: hidden only if it moves nothing.
        """
        if self.stages == 1:
            return self.lead + self.transfer + self.tail == 0
        return self.compute >= self.transfer

    @property
    def exposed(self) -> float:
        """Seconds communication adds beyond the compute and the fixed overheads: ``seconds`` less
        stages·(compute + overhead), taken term by term (the difference of the sums came out a few
        ulps below 0, -8.7e-19 s in the JSON, where the compute hid every transfer)."""
        return self.lead + self.tail + (self.stages - 1) * max(0.0, self.transfer - self.compute)

    def as_dict(self) -> dict:
        return dict(stages=self.stages, compute_seconds_per_stage=self.compute,
                    transfer_seconds_per_stage=self.transfer, lead_seconds=self.lead, tail_seconds=self.tail,
                    overhead_seconds_per_stage=self.overhead, seconds=self.seconds, exposed_seconds=self.exposed,
                    transfer_hidden=self.hidden)


@dataclass(frozen=True)
class AttentionTime:
    """One layer's attention on the busiest rank."""

    forward: Pipeline
    backward: Pipeline
    link_bandwidth: float  # bytes/s of the link the K/V (or all-to-all) traffic crosses

    @property
    def seconds(self) -> float:
        return self.forward.seconds + self.backward.seconds


def split_traffic(w: Workload) -> tuple[traffic.Traffic, traffic.Traffic]:
    """(all-to-all part, ring/all-gather part) of the layer's traffic."""
    total = layer_traffic(w)
    if w.strategy != "hybrid":
        return (total, traffic.Traffic(0, 0)) if w.strategy == "alltoall" else (traffic.Traffic(0, 0), total)
    a2a = traffic.alltoall(batch=w.batch, local_len=w.local_len, heads=w.heads_per_gpu, kv_heads=w.kv_heads_per_gpu,
                           head_dim=w.model.head_dim, ulysses=w.ulysses, elem=w.elem, acc=w.acc)
    return a2a, traffic.Traffic(total.forward - a2a.forward, total.backward - a2a.backward)


def kernel_tokens(w: Workload) -> int:
    """The keys every kernel call is looked up at on hardware whose size curves are not by
    a tile's keys (``kernel_rate_fractions``): a ring step's shard, the U shards of a hybrid
    union's, the whole sequence for all-to-all."""
    return w.local_len * w.ulysses_degree


def busiest_ranks(w: Workload) -> tuple[int, ...]:
    """The ranks tied for the most pairs (zigzag: all of them); all-to-all's rank 0, whose
    one kernel every rank runs alike."""
    if w.strategy == "alltoall":
        return (0,)
    pairs = head_pairs(w)
    most = max(pairs)
    return tuple(r for r, p in enumerate(pairs) if p == most)


STAND_IN_MULTIPLES = 64  # layout multiples in a plain mask's stand-in row (the all-gather's: at least P)


def _plan_seq(w: Workload, rank: int) -> int:
    """The row ``rank``'s block plan is walked on. Under a plain mask a short stand-in, where
    the rank's kernel calls do not depend on T: tile sides then grow in proportion to T up
    to a constant (striped's shifted diagonals are S - 1 wide), which 64 multiples or more
    make under 2% (tested). Whether the calls depend on T is read off the plan itself
    (``_stand_in_holds``: the same calls on a stand-in twice as long), not assumed: the
    ring between a hybrid's unions on the striped layout (positions 0, 1, 4, 5, ... against
    2, 3, 6, 7, ...) is a staircase cut in bands whose count grows with T, so it walks the
    row itself. The all-gather's choice of key order compares tile counts that settle once a
    striped shard holds P rows (tested), so its row has P multiples where that is more,
    and is the row itself where that is shorter. One stand-in serves every length of a
    sweep. Under documents or a window the row itself (0.05-0.3 s per rank at 1M tokens on
    P=8 on a CPU core: ``benchmarks/plan_walk.py``)."""
    if not w.mask.is_plain:
        return w.seq
    multiple = get_layout(w.layout, w.cp).multiple
    if w.strategy == "allgather":
        stand_in = multiple * max(STAND_IN_MULTIPLES, w.cp)
        if w.seq <= stand_in:
            return w.seq
    else:
        stand_in = multiple * STAND_IN_MULTIPLES
    return stand_in if _stand_in_holds(stand_in, w.strategy, *_walk(w, rank), w.mask) else w.seq


@functools.lru_cache(maxsize=4096)
def _stand_in_holds(stand_in: int, strategy: str, layout: str, cp: int, rank: int, ulysses: int, mask: Mask) -> bool:
    """Whether the rank's plan makes as many kernel calls (per stage at most, and in all) on
    a row twice ``stand_in`` as on ``stand_in``: its calls do not grow with T."""
    short, long = (_rank_plan(layout, seq, cp, mask, strategy, rank, ulysses) for seq in (stand_in, 2 * stand_in))
    return (short.most_calls, short.tiles) == (long.most_calls, long.tiles)


@dataclass(frozen=True)
class RankPlan:
    """What the cost model reads from one rank's block plans (``work.stage_tiles``)."""

    most_calls: int  # kernel calls of its busiest pipeline stage
    # (kind, queries, keys, visible pairs, how many) over all its stages
    shapes: tuple[tuple[MaskKind, int, int, int, int], ...]
    seq: int  # the row it was walked on (``_plan_seq``): its tile sides times T / seq are those at T

    def scale(self, seq_len: int) -> float:
        """The factor from its tile sides to those at ``seq_len``: a stand-in's sides scale to T
        (its visible pairs are kept: only masks that are not plain cut tiles with explicit
        masks, and those are walked on the row itself), its counts are kept (``_plan_seq``
        takes a stand-in only where they hold at any T)."""
        return seq_len / self.seq

    @property
    def tiles(self) -> int:
        """Kernel calls over all its stages."""
        return sum(shape[-1] for shape in self.shapes)


@functools.lru_cache(maxsize=2**16)  # one small entry per distinct walk (``rank_plan``), not per T under a plain mask
def _rank_plan(layout: str, seq: int, cp: int, mask: Mask, strategy: str, rank: int, ulysses: int) -> RankPlan:
    shards = get_layout(layout, cp)
    if strategy == "hybrid":  # the ring between unions of U consecutive ranks (strategies/hybrid.py)
        shards, rank, strategy = UnionLayout(cp // ulysses, shards, ulysses), rank // ulysses, "ring"
    stages = stage_tiles(shards, seq, rank, mask, strategy)
    shapes = collections.Counter((t.kind, t.q_stop - t.q_start, t.kv_stop - t.kv_start, t.pairs)
                                 for tiles in stages for t in tiles)
    return RankPlan(max(len(tiles) for tiles in stages),
                    tuple((kind, nq, nk, pairs, n) for (kind, nq, nk, pairs), n in shapes.items()), seq)


def _walk(w: Workload, rank: int) -> tuple[str, int, int, int]:
    """(layout, P, rank, U) of the walk that gives ``rank``'s plan: ranks whose walks are the
    same share one. The all-to-all's is the whole row against itself, the same for every
    rank, and for every layout and degree on the same row (the real row under a window or
    documents; a plain mask's stand-in follows the layout's multiple); a hybrid union's U
    ranks walk the union's ring."""
    if w.strategy == "alltoall":
        return "contiguous", 1, 0, 1
    u = w.ulysses_degree
    return w.layout, w.cp, rank - rank % u if w.strategy == "hybrid" else rank, u


def rank_plan(w: Workload, rank: int) -> RankPlan:
    """``rank``'s plan summary, walked on ``_plan_seq`` (its tile sides are that row's)."""
    layout, cp, walked, ulysses = _walk(w, rank)
    return _rank_plan(layout, _plan_seq(w, rank), cp, w.mask, w.strategy, walked, ulysses)


def kernels_per_stage(w: Workload) -> int:
    """Kernel calls one pipeline stage makes (its forward, or its backward), the most over the
    busiest ranks' block plans (``work.stage_tiles``): a ring step's tiles against one
    shard (the hybrid's against one union of U shards), the all-gather's against all keys
    per head group, the all-to-all's over the whole sequence."""
    return max(rank_plan(w, rank).most_calls for rank in busiest_ranks(w))


def kernel_rate_fractions(w: Workload, hw: Hardware, rank: int) -> tuple[float, float]:
    """(forward, backward): the fractions of the hardware's attention rates ``rank``'s kernels
    run at. Each tile of its block plan runs at a size curve's value, the causal curve's
    for causal tiles (and anti-causal ones, which the kernels compute as causal), the full
    curve's for the rest, looked up at the tile's keys where ``hw.size_curve_by_keys``
    (measured so for ``local``'s kernels: docs/planner.md section 6), else at the rank's
    shard. A tile with an explicit mask (windows' and documents' edges) computes its whole
    area, the pairs it masks out too, at the full curve's rate. The tiles' times add, so
    the fractions are the rank's visible pairs over the sum of each tile's computed pairs
    over its rate's fraction."""
    if not (hw.attention_size_curve or hw.attention_causal_size_curve):
        return 1.0, 1.0
    plan = rank_plan(w, rank)
    return _rate_fractions(plan, plan.scale(w.seq), hw, None if hw.size_curve_by_keys else kernel_tokens(w))


@functools.lru_cache(maxsize=256)  # a sweep asks again for the same plan; a plan growing with T has a shape per tile
def _rate_fractions(plan: RankPlan, scale: float, hw: Hardware, tokens: int | None) -> tuple[float, float]:
    """``kernel_rate_fractions`` of ``plan``'s tiles, their sides times ``scale``, looked up at
    their keys (``tokens`` None) or at ``tokens``."""
    pairs = forward = backward = 0.0
    for kind, nq, nk, visible, n in plan.shapes:
        queries, keys = nq * scale, nk * scale
        causal = kind in (MaskKind.CAUSAL, MaskKind.ANTI_CAUSAL)
        computed = queries * (queries + 1) / 2 if causal else queries * keys
        seen = visible if kind is MaskKind.PARTIAL else computed
        f, b = hw.attention_size_scale(keys if tokens is None else tokens, causal)
        pairs, forward, backward = pairs + n * seen, forward + n * computed / f, backward + n * computed / b
    return (pairs / forward, pairs / backward) if pairs else (1.0, 1.0)


def accumulated_bytes(*, batch: int, queries: float, keys: float, heads: int, kv_heads: int, head_dim: int,
                      acc: int) -> tuple[float, float]:
    """(forward, backward) accumulator bytes one tile of ``queries`` x ``keys`` updates over
    ``heads`` (``kv_heads``): its output merged, B·q·h·D elements; its gradients added,
    B·(q·h + 2·k·h_kv)·D."""
    return (acc * batch * queries * heads * head_dim,
            acc * batch * (queries * heads + 2 * keys * kv_heads) * head_dim)


def tile_overhead_seconds(w: Workload, hw: Hardware, rank: int) -> tuple[float, float]:
    """(forward, backward) seconds ``rank``'s tiles cost beyond their kernels: each tile of
    its block plan merges its output into the accumulators (forward) and adds its
    gradients into dQ, dK and dV (backward), at the hardware's tile overhead per kernel
    call plus its seconds per byte accumulated (``accumulated_bytes``) over the heads the
    rank computes (the hybrid's and the all-to-all's H/U and H_kv'/U after their
    all-to-all). The all-gather calls each tile once per head group: the fixed part once
    per group, the bytes those of all its heads."""
    if not any(getattr(hw, key) for key in TILE_OVERHEADS):
        return 0.0, 0.0
    u = w.ulysses_degree
    heads, kv_heads = w.heads_per_gpu // u, w.kv_heads_sent // u
    calls = gather_groups(w.kv_heads_per_gpu) if w.strategy == "allgather" else 1  # kernel calls per tile
    forward = backward = 0.0
    plan = rank_plan(w, rank)
    scale = plan.scale(w.seq)
    for _, nq, nk, _, n in plan.shapes:
        queries, keys = nq * scale, nk * scale
        merged, added = accumulated_bytes(batch=w.batch, queries=queries, keys=keys, heads=heads, kv_heads=kv_heads,
                                          head_dim=w.model.head_dim, acc=w.acc)
        forward += n * (calls * hw.tile_forward_overhead + hw.tile_forward_seconds_per_byte * merged)
        backward += n * (calls * hw.tile_backward_overhead + hw.tile_backward_seconds_per_byte * added)
    return forward, backward


def compute_seconds(w: Workload, hw: Hardware, rank: int | None = None) -> tuple[float, float]:
    """(forward, backward) compute seconds of one layer on ``rank`` (by default the slowest of
    the busiest ranks): its forward FLOPs at the forward rate and the backward's 2.5x at
    the backward rate, each at the fraction its kernels run at (``kernel_rate_fractions``),
    plus what its tiles cost beyond their kernels (``tile_overhead_seconds``)."""
    if rank is None:
        return max((compute_seconds(w, hw, r) for r in busiest_ranks(w)), key=sum)
    if not (isinstance(rank, int) and 0 <= rank < w.cp):
        raise ValueError(f"rank {rank!r} is not one of the CP group's ranks 0..{w.cp - 1}")
    flops = attention_forward_flops_per_rank(w)[rank]
    forward, backward = kernel_rate_fractions(w, hw, rank)
    extra = tile_overhead_seconds(w, hw, rank)
    return (flops / (forward * hw.forward_flops) + extra[0],
            BACKWARD_FLOPS_RATIO * flops / (backward * hw.backward_flops) + extra[1])


def attention_time(w: Workload, hw: Hardware, world: int | None = None) -> AttentionTime:
    """Forward and backward pipelines of one layer (see the module docstring); the CP groups
    laid over ``world`` GPUs (default ``w``'s; a pipeline stage's workload takes the job's)."""
    world = world or w.world_size
    fwd_compute, bwd_compute = compute_seconds(w, hw)
    kernels = kernels_per_stage(w) if hw.launch_overhead else 1  # counting walks the block plan: only if it costs
    lat = hw.latency
    a2a, rest = split_traffic(w)

    def overhead(stages: int, backward: bool) -> float:
        """Per stage of the forward (or backward) pass, whose bytes are spread over its stages."""
        own, shuffled = (rest.backward, a2a.backward) if backward else (rest.forward, a2a.forward)
        return stage_overhead(hw, w.strategy, kernels, own / stages, shuffled / stages)

    bw = hw.bandwidth(w.tp * w.cp, world)
    a2a_bw = all_to_all_bandwidth(w, hw, world)
    if w.strategy == "allgather":
        n = gather_groups(w.kv_heads_per_gpu)  # one head group gathered per stage
        gather, reduce = rest.forward / n / bw + lat, (rest.backward - rest.forward) / n / bw + lat
        return AttentionTime(
            Pipeline(n, fwd_compute / n, gather, lead=gather, overhead=overhead(n, False)),
            Pipeline(n, bwd_compute / n, gather + reduce, lead=gather, tail=reduce,
                     overhead=overhead(n, True)), bw)
    r = w.ring_degree
    if ring_window_per_rank(w) is not None:  # the ring stops once the halo has arrived
        r = 1 + traffic.window_steps(local_len=w.local_len, world=w.cp, window=w.mask.window)
    hops = max(r - 1, 1)
    hop_latency = lat if r > 1 else 0.0  # one message per hop
    kv_hop = rest.forward / hops / bw + hop_latency
    dkv_hop = (rest.backward - rest.forward) / hops / bw + hop_latency
    a2a_latency = A2A_MESSAGES * lat if w.ulysses_degree > 1 else 0.0  # q/k/v there, outputs (or gradients) back
    return AttentionTime(
        Pipeline(r, fwd_compute / r, kv_hop, lead=a2a.forward / a2a_bw + a2a_latency,
                 overhead=overhead(r, False)),
        Pipeline(r, bwd_compute / r, kv_hop + dkv_hop, lead=a2a.backward / a2a_bw + a2a_latency, tail=dkv_hop,
                 overhead=overhead(r, True)),
        bw if r > 1 else a2a_bw)


def all_to_all_bandwidth(w: Workload, hw: Hardware, world: int | None = None) -> float:
    """Bytes/s per GPU per direction of the all-to-all (the alltoall strategy's CP group, the
    hybrid's Ulysses group): U CP ranks t GPUs apart, the groups laid over ``world`` GPUs
    (default ``w``'s). What ``attention_time`` prices and ``links`` shows: one place, so that
    the two cannot part."""
    return hw.all_to_all_bandwidth(w.tp * w.ulysses_degree, w.tp, world or w.world_size)


@dataclass(frozen=True)
class Link:
    """The link one parallel group's collectives cross (Megatron's rank order: ``links``)."""

    group_size: int  # GPUs in the group
    span: int  # consecutive GPUs from its first member to its last
    crosses_nodes: bool
    bandwidth: float  # bytes/s per GPU per direction
    straddling_group: int | None = None  # first GPU of its first copy that leaves a node; None: none does
    all_to_all: bool = False  # an all-to-all's: across nodes, its in-node share rides the intra-node link

    @property
    def name(self) -> str:
        if not self.crosses_nodes:
            return "intra-node"
        return "intra- and inter-node (all-to-all)" if self.all_to_all else "inter-node"

    def as_dict(self) -> dict:
        return dict(group_size=self.group_size, spans_gpus=self.span, crosses_nodes=self.crosses_nodes,
                    link=self.name, bandwidth=self.bandwidth)


def links(w: Workload, hw: Hardware) -> dict[str, Link]:
    """"tp" and "cp" (and "ulysses", the hybrid's all-to-all): TP groups are t consecutive GPUs,
    CP ranks t apart (a group spans t·P GPUs), a hybrid's all-to-all U CP ranks (t·U GPUs).
    The G = DP·P GPUs of a pipeline stage holding one TP shard keep it in step: "fsdp", Z
    of them t apart (spanning t·Z GPUs), and "replicas" (HSDP, the G/Z copies of a shard)
    or "dp" (DDP, all G) spanning the stage's t·P·DP GPUs. "pp": neighbouring stages are
    t·P·DP GPUs apart, so the pipeline spans every GPU. A group is priced at the inter-node
    link when any of its copies over the job's GPUs leaves a node: the slowest sets the step;
    an all-to-all's (the all-to-all strategy's CP group, the hybrid's "ulysses") at
    ``Hardware.all_to_all_bandwidth``, its in-node share over the faster link."""
    def link(size: int, span: int, all_to_all: bool = False) -> Link:
        start = hw.straddling_group(span, w.world_size)
        bandwidth = all_to_all_bandwidth(w, hw) if all_to_all else hw.bandwidth(span, w.world_size)
        return Link(size, span, start is not None, bandwidth, start, all_to_all)

    out = {"tp": link(w.tp, w.tp), "cp": link(w.cp, w.tp * w.cp, all_to_all=w.strategy == "alltoall")}
    if w.strategy == "hybrid":
        out["ulysses"] = link(w.ulysses_degree, w.tp * w.ulysses_degree, all_to_all=True)
    if w.pp > 1:  # neighbouring stages are t·P·DP GPUs apart: all of them span every GPU
        out["pp"] = link(w.pp, w.world_size)
    group, z = w.data_parallel_group, w.fsdp
    if z > 1:
        out["fsdp"] = link(z, w.tp * z)
    if group > z:  # within one pipeline stage: its t·P·DP GPUs
        out["dp" if z == 1 else "replicas"] = link(group // z, w.gpus_per_stage * w.data_parallel)
    return out


def tp_traffic(w: Workload) -> traffic.TensorParallelTraffic:
    """Bytes one GPU sends per layer for tensor parallelism (``traffic.tensor_parallel``)."""
    return traffic.tensor_parallel(batch=w.batch, local_len=w.local_len, hidden=w.model.hidden, tp=w.tp,
                                   elem=w.elem, sequence_parallel=w.sequence_parallel)


def dp_traffic(w: Workload) -> traffic.DataParallelTraffic:
    """Bytes one GPU sends per step for DP / FSDP (``traffic.data_parallel``) over the
    G = DP·P GPUs holding its TP shard of the busiest stage's parameters."""
    return traffic.data_parallel(parameters=w.stage().model.parameters_per_tp_rank(w.tp), elem=w.elem,
                                 group=w.data_parallel_group, fsdp=w.fsdp, microbatches=w.microbatches)


@dataclass(frozen=True)
class DataParallelTime:
    """One step's DP / FSDP communication, as pipelines over the stage's L layers (an even
    share of the bytes each) beside one micro-batch's compute: FSDP's forward all-gathers,
    the next layer's posted while this one computes and the first exposed (``forward``);
    the backward's re-gather (with one micro-batch) and gradient reduction per layer behind
    that layer's backward, the first re-gather and the last reduction exposed
    (``backward``; DDP has only the reduction). What they add to the step is their
    ``exposed`` seconds."""

    traffic: traffic.DataParallelTraffic
    forward: Pipeline | None
    backward: Pipeline | None

    @property
    def exposed(self) -> float:
        return sum(p.exposed for p in (self.forward, self.backward) if p is not None)

    def as_dict(self) -> dict:
        t = self.traffic
        return dict(gather_bytes=t.gather, gathers=t.gathers, gradient_bytes=t.gradients, replicate_bytes=t.replicate,
                    total_bytes=t.total, exposed_seconds=self.exposed,
                    forward=None if self.forward is None else self.forward.as_dict(),
                    backward=None if self.backward is None else self.backward.as_dict())


@dataclass(frozen=True)
class PipelineSchedule:
    """m micro-batches through k pipeline stages (v chunks each): the busiest stage runs
    m + (k-1)/v micro-batches' worth of time (Narayanan et al. 2021, arXiv:2104.04473: the
    bubble is (k-1)/(v·m) of the work), each ending its forward and its backward of every
    chunk with a send of its output to the neighbouring stage (``pipeline_schedule``). With
    k = 1 and m > 1: gradient accumulation, no sends."""

    stages: int  # k
    virtual: int  # v
    microbatches: int  # m
    message_bytes: int  # one activation (or its gradient) sent to the next (or previous) stage
    message_seconds: float  # at the pipeline link's bandwidth, plus one latency

    @property
    def slots(self) -> float:
        """Micro-batches' worth of time the busiest stage takes: m + (k-1)/v."""
        return self.microbatches + (self.stages - 1) / self.virtual

    @property
    def bubble(self) -> float:
        """The stage's idle time as a fraction of its work: (k-1)/(v·m)."""
        return (self.stages - 1) / (self.virtual * self.microbatches)

    @property
    def p2p_seconds_per_microbatch(self) -> float:
        """2·v sends per micro-batch on a stage, on the critical path."""
        return 2 * self.virtual * self.message_seconds

    def as_dict(self) -> dict:
        return dict(stages=self.stages, virtual_stages=self.virtual, microbatches=self.microbatches,
                    slots=self.slots, bubble_over_work=self.bubble, p2p_message_bytes=self.message_bytes,
                    p2p_message_seconds=self.message_seconds,
                    p2p_seconds_per_microbatch=self.p2p_seconds_per_microbatch)


@dataclass(frozen=True)
class StepTime:
    """One training step on the busiest rank, seconds. The fields are one micro-batch's
    forward + backward over the layers of the busiest stage (all of them without PP);
    ``seconds`` runs them through the ``schedule`` and adds the exposed DP time."""

    matmul: float
    attention: AttentionTime
    layers: int
    recompute: bool
    tp_forward: float = 0.0  # one layer's exposed TP communication, forward
    tp_backward: float = 0.0  # and backward (re-gathers overlapped: not counted)
    data_parallel: DataParallelTime | None = None  # None: no other GPU holds the same parameters
    schedule: PipelineSchedule | None = None  # None: one micro-batch, no PP (the fields above are per micro-batch)

    @property
    def attention_seconds(self) -> float:
        """All layers; checkpointing runs each layer's attention forward (and its traffic) twice."""
        per_layer = self.attention.seconds + (self.attention.forward.seconds if self.recompute else 0.0)
        return self.layers * per_layer

    @property
    def tp_seconds(self) -> float:
        """All layers' TP collectives, exposed; checkpointing runs the forward's twice."""
        return self.layers * (self.tp_forward * (2 if self.recompute else 1) + self.tp_backward)

    @property
    def compute_seconds(self) -> float:
        """Matmuls, attention and TP communication: the work DP / FSDP transfers hide behind."""
        return self.matmul + self.attention_seconds + self.tp_seconds

    @property
    def forward_seconds(self) -> float:
        """The part of ``compute_seconds`` before the backward: one pass of the matmuls, every
        layer's attention forward and forward TP collectives."""
        layers = self.layers * (self.attention.forward.seconds + self.tp_forward)
        return self.matmul / matmul_passes(self.recompute) + layers

    @property
    def dp_seconds(self) -> float:
        """DP / FSDP communication the compute does not hide."""
        return 0.0 if self.data_parallel is None else self.data_parallel.exposed

    @property
    def microbatch_seconds(self) -> float:
        """One micro-batch on the busiest stage: its compute and its pipeline sends."""
        return self.compute_seconds + (self.schedule.p2p_seconds_per_microbatch if self.schedule else 0.0)

    @property
    def seconds(self) -> float:
        slots = self.schedule.slots if self.schedule else 1
        return slots * self.microbatch_seconds + self.dp_seconds

    def as_dict(self) -> dict:
        return dict(seconds=self.seconds, microbatch_seconds=self.microbatch_seconds,
                    schedule=None if self.schedule is None else self.schedule.as_dict(),
                    matmul_seconds=self.matmul, attention_seconds=self.attention_seconds,
                    tp_communication_seconds=self.tp_seconds, data_parallel_communication_seconds=self.dp_seconds,
                    data_parallel=None if self.data_parallel is None else self.data_parallel.as_dict(),
                    attention_per_layer=dict(forward=self.attention.forward.as_dict(),
                                             backward=self.attention.backward.as_dict(),
                                             link_bandwidth=self.attention.link_bandwidth),
                    tp_per_layer=dict(forward_seconds=self.tp_forward, backward_seconds=self.tp_backward))


def matmul_passes(recompute: bool) -> int:
    """Forwards' worth of matmuls in a training step: forward + backward (2x), + 1 recomputed."""
    return 4 if recompute else 3


def matmul_seconds(w: Workload, hw: Hardware, passes: int) -> float:
    """``passes`` forwards' worth of the matmuls on the rank's B·T/P tokens, 1/t of them per GPU."""
    return passes * matmul_flops_per_token(w) * w.batch * w.local_len / w.tp / hw.matmul_flops


def stage_overhead(hw: Hardware, strategy: str, kernels: int = 1, moved: float = 0.0, a2a_moved: float = 0.0) -> float:
    """What every pipeline stage pays serially: its ``kernels`` launches and the step
    overhead, fixed and per byte it sends: ``moved`` bytes by the strategy's own hops or
    collectives, ``a2a_moved`` by all-to-all (the all-to-all's figure, also for the
    hybrid's)."""
    return (kernels * hw.launch_overhead + hw.step_overhead_for(strategy) + moved * hw.step_overhead_per_byte(strategy)
            + a2a_moved * hw.step_overhead_per_byte("alltoall"))


def pipeline_schedule(w: Workload, hw: Hardware) -> PipelineSchedule | None:
    """``w``'s schedule (None for one micro-batch without PP). A stage sends its output
    B·S_sp·d·b per GPU: with sequence parallelism each of the t GPUs its S/t tokens, without
    it the whole B·S·d·b (Megatron-Core's point-to-point sends the tensor each TP rank holds)."""
    if w.pp == 1 and w.microbatches == 1:
        return None
    if w.pp == 1:
        return PipelineSchedule(1, 1, w.microbatches, 0, 0.0)
    message = w.batch * w.sequence_region_len * w.model.hidden * w.elem
    return PipelineSchedule(w.pp, w.virtual_stages, w.microbatches, message,
                            message / links(w, hw)["pp"].bandwidth + hw.latency)


def step_time(w: Workload, hw: Hardware) -> StepTime:
    """Matmuls (3 forwards' worth, 4 with checkpointing; 1/t of them per GPU) plus every
    layer's attention and TP communication, per micro-batch on the busiest stage (all of
    the model without PP), times the schedule's slots, plus the exposed DP communication."""
    stage = w.stage()
    recompute = stage.checkpointing == "full"
    matmul = matmul_seconds(stage, hw, matmul_passes(recompute))
    tp, bw = tp_traffic(stage), hw.bandwidth(stage.tp, w.world_size)
    lat = tp.collectives * hw.latency
    step = StepTime(matmul, attention_time(stage, hw, w.world_size), stage.model.layers, recompute,
                    tp.forward / bw + lat, tp.backward / bw + lat, schedule=pipeline_schedule(w, hw))
    return replace(step, data_parallel=data_parallel_time(w, hw, step))


def data_parallel_time(w: Workload, hw: Hardware, step: StepTime) -> DataParallelTime | None:
    """``DataParallelTime`` of ``w`` beside the compute of ``step`` (its ``step_time``); None
    when G = DP·P is 1.

    Per layer of the stage: an all-gather g = gather/L over the FSDP link (again in the
    backward with one micro-batch), a reduction r = gradients/L over it plus replicate/L
    over the replicas' link, one latency per collective.
    """
    moved = dp_traffic(w)
    if moved.total == 0:
        return None
    layers, lat, group_links = step.layers, hw.latency, links(w, hw)
    forward_layer = step.forward_seconds / layers
    backward_layer = (step.compute_seconds - step.forward_seconds) / layers
    if "dp" in group_links:  # DDP: the gradients' all-reduce, bucketed per layer behind the backward
        reduce = moved.gradients / layers / group_links["dp"].bandwidth + lat
        return DataParallelTime(moved, None, Pipeline(layers, backward_layer, reduce, tail=reduce))
    fsdp = group_links["fsdp"].bandwidth
    gather = moved.gather / layers / fsdp + lat
    reduce = moved.gradients / layers / fsdp + lat
    if "replicas" in group_links:
        reduce += moved.replicate / layers / group_links["replicas"].bandwidth + lat
    regather = gather if moved.gathers == 2 else 0.0
    return DataParallelTime(moved, Pipeline(layers, forward_layer, gather, lead=gather),
                            Pipeline(layers, backward_layer, regather + reduce, lead=regather, tail=reduce))


def efficiency(w: Workload, hw: Hardware) -> float:
    """Parallel efficiency: CP-1 step time / (P x CP-P step time); 1.0 = perfect scaling."""
    return scaling(step_time(w.unsplit(), hw).seconds, w.cp, step_time(w, hw).seconds)


def scaling(single_seconds: float, cp: int, step_seconds: float) -> float:
    """``efficiency`` from the two step times it compares."""
    return single_seconds / (cp * step_seconds)


@functools.lru_cache(maxsize=1024)  # the table, the JSON and the recommendation ask alike
def overlap_local_len(w: Workload, hw: Hardware, backward: bool = False) -> int | None:
    """Tokens per rank S from which the forward's (``backward``: the backward's) transfers hide
    behind compute: the boundary nearest ``w``'s own S, below it where they hide there (the
    smallest S down to which they still do), above it where they do not, among the lengths
    the layout splits, found by evaluating the pipeline (from S·transfer/compute, halving or
    doubling, then bisecting).

    The Ring Attention overlap condition (Liu et al. 2023, arXiv:2310.01889: block size
    >= F/B for MHA, non-causal, bf16), here for this workload's GQA ratio, mask, dtype,
    layout and fixed costs: a stage's compute grows as S² and its transfer as S, so without
    fixed costs they meet at S·transfer/compute; per-message latency, size curves and tile
    overheads move the meeting point, which that ratio missed by 28% (100 us latency) to 5x
    (the H200 preset's size curves). Lengths beyond 4T (and the planner's ``MAX_PLAN_SEQ``)
    are not evaluated: a threshold past them is the ratio at the longest evaluated, where
    fixed costs weigh least. None where nothing overlaps (all-to-all) or nothing moves, and
    under documents or a window: there compute grows as S times a document or window length,
    and the threshold is not a length per rank (``Pipeline.hidden`` still says whether the
    transfer hides now).
    """
    def passing(k: int) -> Pipeline | None:  # the pass at T = k layout multiples
        try:
            t = attention_time(w.with_(seq=k * multiple), hw)
        except ValueError:  # a length the workload refuses (too short for its shards)
            return None
        return t.backward if backward else t.forward

    def hidden(k: int) -> bool:
        p = passing(k)
        return p is not None and p.hidden

    multiple = w.seq_multiple
    k_now = w.seq // multiple
    now = passing(k_now)
    if now is None or now.stages == 1 or now.transfer == 0 or not w.mask.is_plain:
        return None

    def ratio(k: int, p: Pipeline) -> int:  # S·transfer/compute at T = k multiples, in multiples
        return max(1, math.ceil(k * p.transfer / p.compute))

    # start where the ratio puts it, so that the lengths evaluated are near the threshold (small, cheap) rather
    # than near the plan's T; where they hide now, look no further than T, and where not, from T up to 4T
    if now.hidden:  # a boundary in (0, k_now]: not hidden at lo (or lo = 0), hidden at hi
        lo = hi = min(ratio(k_now, now), k_now)
        if hidden(hi):
            lo //= 2
            while lo and hidden(lo):
                lo, hi = lo // 2, lo
        else:
            while not hidden(hi):
                lo, hi = hi, min(hi * 2, k_now)
    else:  # a boundary above k_now
        limit = max(k_now, min(4 * w.seq, MAX_PLAN_SEQ) // multiple)
        lo, hi = k_now, max(ratio(k_now, now), k_now + 1)
        if hi > limit:
            return ratio(k_now, now) * multiple // w.cp
        while not hidden(hi):
            if hi >= limit:  # the ratio where the search stops
                last = passing(hi)
                return max(ratio(hi, last) if last else 0, hi + 1) * multiple // w.cp
            lo, hi = hi, min(hi * 2, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi * multiple // w.cp
