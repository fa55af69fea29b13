"""What the planner is asked about: a model shape, a sequence, a parallel configuration.

``resolve_model`` turns ``--model NAME`` plus explicit shape flags into one
``ModelConfig``; ``Workload`` holds everything else and validates it before anything is
computed, with errors that name the flag to change.

Parallel layout (Megatron's rank order, TP innermost, then CP, then DP, then PP)::

    rank = tp_rank + TP·(cp_rank + CP·(dp_rank + DP·pp_rank))

so a TP group is TP consecutive GPUs and a CP group's members are TP apart, spanning
TP·CP consecutive GPUs; neighbouring pipeline stages are TP·CP·DP GPUs apart. FSDP
(ZeRO-3) shards each TP rank's parameters over Z of the DP·CP GPUs that hold the same
ones (in one stage), so Z divides DP·CP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import cached_property, lru_cache
from typing import NoReturn

from ctxpar.layout import LAYOUT_NAMES, Layout, get_layout
from ctxpar.limits import MAX_COUNT, check_count, check_splits, plain_values
from ctxpar.masks import Mask, integer_values, make_mask
from ctxpar.models.config import ModelConfig, get_config
from ctxpar.plan.documents import describe, pack
from ctxpar.strategy_rules import check_heads_split, kv_copies, ulysses_degree

DEFAULT_MODEL = "llama-3-8b"
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CHECKPOINTING = ("none", "full")


def resolve_model(name: str | None = None, **shape: int | None) -> ModelConfig:
    """The preset ``name`` (default llama-3-8b) with the given shape fields replaced.

    ``heads`` not given but ``hidden`` or ``head_dim`` given: heads = hidden / head_dim,
    the Llama convention every preset follows.
    """
    base = get_config(name or DEFAULT_MODEL)
    given = {k: v for k, v in shape.items() if v is not None}
    unknown = set(given) - set(base.as_dict())
    if unknown:
        raise ValueError(f"unknown model field(s) {sorted(unknown)}")
    for field, value in given.items():
        check_count(field, value)
    if "heads" not in given and ({"hidden", "head_dim"} & set(given)):
        hidden, head_dim = given.get("hidden", base.hidden), given.get("head_dim", base.head_dim)
        if hidden % head_dim:
            raise ValueError(f"--hidden {hidden} is not a multiple of --head-dim {head_dim}; give --heads explicitly")
        given["heads"] = hidden // head_dim
    heads, kv_heads = given.get("heads", base.heads), given.get("kv_heads", base.kv_heads)
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    return base.with_(**given)


# The largest request evaluated: per-rank work is counted token by token for every degree,
# so time and memory grow with both (T = 16M at CP 8 takes about a minute on one core).
MAX_PLAN_SEQ = 2**24


@dataclass(frozen=True)
class Workload:
    """One training step's shape and parallel layout.

    Args:
        model: the decoder's shape.
        batch: sequences per step B (each split over the CP group).
        seq: tokens per sequence T.
        dtype: compute dtype of activations, parameters and K/V ("bfloat16" | "float16" | "float32").
        cp: CP degree P: GPUs sharing one sequence.
        strategy: "ring" | "allgather" | "alltoall" | "hybrid".
        layout: "contiguous" | "zigzag" | "striped".
        ulysses: hybrid only: the all-to-all degree U (ring degree P / U).
        tp: tensor-parallel degree t (Megatron: attention heads, MLP width and vocabulary
            split over t GPUs; t divides H, H_kv and F).
        dp: data-parallel replicas of the TP x CP group; None: the fewest that ``fsdp``
            needs (``data_parallel``), 1 unless ``fsdp`` does not divide ``cp``.
        fsdp: degree Z over which parameters, gradients and optimizer states are sharded
            (each TP rank's share, over Z of the DP x CP GPUs holding it: Z divides DP·P).
        pp: pipeline-parallel stages k: the layers split over k groups of TP x CP GPUs, each
            holding at most ceil(L/k) of them (``stage_layers``).
        microbatches: m, the micro-batches of B sequences one step runs through the
            pipeline (with pp = 1: gradient accumulation).
        virtual_stages: v, Megatron's interleaved schedule: each GPU holds v chunks of
            layers (1: the plain 1F1B schedule). m must be a multiple of k.
        sequence_parallel: with tp > 1, Megatron's sequence parallelism (Korthikanti et al.
            2022): norms, residuals and the stored inputs of the column-parallel matmuls
            are split over the TP group along the sequence, and TP communicates by
            all-gather / reduce-scatter instead of all-reduce.
        checkpointing: "none" or "full" (keep only each layer's input, recompute the rest).
        causal: causal attention (decoder training).
        window: causal sliding window w: a query sees itself and the w-1 keys before it
            (None: no limit; w >= T is the same).
        documents: lengths of the documents packed into the row, repeated or cut to T
            (``plan.documents.pack``), so that they describe every length the sweep
            evaluates; a query sees only keys of its own document. None: one document.
        documents_from: where ``documents`` came from, for the report (e.g.
            "lognormal:2048,1.5 seed 0"); None: given.
    """

    model: ModelConfig
    batch: int
    seq: int
    dtype: str
    cp: int
    strategy: str = "ring"
    layout: str = "zigzag"
    ulysses: int | None = None
    tp: int = 1
    dp: int | None = None
    fsdp: int = 1
    pp: int = 1
    microbatches: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = True
    checkpointing: str = "none"
    causal: bool = True
    window: int | None = None
    documents: tuple[int, ...] | None = None
    documents_from: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"Workload model {self.model!r} must be a ModelConfig, e.g. resolve_model('llama-3-8b')")
        plain_values(self)  # numpy's integers are ints here, or the JSON report cannot be written
        for flag in ("batch", "seq", "cp", "tp", "fsdp", "pp", "microbatches", "virtual_stages"):
            check_count(flag, getattr(self, flag))
        if self.dp is not None:
            check_count("dp", self.dp)
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(ELEMENT_BYTES)}")
        if self.layout not in LAYOUT_NAMES:
            raise ValueError(f"--layout {self.layout!r} is not one of {', '.join(LAYOUT_NAMES)}")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"--checkpointing {self.checkpointing!r} is not one of {', '.join(CHECKPOINTING)}")
        if self.window is not None:
            if isinstance(self.window, bool) or not isinstance(self.window, int):
                raise ValueError(f"--window must be an integer number of keys, got {self.window!r}")
            check_count("window", self.window)
            if not self.causal:
                raise ValueError(f"--window {self.window} is a causal sliding window; drop --no-causal or --window")
        if self.documents is not None and type(self.documents) is not Lengths:
            object.__setattr__(self, "documents", _as_lengths(self.documents))
        if self.documents is not None:
            _check_documents(self.documents)
        check_splits(self.layout_obj, self.seq)
        self._check_parallel()
        u = ulysses_degree(self.strategy, self.cp, self.ulysses, name="--ulysses-degree")
        if self.heads_per_gpu % u and self.tp > 1:
            over = "P" if self.strategy == "alltoall" else "ulysses degree"
            raise ValueError(f"strategy {self.strategy!r} splits the H/TP = {self.model.heads}/{self.tp} = "
                             f"{self.heads_per_gpu} query heads of each tensor-parallel rank over {over}={u} ranks, "
                             f"which does not divide them; use strategy 'ring' or 'allgather', or a {over} that "
                             f"divides {self.heads_per_gpu}")
        check_heads_split(self.strategy, self.heads_per_gpu, self.kv_heads_per_gpu, u)

    def _check_pipeline(self) -> None:
        """Every chunk of every stage holds a layer, and a stage's chunks hold as many; the
        interleaved schedule needs PP and, as Megatron's does, a number of micro-batches that
        is a multiple of the stages."""
        k, v, m = self.pp, self.virtual_stages, self.microbatches
        if k * v > self.model.layers:
            raise ValueError(f"--pp {k} x --virtual-stages {v} = {k * v} chunks of layers, more than the model's "
                             f"{self.model.layers} layers; lower --pp or --virtual-stages")
        if v > 1 and k == 1:
            raise ValueError(f"--virtual-stages {v} interleaves pipeline stages; it needs --pp > 1")
        if self.stage_layers % v:
            raise ValueError(f"--virtual-stages {v}: a stage's {self.stage_layers} layers (ceil({self.model.layers}/"
                             f"{k})) do not split into {v} equal chunks, as Megatron's interleaved schedule needs; "
                             f"use a --virtual-stages that divides {self.stage_layers}")
        if v > 1 and m % k:
            raise ValueError(f"--microbatches {m}: the interleaved schedule (--virtual-stages {v}) runs micro-batches "
                             f"in groups of --pp {k}, so their number must be a multiple of {k} (as Megatron's "
                             f"requires); use --microbatches {-(-m // k) * k} or --virtual-stages 1")

    def _check_parallel(self) -> None:
        """TP must split heads, KV heads and the MLP width whole; sequence parallelism the
        CP shard; FSDP must shard over GPUs that hold the same parameters; the world must be
        a count (CP-1 on the same GPUs, ``unsplit``, has up to t·P·DP replicas)."""
        if self.world_size > MAX_COUNT:
            given = (f"--dp {self.dp}" if self.dp is not None else
                     f"--fsdp {self.fsdp} (which implies DP = {self.data_parallel} at --cp {self.cp})")
            raise ValueError(f"{given}: the world size TP x CP x PP x DP = {self.tp} x {self.cp} x {self.pp} x "
                             f"{self.data_parallel} = {self.world_size} GPUs is more than {MAX_COUNT}; lower "
                             f"{given.split()[0]}")
        self._check_pipeline()
        m, t = self.model, self.tp
        if m.heads % t:
            raise ValueError(f"--tp {t} does not divide the {m.heads} query heads (--heads): tensor parallelism "
                             f"gives each GPU H/TP whole heads; use a --tp that divides {m.heads}")
        if m.kv_heads % t:
            raise ValueError(f"--tp {t} does not divide the {m.kv_heads} KV heads (--kv-heads): Megatron-Core gives "
                             f"each GPU H_kv/TP whole KV heads and refuses otherwise (replicating KV heads over TP, "
                             f"as some inference engines do, is not modelled); use a --tp that divides {m.kv_heads}")
        if m.ffn % t:
            raise ValueError(f"--tp {t} does not divide the MLP width --ffn {m.ffn}; use a --tp that divides it")
        if self.sequence_parallel and t > 1 and self.local_len % t:
            multiple = self.seq_multiple
            raise ValueError(f"--seq {self.seq}: with sequence parallelism each of the TP={t} GPUs holds 1/{t} of "
                             f"the S = T/P = {self.local_len} tokens of its CP rank, so T must be a multiple of "
                             f"{multiple}; pad --seq to {-(-self.seq // multiple) * multiple} or add "
                             f"--no-sequence-parallel")
        if self.dp is not None and (self.dp * self.cp) % self.fsdp:
            need = self.fsdp // math.gcd(self.fsdp, self.cp)
            raise ValueError(f"--fsdp {self.fsdp} must divide --dp x --cp = {self.dp} x {self.cp} = "
                             f"{self.dp * self.cp}: FSDP shards each TP rank's parameters over GPUs that hold the same "
                             f"ones (data-parallel replicas x the CP group); make --dp a multiple of {need}, drop "
                             f"--dp, or lower --fsdp")

    @cached_property
    def layout_obj(self) -> Layout:
        return get_layout(self.layout, self.cp)

    @property
    def mask(self) -> Mask:
        """What each query sees in a row of ``seq`` tokens (plain causal without window and documents)."""
        return row_mask(self.seq, self.causal, self.window, self.documents)

    @property
    def ulysses_degree(self) -> int:
        """U: ranks an all-to-all spans (P for alltoall, 1 for ring and allgather)."""
        return ulysses_degree(self.strategy, self.cp, self.ulysses)

    @property
    def ring_degree(self) -> int:
        """R: ranks K/V travel around (P / U)."""
        return self.cp // self.ulysses_degree

    @property
    def heads_per_gpu(self) -> int:
        """H/t: the query heads one tensor-parallel rank's attention computes (H without TP)."""
        return self.model.heads // self.tp

    @property
    def kv_heads_per_gpu(self) -> int:
        """H_kv/t: the KV heads one tensor-parallel rank holds, the heads CP moves."""
        return self.model.kv_heads // self.tp

    @property
    def kv_heads_sent(self) -> int:
        """H_kv' = f * H_kv/t: KV heads after the copies an all-to-all needs (docs/strategies.md)."""
        return self.kv_heads_per_gpu * kv_copies(self.kv_heads_per_gpu, self.ulysses_degree)

    @property
    def data_parallel(self) -> int:
        """DP: ``dp`` if given, else the fewest replicas for which Z divides DP·P."""
        return self.dp if self.dp is not None else self.fsdp // math.gcd(self.fsdp, self.cp)

    @property
    def data_parallel_group(self) -> int:
        """G = DP·P: the GPUs of one pipeline stage holding the same TP shard of the
        parameters, which keep it in step (gradient reduction; FSDP shards over Z of them)."""
        return self.cp * self.data_parallel

    @property
    def gpus_per_stage(self) -> int:
        """TP·P: the GPUs that share one micro-batch's pass through a pipeline stage."""
        return self.tp * self.cp

    @property
    def gpus_per_replica(self) -> int:
        """TP·P·PP: the GPUs that hold one copy of the model and share one batch of sequences."""
        return self.gpus_per_stage * self.pp

    @property
    def world_size(self) -> int:
        """TP·P·PP·DP GPUs in all."""
        return self.gpus_per_replica * self.data_parallel

    @property
    def stage_layers(self) -> int:
        """Layers on the busiest pipeline stage: ceil(L/k) (L without PP), in v chunks."""
        return -(-self.model.layers // self.pp)

    def stage(self) -> Workload:
        """One micro-batch through the busiest pipeline stage: its layers, counted with the
        embedding and the LM head (the first stage holds one, the last the other), no PP."""
        if self.pp == 1 and self.microbatches == 1:
            return self
        return replace(self, model=self.model.with_(layers=self.stage_layers), pp=1, microbatches=1,
                       virtual_stages=1)

    @property
    def sequence_region_len(self) -> int:
        """Tokens per GPU in the norms and residual stream: S/t with sequence parallelism, else S."""
        return self.local_len // self.tp if self.sequence_parallel else self.local_len

    @property
    def seq_multiple(self) -> int:
        """Lengths T must be multiples of this: the layout's, and P·t under sequence parallelism."""
        return self.seq_multiple_at(self.cp)

    def seq_multiple_at(self, cp: int) -> int:
        """``seq_multiple`` at CP degree ``cp``, the same layout and TP (known before a length is)."""
        sp = cp * self.tp if self.sequence_parallel else 1
        return math.lcm(get_layout(self.layout, cp).multiple, sp)

    def padded(self, seq: int, cp: int) -> int:
        """``seq`` padded up to a length that splits at CP degree ``cp`` (``seq_multiple_at``)."""
        multiple = self.seq_multiple_at(cp)
        return -(-seq // multiple) * multiple

    @property
    def elem(self) -> int:
        """e: bytes per element of activations, K/V and parameters."""
        return ELEMENT_BYTES[self.dtype]

    @property
    def acc(self) -> int:
        """a: bytes per accumulator element (float32 for every supported dtype)."""
        return 4

    @property
    def local_len(self) -> int:
        """S = T / P."""
        return self.seq // self.cp

    def with_(self, **changes) -> Workload:
        return replace(self, **changes)

    def unsplit(self, tp: int | None = None) -> Workload:
        """The same step without CP on the same GPUs (CP-1, at TP ``tp``, default the same):
        the baseline of every CP comparison. A stage's t·P·DP GPUs become replicas of TP
        groups of ``tp``, t·P·DP/tp of them holding each TP shard (at least Z, as an implied
        DP would be); at the same TP the G = DP·P of ``data_parallel_group`` stay the same."""
        tp = self.tp if tp is None else tp
        dp = math.lcm(self.data_parallel * self.gpus_per_stage // tp, self.fsdp)
        return replace(self, cp=1, strategy="ring", ulysses=None, tp=tp, dp=dp)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["model"] = self.model.as_dict()
        if self.documents is not None:  # the row's documents, not the stream they are cut from
            row = pack(self.documents, self.seq)
            d["documents"] = dict(describe(row), lengths=list(row))
        return d


@lru_cache(maxsize=64)
def row_mask(seq: int, causal: bool, window: int | None, documents: tuple[int, ...] | None) -> Mask:
    """The ``Mask`` of a row of ``seq`` tokens: ``documents`` packed to ``seq`` (``pack``); a
    window of w >= seq, or one document, is plain attention (``masks.make_mask``)."""
    return make_mask(seq, causal=causal, documents=None if documents is None else pack(documents, seq), window=window)


class Lengths(tuple):
    """A packed row's document lengths, hashed once: they can be a million long, and through
    ``Workload`` they key the planner's caches hundreds of times in one plan (hashing them
    anew took half of such a plan's time)."""

    def __hash__(self) -> int:
        if "hash" not in self.__dict__:
            self.__dict__["hash"] = super().__hash__()
        return self.__dict__["hash"]


def _as_lengths(documents) -> Lengths:
    """Document lengths as ``ctxpar.attention``'s ``documents=`` takes them (a sequence, a 1-D
    numpy array or tensor of integers: numpy integers were refused here, and an array "got
    None"), as Python ints."""
    try:
        return Lengths(integer_values(documents))
    except ValueError:
        _refuse_documents(documents)


@lru_cache(maxsize=16)
def _check_documents(documents: Lengths) -> None:
    """Cached: the sweep builds hundreds of workloads around the same documents."""
    if not documents or not all(1 <= n <= MAX_COUNT for n in documents):
        _refuse_documents(documents)


def _refuse_documents(documents) -> NoReturn:
    raise ValueError(f"--documents must be a non-empty sequence of document lengths, integers between 1 and "
                     f"{MAX_COUNT}, got {str(documents)[:80]}")


def default_ulysses(heads: int, cp: int, gpus_per_node: int, tp: int = 1) -> int | None:
    """Hybrid's all-to-all degree: the largest U < P dividing P and H/t with t·U dividing the
    GPUs per node.

    All-to-all inside a node where bandwidth is high, the ring across (docs/strategies.md);
    CP ranks are t GPUs apart, so U of them span t·U GPUs, and where t·U does not divide the
    node some of those groups straddle two nodes (6 GPUs a node, U = 4: GPUs 4-7), pacing
    every all-to-all at the inter-node link. None when no U > 1 qualifies (hybrid would
    just be a ring).
    """
    best = None
    heads //= tp
    for u in range(2, min(cp - 1, gpus_per_node // tp) + 1):
        if cp % u == 0 and heads % u == 0 and gpus_per_node % (tp * u) == 0:
            best = u
    return best
