"""The fidelity guard: every causal-LM family of the installed transformers is either refused
by ``enable_context_parallel`` naming its features, or runs under CP exactly as unsplit.

The per-family verdicts come from ``hf_cases.sweep`` (CP groups of 2 gloo ranks, zigzag,
16 tokens, windows of 4); the rest runs here at world size 1 without a process group.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

import hf_cases  # noqa: E402
import hf_families  # noqa: E402
import torch  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

import ctxpar  # noqa: E402
from ctxpar.integrations.transformers import enable_context_parallel, shard_inputs  # noqa: E402
from ctxpar.parallelize import IGNORE_INDEX  # noqa: E402

ONE = ctxpar.get_layout("zigzag", 1)


def _verdicts(case: str) -> list[tuple]:
    """The verdict of every rank of the CP group that ran ``case``."""
    return [res["sweep"][case] for res in hf_cases.results() if case in res["sweep"]]


@pytest.mark.parametrize("case", hf_families.CASES)
def test_family_is_refused_naming_its_features_or_runs_exactly(case: str) -> None:
    verdicts = _verdicts(case)
    assert len(verdicts) == hf_cases.SWEEP_P, f"{case} ran on {len(verdicts)} ranks"
    want = set(hf_families.REFUSED.get(case, ()))
    for kind, detail in verdicts:
        if want:
            assert kind == "refused", f"{case} must be refused for {sorted(want)}; it {kind}: {detail}"
            named = {feature for feature in hf_families.FEATURES if feature in detail}
            assert named == want, f"{case}: the error names {sorted(named)}, not {sorted(want)}:\n{detail}"
        else:
            assert kind == "ran", f"{case} must run under CP; it was {kind}: {detail}"
            assert detail <= 1e-5, f"{case}: CP logits differ from the unsplit model's by {detail:.3g} (relative)"


def test_every_causal_lm_family_is_tested_or_listed_with_a_reason() -> None:
    families = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert families == set(hf_families.CASES) - set(hf_families.VARIANTS) | set(hf_families.UNBUILDABLE)
    # built from defaults on the meta device, they can only be checked as refusals
    assert set(hf_families.DEFAULT_ON_META) <= set(hf_families.REFUSED)


def test_the_readme_counts_the_families_this_guard_refuses_and_runs() -> None:
    """The README's counts once stayed at 114 refused / 81 run while the guard moved to 90 / 105."""
    from pathlib import Path

    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    tested = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) & set(hf_families.CASES)
    refused = sum(1 for family in tested if hf_families.REFUSED.get(family))
    assert f"{len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} in" in readme
    assert f"the expected features ({refused})" in readme
    assert f"a relative 1e-5 ({len(tested) - refused})" in readme


def _one_rank(case: str, tokens: int = 8):
    model = enable_context_parallel(hf_families.build(case), layout=ONE)
    inputs, _ = shard_inputs(torch.randint(3, hf_families.VOCAB, (1, tokens)), layout=ONE, rank=0)
    return model, inputs


def test_unknown_keyword_arguments_are_refused_not_dropped() -> None:
    model, inputs = _one_rank("llama")
    with pytest.raises(ValueError, match="passed the keyword argument 'attn_bias' to its attention function"):
        model(**inputs, attn_bias=torch.zeros(1))


@pytest.mark.parametrize("key, value, refusal", [
    ("softcap", 30.0, "LlamaAttention asks for .*soft-capping.*softcap="),
    ("position_bias", torch.zeros(1, 4, 8, 8), "LlamaAttention asks for .*position bias.*position_bias="),
    ("cu_seq_lens_q", torch.tensor([0, 4, 8]), "LlamaAttention asks for .*packed sequences.*cu_seq_lens_q="),
    # by the forward, where every rank agrees (a layer's refusal on one rank left the others waiting)
    ("output_attentions", True, "LlamaForCausalLM asks for output_attentions=True"),
])
def test_attention_features_passed_at_call_time_are_refused(key: str, value, refusal: str) -> None:
    model, inputs = _one_rank("llama")
    with pytest.raises(ValueError, match=refusal):
        model(**inputs, **{key: value})


