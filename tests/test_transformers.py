"""Hugging Face transformers integration: tiny random models under CP against the unsplit model."""

from __future__ import annotations

import copy
import re
import sys

import pytest

pytest.importorskip("transformers")

import hf_cases  # noqa: E402
import hf_families  # noqa: E402
import torch  # noqa: E402

import ctxpar  # noqa: E402
from ctxpar.integrations.transformers import enable_context_parallel, shard_inputs  # noqa: E402
from ctxpar.parallelize import IGNORE_INDEX  # noqa: E402

ONE = ctxpar.get_layout("zigzag", 1)  # world size 1, no process group: plain attention, all checks on


@pytest.mark.parametrize("layout, strategy", hf_cases.COMBOS)
def test_llama_under_cp_gives_the_unsplit_logits_and_gradients(layout: str, strategy: str) -> None:
    for rank, res in enumerate(hf_cases.results()):
        r = res["llama"][(layout, strategy)]
        assert r["logits_err"] <= 1e-5 * r["logits_scale"], f"rank {rank}: logits {r['logits_err']:.3g}"
        assert r["loss_err"] <= 1e-5, f"rank {rank}: loss {r['loss_err']:.3g}"
        assert r["grad_err"] <= 1e-4 * r["grad_scale"], f"rank {rank}: grads {r['grad_err']:.3g}"


@pytest.mark.parametrize("case", hf_cases.LABEL_CASES)
def test_labels_loss_is_the_global_loss_and_its_gradient_sums_to_the_unsplit_one(case: str) -> None:
    """out.loss on every rank reads the unsplit model's own labels= loss (shifted once, every
    labelled token weighted alike across shards); summed over ranks its gradients are the
    unsplit gradients (4 ranks, zigzag, uneven ignored labels). With a MoE's router logits,
    its aux_loss and the loss holding it are the sequence's (each rank's was its shard's)."""
    for rank, res in enumerate(hf_cases.results()):
        r = res["labels"][case]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["loss_err"] <= 1e-5, f"rank {rank}: loss off by {r['loss_err']:.3g}"
        assert r["logits_err"] <= 1e-5 * r["logits_scale"], f"rank {rank}: logits {r['logits_err']:.3g}"
        assert r["grad_err"] <= 1e-4 * r["grad_scale"], f"rank {rank}: grads {r['grad_err']:.3g}"
        assert r["aux_err"] <= 1e-5, f"rank {rank}: router aux_loss off by {r['aux_err']:.3g}"
        assert r["same_on_every_rank"], f"rank {rank}: the loss (or aux_loss) differs between ranks"


def _one_rank(model, tokens: int = 8, **labels):
    model = enable_context_parallel(model, layout=ONE)
    inputs, shifted = shard_inputs(torch.randint(3, hf_families.VOCAB, (1, tokens)), layout=ONE, rank=0, **labels)
    return model, inputs, shifted


def test_an_attention_module_replaced_after_enabling_is_named_as_such() -> None:
    """A layer rebuilt after enable_context_parallel (surgery, an adapter) was told to call
    enable_context_parallel first, which had been done, or that its config was shared."""
    model, inputs, _ = _one_rank(hf_families.build("llama"))
    attention = model.model.layers[1].self_attn
    fresh = type(attention)(model.config, 1)
    fresh.load_state_dict(attention.state_dict())
    model.model.layers[1].self_attn = fresh
    with pytest.raises(ValueError, match="not prepared, though its config is a model's given to enable_context_"
                                         r"parallel: a module added or replaced after it \(call enable_context_"
                                         r"parallel\(model, \.\.\.\) again once the model is changed\)"):
        model(**inputs)
    enable_context_parallel(model, layout=ONE)  # as the message says
    assert model(**inputs).logits.shape[1] == inputs["input_ids"].shape[1]


