"""Inference under CP: prefill into a KV cache sharded over the ranks, exact decoding over it.

    cache = KVCache.for_model(model.cfg, batch=B, capacity=T + n, group=cp_group)
    logits = prefill(model, cache, prompt, layout="zigzag", strategy="ring")   # (B, vocab), every rank
    logits = decode_step(model, cache, logits.argmax(-1))                       # one token per step
    result = generate(model, prompt, layout="zigzag", group=cp_group, new_tokens=n)  # both, timed

Modules: ``cache.py`` (the shard and where decoded positions go), ``prefill.py``,
``decode.py`` (partial attention per rank, merged from one all-gather per layer),
``generate.py`` (sampling, timings, the single-process reference), ``hooks.py`` (running
the model with its attention replaced).
"""

from ctxpar.inference.cache import KVCache
from ctxpar.inference.decode import decode_step, sharded_attention
from ctxpar.inference.generate import GenerationResult, Sampler, generate, reference_generate
from ctxpar.inference.prefill import INFERENCE_STRATEGIES, prefill

__all__ = ["INFERENCE_STRATEGIES", "GenerationResult", "KVCache", "Sampler", "decode_step", "generate", "prefill",
           "reference_generate", "sharded_attention"]
