"""Applying context parallelism to a model from outside, and the loss that goes with it.

    model = Transformer(cfg)                                   # single-device code
    apply_context_parallel(model, layout=layout, group=cp_group)
    batch = shard_batch(tokens, layout=layout, rank=cp_rank)   # labels shifted before sharding
    logits = model(batch.tokens, batch.positions)              # RoPE from global positions
    share, loss = cp_loss(logits, batch.labels, group=None)    # token-weighted over all ranks

The sharp edges this handles: labels are shifted on the unsplit sequence (shifting a
shard would pair its last token with the wrong label), RoPE gets global positions, and
the loss divides the token-weighted sum by the *global* number of labelled tokens, so
shards with different numbers of ignored labels weigh exactly as in the unsplit batch.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import reprlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ctxpar import agreement, comm, limits, topology
from ctxpar.attention import attention, check_settings, is_dtensor, loaded_class
from ctxpar.layout import Layout, get_layout, positions_mismatch
from ctxpar.masks import document_lengths, positions_in_documents
from ctxpar.models.config import ModelConfig
from ctxpar.models.llama import causal_sdpa

IGNORE_INDEX = -100


def shift_labels(tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token targets (B, T): position t is scored on labels[t + 1] (default: tokens);
    the last position has none (IGNORE_INDEX). Apply to the unsplit sequence. int64, whatever
    the integer dtype of the ids (uint8 ones could not hold IGNORE_INDEX)."""
    labels = tokens if labels is None else labels
    return F.pad(labels[:, 1:].long(), (0, 1), value=IGNORE_INDEX)


@dataclass
class CPBatch:
    tokens: torch.Tensor  # (B, T/P) int64, this rank's tokens
    positions: torch.Tensor  # (T/P,) their positions for RoPE: global, or within their document
    labels: torch.Tensor  # (B, T/P) next-token targets, IGNORE_INDEX where none
    documents: tuple[int, ...] | None = None  # the packed row's document lengths, for attention(documents=)


def shard_batch(
    tokens: torch.Tensor, *, layout: Layout, rank: int, labels: torch.Tensor | None = None, documents=None
) -> CPBatch:
    """This rank's part of a (B, T) batch: tokens, positions, shifted labels.

    ``rank``: this rank's place in the layout, its rank in the CP group,
    ``dist.get_rank(group)``, or ``ctxpar.hybrid_rank(mesh)`` (``ctxpar.layout``'s docstring:
    not its place in a list given to ``new_group``).

    ``labels``: (B, T) unshifted, aligned with ``tokens`` (default: the tokens themselves),
    IGNORE_INDEX (-100) where a token is not to be predicted; they are shifted here, on the
    unsplit row (position t is scored on labels[t + 1]). Labels shifted already are refused.

    ``documents``: the lengths (or cu_seqlens) of the documents packed into each row, the
    same for every row. Positions then restart at 0 in each document, and a document's
    last token predicts nothing (not the next document's first token); pass
    ``batch.documents`` on: ``model(batch.tokens, batch.positions, documents=batch.documents)``
    for the reference model, ``documents=`` to ``ctxpar.attention`` otherwise.

    The shard's tokens name the batch they were cut from (``batch_code``): a forward then
    refuses, on every rank together, shards of different batches on the ranks of a CP group.
    """
    _check_batch(tokens, layout, labels)
    seq_len = tokens.shape[1]
    lengths = None if documents is None else document_lengths(documents, seq_len)
    targets = shift_labels(tokens, labels)
    if lengths is not None:
        ends = torch.tensor(list(itertools.accumulate(lengths)), device=tokens.device) - 1
        targets[:, ends] = IGNORE_INDEX
    positions = layout.positions(seq_len, rank, device=tokens.device)
    shard = layout.shard(tokens, rank, dim=1).long()  # the ids the model's embedding takes, from any integers
    if layout.world_size > 1:
        _SHARDED.remember(shard, tokens, targets)
    return CPBatch(
        tokens=shard,
        positions=positions_in_documents(positions, lengths),
        labels=layout.shard(targets, rank, dim=1),
        documents=lengths,
    )