def test_labels_loss_refuses_what_it_cannot_weigh_globally() -> None:
    model, inputs, labels = _one_rank(hf_families.build("llama"))
    for extra, message in ((dict(shift_labels=labels), "already shifted"),
                           (dict(num_items_in_batch=torch.tensor(7)), "num_items_in_batch"),
                           (dict(ignore_index=0), "ignore_index=0")):
        with pytest.raises(ValueError, match=message):
            model(**inputs, labels=labels, **extra)
    with pytest.raises(ValueError, match=r"labels \(1, 7\) must be this rank's shifted labels"):
        model(**inputs, labels=labels[:, :7])
    nothing = model(**inputs, labels=torch.full_like(labels, IGNORE_INDEX)).loss  # nothing labelled
    nothing.backward()
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    assert nothing.item() == 0.0 and gradients and all(bool((g == 0).all()) for g in gradients)  # zero, not NaN
    model.zero_grad()
    with pytest.raises(ValueError, match="unshifted labels"):  # transformers' usual idiom, wrong under CP
        model(**inputs, labels=inputs["input_ids"])
    prompt_masked = inputs["input_ids"].clone()
    prompt_masked[:, :4] = IGNORE_INDEX  # supervised fine-tuning's idiom: it was accepted, each token its own target
    with pytest.raises(ValueError, match="unshifted labels"):
        model(**inputs, labels=prompt_masked)
    prompt_masked[:, -1] = IGNORE_INDEX  # the last token masked too: no label gives them away but their values
    with pytest.raises(ValueError, match=r"position 4: label \d+, next token \d+\).*unshifted labels"):
        model(**inputs, labels=prompt_masked)
    embeds = model.get_input_embeddings()(inputs["input_ids"])  # no ids to compare: it ran, each token its own target
    with pytest.raises(ValueError, match="unshifted labels"):
        model(inputs_embeds=embeds, position_ids=inputs["position_ids"], labels=inputs["input_ids"])
    assert model(inputs_embeds=embeds, position_ids=inputs["position_ids"], labels=labels).loss.item() > 0
    repeated = torch.full((1, 8), 5)  # shifted labels that equal the tokens wherever they label: no refusal
    inputs, labels = shard_inputs(repeated, layout=ONE, rank=0)
    assert torch.equal(labels[:, :-1], repeated[:, :-1]) and model(**inputs, labels=labels).loss.item() > 0
    # a head other than a causal LM's calling the loss (transformers' token classification passes its config
    # where a causal LM passes its vocabulary size): once a causal-LM loss over its logits, without a word
    with pytest.raises(ValueError, match="called with LlamaConfig where a causal LM head passes its vocabulary"):
        model.loss_function(torch.randn(1, 8, 3), labels, model.config)


def test_a_router_loss_ctxpar_cannot_recompute_is_refused() -> None:
    """A family whose aux_loss is not Switch Transformer's load-balancing loss over its router
    logits (here Mixtral's own made twice as large), or whose labels= loss adds it otherwise
    (twice), is refused, not replaced; return_dict=False gives the tuple of the checked outputs."""
    model, inputs, labels = _one_rank(hf_families.build("mixtral"))
    want = model(**inputs, labels=labels, output_router_logits=True)
    got = model(**inputs, labels=labels, output_router_logits=True, return_dict=False)
    assert isinstance(got, tuple) and torch.equal(got[0], want.loss) and torch.equal(got[1], want.aux_loss)
    module = sys.modules[type(model).__module__]
    own = module.load_balancing_loss_func
    try:
        module.load_balancing_loss_func = lambda *args, **kwargs: 2 * own(*args, **kwargs)
        with pytest.raises(ValueError, match="its aux_loss is not Switch Transformer's load-balancing loss"):
            model(**inputs, output_router_logits=True)
    finally:
        module.load_balancing_loss_func = own

    class Twice(type(model)):  # adds its router term to the labels= loss once more
        def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, position_ids=position_ids, labels=labels, **kwargs)
            out["loss"] = out.loss + self.router_aux_loss_coef * out.aux_loss
            return out

    twice = enable_context_parallel(Twice._from_config(model.config, attn_implementation="eager"), layout=ONE)
    with pytest.raises(ValueError, match="its labels= loss adds the router loss otherwise than its router_aux"):
        twice(**inputs, labels=labels, output_router_logits=True)


def test_shard_inputs_refuses_a_batch_of_no_rows_whatever_p() -> None:
    for world in (1, 2):
        with pytest.raises(ValueError, match=re.escape("tokens (0, 8) hold no rows, so there is nothing to shard")):
            shard_inputs(torch.zeros(0, 8, dtype=torch.long), layout=ctxpar.get_layout("zigzag", world), rank=0)


