"""The fidelity guard: what in a transformers model ctxpar cannot compute exactly, found
before any forward and before any collective.

``find_unsupported(model)`` reads the model's configs (its own, its sub-configs and the
per-layer configs its modules hold) and its module tree; ``check_model`` raises one error
listing every feature found, each with its setting and, where there is one, the fix.
What is honoured rather than refused: causal and bidirectional softmax attention, causal
sliding windows and chunked attention (layer kinds below; each layer's window or chunk
is read from the mask transformers builds for it, and anything else in that mask is
refused at call time), attention sinks passed as ``s_aux``, any constant ``scaling`` the
model passes (Granite, Gemma's query_pre_attn_scalar, Whisper), GQA / MQA, K and V head
dims that differ (DeepSeek's MLA), final-logit soft-capping, MoE layers, RoPE whose
frequencies are fixed, LongRoPE where every rank takes the sequence's factors, and dynamic
RoPE scaling below max_position_embeddings (both checked per forward, ``longrope_limits``,
``dynamic_rope_limits``), and heads that score every token (causal LM, token classification,
question answering's start and end logits); heads that pool a row at one position
(sequence classification, multiple choice, a pooler) are refused, as are embeddings that
read a token's neighbours (MobileBERT's trigram input). The call-time half of the guard (keyword arguments,
masks, LongRoPE's lengths) lives in ``attention.py``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class Unsupported:
    """One model feature ctxpar would compute differently, so refuses."""

    feature: str  # e.g. "attention logit soft-capping"
    where: str  # the setting or module that has it, e.g. "Gemma2Config.attn_logit_softcapping=50.0"
    fix: str = ""  # how to run anyway, when there is a way

    def __str__(self) -> str:
        return f"{self.feature} ({self.where})" + (f"; {self.fix}" if self.fix else "")


# Layer kinds (config.layer_types and friends) whose token mixing is softmax attention over
# the causal prefix, a sliding window or chunks of it (honoured through their masks), or none.
_SOFTMAX_KINDS = {"full_attention", "attention", "global", "mlp", "moe", "dense", "sparse",
                  "sliding_attention", "local", "sliding", "chunked_attention"}
_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types", "attention_layers")

_DROPOUT_FIELDS = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop", "attn_dropout")
_LAYERDROP_FIELDS = ("layerdrop", "decoder_layerdrop", "encoder_layerdrop")
# in training each rank draws the layers it skips from its own RNG: ranks that skip different layers
# attend with each other's K/V of another layer (silently wrong), or wait on each other
_LAYERDROP = "LayerDrop (each rank would draw the layers it skips in training on its own)"

# Sub-models beyond the text decoder, and forward inputs beyond tokens: pixels, audio or
# byte patches are not the token sequence that shard_inputs splits.
_TOWER = re.compile(r"vision|audio|speech|image|video|vq|patcher|encoder")
_NON_TEXT_INPUTS = ("pixel_values", "pixel_values_videos", "image_patches", "input_features", "input_values",
                    "audio_values")
_MULTIMODAL = "inputs beyond the token sequence (vision or audio towers, byte patchers)"
_MULTIMODAL_FIX = "apply context parallelism to the text decoder alone"

# Modules that carry state along the sequence outside softmax attention: a shard would
# start from a zero state instead of its predecessor's.
_RECURRENT = re.compile(r"Mamba|Mixer|Rwkv|LSTM|Recurrent|DeltaNet|LinearAttention|LightningAttention|ShortConv")

# Heads and modules whose output for a row is read at one position (the last non-padding
# token, or the first): under CP each rank reads it from its own shard, whose last (first)
# token is not the sequence's. Per-token heads (causal LM, token classification, question
# answering's start/end logits) are split with the tokens and stay exact. A pooler is told by
# its class's name or its attribute's (ALBERT's is an nn.Linear); one computed inline (CLIP's
# text model) only by the pooler_output it returns, refused after the forward.
_POOLING_HEAD = re.compile(r"For(SequenceClassification|MultipleChoice|NextSentencePrediction)$")
_POOLING = ("a head that pools over the sequence: it reads each row at one position, and a rank's shard's last "
            "(or first) token is not the sequence's")
_POOLER = ("a pooler: it reads each row at one position, and a rank's shard's first (or last) token is not the "
           "sequence's")
POOL_WHERE_HELD = "pool the position it reads on the rank whose shard holds it (shard_inputs' position_ids say which)"
_POOLER_FIX = f"build the model without it (add_pooling_layer=False, where its class takes it) and {POOL_WHERE_HELD}"
_POOLING_FIX = f"run its base model (model.base_model) under context parallelism and apply the head: {POOL_WHERE_HELD}"


def _configs(model: nn.Module) -> list:
    """The model's config, its sub-configs (recursively) and every per-module config, once each."""
    from transformers import PretrainedConfig

    found: dict[int, PretrainedConfig] = {}

    def add(config) -> None:
        if not isinstance(config, PretrainedConfig) or id(config) in found:
            return
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            add(getattr(config, key, None))

    add(getattr(model, "config", None))
    for module in model.modules():
        add(getattr(module, "config", None))
    return list(found.values())


