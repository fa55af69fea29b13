"""What the planner is asked about: a model shape, a sequence, a CP configuration.

``resolve_model`` turns ``--model NAME`` plus explicit shape flags into one
``ModelConfig``; ``Workload`` holds everything else and validates it before anything is
computed, with errors that name the flag to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cached_property, lru_cache

from ctxpar.layout import LAYOUT_NAMES, Layout, get_layout
from ctxpar.limits import MAX_COUNT, check_count
from ctxpar.masks import Mask, make_mask
from ctxpar.models.config import ModelConfig, get_config
from ctxpar.plan.documents import describe, pack
from ctxpar.strategy_rules import check_heads, kv_copies, ulysses_degree

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
        fsdp: degree over which parameters, gradients and optimizer states are sharded.
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
    fsdp: int = 1
    checkpointing: str = "none"
    causal: bool = True
    window: int | None = None
    documents: tuple[int, ...] | None = None
    documents_from: str | None = None

    def __post_init__(self) -> None:
        for flag in ("batch", "seq", "cp", "fsdp"):
            check_count(flag, getattr(self, flag))
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
        if self.documents is not None:
            _check_documents(self.documents if isinstance(self.documents, tuple) else None)
        self.layout_obj.validate(self.seq)
        u = ulysses_degree(self.strategy, self.cp, self.ulysses, name="--ulysses-degree")
        check_heads(self.strategy, self.model.heads, self.model.kv_heads, u)

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
    def kv_heads_sent(self) -> int:
        """H_kv' = f * H_kv: KV heads after the copies an all-to-all needs (docs/strategies.md)."""
        return self.model.kv_heads * kv_copies(self.model.kv_heads, self.ulysses_degree)

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

    def unsplit(self) -> Workload:
        """The same step on one GPU (CP-1), the baseline of every comparison."""
        return replace(self, cp=1, strategy="ring", ulysses=None)

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


@lru_cache(maxsize=16)
def _check_documents(documents: tuple[int, ...]) -> None:
    """Cached: the sweep builds hundreds of workloads around the same documents."""
    if documents is None or not documents or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_COUNT for n in documents):
        raise ValueError(f"--documents must be a non-empty tuple of document lengths between 1 and {MAX_COUNT}, got "
                         f"{str(documents)[:80]}")


def default_ulysses(heads: int, cp: int, gpus_per_node: int) -> int | None:
    """Hybrid's all-to-all degree: the largest U < P dividing P and H with U <= GPUs per node.

    All-to-all inside a node where bandwidth is high, the ring across (docs/strategies.md);
    None when no U > 1 qualifies (hybrid would just be a ring).
    """
    best = None
    for u in range(2, min(cp - 1, gpus_per_node) + 1):
        if cp % u == 0 and heads % u == 0:
            best = u
    return best