def test_padding_masks_and_foreign_positions_are_refused() -> None:
    model, inputs, _ = _one_rank(hf_families.build("llama"))
    padding = torch.ones(1, 8, dtype=torch.long)
    padding[0, -2:] = 0
    with pytest.raises(ValueError, match="padding masks are not supported"):
        model(**inputs, attention_mask=padding)
    model(**inputs, attention_mask=torch.ones(1, 8, dtype=torch.long))  # all-ones is fine
    # of another length or batch: transformers masks the keys past a short mask's end, which ctxpar ran unmasked
    for shape in ((1, 4), (1, 20), (2, 8)):
        with pytest.raises(ValueError, match=re.escape(f"got an attention_mask of shape {shape}, for 8 tokens in each "
                                                       f"of 1 rows; pass this rank's shard of an all-ones mask")):
            model(**inputs, attention_mask=torch.ones(shape, dtype=torch.long))

    shifted = dict(inputs, position_ids=inputs["position_ids"] + 3)  # not this rank's global positions
    # ascending: another layout's (shard_inputs with another layout), once told of packed documents
    with pytest.raises(ValueError, match=re.escape("position_ids must be this rank's positions under the zigzag "
                                                   "layout enable_context_parallel was given, got 3..10, where this "
                                                   "rank's are 0..7 (its token 0 is at 0, not 3); shard the batch")):
        model(**shifted)
    # a second row alone wrong: refused (once only row 0 was compared), naming that row and its positions (the
    # message once quoted row 0's, the right ones, as "not this rank's positions")
    right = inputs["position_ids"].reshape(-1)
    two_rows = dict(input_ids=inputs["input_ids"].expand(2, -1), position_ids=torch.stack([right, right + 3]))
    with pytest.raises(ValueError, match=re.escape("position_ids (row 1) must be this rank's positions under the "
                                                   "zigzag layout enable_context_parallel was given, got 3..10")):
        model(**two_rows)
    two_rows["position_ids"] = torch.stack([right, right.flip(0)])
    with pytest.raises(ValueError, match=r"position_ids \(row 1\) must be this rank's global layout positions"):
        model(**two_rows)
    # another length: named by its shape (it quoted row 0 as wrong beside the same list, or raised reshape's error)
    for wrong in (torch.arange(9).expand(2, -1), torch.zeros(1, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match=re.escape(f"position_ids of shape {tuple(wrong.shape)} for this rank's "
                                                       f"8 tokens: pass its global positions, one per token")):
            model(**dict(two_rows, position_ids=wrong))


def test_mistral_sliding_window_runs_exactly() -> None:
    """Window 4 on 16 tokens, at world size 1 (the split itself: the masks tests below)."""
    tokens = torch.randint(3, hf_families.VOCAB, (2, 16))
    with torch.no_grad():
        want = hf_families.build("mistral")(input_ids=tokens, use_cache=False).logits
        model, inputs, _ = _one_rank(hf_families.build("mistral"), tokens=16)
        got = model(**shard_inputs(tokens, layout=ONE, rank=0)[0]).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("case", ["mistral", "gemma3_text"])
def test_a_window_is_taken_from_the_mask_when_the_layers_do_not_pass_sliding_window(case: str) -> None:
    """A family whose layers pass no sliding_window= to their attention (the cross-check of the
    two then cannot speak): the window read off the mask one short gave logits off by 0.66
    relative (Gemma 3; Mistral 0.3), at world size 1 (the split itself: the masks tests below)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    tokens = torch.randint(3, hf_families.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_families.build(case)(input_ids=tokens, use_cache=False).logits
    model, _, _ = _one_rank(hf_families.build(case), tokens=16)
    name = model.config._attn_implementation
    registered = ALL_ATTENTION_FUNCTIONS[name]

    def without_window(*args, **kwargs):
        kwargs.pop("sliding_window", None)
        return registered(*args, **kwargs)

    AttentionInterface.register(name, without_window)
    try:
        with torch.no_grad():
            got = model(**shard_inputs(tokens, layout=ONE, rank=0)[0]).logits
    finally:
        AttentionInterface.register(name, registered)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("layout, strategy", hf_cases.MASK_COMBOS)
@pytest.mark.parametrize("case", hf_cases.MASK_CASES)
def test_sliding_chunked_and_sink_families_give_the_unsplit_logits_loss_and_gradients(
        case: str, layout: str, strategy: str) -> None:
    """Mistral (window), Qwen2 and Gemma 3 (sliding and full layers), gpt-oss (sinks and
    windows), Llama 4 (chunks and full layers) on 2 gloo ranks: logits, the labels= loss
    and the gradients summed over ranks, the sinks' included, as the unsplit eager model."""
    runs = [res["masks"][(case, layout, strategy)] for res in hf_cases.results()
            if (case, layout, strategy) in res["masks"]]
    assert len(runs) == hf_cases.SWEEP_P
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["logits_err"] <= 1e-5 * r["logits_scale"], f"logits {r['logits_err']:.3g}"
        assert r["loss_err"] <= 1e-5, f"loss {r['loss_err']:.3g}"
        assert r["grad_err"] <= 1e-4 * r["grad_scale"], f"grads {r['grad_err']:.3g}"
        if case.startswith("gpt_oss"):
            assert r["sinks_err"] <= 1e-4 * r["sinks_scale"], f"sinks' gradient {r['sinks_err']:.3g}"
    for res in hf_cases.results():  # the windows and chunks change the unsplit model's logits
        if (case, "effect") in res["masks"]:
            assert res["masks"][(case, "effect")] > 1e-2


@pytest.mark.parametrize("case", hf_cases.PACKED_CASES)
def test_packed_documents_run_as_the_unsplit_packed_model_and_as_each_document_alone(case: str) -> None:
    """Documents of 5, 7 and 4 tokens in one row of 16, zigzag on 2 ranks, declared with
    shard_inputs(documents=...): logits as each document run alone, and (where transformers
    itself honours packing) logits, loss and summed gradients as the unsplit packed model."""
    runs = [res["packed"][case] for res in hf_cases.results() if case in res["packed"]]
    assert len(runs) == hf_cases.SWEEP_P
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["alone_err"] <= 1e-5 * r["alone_scale"], f"vs each document alone: {r['alone_err']:.3g}"
        if case not in hf_cases.IGNORES_PACKING:
            assert r["logits_err"] <= 1e-5 * r["logits_scale"], f"logits {r['logits_err']:.3g}"
            assert r["loss_err"] <= 1e-5, f"loss {r['loss_err']:.3g}"
            assert r["grad_err"] <= 1e-4 * r["grad_scale"], f"grads {r['grad_err']:.3g}"
        if r["effect"] is not None:
            assert r["effect"] > 1e-2  # windows / chunks cut inside the documents too


def test_restarting_positions_need_declared_documents() -> None:
    model, _, _ = _one_rank(hf_families.build("llama"), tokens=16)
    tokens = torch.randint(3, hf_families.VOCAB, (1, 16))
    inputs, _ = shard_inputs(tokens, layout=ONE, rank=0, documents=[5, 7, 4])
    assert inputs["position_ids"][0].tolist() == [*range(5), *range(7), *range(4)]
    undeclared = {k: v for k, v in inputs.items() if k != "documents"}
    with pytest.raises(ValueError, match=r"positions that restart mean packed documents.*documents="):
        model(**undeclared)
    with pytest.raises(ValueError, match=r"counted from the start of each declared document \[8, 8\]"):
        model(**dict(inputs, documents=[8, 8]))
    with pytest.raises(ValueError, match="read as cu_seqlens, which must end at the sequence length 16"):
        model(**dict(inputs, documents=[0, 5, 12]))
    model(**dict(inputs, documents=torch.tensor([0, 5, 12, 16])))  # cu_seqlens are fine
    with pytest.raises(ValueError, match=r"packed sequences .*cu_seq_lens_q=.*declare the packed row's documents"):
        model(**shard_inputs(tokens, layout=ONE, rank=0)[0], cu_seq_lens_q=torch.tensor([0, 5, 12, 16]))
    _, labels = shard_inputs(tokens, layout=ONE, rank=0, documents=[5, 7, 4])
    assert labels[0, [4, 11, 15]].tolist() == [IGNORE_INDEX] * 3  # no target across a document boundary


def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank() -> None:
    """A forward that one rank refuses (documents= dropped on rank 1 only) raises on both
    ranks, the right error on the rank that made the mistake, and leaves nobody waiting."""
    for res in hf_cases.results():
        got = res["one_rank_refuses"]
        if got["group_rank"] == 1:
            assert "positions that restart mean packed documents" in got["refused"]
        else:
            assert "another rank of the CP group refused" in got["refused"]
        assert got["after"][1] == hf_cases.SWEEP_TOKENS // 2
        # documents dropped on both ranks: the rank whose positions ascend (0..3, 4..7 for 0..3, 12..15) names
        # packing too, where it said only that they were not the layout's (numbered from 0, they may be the
        # whole sequence's as well: both are said)
        wants = (["got 0..7, where this rank's are 0..3, 12..15 (its token 4 is at 12, not 4); numbered from 0 to 7: "
                  "if they are the whole sequence's, passed on each rank",
                  "that layout (or, where they restart at packed documents, for a packed row, declare its documents"]
                 if got["group_rank"] == 0 else ["positions that restart mean packed documents"])
        assert all(want in got["undeclared"] for want in wants), (got["group_rank"], got["undeclared"])


def test_logits_to_keep_and_an_attention_implementation_switched_after_enable_are_refused() -> None:
    """logits_to_keep keeps a shard's last rows, which are not the sequence's; after
    set_attn_implementation("sdpa") (or a config set to another implementation) each rank
    would attend within its own shard. Both refused, generate included; switching back works."""
    model, inputs, _ = _one_rank(hf_families.build("llama"))
    # refused by the forward, where every rank agrees: each layer refused it alone, leaving the ranks
    # without it waiting in attention
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM asks for output_attentions=True"):
        model(**inputs, output_attentions=True)
    for keep in (1, torch.tensor([7])):
        with pytest.raises(ValueError, match="logits_to_keep=.*not the sequence's last positions"):
            model(**inputs, logits_to_keep=keep)
    assert model(**inputs, logits_to_keep=0).logits.shape[1] == 8  # 0 keeps every row
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's attention implementation is now 'sdpa'.*"
                                         r"set_attn_implementation\(\"ctxpar\"\)"):
        model(**inputs)
    with pytest.raises(ValueError, match="attention implementation is now 'sdpa'"):
        model.generate(inputs["input_ids"], max_new_tokens=2)
    model.set_attn_implementation("ctxpar")
    model.model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attention implementation is now 'eager'"):
        model.model(**inputs)
    model.set_attn_implementation("ctxpar")
    assert model(**inputs).logits.shape[1] == 8


