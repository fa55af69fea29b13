"""``generate``: prefill a prompt over the CP group, then decode token by token.

    result = generate(model, prompt, layout="zigzag", group=cp_group, new_tokens=64)
    result.tokens      # (B, 64), the same on every rank
    result.ttft_s      # time to first token: prefill, the logits' broadcast, sampling
    result.tpot_s      # mean time per further token: one decode step and sampling each

``reference_generate`` is the same generation on one process the plain way (the whole
sequence through the model at every step, no cache, no CP): what the tests and
``ctxpar generate --compare`` check against.
"""

from __future__ import annotations

import math
import reprlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ctxpar import agreement, limits, topology
from ctxpar.inference.cache import KVCache
from ctxpar.inference.decode import decode_step
from ctxpar.inference.partial import auto_method, partial_prefill
from ctxpar.inference.prefill import check_dense_tokens, check_inference_strategy, prefill, prompt_signature
from ctxpar.layout import Layout, OneLengthLayout, fingerprint, get_layout
from ctxpar.parallelize import SAME_MODEL, SAME_WEIGHTS, model_code, weights_code


class Sampler:
    """Next tokens from logits: greedy (temperature 0) or drawn from softmax(logits / temperature).

    The draws come from a CPU ``torch.Generator`` seeded with ``seed``; built alike on every
    rank and fed the identical logits that prefill and decode give every rank, it draws
    the same tokens everywhere, with no communication. On the host whatever the logits'
    device (one (B, vocab) copy per token): a CUDA generator draws other tokens from one
    seed, and a GPU run then differed from its CPU reference (``--compare``).
    """

    def __init__(self, temperature: float = 0.0, seed: int = 0) -> None:
        check_sampling(temperature, seed)
        self.temperature = float(temperature)
        self.generator = torch.Generator().manual_seed(int(seed)) if temperature > 0 else None  # a numpy int too

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, vocab) -> (B,) int64."""
        if self.generator is None:
            return logits.argmax(-1)
        logits = logits.double()  # a temperature below float32's range (1e-46) would round to 0
        # shifted so the largest is 0 first: a tiny temperature then sends the others to -inf, not the
        # largest to +inf (whose softmax is NaN)
        probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / self.temperature, dim=-1)
        return torch.multinomial(probs.cpu(), 1, generator=self.generator).squeeze(1).to(logits.device)


def check_sampling(temperature: float, seed: int) -> None:
    value = limits.as_real(temperature)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {reprlib.repr(temperature)}")
    if limits.whole(seed) is None:
        raise ValueError(f"seed must be an int, got {seed!r}")
    limits.check_seed(seed, "seed")


@dataclass(frozen=True)
class PromptTail:
    """The prompt's tokens after the head the layout splits, run by ``partial_prefill``."""

    tokens: int
    method: str  # "pass-kv" | "pass-q", as method="auto" chose
    why: str


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, new_tokens) int64, on the CPU, the same on every rank
    ttft_s: float  # seconds from the prompt to the first new token
    tpot_s: float | None  # mean seconds per new token after the first (None for a single token)
    kv_cache_bytes: int  # K/V this rank allocated: ceil((T + new_tokens - 1) / P) positions
    cache: KVCache  # this rank's shard, as decoding left it
    tail: PromptTail | None  # None where the layout split the whole prompt


def generate(model: nn.Module, prompt: torch.Tensor, *, layout: str | Layout, group: dist.ProcessGroup | None = None,
             strategy: str = "ring", mesh=None, new_tokens: int, temperature: float = 0.0, seed: int = 0,
             check_consistency: bool = True, on_token: Callable[[], None] | None = None) -> GenerationResult:
    """Generate ``new_tokens`` tokens after ``prompt`` with the KV cache sharded over ``group``.

    Args:
        model: the reference ``ctxpar.models.Transformer``, the same weights on every rank.
        prompt: (B, T) token ids, the same on every rank (B prompts of one length T >= 1): its
            longest head the layout splits goes through ``prefill``, the rest through
            ``partial_prefill`` (exact at any length).
        layout, strategy, mesh: how prefill splits the prompt and moves K/V (``prefill``;
            ``mesh`` for hybrid only).
        group: the CP group (None: WORLD, or one process without a process group).
        new_tokens: tokens to generate per sequence, >= 1; the cache is sized for
            T + new_tokens - 1 positions (the last token is returned, not fed back).
        temperature: 0 for greedy decoding, else sampling from softmax(logits / temperature).
        seed: seeds the sampling generator, alike on every rank.
        check_consistency: the ranks compare each call (``prefill``, ``decode_step``).
        on_token: called after each new token (a progress bar).

    Returns:
        ``GenerationResult``: tokens (B, new_tokens), ttft_s, tpot_s, kv_cache_bytes, cache,
        tail (the prompt's tokens past the layout's head: how many, and the pass
        ``partial_prefill`` chose for them, and why).
    """
    head = None
    ranks = topology.from_group(group, "generate")
    world = ranks.world_size
    with agreement.Refusal() as refusal:
        limits.check_flag("check_consistency", check_consistency)
        _check(model, prompt, new_tokens, temperature, seed)
        new_tokens, seed = int(new_tokens), int(seed)  # numpy integers too
        if not (on_token is None or callable(on_token)):
            raise ValueError(f"on_token must be None or a function of no arguments, called after each new token, "
                             f"got {type(on_token).__name__}")
        # prefill checks these too, but a prompt shorter than the layout's multiple has no head to prefill
        check_inference_strategy(model, ranks.rank, world, strategy, mesh, group, cache_from_group=True)
        layout = get_layout(layout, world)
        head = prefilled_length(layout, prompt.shape[1])
        weight = model.output.weight
        # allocated before the ranks compare calls: a rank without the memory for its shard raises with the others
        cache = KVCache.for_model(model.cfg, batch=prompt.shape[0], capacity=prompt.shape[1] + new_tokens - 1,
                                  group=group, dtype=weight.dtype, device=weight.device)
    refusal.join(lambda: _signature(model, prompt, layout, new_tokens, temperature, seed, strategy), group,
                 "generate call", world_size=world, check_consistency=check_consistency)

    sample = Sampler(temperature, seed)
    begin = _now(weight.device)
    if head:
        logits = prefill(model, cache, prompt[:, :head], layout=layout, strategy=strategy, mesh=mesh,
                         check_consistency=check_consistency)  # (B, vocab)
    tail = None
    if head < prompt.shape[1]:  # the tokens the layout does not split: one chunk after the head (or all)
        tail = PromptTail(prompt.shape[1] - head, *auto_method(model, cache, prompt.shape[1] - head))
        logits = partial_prefill(model, cache, prompt[:, head:], method=tail.method,
                                 check_consistency=check_consistency)
        cache.prompt_len = prompt.shape[1]  # the whole prompt, as after one prefill (its first commit: the head)
    token = sample(logits)  # (B,)
    out = [token]
    ttft = _now(weight.device) - begin
    on_token = on_token or (lambda: None)
    on_token()
    begin = _now(weight.device)
    for _ in range(new_tokens - 1):
        token = sample(decode_step(model, cache, token, check_consistency=check_consistency))
        out.append(token)
        on_token()
    decode_s = _now(weight.device) - begin
    return GenerationResult(tokens=torch.stack(out, dim=1).cpu(), ttft_s=ttft,
                            tpot_s=decode_s / (new_tokens - 1) if new_tokens > 1 else None,
                            kv_cache_bytes=cache.nbytes, cache=cache, tail=tail)