def _check_batch(tokens, layout, labels) -> None:
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a Layout built for the CP group's size (ctxpar.get_layout(name, "
                         f"world_size)), got {reprlib.repr(layout)}")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be a (B, T) tensor of the whole batch, got {got}")
    if tokens.shape[0] == 0:  # an empty shard fails in attention (P > 1): refused alike whatever P is
        raise ValueError(f"tokens {tuple(tokens.shape)} hold no rows, so there is nothing to shard (the empty last "
                         f"slice of a data-parallel split?); give every rank at least one row, e.g. "
                         f"DataLoader(drop_last=True)")
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != tokens.shape):
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be a tensor of the tokens' shape (B, T) = {tuple(tokens.shape)}, got {got}")
    for name, ids in (("tokens", tokens), ("labels", labels)):  # float ids were sharded as they were, silently
        if ids is not None and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
            raise ValueError(f"{name} must hold integer token ids, got {ids.dtype}; pass the ids themselves (e.g. "
                             f"a tokenizer's int64 output), not scores or a mask")
    if labels is not None and _shifted_already(tokens, labels):
        raise ValueError("labels are shifted already (each equals the next token wherever it labels): shard_batch "
                         "shifts them itself, which would score each token on the one after next; pass them aligned "
                         f"with tokens (labels=tokens, or a copy with {IGNORE_INDEX} where a token is not to be "
                         "predicted)")


def _shifted_already(tokens: torch.Tensor, labels: torch.Tensor) -> bool:
    """Labels that are next-token targets already (``shift_labels``', or nanoGPT's y = data[:, 1:]
    beside x = data[:, :-1]): each equal to the following token wherever it labels one, and not
    simply the tokens (a row of one repeated token). One host read."""
    if tokens.shape[1] < 2:
        return False
    labelled = labels != IGNORE_INDEX
    follows = ((labels[:, :-1] == tokens[:, 1:]) | ~labelled[:, :-1]).all()
    return bool(follows & labelled[:, :-1].any() & ((labels != tokens) & labelled).any())


