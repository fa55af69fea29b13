"""A Plan as a readable table (MiB/GiB, ms) and as JSON (exact bytes, seconds).

JSON (bytes exact, times in seconds; formulas in docs/planner.md):

    inputs              the Workload: model shape, batch, seq, dtype, cp, strategy, layout, ulysses,
                        tp, dp (null: implied by fsdp), fsdp, pp, microbatches, virtual_stages,
                        sequence_parallel, checkpointing, mask
    hardware            ``Hardware.as_dict()`` (gpus_per_node after --gpus-per-node)
    conventions         MiB, GiB, GB in bytes, and what a bandwidth is
    parallel            tp, cp, dp (the effective data-parallel degree), fsdp, pp, virtual_stages,
                        microbatches, stage_layers (the busiest stage's), layers_in_flight (whose
                        activations one GPU holds at once), world_size (TP·P·PP·DP),
                        gpus_per_replica (TP·P·PP), sequence_parallel, heads_per_gpu (H/TP),
                        kv_heads_per_gpu (H_kv/TP), parameters_per_gpu (one TP rank's share of the
                        busiest stage, before FSDP), links: {"tp", "cp"[, "ulysses"][, "fsdp"]
                        [, "replicas" | "dp"][, "pp"]} each with group_size, spans_gpus (TP groups:
                        TP consecutive GPUs; CP groups span TP·P, FSDP groups TP·Z, replicas and
                        DDP the TP·P·DP of a stage, PP every GPU), crosses_nodes,
                        link ("intra-node" | "inter-node") and bandwidth
    sequence_tensors    one hidden state, one per layer, one layer's K/V: total and per-GPU bytes
    traffic_per_layer   CP: forward_bytes, backward_bytes per GPU, link_bandwidth, the transfer
                        seconds, link, crosses_nodes; the hybrid's all_to_all_forward_bytes,
                        all_to_all_backward_bytes (in those bytes) and all_to_all_bandwidth
    tp_traffic_per_layer  TP: forward_bytes, backward_bytes (exposed collectives),
                        backward_regather_bytes (sequence parallelism's re-gathers, overlapped),
                        collective_bytes (one all-gather / reduce-scatter, or one all-reduce),
                        link_bandwidth, forward_seconds, backward_seconds, link, crosses_nodes
    mask, work          the mask and its traffic bound; per-rank pairs x heads, load balance
    memory_per_gpu      every category's bytes (per GPU, under TP and FSDP), checkpointing, total_bytes,
                        hbm_bytes (what one rank may fill: with ``local``, its share of the RAM all
                        ranks share), fits
    dp_traffic_per_step  DP / FSDP over the DP·P GPUs holding each TP shard (null when there are
                        none): gather_bytes (one parameter all-gather over FSDP), gathers (how
                        many: forward, and again backward with one micro-batch), gradient_bytes
                        (gradient reduce-scatter over FSDP, or all-reduce without it),
                        replicate_bytes (HSDP: the shard's all-reduce over the replicas),
                        total_bytes, exposed_seconds, forward and backward (the pipelines over
                        the layers), links {"fsdp", "replicas" | "dp"}
    step, cp1_step      seconds, microbatch_seconds, schedule (null for one micro-batch without PP,
                        else stages, virtual_stages, microbatches, slots, bubble_over_work,
                        p2p_message_bytes, p2p_message_seconds, p2p_seconds_per_microbatch); per
                        micro-batch on the busiest stage: matmul_seconds, attention_seconds, tp_communication_seconds,
                        data_parallel_communication_seconds (exposed), data_parallel (as in
                        dp_traffic_per_step, or null), attention_per_layer (the pipelines),
                        tp_per_layer
    efficiency, cp1_fits_up_to, sweep, crossovers   against CP degree at the same TP; a sweep point's
                        seq is the swept length padded to one its degree splits, its gpus the
                        world it runs on and cp1_step_seconds the CP-1 on those GPUs its
                        efficiency divides by (each degree its own); a crossover's
                        faster_from equal to its searched_from is a bound (the table's "<=")
    overlap_thresholds  per strategy and CP degree of the sweep: tokens_per_gpu, and forward and
                        backward (the tokens per GPU from which transfers hide; null: never)
    baseline            the best configuration without CP on the same TP·P GPUs (``plan/baseline.py``):
                        gpus_per_stage (TP·P: one pipeline stage of a replica), verdict ("pays_off" |
                        "does_not_pay_off" | "necessary" | "nothing_fits" | "no_cp"), speedup
                        (baseline seconds per batch / requested step; null when either does not
                        fit), requested_step_seconds, requested_fits,
                        best and candidates (tp, checkpointing, step_seconds, seconds_per_batch,
                        memory_bytes, fits), skipped_tp (TP degree -> why it cannot run), summary
    recommendation      strategy, cp, layout, ulysses, dp, step_seconds, efficiency, reasons (the smallest
                        CP degree that fits), cp_verdict and speedup_vs_baseline (``baseline``'s verdict
                        and speedup for the recommended CP degree; the requested configuration's when
                        CP-1 or nothing is recommended), use_cp (false where CP-1 is recommended or
                        a configuration without CP that fits is at least as fast as the smallest CP
                        degree that fits: the headline then recommends it; null where nothing fits)
                        and without_cp (that configuration: tp, checkpointing, step_seconds,
                        seconds_per_batch, memory_bytes, fits; null otherwise)
    calibration         ``--hardware local``'s measurements, or null
"""