def _guards(check: str) -> list[tuple[int, tuple]]:
    """(rank in its CP group, verdict) of every rank for one check of hf_cases' ``guards``."""
    return [(res["guards"]["group_rank"], res["guards"][check]) for res in hf_cases.results()]


def test_the_decoder_called_alone_is_guarded_like_the_model() -> None:
    """model.model(...) on 2 ranks: with shard_inputs' positions, the unsplit hidden states;
    without position_ids (it would number each shard from 0), refused on every rank."""
    for _, (kind, detail) in _guards("decoder"):
        assert kind == "ran" and detail <= 1e-5, detail
    for _, (kind, detail) in _guards("decoder without positions"):
        assert kind == "refused" and "LlamaModel got no position_ids" in detail, detail
        assert "PEFT's prompt tuning, is not supported" in detail, detail


def test_logits_to_keep_is_refused_on_every_rank() -> None:
    for _, (kind, detail) in _guards("logits_to_keep"):
        assert kind == "refused" and "logits_to_keep=1" in detail, detail


def test_labels_or_a_loss_argument_on_one_rank_is_refused_on_every_rank_together() -> None:
    """labels= on rank 0 only left both ranks waiting until the timeout; num_items_in_batch=
    on rank 1 only was refused there alone, inside the loss, after the forward; and
    output_router_logits on one rank only (its router loss is made the sequence's with
    every rank) is refused before it."""
    for _, (kind, detail) in _guards("labels on one rank"):
        assert kind == "refused" and "got labels= on 1 of the 2 ranks of the CP group" in detail, detail
    for _, (kind, detail) in _guards("output_router_logits on one rank"):
        assert kind == "refused" and "got output_router_logits=True on 1 of the 2 ranks" in detail, detail
    for rank, (kind, detail) in _guards("num_items_in_batch on one rank"):
        assert kind == "refused", detail
        assert ("num_items_in_batch= is not supported" if rank == 1 else "another rank of the CP group refused") \
            in detail, detail
        assert rank != 1 or "or train with ctxpar.integrations.transformers.ContextParallelTrainer" in detail, detail


