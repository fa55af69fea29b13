"""Hugging Face transformers: run a transformers model's attention through ctxpar.

    from ctxpar.integrations.transformers import enable_context_parallel, shard_inputs

    model = LlamaForCausalLM(config)                      # any model using AttentionInterface
    enable_context_parallel(model, layout=layout, group=cp_group, strategy="ring")
    inputs, labels = shard_inputs(input_ids, layout=layout, rank=cp_rank)
    out = model(**inputs, labels=labels)                  # out.logits: (B, T/P, vocab), this rank's rows
    out.loss.backward()                                   # value: global mean loss; gradient: this rank's share

    # a packed row: three documents of 5, 7 and 4 tokens (lengths, or cu_seqlens 0 5 12 16)
    inputs, labels = shard_inputs(input_ids, layout=layout, rank=cp_rank, documents=[5, 7, 4])
    out = model(**inputs, labels=labels)                  # inputs carries documents=; positions restart per document

``enable_context_parallel`` first runs the fidelity guard (``fidelity.py``): anything in
the model that ctxpar would compute differently (soft-capping, attention dropout,
recurrent or convolutional layers, attention outside transformers' AttentionInterface,
...) is refused with one error listing each feature, before any forward and any
collective. Sliding windows (Mistral, Qwen2, Gemma 3, gpt-oss), chunked attention (Llama
4) and attention sinks (gpt-oss) are honoured exactly, layer by layer. It then registers
an attention function named "ctxpar" with transformers' ``AttentionInterface`` and a mask
function of the same name with its ``AttentionMaskInterface`` (``attention.py``); at call
time these refuse padding masks, custom masks, per-shard packing arguments and any
keyword argument they do not know, rather than drop them.

``shard_inputs`` passes global ``position_ids`` (RoPE) and shifts labels before sharding;
the model's own ``labels=`` loss is replaced (``loss.py``) so that it does not shift again
and weighs tokens globally. A packed row is declared with ``documents=`` (the whole row's
document lengths or cu_seqlens, the same on every rank): ``shard_inputs`` then numbers
positions from 0 in each document and puts ``documents`` into the inputs, and
``model(..., documents=...)`` makes every attention layer of that forward see only its
own document (the model itself never receives the argument). Position ids that restart
without declared documents are refused. What the forward refuses (positions, a padding
mask, logits_to_keep, an attention implementation switched after enabling, shards of
different batches, ...) is agreed by one all-reduce, so every rank refuses together; the
decoder called on its own (``model.model(...)``) is checked alike.

``model.generate(input_ids, ...)`` with the whole prompt on every rank gives every rank
the tokens generate gives without CP, greedy or sampled (``generation.py``: a sharded
KV cache, the prompt prefilled over the layout, decode steps merged across ranks); what
it cannot honour (beam search, assisted decoding, a cache passed in, padding, ...) is
refused on every rank before any collective.

    torch.manual_seed(0)                                   # sampling: seed every rank alike
    out = model.generate(input_ids, max_new_tokens=32)     # (B, T + 32), the same on every rank

``ContextParallelTrainer`` is transformers' ``Trainer`` for an enabled model (``trainer.py``):
every rank of a CP group gets the same whole batch, sharded in its ``compute_loss``, and it
trains what ``Trainer`` trains without CP.
"""

from __future__ import annotations

import copy
import functools
import inspect
import reprlib

import torch
import torch.distributed as dist

from ctxpar.integrations.transformers.attention import (
    CHECKED,
    DOCUMENTS,
    ENABLED_CONFIGS,
    FEATURE_KWARGS,
    NAME,
    PADDING_REFUSED,
    Settings,
    attention_forward,
    check_implementation,
    check_rope_lengths,
    installed,
    mask_forward,
)
from ctxpar.integrations.transformers.fidelity import (POOL_WHERE_HELD, Unsupported, check_model, check_no_layerdrop,
                                                       dynamic_rope_limits, find_unsupported, longrope_limits)
from ctxpar.integrations.transformers.generation import (CACHE_KEYS, GENERATE_PADDING_REFUSED, ShardedCache,
                                                         cached_forward, check_token_ids, wrap_generate)
from ctxpar.integrations.transformers.loss import (CAUSAL_LM_LOSSES, LOSS_KEYWORDS, CPCausalLMLoss, head_loss,
                                                   loss_refusal)