from __future__ import annotations

from ctxpar.plan.cost import overlap_local_len, ring_window_per_rank, split_traffic, traffic_bound
from ctxpar.plan.recommend import sequences_per_step, variant
from ctxpar.plan.hardware import LOCAL, TILE_OVERHEADS, Hardware
from ctxpar.plan.memory import layers_in_flight, parameters_per_gpu
from ctxpar.plan.documents import describe
from ctxpar.plan.planner import Plan
from ctxpar.plan.units import format_bandwidth, format_bytes, format_flops, format_seconds, format_tokens

MEMORY_LABELS = {
    "parameters": "parameters (N·b / FSDP)",
    "gradients": "gradients (N·b / FSDP)",
    "optimizer_states": "AdamW states (fp32 m, v [+ master]) / FSDP",
    "fsdp_buffers": "FSDP unsharded units (current + prefetch)",
    "activations": "saved activations, no checkpointing",
    "activations_checkpointed": "saved activations, full checkpointing",
    "logits": "logits (b) + fp32 log-probs, B·S·V",
    "attention_workspace": "attention workspace (one call)",
}


def memory_labels(w) -> dict[str, str]:
    """``MEMORY_LABELS`` for ``w``: with several micro-batches FSDP holds the parameters and
    gradients unsharded, not two units."""
    if w.microbatches == 1:
        return MEMORY_LABELS
    return {**MEMORY_LABELS, "fsdp_buffers": "FSDP unsharded parameters + gradients (m > 1)"}


TRAFFIC_FORMULAS = {
    "ring": ("(P-1)·2·B·H_kv·S·D·e", "(P-1)·2·B·H_kv·S·D·(e+a)"),
    "allgather": ("(P-1)·2·B·H_kv·S·D·e", "(P-1)·2·B·H_kv·S·D·(e+a)"),
    "alltoall": ("(U-1)/U·B·S·[D·e·(2H+2H_kv')+H·a]", "(U-1)/U·B·S·D·e·(2H+2H_kv')"),
    "hybrid": ("alltoall(U) + (R-1)·2·B·H_kv'·S·D·e", "alltoall(U) + (R-1)·2·B·H_kv'·S·D·(e+a)"),
}
# the ring under a window w on the contiguous layout, the busiest rank; the bytes are traffic.ring_window's exactly,
# m = min(P-1, ceil((w-1)/S)) hops (w-1 <= S: m = 1, and the backward is the halo's K/V and one accumulator)
HALO_FORMULAS = ("min(w-1, (P-1)·S)·2·B·H_kv·D·e", "<= fwd + m·min(w-1, S)·2·B·H_kv·D·a")


def _sharded(s) -> dict:
    return {"total_bytes": s.total, "per_gpu_bytes": s.per_gpu}


def _mask_json(plan: Plan) -> dict:
    w = plan.workload
    mask = w.mask
    halo = ring_window_per_rank(w)
    return {
        "causal": mask.causal,
        "window": mask.window,  # None also when --window >= T: the same as no window
        "documents_from": w.documents_from if w.documents is not None else None,
        "documents_in_row": None if mask.documents is None else describe(mask.documents),
        "traffic": "exact" if (bound := traffic_bound(w)) is None else bound,
        "halo_tokens": None if halo is None else mask.window - 1,
        "halo_per_rank": None if halo is None else [
            {"rank": r, "sent_forward_bytes": s.forward, "sent_backward_bytes": s.backward,
             "received_forward_bytes": rv.forward, "received_backward_bytes": rv.backward}
            for r, (s, rv) in enumerate(halo)],
    }


def _parallel_json(plan: Plan) -> dict:
    w = plan.workload
    return {"tp": w.tp, "cp": w.cp, "dp": w.data_parallel, "fsdp": w.fsdp, "pp": w.pp,
            "virtual_stages": w.virtual_stages, "microbatches": w.microbatches, "stage_layers": w.stage_layers,
            "layers_in_flight": layers_in_flight(w), "world_size": w.world_size,
            "gpus_per_replica": w.gpus_per_replica, "sequence_parallel": w.sequence_parallel,
            "heads_per_gpu": w.heads_per_gpu, "kv_heads_per_gpu": w.kv_heads_per_gpu,
            "parameters_per_gpu": parameters_per_gpu(w),
            "links": {k: v.as_dict() for k, v in plan.links.items()}}


def _tp_traffic_json(plan: Plan) -> dict:
    tr, link = plan.tp_traffic, plan.links["tp"]
    return {"forward_bytes": tr.forward, "backward_bytes": tr.backward, "backward_regather_bytes": tr.regather,
            "collective_bytes": tr.forward // tr.collectives if tr.collectives else 0, "link_bandwidth": link.bandwidth,
            "forward_seconds": plan.step.tp_forward, "backward_seconds": plan.step.tp_backward,
            "link": link.name, "crosses_nodes": link.crosses_nodes}


def _dp_traffic_json(plan: Plan) -> dict | None:
    dp = plan.step.data_parallel
    if dp is None:
        return None
    return {**dp.as_dict(), "links": {k: plan.links[k].as_dict() for k in DP_LINKS if k in plan.links}}