def _batch_checksum(tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """crc32 of a whole batch: its tokens, then their shifted targets, as int64."""
    return agreement.tensor_code(targets, torch.int64, agreement.tensor_code(tokens, torch.int64))


class _ShardedLately:
    """The batches ``shard_batch`` cut lately in this process, known by the shard each handed
    out: a forward finds, from its own tokens, a checksum of the whole batch they came
    from, and the ranks of a CP group compare theirs (``batch_code``). Shards of different
    batches (a DistributedSampler over every rank rather than the data-parallel ones) are
    then refused, where attention would silently mix the batches.

    A shard cut alike from two batches (a row of padding) names neither, and tokens not
    cut here (a batch sharded in a DataLoader worker) name none: their forward goes
    unchecked rather than refused."""

    KEPT = 64  # shards remembered: a few steps of prefetching on every micro-batch

    def __init__(self) -> None:
        self._codes: OrderedDict[tuple, int] = OrderedDict()  # (shape, shard's crc32) -> batch code, -1 if two
        self._lock = threading.Lock()  # shard_batch may run in a loader thread

    def remember(self, shard: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """``shard`` was cut from the batch of ``tokens`` and their shifted ``targets`` (B, T)."""
        code = _batch_checksum(tokens, targets) >> 8  # 24 bits: a forward's all-reduce sums their squares
        key = (tuple(shard.shape), agreement.tensor_code(shard, torch.int64))
        with self._lock:
            known = self._codes.pop(key, code)
            self._codes[key] = code if known == code else -1
            while len(self._codes) > self.KEPT:
                self._codes.popitem(last=False)

    def code(self, tokens: torch.Tensor) -> int:
        shape = tuple(tokens.shape)
        with self._lock:
            if not any(known == shape for known, _ in self._codes):  # nothing to find: no host copy, no checksum
                return -1
        key = (shape, agreement.tensor_code(tokens, torch.int64))  # outside the lock: a copy to the host
        with self._lock:
            return self._codes.get(key, -1)


_SHARDED = _ShardedLately()
SAME_BATCH = ("batch (a checksum of the whole batch shard_batch cut each rank's tokens from: every rank of a CP "
              "group shards the same batch; sample data by data-parallel rank, not by global rank)")
SAME_MODEL = "model (a checksum of its config: build or load the same model on every rank)"
SAME_MODE = ("mode (call model.train() or model.eval() on every rank: dropout on some ranks' shards only gives "
             "neither the eval nor the training result)")
# A Hugging Face config's fields that say where the model came from or the dtype it was loaded
# in, not what it computes (parameters' dtypes attention compares itself): ranks loading one
# model from node-local copies agree.
_PROVENANCE = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype")


def has_attention_fn(module: nn.Module) -> bool:
    """Whether ``module`` has an ``attention_fn`` of its own: ``hasattr`` without
    Module.__getattr__, which raises (and catches) an AttributeError for each module lacking
    one (a decode step walked a model's modules so for a tenth of its time). A wrapper that
    forwards attribute reads to the module it wraps (torch.compile's, FSDP1's) has none: the
    wrapped module, which the walk also meets, is the attention module."""
    return "attention_fn" in module.__dict__ or "attention_fn" in module._modules or hasattr(type(module),
                                                                                           "attention_fn")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules with an ``attention_fn``, in forward order (layer 0 first)."""
    return [m for m in model.modules() if has_attention_fn(m)]


def model_code(model: nn.Module, attention: list[nn.Module] | None = None) -> int:
    """A checksum of what ``model`` computes, alike on ranks holding models of one shape: a
    Hugging Face model's ``config`` but for its provenance; else the reference model's
    ``cfg`` (RoPE theta and norm eps included), or for a module without one its parameters'
    names and shapes (not under FSDP1, whose flat shards differ by rank), and its number of
    attention modules. Compared at the first forward and in inference calls: a model built
    otherwise on one rank trained silently wrong (another RoPE theta: a gradient 23% off) or
    left the others waiting in a layer it lacked. -1 where it cannot be read. ``attention``:
    its attention modules where the caller has them (a decode step: no second walk)."""
    def describe() -> str:
        if callable(getattr(getattr(model, "config", None), "to_dict", None)):
            return repr(_computed(model.config.to_dict()))
        config = getattr(model, "cfg", None)
        described = repr(config) if isinstance(config, ModelConfig) else "" if _fsdp1_sharded(model) else repr(
            [(name, tuple(p.shape)) for name, p in model.named_parameters()])
        count = len(attention_modules(model) if attention is None else attention)
        return f"{described}, {count} attention modules"

    return agreement.readable(lambda: agreement.text_code(describe()))


SAME_WEIGHTS = ("weights (a checksum of each parameter's first values: seed ranks apart only after building the "
                "model, or load the same weights on every rank)")
_SAMPLED = 8  # values of each parameter weights_code reads


def weights_code(model: nn.Module) -> int:
    """A checksum of the first values of each parameter this rank holds whole (not a DTensor's
    shard, nor on the meta device; nothing under FSDP1, whose parameters are flat shards),
    alike on ranks holding one model's weights: a model built after seeding the ranks apart
    trained as a mixture of models, silently. -1 where no parameter is held whole. One host
    read per device and dtype."""
    if _fsdp1_sharded(model):
        return -1
    sampled: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in model.parameters():
        if not is_dtensor(p) and not p.is_meta and p.numel():
            first = p.detach()
            while first.dim() > 1:  # the first row: a view, where reshape(-1) copies a strided parameter
                first = first[0]
            sampled.setdefault((p.device, p.dtype), []).append(first[:_SAMPLED])
    code = -1
    for device, dtype in sorted(sampled, key=str):
        code = agreement.tensor_code(torch.cat(sampled[device, dtype]), dtype, max(code, 0))
    return code


def _fsdp1_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP1 units, whose parameters are this rank's flat shards (or
    views of them, or empty): neither their values nor their shapes are alike across ranks."""
    unit = loaded_class("torch.distributed.fsdp", "FullyShardedDataParallel")
    return any(isinstance(m, unit) for m in model.modules())


def _computed(value):
    """A Hugging Face config's fields, and its sub-configs', but for ``_PROVENANCE``, in an order
    and a form alike in every process: sets sorted, and objects by their type (a repr may hold
    an address, a set's order the process's hash seed)."""
    if isinstance(value, dict):
        return sorted(((str(key), _computed(field)) for key, field in value.items() if key not in _PROVENANCE),
                      key=lambda item: item[0])
    if isinstance(value, (list, tuple)):
        return [_computed(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_computed(item) for item in value), key=repr)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


def batch_code(tokens) -> int:
    """A 24-bit checksum of the whole batch (tokens and shifted labels) that ``shard_batch``
    cut ``tokens`` (B, T/P) from in this process, or -1 where that is not known. Equal on
    the ranks of a CP group that were given the same batch; compared in the forward."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        return -1
    return agreement.readable(lambda: _SHARDED.code(tokens))


def apply_context_parallel(
    model: nn.Module, *, layout: str | Layout, group: dist.ProcessGroup | None = None, strategy: str = "ring",
    mesh=None, check_consistency: bool = True,
) -> nn.Module:
    """Route every attention module's ``attention_fn`` through ``ctxpar.attention``.

    Works on any module tree whose attention modules expose ``attention_fn(q, k, v)``
    (the reference ``ctxpar.models.Transformer``); for Hugging Face models see
    ``ctxpar.integrations.transformers``. Returns the model, changed in place.

    Each ``attention_fn`` must be the reference model's causal attention
    (``ctxpar.models.llama.causal_sdpa``) or this function's from an earlier call: it is
    replaced by exact causal attention at scale head_dim**-0.5 over the ranks, so any other
    function (bidirectional, its own scale, a window) is refused, naming its layer, before
    the model changes, rather than silently made causal.

    The model's forward must take this rank's tokens and their global positions as
    parameters named ``tokens`` and ``positions`` (the reference model's ``forward(tokens,
    positions=None, documents=None)``; ``model(batch.tokens, batch.positions)`` with
    ``shard_batch``'s batch), and hand the positions to its RoPE (or position embedding): a
    model with no module whose forward takes them is refused before it changes, as one that
    numbers its tokens itself (``torch.arange``) or takes them by other names
    (``input_ids``, ``position_ids``) would run with each shard numbered from 0 and go
    unchecked. ``model`` may wrap such a module (a module of one's own, DDP,
    ``torch.compile``): the checks go on it, the innermost where they nest. Each rank
    shards at its rank in ``group`` (``shard_batch``'s ``rank``).

    ``check_consistency`` (as ``ctxpar.attention``'s, on every rank at once): each
    attention call compares the ranks' calls, and that module's forward (and the reference
    model's ``hidden_states``, which runs through it) refuses, on every rank together,
    positions that are not this rank's layout positions, shards of different batches
    (``batch_code``) and, where the module holds one ``nn.Embedding`` (the token embedding,
    whatever its name), token ids it cannot take, with one tiny all-gather per forward;
    False skips these checks.

    The model cannot be pickled (``torch.save(model)``) afterwards: save its ``state_dict()``.
    """
    limits.check_flag("check_consistency", check_consistency)
    modules = [(name, m) for name, m in model.named_modules() if has_attention_fn(m)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no module with an attention_fn to replace")
    # the reference model's attention knows its heads: those the all-to-all cannot split are refused now, not at
    # every forward
    shapes = {(m.cfg.heads, m.cfg.kv_heads) for _, m in modules if isinstance(getattr(m, "cfg", None), ModelConfig)}
    check_settings(layout=layout, group=group, strategy=strategy, mesh=mesh, heads=sorted(shapes),
                   who="apply_context_parallel")
    for name, module in modules:
        fn = module.attention_fn
        if not plain_causal_attention(fn):
            shown = repr(getattr(fn, "__name__", fn))  # a partial's arguments, a scale among them: in full
            raise ValueError(
                f"{name or type(model).__name__}'s attention_fn is {shown}, not "
                f"the model's causal attention (ctxpar.models.llama.causal_sdpa) or apply_context_parallel's: it "
                f"would be replaced by causal attention at scale head_dim**-0.5, dropping what it does (a "
                f"bidirectional mask, its own scale, a window); set attention_fn = causal_sdpa if it is plain causal "
                f"attention, or call ctxpar.attention(q, k, v, layout=..., causal=..., scale=...) in it yourself")
    guarded = _guarded_modules(model, [module for _, module in modules])
    if not guarded:
        raise ValueError(
            f"{type(model).__name__}: no module's forward around its attention takes parameters named tokens and "
            f"positions, so this rank's global positions cannot reach its RoPE (or position embedding), nor be "
            f"checked: a forward that numbers its tokens itself (torch.arange) or takes them by other names "
            f"(input_ids, position_ids) runs each shard as if it began the sequence, silently wrong; give the "
            f"forward (tokens, positions=None, ...) parameters, use the positions, and call model(batch.tokens, "
            f"batch.positions) with batch = shard_batch(...) (Hugging Face models: "
            f"ctxpar.integrations.transformers.enable_context_parallel)")
    cp_attention = _SharedAttention(attention, layout=layout, group=group, strategy=strategy, mesh=mesh, causal=True,
                                    check_consistency=check_consistency)
    for _, module in modules:
        module.attention_fn = cp_attention
    for module in model.modules():  # applied again (to the model, or to a wrapper of it): replaced, not stacked
        previous = module.__dict__.pop("_ctxpar_positions_guard", None)
        if previous is not None:
            previous.remove()
    if check_consistency:
        for module in guarded:
            guard = _PositionsGuard(module, layout, group, mesh, cp_attention)
            module._ctxpar_positions_guard = _Hooks(module.register_forward_pre_hook(guard, with_kwargs=True),
                                                    module.register_forward_hook(guard.after, always_call=True))
    return model


@dataclass(frozen=True)
class _Hooks:
    """The guard's two hooks on one module, removed together."""

    before: torch.utils.hooks.RemovableHandle
    after: torch.utils.hooks.RemovableHandle

    def remove(self) -> None:
        self.before.remove()
        self.after.remove()


# attention a module may run itself, outside its attention_fn: within this rank's shard alone under CP
_DIRECT_ATTENTION = (F.scaled_dot_product_attention, F.multi_head_attention_forward)


class _AttentionOutsideAttentionFn(TorchFunctionMode):
    """Through a guarded module's first forward under CP: refuses attention called outside the
    attention_fn that ``apply_context_parallel`` replaced (a layer calling
    F.scaled_dot_product_attention itself, an nn.MultiheadAttention), which would attend
    within this rank's shard alone: a model mixing both trained silently wrong (loss 1e-3
    off, gradients 70-130%). Every rank runs the same layers, so every rank raises there."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model, self.refused = model, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DIRECT_ATTENTION:
            self.refused = True
            raise ValueError(f"{self.model} calls torch.nn.functional.{func.__name__} itself, outside the "
                             f"attention_fn that apply_context_parallel replaced: under context parallelism it would "
                             f"attend within this rank's shard of the sequence alone, silently wrong; route that "
                             f"layer's attention through an attention_fn (causal_sdpa), or call ctxpar.attention in "
                             f"it")
        return func(*args, **(kwargs or {}))


def plain_causal_attention(fn) -> bool:
    """Whether ``fn`` is the reference model's causal attention or ``apply_context_parallel``'s:
    what ctxpar may replace by its own exact causal attention without dropping anything."""
    return fn is causal_sdpa or isinstance(fn, _SharedAttention)


class _KeptWithTheModel:
    """What ``apply_context_parallel`` installs on a model (its attention, the positions guard):
    a deep copy of the model (an EMA copy) shares it, as the process group it holds cannot be
    copied, and pickling it (``torch.save(model)``) is refused saying what to save instead."""

    def __deepcopy__(self, memo: dict) -> _KeptWithTheModel:
        return self

    def __reduce_ex__(self, protocol: int):
        raise pickling_refused("a model under apply_context_parallel",
                               "model.state_dict() and apply_context_parallel to the model you load")


def pickling_refused(model: str, save: str) -> TypeError:
    """The error for pickling (``torch.save(model)``) or shallow-copying a model ctxpar has
    changed: what it installed holds the process group; ``save`` says what to save instead."""
    return TypeError(f"{model} cannot be pickled or shallow-copied while context parallelism is enabled (ctxpar's "
                     f"wrappers hold its process group): save {save}, or use copy.deepcopy")


class _SharedAttention(_KeptWithTheModel, functools.partial):
    """``ctxpar.attention`` with a model's CP settings, the ``attention_fn`` that
    ``apply_context_parallel`` installs. A deep copy of the model shares it: the positions
    guard knows the model's attention by identity (a copied one left the copy unguarded).
    Called as ``causal_sdpa`` is, ``documents`` by place too (a TypeError once)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None, **kwargs) -> torch.Tensor:
        return self.func(q, k, v, *self.args, documents=documents, **{**self.keywords, **kwargs})


def _guarded_modules(model: nn.Module, attention_modules: list[nn.Module]) -> list[nn.Module]:
    """The modules whose forward takes the reference model's ``(tokens, positions)`` and holds
    one of ``attention_modules``, the innermost where they nest: ``model`` itself, or the
    model inside a wrapper (a module of one's own, DDP, torch.compile's OptimizedModule),
    whose own forward takes other arguments and hands them on. Guarding only the root left
    a wrapped model unguarded, its attention under CP all the same."""
    attending = {id(module) for module in attention_modules}
    takers = [module for module in model.modules() if _takes_positions(module)
              and any(id(m) in attending for m in module.modules())]
    return [module for module in takers
            if not any(other is not module and any(other is m for m in module.modules()) for other in takers)]


def _takes_positions(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward inspect cannot read (a builtin): not the reference model's
        return False
    return "tokens" in parameters and "positions" in parameters


class _PositionsGuard(_KeptWithTheModel):
    """A forward pre-hook refusing, on every rank together, a forward whose positions are not
    this rank's layout positions (counted from each document's start when ``documents=`` is
    given, as ``shard_batch`` makes them): forgotten positions (the model would number the
    shard from 0) or a shard taken with another layout give RoPE positions that the causal
    mask does not share, silently wrong. So are shards of different batches
    (``batch_code``), where attention would mix them, and at the first forward models of other
    configs (``model_code``) or weights (``weights_code``). Tokens the embedding cannot take (ids
    outside the vocabulary, another dtype than int64 or int32, another device) raised on the
    one rank holding them, its peers waiting in attention. One tiny all-gather per forward."""

    def __init__(self, module: nn.Module, layout: str | Layout, group: dist.ProcessGroup | None, mesh,
                 cp_attention: Callable[..., torch.Tensor]) -> None:
        self.signature = inspect.signature(module.forward)
        self.layout, self.group, self.mesh, self.cp_attention = layout, group, mesh, cp_attention
        # attention outside the attention_fn is looked for until a forward completes (eagerly: not while
        # torch.compile traces it)
        self.watching: _AttentionOutsideAttentionFn | None = None
        self.watched = False
        self.first_compared = False  # the model and the weights it trains from, at the first forward

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not any(has_attention_fn(m) and m.attention_fn is self.cp_attention for m in module.modules()):
            return  # inference has swapped in its own attention, which passes its own positions
        topo = topology.of(self.group, self.mesh, "apply_context_parallel")
        if topo.world_size == 1:
            return
        tokens = None
        with agreement.Refusal() as refusal:
            bound = self.signature.bind(*args, **kwargs).arguments
            tokens, positions, documents = (bound.get(name) for name in ("tokens", "positions", "documents"))
            self._check(module, topo, tokens, positions, documents)
        batch = batch_code(tokens) if refusal.error is None else -1
        first = not self.first_compared
        weights = agreement.readable(lambda: weights_code(module)) if first else -2
        mode = agreement.Text("train" if module.training else "eval")
        refusal.join(lambda: {SAME_BATCH: batch, SAME_MODEL: model_code(module) if first else -2,
                              SAME_WEIGHTS: weights, SAME_MODE: mode},
                     topo.process_groups, "forward", world_size=topo.world_size, where_known=(SAME_BATCH, SAME_WEIGHTS))
        self.first_compared = True
        if not self.watched and self.watching is None and not torch.compiler.is_compiling():
            self.watching = _AttentionOutsideAttentionFn(type(module).__name__)
            self.watching.__enter__()

    def after(self, module: nn.Module, args: tuple, output) -> None:
        """The forward's end, also where it raised (``always_call``): the watch ends, and is done
        once a forward completed."""
        if self.watching is not None:
            self.watching.__exit__(None, None, None)
            self.watched = output is not None and not self.watching.refused
            self.watching = None

    def _check(self, module: nn.Module, topo: topology.Topology, tokens, positions, documents) -> None:
        name, embed = type(module).__name__, _token_embedding(module)
        # a model embedding token ids holds an nn.Embedding; one of one's own may take other (B, T/P, ...) tokens
        ids = embed is not None
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2 or ids and tokens.dim() != 2:
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"{name} takes this rank's tokens as a (B, T/P{'' if ids else ', ...'}) tensor "
                             f"(shard_batch's batch.tokens; one row is (1, T/P)), got {got}")
        if ids and tokens.dtype not in (torch.int64, torch.int32):  # all nn.Embedding indexes with
            raise ValueError(f"{name} takes token ids as int64 or int32, got {tokens.dtype}; pass the integer ids "
                             f"(shard_batch gives them as int64)")
        if ids and tokens.device != embed.weight.device:
            raise ValueError(f"{name} got tokens on {tokens.device}, its embedding is on {embed.weight.device}; "
                             f"move the tokens there")
        rows, local = tokens.shape[:2]
        if positions is not None and (not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2) or (
                positions.shape[-1] != local or positions.dim() == 2 and positions.shape[0] not in (1, rows))):
            got = f"shape {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else \
                type(positions).__name__
            raise ValueError(f"{name} takes positions as a ({local},) or ({rows}, {local}) tensor for tokens "
                             f"{tuple(tokens.shape)} (shard_batch's batch.positions), got {got}")
        if isinstance(positions, torch.Tensor) and positions.device != tokens.device:
            raise ValueError(f"{name} got positions on {positions.device} and tokens on {tokens.device}; pass them "
                             f"on one device, as shard_batch gives them")
        placed = get_layout(self.layout, topo.world_size)  # a name, as ctxpar.attention takes it, or a Layout
        seq_len = tokens.shape[1] * topo.world_size
        lengths = None if documents is None else document_lengths(documents, seq_len)
        want = positions_in_documents(placed.positions(seq_len, topo.rank), lengths)  # (S,)
        where = " within each document" if lengths else ""
        holder = (f"CP rank {topo.rank} (ctxpar.hybrid_rank(mesh))" if topo.hybrid
                  else f"group rank {topo.rank} (dist.get_rank(group))")
        docs, batch_docs = (", documents=documents", ", documents=batch.documents") if lengths else ("", "")
        fix = (f"batch = shard_batch(tokens, layout=layout, rank={topo.rank}{docs}), then "
               f"model(batch.tokens, batch.positions{batch_docs})")
        if ids and not tokens.is_meta:  # meta: no values (attention refuses the device)
            limits.check_token_range(tokens, embed.num_embeddings, name)
        if positions is None:
            raise ValueError(f"{name} got no positions under context parallelism, so it would number this "
                             f"rank's tokens from 0; pass the global positions{where} of this rank, {holder}: {fix}")
        given = None if positions.is_meta else positions.reshape(-1, local).cpu()
        if given is not None and not bool((given == want).all()):
            wrong = given[(given != want).any(1)][0]
            raise ValueError(f"positions must be the global positions{where} of {holder} under the {placed.name} "
                             f"layout given to apply_context_parallel, got "
                             f"{positions_mismatch(wrong, want, topo.world_size)}: {fix}")


def _token_embedding(module: nn.Module) -> nn.Embedding | None:
    """The ``nn.Embedding`` that embeds ``module``'s tokens: its only one, whatever its name
    (``embed``, ``wte``), or among several the one it holds as ``embed`` (the reference
    model's name); looked up at each forward (a deep copy shares the guard). None where it
    holds none (its tokens are features) or several others (a position embedding beside
    the tokens': which one takes them is not known), so token ids go unchecked."""
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if len(embeddings) == 1:
        return embeddings[0]
    embed = getattr(module, "embed", None)
    return embed if isinstance(embed, nn.Embedding) else None


def cp_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, group: dist.ProcessGroup | None = None, mesh=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over tokens spread across the ranks of ``group``.

    Args:
        logits: (B, S, vocab) this rank's logits; labels: (B, S) integers, IGNORE_INDEX = skip.
        group: every rank holding part of the batch (CP, or DP x CP); None = WORLD.
        mesh: instead of ``group``, the 2D DeviceMesh of ``strategy="hybrid"``: its ranks.

    Returns:
        (share, loss): ``share`` = this rank's token-weighted loss sum / the global token
        count, differentiable; the shares of all ranks add up to the mean loss over the
        global batch, ``loss`` (detached, the same on every rank). Computed in float32, or
        in the logits' dtype where it is wider (float64). A batch whose every label is
        IGNORE_INDEX gives 0 and zero gradients, where a mean over no tokens is NaN (0/0).

    Labels that do not fit the logits on some rank (another shape, not integers, a value
    outside 0..vocab-1 other than IGNORE_INDEX: ``vocab``, or -1 meant as "ignore") are
    refused on every rank together, naming the rank and the values, by the all-reduce of the
    token count: raised on one rank alone (``cross_entropy``'s IndexError), they left the
    others waiting in it until the collective timeout. So are float64 logits on some ranks
    only (the loss's all-reduce in two widths aborted gloo). The verdict is read on the
    host: one device synchronisation per call.
    """
    ranks = topology.of(group, mesh, "cp_loss", " (a hybrid mesh's ranks)",
                        group_also=" (the mean over one CP group's tokens), or group=None (over every rank's: DP x CP)")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    tensor = isinstance(logits, torch.Tensor)  # logits that are none still join the verdict's all-reduce
    vocab = logits.shape[-1] if tensor and logits.dim() == 3 else 0
    fits = (tensor and isinstance(labels, torch.Tensor) and logits.dim() == 3 and labels.shape == logits.shape[:2]
            and labels.device == logits.device and not labels.is_floating_point() and not labels.is_complex()
            and labels.dtype != torch.bool)
    # count, then (ranks refusing, the sum of their ranks, of those whose labels do not fit, labels outside the
    # vocabulary, their lowest, their highest), then ranks computing in float64: summed over the ranks, each exact
    # where one rank refuses
    device = logits.device if tensor else comm.collective_device(ranks.process_groups[0])
    verdict = torch.zeros(8, dtype=torch.int64, device=device)
    width = torch.promote_types(logits.dtype, torch.float32) if tensor else None  # what the loss is computed in
    verdict[7] = width == torch.float64
    if fits:
        labels = labels.long()  # cross_entropy takes int64 class indices alone
    if not fits:
        verdict[1:4] = torch.tensor([1, rank, 1], device=verdict.device)
    elif labels.numel():
        outside = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))  # (B, S)
        refusing = outside.any().long()
        verdict[0] = (labels != IGNORE_INDEX).sum()  # int64: exact whatever the token count
        verdict[1:3] = refusing * torch.tensor([1, rank], device=logits.device)
        verdict[4] = outside.sum()
        verdict[5] = torch.where(outside, labels, torch.iinfo(torch.int64).max).min() * refusing
        verdict[6] = torch.where(outside, labels, torch.iinfo(torch.int64).min).max() * refusing
    own = verdict.clone()
    topology.all_reduce(verdict, ranks)
    own, summed = torch.stack([own, verdict]).tolist()  # one synchronisation
    count, refusing, culprit, unfit, wide = *summed[:4], summed[7]
    if not fits:
        got = type(labels).__name__
        if isinstance(labels, torch.Tensor):
            got = " ".join([str(tuple(labels.shape)), *([] if labels.dtype == torch.long else [str(labels.dtype)]),
                            *([] if tensor and labels.device == logits.device else [f"on {labels.device}"])])
        shape = tuple(logits.shape) if tensor else type(logits).__name__
        raise ValueError(f"logits must be a (B, S, vocab) tensor and labels (B, S) integers on its device, for the "
                         f"same tokens, got logits {shape} and labels {got} (rank {rank})")
    if own[1] or refusing == 1 and not unfit:  # this rank's values, or the one refusing rank's: named alike
        mine = own if own[1] else summed
        values = str(mine[5]) if mine[5] == mine[6] else f"{mine[5]} to {mine[6]}"
        others = f"; {refusing - 1} other rank(s) refused theirs too" if refusing > 1 else ""
        raise ValueError(f"labels hold {mine[4]} value(s) outside the vocabulary 0..{vocab - 1} of the logits "
                         f"({values}, on rank {mine[2]}); mark tokens without a label with {IGNORE_INDEX}, and take "
                         f"labels from the model's vocabulary{others}")
    if refusing == 1:
        raise ValueError(f"cp_loss: rank {culprit}'s labels do not fit its logits (another shape, not integers on "
                         f"their device, or logits that are no (B, S, vocab) tensor); see its error")
    if refusing:
        raise ValueError(f"cp_loss: {refusing} ranks refused their labels ({unfit} not fitting their logits, "
                         f"{refusing - unfit} with values outside the vocabulary 0..{vocab - 1}); see their errors")
    if 0 < wide < ranks.world_size:
        here = "float64" if width == torch.float64 else str(logits.dtype).removeprefix("torch.")
        raise ValueError(f"cp_loss: the logits are float64 on {wide} of the {ranks.world_size} ranks and narrower on "
                         f"the others ({here} on rank {rank}), so the loss would be summed in two widths; give every "
                         f"rank logits of one dtype")
    total = F.cross_entropy(logits.flatten(0, 1).to(width),
                            labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    share = total / max(count, 1)
    loss = share.detach().clone()
    topology.all_reduce(loss, ranks)
    return share, loss
