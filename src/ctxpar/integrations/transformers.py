"""Hugging Face transformers: run a transformers model's attention through ctxpar.

    from ctxpar.integrations.transformers import enable_context_parallel, shard_inputs

    model = LlamaForCausalLM(config)                      # any model using AttentionInterface
    enable_context_parallel(model, layout=layout, group=cp_group, strategy="ring")
    inputs, labels = shard_inputs(input_ids, layout=layout, rank=cp_rank)
    logits = model(**inputs).logits                       # (B, T/P, vocab), this rank's rows
    share, loss = ctxpar.parallelize.cp_loss(logits, labels)

``enable_context_parallel`` registers an attention function named "ctxpar" with
transformers' ``AttentionInterface`` and a mask function of the same name with its
``AttentionMaskInterface``. The causal mask is ctxpar's, from the layout's global
positions; anything else a mask could carry is refused rather than dropped: a padding
mask with padded tokens, custom mask overlays, packed sequences, sliding-window
layers, dropout. ``shard_inputs`` passes global ``position_ids`` (RoPE) and shifts
labels before sharding; compute the loss with ``cp_loss`` rather than the model's own
(which would shift the shard again). Pass the same kind of inputs on every rank: a
padding mask refused on one rank only would leave the others waiting in attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ctxpar.attention import attention
from ctxpar.layout import Layout
from ctxpar.parallelize import shard_batch
from ctxpar.topology import hybrid_rank

NAME = "ctxpar"


@dataclass(frozen=True)
class _Settings:
    layout: Layout
    group: dist.ProcessGroup | None
    strategy: str
    mesh: object

    def positions(self, local_len: int) -> torch.Tensor:
        """The global positions this rank must be attending for."""
        if self.mesh is not None:
            rank = hybrid_rank(self.mesh)
        else:
            rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        return self.layout.positions(local_len * self.layout.world_size, rank)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
               **kwargs):
    """AttentionInterface function: q (B, H, S, D), k/v (B, H_kv, S, D) -> ((B, S, H, D), None)."""
    settings: _Settings | None = getattr(module, "ctxpar_settings", None)
    if settings is None:
        raise ValueError(f"{type(module).__name__} uses attn_implementation='ctxpar' but was not prepared; call "
                         f"enable_context_parallel(model, layout=..., group=...) first")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported under context parallelism; set it to 0")
    if kwargs.get("sliding_window"):
        raise ValueError("sliding-window attention layers are not supported by ctxpar yet")
    if attention_mask is not None:
        raise ValueError("ctxpar attention takes no explicit attention mask: its causal mask follows the layout")
    positions = kwargs.get("position_ids")
    if positions is not None and not bool((positions.cpu() == settings.positions(query.shape[2])).all()):
        raise ValueError("position_ids must be this rank's global layout positions (use shard_inputs); packed "
                         "sequences with restarting positions are not supported under context parallelism")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attention(query, key, value, layout=settings.layout, group=settings.group, strategy=settings.strategy,
                    mesh=settings.mesh, causal=bool(causal), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _mask(*args, attention_mask: torch.Tensor | None = None, use_vmap: bool = False, **kwargs):
    """AttentionMaskInterface function: ctxpar builds the causal mask itself, so return
    None, after refusing what that would silently lose: a padding mask that pads, or
    mask overlays a model adds to the causal mask (transformers flags those with
    use_vmap). Packed-sequence boundaries are caught in ``_attention`` from position_ids;
    4-D masks never get here (transformers passes them straight to attention, which
    refuses them)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("padding masks are not supported under context parallelism: pack or crop the batch so "
                         "every token is real (attention_mask all ones), or leave attention_mask out")
    if use_vmap:
        raise ValueError("this model adds custom mask overlays to the causal mask, which ctxpar does not support")
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)


def _check_supported(config) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) or any("sliding" in t for t in layer_types):
        raise ValueError(f"{type(config).__name__} uses sliding-window attention, which ctxpar does not support yet")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={config.attention_dropout} is not supported; set it to 0")


def enable_context_parallel(
    model, *, layout: Layout, group: dist.ProcessGroup | None = None, strategy: str = "ring", mesh=None
):
    """Make ``model`` (a transformers PreTrainedModel) attend with ctxpar; returns it."""
    _check_supported(model.config)
    _register()
    settings = _Settings(layout, group, strategy, mesh)
    prepared = 0
    for module in model.modules():
        if hasattr(module, "is_causal") and hasattr(module, "config"):  # the attention modules
            module.ctxpar_settings = settings
            prepared += 1
    if prepared == 0:
        raise ValueError(f"found no attention modules in {type(model).__name__}")
    model.set_attn_implementation(NAME)
    return model


def shard_inputs(
    input_ids: torch.Tensor, *, layout: Layout, rank: int, labels: torch.Tensor | None = None
) -> tuple[dict, torch.Tensor]:
    """This rank's model inputs (input_ids, position_ids, use_cache=False) and its shifted labels.

    Args:
        input_ids: (B, T) the unsplit batch. labels: (B, T) unshifted, default input_ids.
    """
    batch = shard_batch(input_ids, layout=layout, rank=rank, labels=labels)
    positions = batch.positions.unsqueeze(0).expand(input_ids.shape[0], -1)
    return dict(input_ids=batch.tokens, position_ids=positions, use_cache=False), batch.labels