def to_json(plan: Plan) -> dict:
    """Every figure of the plan: bytes as exact integers, times in seconds (keys: the module docstring)."""
    w, hw = plan.workload, plan.hardware
    bw = plan.step.attention.link_bandwidth
    mem, a2a = plan.memory, _all_to_all_part(plan)
    return {
        "inputs": w.as_dict(),
        "hardware": hw.as_dict(),
        "parallel": _parallel_json(plan),
        "conventions": {"MiB": 2**20, "GiB": 2**30, "GB": 10**9,
                        "bandwidth": "bytes per second per GPU per direction; GB/s = 1e9 bytes/s"},
        "sequence_tensors": {
            "hidden_state": _sharded(plan.tensors.hidden_state),
            "hidden_states_all_layers": _sharded(plan.tensors.hidden_states_all_layers),
            "kv_one_layer": _sharded(plan.tensors.kv_one_layer),
        },
        "traffic_per_layer": {
            "forward_bytes": plan.traffic.forward,
            "backward_bytes": plan.traffic.backward,
            "link_bandwidth": bw,
            **dict(zip(("forward_transfer_seconds", "backward_transfer_seconds"), _transfer_seconds(plan))),
            "link": plan.links["cp"].name,
            "crosses_nodes": plan.links["cp"].crosses_nodes,
            **({"all_to_all_forward_bytes": a2a.forward, "all_to_all_backward_bytes": a2a.backward,
                "all_to_all_bandwidth": plan.links["ulysses"].bandwidth} if a2a is not None else {}),
        },
        "tp_traffic_per_layer": _tp_traffic_json(plan),
        "dp_traffic_per_step": _dp_traffic_json(plan),
        "mask": _mask_json(plan),
        "work": {"head_pairs_per_rank": list(plan.head_pairs), "load_balance": plan.load_balance},
        "memory_per_gpu": {**{f"{k}_bytes": v for k, v in mem.categories().items()},
                           "checkpointing": mem.checkpointing, "total_bytes": mem.total,
                           "hbm_bytes": mem.hbm_bytes, "fits": mem.fits},
        "step": plan.step.as_dict(),
        "cp1_step": plan.cp1_step.as_dict(),
        "efficiency": plan.efficiency,
        "cp1_fits_up_to": plan.cp1_fits_up_to,
        "sweep": [vars(p) for p in plan.sweep],
        "overlap_thresholds": _overlap_thresholds(plan),
        "crossovers": [vars(c) for c in plan.crossovers],
        "baseline": plan.baseline.as_dict(),
        "recommendation": {
            "strategy": rec.strategy if (rec := plan.recommendation.workload) else None,
            "cp": rec.cp if rec else None,
            "layout": rec.layout if rec else None,
            "ulysses": rec.ulysses if rec else None,
            "dp": rec.data_parallel if rec else None,
            "step_seconds": plan.recommendation.step_seconds,
            "efficiency": plan.recommendation.efficiency,
            "reasons": plan.recommendation.reasons,
            "cp_verdict": plan.recommended_baseline.verdict,
            "speedup_vs_baseline": plan.recommended_baseline.speedup,
            "use_cp": _uses_cp(plan),
            "without_cp": vars(plan.recommended_baseline.best) if _without_cp_instead(plan) else None,
        },
        "calibration": plan.calibration,
    }


def _overlap_thresholds(plan: Plan) -> list[dict]:
    """Per strategy and CP degree of the sweep: the tokens per GPU from which each pass's
    transfers hide behind its compute (``cost.overlap_local_len``; None where nothing
    overlaps or the threshold is not a length), and the tokens per GPU at the plan's T."""
    w, hw = plan.workload, plan.hardware
    out = []
    for strategy, cp in dict.fromkeys((p.strategy, p.cp) for p in plan.sweep if p.cp > 1):
        v = variant(w, hw, strategy=strategy, cp=cp, seq=w.padded(w.seq, cp))
        if v is None:
            continue
        out.append(dict(strategy=strategy, cp=cp, tokens_per_gpu=v.local_len,
                        forward=overlap_local_len(v, hw), backward=overlap_local_len(v, hw, backward=True)))
    return out


def format_plan(plan: Plan) -> str:
    """The table the CLI prints."""
    tp = [*_tp_traffic(plan), ""] if plan.workload.tp > 1 else []
    dp = [*_dp_traffic(plan), ""] if plan.step.data_parallel is not None else []
    return "\n".join([*_header(plan), "", *_tensors(plan), "", *_traffic(plan), "", *tp, *dp, *_attention(plan), "",
                      *_memory(plan), "", *_step(plan), "", *_degrees(plan), "", *_crossovers(plan), "",
                      *_baseline(plan), "", *_recommendation(plan)])


