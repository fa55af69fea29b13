"""Runs inside spawned gloo ranks: transformers models under CP vs the unsplit model.

One spawn of 4 ranks (``results()``) serves test_transformers.py, test_hf_fidelity.py and
test_hf_generate.py:

- ``llama``: a tiny LlamaForCausalLM, every layout x strategy combination in COMBOS,
  loss from ``cp_loss``: logits, loss and parameter gradients against the unsplit model.
- ``labels``: the model's own ``labels=`` loss under CP for a representative subset of
  families (LABEL_CASES), with unevenly ignored labels: ``out.loss`` against the unsplit
  model's loss on every rank, and the rank-summed gradients against its gradients.
- ``sweep``: every case of ``hf_families.CASES`` on two CP groups of 2 ranks (ranks 0-1
  and 2-3 take every other case): refused by ``enable_context_parallel`` (the message), or
  the CP logits against the unsplit eager model's.
- ``masks``: the families whose masks ctxpar honours (MASK_CASES: sliding windows, mixed
  sliding / global layers, sinks, chunks) for every layout x strategy in MASK_COMBOS, on
  the same two groups: logits, the labels= loss and rank-summed gradients (the sinks'
  among them) against the unsplit eager model, and how much the window / chunks change
  the unsplit logits (so that they bite).
- ``packed``: PACKED_CASES on a row of documents PACKED_DOCUMENTS under zigzag: logits,
  loss and gradients against the unsplit eager model given the per-document positions
  (transformers' packed-sequence mask; not for IGNORES_PACKING), and the logits against
  each document run alone.
- ``guards``: on the same two groups, what a forward must run exactly or refuse on every
  rank together: LongRoPE (``hf_families``' ``phi3+longrope``) per layout, the decoder
  called alone, ``logits_to_keep``, a padding mask on one rank only, an attention
  implementation switched after ``enable_context_parallel`` on one rank only, a label outside
  the vocabulary on one rank's shard; per-token heads (token classification, question
  answering) against the unsplit model, and question answering's start_positions (``_heads``).
- ``hybrid``: ``strategy="hybrid"`` on a mesh of every rank, and on two data-parallel
  replicas each a mesh of its own (``_hybrid``).
- ``generate``: ``model.generate()`` on CP groups of 2, 3 and 4 ranks (``hf_generate_cases``,
  asserted by test_hf_generate.py).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import ctxpar
import spawned
from ctxpar.integrations.transformers import enable_context_parallel, shard_inputs
from ctxpar.parallelize import IGNORE_INDEX, cp_loss, shift_labels
from hf_families import tiny_llama

COMBOS = [("zigzag", "ring"), ("striped", "allgather"), ("contiguous", "ring"), ("zigzag", "alltoall")]
# distinct attention set-ups: GQA + RoPE (Llama, Qwen2/3, Phi-3), Gemma's scaled embeddings,
# MLA with different K and V head dims (DeepSeek-V3), a non-default scale (Granite), MoE (Mixtral)
LABEL_CASES = ["llama", "qwen2", "qwen3", "gemma", "phi3", "deepseek_v3", "granite", "mixtral",
               # MoE with output_router_logits=True: the router's load-balancing loss joins the labels= loss
               "mixtral+router", "qwen2_moe+router", "olmoe+router", "jetmoe+router"]  # JetMoE: aux_loss_coef
SWEEP_P, SWEEP_TOKENS = 2, 16
MASK_CASES = ["mistral", "qwen2+sliding-layers", "gemma3_text", "gpt_oss", "llama4_text"]
MASK_COMBOS = [("zigzag", "ring"), ("contiguous", "allgather"), ("striped", "alltoall")]
PACKED_CASES = ["llama", "gemma3_text", "llama4_text", "gpt_oss"]
# gpt-oss builds its masks without position_ids, so unsplit transformers attends across the
# packed documents; under CP, with documents declared, it must equal each document alone.
IGNORES_PACKING = {"gpt_oss"}
PACKED_DOCUMENTS = (5, 7, 4)  # SWEEP_TOKENS in all; windows and chunks of 4 cut inside documents too

def results() -> list[dict]:
    """Every rank's results of ``run`` on 4 local gloo ranks, computed once per test session."""
    return spawned.results("hf")