def _get(config, field: str):
    try:  # some configs expose derived fields as properties that can raise
        return getattr(config, field, None)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _layer_kinds(config) -> dict[str, str]:
    """{layer kind: the config field that lists it}."""
    kinds: dict[str, str] = {}
    for field in _KIND_FIELDS:
        value = _get(config, field)
        if isinstance(value, (list, tuple)):
            for kind in value:
                kinds.setdefault(str(kind), field)
    return kinds


def _rope_setups(config) -> list[tuple[str, dict]]:
    """(field, parameters) of each RoPE set-up of a config: ``rope_parameters`` (one, or one
    per layer type), or a legacy ``rope_scaling`` where there is none (transformers 5 keeps
    ``rope_scaling`` as another name for ``rope_parameters``)."""
    for field in ("rope_parameters", "rope_scaling"):
        value = _get(config, field)
        if not isinstance(value, dict):
            continue
        if "rope_type" in value or "type" in value:
            return [(field, value)]
        return [(f"{field}[{key!r}]", v) for key, v in value.items() if isinstance(v, dict)]
    return []


def _rope_type(parameters: dict) -> str:
    return str(parameters.get("rope_type", parameters.get("type", "default")))


def longrope_limits(model: nn.Module) -> tuple[int, ...]:
    """The original_max_position_embeddings of every LongRoPE set-up in the model's configs:
    from there on a forward takes the long factors (``attention.check_rope_lengths``)."""
    limits = set()
    for config in _configs(model):
        for _, parameters in _rope_setups(config):
            limit = parameters.get("original_max_position_embeddings")
            if _rope_type(parameters) == "longrope" and limit is not None:
                limits.add(int(limit))
    return tuple(sorted(limits))


def dynamic_rope_limits(model: nn.Module) -> tuple[int, ...]:
    """The max_position_embeddings of every config with dynamic RoPE scaling: from there on
    transformers recomputes the frequencies from a forward's largest position
    (``attention.check_rope_lengths``)."""
    limits = set()
    for config in _configs(model):
        limit = _get(config, "max_position_embeddings")
        if limit is not None and any("dynamic" in _rope_type(p) for _, p in _rope_setups(config)):
            limits.add(int(limit))
    return tuple(sorted(limits))


def _config_features(config) -> list[Unsupported]:
    name = type(config).__name__
    found = []
    softcap = _get(config, "attn_logit_softcapping")
    if softcap:
        found.append(Unsupported("attention logit soft-capping", f"{name}.attn_logit_softcapping={softcap}"))
    for field in _DROPOUT_FIELDS:
        p = _get(config, field)
        if isinstance(p, (int, float)) and p > 0:
            found.append(Unsupported("attention dropout", f"{name}.{field}={p}", f"set {field}=0"))
    for field in _LAYERDROP_FIELDS:
        p = _get(config, field)
        if isinstance(p, (int, float)) and p > 0:
            found.append(Unsupported(_LAYERDROP, f"{name}.{field}={p}", f"set {field}=0"))
    if _get(config, "trigram_input") is True:  # MobileBERT: a shard's edge tokens would read zeros for neighbours
        found.append(Unsupported("embeddings that concatenate each token's neighbours along the sequence",
                                 f"{name}.trigram_input=True"))
    if _get(config, "alibi") is True:
        found.append(Unsupported("ALiBi position biases", f"{name}.alibi=True"))
    for kind, field in _layer_kinds(config).items():
        if kind not in _SOFTMAX_KINDS:
            found.append(Unsupported("layers that are not softmax attention over the causal prefix",
                                     f"{name}.{field} has {kind!r}"))
    towers = [key for key in getattr(config, "sub_configs", {}) or {}
              if _TOWER.search(key) and _get(config, key) is not None]
    if towers:
        found.append(Unsupported(_MULTIMODAL, f"{name}: {', '.join(towers)}", _MULTIMODAL_FIX))
    return found


# Family-specific attention variants, recognised by a method of the attention module.
_ATTENTION_VARIANTS = {
    "prepare_dynamic_mask": "dynamic mask attention (learned per-key biases, top-k key selection)",
}


def _layerdrop(module: nn.Module) -> float:
    """The probability of LayerDrop set on ``module`` (0: none)."""
    layerdrop = getattr(module, "layerdrop", 0)
    return layerdrop if isinstance(layerdrop, (int, float)) and layerdrop > 0 else 0