def _header(plan: Plan) -> list[str]:
    w, hw, m = plan.workload, plan.hardware, plan.workload.model
    strategy = w.strategy + (f" (ulysses {w.ulysses} x ring {w.ring_degree})" if w.strategy == "hybrid" else "")
    links = (format_bandwidth(hw.intra_node_bandwidth) if hw.intra_node_bandwidth == hw.inter_node_bandwidth else
             f"{format_bandwidth(hw.intra_node_bandwidth)} in a node of {hw.gpus_per_node}, "
             f"{format_bandwidth(hw.inter_node_bandwidth)} across nodes")
    return [
        f"ctxpar plan: B={w.batch} T={w.seq} ({format_tokens(w.seq)}) {w.dtype}, CP={w.cp} {strategy}, "
        f"{w.layout} layout, {mask_words(plan)}, FSDP={w.fsdp}, checkpointing {w.checkpointing}",
        f"model: layers={m.layers} hidden={m.hidden} heads={m.heads} kv_heads={m.kv_heads} head_dim={m.head_dim} "
        f"ffn={m.ffn} vocab={m.vocab} ({m.parameters:,} parameters)",
        f"hardware: {hw.name}: {rates_words(hw)}; {format_bytes(hw.hbm_bytes)} memory; links {links}; "
        f"{fixed_costs_words(hw, w.strategy)} [{hw.source}]",
        _parallel_words(plan),
        "units: MiB = 2^20 B, GiB = 2^30 B; bandwidth per GPU per direction, GB/s = 1e9 B/s",
    ]


def rates_words(hw: Hardware) -> str:
    """'attention forward 335 TFLOP/s, backward 322 TFLOP/s, matmuls 794.5 TFLOP/s (peak 989 TFLOP/s)'."""
    if hw.attention_forward_rate is None and hw.attention_backward_rate is None and hw.matmul_rate is None \
            and not hw.fp8:
        return f"{format_flops(hw.peak_flops)} x {hw.efficiency:g} = {format_flops(hw.flops)} for every kernel"
    fp8 = " in fp8" if hw.fp8 else ""
    # a measured machine has no datasheet peak: its "peak" is the attention rate it measured
    peak = "attention forward + backward" if hw.name == LOCAL else "peak"
    return (f"attention forward {format_flops(hw.forward_flops)}, backward {format_flops(hw.backward_flops)}, "
            f"matmuls{fp8} {format_flops(hw.matmul_flops)} ({peak} {format_flops(hw.peak_flops)})")


def fixed_costs_words(hw: Hardware, strategy: str) -> str:
    """'fixed costs: latency 20 us per message, 5 us per kernel launch, 0 per ring step', with
    the tiles' own where measured: '..., 60 us + 0.4 ns per byte merged per tile forward, 30 us +
    0.3 ns per byte added backward, ...'."""
    tiles = (f"{format_seconds(hw.tile_forward_overhead)} + {hw.tile_forward_seconds_per_byte * 1e9:.3g} ns per "
             f"byte merged per tile forward, {format_seconds(hw.tile_backward_overhead)} + "
             f"{hw.tile_backward_seconds_per_byte * 1e9:.3g} ns per byte added backward, "
             if any(getattr(hw, key) for key in TILE_OVERHEADS) else "")
    return (f"fixed costs: latency {format_seconds(hw.latency)} per message, {format_seconds(hw.launch_overhead)} "
            f"per kernel launch, {tiles}{step_overhead_words(hw, strategy)}")


def step_overhead_words(hw: Hardware, strategy: str) -> str:
    """'1 ms + 2 ns per byte sent per alltoall step' (the part per byte where measured)."""
    per_byte = hw.step_overhead_per_byte(strategy)
    moved = f" + {per_byte * 1e9:.3g} ns per byte sent" if per_byte else ""
    return f"{format_seconds(hw.step_overhead_for(strategy))}{moved} per {strategy} step"


def _parallel_words(plan: Plan) -> str:
    """'parallel: TP=2 (sequence parallel) x CP=4 x DP=1 = 8 GPUs (rank order TP, CP, DP); 8 GPUs per node'."""
    w, hw = plan.workload, plan.hardware
    sp = (" (sequence parallel)" if w.sequence_parallel else " (no sequence parallelism)") if w.tp > 1 else ""
    implied = " implied by FSDP" if w.dp is None and w.data_parallel > 1 else ""
    pp = (f" x PP={w.pp}" + (f" (v={w.virtual_stages} interleaved)" if w.virtual_stages > 1 else "")
          if w.pp > 1 else "")
    micro = f"; {w.microbatches} micro-batches of B={w.batch} per step" if w.microbatches > 1 else ""
    order = "TP, CP, DP, PP" if w.pp > 1 else "TP, CP, DP"
    return (f"parallel: TP={w.tp}{sp} x CP={w.cp} x DP={w.data_parallel}{implied}{pp} = {_gpus(w.world_size)} "
            f"(rank order {order}); {_gpus(hw.gpus_per_node)} per node{micro}")


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"



def mask_words(plan: Plan) -> str:
    """'causal, window 4096, documents lognormal:2048,1.5 seed 0 (14 in the row: mean ..., max ...)'."""
    w, mask = plan.workload, plan.workload.mask
    words = ["causal" if w.causal else "non-causal"]
    if w.window is not None:
        words.append(f"window {w.window}" + ("" if mask.window else " (>= T: no limit)"))
    if w.documents is not None:
        rows = describe(mask.documents or (w.seq,))
        words.append(f"documents {w.documents_from or 'given'} ({rows['count']} in the row: mean "
                     f"{rows['mean']:.0f}, median {rows['median']:.0f}, max {rows['max']})")
    return ", ".join(words)