def _gather(local: torch.Tensor, layout, group) -> torch.Tensor:
    """(B, T/P, ...) on each rank -> (B, T, ...) in sequence order."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.detach().contiguous(), group=group)
    return layout.unshard(pieces, dim=1)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                      for p in model.parameters()])


def _llama(rank: int, world: int) -> dict:
    torch.manual_seed(1)
    input_ids = torch.randint(0, 128, (2, 16 * world))
    reference = tiny_llama()
    reference.set_attn_implementation("sdpa")
    logits = reference(input_ids, use_cache=False).logits  # (B, T, vocab), unsplit, on every rank
    ref_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels(input_ids).flatten(),
                                                 ignore_index=IGNORE_INDEX)
    ref_loss.backward()
    want = _grads(reference)
    out = {}
    for layout_name, strategy in COMBOS:
        layout = ctxpar.get_layout(layout_name, world)
        model = enable_context_parallel(tiny_llama(), layout=layout, strategy=strategy)
        inputs, labels = shard_inputs(input_ids, layout=layout, rank=rank)
        local_logits = model(**inputs).logits  # (B, T/P, vocab)
        share, loss = cp_loss(local_logits, labels)
        share.backward()
        grads = _grads(model)
        dist.all_reduce(grads)  # parameters are replicated: their gradient is the sum over ranks
        full_logits = _gather(local_logits, layout, None)
        out[(layout_name, strategy)] = dict(
            logits_err=(full_logits - logits.detach()).abs().max().item(),
            logits_scale=logits.detach().abs().max().item(),
            loss_err=abs(loss.item() - ref_loss.item()),
            grad_err=(grads - want).abs().max().item(),
            grad_scale=want.abs().max().item(),
        )
    return out


def _same_on_every_rank(*values: torch.Tensor) -> bool:
    """Whether every rank holds the same bits of ``values`` (scalars): the loss to log."""
    mine = torch.stack([v.detach().double() for v in values])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(other, mine) for other in everyone)


def _labels(rank: int, world: int) -> dict:
    import hf_families

    torch.manual_seed(2)
    input_ids = torch.randint(3, hf_families.VOCAB, (2, 8 * world))
    labels = input_ids.clone()
    labels[0, :11] = IGNORE_INDEX  # uneven: the shards hold different numbers of labelled tokens
    labels[1, 5 * world:] = IGNORE_INDEX
    layout = ctxpar.get_layout("zigzag", world)
    out = {}
    for case in LABEL_CASES:
        family = case.removesuffix("+router")
        routed = dict(output_router_logits=True) if case != family else {}
        # the router loss weighed as much as the labels' (the families' 0.001-0.01 left its gradient 1e-3 of the
        # whole: the aux loss added twice, or from this rank's counts alone, passed the tolerance by 4.4x, 1.2x)
        coef = {} if not routed else {"aux_loss_coef" if family == "jetmoe" else "router_aux_loss_coef": 1.0}
        reference = hf_families.build(family, **coef).train()  # train(): MoE routers as in training; no dropout
        ref = reference(input_ids=input_ids, labels=labels, use_cache=False, **routed)  # transformers' own loss
        ref.loss.backward()
        want = _grads(reference)
        model = enable_context_parallel(hf_families.build(family, **coef).train(), layout=layout)
        inputs, local_labels = shard_inputs(input_ids, layout=layout, rank=rank, labels=labels)
        try:
            got = model(**inputs, labels=local_labels, **routed)
            got.loss.backward()
        except ValueError as e:  # reported by the test; raised alike on every rank, before communicating
            out[case] = dict(error=str(e))
            continue
        grads = _grads(model)
        dist.all_reduce(grads)
        full_logits = _gather(got.logits, layout, None)
        out[case] = dict(
            loss_err=abs(got.loss.item() - ref.loss.item()),
            logits_err=(full_logits - ref.logits.detach()).abs().max().item(),
            logits_scale=ref.logits.detach().abs().max().item(),
            grad_err=(grads - want).abs().max().item(),
            grad_scale=want.abs().max().item(),
            aux_err=abs(got.aux_loss.item() - ref.aux_loss.item()) if routed else 0.0,
            same_on_every_rank=_same_on_every_rank(got.loss, got.aux_loss if routed else got.loss),
        )
    return out


def _sweep(rank: int, world: int) -> dict:
    """{case: ("refused", message) | ("ran", relative logits error) | ("error", message)}."""
    import hf_families

    groups = [dist.new_group(list(range(start, start + SWEEP_P))) for start in range(0, world, SWEEP_P)]
    index, group = rank // SWEEP_P, groups[rank // SWEEP_P]
    layout = ctxpar.get_layout("zigzag", SWEEP_P)
    torch.manual_seed(3)
    input_ids = torch.randint(3, hf_families.VOCAB, (2, SWEEP_TOKENS))
    out = {}
    for case in hf_families.CASES[index :: len(groups)]:
        try:
            enable_context_parallel(hf_families.build(case, meta=True), layout=layout, group=group)
        except ValueError as e:
            out[case] = ("refused", str(e))
            continue
        try:
            model = hf_families.build(case)
            with torch.no_grad():
                want = model(input_ids=input_ids, use_cache=False).logits  # unsplit, eager
                enable_context_parallel(model, layout=layout, group=group)
                inputs, _ = shard_inputs(input_ids, layout=layout, rank=dist.get_rank(group))
                got = _gather(model(**inputs).logits, layout, group)
            out[case] = ("ran", ((got - want).abs().max() / want.abs().max()).item())
        except Exception as e:  # noqa: BLE001 - reported per case by the test; ranks fail alike on one input
            out[case] = ("error", f"{type(e).__name__}: {e}")
    return out


def _pairs(rank: int, world: int):
    """Groups of SWEEP_P ranks (every rank creates every group, in the same order): this
    rank's group, its index, and its rank in it."""
    groups = [dist.new_group(list(range(start, start + SWEEP_P))) for start in range(0, world, SWEEP_P)]
    index = rank // SWEEP_P
    return groups[index], index, len(groups)