def test_shards_of_different_batches_are_refused_on_every_rank() -> None:
    """Each CP rank sharding a batch of its own (a DistributedSampler over every rank) ran
    without a word, attention mixing the batches."""
    for check in ("another batch", "another batch, decoder"):
        for _, (kind, detail) in _guards(check):
            assert kind == "refused" and "got shards of different batches on the ranks of the CP group" in detail, \
                (check, detail)


def test_a_model_of_another_config_on_one_rank_is_refused_on_every_rank() -> None:
    """rms_norm_eps 1e-2 on one rank (the others 1e-6), or other weights, gave a loss and
    gradients without a word."""
    for check in ("another config on one rank", "another config on one rank, decoder"):
        for _, (kind, detail) in _guards(check):
            assert kind == "refused" and "has another config on some rank of the CP group" in detail, (check, detail)
    for _, (kind, detail) in _guards("other weights on one rank"):  # compared at the first forward
        assert kind == "refused" and "has other weights on some rank of the CP group" in detail, detail


def test_training_mode_on_some_ranks_only_is_refused_on_every_rank() -> None:
    """model.train() on one rank and model.eval() on the other ran without a word: dropout
    acted on one rank's shard alone (GPT-2 with dropout 0.3: a loss of 3.8823 where the eval
    loss is 3.8777), with labels= or without (logits 0.23 off)."""
    for check in ("train mode on one rank", "train mode on one rank, no labels"):
        for _, (kind, detail) in _guards(check):
            assert kind == "refused" and "is in training mode on 1 of the 2 ranks of the CP group" in detail, detail
            assert "call model.train() or model.eval() on every rank" in detail, detail


def test_layerdrop_set_on_one_rank_after_enabling_is_refused_on_every_rank() -> None:
    for rank, (kind, detail) in _guards("layerdrop on one rank"):
        assert kind == "refused" and (
            "has model.layerdrop=0.5 in training mode: LayerDrop" if rank == 1 else
            "another rank of the CP group refused its inputs for this forward") in detail, (rank, detail)


def test_hybrid_on_a_mesh_gives_the_unsplit_loss_logits_and_gradients() -> None:
    """strategy="hybrid" on a 2x2 mesh of 4 ranks (zigzag, unevenly ignored labels)."""
    for rank, res in enumerate(hf_cases.results()):
        r = res["hybrid"]["whole"]
        assert r["loss_err"] <= 1e-5 and r["logits_err"] <= 1e-5 and r["grad_err"] <= 1e-4, (rank, r)


