"""The functions transformers calls under ``attn_implementation="ctxpar"``: attention and mask.

Every keyword argument a model passes to its attention function is either honoured
exactly, accepted because it cannot change attention, or refused with an error naming it;
nothing is dropped. The argument names below are the ones transformers 5's attention
modules and ``TransformersKwargs`` pass (``position_ids`` from the decoder layer,
``sliding_window`` / ``softcap`` / ``s_aux`` from the layer's attention, everything a
caller passed to ``model(...)`` that the model forwards down).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ctxpar.attention import attention
from ctxpar.layout import Layout
from ctxpar.topology import hybrid_rank

NAME = "ctxpar"

# Arguments that cannot change the attention result, whatever their value: bookkeeping
# for outputs, caches and losses that transformers threads through every layer.
HARMLESS_KWARGS = frozenset({
    "use_cache", "cache_position", "output_hidden_states", "output_router_logits", "return_dict",
    "num_items_in_batch", "labels", "shift_labels", "ignore_index", "logits_to_keep", "token_type_ids",
    "deterministic",  # flash-attention's backward determinism switch; ctxpar's kernels are deterministic
})

# Arguments that change attention when set; None / False / 0 means "not used" and is accepted.
FEATURE_KWARGS = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "sliding_window": "sliding-window attention",
    "position_bias": "an additive position bias (relative positions or ALiBi)",
    "indices": "sparse attention over selected keys (an indexer's top-k)",
    "block_indices": "block-sparse attention over selected key blocks",
    "cu_seq_lens_q": "packed sequences (cumulative sequence lengths)",
    "cu_seq_lens_k": "packed sequences (cumulative sequence lengths)",
    "max_length_q": "packed sequences (cumulative sequence lengths)",
    "max_length_k": "packed sequences (cumulative sequence lengths)",
    "seq_idx": "packed sequences (sequence indices)",
    "encoder_hidden_states": "cross-attention to encoder states",
    "head_mask": "a head mask",
    "layer_head_mask": "a head mask",
    "output_attentions": "output_attentions=True (ctxpar never forms the attention matrix)",
    "past_key_values": "a KV cache (inference)",
    "past_key_value": "a KV cache (inference)",
    "cache": "a KV cache (inference)",
}


@dataclass(frozen=True)
class Settings:
    """What ``enable_context_parallel`` attached to a model: how its attention is split."""

    layout: Layout
    group: dist.ProcessGroup | None
    strategy: str
    mesh: object

    def positions(self, local_len: int) -> torch.Tensor:
        """(S,) the global positions this rank's ``local_len`` tokens sit at."""
        if self.mesh is not None:
            rank = hybrid_rank(self.mesh)
        else:
            rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        return self.layout.positions(local_len * self.layout.world_size, rank)


