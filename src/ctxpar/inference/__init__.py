"""Inference under CP: prefill into a KV cache sharded over the ranks, exact decoding over it.

    cache = KVCache.for_model(model.cfg, batch=B, capacity=T + n, group=cp_group)
    logits = prefill(model, cache, prompt, layout="zigzag", strategy="ring")   # (B, vocab), every rank
    logits = decode_step(model, cache, logits.argmax(-1))                       # one token per step
    logits = partial_prefill(model, cache, next_turn, method="auto")              # a chunk on top: pass-KV or pass-Q
    result = generate(model, prompt, layout="zigzag", group=cp_group, new_tokens=n)  # both, timed

Modules: ``cache.py`` (the shard and where decoded positions go), ``prefill.py``,
``decode.py`` (partial attention per rank, merged from one all-gather per layer),
``partial.py`` (a chunk on top of the cache: pass-KV or pass-Q),
``generate.py`` (sampling, timings, the single-process reference), ``hooks.py`` (running
the model with its attention replaced).
"""

from ctxpar.inference.cache import KVCache
from ctxpar.inference.decode import decode_step, sharded_attention
from ctxpar.inference.generate import GenerationResult, Sampler, generate, reference_generate
from ctxpar.inference.partial import partial_prefill
from ctxpar.inference.prefill import INFERENCE_STRATEGIES, prefill

__all__ = ["INFERENCE_STRATEGIES", "GenerationResult", "KVCache", "Sampler", "decode_step", "generate",
           "partial_prefill", "prefill", "reference_generate", "sharded_attention"]