def test_hybrid_replicas_each_run_their_own_batch_and_loss_alone() -> None:
    """Two data-parallel replicas, each a hybrid mesh of 2 ranks: the forward's checks and its
    labels= loss ran on WORLD, so each replica's loss averaged both batches, a forward on one
    replica alone waited for the other, and shards of two batches were never compared."""
    runs = [res["hybrid"] for res in hf_cases.results()]
    for rank, r in enumerate(runs):
        assert r["replica"]["loss_err"] <= 1e-5 and r["replica"]["logits_err"] <= 1e-5, (rank, r["replica"])
        assert r["replica"]["grad_err"] <= 1e-4, (rank, r["replica"])
    assert abs(runs[0]["replica"]["loss"] - runs[2]["replica"]["loss"]) > 1e-3  # two batches, two losses
    for rank, r in enumerate(runs):
        if rank < hf_cases.SWEEP_P:
            kind, detail = r["one replica"]
            assert kind == "ran" and detail <= 1e-5, (rank, detail)
            kind, detail = r["another batch on replica 0"]
            assert kind == "refused" and "got shards of different batches" in detail, (rank, detail)
        else:
            assert "one replica" not in r
            assert r["another batch on replica 0"][0] == "ran", (rank, r["another batch on replica 0"])


def test_a_deep_copy_runs_its_own_weights_on_the_same_group() -> None:
    """copy.deepcopy of an enabled model (a frozen reference model, an EMA copy) ran the
    original's weights, its wrappers closing over the original; with group= it raised
    (a ProcessGroup cannot be pickled)."""
    for _, got in _guards("deep copy"):
        assert got == ("ran", (0.0, True)), got


def test_a_deep_copy_is_enabled_alike_and_trains_its_own_weights() -> None:
    """The copy leaves the original as it was, and keeps what others set on its modules."""
    mlp = (built := hf_families.build("llama")).model.layers[0].mlp
    mlp.forward = mlp.forward  # an instance attribute of someone else's, as accelerate's hooks set
    model, inputs, labels = _one_rank(built)
    copied = copy.deepcopy(model)
    assert "forward" in copied.model.layers[0].mlp.__dict__
    with pytest.raises(ValueError, match="logits_to_keep=1"):  # the original is still enabled
        model(**inputs, logits_to_keep=1)
    copied(**inputs, labels=labels).loss.backward()
    assert all(p.grad is None for p in model.parameters()) and all(p.grad is not None for p in copied.parameters())
    torch.testing.assert_close(copied(**inputs).logits, model(**inputs).logits)
    with pytest.raises(ValueError, match="logits_to_keep=1"):  # the copy is guarded as the original is
        copied(**inputs, logits_to_keep=1)
    decoder = copy.deepcopy(model.model)
    with torch.no_grad():
        decoder.embed_tokens.weight.zero_()
        assert decoder(**inputs).last_hidden_state.abs().max() == 0
    assert model.model(**inputs).last_hidden_state.abs().max() > 0


def test_enable_takes_a_layout_name_and_refuses_a_bad_layout_or_strategy_at_once() -> None:
    """A layout name reached the first forward as a string (an AttributeError there); a
    misspelt strategy was refused only inside the first attention layer."""
    model, inputs, labels = _one_rank(hf_families.build("llama"))
    by_name = enable_context_parallel(hf_families.build("llama"), layout="zigzag", strategy="auto")
    torch.testing.assert_close(by_name(**inputs).logits, model(**inputs).logits)
    for change, message in ((dict(strategy="rnig"), "unknown strategy 'rnig'"),
                            (dict(layout=ctxpar.get_layout("zigzag", 2)), "is for P=2 ranks but torch.distributed"),
                            (dict(layout="spiral"), "unknown layout 'spiral'"),
                            # a mesh with the default strategy was refused only at the first forward
                            (dict(mesh=object()), "mesh= is for strategy='hybrid'"),
                            (dict(strategy="auto", mesh=object()), r"strategy='auto' chooses among .*\(for auto on "
                                                                   r"the mesh's ranks, pass group= a process group"),
                            (dict(strategy="hybrid"), "strategy='hybrid' takes mesh=")):
        fresh = hf_families.build("llama")
        with pytest.raises(ValueError, match=message):
            enable_context_parallel(fresh, **{"layout": "zigzag", **change})
        assert fresh.config._attn_implementation != "ctxpar"  # refused before anything changed
    # a wrapper (PEFT-like) was refused for positions it hands on, or with an AttributeError after its
    # modules had been changed
    fresh = hf_families.build("llama")
    wrapper = torch.nn.ModuleDict(dict(model=fresh))
    with pytest.raises(ValueError, match="takes a transformers PreTrainedModel, got ModuleDict; enable the model "
                                         "inside it first, then wrap it"):
        enable_context_parallel(wrapper, layout="zigzag")
    assert not hasattr(fresh, "ctxpar_settings")


