"""The functions transformers calls under ``attn_implementation="ctxpar"``: attention and mask.

Every keyword argument a model passes to its attention function is either honoured
exactly, accepted because it cannot change attention, or refused with an error naming it;
nothing is dropped. The argument names below are the ones transformers 5's attention
modules and ``TransformersKwargs`` pass (``position_ids`` from the decoder layer,
``sliding_window`` / ``softcap`` / ``s_aux`` from the layer's attention, everything a
caller passed to ``model(...)`` that the model forwards down).

What a layer's mask is (causal or bidirectional, a sliding window, chunks) is read from the
mask function transformers composed for that layer (``mask_forward`` returns it as a
``LayerMask``, which the model hands to every layer of that kind), and the packed row's
documents from the forward call (``enable_context_parallel``'s wrapper declares them for
the duration of ``model(..., documents=...)``; ``mask_forward`` bakes them into the
``LayerMask``, so a layer recomputed under gradient checkpointing sees the same ones).

Under ``model.generate()`` (``generation.py``) the forward in progress runs over a
``ShardedCache`` (``CACHED``): in its prefill the attention is the training one over the
prompt's shards; in a decode step the one new query attends to the keys this rank holds
and the partials of all ranks are merged (``ctxpar.inference.sharded_attention``).
"""

from __future__ import annotations

import contextvars
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ctxpar import topology
from ctxpar.attention import attention, refuse_with_peers
from ctxpar.inference.decode import sharded_attention_over
from ctxpar.layout import Layout
from ctxpar.masks import chunked, positions_in_documents
from ctxpar.topology import Topology

NAME = "ctxpar"

# Arguments that cannot change the attention result, whatever their value: bookkeeping
# for outputs, caches and losses that transformers threads through every layer.
HARMLESS_KWARGS = frozenset({
    "use_cache", "cache_position", "output_hidden_states", "output_router_logits", "return_dict",
    "num_items_in_batch", "labels", "shift_labels", "ignore_index", "logits_to_keep", "token_type_ids",
    "deterministic",  # flash-attention's backward determinism switch; ctxpar's kernels are deterministic
})

# Arguments that change attention and are honoured: sliding_window must agree with the
# layer's mask (eager attention follows the mask, flash attention the argument: the same
# window, q - k < w, when they agree); s_aux / sinks are the per-head sink logits.
HONOURED_KWARGS = frozenset({"sliding_window", "s_aux", "sinks"})

