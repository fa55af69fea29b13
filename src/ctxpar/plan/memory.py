"""Memory per GPU, by category, for one training step of a Workload.

Symbols: B batch, T sequence, P CP degree, S = T/P, L layers, d hidden, H / H_kv heads,
D head dim, F ffn width, V vocab, b bytes per element (``Workload.elem``), a accumulator
bytes (4), N parameters, Z the FSDP degree.

Sequence-shaped tensors (the worked example of docs/planner.md) are split by P:
one hidden state B·T·d·b, one per layer L·B·T·d·b, K/V of one layer 2·B·T·H_kv·D·b.

Saved activations are counted tensor by tensor for a Llama block (RMSNorm, GQA
attention with a fused kernel that keeps (out, lse) and no score matrix, SwiGLU MLP);
the method is Korthikanti et al. 2022 (arXiv:2205.05198, section 4), recounted for this
block. Full checkpointing keeps each layer's input and recomputes one layer at a time.
Parameters, gradients and AdamW states follow the ZeRO paper's accounting (Rajbhandari et
al. 2019, arXiv:1910.02054): b + b + (8 + 4 if b < 4 else 8) bytes per parameter (two
fp32 moments, plus an fp32 master copy under mixed precision), divided by Z.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxpar.plan.workload import Workload


@dataclass(frozen=True)
class Sharded:
    """A tensor of ``total`` bytes split over the CP group: ``per_gpu`` = total / P."""

    total: int
    per_gpu: int


@dataclass(frozen=True)
class SequenceTensors:
    hidden_state: Sharded  # B·T·d·b
    hidden_states_all_layers: Sharded  # L·B·T·d·b
    kv_one_layer: Sharded  # 2·B·T·H_kv·D·b


def sequence_tensors(w: Workload) -> SequenceTensors:
    """The sizes that make CP necessary, whole and per GPU (exact: T is a multiple of P)."""
    m, b = w.model, w.elem
    hidden = w.batch * w.seq * m.hidden * b
    kv = 2 * w.batch * w.seq * m.kv_heads * m.head_dim * b

    def shard(total: int) -> Sharded:
        return Sharded(total, total // w.cp)

    return SequenceTensors(shard(hidden), shard(m.layers * hidden), shard(kv))


def saved_tensors_per_token(w: Workload) -> dict[str, int]:
    """Bytes one token's saved activations take in one layer, by tensor (no checkpointing).

    What autograd keeps for the backward in a Llama block; RMSNorm's per-token rstd (one
    float) is left out. All-to-all strategies also keep their head-sharded q, k, v, out
    (docs/strategies.md, peak memory table): (2H + 2H_kv')·D·b per local token.
    """
    m, b = w.model, w.elem
    saved = {
        "attention norm input": m.hidden * b,
        "q/k/v projection input": m.hidden * b,
        "q after RoPE": m.heads * m.head_dim * b,
        "k, v after RoPE": 2 * m.kv_heads * m.head_dim * b,
        "attention output (kernel backward, o projection input)": m.heads * m.head_dim * b,
        "attention lse": m.heads * w.acc,
        "MLP norm input": m.hidden * b,
        "gate/up projection input": m.hidden * b,
        "gate output (SiLU input)": m.ffn * b,
        "up output": m.ffn * b,
        "SiLU(gate)": m.ffn * b,
        "SiLU(gate)·up (down projection input)": m.ffn * b,
    }
    if w.ulysses_degree > 1:
        saved["head-sharded q, k, v, out (all-to-all)"] = (2 * m.heads + 2 * w.kv_heads_sent) * m.head_dim * b
    return saved


def attention_workspace(w: Workload) -> int:
    """Transient extra bytes of one attention call (forward or backward, the larger).

    The leading terms of docs/strategies.md's peak-memory table; all-gather gathers one
    KV head per step (``kv_heads_per_step`` = 1, the default).
    """
    m, e, a, s = w.model, w.elem, w.acc, w.local_len
    bhs = w.batch * m.heads * s  # B·H·S
    if w.strategy == "allgather":
        gathered = w.cp * 2 * w.batch * 1 * s * m.head_dim
        fwd = bhs * (m.head_dim + 1) * a + 2 * gathered * e
        bwd = bhs * m.head_dim * a + 2 * gathered * e + 2 * gathered * a
        return max(fwd, bwd)
    kv = 2 * w.batch * w.kv_heads_sent * s * m.head_dim  # the K/V buffer a ring step moves (H_kv' = H_kv for ring)
    ring_fwd = bhs * (m.head_dim + 1) * a + 2 * kv * e
    ring_bwd = bhs * m.head_dim * a + 4 * kv * a + 2 * kv * e
    staging = w.batch * s * m.head_dim * e * (2 * m.heads + 2 * w.kv_heads_sent)  # one all-to-all's copy
    if w.strategy == "ring":
        return max(ring_fwd, ring_bwd)
    if w.strategy == "alltoall":  # backward: dQ and dK/dV accumulators on top of the staging copy
        return bhs * m.head_dim * a + kv * a + staging
    return staging + max(ring_fwd, ring_bwd)  # hybrid: the all-to-all, then the ring over R groups


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by category; ``total`` counts the activations of ``checkpointing``."""

    parameters: int
    gradients: int
    optimizer_states: int
    fsdp_buffers: int
    activations: int  # saved for backward, no checkpointing
    activations_checkpointed: int  # layer inputs + one layer recomputed
    logits: int
    attention_workspace: int
    checkpointing: str
    hbm_bytes: int

    @property
    def total(self) -> int:
        saved = self.activations_checkpointed if self.checkpointing == "full" else self.activations
        return (self.parameters + self.gradients + self.optimizer_states + self.fsdp_buffers + saved
                + self.logits + self.attention_workspace)

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm_bytes

    def categories(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_states": self.optimizer_states,
            "fsdp_buffers": self.fsdp_buffers,
            "activations": self.activations,
            "activations_checkpointed": self.activations_checkpointed,
            "logits": self.logits,
            "attention_workspace": self.attention_workspace,
        }


def memory_per_gpu(w: Workload, hbm_bytes: int) -> MemoryEstimate:
    """Every category for one GPU of the CP group (see the module docstring for sources)."""
    m, b, s = w.model, w.elem, w.local_len
    n = m.parameters
    optimizer_bytes = 8 + (4 if b < 4 else 0)
    per_token_layer = sum(saved_tensors_per_token(w).values())
    # FSDP holds the unit being computed and the prefetched next one unsharded: a decoder
    # block (one more layer's worth of ModelConfig.parameters) or the embedding table
    largest_unit = max(m.with_(layers=m.layers + 1).parameters - n, m.vocab * m.hidden)
    return MemoryEstimate(
        parameters=-(-n * b // w.fsdp),
        gradients=-(-n * b // w.fsdp),
        optimizer_states=-(-n * optimizer_bytes // w.fsdp),
        fsdp_buffers=2 * largest_unit * b if w.fsdp > 1 else 0,
        activations=m.layers * w.batch * s * per_token_layer,
        activations_checkpointed=m.layers * w.batch * s * m.hidden * b + w.batch * s * per_token_layer,
        logits=w.batch * s * m.vocab * (b + 4),  # logits in b, plus the fp32 log-probabilities the loss keeps
        attention_workspace=attention_workspace(w),
        checkpointing=w.checkpointing,
        hbm_bytes=hbm_bytes,
    )