def _tensors(plan: Plan) -> list[str]:
    t, w = plan.tensors, plan.workload
    rows = [("one hidden-state tensor", "B·T·d·b", t.hidden_state),
            (f"one per layer, {w.model.layers} layers", "L·B·T·d·b", t.hidden_states_all_layers),
            ("K/V for one layer", "2·B·T·H_kv·D·b", t.kv_one_layer)]
    split = f"/{w.cp}" if w.tp == 1 else f"CP {w.cp}, TP {w.tp}"
    lines = [f"{'Sequence-shaped tensors':<44} {'whole':>12} {f'per GPU ({split})':>16}"]
    lines += [f"  {name:<26}{formula:<16} {format_bytes(s.total):>12} {format_bytes(s.per_gpu):>16}"
              for name, formula, s in rows]
    return lines


def _all_to_all_part(plan: Plan):
    """The hybrid's all-to-all traffic (``traffic.Traffic``), which has a link of its own; None
    for the other strategies (the all-to-all strategy's goes over its CP link)."""
    return split_traffic(plan.workload)[0] if "ulysses" in plan.links else None


def _transfer_seconds(plan: Plan) -> tuple[float, float]:
    """(forward, backward): each pass's attention bytes at their links, the hybrid's all-to-all
    part at its own (within a node, where the ring's may cross nodes), the rest at the CP link."""
    bw, total, a2a = plan.step.attention.link_bandwidth, plan.traffic, _all_to_all_part(plan)
    if a2a is None:
        return (total.forward / bw, total.backward / bw) if bw else (0.0, 0.0)
    shuffled = plan.links["ulysses"].bandwidth
    return ((total.forward - a2a.forward) / bw + a2a.forward / shuffled,
            (total.backward - a2a.backward) / bw + a2a.backward / shuffled)


def _traffic(plan: Plan) -> list[str]:
    w, tr = plan.workload, plan.traffic
    bw = plan.step.attention.link_bandwidth
    halo = ring_window_per_rank(w) is not None
    fwd_f, bwd_f = HALO_FORMULAS if halo else TRAFFIC_FORMULAS[w.strategy]
    what = f"halo of w-1 = {w.mask.window - 1} keys, busiest rank" if halo else "sent = received"
    a2a = _all_to_all_part(plan)
    at = "at their links" if a2a is not None else f"at {format_bandwidth(bw)}"
    lines = [f"Attention traffic per GPU per layer ({w.strategy}; {what})",
             f"  {'':<10}{'formula':<40} {'bytes':>12} {at:>14}"]
    for name, formula, n, seconds in zip(("forward", "backward"), (fwd_f, bwd_f), (tr.forward, tr.backward),
                                         _transfer_seconds(plan)):
        lines.append(f"  {name:<10}{formula:<40} {format_bytes(n):>12} {format_seconds(seconds):>14}")
    if a2a is not None:
        lines.append(f"  of which the all-to-all: {format_bytes(a2a.forward)} forward, {format_bytes(a2a.backward)} "
                     f"backward at {format_bandwidth(plan.links['ulysses'].bandwidth)}; the ring's at "
                     f"{format_bandwidth(bw)}")
    if (bound := traffic_bound(w)) is not None:
        lines.append(f"  {bound}")
    elif not w.mask.is_plain and w.strategy in ("allgather", "alltoall"):
        lines.append(f"  exact: {w.strategy} moves the same bytes whatever the mask")
    if w.tp > 1:
        lines.append(f"  H_kv/TP = {w.kv_heads_per_gpu} KV heads per GPU (TP={w.tp} splits the {w.model.kv_heads})")
    if w.cp > 1:
        lines.append(f"  {_link_words(plan.links['cp'], 'CP', plan.hardware.gpus_per_node)}")
    if "ulysses" in plan.links:
        lines.append(f"  {_link_words(plan.links['ulysses'], 'all-to-all', plan.hardware.gpus_per_node)}")
    return lines


def _link_words(link, what: str, per_node: int) -> str:
    """'CP group of 4 spans 4 consecutive GPUs, within a node of 8: intra-node link, 450 GB/s'."""
    where = f"more than a node of {per_node}" if link.span > per_node else f"within a node of {per_node}"
    if link.crosses_nodes and link.span <= per_node:
        first = link.straddling_group
        where += (f", but the group on GPUs {first}-{first + link.span - 1} straddles two nodes "
                  f"(the slowest group sets the step)")
    links = ("intra- and inter-node links, each GPU's in-node peers over the first: in all" if link.all_to_all
             and link.crosses_nodes else f"{link.name} link,")
    return (f"{what} group of {link.group_size} spans {link.span} consecutive GPUs, {where}: {links} "
            f"{format_bandwidth(link.bandwidth)}")


