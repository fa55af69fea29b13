"""Memory per GPU, by category, for one training step of a Workload.

Symbols: B batch, T sequence, P CP degree, S = T/P, L layers, d hidden, H / H_kv heads,
D head dim, F ffn width, V vocab, b bytes per element (``Workload.elem``), a accumulator
bytes (4), N parameters, Z the FSDP degree, t the TP degree.

Sequence-shaped tensors (the worked example of docs/planner.md) are split by P:
one hidden state B·T·d·b, one per layer L·B·T·d·b, K/V of one layer 2·B·T·H_kv·D·b;
under TP the hidden states also by t with sequence parallelism, K/V by t (H_kv/t heads).

Tensor parallelism as Megatron splits a Llama block (Shoeybi et al. 2019,
arXiv:1909.08053; Korthikanti et al. 2022, arXiv:2205.05198): q/k/v and gate/up are
column-parallel, o and down row-parallel, so each GPU holds 1/t of every attention and
MLP matrix (H/t query heads, H_kv/t KV heads, F/t of the MLP width); the embedding and
the LM head are vocabulary-parallel (ceil(V/t) rows each, the vocabulary padded to a
multiple of t); the RMSNorm weights are replicated. Activations inside attention and the
MLP are split by heads / width; the norms' inputs and the column-parallel matmuls'
inputs are the sequence region, split by t along the sequence with sequence parallelism
(Megatron stores the sharded input and all-gathers it again in the backward) and
replicated without it. The logits are vocabulary-parallel.

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

from ctxpar.plan.hardware import Hardware
from ctxpar.plan.workload import Workload
from ctxpar.strategy_rules import gather_group_heads, gather_groups


@dataclass(frozen=True)
class Sharded:
    """A tensor of ``total`` bytes split over the GPUs of one model replica: ``per_gpu`` = total / P
    (/ P·t where TP splits it too)."""

    total: int
    per_gpu: int


@dataclass(frozen=True)
class SequenceTensors:
    hidden_state: Sharded  # B·T·d·b
    hidden_states_all_layers: Sharded  # L·B·T·d·b
    kv_one_layer: Sharded  # 2·B·T·H_kv·D·b


def sequence_tensors(w: Workload) -> SequenceTensors:
    """The sizes that make CP necessary, whole and per GPU (exact: T is a multiple of P, and
    of P·t under sequence parallelism; t divides H_kv)."""
    m, b = w.model, w.elem
    hidden = w.batch * w.seq * m.hidden * b
    kv = 2 * w.batch * w.seq * m.kv_heads * m.head_dim * b
    split = w.cp * (w.local_len // w.sequence_region_len)  # P, or P·t with sequence parallelism

    def shard(total: int, by: int) -> Sharded:
        return Sharded(total, total // by)

    return SequenceTensors(shard(hidden, split), shard(m.layers * hidden, split), shard(kv, w.cp * w.tp))


# Saved tensors of the sequence region: each GPU holds them for its S/t tokens under
# sequence parallelism, for all S tokens without it; the rest are split by heads or width.
SEQUENCE_REGION = ("attention norm input", "q/k/v projection input", "MLP norm input", "gate/up projection input")


def saved_tensors_per_token(w: Workload) -> dict[str, int]:
    """Bytes one token's saved activations take in one layer on one GPU, by tensor (no checkpointing).

    What autograd keeps for the backward in a Llama block; RMSNorm's per-token rstd (one
    float) is left out. Under TP, the attention and MLP entries are one GPU's heads (H/t,
    H_kv/t) and width (F/t); the ``SEQUENCE_REGION`` entries are whole rows of d, held
    for S/t tokens with sequence parallelism (``saved_bytes_per_layer``). All-to-all
    strategies also keep their head-sharded q, k, v, out (docs/strategies.md, peak memory
    table): (2H/t + 2H_kv')·D·b per local token.
    """
    m, b, t = w.model, w.elem, w.tp
    heads, kv_heads = w.heads_per_gpu, w.kv_heads_per_gpu
    saved = {
        "attention norm input": m.hidden * b,
        "q/k/v projection input": m.hidden * b,
        "q after RoPE": heads * m.head_dim * b,
        "k, v after RoPE": 2 * kv_heads * m.head_dim * b,
        "attention output (kernel backward, o projection input)": heads * m.head_dim * b,
        "attention lse": heads * w.acc,
        "MLP norm input": m.hidden * b,
        "gate/up projection input": m.hidden * b,
        "gate output (SiLU input)": m.ffn // t * b,
        "up output": m.ffn // t * b,
        "SiLU(gate)": m.ffn // t * b,
        "SiLU(gate)·up (down projection input)": m.ffn // t * b,
    }
    if w.ulysses_degree > 1:
        saved["head-sharded q, k, v, out (all-to-all)"] = (2 * heads + 2 * w.kv_heads_sent) * m.head_dim * b
    return saved


def saved_bytes_per_layer(w: Workload) -> int:
    """One layer's saved activations on one GPU: B·(S_sp·sequence region + S·the rest), S_sp = S/t
    with sequence parallelism, else S (Korthikanti et al. 2022: sbh·(34/t + ...) with SP,
    sbh·(10 + 24/t + ...) without, for their GPT block)."""
    per_token = saved_tensors_per_token(w)
    region = sum(per_token[k] for k in SEQUENCE_REGION)
    return w.batch * (w.sequence_region_len * region + w.local_len * (sum(per_token.values()) - region))


def parameters_per_gpu(w: Workload) -> int:
    """N_t: the parameters one tensor-parallel rank holds (N when t = 1): 1/t of every
    attention and MLP matrix, ceil(V/t) rows of the embedding and of the LM head, every norm;
    under PP those of the busiest stage's layers (``Workload.stage``)."""
    return w.stage().model.parameters_per_tp_rank(w.tp)


def layers_in_flight(w: Workload) -> int:
    """Layers whose saved activations one GPU holds at the peak of a step.

    Without PP all L of the micro-batch being computed. With k stages, the first stage's
    peak (Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.3: it holds k micro-batches,
    one model's worth, whatever k): 1F1B runs min(m, k) forwards before its first backward,
    each of the stage's layers; the interleaved schedule with v chunks runs
    min(m·v, 2(k-1) + (v-1)·k + 1) chunk forwards first (Megatron's warm-up), each of
    stage_layers / v layers on average (rounded up): about L·(1 + (k-1)/(k·v)).
    """
    k, v, m = w.pp, w.virtual_stages, w.microbatches
    if k == 1:
        return w.model.layers
    if v == 1:
        return min(m, k) * w.stage_layers
    return -(-min(m * v, 2 * (k - 1) + (v - 1) * k + 1) * w.stage_layers // v)


def attention_workspace(w: Workload) -> int:
    """Transient extra bytes of one attention call (forward or backward, the larger).

    The leading terms of docs/strategies.md's peak-memory table, each the buffers the
    strategy's code holds at once at its peak; all-gather gathers a head group per step
    (``strategy_rules.gather_group_heads``: one KV head up to H_kv = 8) and counts as it
    runs under position-order layouts (zigzag, contiguous: striped holds one buffer of each
    kind fewer). The head-sharded q, k, v and out of all-to-all and hybrid are not here: they
    are saved activations (``saved_tensors_per_token``; hybrid once counted them here too).
    """
    e, a, s, d = w.elem, w.acc, w.local_len, w.model.head_dim
    heads = w.heads_per_gpu
    bhs = w.batch * heads * s  # B·H·S (H/t heads under TP)
    if w.cp == 1:  # nothing moves: the float32 output and lse (forward), dQ accumulator (backward)
        return bhs * (d + 1) * a
    if w.strategy == "allgather":
        groups, own = gather_groups(w.kv_heads_per_gpu), 2 * w.batch * w.kv_heads_per_gpu * s * d
        gathered = w.cp * 2 * w.batch * gather_group_heads(w.kv_heads_per_gpu) * s * d  # one group's K/V of all T
        # a group's K/V as it arrived and in position order, and the next group's arriving; K/V stacked
        fwd = bhs * (d + 1) * a + own * e + (3 if groups > 1 else 2) * gathered * e
        # at the rank-order copy of a group's dK/dV shares: both copies, the previous group's in its
        # reduce-scatter, the next group's K/V arriving; dQ, own dK/dV, K/V stacked
        shares = (3 if groups > 1 else 2) * gathered * a + (gathered * e if groups > 2 else 0)
        bwd = bhs * d * a + own * (a + e) + shares
        return max(fwd, bwd)
    kv = 2 * w.batch * w.kv_heads_sent * s * d  # the K/V buffer a ring step moves (H_kv' = H_kv for ring)
    ring_fwd = bhs * (d + 1) * a + 2 * kv * e
    ring_bwd = bhs * d * a + 4 * kv * a + 2 * kv * e
    if w.strategy == "ring":
        return max(ring_fwd, ring_bwd)
    packed = w.batch * s * d * (heads + 2 * w.kv_heads_sent)  # q, k, v of this rank's tokens
    copies = kv * e if w.kv_heads_sent > w.kv_heads_per_gpu else 0  # K/V heads repeated to split over U
    # forward: the packed send and receive buffers, then (once they are gone) the accumulators
    fwd = max(2 * packed * e + copies, bhs * (d + 1) * a)
    # backward: dout's exchange (sent, received, in head layout), then dout in head layout with the
    # dQ, dK, dV accumulators and, below float32, their copies in the input dtype
    bwd = max(3 * bhs * d * e, bhs * d * e + packed * (a + (e if e < a else 0)))
    if w.strategy == "alltoall":
        return max(fwd, bwd)
    return max(fwd, bwd) + max(ring_fwd, ring_bwd)  # hybrid: the all-to-all's, and the ring's over R groups


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
    """Every category for one GPU of the TP x CP group (see the module docstring for sources);
    under PP, of the busiest stage with ``layers_in_flight`` layers' activations."""
    held, microbatches = layers_in_flight(w), w.microbatches
    w = w.stage()
    m, b, s = w.model, w.elem, w.local_len
    n = parameters_per_gpu(w)
    optimizer_bytes = 8 + (4 if b < 4 else 0)
    layer = saved_bytes_per_layer(w)
    # FSDP holds the unit being computed and the prefetched next one unsharded: a decoder
    # block or the embedding table (this TP rank's share of either); across micro-batches it
    # keeps all the stage's parameters gathered and their gradients unsharded (``traffic.data_parallel``)
    largest_unit = max(m.layer_parameters(w.tp), m.vocab_rows(w.tp) * m.hidden)
    unsharded = 2 * (n if microbatches > 1 else largest_unit) * b
    return MemoryEstimate(
        parameters=-(-n * b // w.fsdp),
        gradients=-(-n * b // w.fsdp),
        optimizer_states=-(-n * optimizer_bytes // w.fsdp),
        fsdp_buffers=unsharded if w.fsdp > 1 else 0,
        activations=held * layer,
        # each layer's input (the residual stream: sequence region), plus one layer recomputed
        activations_checkpointed=held * w.batch * w.sequence_region_len * m.hidden * b + layer,
        # logits in b, plus the fp32 log-probabilities the loss keeps; vocabulary-parallel over TP
        logits=w.batch * s * m.vocab_rows(w.tp) * (b + 4),
        attention_workspace=attention_workspace(w),
        checkpointing=w.checkpointing,
        hbm_bytes=hbm_bytes,
    )


def memory_on(w: Workload, hw: Hardware) -> MemoryEstimate:
    """``memory_per_gpu`` against what one of ``w``'s ranks has of ``hw``'s memory: its 1/world
    share of a machine's RAM all its ranks share (``local``), else the GPU's own."""
    return memory_per_gpu(w, hw.memory_per_rank(w.world_size))