def test_a_sliding_window_argument_the_mask_does_not_carry_is_refused() -> None:
    """Eager attention would follow the (plain causal) mask, flash attention the argument."""
    model, inputs = _one_rank("llama")
    with pytest.raises(ValueError, match="LlamaAttention passes sliding_window=4 but its attention mask has no window"):
        model(**inputs, sliding_window=4)


def test_layerdrop_set_after_enabling_is_refused_in_training() -> None:
    """enable_context_parallel refuses LayerDrop it finds; set afterwards, each rank skipped
    layers of its own in training, its peers waiting in their attention until the timeout."""
    model, inputs = _one_rank("opt")
    model.model.decoder.layerdrop = 0.5
    model.train()
    with pytest.raises(ValueError, match=re.escape("has model.decoder.layerdrop=0.5 in training mode: LayerDrop")):
        model(**inputs)
    model.eval()
    model(**inputs)  # no layer is dropped in eval mode


def test_a_sliding_window_of_no_keys_is_refused_naming_the_config() -> None:
    """Qwen2 with sliding_window=0 (its mask hides every key): refused by the mask code,
    "window must be an integer >= 1", naming no model and no config field."""
    model = enable_context_parallel(hf_families.build("qwen2", sliding_window=0, use_sliding_window=True,
                                                      max_window_layers=0, layer_types=None), layout=ONE)
    inputs, _ = shard_inputs(torch.randint(3, hf_families.VOCAB, (1, 8)), layout=ONE, rank=0)
    with pytest.raises(ValueError, match=re.escape("Qwen2Attention's attention mask has a sliding window of 0 keys "
                                                   "(the config's sliding_window), which hides every key")):
        model(**inputs)


@pytest.mark.parametrize("scaling", [0.173, torch.tensor(0.173, dtype=torch.float64)], ids=["float", "tensor"])
def test_a_non_default_scale_is_honoured_exactly(scaling) -> None:
    """Every attention module scales by 0.173 instead of head_dim ** -0.5 (8 ** -0.5 = 0.354),
    a float or a one-element tensor (a scale restored as a buffer); a learned or per-element
    scale tensor is refused."""
    reference = hf_families.build("llama")
    reference.set_attn_implementation("eager")  # takes a tensor scale
    model = hf_families.build("llama")
    for m in (*reference.modules(), *model.modules()):
        if hasattr(m, "scaling"):
            m.scaling = scaling
    tokens = torch.randint(3, hf_families.VOCAB, (2, 8))
    with torch.no_grad():
        want = reference(input_ids=tokens, use_cache=False).logits
        enable_context_parallel(model, layout=ONE)
        got = model(**shard_inputs(tokens, layout=ONE, rank=0)[0]).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    with torch.no_grad():
        plain = hf_families.build("llama")(input_ids=tokens, use_cache=False).logits
    assert (plain - want).abs().max() > 1e-3 * want.abs().max()  # the scale matters on these inputs
    if isinstance(scaling, torch.Tensor):
        for refused, words in ((torch.tensor([0.1, 0.2]), "per-element attention scale tensor of shape (2,)"),
                               (torch.tensor(0.173, requires_grad=True), "learned attention scale tensor of shape ()")):
            for m in model.modules():
                if hasattr(m, "scaling"):
                    m.scaling = refused
            with pytest.raises(ValueError, match=re.escape(words)), torch.no_grad():
                model(**shard_inputs(tokens, layout=ONE, rank=0)[0])


def test_a_sliding_window_argument_other_than_the_masks_window_is_refused() -> None:
    """gpt-oss passes its module's window, the mask carries the config's: eager attention would
    follow the mask, flash attention the argument."""
    from ctxpar.integrations.transformers.attention import LayerMask, Settings, attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    module.ctxpar_settings = Settings(ONE, None, "ring", None)
    q = torch.randn(1, 2, 16, 4)
    with pytest.raises(ValueError, match="passes sliding_window=2 but its attention mask has window 4"):
        attention_forward(module, q, q, q, LayerMask(window=4), scaling=None, sliding_window=2)
    got, _ = attention_forward(module, q, q, q, LayerMask(window=4), scaling=None, sliding_window=4)
    assert got.shape == (1, 16, 2, 4)