def _tp_traffic(plan: Plan) -> list[str]:
    w, tr, link = plan.workload, plan.tp_traffic, plan.links["tp"]
    step = plan.step
    if w.sequence_parallel:
        what = "sequence parallel: one all-gather or reduce-scatter = (t-1)·B·(S/t)·d·e"
        forward, backward = "2 all-gathers + 2 reduce-scatters", "2 reduce-scatters + 2 all-gathers"
    else:
        what = "no sequence parallelism: one all-reduce = 2·(t-1)/t·B·S·d·e"
        forward, backward = "2 all-reduces", "2 all-reduces"
    lines = [f"Tensor-parallel traffic per GPU per layer (TP={w.tp}, {what})",
             f"  {'':<10}{'collectives':<40} {'bytes':>12} {f'at {format_bandwidth(link.bandwidth)}':>14}",
             f"  {'forward':<10}{forward:<40} {format_bytes(tr.forward):>12} {format_seconds(step.tp_forward):>14}",
             f"  {'backward':<10}{backward:<40} {format_bytes(tr.backward):>12} "
             f"{format_seconds(step.tp_backward):>14}"]
    if tr.regather:
        lines.append(f"  {'':<10}{'+ 2 all-gathers of the stored inputs':<40} {format_bytes(tr.regather):>12} "
                     f"{'overlapped':>14}")
    lines.append("  exposed: counted in the step time, not overlapped with compute")
    lines.append(f"  {_link_words(link, 'TP', plan.hardware.gpus_per_node)}")
    return lines


DP_LINKS = ("fsdp", "replicas", "dp")


def _dp_traffic(plan: Plan) -> list[str]:
    w, dp = plan.workload, plan.step.data_parallel
    tr, group, z, per_node = dp.traffic, w.data_parallel_group, w.fsdp, plan.hardware.gpus_per_node
    stage = " of the busiest stage" if w.pp > 1 else ""
    lines = [f"Data-parallel traffic per GPU per step (the {group} GPUs holding each TP shard{stage}: "
             f"DP={w.data_parallel} x CP={w.cp}; FSDP={z}; ring collectives, n = group size, "
             f"N = {parameters_per_gpu(w):,} parameters)",
             f"  {'':<10}{'collective':<58} {'bytes':>12}"]
    if z == 1:
        lines.append(f"  {'backward':<10}{'gradients all-reduce over G, 2·(n-1)·ceil(N/n)·b':<58} "
                     f"{format_bytes(tr.gradients):>12}")
    else:
        again = (("backward", "the same all-gather again", tr.gather) if tr.gathers == 2 else
                 ("backward", f"none: gathered for all {w.microbatches} micro-batches", 0))
        rows = [("forward", "parameters all-gather over Z, (n-1)·ceil(N/n)·b", tr.gather), again,
                ("", "gradients reduce-scatter over Z, (n-1)·ceil(N/n)·b", tr.gradients)]
        if tr.replicate:
            rows.append(("", "shard all-reduce over G/Z replicas, 2·(n-1)·ceil(N/Z/n)·b", tr.replicate))
        lines += [f"  {name:<10}{what:<58} {format_bytes(n):>12}" for name, what, n in rows]
    parts = [(name, p) for name, p in (("forward", dp.forward), ("backward", dp.backward)) if p is not None]
    lines.append("  per layer, behind its compute (1/L of the bytes each): "
                 + "; ".join(f"{name} {format_seconds(p.transfer)} against {format_seconds(p.compute)}"
                             for name, p in parts))
    outlasts = "" if all(p.hidden for _, p in parts) else ", and what outlasts the compute"
    first = "" if dp.forward is None else "the first gather, " + ("the first re-gather, " if tr.gathers == 2 else "")
    if w.microbatches > 1:
        first = f"behind one of the {w.microbatches} micro-batches: {first}"
    lines.append(f"  exposed: {format_seconds(dp.exposed)} per step ({first}the last reduction{outlasts})")
    names = {"fsdp": "FSDP", "replicas": "replica", "dp": "DP"}
    lines += [f"  {_link_words(plan.links[k], names[k], per_node)}" for k in DP_LINKS if k in plan.links]
    return lines


def _attention(plan: Plan) -> list[str]:
    w, attn = plan.workload, plan.step.attention
    hw = plan.hardware
    forward, backward = format_seconds(attn.forward.overhead), format_seconds(attn.backward.overhead)
    fixed_words = ""
    if attn.forward.overhead or attn.backward.overhead:
        # a calibrated cost per byte sent makes the backward's (its messages are larger) the higher
        fixed_words = (f"; every stage + {forward} fixed" if forward == backward else
                       f"; every stage + fixed: {forward} forward, {backward} backward")
    lines = [f"Attention per layer, busiest rank: 4·B·D·(pairs·heads) FLOPs forward at "
             f"{format_flops(hw.forward_flops)}, 2.5x backward at {format_flops(hw.backward_flops)}{fixed_words}",
             f"  {'':<10}{'stages':>6} {'compute/stage':>14} {'transfer/stage':>15} {'exposed':>10} {'total':>11}"
             f"  transfer hidden"]
    for name, p in (("forward", attn.forward), ("backward", attn.backward)):
        s_min = overlap_local_len(w, hw, backward=name == "backward")
        when = f" (from {s_min} tokens/GPU; now {w.local_len})" if s_min is not None else ""
        lines.append(f"  {name:<10}{p.stages:>6} {format_seconds(p.compute):>14} {format_seconds(p.transfer):>15} "
                     f"{format_seconds(p.exposed):>10} {format_seconds(p.seconds):>11}  "
                     f"{'yes' if p.hidden else 'no'}{when}")
    lines.append(f"  load balance (max/mean pairs per rank, {w.layout}): {plan.load_balance:.4f}")
    return lines