from ctxpar.integrations.transformers.moe import global_aux_loss
from ctxpar import agreement, limits, topology
from ctxpar.attention import check_settings
from ctxpar.layout import Layout, positions_mismatch
from ctxpar.masks import document_lengths, positions_in_documents
from ctxpar.parallelize import IGNORE_INDEX, batch_code, model_code, pickling_refused, shard_batch, weights_code

__all__ = ["ContextParallelTrainer", "ShardedCache", "Unsupported", "check_model", "enable_context_parallel",
           "find_unsupported", "shard_inputs"]


def __getattr__(name: str):
    if name == "ContextParallelTrainer":  # transformers' Trainer (and accelerate) imported only when asked for
        from ctxpar.integrations.transformers.trainer import ContextParallelTrainer

        return ContextParallelTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_forward)


def _declare_fix() -> str:
    return ("for a packed row, declare its documents: shard_inputs(..., documents=lengths) numbers positions per "
            "document and passes documents= to the model")


def _tokens(bound: dict) -> torch.Tensor | None:
    """The forward's (B, S) input_ids, or its (B, S, C) inputs_embeds."""
    tokens = bound.get("input_ids")
    return bound.get("inputs_embeds") if tokens is None else tokens


def _check_positions(name: str, settings: Settings, bound: dict, documents: tuple[int, ...] | None) -> None:
    """position_ids must be this rank's global layout positions, counted from the start of
    each declared document: RoPE reads them, and so does transformers' mask code (which
    ctxpar's mask replaces). Restarting positions without declared documents are refused:
    transformers would read them as packing of this shard alone. LongRoPE's choice of
    factors, which reads the largest position, must be the whole sequence's on every rank
    (with documents, the packed row's: every document takes the factors of the row's
    largest position, as transformers' forward of the packed row does)."""
    tokens = _tokens(bound)
    if tokens is None:
        if documents is not None:
            raise ValueError(f"{name} got documents= but neither input_ids nor inputs_embeds")
        return
    check_rope_lengths(name, settings, tokens.shape[1] * settings.layout.world_size, documents)
    want = positions_in_documents(settings.positions(tokens.shape[1]), documents)  # (S,)
    positions = bound.get("position_ids")
    if positions is None:
        if not torch.equal(want, torch.arange(tokens.shape[1])):
            raise ValueError(f"{name} got no position_ids, so it would number this rank's tokens from 0; pass the "
                             f"global positions{' within each document' if documents else ''} (shard_inputs does; an "
                             f"adapter that drops them to prepend virtual tokens to each shard, PEFT's prompt "
                             f"tuning, is not supported under context parallelism)")
        return
    if positions.shape[-1] != want.numel():
        raise ValueError(f"position_ids of shape {tuple(positions.shape)} for this rank's {want.numel()} tokens: pass "
                         f"its global positions, one per token (shard_inputs does)")
    rows = positions.reshape(-1, want.numel()).cpu()
    if not bool((rows == want).all()):
        wrong = int((rows != want).any(1).nonzero()[0, 0])
        given, name_row = rows[wrong], f"position_ids (row {wrong})" if rows.shape[0] > 1 else "position_ids"
        if documents is None and bool((given.diff() > 0).all()):  # ascending: another layout's, or none's
            # or a packed row's, restarting on another rank: that rank says so, this one may not see it
            behind = bool((given <= want).all())
            raise ValueError(f"{name_row} must be this rank's positions under the {settings.layout.name} layout "
                             f"enable_context_parallel was given, got "
                             f"{positions_mismatch(given, want, settings.layout.world_size)}; shard the batch with "
                             f"shard_inputs(..., layout=) that layout"
                             + (f" (or, where they restart at packed documents, {_declare_fix()})" if behind else ""))
        if documents is None:
            raise ValueError(f"{name_row} must be this rank's global layout positions (use shard_inputs); "
                             f"positions that restart mean packed documents, which ctxpar cannot infer from one "
                             f"shard: {_declare_fix()}")
        raise ValueError(f"{name_row} must be this rank's global layout positions counted from the start of "
                         f"each declared document {list(documents)[:8]} (use shard_inputs(..., documents=...))")


