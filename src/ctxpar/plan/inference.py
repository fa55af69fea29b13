"""Inference under CP as arithmetic: time to first token, time per output token, KV cache
per GPU, and pass-KV vs pass-Q for a prefill on top of a cache. Formulas: docs/planner.md.

What ``ctxpar.inference`` does, and what is modelled here for it (P ranks, L layers):

- **Prefill** of a T-token prompt is a training forward without its backward: each
  layer's attention is the strategy's forward pipeline (``cost.attention_time``) at the
  attention forward rate, plus the matmuls of the rank's T/P tokens, plus, with tensor
  parallelism (t GPUs per CP rank, Megatron's split), the forward's TP collectives.
- **Decode**: every CP rank runs the whole model (its 1/t of it under TP) on the new
  token, so it reads its weights once per token; attention reads the rank's shard of the
  KV cache (ceil(S/P) positions, H_kv/t heads) and all-gathers one (B, H/t, 1, D+1)
  float32 partial per layer. Memory-bound: bytes read / memory bandwidth, plus one latency
  per layer and one per step (the step check), plus the partials' bytes; under TP, two
  all-reduces of a (B, d) activation per layer (after the attention output and the MLP
  projections; a single token has no sequence to split, so no sequence parallelism).
- **Partial prefill** (T_new tokens on top of T_cached): pass-KV is a P-stage pipeline
  whose stages move a rank's K/V (cached + new); pass-Q a P-stage pipeline whose stages
  move the new queries and send the previous stage's partial output home, the last
  partial's return exposed. Compute is the same in both: the busiest rank's new queries
  against every earlier key. Under TP each GPU does this for its H/t and H_kv/t heads.

The CP group's GPUs are t apart (TP innermost, as Megatron orders ranks), so the CP link
is the one a group of t·P GPUs spans (``Hardware.bandwidth(t·P)``); the TP link is the
inter-node one if any of the P TP groups leaves a node. With fp8 matmuls (``Hardware.fp8``)
the weights are held and read at 1 byte each; the KV cache stays in the compute dtype.

``make_inference_plan`` gathers these against CP degree for ``ctxpar plan --inference``
(printed and written as JSON by ``plan.inference_report``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ctxpar.limits import check_count
from ctxpar.models.config import ModelConfig
from ctxpar.plan import cost, traffic
from ctxpar.plan.hardware import Hardware
from ctxpar.plan.planner import check_plan_size, sweep_degrees
from ctxpar.plan.units import format_seconds
from ctxpar.plan.workload import Workload, default_ulysses

PARTIAL_PREFILL_METHODS = ("pass-kv", "pass-q")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def busiest_partial_pairs(*, cached: int, new: int, world: int) -> int:
    """(query, key) pairs of the rank with the most work when positions T_cached..T_cached+T_new-1
    are dealt round-robin (position p to rank p mod P) and the query at p sees the p+1 keys 0..p."""
    best = 0
    for rank in range(world):
        first = cached + (rank - cached) % world  # this rank's first new position
        if first >= cached + new:
            continue
        n = (cached + new - 1 - first) // world + 1  # its new positions: first, first+P, ...
        best = max(best, n * (first + 1) + world * n * (n - 1) // 2)
    return best


@dataclass(frozen=True)
class PartialPrefillCost:
    """One layer's attention of a partial prefill on the busiest rank."""

    method: str
    bytes_sent: int  # per rank per layer (``traffic.partial_prefill``)
    pipeline: cost.Pipeline

    @property
    def seconds(self) -> float:
        return self.pipeline.seconds

    def as_dict(self) -> dict:
        return dict(method=self.method, bytes_sent_per_layer=self.bytes_sent, seconds_per_layer=self.seconds,
                    pipeline=self.pipeline.as_dict())


