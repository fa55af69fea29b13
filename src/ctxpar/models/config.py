"""Shapes of the Llama-style reference decoder, with presets from test-sized to Llama 3."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, replace

from ctxpar.limits import whole


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder's shape.

    Args:
        layers: number of decoder blocks.
        hidden: model width d.
        heads: query heads H; head_dim * heads is the attention width.
        kv_heads: key/value heads H_kv (GQA when < heads); must divide heads.
        head_dim: per-head width D.
        ffn: SwiGLU hidden width.
        vocab: vocabulary size.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            value = whole(getattr(self, name))
            if value is None or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)  # a numpy integer becomes an int, for JSON
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
            object.__setattr__(self, name, float(value))  # a numpy float becomes a float, for JSON
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")

    def with_(self, **changes) -> ModelConfig:
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def parameters(self) -> int:
        """Parameter count: embeddings, untied LM head, attention, SwiGLU MLP and norms."""
        return self.parameters_per_tp_rank(1)

    def parameters_per_tp_rank(self, tp: int) -> int:
        """The parameters one of ``tp`` tensor-parallel ranks holds (Megatron's split): 1/t of
        every attention and MLP matrix, ceil(V/t) rows of the embedding and of the LM head,
        every norm."""
        return 2 * self.vocab_rows(tp) * self.hidden + self.layers * self.layer_parameters(tp) + self.hidden

    def layer_parameters(self, tp: int = 1) -> int:
        """One decoder block's parameters on one of ``tp`` ranks (t divides H and H_kv)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) // tp  # q, o; k, v
        mlp = 3 * self.hidden * self.ffn // tp
        return attn + mlp + 2 * self.hidden

    def vocab_rows(self, tp: int = 1) -> int:
        """ceil(V/t): vocabulary-parallel rows per rank (Megatron pads V; to a multiple of t here)."""
        return -(-self.vocab // tp)


def attention_only(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    """One layer whose attention has this shape and nothing else worth counting: what the
    planner evaluates for a single attention call (``ctxpar.auto``, calibration, benchmarks)."""
    return ModelConfig(layers=1, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=1,
                       vocab=1)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256),
    "small": ModelConfig(layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=512),
    "llama-2-7b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=11008, vocab=32000,
                              rope_theta=10000.0),
    "llama-3-8b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256),
    "llama-3-70b": ModelConfig(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256),
    "llama-3-405b": ModelConfig(layers=126, hidden=16384, heads=128, kv_heads=8, head_dim=128, ffn=53248,
                                vocab=128256),
}


def get_config(name: str) -> ModelConfig:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[key]