def _check_call(name: str, bound: dict, extra: dict, *, mask_lengths: tuple[int, ...] = (),
                cached: bool = False) -> None:
    """Refuse in the forward, where every rank's verdict is agreed (``_refuse_together``, or
    the cached forward's own exchange), what a layer or the LM head would get wrong on one
    shard: a padding or custom mask (after sharding, a left-padded row's zeros sit on one
    rank only), question answering's start_positions / end_positions (global indices, where
    a rank's logits cover its shard) and logits_to_keep (a shard's last rows are not the
    sequence's last positions). ``cached``: a forward over ctxpar's ``ShardedCache``, which
    returns the logits of the sequence's last position, so logits_to_keep=1 (generate's) is
    what it does. ``mask_lengths``: the lengths an all-ones 2-D attention_mask may have (a
    shorter one reads to transformers as padding past its end, a longer one as another
    sequence's)."""
    mask = bound.get("attention_mask", extra.get("attention_mask"))
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            shown = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"{name} got an explicit attention mask {shown}; under context parallelism the mask "
                             f"follows the layout (and the declared documents), and custom or padding masks are "
                             f"refused")
        if not bool(mask.all()):
            raise ValueError(f"{name}: {GENERATE_PADDING_REFUSED if cached else PADDING_REFUSED}")
        rows = _tokens(bound)
        if mask_lengths and (mask.shape[1] not in mask_lengths or rows is not None and mask.shape[0] != rows.shape[0]):
            # ignored here, it once ran unmasked where the model without CP masks the keys past its end
            said = " or ".join(map(str, sorted(set(mask_lengths))))
            raise ValueError(f"{name} got an attention_mask of shape {tuple(mask.shape)}, for {said} tokens in each "
                             f"of {rows.shape[0] if rows is not None else 'the'} rows; "
                             + ("pass the mask of the whole sequence so far (the cached tokens and these), or none"
                                if cached else "pass this rank's shard of an all-ones mask, or none"))
    types, ids = bound.get("token_type_ids", extra.get("token_type_ids")), bound.get("input_ids")
    if isinstance(types, torch.Tensor) and isinstance(ids, torch.Tensor) and types.shape[-1:] != ids.shape[-1:]:
        # the whole batch's beside a shard's ids: (2, 8) logits for one (1, 8) row, or torch's broadcast error
        raise ValueError(f"{name} got token_type_ids {tuple(types.shape)} for input_ids {tuple(ids.shape)}: pass this "
                         f"rank's shard, as shard_inputs(input_ids, token_type_ids=..., ...) returns it")
    for key in ("start_positions", "end_positions"):
        if bound.get(key, extra.get(key)) is not None:
            raise ValueError(f"{name} got {key}=: they index the whole sequence, while under context parallelism a "
                             f"rank's start_logits and end_logits cover its shard's positions only, so its loss "
                             f"would score other positions; leave them out and compute the loss on the whole "
                             f"sequence's logits (all-gather start_logits and end_logits over the CP group, then "
                             f"layout.unshard(pieces, dim=1))")
    if bound.get("output_attentions", extra.get("output_attentions")):  # refused by each layer alone, it left the
        # ranks without it waiting in attention
        raise ValueError(f"{name} asks for {FEATURE_KWARGS['output_attentions']}, which ctxpar cannot compute under "
                         f"context parallelism; it refuses rather than ignore it")
    for key in ("logits_to_keep", "num_logits_to_keep"):
        keep = bound.get(key, extra.get(key))
        if isinstance(keep, torch.Tensor) or keep not in ((None, 0, 1) if cached else (None, 0)):
            shown = f"a tensor {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else repr(keep)
            if cached:
                raise ValueError(f"{name} got {key}={shown} with ctxpar's sharded cache, whose forwards return the "
                                 f"logits of the sequence's last position only; leave it out or pass 1")
            raise ValueError(f"{name} got {key}={shown}: it keeps rows of this rank's shard, and under context "
                             f"parallelism a shard's last rows are not the sequence's last positions; leave it out "
                             f"(0 keeps every row) and pick rows by their global positions (the position_ids "
                             f"shard_inputs returns), or call model.generate(), which keeps the right row itself")