def test_the_default_scale_is_the_query_head_dims_when_values_are_wider() -> None:
    """MLA shapes (DeepSeek): q and k of head dim 4, v of 8, scaling=None. The default scale is
    Dqk ** -0.5 = 0.5; once it was taken from the zero-padded width max(Dqk, Dv) (8 ** -0.5),
    the output off by 0.45."""
    from ctxpar.integrations.transformers.attention import LayerMask, Settings, attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    module.ctxpar_settings = Settings(ONE, None, "ring", None)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 8)
    got, _ = attention_forward(module, q, k, v, LayerMask(), scaling=None)  # (B, S, H, Dv)
    visible = torch.ones(16, 16, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible,
                                                            scale=4**-0.5).transpose(1, 2)
    assert got.shape == (1, 16, 2, 8)
    assert (got.double() - want).abs().max().item() <= 1e-5


def test_attention_dropout_is_refused_at_enable_time_and_at_call_time() -> None:
    with pytest.raises(ValueError, match=r"attention dropout \(GPT2Config.attn_pdrop=0.1\); set attn_pdrop=0"):
        enable_context_parallel(hf_families.build("gpt2+dropout", meta=True), layout=ONE)
    model, inputs = _one_rank("llama")
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1  # set after the guard ran
    model.train()
    with pytest.raises(ValueError, match="applies attention dropout p=0.1"):
        model(**inputs)


def test_layerdrop_is_refused_at_enable_time() -> None:
    """OPT's LayerDrop: in training each rank drew the layers it skips from its own RNG; ranks
    skipping different layers attended with each other's K/V of another layer (a wrong loss,
    silently) or waited on each other until the timeout."""
    with pytest.raises(ValueError, match=r"LayerDrop .* \(OPTConfig.layerdrop=0.5, model.decoder.layerdrop=0.5\); "
                                         r"set layerdrop=0"):
        enable_context_parallel(hf_families.build("opt", meta=True, layerdrop=0.5), layout=ONE)
    model = hf_families.build("opt", meta=True)
    model.model.decoder.layerdrop = 0.3  # on the module, after its config
    with pytest.raises(ValueError, match=r"LayerDrop .* \(model.decoder.layerdrop=0.3\); set it to 0"):
        enable_context_parallel(model, layout=ONE)


def test_custom_masks_and_cross_attention_are_refused() -> None:
    model, inputs = _one_rank("llama")
    with pytest.raises(ValueError, match=r"explicit attention mask \(1, 1, 8, 8\)"):
        model(**inputs, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))

    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        chunked_causal_mask_function,
        or_masks,
        sliding_window_bidirectional_mask_function,
        sliding_window_causal_mask_function,
    )

    from ctxpar.integrations.transformers.attention import RefusedMask, attention_forward, mask_forward

    from ctxpar.integrations.transformers.attention import LayerMask

    chunks = mask_forward(mask_function=chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)))
    assert chunks == LayerMask(chunk=4)
    windowed = mask_forward(mask_function=sliding_window_causal_mask_function(3))
    assert windowed == LayerMask(window=3)
    assert mask_forward(mask_function=causal_mask_function) == LayerMask(causal=True)
    assert mask_forward(mask_function=bidirectional_mask_function) == LayerMask(causal=False)
    refused = mask_forward(mask_function=sliding_window_bidirectional_mask_function(3))
    assert isinstance(refused, RefusedMask) and "has a bidirectional sliding window, which" in refused.reason
    padded = mask_forward(mask_function=chunked_causal_mask_function(4, torch.tensor([2])))
    assert isinstance(padded, RefusedMask) and "left padding" in padded.reason
    union = mask_forward(mask_function=or_masks(sliding_window_causal_mask_function(3), lambda *a: True))
    assert isinstance(union, RefusedMask)
    attention = next(m for m in model.modules() if type(m).__name__ == "LlamaAttention")
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="LlamaAttention: its attention mask has a bidirectional sliding window"):
        attention_forward(attention, q, q[:, :2], q[:, :2], refused)
    # the layer's flag against its mask: Gemma's use_bidirectional_attention layers over the causal mask its
    # model builds (transformers' eager attention follows the mask, its sdpa the flag)
    attention.is_causal = False
    with pytest.raises(ValueError, match="attends bidirectionally over a causal mask; ctxpar refuses"):
        attention_forward(attention, q, q, q, LayerMask(causal=True))

    bert, bert_inputs = _one_rank("bert+decoder")
    with pytest.raises(ValueError, match="cross-attention"):
        bert(**bert_inputs, encoder_hidden_states=torch.zeros(1, 5, 32))