def test_a_model_sharing_the_config_of_an_enabled_one_is_told_why_it_cannot_run() -> None:
    """Two models built from one config object: enabling one switches the config the other
    reads too, which it then refused as "not prepared" without saying why."""
    enabled = hf_families.build("llama")
    bystander = type(enabled)(enabled.config)
    enable_context_parallel(enabled, layout=ONE)
    with pytest.raises(ValueError, match=r"shares its config with one given to enable_context_parallel"):
        bystander(input_ids=torch.randint(3, hf_families.VOCAB, (1, 8)))
    own = type(enabled)(copy.deepcopy(enabled.config))
    own.set_attn_implementation("sdpa")  # the fix the message gives, for a model built from the enabled one's config
    assert own(input_ids=torch.randint(3, hf_families.VOCAB, (1, 8))).logits.shape == (1, 8, hf_families.VOCAB)
    assert enabled.config._attn_implementation == "ctxpar"


def test_pickling_an_enabled_model_is_refused_saying_what_to_save(tmp_path) -> None:
    """torch.save(model) failed with "Can't pickle <function LlamaModel.forward>: it's not the
    same object as transformers...", blaming transformers for ctxpar's wrapper."""
    model, _, _ = _one_rank(hf_families.build("llama"))
    for whole in (model, model.model):
        with pytest.raises(TypeError, match="cannot be pickled or shallow-copied while context parallelism is enabled"):
            torch.save(whole, tmp_path / "model.pt")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    model.save_pretrained(tmp_path / "pretrained")
    assert (tmp_path / "pretrained" / "config.json").exists()


def test_a_bfloat16_models_labels_loss_is_taken_in_float32_as_transformers_takes_it() -> None:
    """A bf16 model's logits: transformers upcasts them for its cross-entropy. Taken in
    bfloat16, the loss was off by 0.0082 (a float64 reference on the same logits) and came
    back in bfloat16."""
    torch.manual_seed(0)
    ids = torch.randint(3, hf_families.VOCAB, (1, 128))
    plain = hf_families.build("llama").to(torch.bfloat16)
    model = enable_context_parallel(hf_families.build("llama").to(torch.bfloat16), layout=ONE)
    inputs, labels = shard_inputs(ids, layout=ONE, rank=0)
    with torch.no_grad():
        want = plain(input_ids=ids, labels=ids, use_cache=False).loss
        got = model(**inputs, labels=labels)
    exact = torch.nn.functional.cross_entropy(got.logits.double().flatten(0, 1), labels.flatten())
    assert got.loss.dtype == want.dtype == torch.float32
    assert abs(got.loss.item() - exact.item()) <= 1e-6  # float32 accumulation: 7e-8 off here
    assert abs(got.loss.item() - want.item()) <= 5e-4  # the two attentions' bfloat16 logits differ: 3e-5 here