def _label_flags(labels: torch.Tensor | None, input_ids: torch.Tensor | None, settings: Settings) -> list[int]:
    """[labels given, labels equal to input_ids wherever labelled, the sequence's last position
    labelled here, input_ids given] for this rank. The labels ``shard_inputs`` returns are
    shifted on the unsplit sequence, so that last position holds IGNORE_INDEX; unshifted
    labels (``labels=input_ids``, or a copy with the prompt masked as supervised fine-tuning
    makes it) equal the tokens wherever they label, and label it unless it is masked too
    (``_refuse_unshifted`` tells those apart)."""
    if labels is None:
        return [0, 0, 0, 0]
    labels = labels.cpu()
    labelled = labels != IGNORE_INDEX
    last = settings.positions(labels.shape[1]) == labels.shape[1] * settings.layout.world_size - 1
    # inputs_embeds: no ids to compare, labelling the last token alone says unshifted (they ran, the loss of
    # each token predicting itself)
    matches = input_ids is None or bool((labels == input_ids.cpu())[labelled].all())
    return [1, int(matches), int(bool(labelled[:, last].any())), int(input_ids is not None)]


def _unshifted(name: str, why: str) -> ValueError:
    return ValueError(f"{name} got labels that {why}: unshifted labels (labels=input_ids, or a copy with the prompt "
                      f"masked), which would score each token on predicting itself. Pass the labels shard_inputs "
                      f"returns (shard_inputs(input_ids, labels=your_labels, ...) shifts them on the unsplit "
                      f"sequence), or compute the loss with ctxpar.parallelize.cp_loss")


def _refuse_unshifted(name: str, labels: torch.Tensor, input_ids: torch.Tensor, settings: Settings) -> None:
    """Labels equal to input_ids wherever they label, on every rank, that leave the sequence's
    last token unlabelled (a supervised fine-tuning copy with its last token masked too):
    shifted labels equal the tokens so only over a run of repeated tokens, where each also
    equals the next token. The whole rows are gathered (this case alone, rare in training)
    to tell: a label that differs from the next token cannot be a next-token label."""
    ids = input_ids.long()
    pieces = topology.all_gather(torch.stack([labels.to(ids.device, torch.long), ids]), settings.peers())
    labels, ids = settings.layout.unshard(list(pieces), dim=2)  # (B, T) each
    differs = (labels[:, :-1] != ids[:, 1:]) & (labels[:, :-1] != IGNORE_INDEX)
    if bool(differs.any()):
        row, position = differs.nonzero()[0].tolist()
        raise _unshifted(name, f"equal its input_ids wherever they label a token, where next-token labels would "
                               f"hold the following token (row {row}, position {position}: label "
                               f"{int(labels[row, position])}, next token {int(ids[row, position + 1])})")


def _check_label_range(name: str, model, labels: torch.Tensor) -> None:
    """Refuse labels outside the LM head's vocabulary besides IGNORE_INDEX: cross_entropy's
    IndexError on the rank whose shard held one left the others waiting in the loss's
    all-reduce."""
    head = model.get_output_embeddings()
    classes = getattr(head, "out_features", getattr(head, "num_embeddings", None))
    if isinstance(classes, int):
        limits.check_token_range(labels[labels != IGNORE_INDEX], classes, f"{name} labels=",
                                 f" (besides {IGNORE_INDEX}, which marks a token without a label)")


