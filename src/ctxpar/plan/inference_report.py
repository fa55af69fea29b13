"""An ``InferencePlan`` as a readable table and as JSON (``ctxpar plan --inference``).

JSON (bytes exact, times in seconds):

    inputs            model shape, batch, prompt_tokens (T), new_tokens (n), dtype, cp (P),
                      tp (t GPUs per CP rank) and sequence_parallel (the prefill's), strategy,
                      ulysses (the hybrid's all-to-all degree U at P; null for the others)
                      and layout of the prefill
    hardware          ``Hardware.as_dict()`` plus attention_forward_flops (the prefill rate);
                      memory_bandwidth 0 = unknown, latency 0 = not modelled
    degrees           per CP degree: cp, ulysses (the hybrid prefill's U there; null for the
                      other strategies), prefill_seconds (time to first token),
                      prefill_speedup (CP-1 / CP-P; null without CP 1), decode_positions (T + n,
                      where decoding is priced), decode_seconds_per_token
                      (at those positions; null: no memory bandwidth), decode_change (relative
                      to CP 1; null as before), kv_cache_bytes and weight_bytes per GPU (1/t of
                      the heads and weights under TP), fits
                      (weights + KV cache within the GPU's memory)
    skipped_degrees   the degrees not evaluated: cp and reason (the layout does not split T over
                      them, or the heads do not divide)
    partial_prefill   a chunk of new_tokens on top of cached_tokens = T + n at cp: new_fraction
                      (T_new / (T_cached + T_new)); methods["pass-kv" | "pass-q"] with
                      bytes_sent_per_layer (per rank), seconds_per_layer and the pipeline;
                      choice (method, why) on the hardware; bytes_choice (method, why) by bytes
                      alone; pass_q_fraction (the bytes rule's threshold) and
                      published_pass_q_fraction (2·H_kv/H); crossover_new_tokens (pass-KV no
                      slower from this T_new on; null: pass-Q faster up to 16M, or one rank)
    summary           the one-line answer the table ends with
    calibration       ``--hardware local``'s measurements, or null
"""

from __future__ import annotations

from ctxpar.plan.inference import InferencePlan
from ctxpar.plan.report import rates_words, step_overhead_words
from ctxpar.plan.units import format_bandwidth, format_bytes, format_seconds, format_tokens

PARTIAL_FORMULAS = {
    "pass-kv": "(P-1)·2·B·H_kv·ceil((Tc+Tn)/P)·D·e",
    "pass-q": "(P-1)·B·H·ceil(Tn/P)·(D·e+(D+1)·a)",
}
LABELS = {"pass-kv": "pass-KV", "pass-q": "pass-Q"}


def decode_change(plan: InferencePlan, cp: int) -> float | None:
    """CP-P decode time per token / CP-1's, less one (negative: faster); None if either is unknown."""
    one, here = plan.point(1), plan.point(cp)
    if one is None or here is None or one.decode_seconds_per_token is None:
        return None
    return here.decode_seconds_per_token / one.decode_seconds_per_token - 1


def summary(plan: InferencePlan) -> str:
    """Prefill speed-up and the change in decode time at the chosen degree, in one line."""
    w = plan.workload
    one, here = plan.point(1), plan.point(w.cp)
    if w.cp == 1 or one is None:
        return "CP=1: nothing is split; give --cp P to compare"
    speedup = plan.speedup(w.cp)
    ratio = f"{max(speedup, 1 / speedup):.2f}x"
    prefill = ("as fast as" if ratio == "1.00x" else f"{ratio} faster than" if speedup > 1
               else f"{ratio} slower than")  # a slowdown once read "0.38x faster"
    line = (f"At CP {w.cp}: prefill {prefill} CP 1 ({format_seconds(one.prefill_seconds)} -> "
            f"{format_seconds(here.prefill_seconds)})")
    change = decode_change(plan, w.cp)
    if change is None:
        return line + (f"; decode per token unknown: {plan.hardware.name} has no memory bandwidth (calibrate again: "
                       f"--calibrate measures it)")
    share = one.kv_cache_bytes / (one.kv_cache_bytes + one.weight_bytes)
    return (line + f"; decode per token changes by {change:+.1%} ({format_seconds(one.decode_seconds_per_token)} -> "
            f"{format_seconds(here.decode_seconds_per_token)}): decode gains at most the KV cache's share of the "
            f"bytes read ({share:.0%} at CP 1), since every CP rank reads all its weights")


