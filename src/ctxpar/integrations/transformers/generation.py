"""``model.generate()`` under context parallelism: a transformers ``Cache`` that holds this
rank's share of the K/V, and every forward generate makes run exactly over it.

    model = enable_context_parallel(LlamaForCausalLM(config), layout=layout, group=cp_group)
    torch.manual_seed(seed)                                 # for sampling: alike on every rank
    out = model.generate(input_ids, max_new_tokens=64)      # the whole (B, T) prompt, on every rank
    # out: (B, T + 64) on every rank, the tokens generate gives without CP

``ShardedCache`` keeps positions the way ``ctxpar.inference.KVCache`` deals them (it holds
one): the prompt positions the layout gave this rank, then decoded position p on rank
p mod P. Its ``get_seq_length()`` is the global length, so transformers numbers positions
and sizes masks as without CP. generate's forwards reach ``cached_forward`` through
``enable_context_parallel``'s forward wrapper:

    prefill  the first forward gets the whole prompt (of a length the layout does not
             split, the longest head it does; the rest is fed as decode steps, all of a
             prompt shorter than the layout's multiple). It is sharded with the layout
             (tokens and their global positions); each attention layer stores this rank's
             K/V (after RoPE) and attends with ctxpar.attention as in training (ring,
             allgather, alltoall, hybrid on its mesh, or "auto": the planner picks per
             layer, ``ctxpar.auto``); the rank holding position T-1 computes its logits and
             broadcasts them.
    decode   each later forward gets one token per sequence at position p, the same on
             every rank, and the model runs replicated. At each layer rank p mod P stores
             the new K/V, every rank attends the query to the keys it holds (those inside
             the layer's sliding window or chunk), and the partials are merged from one
             all-gather (``ctxpar.inference.sharded_attention``; over a hybrid mesh, one
             along its ulysses groups, then one along its ring groups). p counts the
             rank's place in the layout, which under a mesh is ``ctxpar.hybrid_rank``.

So every rank gets bit-identical logits: greedy decoding, and sampling from torch's global
RNG seeded alike on every rank, pick the same tokens everywhere. One tiny all-gather per
generate call and one per forward compare the ranks' arguments, RNG state and tokens
(``agreement.check_values_agree``): a rank that refuses or differs makes every rank raise.
One tiny all-reduce per step after the stopping criteria (``AgreedStop``) stops a sequence
on every rank where any rank's criteria stop it, compares the token just appended and the
scores the logits processors gave (``HeldProcessors``), and raises on every rank where a
logits processor or a criterion raised on one.

What generate would do that this cannot honour is refused on every rank before any
collective, naming it (``check_generate``): every mode but greedy and sampling (beam
search, contrastive search, assisted decoding, ...), a cache passed in, other cache
implementations (static, offloaded, quantized), ``use_cache=False``, chunked prefill,
``inputs_embeds``, padding, ``output_attentions`` / ``output_hidden_states``, token ids
outside the vocabulary, a ``max_new_tokens`` whose cache would pass ``limits.MAX_COUNT``
positions, encoder-decoder models, an attention implementation
switched after ``enable_context_parallel``, a prompt on whose length LongRoPE would pick
different factors on different ranks. Every forward over the cache (generate's, or one's
own ``model(input_ids=..., cache=ShardedCache(...))``) is checked as any forward under CP
is (a mask but the all-ones 2-D one, token ids, ``logits_to_keep`` but 1), on every rank
together. Each layer's cache is allocated at its first store, where its shape is known: a
rank short of memory raises after that forward, with its peers. Refused during the call, on every rank alike: a
model that attends with K/V other than the ones it cached (but for those its ``expand_kv``
makes of them: multi-head latent attention caches latents and expands them position by
position), at its first layer of the prefill (``ShardedCache.take``); a layer that stored
K/V in the prefill and skips a decode step, at that step (``cached_forward``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ctxpar import agreement, limits, topology
from ctxpar.inference.cache import KVCache, decoded_owner
from ctxpar.inference.generate import prefilled_length
from ctxpar.inference.prefill import last_position_owner
from ctxpar.integrations.transformers.attention import (CACHED, Settings, check_dynamic_rope, check_implementation,
                                                        check_rope_lengths, installed)
from ctxpar.layout import written_positions
from ctxpar.parallelize import SAME_MODEL, SAME_WEIGHTS, model_code, weights_code

try:
    from transformers.cache_utils import Cache
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import StoppingCriteriaList
except ImportError:  # the integration imports transformers lazily; without it nothing here is reachable
    Cache, LogitsProcessorList, StoppingCriteriaList = object, list, list

CACHE_KEYS = ("cache", "past_key_values", "cache_params")  # transformers 5 renamed past_key_values to cache
GENERATE_PADDING_REFUSED = ("padding (an attention_mask with zeros, a left-padded batch, or one transformers infers "
                            "where the prompt holds pad_token_id) is not supported by generation under context "
                            "parallelism: generate each prompt length separately")
_MODES = ("greedy_search", "sample")


@dataclass
class _Step:
    """What one forward over the cache adds. ``position`` is the decoded position (None for
    the prefill); ``positions`` (n,) the positions this rank stores; ``keys`` (held,) the
    global positions of the keys a decode step attends over on this rank."""

    position: int | None
    positions: torch.Tensor
    held: int = 0
    keys: torch.Tensor | None = None
    stored: set = field(default_factory=set)
    pending: deque = field(default_factory=deque)  # (K, V) handed to layers, not yet attended with
    unallocated: Exception | None = None  # why this rank could not allocate its share (``ShardedCache.update``)
    split: str | None = None  # where it is a part of a prompt the layout does not split: how the prompt is fed


class ShardedCache(Cache):
    """This rank's share of the K/V of ``model.generate()`` under CP (module docstring).

    Args:
        layers: decoder layers of the model (layer indices 0..layers-1).
        batch: sequences generated together.
        capacity: the longest the sequence gets (prompt + new tokens - 1), over all ranks.
        group: the CP group (None: WORLD, or one process without one).
        mesh: instead of ``group``, the hybrid strategy's 2D DeviceMesh (its ranks: the CP
            group, each at its place in the layout).

    Each layer's K/V go to a ``KVCache`` of its own, made at the layer's first store in the
    prefill from its K (B, H_kv, n, D) and V (B, H_kv, n, Dv): layers may differ in H_kv
    and D (Gemma 4's global and sliding layers), K and V in their head dim (multi-head latent
    attention's). Every layer's holds the same positions; ``kv`` is the first one made
    (None before). A rank that cannot allocate its share stores nothing more in that
    forward, which runs on, and raises after it with its peers (``_cached_step``): inside
    the forward, its peers would wait in attention.
    """

    def __init__(self, *, layers: int, batch: int, capacity: int, group: dist.ProcessGroup | None = None,
                 mesh=None) -> None:
        for name, value in (("layers", layers), ("batch", batch), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limits.MAX_COUNT:
                raise ValueError(f"ShardedCache {name} must be an int between 1 and {limits.MAX_COUNT}, got "
                                 f"{value!r}")
        super().__init__(layers=[])
        self.peers = topology.of(group, mesh, "ShardedCache")
        self.group, self.mesh, self.rank, self.world_size = group, mesh, self.peers.rank, self.peers.world_size
        self.num_layers, self.batch, self.capacity = layers, batch, capacity
        self._per_layer: list[KVCache | None] = [None] * layers
        self._made: list[KVCache] = []  # in the order the layers first stored
        self._step: _Step | None = None
        self.made_by_generate = False  # generate's own: its forwards' router logits are never read

    @property
    def kv(self) -> KVCache | None:
        """The positions this rank holds (every layer's cache holds the same), and the K/V of
        the layer that stored first."""
        return self._made[0] if self._made else None

    # -- transformers' Cache interface -------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions in the sequence so far, over all ranks."""
        return self.kv.seq_len if self.kv is not None else 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def batch_size(self) -> int:
        return self.batch

    @property
    def is_croppable(self) -> bool:
        return False

    def reset(self) -> None:
        for kv in self._made:
            kv.reset()

    def _refuse(self, what: str) -> None:
        raise NotImplementedError(f"ctxpar's ShardedCache cannot {what}: generation under context parallelism "
                                  f"supports greedy decoding and sampling, one token per step")

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("be cropped (assisted decoding, rollback)")

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._refuse("reorder its sequences (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("repeat its sequences (contrastive search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("select sequences (contrastive search)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer_idx``'s new K/V (B, H_kv, n, D) where they belong; return the
        keys this rank attends with: in the prefill the new ones (its prompt shard), in a
        decode step all it holds of this layer, the new position's included if it is
        this rank's (B, H_kv, held, D)."""
        step = self._step
        if step is None:
            raise ValueError("ctxpar's ShardedCache stores K/V only during a forward of a model that "
                             "enable_context_parallel prepared (model.generate(), or model(..., cache=cache))")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise NotImplementedError(f"the model stores K/V for layer index {layer_idx!r} but its config counts "
                                      f"{self.num_layers} layers (looped or extra layers), which ctxpar's sharded "
                                      f"cache is not sized for")
        if layer_idx in step.stored:
            raise NotImplementedError(f"layer {layer_idx} stored K/V twice in one forward (a looped layer); "
                                      f"ctxpar's sharded cache takes one store per layer and forward")
        k_shape, v_shape = tuple(key_states.shape), tuple(value_states.shape)  # (B, H_kv, n, D)
        if k_shape[:3] != v_shape[:3]:
            raise NotImplementedError(f"layer {layer_idx} stores K {k_shape} and V {v_shape}, which differ in more "
                                      f"than their head dim; ctxpar's sharded cache holds K and V of one batch, "
                                      f"H_kv and length")
        kv = self._per_layer[layer_idx]
        if kv is None and step.unallocated is None:
            if self.get_seq_length():
                raise NotImplementedError(f"layer {layer_idx} stores K/V in a decode step but stored none before, "
                                          f"so ctxpar's sharded cache holds no earlier positions for it")
            kv = self._allocate(step, key_states, value_states)
            self._per_layer[layer_idx] = kv
        if kv is None:  # this rank's share could not be allocated: nothing is stored, the forward runs on
            keys, values = key_states, value_states  # what the first forward attends with: its own new K/V
        elif step.position is None:
            kv.write(0, 0, key_states, value_states)  # the prompt shard, T/P positions
            keys, values = key_states, value_states
        else:
            mine = step.held > kv.length  # this rank keeps the new position
            # the others write nothing but check the shapes alike: an error on the owner alone would hang them
            kv.write(0, kv.length, key_states if mine else key_states[:, :, :0],
                     value_states if mine else value_states[:, :, :0])
            keys, values = kv.keys(0, step.held), kv.values(0, step.held)  # (B, H_kv, held, D)
            if not step.held:  # none yet (a short prompt's first steps): the model runs on the new position's
                keys, values = key_states, value_states  # (some fail on none: MLA's expand_kv); never keys here
        step.stored.add(layer_idx)
        step.pending.append((keys, values))
        return keys, values

    def _allocate(self, step: _Step, key_states: torch.Tensor, value_states: torch.Tensor) -> KVCache | None:
        """A layer's ``KVCache`` for K (B, H_kv, n, D) and V (B, H_kv, n, Dv); None where this
        rank cannot allocate it, which drops the layers' caches it made (their memory freed
        for the rest of the forward) and keeps why in ``step``."""
        try:
            kv = KVCache(layers=1, batch=self.batch, kv_heads=key_states.shape[1], head_dim=key_states.shape[3],
                         value_dim=value_states.shape[3], capacity=self.capacity, group=self.group, mesh=self.mesh,
                         dtype=key_states.dtype, device=key_states.device)
        except Exception as e:  # noqa: BLE001  raised after the forward, on every rank together
            step.unallocated = e
            self._per_layer = [None] * self.num_layers
            self._made.clear()
            return None
        self._made.append(kv)
        return kv

    def stored_layers(self) -> list[int]:
        """The layers that stored K/V in the prefill."""
        return [layer for layer, kv in enumerate(self._per_layer) if kv is not None]

    def commit(self, positions: torch.Tensor, seq_len: int) -> None:
        """Count ``positions`` (n,) as held in every layer, and the sequence as ``seq_len`` long."""
        for kv in self._made:
            kv.commit(positions, seq_len=seq_len)

    # -- what the attention function asks (attention.py) -------------------------------
    @property
    def decoding(self) -> bool:
        return self._step is not None and self._step.position is not None

    def take(self, module, key: torch.Tensor, value: torch.Tensor, causal: bool) -> None:
        """Check that a layer attends with the K/V this cache just handed it, or, where the
        module has an ``expand_kv`` (transformers' name for multi-head latent attention's
        position-by-position expansion of its cached latents), with K/V of as many positions,
        taken to be what it made of them (not verified). A model that skips the cache, or
        changes K/V after it some other way, might attend over something else (keys
        re-rotated by their index in the cache, which is not their position here). A layer that
        attends bidirectionally is refused over a prompt fed in parts: its earlier tokens would
        not see the later ones, as they do in the whole prompt (every rank alike: the layers and
        the prompt are the same on each)."""
        owner = type(module).__name__
        if not causal and self._step.split:
            raise ValueError(f"{owner} attends bidirectionally, and {self._step.split}: its earlier tokens would "
                             f"not see the later ones, as they do when the whole prompt is prefilled; give a prompt "
                             f"length the layout splits")
        if not self._step.pending:
            raise NotImplementedError(f"{owner} attends without storing its K/V in the cache (K/V shared across "
                                      f"layers), which ctxpar's sharded cache cannot serve")
        keys, values = self._step.pending.popleft()
        if key is keys and value is values:
            return
        expanded = callable(getattr(module, "expand_kv", None)) and key.shape[2] == value.shape[2] == keys.shape[2]
        if not expanded:
            raise NotImplementedError(f"{owner} attends with K/V other than the ones its cache returned (K/V changed "
                                      f"after caching), which ctxpar's sharded cache cannot serve")

    def visible(self, window: int | None, chunk: int | None) -> slice:
        """The slots of the K/V handed to a layer that a decode step's query sees: those held
        (a rank holding none yet was handed the new position's K/V, not its to attend to), from
        the first inside a sliding window (q - k < window) or the query's chunk (counted from
        position 0): the slots hold ascending positions."""
        p, keys = self._step.position, self._step.keys
        first = max(p - window + 1 if window else 0, p - p % chunk if chunk else 0)
        return slice(int(torch.searchsorted(keys, first)) if first > 0 else 0, self._step.held)


_GENERATE_MODE_KEYS = ("tokenizer", "assistant_tokenizer")


def cached_forward(forward, kwargs: dict, *, name: str, settings: Settings, cache: ShardedCache, accepts,
                   model: int, refusal: Exception | None = None):
    """One forward of generate over ``cache`` (the prefill or a decode step), ``kwargs`` as
    the caller passed them; ``accepts``: the names the model's forward takes; ``model``: its
    ``model_code`` at the prefill (-2 after it), compared as the call's arguments are;
    ``refusal``: what the caller already refused (raised on every rank together, like this
    call's own).

    A prompt whose length the layout does not split is prefilled as its longest head that
    it does, then one token at a time as decode steps (exact: each attends to every earlier
    key), so that generate takes a prompt of any length; one shorter than the layout's
    multiple goes one token at a time from the start."""
    if cache.made_by_generate:  # transformers passes generate's tokenizers on to the forward (stop_strings needs
        kwargs = {k: v for k, v in kwargs.items() if k not in _GENERATE_MODE_KEYS}  # one); attention ignores them
    head = _splittable_head(settings, cache, kwargs) if refusal is None else None
    if head is None:
        return _cached_step(forward, kwargs, name=name, settings=settings, cache=cache, accepts=accepts,
                            model=model, refusal=refusal)
    whole = {f"call's {k}": v for k, v in _forward_signature(cache, kwargs).items()}  # compared at every part
    out, length = None, kwargs["input_ids"].shape[1]
    refusal = _head_rope_refusal(name, settings, head, length)
    split = None if length == 1 else (  # a prompt of one token, fed alone, is fed whole
        f"the prompt of {length} tokens, a length the {settings.layout.name} layout does not split (it splits "
        f"multiples of {settings.layout.multiple}), is fed "
        + (f"as its first {head} tokens, then one token at a time" if head else "one token at a time"))
    for start, end in ([(0, head)] if head else []) + [(p, p + 1) for p in range(head, length)]:
        out = _cached_step(forward, _sliced(kwargs, start, end), name=name, settings=settings, cache=cache,
                           accepts=accepts, model=model, refusal=refusal, whole=whole, split=split)
    return out


def _splittable_head(settings: Settings, cache: ShardedCache, kwargs: dict) -> int | None:
    """For a prefill whose length the layout does not split: the longest head it does (0 for a
    prompt shorter than one multiple); None otherwise, and where other tensors than the
    tokens, their positions and an attention mask come with the prompt (the layout's own
    refusal then speaks)."""
    tokens = kwargs.get("input_ids")
    if cache.get_seq_length() or not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or not tokens.shape[1]:
        return None
    if any(isinstance(v, torch.Tensor) and k not in ("input_ids", "position_ids", "attention_mask")
           for k, v in kwargs.items()):
        return None
    head = prefilled_length(settings.layout, tokens.shape[1])
    return None if head == tokens.shape[1] else head


def _head_rope_refusal(name: str, settings: Settings, head: int, length: int) -> Exception | None:
    """RoPE whose frequencies depend on a forward's largest position: dynamic scaling past its
    limit (the prompt's frequencies would not be the head's), and LongRoPE, whose head alone
    would take the short factors where the whole prompt takes the long ones."""
    try:
        check_dynamic_rope(name, settings, length - 1)
    except ValueError as e:
        return e
    limits = [limit for limit in settings.longrope if head - 1 < limit <= length - 1]
    if not limits:
        return None
    layout = settings.layout
    fed = (f"is prefilled as its first {head}, which the {layout.name} layout splits, then one token at a time, and "
           f"the first {head}" if head else f"is shorter than the {layout.name} layout's multiple, so fed one token "
                                           f"at a time, and its first positions")
    return ValueError(f"{name} uses LongRoPE (long factors from position {limits[0]}): a prompt of {length} tokens "
                      f"{fed} would rotate with the short factors where the whole prompt takes the long ones; give "
                      f"a prompt length that is a multiple of {layout.multiple}")


def _sliced(kwargs: dict, start: int, end: int) -> dict:
    """The forward's arguments for prompt tokens start..end-1 (its attention_mask, all ones,
    is dropped by ``_plan``)."""
    part = dict(kwargs, input_ids=kwargs["input_ids"][:, start:end])
    if isinstance(kwargs.get("position_ids"), torch.Tensor):
        part["position_ids"] = kwargs["position_ids"][..., start:end]
    return part


def _cached_step(forward, kwargs: dict, *, name: str, settings: Settings, cache: ShardedCache, accepts, model: int,
                 refusal: Exception | None, whole: dict[str, int] | None = None, split: str | None = None):
    """One forward over ``cache``: ``cached_forward``'s, or one part of a prompt it splits
    (``whole``: the signature of the whole call, compared at every part; ``split``: how the
    prompt is fed)."""
    call, step = None, None
    streamer = STREAMING.get()
    if refusal is None and streamer is not None:
        refusal = streamer.error  # what the last token (or the prompt) made it raise, raised now on every rank
    with agreement.Refusal(refusal) as held:
        if held.error is None:
            call, step = _plan(name, settings, cache, dict(kwargs), accepts)
    held.join(lambda: {**_forward_signature(cache, kwargs), SAME_MODEL: model, **(whole or {})},
              cache.peers.process_groups, "generate forward", world_size=cache.world_size)
    cache._step = step
    if step is not None:
        step.split = split
    active = CACHED.set(cache)
    first = not cache.get_seq_length()  # the forward that allocates the cache's shards
    try:
        out = forward(**call)
        if first:
            _agree_allocated(cache, step.unallocated, call["input_ids"].device)
        if step.pending or not step.stored:
            raise NotImplementedError(f"{name} stored K/V in the cache for layers whose attention never read them; "
                                      f"ctxpar's sharded cache cannot serve this model")
        skipped = sorted(set(cache.stored_layers()) - step.stored)
        if skipped:  # their slots for this position would count as held, holding nothing
            raise NotImplementedError(f"{name} stored no K/V for layers {skipped} in this step but did in the "
                                      f"prefill; ctxpar's sharded cache takes every layer's K/V at every position")
    finally:
        CACHED.reset(active)
        cache._step = None
    if step.position is None:
        seq_len = int(step.positions.numel()) * cache.world_size
        owner = last_position_owner(settings.layout, seq_len)
        out["logits"] = topology.broadcast(out.logits[:, -1:].contiguous(), owner, cache.peers)  # (B, 1, vocab)
    else:
        seq_len = step.position + 1
    cache.commit(step.positions, seq_len)
    return out


def _agree_allocated(cache: ShardedCache, error: Exception | None, device: torch.device) -> None:
    """One tiny all-reduce after the forward that allocated the cache's shards (the shapes of
    each layer's K/V are known only there): a rank that could not allocate its share raises
    its error, and its peers name it, rather than one rank raising inside the forward while
    the others wait in attention until the collective timeout."""
    failed = torch.zeros(cache.world_size, dtype=torch.int64, device=device)
    failed[cache.rank] = error is not None
    if cache.world_size > 1:
        topology.all_reduce(failed, cache.peers)
    if error is not None:
        raise error
    ranks = failed.nonzero().flatten().tolist()
    if ranks:
        raise ValueError(f"ranks {ranks} of the CP group could not allocate their share of the sharded KV cache; "
                         f"see their errors")


def _plan(name: str, settings: Settings, cache: ShardedCache, kwargs: dict, accepts) -> tuple[dict, _Step]:
    """Check what a forward over the cache adds to the checks of any forward under CP (its mask,
    token ids, logits_to_keep: ``enable_context_parallel``'s wrapper made them) and rewrite its
    arguments: the prefill's prompt sharded with global positions, or a decode step's position."""
    if torch.is_grad_enabled():  # generate runs under no_grad; a decode step's attention cuts the graph
        raise ValueError(f"{name} over ctxpar's sharded cache is inference only, but grad mode is on: a decode step "
                         f"gathers the ranks' partial attention without a gradient, so a backward would be wrong; "
                         f"call it under torch.no_grad() or torch.inference_mode(), as generate does")
    for key, what in (("labels", "labels= (a loss)"), ("inputs_embeds", "inputs_embeds="),
                      ("output_hidden_states", "output_hidden_states=True (hidden states of one shard)")):
        if kwargs.get(key) not in (None, False):
            raise NotImplementedError(f"{name} got {what} with ctxpar's sharded cache, which generation under "
                                      f"context parallelism does not support")
    if kwargs.get("return_dict") is False:
        raise NotImplementedError(f"{name} got return_dict=False with ctxpar's sharded cache; it returns a "
                                  f"ModelOutput")
    tokens = kwargs.get("input_ids")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] == 0:
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"{name} over ctxpar's sharded cache needs input_ids (B, n), got {got}")
    if tokens.shape[0] != cache.batch:
        raise ValueError(f"{name} got a batch of {tokens.shape[0]} but the sharded cache holds {cache.batch}")
    kwargs.pop("attention_mask", None)  # all ones (the forward's checks refused any other): the layout's causal mask
    batch, new = tokens.shape
    past = cache.get_seq_length()
    given = kwargs.get("position_ids")
    # one token the layout does not split (the start of a prompt shorter than its multiple) is
    # a decode step from an empty cache
    if past == 0 and (new > 1 or prefilled_length(settings.layout, 1)):
        want = torch.arange(new)
        settings.layout.validate(new)
        check_rope_lengths(name, settings, new, None)
        if new > cache.capacity:
            raise ValueError(f"a prompt of {new} tokens is longer than the sharded cache's {cache.capacity} positions")
        positions = settings.layout.positions(new, cache.rank)  # (T/P,) global, ascending
        kwargs["input_ids"] = settings.layout.shard(tokens, cache.rank, dim=1)  # (B, T/P)
        kwargs["position_ids"] = positions.to(tokens.device).unsqueeze(0).expand(batch, -1)
        if "logits_to_keep" in accepts:
            kwargs["logits_to_keep"] = 1  # the rank holding T-1 holds it last: the one row sampling needs
        step = _Step(position=None, positions=positions)
    else:
        if new != 1:
            raise NotImplementedError(f"{name} got {new} tokens on top of {past} cached positions; generation "
                                      f"under context parallelism feeds one token per step (chunked prefill, "
                                      f"assisted decoding and continuing from a cache are not supported)")
        if past >= cache.capacity:
            raise ValueError(f"the sharded cache is full: {past} positions = its capacity. generate sizes it for "
                             f"its own call; to continue a sequence, call generate again with the whole sequence "
                             f"as the prompt")
        want = torch.tensor([past])
        kwargs["position_ids"] = torch.full((batch, 1), past, dtype=torch.long, device=tokens.device)
        mine = decoded_owner(past, cache.world_size) == cache.rank
        new_positions = torch.tensor([past] if mine else [], dtype=torch.long)
        held = cache.kv.positions() if cache.kv is not None else new_positions[:0]
        step = _Step(position=past, positions=new_positions, held=len(held) + int(mine),
                     keys=torch.cat([held, new_positions]))
    if given is not None:
        _check_position_ids(name, given, want, past)
    return kwargs, step


def _check_position_ids(name: str, given, want: torch.Tensor, past: int) -> None:
    """Refuse position_ids other than the sequence's own (``want``, from ``past`` on), naming
    the first row that differs: row 0 may be right."""
    new = len(want)
    span = f"positions {past}..{past + new - 1} of the sequence; leave them to generate"
    if not isinstance(given, torch.Tensor) or given.dim() == 0 or given.numel() == 0 or given.shape[-1] != new:
        got = f"of shape {tuple(given.shape)}" if isinstance(given, torch.Tensor) else f"as {type(given).__name__}"
        raise ValueError(f"{name} got position_ids {got} for {span}")
    rows = given.reshape(-1, new).cpu()
    wrong = (rows != want).any(-1).nonzero().flatten()
    if len(wrong):
        row = int(wrong[0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(row), given.shape[:-1]))
        which = f" (row {index[0] if len(index) == 1 else index})" if len(rows) > 1 else ""
        raise ValueError(f"{name} got position_ids{which} {written_positions(rows[row])} for {span}")


_CRC_DEPTH = 5  # containers nested deeper are compared by type and length alone: a cycle ends
_PLAIN = (type(None), bool, int, float, str)


def _crc(value, depth: int = 0) -> int:
    """A checksum every rank computes alike for alike values: tensors by content, plain values
    and containers of them by value (one pass over a container of plain values: a vocabulary
    of 152k entries took 0.2-0.4 s member by member), functions by name and code (two lambdas
    written in one place share a name), other objects by type alone. Their attributes may
    differ between ranks without changing what they do (a creation time, an id, a set's
    order made into a list: compared, they refused calls that were the same everywhere);
    what a logits processor does is compared at every step, by the scores it gives
    (``HeldProcessors``)."""
    if isinstance(value, torch.Tensor):
        return agreement.tensor_code(value, value.dtype, agreement.text_code(str((tuple(value.shape), value.dtype))))
    if isinstance(value, _PLAIN):
        return agreement.text_code(repr(value))
    if inspect.ismethod(value):
        value = value.__func__
    if inspect.isfunction(value):
        code = value.__code__
        constants = [c for c in code.co_consts if isinstance(c, _PLAIN)]
        return agreement.text_code(f"{value.__module__}.{value.__qualname__} {code.co_code.hex()} {constants!r}")
    kind = type(value).__qualname__
    containers = (list, tuple, set, frozenset, dict)
    if not isinstance(value, containers):
        return agreement.text_code(kind)
    if depth >= _CRC_DEPTH:
        return agreement.text_code(f"{kind} of {len(value)}")
    if isinstance(value, dict):
        items = list(value.items())
        if all(isinstance(k, _PLAIN) and isinstance(v, _PLAIN) for k, v in items):
            return agreement.text_code(f"{kind} {sorted((repr(k), repr(v)) for k, v in items)}")
        return agreement.text_code(f"{kind} {sorted((_crc(k, depth + 1), _crc(v, depth + 1)) for k, v in items)}")
    unordered = isinstance(value, (set, frozenset))  # in no order of its own (a set of str's: PYTHONHASHSEED's)
    if all(isinstance(v, _PLAIN) for v in value):
        members = sorted(map(repr, value)) if unordered else list(value)
        return agreement.text_code(f"{kind} {members!r}")
    members = [_crc(v, depth + 1) for v in value]
    return agreement.text_code(f"{kind} {sorted(members) if unordered else members}")


def _forward_signature(cache: ShardedCache, kwargs: dict) -> dict[str, int]:
    tokens = kwargs.get("input_ids")
    ok = isinstance(tokens, torch.Tensor) and tokens.dim() == 2
    return {"cached positions": cache.get_seq_length(), "batch": tokens.shape[0] if ok else -1,
            "new tokens": tokens.shape[1] if ok else -1, "tokens (crc32)": _crc(tokens) if ok else -1}


def _num_layers(config) -> int:
    text = config.get_text_config(decoder=True)
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if isinstance(getattr(text, key, None), int):
            return getattr(text, key)
    raise NotImplementedError(f"{type(text).__name__} names no layer count ctxpar's sharded cache can size itself by")


def check_generate(model, settings: Settings, call: inspect.BoundArguments):
    """Refuse what generate would do that the sharded cache cannot honour (no collective);
    returns the prompt (B, T) and transformers' GenerationConfig for the call, ``call`` its
    arguments bound to generate's parameters."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    check_implementation(name, [m for m in model.modules() if isinstance(m, PreTrainedModel)])
    if model.config.is_encoder_decoder:
        raise NotImplementedError(f"{name} is an encoder-decoder model; ctxpar generates with decoder-only models")
    bound = dict(call.arguments)
    extra = dict(bound.pop("kwargs", {}))
    for key, what in (("assistant_model", "assisted decoding (assistant_model=)"),
                      ("custom_generate", "custom_generate="),
                      ("negative_prompt_ids", "classifier-free guidance (negative_prompt_ids=)")):
        if bound.get(key) is not None:
            raise NotImplementedError(f"{what} is not supported by generation under context parallelism")
    for key in CACHE_KEYS:
        if extra.get(key) is not None:
            raise NotImplementedError(f"generate got {key}=: continuing from a cache passed in is not supported "
                                      f"under context parallelism; ctxpar builds its own sharded cache from the "
                                      f"whole prompt")
    if extra.get("inputs_embeds") is not None:
        raise NotImplementedError("generate from inputs_embeds is not supported under context parallelism; pass "
                                  "input_ids")
    config, _ = model._prepare_generation_config(bound.get("generation_config"), **extra)
    mode = config.get_generation_mode(bound.get("assistant_model"))
    if mode not in _MODES:
        raise NotImplementedError(f"generation mode {str(getattr(mode, 'value', mode))!r} (num_beams="
                                  f"{config.num_beams}) is not supported under context parallelism; use greedy "
                                  f"decoding or sampling (num_beams=1)")
    for setting, value, fine in (("use_cache", config.use_cache, (True,)),
                                 ("cache_implementation", config.cache_implementation, (None, "dynamic")),
                                 ("prefill_chunk_size", config.prefill_chunk_size, (None,)),
                                 ("output_attentions", config.output_attentions, (None, False)),
                                 ("output_hidden_states", config.output_hidden_states, (None, False))):
        if value not in fine:
            raise NotImplementedError(f"generate with {setting}={value!r} is not supported under context "
                                      f"parallelism (ctxpar's sharded cache serves every step)")
    if _synced_gpus(model, bound.get("synced_gpus")):
        raise NotImplementedError("generate with synced_gpus (which transformers turns on under FSDP and DeepSpeed "
                                  "ZeRO-3) is not supported under context parallelism: a replica done early keeps "
                                  "running forwards for the others, past what its sharded cache holds; pass "
                                  "synced_gpus=False where no sharding across CP groups needs every rank's forwards "
                                  "in step")
    guiding = [type(p).__name__ for p in bound.get("logits_processor") or ()
               if type(p).__name__ == "UnbatchedClassifierFreeGuidanceLogitsProcessor"]
    if config.guidance_scale not in (None, 1) or guiding:
        given = f"a {guiding[0]}" if guiding else f"guidance_scale={config.guidance_scale!r}"
        raise NotImplementedError(f"generate with {given} is not supported under context parallelism: "
                                  f"classifier-free guidance runs the model on the prompt's last token alone, which "
                                  f"is no shard of the layout")
    prompt = bound.get("inputs")
    if prompt is None:
        prompt = extra.get("input_ids")
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or 0 in prompt.shape:
        got = tuple(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt).__name__
        raise ValueError(f"generate under context parallelism needs the whole prompt as input_ids (B, T), the same "
                         f"on every rank, got {got}")
    _check_attention_mask(extra.get("attention_mask"), prompt)
    check_token_ids(name, model, prompt)
    _check_cache_length(prompt.shape[1], config)
    _check_longrope_switch(model, settings, prompt.shape[1], config)
    head = prefilled_length(settings.layout, prompt.shape[1])  # the rest: one token at a time (``cached_forward``)
    if head:
        check_rope_lengths(name, settings, head, None)
    return prompt, config


def _check_attention_mask(mask, prompt: torch.Tensor) -> None:
    """A generate's ``attention_mask`` must be all ones of the prompt's shape (padding is
    refused): another shape or values other than 0 and 1 reached transformers, which made
    position ids of them, refused then as if the caller had passed position ids."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(prompt.shape):
        got = f"of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else \
            f"of type {type(mask).__name__}, not a tensor,"
        raise ValueError(f"generate got an attention_mask {got} for input_ids of shape {tuple(prompt.shape)}: pass "
                         f"a mask of the prompt's shape, or none")
    binary = (mask == 0) | (mask == 1)
    if not bool(binary.all()):
        raise ValueError(f"generate got an attention_mask holding {mask[~binary][0].item()!r}: a mask holds 0 "
                         f"(padding) and 1 (a token) only")
    if not bool(mask.all()):
        raise ValueError(GENERATE_PADDING_REFUSED)


def _longest(prompt_len: int, config) -> int:
    """The most tokens the sequence may hold by the end of generate (prompt and new)."""
    return prompt_len + config.max_new_tokens if config.max_new_tokens is not None else config.max_length


def _check_cache_length(prompt_len: int, config) -> None:
    """Refuse a call whose sharded cache (sized for the longest the sequence may get, as
    transformers sizes its caches) would hold more positions than ctxpar counts; raised inside
    the prefill, it named the cache's capacity, an argument the caller never gave."""
    longest = _longest(prompt_len, config)
    if config.max_new_tokens is not None:
        setting, most = "max_new_tokens", limits.MAX_COUNT + 1 - prompt_len
    else:
        setting, most = "max_length", limits.MAX_COUNT + 1
    if longest - 1 > limits.MAX_COUNT:
        raise ValueError(f"generate with {setting}={getattr(config, setting)} and a prompt of {prompt_len} tokens "
                         f"sizes the sharded KV cache for {longest - 1} positions, more than the {limits.MAX_COUNT} "
                         f"ctxpar counts; ask for {setting} at most {most}")


def _check_longrope_switch(model, settings: Settings, prompt_len: int, config) -> None:
    """The generate of some LongRoPE models (Phi-3's, Phi-MoE's: their
    ``prepare_inputs_for_generation`` reads original_max_position_embeddings) drops its cache
    and runs the whole sequence again with the long factors at the step whose input first
    passes original_max_position_embeddings tokens; under CP the sharded cache keeps the keys
    it holds, rotated with the short factors (the next logits 6.6 off, other tokens, silently).
    Refused where a generation from ``prompt_len`` tokens reaches that step; other LongRoPE
    models keep their cache, as CP does."""
    code = getattr(inspect.unwrap(type(model).prepare_inputs_for_generation), "__code__", None)
    if code is None or "original_max_position_embeddings" not in code.co_names:
        return
    name = type(model).__name__
    longest = _longest(prompt_len, config)
    for limit in settings.longrope:
        if prompt_len <= limit and longest - 1 > limit:  # the last forward's input: longest - 1 tokens
            raise ValueError(f"{name} uses LongRoPE: its generate runs the whole sequence again with the long "
                             f"factors once it passes original_max_position_embeddings={limit} tokens, which the "
                             f"sharded cache cannot follow (its keys stay rotated with the short factors); from "
                             f"this prompt of {prompt_len} tokens generate at most {limit + 1 - prompt_len} new "
                             f"token{'s' if limit - prompt_len else ''}, or start from a prompt longer than {limit}, "
                             f"or generate without context parallelism")


def _synced_gpus(model, given) -> bool:
    """Whether generate keeps finished ranks running forwards: ``synced_gpus``, or what
    transformers decides where it is None (FSDP or ZeRO-3 on more than one process)."""
    if given is not None:
        return bool(given)
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)) and dist.is_initialized() \
        and dist.get_world_size() > 1


def check_token_ids(name: str, model, tokens) -> None:
    """Token ids of an integer dtype (torch's embedding error named no argument), within the
    rows of the model's input embeddings, if it has them (an IndexError on the rank whose
    shard held one left its peers waiting in attention, and the group out of step for the
    next call)."""
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:  # a model without input embeddings: nothing to check against
        return
    rows = getattr(embeddings, "num_embeddings", None)
    weight = getattr(embeddings, "weight", None)
    if rows is None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        rows = weight.shape[0]  # an adapter's wrapper (PEFT's LoRA, trainable tokens) shows its embedding's weight
    if isinstance(tokens, torch.Tensor) and (tokens.dtype.is_floating_point or tokens.dtype.is_complex
                                             or tokens.dtype == torch.bool):
        raise ValueError(f"{name} got token ids of dtype {tokens.dtype}: token ids are integers (torch.long)")
    if isinstance(tokens, torch.Tensor) and isinstance(rows, int):
        limits.check_token_range(tokens, rows, name)


# generation settings compared by value, so that a difference names them (the rest by checksum): integers, and
# the usual sampling settings shown as written (None where unset)
_NAMED_SETTINGS = ("max_new_tokens", "max_length", "min_new_tokens", "do_sample", "num_return_sequences", "top_k")
_NAMED_FLOAT_SETTINGS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty")
# generate's arguments of objects compared each by its own checksum, so that a difference names them (a logits
# processor on one rank read "arguments (crc32)"); an empty list is no list (an empty StoppingCriteriaList is None's)
_NAMED_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn")


def generate_signature(model, arguments: dict, prompt, config) -> dict[str, int]:
    """What every rank's generate call must share: ``arguments`` (generate's, by name), prompt,
    the model's config and weights and, when sampling, the state of the RNG transformers draws
    from. A ``streamer`` is left out: it only watches (rank 0 alone often prints)."""
    sampling = config is not None and bool(config.do_sample)
    rng = [torch.get_rng_state()] if sampling else []
    device = model.device
    if sampling and device.type == "cuda":
        rng.append(torch.cuda.get_rng_state(device))
    named = {key: agreement.readable(lambda key=key: _setting(getattr(config, key, None))) for key in _NAMED_SETTINGS}
    named_floats = {key: agreement.Text(repr(getattr(config, key, None))) for key in _NAMED_FLOAT_SETTINGS}
    rest = {k: v for k, v in arguments.items() if k != "streamer" and k not in _NAMED_ARGUMENTS}
    # a checksum that raises (a meta or sparse tensor held by one rank) is sent as -1: a difference, on every rank
    return {"arguments (crc32)": agreement.readable(lambda: _crc(rest)),
            **{f"{key} (crc32)": agreement.readable(lambda key=key: _crc(arguments.get(key) or None))
               for key in _NAMED_ARGUMENTS},
            "prompt": tuple(prompt.shape)[1] if isinstance(prompt, torch.Tensor) else -1,
            **named, **named_floats,
            "generation config (crc32: the call's settings over model.generation_config)":
                _crc(config.to_dict()) if config is not None else -1,
            "RNG state (crc32), seed every rank alike": _crc(rng), SAME_MODEL: model_code(model),
            SAME_WEIGHTS: agreement.readable(lambda: weights_code(model))}


def _setting(value) -> int:
    """A generation setting as an integer to compare (None: -2, as -1 reads "unknown")."""
    if value is None:
        return -2
    if isinstance(value, (bool, int)):
        return int(value)
    raise TypeError(value)  # readable() sends -1 for it: the config's checksum still compares it


class HeldStreamer:
    """A generate call's ``streamer``, whose error is held for the next forward's exchange,
    which raises it on every rank together: a streamer given on rank 0 alone (a closed pipe
    to print to) raised there between steps, its peers waiting in the next step's
    collective. An error after the last forward is raised by ``end``, on that rank alone (its
    peers are done)."""

    def __init__(self, streamer) -> None:
        self.streamer = streamer
        self.error: Exception | None = None

    def put(self, value) -> None:
        if self.error is None:
            try:
                self.streamer.put(value)
            except Exception as e:  # noqa: BLE001  any failure: raised at the next exchange
                self.error = e

    def end(self) -> None:
        if self.error is None:
            self.streamer.end()
        if self.error is not None:
            raise self.error


# The streamer of the generate call in progress (None outside one, or without a streamer).
STREAMING: contextvars.ContextVar[HeldStreamer | None] = contextvars.ContextVar("ctxpar_streaming", default=None)


class HeldProcessors(LogitsProcessorList):
    """A generate call's logits processors, whose error is held for the step's ``AgreedStop``,
    which raises it on every rank together: a processor failing on one rank raised there,
    its peers waiting in the all-reduce until the timeout (and the group out of step for the
    next call). Once one failed, zeros go on to the step's end (what it left half done, NaN or
    all -inf, could fail the sampling on this rank alone). ``code``: a checksum of the scores
    they gave at this step, which ``AgreedStop`` compares: processors that differ between
    ranks (one class with other parameters; two ``prefix_allowed_tokens_fn``) gave each rank
    its own scores, the tokens differing only where they made them differ. ``logits_code``:
    the same of the logits they were given, so that logits differing between ranks (a hook or
    weights of one rank's own) are not blamed on the processors."""

    def __init__(self, processors) -> None:
        super().__init__(processors)
        self.error: Exception | None = None
        self.code = self.logits_code = 0
        self._weights: torch.Tensor | None = None  # _scores_sum's, made once per generate call, not per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self._weights is None or self._weights.numel() != scores.numel() or self._weights.device != scores.device:
            self._weights = torch.arange(scores.numel(), device=scores.device, dtype=torch.int64) % 65521 + 1
        logits_sum = _scores_sum(scores, self._weights)  # before processors that change them in place
        if self.error is None and len(self):
            try:
                scores = super().__call__(input_ids, scores, **kwargs)
            except Exception as e:  # noqa: BLE001  any failure: raised by this step's AgreedStop
                self.error = e
        if self.error is not None:  # what a processor left half done (NaN, all -inf) could fail the sampling here
            scores = torch.zeros_like(scores)
        scores_sum = _scores_sum(scores, self._weights) if len(self) else logits_sum
        # one host read for both checksums per step
        self.logits_code, self.code = (agreement.text_code(str(int(s))) & 0xFFFFFF
                                       for s in torch.stack([logits_sum, scores_sum]).tolist())
        return scores


_SCORE_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
               torch.bfloat16: torch.int16}