def _memory(plan: Plan) -> list[str]:
    mem, w = plan.memory, plan.workload
    chosen = "activations_checkpointed" if w.checkpointing == "full" else "activations"
    tp = f"TP={w.tp}, " if w.tp > 1 else ""
    lines = [f"Memory per GPU ({tp}CP={w.cp}, FSDP={w.fsdp})"]
    if w.pp > 1:
        held = layers_in_flight(w)
        lines.append(f"  busiest of PP={w.pp} stages: {w.stage_layers} of the {w.model.layers} layers, with the "
                     f"embedding and the LM head; activations of {held} layer{'s' if held > 1 else ''} in flight "
                     f"(its micro-batches' forwards before their backwards)")
    if w.tp > 1:
        stage = " of that stage" if w.pp > 1 else ""
        lines.append(f"  N_tp = {parameters_per_gpu(w):,} parameters per TP rank{stage} (for N above: attention and "
                     f"MLP matrices / {w.tp}, embedding and LM head vocabulary-parallel, norms replicated)")
    labels = memory_labels(w)
    for key, n in mem.categories().items():
        skipped = key in ("activations", "activations_checkpointed") and key != chosen
        lines.append(f"  {labels[key]:<46} {format_bytes(n):>12}{'  (not counted)' if skipped else ''}")
    verdict = "fits" if mem.fits else "does NOT fit"
    shared = (f" (1/{w.world_size} of this machine's {format_bytes(plan.hardware.hbm_bytes)} RAM: its "
              f"{w.world_size} ranks share it)" if plan.hardware.shared_memory else "")
    lines.append(f"  {'total':<46} {format_bytes(mem.total):>12}  of {format_bytes(mem.hbm_bytes)}{shared}: {verdict}")
    return lines


def _step(plan: Plan) -> list[str]:
    s, w = plan.step, plan.workload
    tp = f" + TP communication {format_seconds(s.tp_seconds)} (exposed)" if w.tp > 1 else ""
    dp = f" + DP/FSDP communication {format_seconds(s.dp_seconds)} (exposed)" if s.data_parallel else ""
    per_gpu = f" / TP={w.tp}" if w.tp > 1 else ""
    work = (f"matmuls {format_seconds(s.matmul)} (6·(N - V·d) FLOPs per token{per_gpu}"
            f"{', +1 forward recomputed' if s.recompute else ''}) + attention {format_seconds(s.attention_seconds)} "
            f"over {s.layers} layer{'s' if s.layers > 1 else ''}{tp}")
    if (schedule := s.schedule) is None:
        lines = [f"Step time, busiest rank: {format_seconds(s.seconds)} = {work}{dp}"]
    elif schedule.stages == 1:  # gradient accumulation
        lines = [f"Step time, busiest rank: {format_seconds(s.seconds)} = {schedule.microbatches} micro-batches x "
                 f"{format_seconds(s.microbatch_seconds)}{dp}",
                 f"  one micro-batch {format_seconds(s.microbatch_seconds)} = {work}"]
    else:
        sends = (f" + {2 * schedule.virtual} pipeline sends of {format_bytes(schedule.message_bytes)} "
                 f"{format_seconds(s.microbatch_seconds - s.compute_seconds)}")
        lines = [f"Step time, busiest rank: {format_seconds(s.seconds)} = {schedule.slots:g} micro-batches' worth "
                 f"(m + (PP-1)/v = {schedule.microbatches} + {schedule.stages - 1}/{schedule.virtual}: the bubble "
                 f"is {schedule.bubble:.1%} of the work) x {format_seconds(s.microbatch_seconds)}{dp}",
                 f"  one micro-batch of the busiest stage, {format_seconds(s.microbatch_seconds)} = {work}{sends}"]
    if w.pp > 1:
        lines.append(f"  {_link_words(plan.links['pp'], 'PP', plan.hardware.gpus_per_node)}")
    return [*lines,
            f"CP-1 step time {format_seconds(plan.cp1_step.seconds)}; parallel efficiency at CP={w.cp}: "
            f"{plan.efficiency:.3f} (CP-1 time / (P x CP-P time))"]


def _degrees(plan: Plan) -> list[str]:
    w = plan.workload
    here = [p for p in plan.sweep if p.seq == w.padded(w.seq, p.cp)]
    tp = f", TP={w.tp} throughout" if w.tp > 1 else ""
    lines = [f"Every degree and strategy at T={format_tokens(w.seq)} ({w.layout} layout{tp}); efficiency = CP-1 step "
             f"on the same GPUs / (P x step)",
             f"  {'CP':>4} {'strategy':<10} {'GPUs':>6} {'step':>11} {'CP-1 step':>11} {'efficiency':>10} "
             f"{'memory/GPU':>12} {'fits':>5} {'fwd hidden':>10} {'balance':>8}"]
    for p in here:
        lines.append(f"  {p.cp:>4} {p.strategy if p.cp > 1 else '-':<10} {p.gpus:>6} "
                     f"{format_seconds(p.step_seconds):>11} {format_seconds(p.cp1_step_seconds):>11} "
                     f"{p.efficiency:>10.3f} {format_bytes(p.memory_bytes):>12} {'yes' if p.fits else 'no':>5} "
                     f"{'yes' if p.transfer_hidden else 'no':>10} {p.load_balance:>8.4f}"
                     + (f"  at T={p.seq}" if p.seq != w.seq else ""))
    if any(p.seq != w.seq for p in here):
        lines.append(f"  at T=...: the next length the {w.layout} layout splits over that degree (it does not split "
                     f"T={w.seq})")
    return lines