def reference_generate(model: nn.Module, prompt: torch.Tensor, *, new_tokens: int, temperature: float = 0.0,
                       seed: int = 0) -> torch.Tensor:
    """The same generation in this process, the plain way: at every step the whole
    sequence so far goes through the model with its own attention; no cache, no CP.
    Returns (B, new_tokens) int64 on the CPU."""
    _check(model, prompt, new_tokens, temperature, seed)
    sample = Sampler(temperature, seed)
    seq = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            seq = torch.cat([seq, sample(model(seq)[:, -1]).unsqueeze(1)], dim=1)
    return seq[:, prompt.shape[1]:].cpu()


def prefilled_length(layout: Layout, length: int) -> int:
    """How many of a prompt's ``length`` tokens ``prefill`` takes: the longest head ``layout``
    splits, a multiple of its ``multiple`` (a layout built for one length, balanced or a
    checked deal, takes the whole prompt: prefill refuses any other); the rest goes through
    ``partial_prefill``, exact at any length."""
    if isinstance(layout, OneLengthLayout):
        return length
    return length // layout.multiple * layout.multiple


def _check(model: nn.Module, prompt: torch.Tensor, new_tokens: int, temperature: float, seed: int) -> None:
    """generate's own arguments; prefill checks the prompt against the model and layout."""
    count = limits.whole(new_tokens)  # a Python int: a numpy int32's sums wrap
    if count is None or not 1 <= count <= limits.MAX_COUNT:
        raise ValueError(f"new_tokens must be an int between 1 and {limits.MAX_COUNT}, got {new_tokens!r}")
    check_sampling(temperature, seed)
    if getattr(model, "cfg", None) is None or not hasattr(model, "output"):
        raise ValueError(f"{type(model).__name__} is not a ctxpar.models.Transformer: generate needs its cfg and "
                         f"output head")
    check_dense_tokens(prompt, "the prompt", "(B, T)")
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices ({', '.join(sorted(map(str, devices)))}): "
                         f"generate runs it on one; move it with model.to(device)")
    device, = devices
    if device.type == "meta":
        raise ValueError("the model is on the meta device, its weights not loaded: materialise it "
                         "(model.to_empty(device=...), then load its weights)")
    if prompt.device != device:
        raise ValueError(f"the prompt is on {prompt.device} but the model is on {device}")
    if 0 in prompt.shape:
        raise ValueError(f"the prompt must hold token ids (B, T) with B, T >= 1, got {tuple(prompt.shape)}")
    if prompt.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"the prompt must hold integer token ids (int64), got {prompt.dtype}")
    limits.check_token_range(prompt, model.cfg.vocab, "the model", " in its prompt")
    if prompt.shape[1] + count - 1 > limits.MAX_COUNT:
        raise ValueError(f"a prompt of {prompt.shape[1]} tokens and new_tokens={count} need a KV cache of "
                         f"{prompt.shape[1] + count - 1} positions, more than {limits.MAX_COUNT}")


def _signature(model, prompt, layout, new_tokens, temperature, seed, strategy) -> dict[str, agreement.Value]:
    return {SAME_MODEL: model_code(model),
            SAME_WEIGHTS: agreement.readable(lambda: weights_code(model)),  # named by the call made, not its prefill
            **prompt_signature(prompt),
            "layout": agreement.Text(fingerprint(layout) if isinstance(layout, Layout) else layout),
            "new_tokens": -1 if limits.whole(new_tokens) is None else int(new_tokens),
            "temperature": agreement.Real(temperature),
            "seed": -1 if limits.whole(seed) is None else int(seed),
            "strategy": agreement.Text(strategy)}


def _now(device: torch.device) -> float:
    """perf_counter once the device has finished what was queued (timings on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