def _refuse_together(name: str, error: Exception | None, label_flags: list[int], batch: int, model: int,
                     weights: int, device: torch.device, peers: topology.Topology, routed: bool,
                     training: bool) -> bool:
    """One tiny all-reduce, so that every rank refuses a forward if any rank does (a refusal
    on some ranks only would leave the others waiting in attention): this rank's own error
    (declared documents, positions, caches, labels), labels= given on some ranks only (the
    others would not join the loss's all-reduce), unshifted labels (``_label_flags``),
    output_router_logits on some ranks only (``routed``: the router loss is made the
    sequence's after the forward, with every rank), shards of different batches
    (``batch``: ``batch_code``'s checksum, -1 if unknown), and models of other configs
    (``model``: ``model_code``'s) or weights (``weights``: ``weights_code``'s), at the first
    forward (-2 after it), and ``training`` mode on some ranks only (dropout on some shards:
    silently neither the eval loss nor a train step's).
    True when the labels equal input_ids wherever they label on every rank but label no
    last token: ``_refuse_unshifted`` decides those."""
    known = int(batch >= 0)
    code = batch if known else 0
    model, weights = model & 0xFFFFFF, weights & 0xFFFFFF  # sums_of's 24 bits
    flags = torch.tensor([int(error is not None), *label_flags, int(routed), int(training), known,
                          *agreement.sums_of(code), *agreement.sums_of(model), *agreement.sums_of(weights)],
                         device=device)
    topology.all_reduce(flags, peers)
    refused, given, matching, last_labelled, with_ids, routing, trained, knowing, *summed = flags.tolist()
    summed, models, weighed = summed[:3], summed[3:6], summed[6:]
    ranks = summed[-1]
    if error is not None:
        raise error
    if refused:
        raise ValueError(f"{name}: another rank of the CP group refused its inputs for this forward; see its error")
    if agreement.differ(model, models):
        raise ValueError(f"{name} has another config on some rank of the CP group (its fields but where it was "
                         f"loaded from and its dtype): load or build the same model on every rank")
    if agreement.differ(weights, weighed):
        raise ValueError(f"{name} has other weights on some rank of the CP group (the first values of its "
                         f"parameters differ): seed ranks apart only after building the model, or load the same "
                         f"weights on every rank")
    if knowing == ranks and agreement.differ(code, summed):
        raise ValueError(f"{name} got shards of different batches on the ranks of the CP group (or of one batch "
                         f"with other labels or documents): each CP rank must pass the same whole batch to "
                         f"shard_inputs (sample data by data-parallel rank, not by global rank: a "
                         f"DistributedSampler over every rank gives each CP rank another batch)")
    if 0 < trained < ranks:
        raise ValueError(f"{name} is in training mode on {trained} of the {ranks} ranks of the CP group and in eval "
                         f"mode on the others: dropout and other training-only behaviour would act on some ranks' "
                         f"shards only; call model.train() or model.eval() on every rank")
    if 0 < routing < ranks:  # the router loss made exact after the forward needs every rank
        raise ValueError(f"{name} got output_router_logits=True on {routing} of the {ranks} ranks of the CP group; "
                         f"pass the same on every rank")
    if 0 < given < ranks:
        raise ValueError(f"{name} got labels= on {given} of the {ranks} ranks of the CP group; pass them on every "
                         f"rank or on none")
    if given and matching == ranks and last_labelled:
        raise _unshifted(name, "label the sequence's last token, which next-token labels never do, and equal its "
                               "input_ids wherever they label a token (where input_ids are given)")
    return bool(given and matching == ranks and with_ids == ranks)


def _documents(name: str, settings: Settings, bound: dict, documents) -> tuple[int, ...] | None:
    """The declared documents as lengths over the whole row (None for one document)."""
    tokens = _tokens(bound)
    if tokens is None:
        raise ValueError(f"{name} got documents= but neither input_ids nor inputs_embeds")
    lengths = document_lengths(documents, tokens.shape[1] * settings.layout.world_size)
    return None if len(lengths) == 1 else lengths


def _router_logits_asked(model, bound: dict, extra: dict) -> bool:
    """Whether a forward returns a MoE's router logits (and its aux_loss): asked in the call,
    else by the config."""
    asked = bound.get("output_router_logits", extra.get("output_router_logits"))
    return bool(getattr(model.config, "output_router_logits", False) if asked is None else asked)