def _crossovers(plan: Plan) -> list[str]:
    smallest, largest = min(p.seq for p in plan.sweep), max(p.seq for p in plan.sweep)
    limit, w = plan.cp1_fits_up_to, plan.workload
    cp1 = f"CP-1 at TP={w.tp}, checkpointing {w.checkpointing}"
    lines = [f"Crossovers (T searched {format_tokens(smallest)}..{format_tokens(largest)}): CP-P's step is faster "
             f"than CP-1's from T on (at every T searched); the longest T that fits",
             f"  {cp1} fits up to T={limit}; beyond it, CP or another configuration without CP (below) is needed"
             if limit else f"  {cp1} does not fit at any length: CP or another configuration without CP (below) "
                           f"is needed",
             f"  {'CP':>4} {'strategy':<10} {'faster from T':>14} {'fits up to T':>13}"]
    for c in plan.crossovers:
        if c.faster_from is None:  # slower at the longest T searched: "never" hid where it wins below it
            wins = any((p.cp, p.strategy) == (c.cp, c.strategy) and p.step_seconds < p.cp1_step_seconds
                       for p in plan.sweep)
            faster = f"not at {c.searched_to}" if wins else "never"
        else:
            faster = f"<= {c.faster_from}" if c.faster_from <= c.searched_from else str(c.faster_from)
        fits = c.fits_up_to or "never"  # 0: not at the layout's shortest length either
        lines.append(f"  {c.cp:>4} {c.strategy:<10} {faster:>14} {fits:>13}")
    return lines


def _baseline(plan: Plan) -> list[str]:
    b, w = plan.baseline, plan.workload
    per = "pipeline stage" if w.pp > 1 else "replica"
    lines = [f"Without CP on the same {_gpus(b.gpus)} per {per} at T={format_tokens(w.seq)}: TP x checkpointing "
             f"(other GPUs: data parallelism)",
             f"  {'TP':>4} {'checkpointing':<14} {'step':>11} {'per batch':>11} {'memory/GPU':>12} {'fits':>5}"]
    for p in b.points:
        best = "  <- best" if p is b.best else ""
        lines.append(f"  {p.tp:>4} {p.checkpointing:<14} {format_seconds(p.step_seconds):>11} "
                     f"{format_seconds(p.seconds_per_batch):>11} {format_bytes(p.memory_bytes):>12} "
                     f"{'yes' if p.fits else 'no':>5}{best}")
    for t, why in b.skipped.items():
        lines.append(f"  {t:>4} cannot run: {why.split(':')[0]}")
    lines.append(f"  {b.summary}")
    return lines


def _without_cp_instead(plan: Plan) -> bool:
    """Whether a configuration without CP that fits on the same GPUs is the recommendation: the
    smallest CP degree that fits loses to it (``baseline``'s "does_not_pay_off" for it), or
    no CP degree fits and it does."""
    w, best = plan.recommendation.workload, plan.recommended_baseline.best
    if w is None:
        return best is not None
    return w.cp > 1 and plan.recommended_baseline.verdict == "does_not_pay_off"


def _uses_cp(plan: Plan) -> bool | None:
    """None where nothing fits, with CP or without."""
    w = plan.recommendation.workload
    if w is None:
        return False if _without_cp_instead(plan) else None
    return w.cp > 1 and not _without_cp_instead(plan)


def _recommendation(plan: Plan) -> list[str]:
    rec = plan.recommendation
    w = rec.workload
    extra = f", ulysses {w.ulysses} x ring {w.ring_degree}" if w is not None and w.strategy == "hybrid" else ""
    b = plan.recommended_baseline
    instead = None if b.best is None else (
        f"Recommendation: no CP: TP={b.best.tp} with checkpointing {b.best.checkpointing} on the same {_gpus(b.gpus)}, "
        f"{format_seconds(b.best.seconds_per_batch)} per batch")
    if w is None:  # no CP degree fits at the requested TP; without CP, more TP may
        head = f"{instead}; no CP degree fits at TP={plan.workload.tp}" if instead else "Recommendation: none fits"
    elif w.cp == 1:
        head = "Recommendation: no CP (CP-1)"
    elif _without_cp_instead(plan):  # the smallest CP degree that fits is slower than what needs no CP
        head = (f"{instead}; the smallest CP degree that fits, CP-{w.cp} {w.strategy}{extra} on the {w.layout} "
                f"layout, takes {format_seconds(rec.step_seconds)} per batch")
    else:
        # at another DP than asked (FSDP must divide DP x CP) a step holds other sequences: its time beside the
        # requested degree's misleads without it (the reasons say why)
        batch = (f" for {sequences_per_step(w)} sequences (DP={w.data_parallel})"
                 if w.data_parallel != plan.workload.data_parallel else "")
        head = (f"Recommendation: CP-{w.cp} {w.strategy}{extra}, {w.layout} layout: step "
                f"{format_seconds(rec.step_seconds)}{batch}, efficiency {rec.efficiency:.3f}")
    return [head, *(f"  - {r}" for r in rec.reasons),
            f"  - against the best without CP: {plan.recommended_baseline.summary}"]