def partial_prefill_cost(method: str, *, model: ModelConfig, batch: int, cached: int, new: int, world: int,
                         elem: int, hw: Hardware, acc: int = 4, tp: int = 1) -> PartialPrefillCost:
    """Bytes and the pipeline of one layer on one GPU, which holds H/t and H_kv/t heads (``module docstring``)."""
    heads, kv_heads = model.heads // tp, model.kv_heads // tp
    sent = traffic.partial_prefill(method, batch=batch, cached=cached, new=new, heads=heads, kv_heads=kv_heads,
                                   head_dim=model.head_dim, world=world, elem=elem, acc=acc)
    flops = 4 * model.head_dim * batch * heads * busiest_partial_pairs(cached=cached, new=new, world=world)
    compute = flops / hw.forward_flops
    overhead = cost.stage_overhead(hw, "ring", moved=sent / world)  # a ring of P steps, whichever way it passes
    if world == 1:
        return PartialPrefillCost(method, 0, cost.Pipeline(1, compute, 0.0, overhead=overhead))
    bw, latency = hw.bandwidth(tp * world), hw.latency
    if method == "pass-kv":
        hop = sent / (world - 1)
        return PartialPrefillCost(method, sent, cost.Pipeline(world, compute / world, hop / bw + latency,
                                                              overhead=overhead))
    queries = (world - 1) * batch * heads * _ceil_div(new, world) * model.head_dim * elem
    hop, home = queries / (world - 1), (sent - queries) / (world - 1)  # a step's queries; one partial
    return PartialPrefillCost(method, sent, cost.Pipeline(world, compute / world, (hop + home) / bw + 2 * latency,
                                                          tail=home / bw + latency, overhead=overhead))


def pass_q_fraction(model: ModelConfig, elem: int, acc: int = 4) -> float:
    """The bytes rule: pass-Q moves fewer bytes when T_new / (T_cached + T_new) is below this.

    From ``traffic.partial_prefill`` without the rounding: pass-Q sends T_new·H·(D·e + (D+1)·a),
    pass-KV (T_cached + T_new)·2·H_kv·D·e, so the threshold is 2·H_kv·D·e / (H·(D·e + (D+1)·a)).
    The published rule 2·H_kv/H (Yang et al. 2024, arXiv:2411.01783) counts the queries only;
    returning the partial outputs, here in float32, lowers it: about H_kv/H for float32 inputs
    and 2/3·H_kv/H for bf16.
    """
    d = model.head_dim
    return 2 * model.kv_heads * d * elem / (model.heads * (d * elem + (d + 1) * acc))


def choose_partial_prefill(*, model: ModelConfig, batch: int, cached: int, new: int, world: int, elem: int,
                           hw: Hardware | None = None, acc: int = 4, tp: int = 1) -> tuple[str, str]:
    """(method, why): the lower predicted time on ``hw``, or without hardware the fewer bytes
    (ties: pass-KV, whose compute needs no all-to-all after it)."""
    if world == 1:
        return "pass-kv", "one rank: nothing moves"
    kw = dict(model=model, batch=batch, cached=cached, new=new, world=world, elem=elem, acc=acc, tp=tp)
    if hw is None:
        kv, q = (traffic.partial_prefill(m, batch=batch, cached=cached, new=new, heads=model.heads // tp,
                                         kv_heads=model.kv_heads // tp, head_dim=model.head_dim, world=world,
                                         elem=elem, acc=acc) for m in PARTIAL_PREFILL_METHODS)
        method = "pass-q" if q < kv else "pass-kv"
        return method, (f"fewer bytes: pass-KV {kv:,} B vs pass-Q {q:,} B per rank per layer "
                        f"(T_new/(T_cached+T_new) = {new / (cached + new):.3f}, pass-Q below "
                        f"{pass_q_fraction(model, elem, acc):.3f})")
    kv, q = (partial_prefill_cost(m, hw=hw, **kw) for m in PARTIAL_PREFILL_METHODS)
    method = "pass-q" if q.seconds < kv.seconds else "pass-kv"
    return method, (f"predicted on {hw.name}: pass-KV {format_seconds(kv.seconds)} vs pass-Q "
                    f"{format_seconds(q.seconds)} per layer")


