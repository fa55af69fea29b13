"""Every causal-LM family of the installed transformers, built tiny with random weights.

``CASES`` lists one case per family in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (except the
``UNBUILDABLE`` ones, with the reason) plus ``VARIANTS`` that isolate one feature (Gemma 2's
soft-capping without its sliding windows, ...). ``REFUSED`` is the verdict table: the
features ``enable_context_parallel`` must name for each refused case; every other case
must run under CP exactly as the unsplit eager model. ``hf_cases`` runs every case on CP
groups of 2 gloo ranks; ``test_hf_fidelity.py`` asserts the verdicts.

Tiny means: hidden 32, 4 query heads of dim 8, 2 K/V heads, vocabulary 96, one layer of
each layer kind the family's default config has (two when it has one kind), and every
window or chunk 4 tokens, so that on 16 tokens windows, chunks and P=2 shards all bite.
Attention dropout is set to 0 here (a user's fix when ctxpar refuses it); the refusal of
dropout itself is tested separately.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 96
SIZES = dict(
    hidden_size=32, n_embd=32, d_model=32, emb_dim=32, intermediate_size=64, ffn_dim=64, n_inner=64,
    decoder_ffn_dim=64, encoder_ffn_dim=64, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    ffn_hidden_size=64, expert_ffn_hidden_size=16,
    num_hidden_layers=2, n_layer=2, n_layers=2, num_layers=2, decoder_layers=2, encoder_layers=2,
    num_attention_heads=4, n_head=4, n_heads=4, decoder_attention_heads=4, encoder_attention_heads=4,
    num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
    vocab_size=VOCAB, unpadded_vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
    max_position_embeddings=64, n_positions=64, max_seq_len=64,
    num_experts=4, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_topk=2, n_group=1,
    topk_group=1, zero_expert_num=2, first_k_dense_replace=1, num_nextn_predict_layers=0,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=12,
    rotary_dim=4, rotary_emb_dim=4,
    sliding_window=4, sliding_window_size=4, attention_chunk_size=4, window_size=4, rel_extent=8,
    log_scaling_n_floor=4, floor_scale=2, n_layers_per_attn_res_block=1,
    attention_dropout=0, attention_probs_dropout_prob=0, attn_pdrop=0,
)

# Whatever SIZES cannot express: fields that must agree with each other, or defaults that
# do not build in transformers 5.24 (noted).
OVERRIDES = {
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, attn_layer_indices=[1]),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e4)}),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),  # clip_qkv=None fails in 5.24
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "deepseek_v2": dict(num_experts_per_tok=2, n_shared_experts=1),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),
    "dory": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                 n_input_layers=1, n_output_layers=1),  # one input, one looped, one output layer
    "dots3_note_text": dict(per_layer_config={}, head_dim=12, num_key_value_heads=4),
    "gemma3n_text": dict(num_kv_shared_layers=0, intermediate_size=64, activation_sparsity_pattern=[0.0, 0.0],
                         laurel_rank=4, altup_num_inputs=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_heads=4),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
                             layer_types=["mamba", "attention"]),
    "hunyuan_v1_dense": dict(head_dim=8), "hunyuan_v1_moe": dict(head_dim=8), "ministral": dict(head_dim=8),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # its checkpoints mix short convolutions in
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1, state_size=8, chunk_size=8, time_step_rank=4),
    "nemotron": dict(num_key_value_heads=2),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                           indexer_compress_ratio=1, hc_lowrank=8, ple_embed_dim=8, ngram_vocab_size_base=64,
                           split_ngram_parts=2, heads_per_ngram=2, linear_key_head_dim=8, linear_value_head_dim=8,
                           linear_num_key_heads=2, linear_num_value_heads=4),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[16, 16], axial_pos_shape=[4, 4]),
    "zaya": dict(num_experts_per_tok=1),
}

# Families whose tiny config does not build in transformers 5.24 for reasons unrelated to
# attention: built from their default config on the meta device instead, which is enough
# for a refusal (it reads configs and modules only). The verdict table must refuse them.
DEFAULT_ON_META = {
    "blt": "its byte patcher's sub-configs do not shrink consistently (shape mismatch in the local encoder)",
    "dots3_note": "its per-layer configs name layers 25-41",
    "gemma4_assistant": "its default config fails its own validation; built with hidden/vocab_size_per_layer_input=0",
    "zamba": "transformers' tied-weights check fails below the default depth",
}
_META_BASE = {"gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0))}

UNBUILDABLE = {
    "gemma3n": "its vision tower needs the timm package, which is not installed; its text decoder is gemma3n_text",
}

# Soft-capping at 1 on weights of scale 1: attention logits of a few units, so capping bites
# (with the default 0.02 init the logits are ~1e-3 and tanh-capping at 50 changes nothing).
_BITE = dict(attn_logit_softcapping=1.0, initializer_range=1.0)

# case -> (family, overrides): one feature at a time, and the fixes ctxpar's errors suggest
VARIANTS = {
    "gemma2+softcap-only": ("gemma2", dict(layer_types=["full_attention"] * 2, sliding_window=0, **_BITE)),
    "vaultgemma+softcap-only": ("vaultgemma", dict(layer_types=["full_attention"] * 2, sliding_window=0, **_BITE)),
    "gpt_oss+sinks-only": ("gpt_oss", dict(layer_types=["full_attention"] * 2, sliding_window=0)),
    "llama4_text+full-attention": ("llama4_text", dict(layer_types=["full_attention"] * 2)),
    "llama4_text+nope-temperature": ("llama4_text", dict(layer_types=["full_attention"] * 2, no_rope_layers=[1, 0])),
    "mistral+no-window": ("mistral", dict(sliding_window=None)),
    # Qwen2's own switch: layers from max_window_layers on slide (layer 0 full, layer 1 sliding)
    "qwen2+sliding-layers": ("qwen2", dict(use_sliding_window=True, max_window_layers=1, layer_types=None,
                                                  sliding_window=4)),
    "bert+decoder": ("bert", dict(is_decoder=True, add_cross_attention=True)),  # cross-attention unused here
    "gpt2+dropout": ("gpt2", dict(attn_pdrop=0.1)),
    # RoPE whose frequencies follow the largest position a forward sees: dynamic NTK scaling
    # runs exactly below max_position_embeddings (64 here; past it, refused: hf_cases' guards);
    # LongRoPE's long factors (from position 8 on) run exactly where every rank's positions
    # reach past 8, as zigzag's do on 16
    "llama+dynamic-rope": ("llama", dict(rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=1e4))),
    "phi3+longrope": ("phi3", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 4,
                                                        long_factor=[4.0] * 4), original_max_position_embeddings=8)),
}

# Feature names as ctxpar's errors spell them (fidelity.py). Sliding windows, chunked
# attention and sinks are honoured: families with only those run, and must be exact.
SOFTCAP, OTHER_KV = "soft-capping", "another model's keys and values"
DROPOUT, OWN_CODE, NOT_SOFTMAX = "attention dropout", "not through transformers' AttentionInterface", "not softmax"
STATE, CONV, LOCAL_POSITIONS = "outside attention", "convolutions along", "positions counted within the local shard"
PADDING_POSITIONS, NON_TEXT = "after padding_idx", "inputs beyond the token sequence"
DYNAMIC_MASK, TEMPERATURE, ALIBI = "dynamic mask", "temperature tuning", "ALiBi"
FEATURES = (SOFTCAP, OTHER_KV, DROPOUT, OWN_CODE, NOT_SOFTMAX, STATE, CONV, LOCAL_POSITIONS,
            PADDING_POSITIONS, NON_TEXT, DYNAMIC_MASK, TEMPERATURE, ALIBI)

_SSM = (NOT_SOFTMAX, STATE, CONV)
REFUSED = {
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"), (OTHER_KV,)),  # speculative assistants
    **dict.fromkeys(("big_bird", "falcon", "gpt_neox_japanese", "megatron-bert", "openai-gpt", "reformer",
                     "rembert", "xglm", "xlm"), (OWN_CODE,)),
    **dict.fromkeys(("axk2", "deepseek_v32", "glm_moe_dsa"), (NOT_SOFTMAX,)),  # indexed (top-k sparse) attention
    # BART-style decoders and Whisper number positions from the shard's own length
    **dict.fromkeys(("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "musicgen",
                     "musicgen_melody", "pegasus", "plbart", "whisper"), (LOCAL_POSITIONS,)),
    **dict.fromkeys(("camembert", "data2vec-text", "roberta", "roberta-prelayernorm", "xlm-roberta",
                     "xlm-roberta-xl", "xmod"), (PADDING_POSITIONS,)),
    **dict.fromkeys(("fuyu", "git"), (NON_TEXT,)),
    **dict.fromkeys(("doge",), (DYNAMIC_MASK,)),
    **dict.fromkeys(("gemma2", "vaultgemma"), (SOFTCAP,)),
    **dict.fromkeys(("deepseek_v4", "hy_v4", "dots3_note", "dots3_note_text"), (NOT_SOFTMAX,)),
    **dict.fromkeys(("gpt_neo",), (OWN_CODE,)),
    **dict.fromkeys(("blt", "gemma3", "gemma4", "gemma4_unified", "moshi"), (NON_TEXT,)),
    **dict.fromkeys(("bloom", "cpmant", "mvp", "prophetnet", "roformer", "trocr", "xlnet"),
                    (OWN_CODE, LOCAL_POSITIONS)),
    **dict.fromkeys(("got_ocr2",), (OWN_CODE, NON_TEXT)),
    **dict.fromkeys(("minimax",), (NOT_SOFTMAX, STATE)),
    **dict.fromkeys(("bailing_hybrid", "zaya"), (NOT_SOFTMAX, CONV)),
    **dict.fromkeys(("xlstm",), (STATE, LOCAL_POSITIONS)),
    **dict.fromkeys(("phi4_multimodal",), (CONV, NON_TEXT)),
    **dict.fromkeys(("rwkv",), (OWN_CODE, STATE, LOCAL_POSITIONS)),
    **dict.fromkeys(("mpt",), (OWN_CODE, LOCAL_POSITIONS, ALIBI)),
    **dict.fromkeys(("bamba", "falcon_h1", "granitemoehybrid", "inkling2_loop_text", "inkling2_text",
                     "inkling_text", "jamba", "kimi_linear", "lfm2", "lfm2_moe", "nemotron_h", "olmo_hybrid",
                     "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "qwen4_exp",
                     "qwen4_exp_text", "recurrent_gemma", "zamba", "zamba2"), _SSM),
    **dict.fromkeys(("moss_transcribe_diarize",), (CONV, LOCAL_POSITIONS, NON_TEXT)),
    **dict.fromkeys(("lara_mini", "lfm3"), _SSM),
    **dict.fromkeys(("falcon_mamba", "mamba", "mamba2"), (*_SSM, LOCAL_POSITIONS)),
    # the hostile-testing list, each feature alone
    "gemma2+softcap-only": (SOFTCAP,), "vaultgemma+softcap-only": (SOFTCAP,),
    "llama4_text+nope-temperature": (TEMPERATURE,), "gpt2+dropout": (DROPOUT,),
}

CASES = [f for f in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if f not in UNBUILDABLE] + list(VARIANTS)


def tiny_llama():
    """The Llama the CP tests train and compare: 2 layers, 4 heads over 2 K/V heads, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).float()