def test_composed_masks_are_read_as_the_pairs_their_functions_allow() -> None:
    """describe_mask over transformers' and_masks / or_masks, against the mask function itself
    on a 12 x 12 grid: causal OR bidirectional sees everything (it was read as causal once
    or_masks took any part's causal flag: 78 pairs for 144), and an intersection of windows
    is the smallest (it was read as the largest once and_masks kept the max: 68 pairs for 42)."""
    from transformers.masking_utils import (
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )

    from ctxpar.integrations.transformers.attention import LayerMask, describe_mask
    from ctxpar.masks import make_mask

    seq_len = 12
    cases = {
        "or(causal, bidirectional)": (or_masks(causal_mask_function, bidirectional_mask_function),
                                      LayerMask(causal=False)),
        "and(causal, window 4, window 8)": (and_masks(causal_mask_function, sliding_window_overlay(4),
                                                      sliding_window_overlay(8)), LayerMask(window=4)),
        "and(and(window 8, causal), window 4)": (and_masks(and_masks(sliding_window_overlay(8), causal_mask_function),
                                                           sliding_window_overlay(4)), LayerMask(window=4)),
    }
    zero, positions = torch.tensor(0), torch.arange(seq_len)
    for name, (fn, expected) in cases.items():
        want = torch.tensor([[bool(fn(zero, zero, torch.tensor(q), torch.tensor(k))) for k in range(seq_len)]
                             for q in range(seq_len)])
        described = describe_mask(fn)
        got = make_mask(seq_len, causal=described.causal, window=described.window).visible(positions, positions,
                                                                                          seq_len)
        assert torch.equal(got, want), (name, described, int(got.sum()), int(want.sum()))
        assert described == expected, (name, described)


def test_heads_that_pool_over_the_sequence_are_refused_at_enable_time() -> None:
    """LlamaForSequenceClassification was accepted and read each rank's shard's last token:
    2 ranks, rank 1's logits off by 0.25. Heads that score every token stay accepted (their
    outputs under CP: test_transformers.py)."""
    import transformers

    from ctxpar.integrations.transformers import find_unsupported

    config = hf_families.config_for("llama", num_labels=3, pad_token_id=0)
    for head, where in (("LlamaForSequenceClassification", "LlamaForSequenceClassification"),
                        ("GPT2DoubleHeadsModel", "GPT2SequenceSummary")):
        with torch.device("meta"):
            model = getattr(transformers, head)(hf_families.config_for("gpt2") if "GPT2" in head else config)
        with pytest.raises(ValueError, match=rf"a head that pools over the sequence.*\({where}\); run its base model"):
            enable_context_parallel(model, layout=ONE)
        assert model.config._attn_implementation != "ctxpar"  # refused before anything changed
    for head in ("LlamaForTokenClassification", "LlamaForQuestionAnswering"):
        with torch.device("meta"):
            assert find_unsupported(getattr(transformers, head)(config)) == [], head


def _encoder(kind: str, **config):
    """A tiny transformers encoder (``kind``'s Config and Model), float64, eval, eager."""
    import transformers

    torch.manual_seed(0)
    sizes = dict(vocab_size=hf_families.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64, attention_probs_dropout_prob=0.0,
                 hidden_dropout_prob=0.0, initializer_range=0.3)
    built = getattr(transformers, f"{kind}Config")(**{**sizes, **config})
    return getattr(transformers, f"{kind}Model")._from_config(built, attn_implementation="eager").double().eval()