def partial_prefill_crossover(*, model: ModelConfig, batch: int, cached: int, world: int, elem: int, hw: Hardware,
                              acc: int = 4, tp: int = 1, max_new: int = 2**24) -> int | None:
    """The smallest T_new from which pass-KV is predicted no slower than pass-Q on top of
    T_cached tokens (bisection: pass-Q's advantage shrinks as the chunk grows); None if
    pass-Q stays faster up to ``max_new``, or with one rank."""
    if world == 1:
        return None

    def kv_wins(new: int) -> bool:
        kw = dict(model=model, batch=batch, cached=cached, new=new, world=world, elem=elem, acc=acc, hw=hw, tp=tp)
        return partial_prefill_cost("pass-kv", **kw).seconds <= partial_prefill_cost("pass-q", **kw).seconds

    if not kv_wins(max_new):
        return None
    lo, hi = 1, max_new  # kv_wins(hi)
    if kv_wins(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if kv_wins(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class InferencePoint:
    """Serving one prompt of T tokens, generating n, at CP degree P, per GPU."""

    cp: int
    ulysses: int | None  # the hybrid prefill's all-to-all degree U at P (None: another strategy)
    prefill_seconds: float
    decode_seconds_per_token: float | None  # None: the hardware's memory bandwidth is unknown
    kv_cache_bytes: int  # ceil((T + n - 1) / P) positions (what generate allocates), every layer, H_kv/t heads
    weight_bytes: int  # every CP rank holds the whole model (its 1/t under TP)
    fits: bool

    def as_dict(self) -> dict:
        return asdict(self)


def prefill_seconds(w: Workload, hw: Hardware) -> float:
    """Time to first token: every layer's attention forward pipeline at the forward rate (its
    fixed costs included) and its forward TP collectives, plus one forward's matmuls on the
    rank's T/P tokens at the matmul rate (1/t of them per GPU)."""
    step = cost.step_time(w, hw)
    return w.model.layers * (step.attention.forward.seconds + step.tp_forward) + cost.matmul_seconds(w, hw, 1)


def kv_cache_bytes(model: ModelConfig, *, batch: int, positions: int, cp: int, elem: int, tp: int = 1) -> int:
    """K and V of ceil(positions / P) positions and H_kv/t heads, every layer (``KVCache.nbytes``)."""
    return 2 * model.layers * batch * (model.kv_heads // tp) * model.head_dim * _ceil_div(positions, cp) * elem


def weight_bytes(model: ModelConfig, *, tp: int, elem: int, hw: Hardware) -> int:
    """One GPU's weights: its TP rank's parameters, at 1 byte where matmuls run in fp8
    (``Hardware.fp8``: fp8 serving stores the weights it multiplies in fp8), else ``elem``."""
    return model.parameters_per_tp_rank(tp) * (1 if hw.fp8 else elem)


def decode_seconds(model: ModelConfig, *, batch: int, positions: int, cp: int, elem: int, hw: Hardware,
                   tp: int = 1) -> float | None:
    """Time per output token at ``positions`` held over P ranks of t GPUs each (module docstring)."""
    if not hw.memory_bandwidth:
        return None
    weights = weight_bytes(model, tp=tp, elem=elem, hw=hw)
    kv = kv_cache_bytes(model, batch=batch, positions=positions, cp=cp, elem=elem, tp=tp)
    heads = model.heads // tp
    compute = (2 * model.parameters_per_tp_rank(tp) * batch / hw.matmul_flops
               + 4 * model.head_dim * batch * heads * positions * model.layers / cp / hw.forward_flops)
    # + one attention call per layer, launched one after another (matmul launches are not counted, as in training)
    seconds = max((weights + kv) / hw.memory_bandwidth, compute) + model.layers * hw.launch_overhead
    if tp > 1:  # two all-reduces of the token's (B, d) activation per layer
        reduce = traffic.tensor_parallel(batch=batch, local_len=1, hidden=model.hidden, tp=tp, elem=elem,
                                         sequence_parallel=False)
        seconds += model.layers * (reduce.forward / hw.bandwidth(tp, tp * cp) + reduce.collectives * hw.latency)
    if cp == 1:
        return seconds
    partials = (cp - 1) * batch * heads * (model.head_dim + 1) * 4
    return seconds + (model.layers + 1) * hw.latency + model.layers * partials / hw.bandwidth(tp * cp)


def _at_degree(w: Workload, cp: int, hw: Hardware) -> Workload:
    """``w`` at CP degree ``cp``: one GPU runs plain attention; hybrid keeps its all-to-all
    degree at the requested degree (U = P too, as training plans it) and where it splits
    ``cp`` into a ring of two or more, else takes the default (``default_ulysses``), and
    raises where none does."""
    if cp == 1:
        return w.with_(cp=1, strategy="ring", ulysses=None)
    if w.strategy != "hybrid":
        return w.with_(cp=cp, ulysses=None)
    kept = bool(w.ulysses) and (cp == w.cp or cp % w.ulysses == 0 and w.ulysses < cp)
    u = w.ulysses if kept else default_ulysses(w.model.heads, cp, hw.gpus_per_node, w.tp)
    if u is None:
        raise ValueError(f"no hybrid split of {cp} ranks")
    return w.with_(cp=cp, ulysses=u)


def inference_sweep(w: Workload, hw: Hardware, *, new_tokens: int, degrees: list[int],
                    skipped: dict[int, str] | None = None) -> list[InferencePoint]:
    """An ``InferencePoint`` for each CP degree that can split the prompt (``w.seq``); the others
    go into ``skipped`` with the reason."""
    points = []
    for cp in degrees:
        try:
            v = _at_degree(w, cp, hw)
        except ValueError as e:  # the layout cannot split T over cp ranks, or the heads do not divide
            if skipped is not None:
                skipped[cp] = str(e).removeprefix("--seq: ")
            continue
        # the cache generate allocates: the prompt and every new token but the last, which is never stored
        kv = kv_cache_bytes(w.model, batch=w.batch, positions=w.seq + new_tokens - 1, cp=cp, elem=w.elem, tp=w.tp)
        weights = weight_bytes(w.model, tp=w.tp, elem=w.elem, hw=hw)
        points.append(InferencePoint(
            cp=cp, ulysses=v.ulysses if v.strategy == "hybrid" else None, prefill_seconds=prefill_seconds(v, hw),
            decode_seconds_per_token=decode_seconds(w.model, batch=w.batch, positions=w.seq + new_tokens, cp=cp,
                                                    elem=w.elem, hw=hw, tp=w.tp),
            kv_cache_bytes=kv, weight_bytes=weights, fits=kv + weights <= hw.memory_per_rank(w.tp * cp)))
    return points


def published_pass_q_fraction(model: ModelConfig) -> float:
    """2·H_kv/H: Yang et al. 2024 (arXiv:2411.01783)'s pass-Q threshold, queries against K and V only."""
    return 2 * model.kv_heads / model.heads


@dataclass(frozen=True)
class PartialPrefillPlan:
    """A chunk of T_new tokens prefilled on top of T_cached at CP degree P: both methods, the choice, the rules."""

    cp: int
    cached: int
    new: int
    costs: tuple[PartialPrefillCost, ...]  # one per PARTIAL_PREFILL_METHODS, in that order
    method: str  # ``choose_partial_prefill`` on the hardware
    why: str
    bytes_method: str  # ``choose_partial_prefill`` without hardware: the fewer bytes
    bytes_why: str
    pass_q_fraction: float  # ``pass_q_fraction``: the bytes rule's threshold on T_new / (T_cached + T_new)
    published_fraction: float  # 2·H_kv/H
    crossover: int | None  # ``partial_prefill_crossover``: pass-KV no slower from this T_new on

    @property
    def new_fraction(self) -> float:
        return self.new / (self.cached + self.new)


@dataclass(frozen=True)
class InferencePlan:
    """Serving a T-token prompt (``workload.seq``) and generating ``new_tokens``, against CP degree,
    and the pass-KV / pass-Q choice for a follow-up chunk at ``workload.cp``."""

    workload: Workload
    hardware: Hardware
    new_tokens: int
    points: list[InferencePoint]  # one per degree that can split the prompt, CP 1 first
    partial: PartialPrefillPlan
    calibration: dict | None = None
    skipped: dict[int, str] = field(default_factory=dict)  # the degrees that cannot, and why

    def point(self, cp: int) -> InferencePoint | None:
        return next((p for p in self.points if p.cp == cp), None)

    def speedup(self, cp: int) -> float | None:
        """CP-1 prefill time / CP-P prefill time."""
        one, here = self.point(1), self.point(cp)
        return None if one is None or here is None else one.prefill_seconds / here.prefill_seconds


def partial_prefill_plan(*, model: ModelConfig, batch: int, cached: int, new: int, world: int, elem: int,
                         hw: Hardware, acc: int = 4, tp: int = 1) -> PartialPrefillPlan:
    """Both methods' bytes and pipelines, the choice with and without ``hw``, the rules and the crossover."""
    kw = dict(model=model, batch=batch, cached=cached, new=new, world=world, elem=elem, acc=acc, tp=tp)
    method, why = choose_partial_prefill(hw=hw, **kw)
    bytes_method, bytes_why = choose_partial_prefill(**kw)
    return PartialPrefillPlan(
        cp=world, cached=cached, new=new,
        costs=tuple(partial_prefill_cost(m, hw=hw, **kw) for m in PARTIAL_PREFILL_METHODS),
        method=method, why=why, bytes_method=bytes_method, bytes_why=bytes_why,
        pass_q_fraction=pass_q_fraction(model, elem, acc), published_fraction=published_pass_q_fraction(model),
        crossover=partial_prefill_crossover(model=model, batch=batch, cached=cached, world=world, elem=elem, hw=hw,
                                            acc=acc, tp=tp))


def make_inference_plan(w: Workload, hw: Hardware, *, new_tokens: int, chunk: int | None = None,
                        max_cp: int | None = None, calibration: dict | None = None) -> InferencePlan:
    """``ctxpar plan --inference``: the prompt is ``w.seq`` tokens, prefilled by ``w.strategy`` on
    ``w.layout``; degrees 1, 2, 4, ... up to ``max_cp`` (``planner.sweep_degrees``), each CP rank
    ``w.tp`` GPUs; the chunk (default T // 16, at least 1) goes on top of T + ``new_tokens`` at ``w.cp``."""
    check_plan_size(w.seq, w.cp, max_cp)
    hw = hw.for_dtype(w.dtype)
    check_count("new_tokens", new_tokens)
    chunk = max(1, w.seq // 16) if chunk is None else chunk
    check_count("chunk", chunk)
    training = [name for name, given in (("window", w.window is not None), ("documents", w.documents is not None),
                                         ("causal=False", not w.causal), ("fsdp", w.fsdp != 1),
                                         ("checkpointing", w.checkpointing != "none"),
                                         ("dp", w.dp is not None), ("pp", w.pp != 1),
                                         ("microbatches", w.microbatches != 1),
                                         ("virtual_stages", w.virtual_stages != 1)) if given]
    if training:
        raise ValueError(f"the inference plan models a causal decoder serving whole prompts, the weights on every CP "
                         f"rank (split over TP) and no backward; the workload sets {', '.join(training)}: leave them "
                         f"at their defaults")
    cached = w.seq + new_tokens
    partial = partial_prefill_plan(model=w.model, batch=w.batch, cached=cached, new=chunk, world=w.cp,
                                   elem=w.elem, hw=hw, acc=w.acc, tp=w.tp)
    skipped: dict[int, str] = {}
    points = inference_sweep(w, hw, new_tokens=new_tokens, degrees=sweep_degrees(w.cp, max_cp), skipped=skipped)
    return InferencePlan(w, hw, new_tokens, points, partial, calibration, skipped)