def _kind_list(kinds: list) -> list:
    """One layer of each kind, in order of first appearance (two layers if one kind)."""
    kept = list(dict.fromkeys(kinds))
    return kept * 2 if len(kept) == 1 else kept


def _tiny_kwargs(cls, overrides: dict | None = None) -> dict:
    default = cls()
    defaults = default.to_dict()
    kwargs = {k: type(defaults[k])(v) for k, v in SIZES.items()
              if k in defaults and defaults[k] is not None and not isinstance(defaults[k], (list, dict, bool))}
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"):
        if isinstance(defaults.get(key), int) and defaults[key] >= VOCAB:
            kwargs[key] = 1
    if "kv_lora_rank" in kwargs:  # MLA: head_dim is the rope part, and K/V have all query heads
        kwargs.update(head_dim=SIZES["qk_rope_head_dim"], num_key_value_heads=SIZES["num_attention_heads"])
    for key in ("layer_types", "layers_block_type"):
        if isinstance(defaults.get(key), list):
            kwargs[key] = _kind_list(defaults[key])
            kwargs.update({n: len(kwargs[key]) for n in ("num_hidden_layers", "n_layer", "num_layers") if n in kwargs})
    for key in getattr(cls, "sub_configs", {}) or {}:
        sub = getattr(default, key, None)
        if isinstance(sub, PretrainedConfig):
            kwargs[key] = dict(_tiny_kwargs(type(sub), OVERRIDES.get(sub.model_type)), model_type=sub.model_type)
    for key, value in (overrides or {}).items():
        merge = isinstance(value, dict) and isinstance(kwargs.get(key), dict)
        kwargs[key] = {**kwargs[key], **value} if merge else value
    return kwargs