def test_an_encoder_whose_layers_carry_no_causal_flag_attends_as_its_mask_says() -> None:
    """Splinter's attention has no is_causal: its bidirectional mask decides (it was taken for
    causal, the hidden states off by 0.42)."""
    ids = torch.randint(3, hf_families.VOCAB, (2, 8))
    want = _encoder("Splinter")(input_ids=ids).last_hidden_state
    model = enable_context_parallel(_encoder("Splinter"), layout=ONE)
    inputs, _ = shard_inputs(ids, layout=ONE, rank=0)
    got = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).last_hidden_state
    assert (got - want).abs().max().item() <= 1e-6  # Splinter's eager softmax runs in float32


def test_outputs_one_shard_cannot_give_are_refused() -> None:
    """ALBERT's pooler (an nn.Linear named pooler) at enable time; CLIP's text model pools inline
    at the largest token id: refused once the forward returns it (each rank had its own
    shard's), also where return_dict=False would have hidden it in a tuple."""
    with pytest.raises(ValueError, match=r"a pooler: .*\(pooler: Linear\); build the model without it"):
        enable_context_parallel(_encoder("Albert", embedding_size=16), layout=ONE)
    from ctxpar.integrations.transformers import find_unsupported

    albert = _encoder("Albert", embedding_size=16)
    assert find_unsupported(type(albert)(albert.config, add_pooling_layer=False)) == []
    ids = torch.randint(3, hf_families.VOCAB, (1, 8))
    inputs, _ = shard_inputs(ids, layout=ONE, rank=0)
    clip = enable_context_parallel(_encoder("CLIPText"), layout=ONE)
    plain = dict(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
    with pytest.raises(ValueError, match="CLIPTextModel returned pooler_output, computed from this rank's shard"):
        clip(**plain)
    with pytest.raises(ValueError, match="CLIPTextModel returned pooler_output"):  # not hidden in a tuple
        clip(**plain, return_dict=False)

    class Named(type(clip)):  # return_dict a parameter of its own forward, as older models' is
        def forward(self, input_ids=None, position_ids=None, return_dict=None, **kwargs):
            return super().forward(input_ids=input_ids, position_ids=position_ids, return_dict=return_dict, **kwargs)

    named = enable_context_parallel(Named._from_config(clip.config, attn_implementation="eager").double(), layout=ONE)
    with pytest.raises(ValueError, match="Named returned pooler_output"):
        named(**plain, return_dict=False)


def test_mobilebert_trigram_embeddings_are_refused() -> None:
    """Each token's embedding concatenates its neighbours' (F.pad of the shifted sequence): a
    shard's edge tokens read zeros, logits off by 0.075 on 2 ranks."""
    import transformers

    config = transformers.MobileBertConfig(vocab_size=hf_families.VOCAB, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=4, intermediate_size=64, embedding_size=16,
                                           intra_bottleneck_size=32, true_hidden_size=32)
    with torch.device("meta"):
        model = transformers.MobileBertForTokenClassification(config)
    with pytest.raises(ValueError, match=r"neighbours along the sequence \(MobileBertConfig.trigram_input=True\)"):
        enable_context_parallel(model, layout=ONE)


def test_the_report_names_every_feature_and_llama_has_none() -> None:
    from ctxpar.integrations.transformers import find_unsupported

    assert find_unsupported(hf_families.build("llama", meta=True)) == []
    with pytest.raises(ValueError) as refused:
        enable_context_parallel(hf_families.build("gemma2", meta=True), layout=ONE)
    message = str(refused.value)
    assert "Gemma2ForCausalLM cannot run exactly under context parallelism" in message
    assert "attention logit soft-capping (Gemma2Config.attn_logit_softcapping=50.0" in message
    assert "sliding" not in message  # honoured


def test_dynamic_rope_scaling_runs_below_its_limit_and_is_refused_past_it_on_every_rank() -> None:
    """Dynamic NTK scaling recomputes the frequencies from the largest position a forward
    sees once it passes max_position_embeddings: each rank would rotate with its own. Below
    the limit it is the default RoPE (the family sweep's llama+dynamic-rope runs exactly);
    past it (16 tokens, limit 8) every rank refuses, naming the limit."""
    for res in hf_cases.results():
        kind, detail = res["guards"]["dynamic rope past its limit"]
        assert kind == "refused" and "dynamic RoPE scaling" in detail and "max_position_embeddings=8" in detail, \
            detail


def test_rope_limits_are_checked_at_their_exact_edges() -> None:
    """check_rope_lengths on one process (16 tokens, contiguous over 2 ranks: rank 0 holds
    positions 0-7). LongRoPE with limit 15: the sequence's largest position 15 reaches it, so
    rank 0 (up to 7) would keep the short factors: refused (it ran once the check skipped a
    largest position equal to the limit: logits off by 1.2e-3). Dynamic RoPE with limit 16:
    16 tokens is max_position_embeddings, refused (it ran once only largest >= limit was
    refused: off by 6e-5 after a longer call); limit 17 runs."""
    from ctxpar.integrations.transformers.attention import Settings, check_rope_lengths

    def verdict(**limits) -> str:
        try:
            check_rope_lengths("M", Settings(ctxpar.get_layout("contiguous", 2), None, "ring", None, **limits), 16,
                               None)
        except ValueError as e:
            return str(e)
        return "runs"

    assert "uses LongRoPE" in verdict(longrope=(15,)) and "rank 0 holds positions up to 7" in verdict(longrope=(15,))
    assert verdict(longrope=(17,)) == "runs"
    assert "dynamic RoPE scaling" in verdict(dynamic=(16,)) and "max_position_embeddings=16" in verdict(dynamic=(16,))
    assert verdict(dynamic=(17,)) == "runs"


def test_longrope_runs_exactly_where_every_rank_uses_the_sequences_factors_and_is_refused_elsewhere() -> None:
    """LongRoPE switches to its long factors when the largest position a forward sees
    reaches original_max_position_embeddings (8). On 16 tokens over 2 ranks, zigzag and
    striped give every rank a position past 8: the unsplit logits; contiguous leaves rank 0
    positions 0-7: refused on both ranks, naming the limit and the rank."""
    for res in hf_cases.results():
        got = res["guards"]
        assert got["longrope effect"] > 1e-3  # the long factors change the logits
        for name in ("zigzag", "striped"):
            kind, detail = got[f"longrope {name}"]
            assert kind == "ran" and detail <= 1e-5, f"{name}: {detail}"
        kind, detail = got["longrope contiguous"]
        assert kind == "refused", detail
        assert "uses LongRoPE" in detail and "original_max_position_embeddings=8" in detail and "rank 0" in detail


# -- guards of the attention forward, the labels and the fidelity check, one process --------------------------


def _module(**attributes) -> torch.nn.Module:
    from ctxpar.integrations.transformers.attention import Settings

    module = torch.nn.Module()
    module.is_causal = True
    module.ctxpar_settings = Settings(ONE, None, "ring", None)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def test_sinks_a_layer_holds_but_does_not_pass_are_refused() -> None:
    """A layer with a sinks parameter that does not hand it to its attention function as s_aux=
    (a family ported from gpt-oss that applies them otherwise, or not at all): ctxpar cannot tell
    whether they apply, and refuses; passed, they are honoured (they change the output). No
    installed family reaches the refusal: the guard's removal passed every test."""
    from ctxpar.integrations.transformers.attention import LayerMask, attention_forward

    torch.manual_seed(0)
    sinks = torch.nn.Parameter(torch.full((2,), 3.0))
    module = _module(sinks=sinks)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"has attention sinks \(module.sinks\) but did not pass them"):
        attention_forward(module, q, q, q, LayerMask())
    with_sinks, _ = attention_forward(module, q, q, q, LayerMask(), s_aux=sinks)
    without, _ = attention_forward(_module(), q, q, q, LayerMask())
    assert (with_sinks - without).abs().max() > 1e-2