def _compare(case: str, layout, group, input_ids, labels, reference_kwargs: dict, cp_inputs: dict, cp_labels,
             strategy: str = "ring") -> dict:
    """One family under CP on ``group`` against its unsplit eager model: logits, labels= loss
    and the gradients summed over the group (sinks' separately)."""
    import hf_families

    reference = hf_families.build(case).train()
    ref = reference(input_ids=input_ids, labels=labels, use_cache=False, **reference_kwargs)
    ref.loss.backward()
    want = _grads(reference)
    want_sinks = [p.grad.flatten() for n, p in reference.named_parameters() if n.endswith("sinks")]
    model = enable_context_parallel(hf_families.build(case).train(), layout=layout, group=group, strategy=strategy)
    got = model(**cp_inputs, labels=cp_labels)
    got.loss.backward()
    grads = _grads(model)
    dist.all_reduce(grads, group=group)
    # a sink without a gradient (detached in the attention) counts as zeros: its error is then the whole gradient's
    sinks = [p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten()
             for n, p in model.named_parameters() if n.endswith("sinks")]
    out = dict(
        loss_err=abs(got.loss.item() - ref.loss.item()),
        logits_err=(_gather(got.logits, layout, group) - ref.logits.detach()).abs().max().item(),
        logits_scale=ref.logits.detach().abs().max().item(),
        grad_err=(grads - want).abs().max().item(),
        grad_scale=want.abs().max().item(),
    )
    if sinks:
        got_sinks = torch.cat(sinks)
        dist.all_reduce(got_sinks, group=group)
        out.update(sinks_err=(got_sinks - torch.cat(want_sinks)).abs().max().item(),
                   sinks_scale=torch.cat(want_sinks).abs().max().item())
    return out


def _mask_effect(case: str, input_ids, **kwargs) -> float:
    """Relative change of the unsplit logits when windows and chunks cover the whole row."""
    import hf_families

    model = hf_families.build(case)
    with torch.no_grad():
        want = model(input_ids=input_ids, use_cache=False, **kwargs).logits
        model.config.sliding_window = model.config.attention_chunk_size = 4 * SWEEP_TOKENS  # masks read them per call
        wide = model(input_ids=input_ids, use_cache=False, **kwargs).logits
    return ((want - wide).abs().max() / want.abs().max()).item()