def config_for(case: str, **changes) -> PretrainedConfig:
    """The tiny config of ``case`` (a family or a variant), with ``changes`` on top."""
    family, extra = VARIANTS.get(case, (case, {}))
    extra = {**extra, **changes}
    if family in ("musicgen", "musicgen_melody"):  # their causal LM is the decoder alone, on 1 codebook here
        cls = CONFIG_MAPPING[f"{family}_decoder"]
        return cls(**_tiny_kwargs(cls, dict(num_codebooks=1)))
    cls = CONFIG_MAPPING[family]
    return cls(**_tiny_kwargs(cls, {**OVERRIDES.get(family, {}), **extra}))


def build(case: str, *, meta: bool = False, **changes) -> torch.nn.Module:
    """``case`` built tiny in float32 with seed 0, eager attention; ``meta``: on the meta device
    (no weights; enough for ``enable_context_parallel``'s checks). ``DEFAULT_ON_META``
    families always come from their default config on the meta device."""
    family = VARIANTS.get(case, (case,))[0]
    if family in DEFAULT_ON_META:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(CONFIG_MAPPING[family](**_META_BASE.get(family, {})))
    torch.manual_seed(0)
    config = config_for(case, **changes)
    with torch.device("meta" if meta else "cpu"):
        if family in ("musicgen", "musicgen_melody"):
            decoder_lm = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[family]]
            model = decoder_lm._from_config(config, attn_implementation="eager")
        else:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model if meta else model.float().eval()