def _scores_sum(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The sum of ``scores``' bits weighted by position (a swap of two values changes it), an
    int64 scalar on their device wrapping alike on every rank, whose 64 bits the caller folds
    into a 24-bit checksum (``agreement.sums_of``): scores scaled by a power of 2 (a
    temperature of 0.5 against 2.0) differ in their exponents alone, the sum by a multiple of
    2**24. 0 for a dtype without a same-width integer type."""
    bits = _SCORE_BITS.get(scores.dtype)
    if bits is None:
        return torch.zeros((), dtype=torch.int64, device=scores.device)
    flat = scores.detach().contiguous().view(bits).reshape(-1).to(torch.int64)
    return (flat * weights).sum()


# The logits processors of the generate call in progress (None outside one, or on one rank).
PROCESSING: contextvars.ContextVar[HeldProcessors | None] = contextvars.ContextVar("ctxpar_processing", default=None)


class AgreedStop(StoppingCriteriaList):
    """transformers' stopping criteria for one generate call, then one tiny all-reduce over
    the CP group: a sequence stops on every rank where any rank's criteria stop it (a
    ``max_time`` clock, a criterion with state of its own), and the tokens each rank just
    appended are compared (a call's last token reaches no forward, whose check would catch
    a rank that sampled another)."""

    def __init__(self, criteria, peers: topology.Topology) -> None:
        super().__init__(criteria)
        self.peers = peers

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        rows, error = input_ids.shape[0], None
        processors = PROCESSING.get()
        processor_error, logits_code, scores_code = ((processors.error, processors.logits_code, processors.code)
                                                     if processors is not None else (None, 0, 0))
        try:
            done = super().__call__(input_ids, scores, **kwargs).tolist()  # (B,) bool
        except Exception as e:  # noqa: BLE001  a criterion failing here: this rank must still join the all-reduce
            done, error = [False] * rows, e
        code = _crc(input_ids[:, -1]) & 0xFFFFFF  # 24 bits (agreement.sums_of)
        flags = torch.tensor([*done, int(processor_error is not None), int(error is not None),
                              *agreement.sums_of(code), *agreement.sums_of(logits_code),
                              *agreement.sums_of(scores_code)], dtype=torch.int64, device=input_ids.device)
        topology.all_reduce(flags, self.peers)
        values = flags.tolist()  # one copy to the host
        stopped, failed = values[:rows], values[rows:rows + 2]
        summed, summed_logits, summed_scores = values[rows + 2:rows + 5], values[rows + 5:rows + 8], values[rows + 8:]
        if processor_error is not None or error is not None:
            raise processor_error if processor_error is not None else error
        for what, count in zip(("a logits processor", "a stopping criterion"), failed):
            if count:
                raise ValueError(f"{what} failed on another rank of the CP group; see its error")
        if agreement.differ(logits_code, summed_logits):
            raise ValueError(f"the model gave the ranks of the CP group different logits for position "
                             f"{input_ids.shape[1] - 1} (before any logits processor): a forward hook, or weights "
                             f"changed since the call began, differ between ranks; every rank must generate alike")
        if agreement.differ(scores_code, summed_scores):
            raise ValueError(f"the logits processors of the ranks of the CP group gave different scores for position "
                             f"{input_ids.shape[1] - 1}: a logits processor (its parameters) or a "
                             f"prefix_allowed_tokens_fn differs between ranks; every rank must generate alike")
        if agreement.differ(code, summed):
            raise ValueError(f"the ranks of the CP group appended different tokens at position "
                             f"{input_ids.shape[1] - 1}: a logits processor, stopping criterion or use of the RNG "
                             f"differs between ranks; every rank must generate alike")
        return torch.tensor(stopped, device=input_ids.device) > 0


def wrap_generate(model, settings: Settings) -> None:
    """Make ``model.generate`` check its call on every rank, then run transformers' generate
    over a ``ShardedCache`` (built by the model's ``_prepare_cache_for_generation``)."""
    from transformers import GenerationMixin

    generate = getattr(type(model), "generate", None)
    if generate is None:
        return  # no LM head: nothing to generate with
    name = type(model).__name__
    hooks = ("_prepare_generation_config", "_prepare_cache_for_generation", "_get_stopping_criteria",
             "_get_logits_processor")
    if generate is not GenerationMixin.generate or not all(hasattr(GenerationMixin, h) for h in hooks):
        @installed
        def refuse(*args, **kwargs):
            raise NotImplementedError(f"{name}.generate() is not transformers' GenerationMixin.generate of version "
                                      f"5 (with {' and '.join(hooks)}), which ctxpar drives under context "
                                      f"parallelism; generate with a model enable_context_parallel was not applied to")
        model.generate = refuse
        return

    @installed
    @functools.wraps(generate)
    def cp_generate(*args, **kwargs):
        prompt, config, call = None, None, None
        with agreement.Refusal() as refusal:
            call = inspect.signature(generate).bind(model, *args, **kwargs)  # a positional streamer too
            prompt, config = check_generate(model, settings, call)
        arguments = dict(call.arguments) if call is not None else {"arguments": [list(args), kwargs]}
        arguments.pop("self", None)
        peers = settings.peers()
        refusal.join(lambda: generate_signature(model, arguments, prompt, config), peers.process_groups,
                     "generate call", world_size=peers.world_size)
        held = None
        if call.arguments.get("streamer") is not None and peers.world_size > 1:
            held = call.arguments["streamer"] = HeldStreamer(call.arguments["streamer"])
        streaming, processing = STREAMING.set(held), PROCESSING.set(None)
        try:
            return generate(*call.args, **call.kwargs)
        finally:
            STREAMING.reset(streaming)
            PROCESSING.reset(processing)

    @installed
    def logits_processor(*args, **kwargs) -> LogitsProcessorList:
        processors = type(model)._get_logits_processor(model, *args, **kwargs)
        if settings.peers().world_size == 1:
            return processors
        held = HeldProcessors(processors)
        PROCESSING.set(held)
        return held

    @installed
    def stopping_criteria(*args, **kwargs) -> StoppingCriteriaList:
        criteria = type(model)._get_stopping_criteria(model, *args, **kwargs)
        peers = settings.peers()
        return AgreedStop(criteria, peers) if peers.world_size > 1 else criteria

    @installed
    def prepare_cache(generation_config, model_kwargs: dict, generation_mode, batch_size: int,
                      max_cache_length: int) -> None:
        copies = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        if isinstance(max_cache_length, float) and math.isfinite(max_cache_length):  # max_new_tokens=3.5: generate
            max_cache_length = math.ceil(max_cache_length)  # without CP runs while the length is below T + 3.5
        cache = ShardedCache(layers=_num_layers(model.config), batch=batch_size * copies, capacity=max_cache_length,
                             group=settings.group, mesh=settings.mesh)
        cache.made_by_generate = True
        model_kwargs["cache"] = cache

    model.generate = cp_generate
    model._prepare_cache_for_generation = prepare_cache
    model._get_stopping_criteria = stopping_criteria
    model._get_logits_processor = logits_processor