def _masks(rank: int, world: int) -> dict:
    import hf_families

    group, index, n_groups = _pairs(rank, world)
    torch.manual_seed(4)
    input_ids = torch.randint(3, hf_families.VOCAB, (2, SWEEP_TOKENS))
    out = {}
    for case in MASK_CASES[index::n_groups]:
        for layout_name, strategy in MASK_COMBOS:
            layout = ctxpar.get_layout(layout_name, SWEEP_P)
            inputs, labels = shard_inputs(input_ids, layout=layout, rank=dist.get_rank(group))
            try:
                out[(case, layout_name, strategy)] = _compare(case, layout, group, input_ids, input_ids, {}, inputs,
                                                              labels, strategy)
            except ValueError as e:  # reported by the test
                out[(case, layout_name, strategy)] = dict(error=str(e))
        out[(case, "effect")] = _mask_effect(case, input_ids)
    return out


def _packed(rank: int, world: int) -> dict:
    import hf_families

    group, index, n_groups = _pairs(rank, world)
    torch.manual_seed(5)
    input_ids = torch.randint(3, hf_families.VOCAB, (2, SWEEP_TOKENS))
    starts = [0, *torch.tensor(PACKED_DOCUMENTS).cumsum(0).tolist()]
    positions = torch.cat([torch.arange(n) for n in PACKED_DOCUMENTS]).unsqueeze(0).expand(2, -1)  # restart per doc
    labels = input_ids.clone()
    labels[:, starts[1:-1]] = IGNORE_INDEX  # no document predicts the next one's first token
    layout = ctxpar.get_layout("zigzag", SWEEP_P)
    out = {}
    for case in PACKED_CASES[index::n_groups]:
        inputs, cp_labels = shard_inputs(input_ids, layout=layout, rank=dist.get_rank(group),
                                         documents=PACKED_DOCUMENTS)
        try:
            out[case] = {} if case in IGNORES_PACKING else _compare(
                case, layout, group, input_ids, labels, dict(position_ids=positions), inputs, cp_labels)
        except ValueError as e:
            out[case] = dict(error=str(e))
            continue
        model = enable_context_parallel(hf_families.build(case), layout=layout, group=group)
        alone = hf_families.build(case)
        with torch.no_grad():
            got = _gather(model(**inputs).logits, layout, group)
            each = torch.cat([alone(input_ids=input_ids[:, a:b], use_cache=False).logits
                              for a, b in zip(starts, starts[1:])], dim=1)
        out[case].update(alone_err=(got - each).abs().max().item(), alone_scale=each.abs().max().item(),
                         effect=_mask_effect(case, input_ids, position_ids=positions) if case != "llama" else None)
    return out


