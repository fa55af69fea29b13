"""Hugging Face transformers integration: a tiny random LlamaForCausalLM under CP."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_cases  # noqa: E402
import torch  # noqa: E402

import ctxpar  # noqa: E402
from ctxpar.integrations.transformers import enable_context_parallel, shard_inputs  # noqa: E402
from ctxpar.launch import run_local  # noqa: E402

_results: dict = {}


def results() -> list[dict]:
    if not _results:
        _results["P4"] = run_local(hf_cases.run, 4, timeout_s=300)
    return _results["P4"]


@pytest.mark.parametrize("layout, strategy", hf_cases.COMBOS)
def test_llama_under_cp_gives_the_unsplit_logits_and_gradients(layout: str, strategy: str) -> None:
    for rank, res in enumerate(results()):
        r = res[(layout, strategy)]
        assert r["logits_err"] <= 1e-5 * r["logits_scale"], f"rank {rank}: logits {r['logits_err']:.3g}"
        assert r["loss_err"] <= 1e-5, f"rank {rank}: loss {r['loss_err']:.3g}"
        assert r["grad_err"] <= 1e-4 * r["grad_scale"], f"rank {rank}: grads {r['grad_err']:.3g}"


def test_padding_masks_and_sliding_windows_are_refused() -> None:
    model = enable_context_parallel(hf_cases.tiny_llama(), layout=ctxpar.get_layout("zigzag", 1))
    inputs, _ = shard_inputs(torch.randint(0, 128, (1, 8)), layout=ctxpar.get_layout("zigzag", 1), rank=0)
    padding = torch.ones(1, 8, dtype=torch.long)
    padding[0, -2:] = 0
    with pytest.raises(ValueError, match="padding masks are not supported"):
        model(**inputs, attention_mask=padding)
    model(**inputs, attention_mask=torch.ones(1, 8, dtype=torch.long))  # all-ones is fine

    shifted = dict(inputs, position_ids=inputs["position_ids"] + 3)  # not this rank's global positions
    with pytest.raises(ValueError, match="global layout positions"):
        model(**shifted)

    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               sliding_window=4))
    with pytest.raises(ValueError, match="sliding-window"):
        enable_context_parallel(mistral, layout=ctxpar.get_layout("zigzag", 1))