def inference_to_json(plan: InferencePlan) -> dict:
    """Every figure of the inference plan (module docstring for the keys)."""
    w, hw, pp = plan.workload, plan.hardware, plan.partial
    return {
        "inputs": {"model": w.model.as_dict(), "batch": w.batch, "prompt_tokens": w.seq,
                   "new_tokens": plan.new_tokens, "dtype": w.dtype, "cp": w.cp, "tp": w.tp,
                   "sequence_parallel": w.sequence_parallel and w.tp > 1, "strategy": w.strategy,
                   "ulysses": w.ulysses_degree if w.strategy == "hybrid" else None, "layout": w.layout},
        "hardware": dict(hw.as_dict(), attention_forward_flops=hw.forward_flops),
        "conventions": {"MiB": 2**20, "GiB": 2**30, "GB": 10**9,
                        "bandwidth": "bytes per second per GPU per direction; GB/s = 1e9 bytes/s"},
        "degrees": [dict(p.as_dict(), prefill_speedup=plan.speedup(p.cp), decode_change=decode_change(plan, p.cp),
                         decode_positions=w.seq + plan.new_tokens) for p in plan.points],
        "skipped_degrees": [{"cp": cp, "reason": why} for cp, why in plan.skipped.items()],
        "partial_prefill": {
            "cp": pp.cp, "cached_tokens": pp.cached, "new_tokens": pp.new, "new_fraction": pp.new_fraction,
            "methods": {c.method: c.as_dict() for c in pp.costs},
            "choice": {"method": pp.method, "why": pp.why},
            "bytes_choice": {"method": pp.bytes_method, "why": pp.bytes_why},
            "pass_q_fraction": pp.pass_q_fraction,
            "published_pass_q_fraction": pp.published_fraction,
            "crossover_new_tokens": pp.crossover,
        },
        "summary": summary(plan),
        "calibration": plan.calibration,
    }


def format_inference_plan(plan: InferencePlan) -> str:
    """The table ``ctxpar plan --inference`` prints."""
    return "\n".join([*_header(plan), "", *_degrees(plan), "", *_partial(plan), "", summary(plan)])


def _header(plan: InferencePlan) -> list[str]:
    w, hw, m = plan.workload, plan.hardware, plan.workload.model
    links = (format_bandwidth(hw.intra_node_bandwidth) if hw.intra_node_bandwidth == hw.inter_node_bandwidth else
             f"{format_bandwidth(hw.intra_node_bandwidth)} in a node of {hw.gpus_per_node}, "
             f"{format_bandwidth(hw.inter_node_bandwidth)} across nodes")
    memory = format_bandwidth(hw.memory_bandwidth) if hw.memory_bandwidth else "unknown"
    latency = format_seconds(hw.latency) if hw.latency else "0 (not modelled; --latency sets it)"
    return [
        f"ctxpar plan --inference: B={w.batch} prompt T={w.seq} ({format_tokens(w.seq)}) + n={plan.new_tokens} new "
        f"tokens, {w.dtype}, CP={w.cp}" + (f" x TP={w.tp} ({w.tp * w.cp} GPUs per replica; the prefill's TP "
                                            f"{'with' if w.sequence_parallel else 'without'} sequence parallelism)"
                                            if w.tp > 1 else "") + f"; prefill {w.strategy}"
        + (f" (ulysses {w.ulysses_degree} x ring {w.ring_degree})" if w.strategy == "hybrid" else "")
        + f", {w.layout} layout",
        f"model: layers={m.layers} hidden={m.hidden} heads={m.heads} kv_heads={m.kv_heads} head_dim={m.head_dim} "
        f"ffn={m.ffn} vocab={m.vocab} ({m.parameters:,} parameters)",
        f"hardware: {hw.name}: {rates_words(hw)}; {format_bytes(hw.hbm_bytes)} memory at {memory}; "
        f"links {links}; latency {latency}; launch {format_seconds(hw.launch_overhead)} per kernel, "
        f"{step_overhead_words(hw, w.strategy)} [{hw.source}]",
        "units: MiB = 2^20 B, GiB = 2^30 B; bandwidth per GPU per direction, GB/s = 1e9 B/s",
    ]