def _wrap_forward(model, settings: Settings, loss: CPCausalLMLoss | None = None) -> None:
    """Refuse, before the forward and on every rank together, what the model would do wrong
    with its inputs (positions, masks, caches, labels, logits_to_keep) or with an attention
    implementation switched after ``enable_context_parallel``; and after it, a labels= loss
    that did not go through ``loss`` (a model computing its own). ``loss`` None: a sub-model
    (the decoder under the LM head), checked alike when called on its own and run unchecked
    inside a checked forward (``CHECKED``). A forward of the model over ctxpar's
    ``ShardedCache`` (generate's) goes to ``cached_forward``."""
    from transformers import PreTrainedModel

    forward = model.__dict__.get("_ctxpar_inner_forward", model.forward)
    model._ctxpar_inner_forward = forward
    signature = inspect.signature(forward)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    name = type(model).__name__
    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]

    if "documents" in signature.parameters:
        raise ValueError(f"{name}.forward takes its own documents= argument, which ctxpar's documents= would shadow")
    returns_dict = "return_dict" in signature.parameters or var_kw is not None
    compared = False  # the config and weights, at the first forward every rank agreed on

    def checked(args, kwargs, documents):
        nonlocal compared
        bound = signature.bind_partial(*args, **kwargs).arguments
        extra = bound.get(var_kw, {}) if var_kw else {}
        caches = {key: bound.get(key, extra.get(key)) for key in CACHE_KEYS}
        sharded = [c for c in caches.values() if isinstance(c, ShardedCache)]
        if sharded and documents is None and loss is not None:
            # what the forward below refuses, refused alike over the cache (every rank together in cached_forward)
            with agreement.Refusal() as held:
                check_implementation(name, models)
                rows = _tokens(bound)
                _check_call(name, bound, extra, cached=True,
                            mask_lengths=() if rows is None else (sharded[0].get_seq_length() + rows.shape[1],))
                check_token_ids(name, model, bound.get("input_ids"))
                if _router_logits_asked(model, bound, extra) and not sharded[0].made_by_generate:
                    raise ValueError(f"{name} got output_router_logits=True (in the call or its config) with "
                                     f"ctxpar's sharded cache, whose prefill routes each rank's share of the prompt: "
                                     f"its router logits and aux_loss would be that share's; pass "
                                     f"output_router_logits=False (generate, which reads neither, runs either way)")
            call = {k: v for k, v in bound.items() if k != var_kw}
            return cached_forward(forward, {**call, **extra}, name=name, settings=settings, cache=sharded[0],
                                  accepts=signature.parameters, refusal=held.error,
                                  model=-2 if sharded[0].get_seq_length() else model_code(model))  # at the prefill
        labels = bound.get("labels")
        peers = settings.peers()  # enable_context_parallel saw this rank in them
        with agreement.Refusal() as held:  # this rank's refusal joins the exchange below
            check_implementation(name, models)
            for key, cache in caches.items():
                if cache is not None:
                    raise ValueError(f"{name} got {key}={type(cache).__name__}: under context parallelism a "
                                     f"forward takes no KV cache but the one model.generate() builds (ctxpar's "
                                     f"ShardedCache, for the model enable_context_parallel was applied to), and "
                                     f"documents= do not go with it")
            rows = _tokens(bound)
            # this rank's shard, or the whole sequence's (all ones: one layout's positions are as good as another's)
            _check_call(name, bound, extra, mask_lengths=() if rows is None else (
                rows.shape[1], rows.shape[1] * settings.layout.world_size))
            check_token_ids(name, model, bound.get("input_ids"))
            if labels is not None and head_loss(model) not in CAUSAL_LM_LOSSES:
                raise ValueError(f"{name} got labels=, which under context parallelism are shard_inputs' labels, "
                                 f"shifted for next-token prediction, while its head ({head_loss(model)}) scores each "
                                 f"token against its own label; compute the loss from the logits: "
                                 f"ctxpar.parallelize.cp_loss(model(**inputs).logits, layout.shard(labels, rank, "
                                 f"dim=1), group=...)")
            if labels is not None and rows is not None:  # what the loss would refuse, refused together
                passed = {**extra, **bound}
                refusal = loss_refusal(labels, tuple(rows.shape[:2]),
                                       **{key: passed[key] for key in LOSS_KEYWORDS if key in passed})
                if refusal is not None:
                    raise ValueError(f"{name}: {refusal}")
                _check_label_range(name, model, labels)
            if documents is not None:
                documents = _documents(name, settings, bound, documents)
            _check_positions(name, settings, bound, documents)
            if model.training:
                check_no_layerdrop(name, model)
        error = held.error
        tokens = bound.get("input_ids")
        device = (tokens if tokens is not None else model.get_input_embeddings().weight).device
        flags = [int(labels is not None), 0, 0, 0] if error is not None else _label_flags(labels, tokens, settings)
        batch = batch_code(tokens) if error is None else -1
        code, weights = (-2, -2) if compared else (model_code(model), agreement.readable(lambda: weights_code(model)))
        if _refuse_together(name, error, flags, batch, code, weights, device, peers,
                            _router_logits_asked(model, bound, extra), training=model.training):
            _refuse_unshifted(name, labels, tokens, settings)
        compared = True
        # a tuple would hide the outputs checked below: asked for as a ModelOutput, given back as the tuple
        given = bound.get("return_dict", extra.get("return_dict"))
        as_tuple = returns_dict and ("return_dict" in kwargs or given is None) and (  # not passed by position
            given is False or given is None and getattr(model.config, "return_dict", True) is False)
        if as_tuple:
            kwargs = dict(kwargs, return_dict=True)
        calls = loss.calls if loss is not None else 0
        declared = DOCUMENTS.set(documents)
        try:
            out = forward(*args, **kwargs)
        finally:
            DOCUMENTS.reset(declared)
        if labels is not None and loss is not None and loss.calls == calls:
            raise ValueError(f"{name} computes its labels= loss without transformers' loss_function, so it would "
                             f"shift the already shifted labels and average per rank; call it without labels= and "
                             f"use ctxpar.parallelize.cp_loss(out.logits, labels)")
        # a pooler computed inline (CLIP's text model pools at the largest token id), which its config and
        # modules do not give away before the forward; every rank alike: the same model and arguments
        if getattr(out, "pooler_output", None) is not None:
            raise ValueError(f"{name} returned pooler_output, computed from this rank's shard alone though it stands "
                             f"for the whole sequence; run the model without its pooler and {POOL_WHERE_HELD}")
        if getattr(out, "aux_loss", None) is not None:  # on every rank alike: output_router_logits was agreed
            global_aux_loss(name, model, out, peers, loss.last if labels is not None and loss is not None else None)
        return out.to_tuple() if as_tuple and hasattr(out, "to_tuple") else out

    @installed
    @functools.wraps(forward)
    def cp_forward(*args, documents=None, **kwargs):
        if CHECKED.get() and documents is None:  # a sub-model inside a forward checked as a whole
            return forward(*args, **kwargs)
        inside = CHECKED.set(True)
        try:
            return checked(args, kwargs, documents)
        finally:
            CHECKED.reset(inside)

    model.forward = cp_forward