def _one_rank_refuses(rank: int, world: int) -> dict:
    """One rank of a pair drops documents= (its positions still restart per document): both
    ranks must refuse the forward, none be left waiting, and the next forward must run."""
    import hf_families

    group, _, _ = _pairs(rank, world)
    layout = ctxpar.get_layout("zigzag", SWEEP_P)
    model = enable_context_parallel(hf_families.build("llama"), layout=layout, group=group)
    input_ids = torch.randint(3, hf_families.VOCAB, (1, SWEEP_TOKENS), generator=torch.Generator().manual_seed(2))
    inputs, _ = shard_inputs(input_ids, layout=layout, rank=dist.get_rank(group), documents=PACKED_DOCUMENTS)
    partial = {k: v for k, v in inputs.items() if k != "documents" or dist.get_rank(group) == 0}
    try:
        model(**partial)
        refused = "ran"
    except ValueError as e:
        refused = str(e)
    after = tuple(model(**inputs).logits.shape)
    halves, _ = shard_inputs(input_ids, layout=layout, rank=dist.get_rank(group), documents=(SWEEP_TOKENS // 2,) * 2)
    halves.pop("documents")  # on both ranks: rank 0's positions still ascend (0..3, 4..7)
    try:
        model(**halves)
        undeclared = "ran"
    except ValueError as e:
        undeclared = str(e)
    return dict(refused=refused, group_rank=dist.get_rank(group), after=after, undeclared=undeclared)


def _hybrid(rank: int, world: int) -> dict:
    """strategy="hybrid": on the 2x2 mesh of every rank, the labels= loss, logits and summed
    gradients against the unsplit model; then on a (dp 2) x (ring 1, ulysses 2) mesh, each
    data-parallel replica a CP group of its own with a batch of its own: its loss is its
    batch's, a forward on replica 0 alone runs (replica 1 takes no part in it), and shards of
    two batches on replica 0 are refused there while replica 1 runs."""
    from torch.distributed.device_mesh import init_device_mesh

    def against_unsplit(model, layout, mesh, group, input_ids, labels) -> dict:
        reference = tiny_llama()
        ref = reference(input_ids=input_ids, labels=labels, use_cache=False)
        ref.loss.backward()
        inputs, local_labels = shard_inputs(input_ids, layout=layout, rank=ctxpar.hybrid_rank(mesh), labels=labels)
        got = model(**inputs, labels=local_labels)
        got.loss.backward()
        grads = _grads(model)
        dist.all_reduce(grads, group=group)
        want = _grads(reference)
        return dict(loss=got.loss.item(), loss_err=abs(got.loss.item() - ref.loss.item()),
                    logits_err=_relative(_gather(got.logits, layout, group), ref.logits.detach()),
                    grad_err=_relative(grads, want))

    def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids = torch.randint(0, 128, (2, 8 * world), generator=torch.Generator().manual_seed(seed))
        labels = input_ids.clone()
        labels[0, :5] = IGNORE_INDEX  # the shards hold different numbers of labelled tokens
        return input_ids, labels

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    layout = ctxpar.get_layout("zigzag", world)
    model = enable_context_parallel(tiny_llama(), layout=layout, strategy="hybrid", mesh=mesh)
    out = dict(whole=against_unsplit(model, layout, mesh, None, *batch(3)))

    pair, replica, _ = _pairs(rank, world)  # ranks 0-1 and 2-3: the replicas of the mesh below
    replicas = init_device_mesh("cpu", (2, 1, SWEEP_P), mesh_dim_names=("dp", "ring", "ulysses"))
    assert replicas.get_local_rank("dp") == replica
    mesh = replicas["ring", "ulysses"]
    layout = ctxpar.get_layout("zigzag", SWEEP_P)
    model = enable_context_parallel(tiny_llama(), layout=layout, strategy="hybrid", mesh=mesh)
    input_ids, labels = batch(10 + replica)
    out["replica"] = against_unsplit(model, layout, mesh, pair, input_ids, labels)
    inputs, local_labels = shard_inputs(input_ids, layout=layout, rank=ctxpar.hybrid_rank(mesh), labels=labels)
    with torch.no_grad():
        want = tiny_llama()(input_ids=input_ids, use_cache=False).logits
        if replica == 0:  # an evaluation on one replica
            out["one replica"] = _attempt(lambda: _relative(_gather(model(**inputs).logits, layout, pair), want))
    dist.barrier()
    other, _ = shard_inputs(batch(20)[0], layout=layout, rank=ctxpar.hybrid_rank(mesh))
    mixed = other if replica == 0 and rank % SWEEP_P == 1 else inputs
    out["another batch on replica 0"] = _attempt(lambda: model(**mixed, labels=local_labels).loss.item())
    return out


class EmbeddingWrapper(torch.nn.Module):
    """An adapter's wrapper around the input embeddings, as PEFT's are: the embedding kept inside
    (LoRA's as base_layer, trainable tokens' deeper), its weight shown, no num_embeddings."""

    def __init__(self, embedding: torch.nn.Embedding) -> None:
        super().__init__()
        self.adapter = torch.nn.ModuleDict({"base_layer": embedding})

    @property
    def weight(self) -> torch.Tensor:
        return self.adapter["base_layer"].weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.adapter["base_layer"](input_ids)


def _attempt(fn) -> tuple[str, object]:
    """("ran", what fn returns) or ("refused", the ValueError's message)."""
    try:
        return "ran", fn()
    except ValueError as e:
        return "refused", str(e)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _guards(rank: int, world: int) -> dict:
    """{check: ("ran", value) | ("refused", message)} on this rank's pair, plus the rank in it."""
    import hf_families

    group, _, _ = _pairs(rank, world)
    me = dist.get_rank(group)
    input_ids = torch.randint(3, hf_families.VOCAB, (1, SWEEP_TOKENS), generator=torch.Generator().manual_seed(6))
    out: dict = dict(group_rank=me)
    reference = hf_families.build("phi3+longrope")
    with torch.no_grad():
        want = reference(input_ids=input_ids, use_cache=False).logits  # long factors: 16 > 8
        short = reference(input_ids=input_ids[:, :8], use_cache=False).logits  # short factors
    out["longrope effect"] = _relative(want[:, :8], short)
    for name in ("zigzag", "striped", "contiguous"):  # contiguous: rank 0 holds positions 0-7 only
        layout = ctxpar.get_layout(name, SWEEP_P)
        model = enable_context_parallel(hf_families.build("phi3+longrope"), layout=layout, group=group)
        inputs, _ = shard_inputs(input_ids, layout=layout, rank=me)
        with torch.no_grad():
            out[f"longrope {name}"] = _attempt(lambda: _relative(_gather(model(**inputs).logits, layout, group), want))

    layout = ctxpar.get_layout("zigzag", SWEEP_P)
    inputs, _ = shard_inputs(input_ids, layout=layout, rank=me)
    # dynamic RoPE past max_position_embeddings (8 < 16): each rank would recompute from its own positions
    dynamic = enable_context_parallel(hf_families.build("llama+dynamic-rope", max_position_embeddings=8),
                                      layout=layout, group=group)
    with torch.no_grad():
        out["dynamic rope past its limit"] = _attempt(lambda: tuple(dynamic(**inputs).logits.shape))
    with torch.no_grad():
        hidden = layout.shard(hf_families.build("llama").model(input_ids=input_ids).last_hidden_state, me, dim=1)
        model = enable_context_parallel(hf_families.build("llama"), layout=layout, group=group)
        out["decoder"] = _attempt(lambda: _relative(model.model(**inputs).last_hidden_state, hidden))
        out["decoder without positions"] = _attempt(
            lambda: tuple(model.model(input_ids=inputs["input_ids"]).last_hidden_state.shape))
        out["logits_to_keep"] = _attempt(lambda: tuple(model(**inputs, logits_to_keep=1).logits.shape))
        mask = torch.ones_like(input_ids)
        mask[:, :2] = 0  # left padding: after sharding, only rank 0 holds zeros
        padded = dict(inputs, attention_mask=layout.shard(mask, me, dim=1))
        out["padding on one rank"] = _attempt(lambda: tuple(model(**padded).logits.shape))
        # two rows, the first all ones, the second left-padded: a check of the first row alone let rank 0 refuse
        # alone in the mask's forward while rank 1 waited in attention
        rows = torch.randint(3, hf_families.VOCAB, (2, SWEEP_TOKENS), generator=torch.Generator().manual_seed(7))
        mask = torch.ones_like(rows)
        mask[1, :2] = 0
        two = dict(shard_inputs(rows, layout=layout, rank=me)[0], attention_mask=layout.shard(mask, me, dim=1))
        out["padding in a second row on one rank"] = _attempt(lambda: tuple(model(**two).logits.shape))
        if me == 1:
            model.set_attn_implementation("sdpa")  # each rank would attend within its own shard
        out["sdpa on one rank"] = _attempt(lambda: tuple(model(**inputs).logits.shape))
        model.set_attn_implementation("ctxpar")
        out["after"] = _attempt(lambda: tuple(model(**inputs).logits.shape))
        # a keyword argument the layers refuse, on one rank only: refused there alone, its peer waited in attention
        out["attention keyword on one rank"] = _attempt(
            lambda: tuple(model(**inputs, **(dict(softcap=30.0) if me == 1 else {})).logits.shape))
        out["after attention keyword"] = _attempt(lambda: tuple(model(**inputs).logits.shape))
        # a layer's scale changed on one rank only: refused there alone, its peer waited in attention
        attention = model.model.layers[0].self_attn
        scaling, attention.scaling = attention.scaling, float("inf") if me == 1 else attention.scaling
        out["attention scale on one rank"] = _attempt(lambda: tuple(model(**inputs).logits.shape))
        attention.scaling = scaling
        out["after attention scale"] = _attempt(lambda: tuple(model(**inputs).logits.shape))
    inputs, labels = shard_inputs(input_ids, layout=layout, rank=me)
    # labels= or a loss argument on one rank only: the others would wait in the loss's all-reduce
    out["labels on one rank"] = _attempt(lambda: model(**inputs, **(dict(labels=labels) if me == 0 else {})).loss)
    # a MoE's router loss is made the sequence's after the forward, with every rank: asked on one rank only,
    # that rank would wait alone
    out["output_router_logits on one rank"] = _attempt(
        lambda: tuple(model(**inputs, **(dict(output_router_logits=True) if me == 1 else {})).logits.shape))
    out["num_items_in_batch on one rank"] = _attempt(
        lambda: model(**inputs, labels=labels, **(dict(num_items_in_batch=7) if me == 1 else {})).loss.item())
    # each rank a batch of its own (a DistributedSampler over every rank): attention would mix them
    own = torch.randint(3, hf_families.VOCAB, (1, SWEEP_TOKENS), generator=torch.Generator().manual_seed(50 + me))
    mine, mine_labels = shard_inputs(own, layout=layout, rank=me)
    moved = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in mine.items()}
    out["another batch"] = _attempt(lambda: model(**moved, labels=mine_labels).loss)
    with torch.no_grad():
        out["another batch, decoder"] = _attempt(lambda: tuple(model.model(**mine).last_hidden_state.shape))
    # a model loaded with another config on one rank (another norm epsilon) trained silently wrong
    other = enable_context_parallel(hf_families.build("llama", **(dict(rms_norm_eps=1e-2) if me == 1 else {})),
                                    layout=layout, group=group)
    out["another config on one rank"] = _attempt(lambda: other(**inputs, labels=labels).loss)
    with torch.no_grad():
        out["another config on one rank, decoder"] = _attempt(
            lambda: tuple(other.model(**inputs).last_hidden_state.shape))
    # weights drawn apart (rank 1's first value moved, as another seed would): a mixture of models, silently
    drawn = hf_families.build("llama")
    with torch.no_grad():
        next(drawn.parameters()).view(-1)[0] += me == 1
    drawn = enable_context_parallel(drawn, layout=layout, group=group)
    out["other weights on one rank"] = _attempt(lambda: drawn(**inputs, labels=labels).loss)
    # train() on one rank, eval() on the other: dropout on one rank's shard alone gave a loss that is neither
    # the eval loss nor a train step's (GPT-2, dropout 0.3: 3.8823 against 3.8777), silently
    was_training = model.training
    model.train(me == 0)
    out["train mode on one rank"] = _attempt(lambda: model(**inputs, labels=labels).loss)
    with torch.no_grad():  # an evaluation loop scoring from the logits: no loss to disagree on, dropout still acts
        out["train mode on one rank, no labels"] = _attempt(lambda: tuple(model(**inputs).logits.shape))
    model.train()
    if me == 1:  # set after enable_context_parallel, on one rank: each rank would skip layers of its own
        model.model.layerdrop = 0.5
    out["layerdrop on one rank"] = _attempt(lambda: model(**inputs, labels=labels).loss)
    if me == 1:
        del model.model.layerdrop
    model.train(was_training)
    copied = copy.deepcopy(model)  # group= given: the copy shares it (a ProcessGroup cannot be copied)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.zero_()  # the copy's logits are now 0 everywhere; the original's are not
        out["deep copy"] = _attempt(lambda: (copied(**inputs).logits.abs().max().item(),
                                             model(**inputs).logits.abs().max().item() > 0))
    # one label id outside the vocabulary in the whole batch, on one rank's shard after the shift
    # (zigzag, 16 tokens: rank 0 holds positions 0-3 and 12-15): an IndexError there left the other waiting
    for check, position, value in (("label beyond the vocabulary on rank 1", 6, hf_families.VOCAB),
                                   ("label -1 on rank 0", 1, -1)):
        bad = input_ids.clone()
        bad[0, position] = value
        bad_inputs, bad_labels = shard_inputs(input_ids, layout=layout, rank=me, labels=bad)
        out[check] = _attempt(lambda: model(**bad_inputs, labels=bad_labels).loss.item())
    out["after bad labels"] = _attempt(lambda: model(**inputs, labels=labels).loss.item())
    # the embedding wrapped as PEFT's adapters wrap it (no num_embeddings of its own): an id beyond the
    # vocabulary on rank 1's shard went unchecked, its IndexError there alone
    wrapped = enable_context_parallel(hf_families.build("llama"), layout=layout, group=group)
    wrapped.set_input_embeddings(EmbeddingWrapper(wrapped.get_input_embeddings()))
    beyond = input_ids.clone()
    beyond[0, 6] = hf_families.VOCAB
    beyond_inputs, _ = shard_inputs(beyond, layout=layout, rank=me)
    with torch.no_grad():
        out["token beyond the vocabulary, embedding wrapped"] = _attempt(
            lambda: tuple(wrapped(**beyond_inputs).logits.shape))
    # supervised fine-tuning's copy of the tokens, its prompt and last token masked, sharded as the tokens are:
    # no one shard's labels give them away
    unshifted = input_ids.clone()
    unshifted[:, :4] = IGNORE_INDEX
    unshifted[:, -1] = IGNORE_INDEX
    out["unshifted labels, last masked"] = _attempt(
        lambda: model(**inputs, labels=layout.shard(unshifted, me, dim=1)).loss.item())
    out.update(_heads(layout, group, input_ids))
    return out


def _heads(layout, group, input_ids) -> dict:
    """Per-token heads on a pair: their outputs against the unsplit model's rows of this
    shard; question answering's start_positions (global indices) and token classification's
    labels= (shard_inputs shifts them for next-token prediction) refused on every rank."""
    import hf_families
    import transformers

    me = dist.get_rank(group)
    config = hf_families.config_for("llama", num_labels=3)
    out = {}
    for head, keys in (("LlamaForTokenClassification", ("logits",)),
                       ("LlamaForQuestionAnswering", ("start_logits", "end_logits"))):
        torch.manual_seed(0)
        reference = getattr(transformers, head)._from_config(config, attn_implementation="eager").eval()
        model = enable_context_parallel(copy.deepcopy(reference), layout=layout, group=group)
        inputs, labels = shard_inputs(input_ids, layout=layout, rank=me, labels=input_ids % 3)
        with torch.no_grad():
            want, got = reference(input_ids=input_ids, use_cache=False), model(**inputs)
        out[head] = max(_relative(getattr(got, key), layout.shard(getattr(want, key), me, dim=1)) for key in keys)
        if head == "LlamaForTokenClassification":  # shard_inputs' labels are shifted: once a wrong loss, silently
            out["token classification labels"] = _attempt(lambda: model(**inputs, labels=labels).loss.item())
            # a subclass named otherwise has loss_type None, which once read as the causal LM's
            tagger = enable_context_parallel(type("Tagger", (type(reference),), {})._from_config(config), layout=layout,
                                             group=group)
            out["subclass labels"] = _attempt(lambda: tagger(**inputs, labels=labels).loss.item())
    positions = dict(start_positions=torch.tensor([3]), end_positions=torch.tensor([5]))
    out["question answering positions"] = _attempt(lambda: model(**inputs, **positions).loss.item())
    # GPT-2's segment ids: shard_inputs shards them with the tokens; the whole batch's beside a shard's ids once gave
    # (2, 8) logits for one (1, 8) row, or torch's broadcast error
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel._from_config(hf_families.config_for("gpt2"), attn_implementation="eager")
    reference = gpt2.eval()
    model = enable_context_parallel(copy.deepcopy(reference), layout=layout, group=group)
    types = (torch.arange(input_ids.shape[1]) >= input_ids.shape[1] // 3).long().expand_as(input_ids)
    inputs, _ = shard_inputs(input_ids, layout=layout, rank=me, token_type_ids=types)
    with torch.no_grad():
        want = reference(input_ids=input_ids, token_type_ids=types, use_cache=False).logits
        out["token_type_ids"] = _relative(model(**inputs).logits, layout.shard(want, me, dim=1))
        whole = {**inputs, "token_type_ids": types}
        out["whole token_type_ids"] = _attempt(lambda: model(**whole).logits.shape)
    return out


def run(rank: int, world: int) -> dict:
    import warnings

    from transformers.utils import logging

    logging.set_verbosity_error()  # tiny configs make transformers warn about sizes and defaults
    warnings.filterwarnings("ignore")
    import hf_generate_cases

    return dict(llama=_llama(rank, world), labels=_labels(rank, world), sweep=_sweep(rank, world),
                masks=_masks(rank, world), packed=_packed(rank, world), one_rank_refuses=_one_rank_refuses(rank, world),
                guards=_guards(rank, world), hybrid=_hybrid(rank, world), generate=hf_generate_cases.run(rank, world))


# its longest wait at a collective: ranks 2 and 3 at the first generate on 4 ranks while 0 and 1 generate on 2, then
# 0-2 on 3 (about 9 s here); a hang costs the timeout to every batch of its group
spawned.declare("hf", run, 4, timeout_s=120)