def check_no_layerdrop(name: str, model: nn.Module) -> None:
    """Refuse LayerDrop set on a module after ``enable_context_parallel`` (which refused it
    then), in a training forward: each rank skipped layers of its own, its peers waiting in
    the skipped layers' attention until the timeout."""
    for path, module in model.named_modules():
        if _layerdrop(module):
            raise ValueError(f"{name} has {path}.layerdrop={module.layerdrop} in training mode: {_LAYERDROP}, which "
                             f"ctxpar does not support under context parallelism; set it to 0")


def _module_features(model: nn.Module) -> list[Unsupported]:
    from transformers import PreTrainedModel

    found = []
    heads = [cls.__name__ for cls in type(model).__mro__ if _POOLING_HEAD.search(cls.__name__)]
    if heads:
        found.append(Unsupported(_POOLING, heads[0], _POOLING_FIX))
    for path, module in model.named_modules():
        owner = type(module).__name__
        if owner.endswith("SequenceSummary"):  # GPT-2's double heads
            found.append(Unsupported(_POOLING, owner, _POOLING_FIX))
        elif owner.endswith("Pooler") or path.rpartition(".")[2] == "pooler":
            found.append(Unsupported(_POOLER, owner if owner.endswith("Pooler") else f"{path}: {owner}", _POOLER_FIX))
        if _layerdrop(module):  # set on the module after its config
            found.append(Unsupported(_LAYERDROP, f"{path}.layerdrop={module.layerdrop}", "set it to 0"))
        if isinstance(module, PreTrainedModel):
            if not type(module)._can_set_attn_implementation():
                found.append(Unsupported("attention computed in the model's own code, not through transformers' "
                                         "AttentionInterface", owner))
            continue
        if getattr(module, "attn_logit_softcapping", None):
            found.append(Unsupported("attention logit soft-capping", f"{owner}.attn_logit_softcapping"))
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            found.append(Unsupported("attention temperature tuning computed from local token indices (NoPE layers)",
                                     f"{owner}.attn_temperature_tuning", "set attn_temperature_tuning=False"))
        for method, feature in _ATTENTION_VARIANTS.items():
            if callable(getattr(module, method, None)):
                found.append(Unsupported(feature, f"{owner}.{method}"))
        if _RECURRENT.search(owner):
            found.append(Unsupported("state carried along the sequence outside attention (recurrent, state-space "
                                     "or linear-attention layers)", owner))
        if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
            parent = type(model.get_submodule(path.rpartition(".")[0])).__name__ if "." in path else owner
            found.append(Unsupported("convolutions along the sequence", parent))
        if callable(getattr(module, "create_position_ids_from_input_ids", None)):
            found.append(Unsupported("position ids that start after padding_idx (RoBERTa style), not the global "
                                     "positions shard_inputs passes", owner))
    parameters = inspect.signature(model.forward).parameters
    non_text = [name for name in _NON_TEXT_INPUTS if name in parameters]
    if non_text:
        found.append(Unsupported(_MULTIMODAL, f"{type(model).__name__}.forward takes {', '.join(non_text)}",
                                 _MULTIMODAL_FIX))
    if "shared_kv_states" in parameters:  # speculative-decoding assistants (Gemma 4)
        found.append(Unsupported("attention to another model's keys and values (an assistant reading its target "
                                 "model's cache)", f"{type(model).__name__}.forward takes shared_kv_states"))
    if "position_ids" not in parameters:
        found.append(Unsupported("positions counted within the local shard",
                                 f"{type(model).__name__}.forward takes no position_ids"))
    return found


def find_unsupported(model: nn.Module) -> list[Unsupported]:
    """Every feature of ``model`` (a transformers PreTrainedModel) that ctxpar would not
    compute exactly under context parallelism, one entry per feature (its settings and
    modules joined); empty when ctxpar can run the model."""
    found = [item for config in _configs(model) for item in _config_features(config)]
    found += _module_features(model)
    wheres: dict[str, list[str]] = {}
    fixes: dict[str, str] = {}
    for item in found:
        places = wheres.setdefault(item.feature, [])
        if item.where not in places:
            places.append(item.where)
        fixes.setdefault(item.feature, item.fix)
    return [Unsupported(feature, ", ".join(places), fixes[feature]) for feature, places in wheres.items()]


def check_model(model: nn.Module) -> None:
    """Raise ValueError naming every feature ``find_unsupported`` finds; touches no process group."""
    found = find_unsupported(model)
    if found:
        lines = "\n".join(f"  - {item}" for item in found)
        raise ValueError(f"{type(model).__name__} cannot run exactly under context parallelism; ctxpar refuses "
                         f"it rather than compute something else:\n{lines}")