class RefusedMask:
    """What ``mask_forward`` returns for a mask ctxpar cannot honour. Models build masks for
    every layer kind they know, used or not (Qwen2-MoE builds a sliding-window mask with no
    sliding layer), so the refusal waits until a layer actually attends with it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _is_unset(value) -> bool:
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return False


def _check_kwargs(owner: str, kwargs: dict) -> None:
    for key, value in kwargs.items():
        if key in HARMLESS_KWARGS or key == "position_ids":  # checked once per forward by enable_context_parallel
            continue
        if key in FEATURE_KWARGS:
            if not _is_unset(value):
                shown = value if isinstance(value, (int, float, str)) else type(value).__name__
                raise ValueError(f"{owner} asks for {FEATURE_KWARGS[key]} ({key}={shown}), which ctxpar cannot "
                                 f"compute under context parallelism; it refuses rather than ignore it")
            continue
        raise ValueError(f"{owner} passed the keyword argument {key!r} to its attention function; ctxpar does not "
                         f"know what it changes, so it refuses it rather than drop it (run this model without "
                         f"context parallelism, or stop passing {key!r})")


def _scale(owner: str, scaling, head_dim: int) -> float:
    if scaling is None:
        return head_dim**-0.5
    if isinstance(scaling, torch.Tensor):
        if scaling.numel() != 1 or scaling.requires_grad:
            raise ValueError(f"{owner} passes a {'learned' if scaling.requires_grad else 'per-element'} attention "
                             f"scale tensor of shape {tuple(scaling.shape)}; ctxpar takes one constant scale")
        scaling = scaling.item()
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise ValueError(f"{owner} passes scaling={scaling!r}; ctxpar needs a finite number")
    return float(scaling)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """AttentionInterface function: q (B, H, S, Dqk), k (B, H_kv, S, Dqk), v (B, H_kv, S, Dv)
    -> ((B, S, H, Dv), None). ``scaling`` is honoured exactly (default Dqk ** -0.5); K and V
    with different head dims (DeepSeek's MLA) are zero-padded to one width, which leaves
    q.k and the output unchanged. Everything else that would change the result is refused
    here, on every rank alike, before ctxpar communicates."""
    settings: Settings | None = getattr(module, "ctxpar_settings", None)
    owner = type(module).__name__
    if settings is None:
        raise ValueError(f"{owner} uses attn_implementation='ctxpar' but was not prepared; call "
                         f"enable_context_parallel(model, layout=..., group=...) first")
    if isinstance(attention_mask, RefusedMask):
        raise ValueError(f"{owner}: {attention_mask.reason}")
    if dropout:
        raise ValueError(f"{owner} applies attention dropout p={dropout}, which ctxpar does not support; set the "
                         f"model's attention dropout to 0")
    if attention_mask is not None:
        raise ValueError(f"{owner} got an explicit attention mask {tuple(attention_mask.shape)}; under context "
                         f"parallelism the causal mask follows the layout, and custom or padding masks are refused")
    _check_kwargs(owner, kwargs)
    if getattr(module, "is_cross_attention", False) or "CrossAttention" in owner:
        raise ValueError(f"{owner} is a cross-attention layer (keys from another sequence), which ctxpar does not "
                         f"support under context parallelism")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{owner} attends from {query.shape[2]} queries to {key.shape[2]} keys (cross-attention or "
                         f"a KV cache), which ctxpar does not support")
    scale = _scale(owner, scaling, query.shape[-1])
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    d_qk, d_v = query.shape[-1], value.shape[-1]
    width = max(d_qk, d_v)
    if d_qk < width:  # zero columns add nothing to q.k
        query, key = F.pad(query, (0, width - d_qk)), F.pad(key, (0, width - d_qk))
    if d_v < width:  # zero columns of v give zero output columns, sliced off below
        value = F.pad(value, (0, width - d_v))
    out = attention(query, key, value, layout=settings.layout, group=settings.group, strategy=settings.strategy,
                    mesh=settings.mesh, causal=bool(causal), scale=scale)  # (B, H, S, width)
    return out[..., :d_v].transpose(1, 2).contiguous(), None


_MASK_KINDS = {
    "sliding_window_overlay": "sliding-window",
    "sliding_window_bidirectional_overlay": "sliding-window",
    "chunked_overlay": "chunked-attention",
    "blockwise_overlay": "block-wise (bidirectional blocks)",
    "padding_mask_function": "padding",
}


# transformers reads a layout's global position_ids (0 1 6 7 on rank 0 of zigzag P=2) as
# packed sequences and adds their boundaries; ctxpar's mask follows the same positions
# (enable_context_parallel checks they are the layout's), so those parts are honoured.
_LAYOUT_MASKS = {"causal_mask_function", "bidirectional_mask_function", "packed_sequence_mask_function",
                 "remap_positions_for_packed_sequence", "and_masks", "or_masks"}


def _mask_parts(mask_function) -> list[str]:
    """Names of the functions transformers composed a mask function from: and_masks,
    or_masks and the position remapping keep theirs in their closures."""
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__).split(".<locals>")[0]
    parts = [name]
    for cell in getattr(mask_function, "__closure__", None) or ():
        content = cell.cell_contents
        for fn in content if isinstance(content, tuple) else (content,):
            if inspect.isfunction(fn):
                parts += _mask_parts(fn)
    return parts


def mask_forward(*args, attention_mask: torch.Tensor | None = None, mask_function=None,
                 **kwargs) -> RefusedMask | None:
    """AttentionMaskInterface function: ctxpar builds the causal (or bidirectional) mask
    itself from the layout, so return None, after refusing what that would silently lose:
    a padding mask that pads (raised here), or a mask other than plain causal /
    bidirectional (sliding windows, chunks, overlays: a ``RefusedMask``, raised by the
    first layer that uses it). 4-D masks never get here (transformers passes them
    straight to attention, which refuses them)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("padding masks are not supported under context parallelism: pack or crop the batch so "
                         "every token is real (attention_mask all ones), or leave attention_mask out")
    if mask_function is not None:
        extra = [p for p in _mask_parts(mask_function) if p not in _LAYOUT_MASKS]
        if extra:
            kinds = ", ".join(_MASK_KINDS.get(p, p) for p in extra)
            return RefusedMask(f"its attention mask is {kinds} on top of causal, which ctxpar does not support "
                               f"under context parallelism")
    return None