def test_declared_documents_with_no_mask_for_a_layer_are_refused() -> None:
    """A model that hands a layer no mask (attention_mask=None: it did not build it through
    transformers' mask functions) while documents= were declared: the layer would attend across
    the documents; refused (no installed family does: the guard's removal passed every test)."""
    from ctxpar.integrations.transformers.attention import DOCUMENTS, attention_forward

    q = torch.randn(1, 2, 16, 4)
    declared = DOCUMENTS.set((5, 7, 4))
    try:
        with pytest.raises(ValueError, match="got no attention mask although documents were declared"):
            attention_forward(_module(), q, q, q, None)
    finally:
        DOCUMENTS.reset(declared)
    got, _ = attention_forward(_module(), q, q, q, None)  # no documents: plain causal
    assert got.shape == (1, 16, 2, 4)


def test_longrope_with_documents_is_checked_on_each_ranks_positions_within_its_documents() -> None:
    """LongRoPE reads the largest position_id a forward sees, and with documents a rank's
    position_ids restart per document. Contiguous over 2 ranks, 16 tokens, documents of 2 and
    14, limit 6: the row reaches position 13 (long factors), rank 0 holds in-document positions
    0-1 and 0-5, so up to 5 (short factors): refused. Taken without the documents, rank 0's
    largest looked like 7 and the forward ran, rank 0 rotating with the short factors (Phi-3, two
    ranks, documents of 10 and 6: 0.009 of the logits off, no error), and no test saw it."""
    from ctxpar.integrations import transformers as integration
    from ctxpar.integrations.transformers.attention import Settings, check_rope_lengths

    settings = Settings(ctxpar.get_layout("contiguous", 2), None, "ring", None, longrope=(6,))
    with pytest.raises(ValueError, match="rank 0 holds positions up to 5 only"):  # as the forward checks
        integration._check_positions("M", settings, dict(input_ids=torch.zeros(1, 8, dtype=torch.long)), (2, 14))
    check_rope_lengths("M", settings, 16, None)  # one document: rank 0 holds 0-7, long factors everywhere