def enable_context_parallel(
    model, *, layout: str | Layout, group: dist.ProcessGroup | None = None, strategy: str = "ring", mesh=None
):
    """Make ``model`` (a transformers PreTrainedModel) attend with ctxpar; returns it, changed in place.

    ``model(**shard_inputs(...)[0])`` then runs on this rank's shard, and
    ``model.generate(input_ids, ...)`` on the whole prompt (the same on every rank) gives
    the tokens of generation without CP (``generation.py``; any strategy, hybrid on its mesh).

    Args:
        model: a transformers model whose attention goes through ``AttentionInterface``.
        layout: the ``Layout`` its inputs were sharded with (``shard_inputs``), or its name
            (``"zigzag"``: built for the group's size).
        group: the CP process group (default WORLD); the ``labels=`` loss is averaged over
            the tokens of its ranks. ``mesh``: for ``strategy="hybrid"``, the CP group then
            (a forward's checks and loss run on its ranks alone, not on the rest of WORLD).
        strategy: ``"ring" | "allgather" | "alltoall" | "hybrid" | "auto"``, as in
            ``ctxpar.attention`` ("auto": the planner picks per attention call).

    Raises:
        ValueError: listing every feature of the model that ctxpar would not compute exactly
            (``find_unsupported``), before changing the model and before any collective.
    """
    layout = check_settings(layout=layout, group=group, strategy=strategy, mesh=mesh,  # a name, or one for this P
                            who="enable_context_parallel")
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):  # a wrapper (PEFT-like) was refused for positions it does hand on
        raise ValueError(f"enable_context_parallel takes a transformers PreTrainedModel, got {type(model).__name__}; "
                         f"enable the model inside it first, then wrap it")
    check_model(model)
    _register()
    settings = Settings(layout, group, strategy, mesh, longrope=longrope_limits(model),
                        dynamic=dynamic_rope_limits(model))
    for module in model.modules():  # attention_forward finds its settings on the module that calls it
        module.ctxpar_settings = settings
        if getattr(module, "config", None) is not None:
            ENABLED_CONFIGS[id(module.config)] = settings
    model.set_attn_implementation(NAME)
    stale = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, PreTrainedModel) and m.config._attn_implementation != NAME})
    if stale:
        raise ValueError(f"transformers kept another attention implementation for {', '.join(stale)}; ctxpar "
                         f"cannot run this model")
    loss = CPCausalLMLoss(group, mesh)
    model.loss_function = loss
    for sub in model.modules():  # the decoder called on its own (model.model(...)) is checked too
        if isinstance(sub, PreTrainedModel) and sub is not model:
            _wrap_forward(sub, settings)
    _wrap_forward(model, settings, loss)
    wrap_generate(model, settings)
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            _copy_enabled_alike(sub, settings)
    return model