def test_a_model_under_autocast_runs_as_its_sdpa_model_does() -> None:
    """A Trainer's bf16=True: RoPE leaves q and k in float32 and v in bfloat16, which was
    refused ("q, k, v dtypes differ"); SDPA under autocast casts all three."""
    model, inputs, labels = _one_rank(hf_families.build("llama"))
    reference = hf_families.build("llama")
    reference.set_attn_implementation("sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(**inputs, labels=labels).loss
        want = reference(**{k: v for k, v in inputs.items() if k != "use_cache"}, labels=inputs["input_ids"]).loss
    assert got.item() == pytest.approx(want.item(), rel=1e-3)


def test_a_padding_mask_on_one_rank_is_refused_on_every_rank_together() -> None:
    """A left-padded row: after sharding only rank 0 holds zeros of the mask. Rank 0 says
    why, rank 1 that another rank refused; nobody waits in attention. So too when the padded
    row is the second of two (the first row alone was checked: rank 1 waited in attention)."""
    for rank, (kind, detail) in _guards("padding on one rank"):
        assert kind == "refused", detail
        assert ("padding masks are not supported" if rank == 0 else "another rank of the CP group refused") in detail
    # two rows, the second one's padding on rank 0 alone: a check of the first row alone let rank 0 refuse later,
    # alone, in the mask's forward (its message without the model's name) while rank 1 waited in attention
    for rank, (kind, detail) in _guards("padding in a second row on one rank"):
        assert kind == "refused", detail
        assert ("LlamaForCausalLM: padding masks are not supported" if rank == 0 else
                "another rank of the CP group refused") in detail, (rank, detail)


def test_an_attention_implementation_switched_on_one_rank_is_refused_on_every_rank() -> None:
    """set_attn_implementation("sdpa") on rank 1 after enable_context_parallel: every rank
    refuses the forward; switched back, the next forward runs."""
    for rank, (kind, detail) in _guards("sdpa on one rank"):
        assert kind == "refused", detail
        assert ("attention implementation is now 'sdpa'" if rank == 1 else "another rank of the CP group refused") \
            in detail, detail
    for _, got in _guards("after"):
        assert got == ("ran", (1, hf_cases.SWEEP_TOKENS // 2, hf_families.VOCAB)), got


@pytest.mark.parametrize("check, refusal", [("attention keyword", "asks for attention logit soft-capping"),
                                            ("attention scale", "LlamaAttention passes scaling=inf")])
def test_a_layers_refusal_on_one_rank_is_refused_on_every_rank(check: str, refusal: str) -> None:
    """softcap= on rank 1 alone reaches its attention layers alone, and so does a scale set on
    rank 1's layer alone: refused there, while rank 0 waited in attention's first exchange
    (until the timeout, or "Connection closed by peer" once rank 1 had gone). Both refuse,
    and the next forward runs."""
    for rank, (kind, detail) in _guards(f"{check} on one rank"):
        assert kind == "refused", detail
        assert (refusal if rank == 1 else "of the CP group rejected their attention inputs; see their errors") \
            in detail, detail
    for _, got in _guards(f"after {check}"):
        assert got == ("ran", (1, hf_cases.SWEEP_TOKENS // 2, hf_families.VOCAB)), got


def test_a_token_beyond_the_vocabulary_is_refused_on_every_rank_through_an_adapters_embedding() -> None:
    """PEFT's LoRA on the embedding keeps the nn.Embedding as its base_layer: the token check,
    reading num_embeddings off the wrapper, skipped it, and the rank holding the id failed alone
    (IndexError) while the other waited in attention until the timeout."""
    for rank, (kind, detail) in _guards("token beyond the vocabulary, embedding wrapped"):
        assert kind == "refused", detail
        want = f"outside its vocabulary of {hf_families.VOCAB}" if rank == 1 else "another rank of the CP group refused"
        assert want in detail, (rank, detail)


def test_a_label_outside_the_vocabulary_on_one_rank_is_refused_on_every_rank_together() -> None:
    """One label id beyond the vocabulary (or -1 for "ignore") in the batch lands on one rank's
    shard: cross_entropy's IndexError there left the other rank waiting in the loss's
    all-reduce until the timeout. Now that rank names it, the other says a rank refused, and
    the next forward runs."""
    for check, bad_rank, value in (("label beyond the vocabulary on rank 1", 1, hf_families.VOCAB),
                                   ("label -1 on rank 0", 0, -1)):
        for rank, (kind, detail) in _guards(check):
            assert kind == "refused", (check, detail)
            if rank != bad_rank:
                assert "another rank of the CP group refused" in detail, (check, detail)
                continue
            shown = f"from {value} to" if value < 0 else f"to {value} (besides -100, which marks a token without"
            assert "LlamaForCausalLM labels= got token ids" in detail and shown in detail, (check, detail)
            assert f"outside its vocabulary of {hf_families.VOCAB}" in detail, (check, detail)
    for _, (kind, detail) in _guards("after bad labels"):
        assert kind == "ran" and detail > 0, detail


def test_unshifted_labels_with_the_last_token_masked_are_refused_on_every_rank() -> None:
    """A fine-tuning copy of the tokens with its prompt and last token masked labels no last
    token: the ranks gather the rows to see labels that equal their tokens but not the next."""
    for _, (kind, detail) in _guards("unshifted labels, last masked"):
        assert kind == "refused" and "next-token labels would hold the following token" in detail, detail
        assert "unshifted labels" in detail, detail


def test_per_token_heads_run_exactly_and_their_positions_or_labels_are_refused() -> None:
    """Token classification and question answering score every token, so their outputs split
    with the tokens (2 ranks, zigzag). start_positions / end_positions index the whole sequence
    while a rank's logits cover its shard: refused on every rank, where the loss was handed to
    the causal-LM loss and refused after the forward as "num_items_in_batch"."""
    for head in ("LlamaForTokenClassification", "LlamaForQuestionAnswering"):
        for rank, got in _guards(head):
            assert got <= 1e-5, (head, rank, got)
    for _, (kind, detail) in _guards("question answering positions"):
        assert kind == "refused" and "LlamaForQuestionAnswering got start_positions=" in detail, detail
    for rank, got in _guards("token_type_ids"):  # sharded by shard_inputs: GPT-2's logits with segment ids
        assert got <= 1e-5, (rank, got)
    for _, (kind, detail) in _guards("whole token_type_ids"):
        assert kind == "refused" and "GPT2LMHeadModel got token_type_ids (1, 16) for input_ids (1, 8)" in detail, detail
    for case in ("token classification labels", "subclass labels"):  # shifted by shard_inputs: once a wrong loss
        for _, (kind, detail) in _guards(case):
            assert kind == "refused" and "its head (ForTokenClassification) scores each token" in detail, detail