# Arguments that change attention when set; None / False / 0 means "not used" and is accepted.
FEATURE_KWARGS = {
    "softcap": "attention logit soft-capping",
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
# Packing given per shard (flash-attention's varlen arguments) cannot describe documents that
# cross shards; the whole row's documents, declared once, can.
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
KWARG_FIXES = dict.fromkeys(_PACKED, "declare the packed row's documents instead: pass the whole row's document "
                                     "lengths as shard_inputs(..., documents=...) (or model(..., documents=...))")


# the settings of the models given to enable_context_parallel, by id of each of their configs, held as long
# as the model holds them: a module not prepared whose config is there was added after enable_context_parallel
ENABLED_CONFIGS: weakref.WeakValueDictionary[int, Settings] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class Settings:
    """What ``enable_context_parallel`` attached to a model: how its attention is split.
    ``longrope``: the original_max_position_embeddings of the model's LongRoPE set-ups
    (``fidelity.longrope_limits``); ``dynamic``: the max_position_embeddings of its dynamic
    RoPE scaling (``fidelity.dynamic_rope_limits``); both checked per forward by
    ``check_rope_lengths``."""

    layout: Layout
    group: dist.ProcessGroup | None
    strategy: str
    mesh: object
    longrope: tuple[int, ...] = ()
    dynamic: tuple[int, ...] = ()

    @property
    def split(self) -> dict:
        """How attention is split, as ``ctxpar.attention`` (and ``enable_context_parallel``) take it."""
        return dict(layout=self.layout, group=self.group, strategy=self.strategy, mesh=self.mesh)

    def peers(self) -> Topology:
        """The CP group: ``group``'s ranks, or the hybrid ``mesh``'s (never the rest of WORLD,
        which may hold other data-parallel replicas, forwarding other batches or none)."""
        return topology.of(self.group, self.mesh, "enable_context_parallel")

    def positions(self, local_len: int) -> torch.Tensor:
        """(S,) the global positions this rank's ``local_len`` tokens sit at."""
        return self.layout.positions(local_len * self.layout.world_size, self.peers().rank)


def installed(fn):
    """Mark ``fn`` as one of the attributes ``enable_context_parallel`` sets on a model, which a
    deep copy leaves out (and makes anew for the copy) while keeping everyone else's."""
    fn.ctxpar_installed = True
    return fn


# The document lengths of the packed row during one forward (None: one document), set by
# enable_context_parallel's wrapper around model.forward and read by mask_forward.
DOCUMENTS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("ctxpar_documents",
                                                                                  default=None)

# The ShardedCache of the generate forward in progress (None outside generate), set by
# generation.cached_forward: the cache this forward's layers store into and attend from.
CACHED: contextvars.ContextVar[object | None] = contextvars.ContextVar("ctxpar_cached", default=None)

# True while a forward that enable_context_parallel's wrapper checked is running: the wrapped
# sub-models it calls (the decoder under the LM head) run unchecked, as part of it.
CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("ctxpar_checked", default=False)

PADDING_REFUSED = ("padding masks are not supported under context parallelism: pack or crop the batch so every token "
                   "is real (attention_mask all ones, or documents= for a packed row), or leave attention_mask out")


def check_implementation(owner: str, models) -> None:
    """Refuse a forward of ``owner`` when any of ``models`` (its transformers PreTrainedModels)
    no longer attends with ctxpar (``set_attn_implementation`` or a config changed after
    ``enable_context_parallel``): transformers would call that implementation on each rank's
    shard alone."""
    for model in models:
        implementation = model.config._attn_implementation
        if implementation != NAME:
            raise ValueError(f"{owner}'s attention implementation is now {implementation!r} "
                             f"({type(model.config).__name__}._attn_implementation), not ctxpar's, so each rank "
                             f"would attend within its own shard only; call model.set_attn_implementation(\"ctxpar\") "
                             f"to run under context parallelism again, or run a model enable_context_parallel was "
                             f"not applied to")


def check_rope_lengths(owner: str, settings: Settings, seq_len: int, documents: tuple[int, ...] | None) -> None:
    """LongRoPE takes its long frequency factors when the largest position a forward sees is
    at least original_max_position_embeddings (transformers' ``longrope_frequency_update``,
    Phi-MoE's rotary embedding), and a rank sees only its own positions. Exact when every
    rank's choice is the whole sequence's; refused otherwise. Dynamic RoPE scaling recomputes
    its frequencies once a forward's largest position + 1 passes max_position_embeddings (and
    resets them below it): exact while the sequence stays below, where no rank can differ
    from the unsplit model; refused from max_position_embeddings tokens on (at exactly that
    many, the unsplit model keeps frequencies a longer call left, which ranks holding only
    smaller positions reset). The verdict depends on the layout, ``seq_len`` and the declared
    documents only, so every rank reaches the same one."""
    if not (settings.longrope or settings.dynamic):
        return
    layout = settings.layout
    largest = int(positions_in_documents(torch.arange(seq_len), documents).max())  # what RoPE reads, unsplit
    check_dynamic_rope(owner, settings, largest)
    for limit in settings.longrope:
        if largest < limit:
            continue  # short factors everywhere
        for rank in range(layout.world_size):
            mine = int(positions_in_documents(layout.positions(seq_len, rank), documents).max())
            if mine < limit:
                raise ValueError(f"{owner} uses LongRoPE, which switches to its long frequency factors when a "
                                 f"forward's largest position is at least original_max_position_embeddings={limit}: "
                                 f"the sequence's is {largest}, but rank {rank} holds positions up to {mine} only, "
                                 f"so the ranks would rotate with different frequencies. Use a layout or length "
                                 f"that gives every rank a position of at least {limit} (striped gives rank r "
                                 f"position T-P+r), or run without context parallelism")


def check_dynamic_rope(owner: str, settings: Settings, largest: int) -> None:
    """``check_rope_lengths``' verdict on dynamic RoPE scaling for a sequence whose largest
    position (what RoPE reads) is ``largest``."""
    for limit in settings.dynamic:
        if largest + 1 >= limit:
            raise ValueError(f"{owner} uses dynamic RoPE scaling, which recomputes its frequencies from a forward's "
                             f"largest position once it passes max_position_embeddings={limit}: the sequence reaches "
                             f"position {largest}, and each rank would recompute them from its own positions. It "
                             f"runs exactly below {limit} tokens (or documents); beyond, run without context "
                             f"parallelism")


@dataclass(frozen=True)
class LayerMask:
    """What ``mask_forward`` returns for a mask ctxpar honours beyond plain causal: the mask
    of the layers transformers hands it to, over the whole (unsplit) row.

    causal: keys after the query are hidden. window: a query at p sees keys p-window+1..p
    (transformers' sliding_window: q - k < window). chunk: attention within chunks of this
    many tokens, counted from the start of each document (Llama 4). documents: the packed
    row's document lengths (None: one document), declared for the forward that built it.
    """

    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    documents: tuple[int, ...] | None = None

    def documents_for(self, seq_len: int) -> tuple[int, ...] | None:
        """The documents ``ctxpar.attention`` takes: chunks split every document."""
        if self.chunk is None:
            return self.documents
        return chunked(seq_len, self.chunk, self.documents)


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
    cached = CACHED.get()
    for key, value in kwargs.items():
        if key in HARMLESS_KWARGS or key in HONOURED_KWARGS or key == "position_ids":  # positions: checked per forward
            continue
        if cached is not None and value is cached:  # the sharded cache generate runs over
            continue
        if key in FEATURE_KWARGS:
            if not _is_unset(value):
                shown = value if isinstance(value, (int, float, str)) else type(value).__name__
                fix = f"; {KWARG_FIXES[key]}" if key in KWARG_FIXES else ""
                raise ValueError(f"{owner} asks for {FEATURE_KWARGS[key]} ({key}={shown}), which ctxpar cannot "
                                 f"compute under context parallelism; it refuses rather than ignore it{fix}")
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
        scaling = scaling.item()  # on a GPU a host synchronisation per layer: the kernels take a float
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise ValueError(f"{owner} passes scaling={scaling!r}; ctxpar needs a finite number")
    return float(scaling)


def _layer_mask(owner: str, attention_mask, causal: bool, kwargs: dict) -> LayerMask:
    """The layer's mask, after refusing one that contradicts the layer's arguments."""
    if isinstance(attention_mask, RefusedMask):
        raise ValueError(f"{owner}: {attention_mask.reason}")
    if attention_mask is not None and not isinstance(attention_mask, LayerMask):
        raise ValueError(f"{owner} got an explicit attention mask {tuple(attention_mask.shape)}; under context "
                         f"parallelism the mask follows the layout (and the declared documents), and custom or "
                         f"padding masks are refused")
    if attention_mask is None:
        if DOCUMENTS.get() is not None:
            raise ValueError(f"{owner} got no attention mask although documents were declared: the model did not "
                             f"build its mask through transformers' mask functions, so ctxpar cannot tell which "
                             f"layers see which documents; run it without documents=")
        attention_mask = LayerMask(causal=causal)
    if attention_mask.causal != causal:
        raise ValueError(f"{owner} attends {'causally' if causal else 'bidirectionally'} over a "
                         f"{'causal' if attention_mask.causal else 'bidirectional'} mask; ctxpar refuses the "
                         f"contradiction")
    if attention_mask.window is not None and attention_mask.window < 1:  # masks.py's refusal named no config
        raise ValueError(f"{owner}'s attention mask has a sliding window of {attention_mask.window} keys (the "
                         f"config's sliding_window), which hides every key from every query; set it to 1 or more, "
                         f"or turn the window off (Qwen2: use_sliding_window=False)")
    window = kwargs.get("sliding_window")
    if not _is_unset(window) and window != attention_mask.window:
        raise ValueError(f"{owner} passes sliding_window={window} but its attention mask has "
                         f"{'no window' if attention_mask.window is None else f'window {attention_mask.window}'}: "
                         f"transformers' attention implementations would disagree, so ctxpar refuses it")
    return attention_mask


def _sinks(owner: str, module, kwargs: dict) -> torch.Tensor | None:
    given = [kwargs[key] for key in ("s_aux", "sinks") if kwargs.get(key) is not None]
    if len(given) == 2 and given[0] is not given[1]:
        raise ValueError(f"{owner} passes both s_aux= and sinks=; ctxpar takes one set of sink logits")
    if not given:
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise ValueError(f"{owner} has attention sinks (module.sinks) but did not pass them to its attention "
                             f"function (s_aux=), so ctxpar cannot tell whether they apply; it refuses")
        return None
    return given[0]


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """AttentionInterface function: q (B, H, S, Dqk), k (B, H_kv, S, Dqk), v (B, H_kv, S, Dv)
    -> ((B, S, H, Dv), None). ``scaling`` is honoured exactly (default Dqk ** -0.5); K and V
    with different head dims (DeepSeek's MLA) are zero-padded to one width, which leaves
    q.k and the output unchanged. The layer's mask (a ``LayerMask`` from ``mask_forward``:
    sliding window, chunks, documents) and sink logits (``s_aux``, (H,), differentiable: the
    ranks' gradients sum to the unsplit one) are honoured exactly. Everything else
    that would change the result is refused here, before ctxpar communicates; a rank
    refusing alone (its own keyword arguments, a module changed on it alone) joins the check
    its peers' attention makes first, so that they raise with it rather than wait, except in
    a generate decode step, whose peers' merge has no such check (there a module changed on
    one rank alone leaves them waiting; generate's keyword arguments are compared before)."""
    settings: Settings | None = getattr(module, "ctxpar_settings", None)
    owner = type(module).__name__
    if settings is None:
        shared = ("it shares its config with one given to enable_context_parallel (two models built from one config "
                  "object, or from_config(enabled_model.config)): give it a config of its own (copy.deepcopy(config)) "
                  "or set_attn_implementation('sdpa') on it")
        if id(getattr(module, "config", None)) in ENABLED_CONFIGS:  # said "call enable_context_parallel first"
            raise ValueError(f"{owner} uses attn_implementation='ctxpar' but was not prepared, though its config is a "
                             f"model's given to enable_context_parallel: a module added or replaced after it (call "
                             f"enable_context_parallel(model, ...) again once the model is changed), or {shared}")
        raise ValueError(f"{owner} uses attn_implementation='ctxpar' but was not prepared; call "
                         f"enable_context_parallel(model, layout=..., group=...) first. If this model is not meant "
                         f"to be split, {shared}")
    cached = CACHED.get()
    decoding = cached is not None and cached.decoding
    try:
        causal, mask, sinks = _what_to_honour(owner, module, attention_mask, dropout, is_causal, kwargs)
        scale = _scale(owner, scaling, query.shape[-1])  # a scale of one rank's own (inf) once left its peers waiting
        if not decoding and key.shape[2] != query.shape[2]:
            raise ValueError(f"{owner} attends from {query.shape[2]} queries to {key.shape[2]} keys (cross-attention "
                             f"or a KV cache), which ctxpar does not support")
    except ValueError as e:
        if decoding:  # a decode step's exchange is another
            raise
        refuse_with_peers(e, query, key, value, **settings.split)
    if cached is not None:
        cached.take(module, key, value, causal)
        if decoding:
            return _decode(cached, query, key, value, mask, sinks, scale)
    seq_len = query.shape[2] * settings.layout.world_size
    query, key, value, d_v = _one_width(query, key, value)
    out = attention(query, key, value, **settings.split, causal=causal, scale=scale,
                    documents=mask.documents_for(seq_len), window=mask.window, sinks=sinks)  # (B, H, S, width)
    return out[..., :d_v].transpose(1, 2).contiguous(), None


def _what_to_honour(owner: str, module, attention_mask, dropout: float, is_causal, kwargs: dict
                    ) -> tuple[bool, LayerMask, torch.Tensor | None]:
    """The layer's causal flag, mask and sinks; ValueError for anything else that would change
    its result."""
    if dropout:
        raise ValueError(f"{owner} applies attention dropout p={dropout}, which ctxpar does not support; set the "
                         f"model's attention dropout to 0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", None)
    if causal is None:  # a layer without the flag (Splinter's) attends as its mask says, causal by default
        causal = attention_mask.causal if isinstance(attention_mask, LayerMask) else True
    causal = bool(causal)
    mask = _layer_mask(owner, attention_mask, causal, kwargs)
    _check_kwargs(owner, kwargs)
    sinks = _sinks(owner, module, kwargs)
    if getattr(module, "is_cross_attention", False) or "CrossAttention" in owner:
        raise ValueError(f"{owner} is a cross-attention layer (keys from another sequence), which ctxpar does not "
                         f"support under context parallelism")
    return causal, mask, sinks


def _decode(cached, query, key, value, mask: LayerMask, sinks, scale: float) -> tuple[torch.Tensor, None]:
    """A generate decode step: the new query (B, H, 1, D) against the keys (B, H_kv, n, D)
    this rank holds, those inside the layer's window or chunk; partials merged over ranks.
    The cache holds only earlier positions and the new one, so a causal and a
    bidirectional layer attend alike here."""
    seen = cached.visible(mask.window, mask.chunk)
    key, value = key[:, :, seen], value[:, :, seen]  # (B, H_kv, m, D): views, no copy
    query, key, value, d_v = _one_width(query, key, value)
    out = sharded_attention_over(query, key, value, cached.peers, scale=scale, sinks=sinks)  # (B, H, 1, D)
    return out[..., :d_v].transpose(1, 2).contiguous(), None  # (B, 1, H, Dv)


def _one_width(query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k (..., Dqk) and v (..., Dv) zero-padded to one head dim, as the kernels take them,
    and Dv: zero columns add nothing to q.k, and give output columns to slice off."""
    d_qk, d_v = query.shape[-1], value.shape[-1]
    width = max(d_qk, d_v)
    if d_qk < width:
        query, key = F.pad(query, (0, width - d_qk)), F.pad(key, (0, width - d_qk))
    if d_v < width:
        value = F.pad(value, (0, width - d_v))
    return query, key, value, d_v


class _Refused(Exception):
    pass


_MASK_KINDS = {
    "sliding_window_bidirectional_overlay": "a bidirectional sliding window",
    "blockwise_overlay": "block-wise attention (bidirectional blocks)",
    "padding_mask_function": "padding",
}

# transformers reads a layout's global position_ids (0 1 6 7 on rank 0 of zigzag P=2), and
# per-document positions, as packed sequences: it remaps the mask to them and adds document
# boundaries. ctxpar's mask follows the layout's positions and the declared documents
# (enable_context_parallel checks position_ids agree with both), so these parts are honoured.
_PACKING = {"packed_sequence_mask_function"}


def _name(fn) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__).split(".<locals>")[0]


def _closure(fn) -> dict:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}


def _parse(fn) -> dict:
    """{causal, window, chunk} described by a mask function composed by transformers' masking
    utilities; raises _Refused naming the parts that are something else."""
    name, cells = _name(fn), _closure(fn)
    if name == "causal_mask_function":
        return dict(causal=True)
    if name == "bidirectional_mask_function":
        return dict(causal=False)
    if name in _PACKING:
        return {}
    if name == "sliding_window_overlay":
        return dict(window=int(cells["sliding_window"]))
    if name == "chunked_overlay":
        padding = cells["left_padding"]
        if bool((torch.as_tensor(padding) != 0).any()):
            raise _Refused("chunked attention counted after left padding")
        return dict(chunk=int(cells["chunk_size"]))
    if name == "remap_positions_for_packed_sequence":
        return _parse(cells["mask_function"])
    if name in ("and_masks", "or_masks"):
        parts = [_parse(f) for f in cells["mask_functions"]]
        if name == "or_masks":
            if any("window" in p or "chunk" in p for p in parts):
                raise _Refused("a union of masks with a sliding window or chunks")
            # causal OR bidirectional sees everything: bidirectional
            return dict(causal=all(p.get("causal", True) for p in parts)) if any("causal" in p for p in parts) else {}
        out: dict = {}
        for part in parts:
            if "causal" in part:
                out["causal"] = out.get("causal", False) or part["causal"]
            if "window" in part:
                out["window"] = min(out.get("window", part["window"]), part["window"])
            if "chunk" in part:
                if out.get("chunk", part["chunk"]) != part["chunk"]:
                    raise _Refused("chunks of two sizes")
                out["chunk"] = part["chunk"]
        return out
    raise _Refused(_MASK_KINDS.get(name, f"a part ctxpar does not know ({name})"))


def describe_mask(mask_function) -> LayerMask | RefusedMask:
    """The ``LayerMask`` a transformers mask function stands for, or a ``RefusedMask`` naming
    what it has beyond causal / bidirectional, sliding windows, chunks and packing."""
    try:
        found = _parse(mask_function)
        if "causal" not in found:
            raise _Refused("an overlay with no causal or bidirectional base")
        if not found["causal"] and ("window" in found or "chunk" in found):
            raise _Refused("a sliding window or chunks over bidirectional attention")
    except _Refused as e:
        return RefusedMask(f"its attention mask has {e}, which ctxpar does not support under "
                           f"context parallelism")
    except (KeyError, TypeError, ValueError):  # a function of the same name built differently
        return RefusedMask(f"its attention mask ({_name(mask_function)}) is not built the way ctxpar can read, "
                           f"which ctxpar does not support under context parallelism")
    return LayerMask(causal=found["causal"], window=found.get("window"), chunk=found.get("chunk"),
                     documents=DOCUMENTS.get())


def mask_forward(*args, attention_mask: torch.Tensor | None = None, mask_function=None,
                 **kwargs) -> LayerMask | RefusedMask | None:
    """AttentionMaskInterface function: ctxpar builds the mask itself from the layout, so
    it returns no tensor but a description: a ``LayerMask`` (causal or bidirectional, sliding
    window, chunks, the declared documents) that the attention function honours, and holds
    the layer's own causal flag to, or a ``RefusedMask`` (raised by the first layer that
    attends with it) for anything else. A padding mask is refused here too, although
    ``enable_context_parallel``'s forward wrapper refuses it first, on every rank together.
    4-D masks never get here (transformers passes them straight to attention, which refuses
    them)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(PADDING_REFUSED)
    if mask_function is None:
        return None if DOCUMENTS.get() is None else LayerMask(documents=DOCUMENTS.get())
    return describe_mask(mask_function)