def test_a_packed_row_of_repeated_tokens_with_shifted_labels_runs() -> None:
    """shard_inputs' labels of a packed row hold -100 at each document's last token. Over a run
    of repeated tokens they equal the tokens wherever they label, so the unshifted-label check
    gathers the rows: a -100 there is no label, and must not count as one that differs from the
    next token (the row was refused as unshifted labels, and no test saw it)."""
    model = enable_context_parallel(hf_families.build("llama"), layout=ONE)
    inputs, labels = shard_inputs(torch.full((1, 16), 5), layout=ONE, rank=0, documents=[5, 7, 4])
    assert labels[0, [4, 11, 15]].tolist() == [IGNORE_INDEX] * 3
    assert model(**inputs, labels=labels).loss.item() > 0


def test_attention_dropout_in_the_config_is_refused_at_enable_time() -> None:
    """config.attention_dropout (Llama, Mistral, Qwen...): refused by enable_context_parallel,
    not only at the first training forward (the field dropped from the guard passed every test)."""
    with pytest.raises(ValueError, match=re.escape("attention dropout (LlamaConfig.attention_dropout=0.1); set "
                                                   "attention_dropout=0")):
        enable_context_parallel(hf_families.build("llama", meta=True, attention_dropout=0.1), layout=ONE)


def test_a_window_over_bidirectional_attention_is_refused_by_the_mask_reader() -> None:
    """and_masks(bidirectional, sliding_window_overlay): a window ctxpar's causal window is not;
    refused naming it (once it reached masks.py: "window= is a causal sliding window; it needs
    causal=True", naming no model)."""
    from transformers.masking_utils import and_masks, bidirectional_mask_function, sliding_window_overlay

    from ctxpar.integrations.transformers.attention import RefusedMask, describe_mask

    got = describe_mask(and_masks(bidirectional_mask_function, sliding_window_overlay(3)))
    assert isinstance(got, RefusedMask) and "a sliding window or chunks over bidirectional attention" in got.reason
