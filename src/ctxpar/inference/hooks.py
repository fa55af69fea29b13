"""Running a model's forward with its attention replaced, one function per layer.

The reference model computes q, k, v and RoPE itself and hands them to each attention
module's ``attention_fn(q, k, v)``. Prefill and decode swap those functions for the
duration of one forward: the replacement sees this layer's K/V after RoPE (what the
cache keeps), attends the way CP inference needs, and the model stays single-device
code. The previous functions (plain SDPA, or ``apply_context_parallel``'s) come back
afterwards, so the same model still runs single-process.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from ctxpar.inference.cache import KVCache
from ctxpar.models.llama import AttentionFn
from ctxpar.parallelize import attention_modules, has_attention_fn, plain_causal_attention


# why an attention module may attend once per forward
ONE_SLOT_PER_MODULE = ("CP inference keeps one KV cache slot per attention module, and a second call's K/V would "
                       "take the first's place; give each layer a module of its own (copy.deepcopy) or generate "
                       "without CP (reference_generate)")


@contextlib.contextmanager
def attention_replaced(model: nn.Module, make: Callable[[int], AttentionFn],
                       modules: list[nn.Module] | None = None) -> Iterator[None]:
    """Within the block (one forward), layer i attends with ``make(i)``, once; restored
    afterwards, also on error. ``modules``: the model's attention modules where the caller
    has them (``check_model_fits``'), else found here."""
    modules = attention_modules(model) if modules is None else modules
    saved = [m.attention_fn for m in modules]
    try:
        for i, m in enumerate(modules):
            m.attention_fn = _once(make(i), i)
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.attention_fn = fn


def _once(attend: AttentionFn, layer: int) -> AttentionFn:
    """``attend``, refusing a second call: a module that layers share, or a forward looping
    over a layer, once decoded from K/V the second call had overwritten. Every rank runs the
    same layers, so every rank raises at the same call."""
    calls = 0

    def attend_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise ValueError(f"layer {layer}'s attention module ran twice in one forward: {ONE_SLOT_PER_MODULE}")
        return attend(q, k, v)

    return attend_once


def check_cache(cache) -> None:
    """Refuse a cache that is not a ``KVCache``. Raised before the ranks compare calls: the
    cache names the group they would compare on."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a ctxpar KVCache (KVCache.for_model(model.cfg, ...)), got "
                         f"{type(cache).__name__}")
    if cache.mesh is not None:
        raise ValueError("this KVCache is held over a hybrid mesh (KVCache(mesh=...)), as model.generate() makes "
                         "one; ctxpar's prefill, decode_step and partial_prefill take a cache on the CP group "
                         "(KVCache(group=...)), and hybrid prefill takes the mesh as its own mesh= argument")


def check_model_fits(model: nn.Module, cache: KVCache) -> list[nn.Module]:
    """Refuse a model whose shape is not the cache's, or that inference cannot drive
    (it needs the reference model's ``cfg``, ``hidden_states`` and ``output``, and plain
    causal attention in every layer: prefill and decode put exact causal attention over
    the sharded cache in its place, which would drop what a custom ``attention_fn`` does),
    or that is not the model whose K/V the cache holds; and a cache built under
    ``torch.inference_mode()`` outside it, where its tensors cannot be written. Records ``model`` as that model:
    every call that writes the cache checks first. Returns the model's attention modules
    (``attention_modules``)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "hidden_states") or not hasattr(model, "output"):
        raise ValueError(f"{type(model).__name__} is not a ctxpar.models.Transformer: CP inference needs its cfg, "
                         f"hidden_states() and output head")
    places = {}  # attention module -> its names in the model, more than one where layers share it
    for name, module in model.named_modules(remove_duplicate=False):
        if has_attention_fn(module):
            places.setdefault(module, []).append(name)
    modules = list(places)  # attention_modules(model), in its order, from the same walk
    shared = next((names for names in places.values() if len(names) > 1), None)
    for i, module in enumerate(modules):
        fn = module.attention_fn
        if not plain_causal_attention(fn):
            raise ValueError(f"layer {i}'s attention_fn is {getattr(fn, '__name__', fn)!r}, not the model's causal "
                             f"attention (or apply_context_parallel's): prefill and decode "
                             f"replace it with causal attention over the sharded cache and would drop what it does; "
                             f"restore the default (ctxpar.models.llama.causal_sdpa) or generate without CP "
                             f"(reference_generate)")
    have = (len(modules), cfg.kv_heads, cfg.head_dim, cfg.head_dim)  # the reference model's V is as wide as K
    want = (cache.layers, cache.kv_heads, cache.head_dim, cache.value_dim)
    if have != want:
        fix = (f"{' and '.join(shared)} are one attention module: {ONE_SLOT_PER_MODULE}" if shared and
               len(modules) < cfg.layers else "build the cache with KVCache.for_model(model.cfg, ...)")
        raise ValueError(f"the model has (layers, kv_heads, head_dim, value_dim) = {have} but the KV cache was "
                         f"built for {want}; {fix}")
    dtype, device = model.output.weight.dtype, model.output.weight.device
    if (dtype, device) != (cache.dtype, cache.device):
        raise ValueError(f"the model is {dtype} on {device} but the KV cache {cache.dtype} on {cache.device}; "
                         f"build the cache with the model's dtype and device")
    if cache.made_in_inference_mode and not torch.is_inference_mode_enabled():
        # torch refuses to write inference tensors outside inference mode: once on the owner rank
        # alone, in a decode step's write, its peers waiting in attention
        raise ValueError("the KV cache was built under torch.inference_mode(), whose tensors cannot be written "
                         "outside it; make every call on this cache inside torch.inference_mode() as well, or "
                         "build the cache outside it (ctxpar's calls disable autograd themselves)")
    filled_by = cache.filled_by() if cache.filled_by is not None else None
    if cache.seq_len and filled_by is not model:
        # another model's K/V under this one's queries: plausible logits, of neither model
        raise ValueError(f"the KV cache holds {cache.seq_len} positions of K/V another model computed; continue "
                         f"with the model that prefilled it, or reset() the cache and prefill again")
    cache.filled_by = weakref.ref(model)
    return modules