# The instance attributes enable_context_parallel may set on a model's modules, besides the
# inner forward: a deep copy's own copy of it is bound to the copy
_INSTALLED_ATTRIBUTES = ("forward", "generate", "_prepare_cache_for_generation", "_get_stopping_criteria",
                         "_get_logits_processor", "_loss_function", "ctxpar_settings", "__deepcopy__", "__reduce_ex__")


def _installed_by_ctxpar(value) -> bool:
    return getattr(value, "ctxpar_installed", False) or isinstance(value, (Settings, CPCausalLMLoss))


def _copy_enabled_alike(model, settings: Settings) -> None:
    """Make ``copy.deepcopy(model)`` (a frozen reference model, an EMA copy) a copy with the
    same layout, group and strategy that runs its own weights. The wrappers close over the
    original model, so a plain deep copy ran the original's weights and sent the gradients
    there; they are left out of the copy and made anew for it, and the copy shares the
    process group (which cannot be copied)."""
    @installed
    def deepcopy(memo: dict):
        held = [(module, {key: module.__dict__.pop(key) for key in _INSTALLED_ATTRIBUTES
                          if _installed_by_ctxpar(module.__dict__.get(key))})
                for module in model.modules()]
        try:
            copied = copy.deepcopy(model, memo)
        finally:
            for module, attributes in held:
                module.__dict__.update(attributes)
        return enable_context_parallel(copied, **settings.split)

    @installed
    def reduce_ex(protocol: int):  # pickle (torch.save(model)) and copy.copy find it on the instance
        raise pickling_refused(type(model).__name__, "model.state_dict() or model.save_pretrained(...) and enable "
                                                     "the model you load again")

    model.__deepcopy__ = deepcopy
    model.__reduce_ex__ = reduce_ex


def shard_inputs(
    input_ids: torch.Tensor, *, layout: Layout, rank: int, labels: torch.Tensor | None = None, documents=None,
    token_type_ids: torch.Tensor | None = None,
) -> tuple[dict, torch.Tensor]:
    """This rank's model inputs (input_ids, position_ids, use_cache=False, and documents and
    token_type_ids when given) and its shifted labels.

    Args:
        input_ids: (B, T) the unsplit batch. labels: (B, T) unshifted, default input_ids.
        token_type_ids: (B, T) the unsplit batch's segment ids (GPT-2, BERT-style models), sharded
            as input_ids are.
        documents: the documents packed into each row (every row alike): their lengths
            summing to T, or cu_seqlens (0, ..., T). Positions then restart at 0 in each
            document, a token predicts nothing across a document boundary (its label is
            IGNORE_INDEX), and ``documents`` joins the inputs, so that ``model(**inputs)``
            attends within documents. The same on every rank.

    Returns:
        (inputs, labels): ``model(**inputs)`` gives this rank's logits (B, T/P, vocab);
        ``labels`` (B, T/P) are the next-token targets of those rows (IGNORE_INDEX where
        none), for ``model(**inputs, labels=labels)`` or ``cp_loss(logits, labels)``.
    """
    batch = shard_batch(input_ids, layout=layout, rank=rank, labels=labels, documents=documents)
    positions = batch.positions.unsqueeze(0).expand(input_ids.shape[0], -1)
    inputs = dict(input_ids=batch.tokens, position_ids=positions, use_cache=False)
    if batch.documents is not None:
        inputs["documents"] = batch.documents
    if token_type_ids is not None:
        if not isinstance(token_type_ids, torch.Tensor) or token_type_ids.shape != input_ids.shape:
            got = tuple(token_type_ids.shape) if isinstance(token_type_ids, torch.Tensor) else token_type_ids
            raise ValueError(f"token_type_ids must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{reprlib.repr(got)}")
        inputs["token_type_ids"] = layout.shard(token_type_ids, rank, dim=1)
    return inputs, batch.labels
