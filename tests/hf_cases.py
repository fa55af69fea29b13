"""Runs inside spawned gloo ranks: a tiny random LlamaForCausalLM under CP vs unsplit."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ctxpar
from ctxpar.integrations.transformers import enable_context_parallel, shard_inputs
from ctxpar.parallelize import cp_loss, shift_labels

COMBOS = [("zigzag", "ring"), ("striped", "allgather"), ("contiguous", "ring"), ("zigzag", "alltoall")]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).float()


def run(rank: int, world: int) -> dict:
    torch.manual_seed(1)
    input_ids = torch.randint(0, 128, (2, 16 * world))
    reference = tiny_llama()
    reference.set_attn_implementation("sdpa")
    logits = reference(input_ids, use_cache=False).logits  # (B, T, vocab), unsplit, on every rank
    ref_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels(input_ids).flatten(),
                                                 ignore_index=-100)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    results = {}
    for layout_name, strategy in COMBOS:
        layout = ctxpar.get_layout(layout_name, world)
        model = enable_context_parallel(tiny_llama(), layout=layout, strategy=strategy)
        inputs, labels = shard_inputs(input_ids, layout=layout, rank=rank)
        local_logits = model(**inputs).logits  # (B, T/P, vocab)
        share, loss = cp_loss(local_logits, labels)
        share.backward()
        grads = torch.cat([p.grad.flatten() for _, p in model.named_parameters()])
        dist.all_reduce(grads)  # parameters are replicated: their gradient is the sum over ranks
        pieces = [torch.empty_like(local_logits) for _ in range(world)]
        dist.all_gather(pieces, local_logits.detach().contiguous())
        full_logits = layout.unshard(pieces, dim=1)
        want = torch.cat([ref_grads[n].flatten() for n, _ in model.named_parameters()])
        results[(layout_name, strategy)] = dict(
            logits_err=(full_logits - logits.detach()).abs().max().item(),
            logits_scale=logits.detach().abs().max().item(),
            loss_err=abs(loss.item() - ref_loss.item()),
            grad_err=(grads - want).abs().max().item(),
            grad_scale=want.abs().max().item(),
        )
    return results
