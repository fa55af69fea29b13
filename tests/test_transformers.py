"""Hugging Face transformers integration: tiny random models under CP against the unsplit model."""

from __future__ import annotations

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
    unsplit gradients (4 ranks, zigzag, uneven ignored labels)."""
    for rank, res in enumerate(hf_cases.results()):
        r = res["labels"][case]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["loss_err"] <= 1e-5, f"rank {rank}: loss off by {r['loss_err']:.3g}"
        assert r["logits_err"] <= 1e-5 * r["logits_scale"], f"rank {rank}: logits {r['logits_err']:.3g}"
        assert r["grad_err"] <= 1e-4 * r["grad_scale"], f"rank {rank}: grads {r['grad_err']:.3g}"


def _one_rank(model, tokens: int = 8, **labels):
    model = enable_context_parallel(model, layout=ONE)
    inputs, shifted = shard_inputs(torch.randint(3, hf_families.VOCAB, (1, tokens)), layout=ONE, rank=0, **labels)
    return model, inputs, shifted


def test_generate_is_refused_early_with_a_clear_message() -> None:
    model, inputs, _ = _one_rank(hf_families.build("llama"))
    with pytest.raises(NotImplementedError, match="inference under context parallelism is not supported yet"):
        model.generate(inputs["input_ids"], max_new_tokens=2)


def test_labels_loss_refuses_what_it_cannot_weigh_globally() -> None:
    model, inputs, labels = _one_rank(hf_families.build("llama"))
    for extra, message in ((dict(shift_labels=labels), "already shifted"),
                           (dict(num_items_in_batch=torch.tensor(7)), "num_items_in_batch"),
                           (dict(ignore_index=0), "ignore_index=0")):
        with pytest.raises(ValueError, match=message):
            model(**inputs, labels=labels, **extra)
    with pytest.raises(ValueError, match=r"labels \(1, 7\) must be this rank's shifted labels"):
        model(**inputs, labels=labels[:, :7])
    assert model(**inputs, labels=torch.full_like(labels, IGNORE_INDEX)).loss.item() == 0.0  # nothing labelled
    with pytest.raises(ValueError, match="unshifted labels"):  # transformers' usual idiom, wrong under CP
        model(**inputs, labels=inputs["input_ids"])


def test_router_aux_loss_with_labels_is_refused() -> None:
    """Mixtral adds a load-balancing loss over the tokens it sees, a per-shard quantity."""
    model, inputs, labels = _one_rank(hf_families.build("mixtral"))
    with pytest.raises(ValueError, match="router load-balancing loss"):
        model(**inputs, labels=labels, output_router_logits=True)
    model(**inputs, labels=labels)  # off by default: fine


def test_padding_masks_and_foreign_positions_are_refused() -> None:
    model, inputs, _ = _one_rank(hf_families.build("llama"))
    padding = torch.ones(1, 8, dtype=torch.long)
    padding[0, -2:] = 0
    with pytest.raises(ValueError, match="padding masks are not supported"):
        model(**inputs, attention_mask=padding)
    model(**inputs, attention_mask=torch.ones(1, 8, dtype=torch.long))  # all-ones is fine

    shifted = dict(inputs, position_ids=inputs["position_ids"] + 3)  # not this rank's global positions
    with pytest.raises(ValueError, match="global layout positions"):
        model(**shifted)


def test_mistral_sliding_window_is_refused_with_its_fix() -> None:
    with pytest.raises(ValueError, match=r"sliding-window attention \(MistralConfig.sliding_window=4\); set "
                                         r"sliding_window=None if no sequence is longer"):
        enable_context_parallel(hf_families.build("mistral", meta=True), layout=ONE)