def _degrees(plan: InferencePlan) -> list[str]:
    w = plan.workload
    lines = [f"Per CP degree: prefill = time to first token; decode = one token at T+n = {w.seq + plan.new_tokens} "
             f"positions; memory per GPU",
             f"  {'CP':>4} {'prefill':>11} {'speed-up':>9} {'decode/token':>13} {'KV cache':>12} {'weights':>12} "
             f"{'fits':>5}"]
    for p in plan.points:
        speedup = plan.speedup(p.cp)
        decode = "unknown" if p.decode_seconds_per_token is None else format_seconds(p.decode_seconds_per_token)
        lines.append(f"  {p.cp:>4} {format_seconds(p.prefill_seconds):>11} "
                     f"{'-' if speedup is None else f'{speedup:.2f}x':>9} {decode:>13} "
                     f"{format_bytes(p.kv_cache_bytes):>12} {format_bytes(p.weight_bytes):>12} "
                     f"{'yes' if p.fits else 'no':>5}")
    lines += [f"  {cp:>4} not evaluated: {why}" for cp, why in plan.skipped.items()]
    if w.strategy == "hybrid":
        lines.append("  hybrid prefill, ulysses U x ring R: " + ", ".join(
            f"CP {p.cp}: {p.ulysses} x {p.cp // p.ulysses}" for p in plan.points if p.ulysses))
    if w.tp == 1:
        lines += ["  prefill = L·(attention forward pipeline at the forward rate) + 2·(N - V·d)·B·T/P FLOPs / rate",
                  "  decode  = max((N·e + KV)/HBM, FLOPs/rate) + L·launch + (L+1)·latency + L·(P-1)·B·H·(D+1)·4 B/link",
                  "  KV      = 2·L·B·H_kv·D·ceil((T+n-1)/P)·e; weights N·e (1 byte each with --fp8); fits: weights + "
                  "KV within the GPU's memory"]
    else:
        lines += ["  prefill = L·(attention forward pipeline on H/t heads + forward TP collectives) "
                  "+ 2·(N - V·d)·B·T/(P·t) FLOPs / rate",
                  "  decode  = max((N_t·e + KV)/HBM, FLOPs/rate) + L·launch + L·(2 all-reduces of B·d·e + 2·latency) "
                  "+ (L+1)·latency + L·(P-1)·B·(H/t)·(D+1)·4 B/link",
                  "  KV      = 2·L·B·(H_kv/t)·D·ceil((T+n-1)/P)·e; N_t: one TP rank's parameters, e bytes each (1 with "
                  "--fp8); fits: weights + KV within the GPU's memory"]
    return lines


def _partial(plan: InferencePlan) -> list[str]:
    pp = plan.partial
    lines = [f"Partial prefill at CP={pp.cp}: a chunk of T_new={pp.new} tokens on top of T_cached = T+n = {pp.cached} "
             f"(positions dealt round-robin; T_new/(T_cached+T_new) = {pp.new_fraction:.3f})"]
    if pp.cp == 1:
        return lines + ["  one rank: nothing moves (give --cp P to compare pass-KV and pass-Q)"]
    lines.append(f"  {'':<8} {'bytes per rank per layer':<38} {'':>12} {'stages':>6} {'compute/stage':>14} "
                 f"{'transfer/stage':>15} {'tail':>11} {'per layer':>11}")
    for c in pp.costs:
        p = c.pipeline
        lines.append(f"  {LABELS[c.method]:<8} {PARTIAL_FORMULAS[c.method]:<38} {format_bytes(c.bytes_sent):>12} "
                     f"{p.stages:>6} {format_seconds(p.compute):>14} {format_seconds(p.transfer):>15} "
                     f"{format_seconds(p.tail):>11} {format_seconds(c.seconds):>11}")
    crossover = (f"pass-KV is predicted no slower from T_new = {pp.crossover} on" if pp.crossover is not None else
                 "pass-Q is predicted faster for every T_new up to 16M")
    return lines + [
        f"  choice: {LABELS[pp.method]} ({pp.why})",
        f"  by bytes alone: {LABELS[pp.bytes_method]} ({pp.bytes_why})",
        f"  bytes rule: pass-Q moves fewer bytes while T_new/(T_cached+T_new) < 2·H_kv·D·e/(H·(D·e+(D+1)·a)) = "
        f"{pp.pass_q_fraction:.3f}; the published 2·H_kv/H = {pp.published_fraction:.3f} (Yang et al. 2024, "
        f"arXiv:2411.01783) counts the queries only, not the partial outputs returned",
        f"  crossover at T_cached = {pp.cached}: {crossover}",
    ]
