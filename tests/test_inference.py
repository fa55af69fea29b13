"""Inference under CP on 1-4 gloo ranks: prefill and decode logits against the single-process
model, greedy and sampled tokens, what each rank's cache holds, and bad input."""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
import torch

import ctxpar
import inference_cases as cases
import spawned
from ctxpar.auto import CANDIDATES
from ctxpar.inference import KVCache, decode_step, generate, partial_prefill, prefill, reference_generate
from ctxpar.plan import get_hardware
from ctxpar.plan.inference import choose_partial_prefill
from ctxpar.verify import FP32_RTOL

WORLD_SIZES = (1, 2, 3, 4)


for _world in WORLD_SIZES:  # first: it checks what a first generate call imports
    spawned.declare(f"inference-P{_world}", cases.run_all, _world, timeout_s=60, first=True)


def results(world: int) -> list[dict]:
    """Per-rank results of ``inference_cases.run_all`` on ``world`` ranks."""
    return spawned.results(f"inference-P{world}")


def _reported(world: int, check: str) -> list:
    per_rank = [res[check] for res in results(world)]
    for rank, r in enumerate(per_rank):
        assert not isinstance(r, str), r  # a check that raised reports its traceback
    return per_rank


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_a_first_generate_call_loads_no_heavy_module(world: int) -> None:
    """Its ttft_s is the prefill's, not a half-second import's: a DTensor or FSDP1 unit can exist only
    once its module is loaded, so the checks look it up rather than import it."""
    for res in results(world):
        assert res["first_call_imports"] == dict(before=[], loaded=[]), res["first_call_imports"]


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_prefill_and_every_decode_step_match_the_single_process_model(world: int) -> None:
    per_rank = _reported(world, "logits")
    # every layout x strategy and auto (GQA), the ring under MQA, and on more than one rank the hybrid (a user's
    # layout holding T-1 inside the mesh too: the broadcast from its place's rank, not the rank of that number);
    # from P=3 that layout under the ring
    assert len(per_rank[0]) == 3 * 4 + 3 + (3 + 1 if world > 1 else 0) + (world == 4) + (world > 2)
    assert all(r.pop("place_to_rank", True) is True for r in per_rank), "hybrid: a mesh place maps to another rank"
    for case, (errors, _) in per_rank[0].items():
        assert len(errors) == 1 + cases.FORCED_STEPS
        for step, err in enumerate(errors):
            assert err <= FP32_RTOL, f"P={world} {case}: step {step} (0 = prefill) relative error {err:.2e}"
    for case in per_rank[0]:  # every rank samples from the very same numbers
        assert len({r[case][1] for r in per_rank}) == 1, f"P={world} {case}: logits differ between ranks"


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_a_float32_model_under_autocast_serves_as_it_runs_alone(world: int) -> None:
    """Under autocast(bfloat16) the rank holding the last position broadcast bf16 logits into
    the others' float32 buffers (rank 1's off by 1.2 of the logits' scale, another token
    chosen; 1.4e16 after a partial prefill), and a decode step refused its bf16 query beside
    the float32 cache ("q, k, v are torch.bfloat16, torch.float32, torch.float32")."""
    per_rank = _reported(world, "autocast")
    for r in per_rank:
        assert r["dtypes"] == ["torch.bfloat16"], r
        assert len(r["errors"]) == 1 + len(cases.TURNS)
        assert max(r["errors"]) <= 2e-2, r["errors"]  # bf16 logits: a few of its 2**-8 roundings
    assert len({r["digest"] for r in per_rank}) == 1, "ranks hold different logits"


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_greedy_tokens_equal_the_single_process_generation(world: int) -> None:
    per_rank = _reported(world, "greedy")
    reference = per_rank[0]["reference"]
    assert len(reference[0]) == cases.GREEDY_TOKENS >= 32
    for rank, r in enumerate(per_rank):
        for case in (f"{lay}-{s}" for lay in cases.LAYOUTS for s in cases.WITH_AUTO):
            assert r[case]["tokens"] == reference, f"P={world} rank {rank} {case}"
            assert r[case]["ttft_s"] > 0 and r[case]["tpot_s"] > 0


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_strategy_auto_asks_the_planner_once_per_prefill_layer_and_never_in_decode(world: int) -> None:
    """strategy="auto" (its tokens: the test above) resolves in ``ctxpar.attention``: each
    layer of the prefill records one of auto's candidates, the same on every rank; the
    GREEDY_TOKENS - 1 decode steps ask nothing. An explicit strategy records nothing."""
    per_rank = _reported(world, "greedy")
    for layout in cases.LAYOUTS:
        chosen = [r[f"{layout}-auto"]["chosen"] for r in per_rank]
        assert len(chosen[0]) == cases.CONFIGS["gqa"].layers, (layout, chosen[0])
        assert set(chosen[0]) <= set(CANDIDATES), (layout, chosen[0])
        assert all(c == chosen[0] for c in chosen), (layout, chosen)
        for strategy in cases.STRATEGIES:
            assert all(r[f"{layout}-{strategy}"]["chosen"] == [] for r in per_rank), (layout, strategy)


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_each_cache_holds_its_prompt_positions_and_every_pth_decoded_one(world: int) -> None:
    """Prompt positions as the layout dealt them, then position p on rank p mod P; the
    last token is returned, not fed back, so T + n - 1 positions in all; kv_cache_bytes is
    what the rank allocated for them."""
    per_rank = _reported(world, "greedy")
    decoded = range(cases.PROMPT_LEN, cases.PROMPT_LEN + cases.GREEDY_TOKENS - 1)
    slots = -(-decoded.stop // world)  # what each rank allocates, ceil((T + n - 1) / P), however many it holds
    for case in (f"{lay}-{s}" for lay in cases.LAYOUTS for s in cases.WITH_AUTO):
        held = []
        for rank, r in enumerate(per_rank):
            want = r[case]["prompt_positions"] + [p for p in decoded if p % world == rank]
            assert r[case]["positions"] == want, f"P={world} rank {rank} {case}"
            # held bytes passed at P = 4, where the shares are equal
            assert r[case]["kv_cache_bytes"] == slots * r[case]["bytes_per_position"], f"P={world} rank {rank} {case}"
            held.append(len(want))
        assert sorted(p for r in per_rank for p in r[case]["positions"]) == list(range(decoded.stop))
        assert max(held) - min(held) <= 1, f"P={world} {case}: unbalanced {held}"


def test_kv_cache_bytes_per_rank_at_p4_are_a_quarter_of_single_process() -> None:
    single = _reported(1, "greedy")[0]["zigzag-ring"]
    per_token = single["bytes_per_position"]  # K and V of one position, all layers: one token per layer
    positions = cases.PROMPT_LEN + cases.GREEDY_TOKENS - 1
    assert single["kv_cache_bytes"] == single["held_bytes"] == positions * per_token
    for rank, r in enumerate(_reported(4, "greedy")):
        for case, c in ((k, v) for k, v in r.items() if k != "reference"):
            for what in ("kv_cache_bytes", "held_bytes"):
                assert single[what] / 4 <= c[what] <= single[what] / 4 + per_token, (rank, case, what, c[what])


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_seeded_sampling_draws_the_single_process_tokens_on_every_rank(world: int) -> None:
    for rank, r in enumerate(_reported(world, "sampled")):
        assert r["tokens"] == r["reference"], f"P={world} rank {rank}"
        assert len(r["tokens"][0]) == cases.SAMPLED_TOKENS


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_generate_takes_a_prompt_of_any_length(world: int) -> None:
    """A length the layout did not split was refused, advising padding, which generate has none of;
    a layout of the user's took the whole prompt, which prefill refused unless it split."""
    for rank, r in enumerate(_reported(world, "any_length")):
        # the cache's, the whole prompt
        assert r.pop("prompt_len") == [2 * world * 3 + 1, 2 * world - 1, 2 * world * 3 + 1], (rank, r)
        # one token on top of 6P cached: pass-Q's fewer bytes; 2P - 1 on none: pass-KV's; one rank's zigzag splits
        # any length, and nothing moves
        tails = [(1, "pass-q"), (2 * world - 1, "pass-kv"), (1, "pass-q")] if world > 1 else [None, None,
                                                                                             (1, "pass-kv")]
        assert r.pop("tails") == tails, (rank, r)
        assert r and all(r.values()), (rank, r)


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_a_rank_with_an_empty_shard_contributes_nothing_and_sinks_are_merged_exactly(world: int) -> None:
    for r in _reported(world, "empty_shard"):
        assert r["err"] <= FP32_RTOL and r["sinks_err"] <= FP32_RTOL, r
        assert r["sinks_effect"] > 0.05, r  # the sinks bite
        assert r.get("mesh_err", 0.0) <= FP32_RTOL and ("mesh_err" in r) == (world % 2 == 0), r


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_partial_prefill_matches_the_single_process_model_turn_after_turn(world: int) -> None:
    """Prompt, then decode steps and chunks of 1, 3 (fewer tokens than ranks), 13 and 8
    tokens by pass-KV, pass-Q and auto: every turn's logits, on every rank alike."""
    per_rank = _reported(world, "partial")
    assert len(per_rank[0]) == 3 * 3 + 3 + 1
    for case, r in ((c, r) for c, r in per_rank[0].items() if c != "bytes"):
        assert len(r["errors"]) == 1 + len(cases.TURNS)
        for turn, err in enumerate(r["errors"]):
            assert err <= FP32_RTOL, f"P={world} {case}: turn {turn} (0 = prompt) relative error {err:.2e}"
        assert len({res[case]["digest"] for res in per_rank}) == 1, f"P={world} {case}: logits differ between ranks"


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_pass_q_and_pass_kv_give_the_same_logits(world: int) -> None:
    r = _reported(world, "partial")[0]
    for layout in (*cases.LAYOUTS, "empty"):
        kv, q = (torch.tensor(r[f"gqa-{layout}-{m}"]["logits"]) for m in ("pass-kv", "pass-q"))
        assert cases.rel_error(q, kv) <= FP32_RTOL, layout


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_partial_prefill_moves_the_bytes_the_planner_counts(world: int) -> None:
    for rank, r in enumerate(_reported(world, "partial")):
        for method, (sent, expected) in r["bytes"].items():
            assert sent == expected, f"P={world} rank {rank} {method}: sent {sent} B, formula {expected} B"


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_chunks_go_round_robin_and_keep_the_caches_balanced(world: int) -> None:
    per_rank = _reported(world, "partial")
    after_prompt = range(cases.PROMPT_LEN, cases.PROMPT_LEN + cases.TURN_TOKENS)
    for case in (c for c in per_rank[0] if c != "bytes"):
        held = []
        for rank, res in enumerate(per_rank):
            r = res[case]
            prompt = r["prompt_positions"] if r["prompt_positions"] is not None else \
                [p for p in range(cases.PROMPT_LEN) if p % world == rank]
            assert r["positions"] == prompt + [p for p in after_prompt if p % world == rank], (case, rank)
            held.append(len(r["positions"]))
        assert max(held) - min(held) <= 1, f"P={world} {case}: unbalanced {held}"


EXPECTED_MESSAGES = {
    "capacity": ["prompt of 24 tokens", "capacity of 22"],
    "capacity_one_short": ["prompt of 24 tokens", "capacity of 23"],
    "batch": ["batch B=2", "built for batch 3"],
    "heads": ["(layers, kv_heads, head_dim, value_dim) = (2, 4, 8, 8)", "(2, 2, 8, 8)"],
    "layout_length": ["not a multiple of 2*P=", "zigzag layout", "pad to"],
    "strategy": ["inference strategy 'ulysses'", "ring, allgather, alltoall, hybrid, auto"],
    "hybrid_no_mesh": ["strategy='hybrid' takes mesh="],
    "mesh_not_hybrid": ["mesh= is for strategy='hybrid'"],
    "mesh_with_auto": ["mesh= is for strategy='hybrid'; 'auto' runs on the cache's group"],
    "mesh_not_a_mesh": ["mesh= must be a torch DeviceMesh", "got object"],
    "before_prefill": ["decode before prefill"],
    "prefill_twice": ["already holds a sequence of 24 positions"],
    "decode_batch": ["batch B=1", "built for batch 2"],
    "new_tokens": ["new_tokens must be", "got 0"],
    "short_prompt_strategy": ["inference strategy 'ulysses'"],
    "short_prompt_hybrid": ["strategy='hybrid' takes mesh="],
    "temperature": ["temperature must be", "-1.0"],
    "cache_full": ["KV cache is full", "25 positions"],
    "step": ["disagree on the decode step", "position (prompt + steps) [25,"],
    "tokens_differ": ["disagree on the decode step", "tokens (crc32)"],
    "chunk_capacity": ["24 cached + 5 new positions exceed", "capacity of 28"],
    "chunk_batch": ["chunk: batch B=1", "built for batch 2"],
    "chunk_method": ["method 'pass-x'", "auto, pass-kv, pass-q"],
    "chunk_empty": ["holds no tokens"],
    "chunks_differ": ["disagree on the partial prefill", "chunk tokens (crc32)"],
    "methods_differ": ["disagree on the partial prefill", "method"],
    "calls_differ": ["disagree on the", "call ['decode step', 'partial prefill'"],
    "chunk_capacities_differ": ["disagree on the partial prefill", "capacity [28, 29"],
    "interrupted_chunk": ["ok: the retry gives the uninterrupted logits"],
    "cache_not_a_cache": ["cache must be a ctxpar KVCache", "got NoneType"],
    "consistency_type": ["check_consistency must be True or False, got ''"],  # once skipped the check
    "decode_consistency_type": ["check_consistency must be True or False, got 'no'"],
    "temperature_overflow": ["temperature must be a finite number", "got 1000"],
    "cache_on_a_mesh": ["this KVCache is held over a hybrid mesh", "take a cache on the CP group"],
    "cache_on_group_and_mesh": ["KVCache takes group= or mesh=, not both"],
    "attention_queries_differ": ["disagree on the sharded attention", "q values (crc32)"],
    "attention_scales_differ": ["disagree on the sharded attention: scale [0.5, 0.25"],
    "attention_sinks_differ": ["disagree on the sharded attention: sinks (crc32) ["],
    "models_differ": ["disagree on the generate call", "model (a checksum of its config"],
    "weights_differ": ["disagree on the generate call", "weights (a checksum of each parameter's first values"],
    **{f"unchecked_{entry}": ["NO ERROR"] for entry in ("prefill", "chunk", "decode", "attention")},
    "one_rank_bad_keys_on_a_mesh": ["refused alike"],
    "prefill_weights_differ": ["disagree on the prefill", "weights (a checksum of each parameter's first values"],
    "attention_grad": ["sharded_attention is inference only, but grad mode is on and q set requires_grad",
                       "under torch.no_grad() or torch.inference_mode(), or use ctxpar.attention for training"],
    "inference_mode_cache": ["KV cache was built under torch.inference_mode()", "inside torch.inference_mode() as"],
    "value_dim": ["(layers, kv_heads, head_dim, value_dim) = (2, 4, 8, 8)", "built for (2, 4, 8, 16)",
                  "KVCache.for_model(model.cfg"],
    "nested_prompt": ["the prompt: expected token ids as a dense (B, T) tensor, one length for every prompt, got a "
                      "nested tensor"],
    "sparse_prompt": ["prompt: expected token ids as a dense (B, n) tensor", "got a sparse_coo tensor"],
    "temperature_differs": ["disagree on the generate call: temperature [0.5, 0.5000000000000001"],
    "names_differ": ["disagree on the prefill", "layout ['zigzag/", "'striped/", "strategy ['ring', 'allgather'"],
    "empty_prompt": ["the prompt holds no tokens"],  # once 'length 0 is not a multiple of 2*P ... pad to 2P'
    "caches_swapped": ["disagree on the decode step: sequence so far (crc32) ["],
    "chunk_caches_swapped": ["disagree on the partial prefill: sequence so far (crc32) ["],
    "deals_differ": ["disagree on the decode step: prompt dealt by ['zigzag/", "'striped/"],
    "generate_layouts_differ": ["disagree on the generate call: layout ['zigzag/", "'striped/"],
    "mesh_over_other_ranks": ["the hybrid mesh spans global ranks [", "but the KV cache's group holds [",
                              "build the cache on the group the mesh spans, or build the mesh over the group's"],
    # generate builds the cache itself: the fix is its group= (it once said to build the cache)
    "generate_mesh_of_fewer_ranks": ["the hybrid mesh holds 2 ranks but group= (generate builds the KV cache on "
                                     "it) holds 4; pass group= the process group of the mesh's ranks (for a mesh "
                                     "taken from a larger one, each rank's own: dist.new_subgroups_by_enumeration"],
    "generate_mesh_over_other_ranks": ["the hybrid mesh spans global ranks [", "but group= (generate builds the KV "
                                       "cache on it) holds [", "pass group= the process group of the mesh's ranks"],
}
ONE_RANK_BAD = {  # the last rank's call is bad: it raises its own error, the others name it
    "one_rank_bad": "batch B=1",
    "one_rank_overflow": "temperature must be a finite number",
    "one_rank_bad_keys": "H a multiple of H_kv",
    "one_rank_on_token": "on_token must be None or a function",
    "one_rank_attention_grad": "sharded_attention is inference only, but grad mode is on and k set requires_grad",
    "one_rank_value_dim": "(layers, kv_heads, head_dim, value_dim) = (2, 4, 8, 8)",
    "one_rank_nested_prompt": "prompt: expected token ids as a dense (B, n) tensor",
    "one_rank_empty_strategy": "inference strategy '': choose one of",
    **{f"one_rank_flag_{call}": "check_consistency must be True or False, got None"
       for call in ("prefill", "decode", "chunk", "generate", "attention")},
}
RANK_0_BAD = {  # rank 0's call is bad: it raises its own error, the others name it
    "rank_0_shard_full": "rank 0's KV cache shard cannot take its share of the chunk",
}
MULTI_RANK_ONLY = ("layout_length", "step", "tokens_differ", "chunks_differ", "methods_differ", "calls_differ",
                   "chunk_capacities_differ", "interrupted_chunk", "cache_on_a_mesh", "cache_on_group_and_mesh",
                   "attention_queries_differ", "attention_scales_differ", "attention_sinks_differ", "models_differ",
                   "weights_differ", "prefill_weights_differ", "temperature_differs", "names_differ", "caches_swapped",
                   "chunk_caches_swapped", "deals_differ", "generate_layouts_differ", "unchecked_prefill",
                   "unchecked_chunk", "unchecked_decode", "unchecked_attention")
ONLY_AT_P4 = ("mesh_over_other_ranks", "generate_mesh_of_fewer_ranks", "generate_mesh_over_other_ranks",
              "one_rank_bad_keys_on_a_mesh")


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_bad_inputs_raise_clear_errors_on_every_rank_without_hanging(world: int) -> None:
    for rank, messages in enumerate(_reported(world, "bad_inputs")):
        messages = dict(messages)
        assert messages.pop("after") == "ok", "generation after the rejected calls"
        refill = messages.pop("rewound_refill", None)
        if world > 1:
            assert "rewound into its prompt" in refill or "of the CP group rejected their decode step" in refill, refill
        for bad, own_messages in ((world - 1, ONE_RANK_BAD), (0, RANK_0_BAD)):
            for case, own in own_messages.items():
                message = messages.pop(case, None)
                if world > 1:
                    want = own if rank == bad else f"ranks [{bad}] of the CP group rejected"
                    assert want in message, (case, rank, message)
        expected = {k for k in EXPECTED_MESSAGES if (world > 1 or k not in MULTI_RANK_ONLY)
                    and (world == 4 or k not in ONLY_AT_P4)}
        assert set(messages) == expected
        for name, message in messages.items():
            for fragment in EXPECTED_MESSAGES[name]:
                assert fragment in message, f"P={world} rank {rank} {name}: {fragment!r} not in {message!r}"


def test_without_a_process_group_generate_is_the_single_process_generation() -> None:
    model, prompt = cases.build(), cases.prompt_tokens()
    for temperature in (0.0, 1.0):
        got = generate(model, prompt, layout="striped", new_tokens=5, temperature=temperature, seed=7)
        assert got.tokens.tolist() == reference_generate(model, prompt, new_tokens=5, temperature=temperature,
                                                         seed=7).tolist()
        assert got.cache.positions().tolist() == list(range(cases.PROMPT_LEN + 4))


def test_time_per_output_token_is_the_decode_steps_time_over_the_tokens_after_the_first(monkeypatch) -> None:
    """tpot_s: the new_tokens - 1 decode steps' time over their count (the first token is the
    prefill's); once divided by new_tokens, 20% short at 5 tokens. ttft_s ends once the first
    token is sampled, and each later sampling counts in its step. On a clock that the decode
    steps (20 ms each) and the samplings (5 ms each) alone move: exact on a loaded machine."""
    import importlib

    module = importlib.import_module("ctxpar.inference.generate")  # the package's `generate` is the function
    clock, real_step, real_sample = [0.0], module.decode_step, module.Sampler.__call__

    def step(*args, **kwargs):
        clock[0] += 0.02
        return real_step(*args, **kwargs)

    def sample(self, logits):
        clock[0] += 0.005
        return real_sample(self, logits)

    monkeypatch.setattr(module, "_now", lambda device: clock[0])
    monkeypatch.setattr(module, "decode_step", step)
    monkeypatch.setattr(module.Sampler, "__call__", sample)
    got = generate(cases.build(), cases.prompt_tokens(), layout="striped", new_tokens=5)
    assert (got.ttft_s, clock[0]) == (pytest.approx(0.005), pytest.approx(0.105))
    assert got.tpot_s == pytest.approx(0.025)


def test_a_custom_attention_fn_is_refused_not_replaced() -> None:
    """Prefill and decode put causal attention over the sharded cache in each layer's place:
    a sliding window set by hand was once silently dropped; apply_context_parallel's runs."""
    from ctxpar.inference.hooks import attention_modules
    from ctxpar.layout import get_layout
    from ctxpar.parallelize import apply_context_parallel

    model, prompt = cases.build(), cases.prompt_tokens()
    want = reference_generate(model, prompt, new_tokens=3).tolist()
    apply_context_parallel(model, layout=get_layout("zigzag", 1))
    assert generate(model, prompt, layout="zigzag", new_tokens=3).tokens.tolist() == want

    def windowed(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    attention_modules(model)[1].attention_fn = windowed
    with pytest.raises(ValueError, match="layer 1's attention_fn is 'windowed'"):
        generate(model, prompt, layout="zigzag", new_tokens=3)


def test_a_cache_on_a_cuda_device_this_process_lacks_is_refused_by_name() -> None:
    """torch's refusal was an AssertionError on a CPU build, or an allocation failure said to
    need a smaller capacity."""
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"KVCache device {missing}: this process sees "):
        KVCache(layers=1, batch=1, kv_heads=1, head_dim=4, capacity=8, device=missing)


def test_cache_allocates_a_pth_of_the_capacity_and_refuses_bad_shapes() -> None:
    cache = KVCache(layers=3, batch=2, kv_heads=2, head_dim=4, capacity=10, dtype=torch.bfloat16)
    assert cache.local_capacity == 10 and cache.nbytes == 10 * 2 * 3 * 2 * 2 * 4 * 2
    assert cache.keys(0).shape == (2, 2, 0, 4) and cache.owner(7) == 0
    assert cache.next_positions(3, 0).tolist() == [0, 1, 2]  # one rank keeps every position
    for new, rank in ((-1, 0), (2, 1), (2, -1), (1.5, 0), (True, 0)):
        with pytest.raises(ValueError, match="next_positions: "):
            cache.next_positions(new, rank)
    with pytest.raises(ValueError, match="capacity must be an int between 1"):
        KVCache(layers=3, batch=2, kv_heads=2, head_dim=4, capacity=0)
    # numpy integers, as generate takes them
    sized = KVCache(layers=np.int64(3), batch=np.int32(2), kv_heads=2, head_dim=4, capacity=np.uint16(10))
    assert (sized.nbytes, type(sized.batch), sized.next_positions(np.int64(3), np.int64(0)).tolist()) == (
        cache.nbytes * 2, int, [0, 1, 2])  # float32 against bfloat16
    with pytest.raises(ValueError, match="do not fit the cache"):
        cache.write(0, 0, torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4))
    latents = KVCache(layers=1, batch=2, kv_heads=1, head_dim=6, value_dim=2, capacity=10)  # MLA's: K and V widths
    assert latents.nbytes == 10 * 2 * (6 + 2) * 4
    k, v = torch.randn(2, 1, 3, 6), torch.randn(2, 1, 3, 2)
    latents.write(0, 0, k, v)
    latents.commit(torch.arange(3), seq_len=3)
    assert torch.equal(latents.keys(0), k) and torch.equal(latents.values(0), v)
    with pytest.raises(ValueError, match=re.escape("the cache's (B, H_kv, n, D) = (2, 1, n, D), D = 6, Dv = 2")):
        latents.write(0, 3, k, k)
    with pytest.raises(ValueError, match="value_dim must be an int between 1"):
        KVCache(layers=1, batch=2, kv_heads=1, head_dim=6, value_dim=0, capacity=10)


def test_a_cache_built_outside_inference_mode_runs_each_call_in_or_out_of_it_exactly() -> None:
    """A cache built outside torch.inference_mode() (what the refusal of one built inside it
    advises), prefilled inside it: the token record its first commit made there was an
    inference tensor, and every later decode step or chunk outside inference mode raised
    torch's in-place error after its collectives had run."""
    model, prompt = cases.build(), cases.prompt_tokens()

    def steps(prefill_mode) -> list[torch.Tensor]:
        cache = KVCache.for_model(model.cfg, batch=prompt.shape[0], capacity=cases.PROMPT_LEN + 8)
        with prefill_mode():
            logits = [prefill(model, cache, prompt[:, :16], layout="zigzag")]
        logits.append(decode_step(model, cache, prompt[:, 16]))
        logits.append(partial_prefill(model, cache, prompt[:, 17:20]))
        with torch.inference_mode():
            logits.append(decode_step(model, cache, prompt[:, 20]))
        return logits

    for got, want in zip(steps(torch.inference_mode), steps(torch.no_grad), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("message", ["CUDA out of memory. Tried to allocate 8 GiB\nmore", ""])
def test_a_cache_that_cannot_be_allocated_is_refused_naming_its_size(message: str, monkeypatch) -> None:
    """The allocator's first line, or its error's name where the message is empty (an
    IndexError then took the refusal's place)."""
    def refuse(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(ValueError, match=r"needs 0\.0156 GiB on cpu, which could not be allocated \((CUDA out of "
                                         r"memory\. Tried to allocate 8 GiB|RuntimeError)\); build it with a smaller"):
        KVCache(layers=2, batch=1, kv_heads=4, head_dim=64, capacity=4096)


def test_rewind_forgets_the_later_positions_and_the_next_chunk_continues_there() -> None:
    model, prompt = cases.build(), cases.prompt_tokens()
    chunk = cases.prompt_tokens(5, seed=9)
    cache = KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=cases.PROMPT_LEN + 5)
    prefill(model, cache, prompt, layout="zigzag")
    first = partial_prefill(model, cache, chunk, method="pass-q")
    cache.rewind(cases.PROMPT_LEN)
    assert (cache.seq_len, cache.length, cache.prompt_len) == (cases.PROMPT_LEN,) * 3
    assert cache.positions().tolist() == list(range(cases.PROMPT_LEN))
    again = partial_prefill(model, cache, chunk, method="pass-kv")
    assert cases.rel_error(again, first) <= FP32_RTOL
    for bad in (-1, cases.PROMPT_LEN + 6, 2.0, True):
        with pytest.raises(ValueError, match="rewind to"):
            cache.rewind(bad)
    cache.rewind(np.int64(cases.PROMPT_LEN - 2))  # numpy integers, as generate takes them: once refused
    assert (cache.seq_len, type(cache.seq_len)) == (cases.PROMPT_LEN - 2, int)


def test_a_caches_history_is_its_tokens_however_they_were_fed_and_rewound() -> None:
    """What decode_step and partial_prefill compare across ranks: the sequence itself, not the
    calls that fed it, so the same tokens fed in other pieces or rewound and fed again match."""
    model, prompt = cases.build(), cases.prompt_tokens()
    tokens = torch.cat([prompt, cases.prompt_tokens(4, seed=5)], dim=1)  # (B, T + 4)

    def cache() -> KVCache:
        return KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=tokens.shape[1])

    whole, pieces = cache(), cache()
    prefill(model, whole, tokens, layout="zigzag")
    prefill(model, pieces, prompt, layout="zigzag")
    partial_prefill(model, pieces, tokens[:, -4:-2])
    for i in (-2, -1):
        decode_step(model, pieces, tokens[:, i])
    assert whole.history == pieces.history and whole.dealt_by == pieces.dealt_by == "zigzag/1"
    pieces.rewind(cases.PROMPT_LEN - 3)
    assert pieces.history != whole.history and pieces.prompt_len == cases.PROMPT_LEN - 3  # into the prompt
    partial_prefill(model, pieces, tokens[:, cases.PROMPT_LEN - 3:])
    assert pieces.history == whole.history
    pieces.rewind(cases.PROMPT_LEN + 1)
    decode_step(model, pieces, tokens[:, cases.PROMPT_LEN + 2])  # another token at that position
    assert pieces.history != whole.history
    # back by exactly one position, its token read into the history above: once kept that checksum
    pieces.rewind(cases.PROMPT_LEN + 1)
    for i in range(cases.PROMPT_LEN + 1, tokens.shape[1]):
        decode_step(model, pieces, tokens[:, i])
    assert pieces.history == whole.history
    pieces.rewind(0)  # as fresh: a peer with a fresh cache takes the same calls
    assert (pieces.history, pieces.dealt_by, pieces.prompt_len) == (0, "", 0)
    with pytest.raises(ValueError, match="decode before prefill"):  # the prompt forgotten (once decoded position 0)
        decode_step(model, pieces, tokens[:, 0])
    partial_prefill(model, pieces, tokens[:, :3])
    assert pieces.history != 0
    pieces.reset()
    assert (pieces.history, pieces.dealt_by) == (0, "")


def test_layers_sharing_one_attention_module_are_refused_not_decoded_from_overwritten_kv() -> None:
    """The second call's K/V took the first's cache slot: the first decode step was 57% off."""
    model, prompt = cases.build(), cases.prompt_tokens()
    model.layers[1] = model.layers[0]
    with pytest.raises(ValueError, match=r"layers\.0\.attention and layers\.1\.attention are one attention module: "
                                         r"CP inference keeps one KV cache slot per attention module"):
        generate(model, prompt, layout="zigzag", new_tokens=2)
    one_slot = KVCache(layers=1, batch=cases.BATCH, kv_heads=model.cfg.kv_heads, head_dim=model.cfg.head_dim,
                       capacity=cases.PROMPT_LEN + 1)
    with pytest.raises(ValueError, match="layer 0's attention module ran twice in one forward"):
        prefill(model, one_slot, prompt, layout="zigzag")
    assert one_slot.seq_len == 0


def test_partial_prefill_auto_chooses_with_the_caches_partials_and_its_dtypes_rates(monkeypatch) -> None:
    """A float64 cache's partials are 8 bytes (auto once took 4 and sent 27% more bytes), and a
    float32 cache runs at float32 rates (auto once took the bf16 rates the plan does not)."""
    from ctxpar.inference import partial

    asked = []

    def spy(**kw):
        asked.append(kw)
        return "pass-kv", ""

    monkeypatch.setattr(partial, "choose_partial_prefill", spy)
    h100 = get_hardware("H100-SXM")
    for dtype, acc, rates in ((torch.float64, 8, "float32"), (torch.float32, 4, "float32"),
                              (torch.bfloat16, 4, "bfloat16"), (torch.float16, 4, "float16")):
        model = cases.build().to(dtype)
        cache = KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=cases.PROMPT_LEN, dtype=dtype)
        partial_prefill(model, cache, cases.prompt_tokens(3), hardware=h100)
        assert (asked[-1]["elem"], asked[-1]["acc"]) == (dtype.itemsize, acc)
        assert asked[-1]["hw"] == h100.for_dtype(rates)
    assert h100.for_dtype("float32") != h100


def test_partial_prefill_gathers_the_held_positions_on_the_device_its_group_carries(monkeypatch) -> None:
    """NCCL carries GPU tensors only: the all-gather of every rank's held positions is made on
    ``collective_device`` (here a stand-in that is not the host), and its result read on the
    host. A CPU tensor there made partial prefill (and generate() with a prompt the layout
    cannot split) fail on every rank under torchrun."""
    from ctxpar.inference import partial

    handed = []

    class Gather:  # what PendingAllGather is handed; two ranks' tables come back
        def __init__(self, shard: torch.Tensor, group) -> None:
            handed.append((shard.device, shard.shape))

        def wait(self) -> torch.Tensor:
            return torch.tensor([[0, 2, 4], [1, 3, -1]])

    monkeypatch.setattr(partial, "collective_device", lambda group: torch.device("meta"), raising=False)
    monkeypatch.setattr(partial, "PendingAllGather", Gather)
    cache = KVCache(layers=1, batch=1, kv_heads=1, head_dim=8, capacity=3)
    held = partial._gather_positions(torch.tensor([0, 2, 4]), cache)
    assert handed == [(torch.device("meta"), (3,))]
    assert [row.tolist() for row in held] == [[0, 2, 4], [1, 3]] and held[0].device.type == "cpu"


def test_a_cache_continues_only_with_the_model_that_filled_it() -> None:
    """Another model's queries over this one's K/V gave logits of neither model, without a
    word (the cache checked only its shape); after reset() the cache takes a new model."""
    from ctxpar.inference import decode_step

    model, other, prompt = cases.build(), cases.build(), cases.prompt_tokens()  # equal weights, another model
    cache = KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=cases.PROMPT_LEN + 2)
    prefill(model, cache, prompt, layout="zigzag")
    step = torch.zeros(cases.BATCH, dtype=torch.long)
    for continue_with in (lambda: decode_step(other, cache, step),
                          lambda: partial_prefill(other, cache, step[:, None])):
        with pytest.raises(ValueError, match="holds 24 positions of K/V another model computed"):
            continue_with()
    decode_step(model, cache, step)
    cache.reset()
    prefill(other, cache, prompt, layout="zigzag")
    decode_step(other, cache, step)


def test_auto_chooses_by_bytes_without_hardware_and_by_predicted_time_with_it() -> None:
    cfg = cases.CONFIGS["gqa"]
    small, large = dict(cached=4096, new=8), dict(cached=64, new=4096)
    pick = [choose_partial_prefill(model=cfg, batch=1, world=4, elem=4, **kw)[0] for kw in (small, large)]
    assert pick == ["pass-q", "pass-kv"]
    h100 = get_hardware("H100-SXM")
    method, why = choose_partial_prefill(model=cfg, batch=1, world=4, elem=4, hw=h100, **small)
    assert method == "pass-q" and "predicted on H100-SXM" in why
    with pytest.raises(ValueError, match="hardware must be a ctxpar.plan.Hardware"):
        model = cases.build()
        cache = KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=cases.PROMPT_LEN)
        partial_prefill(model, cache, cases.prompt_tokens(), hardware="H100-SXM")


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e30])
def test_sampling_at_extreme_temperatures_draws_real_tokens(temperature: float) -> None:
    """A tiny temperature samples the largest logit (it once overflowed to inf and NaN
    probabilities); a huge one still draws valid tokens."""
    from ctxpar.inference.generate import Sampler

    logits = torch.tensor([[1.0, 3.0, -2.0, float("-inf")], [0.5, -1.0, 0.25, 7.0]])
    tokens = Sampler(temperature, seed=3)(logits)
    if temperature < 1:
        assert tokens.tolist() == [1, 3]
    assert tokens.dtype == torch.int64 and tokens[0] in (0, 1, 2) and tokens[1] in (0, 1, 2, 3)


@pytest.mark.parametrize("temperature, logits", [(0.5, [1.0, 3.0, -2.0, 2.0, 0.5]), (0.8, [1.0, 3.0, -2.0, 2.0, 0.5]),
                                                  (2.0, [1.0, 3.0, -2.0, 2.0, 0.5]), (1e-3, [0.0, 0.005, 0.01])])
def test_sampling_draws_tokens_as_often_as_softmax_of_logits_over_temperature(temperature: float,
                                                                               logits: list[float]) -> None:
    """The seeded sampling tests compare generate with the single-process run, which samples
    with the same Sampler: here its draws are checked against the distribution itself (the
    logits divided by the square root of the temperature passed every other test; a temperature
    clamped to 1e-2 once drew the last of [0, 0.005, 0.01] at 1e-3 half the time, not 99%)."""
    from ctxpar.inference.generate import Sampler

    logits = torch.tensor(logits)
    draws = Sampler(temperature, seed=0)(logits.expand(40_000, -1))  # one draw per row
    frequencies = torch.bincount(draws, minlength=len(logits)).double() / draws.numel()
    want = torch.softmax(logits.double() / temperature, -1)
    # 4 standard deviations of a frequency over 40,000 draws is at most 0.01
    torch.testing.assert_close(frequencies, want, rtol=0, atol=0.01)


def test_generate_and_sampler_take_seeds_from_0_to_the_largest_the_refusal_names() -> None:
    """"seed must be between 0 and 4294967295": both ends are taken, one past either is refused,
    by Sampler, generate and reference_generate (an off-by-one bound refusing 4294967295, the
    largest seed the message offers, passed every test as a planted mutation; test_cli checks
    the --seed flags)."""
    from ctxpar.inference.generate import Sampler
    from ctxpar.limits import MAX_SEED

    model, prompt = cases.build(), cases.prompt_tokens()
    for seed in (0, MAX_SEED):
        assert Sampler(1.0, seed=seed)(torch.zeros(2, 5)).shape == (2,)
    # the host's generator whatever the logits' device: a CUDA one drew other tokens than the CPU reference's
    assert Sampler(1.0, seed=0).generator.device == torch.device("cpu")
    got = generate(model, prompt, layout="zigzag", new_tokens=2, temperature=1.0, seed=MAX_SEED).tokens
    assert got.tolist() == reference_generate(model, prompt, new_tokens=2, temperature=1.0, seed=MAX_SEED).tolist()
    for seed in (-1, MAX_SEED + 1):
        for call in (lambda: Sampler(1.0, seed=seed),
                     lambda: reference_generate(model, prompt, new_tokens=2, seed=seed),
                     lambda: generate(model, prompt, layout="zigzag", new_tokens=2, seed=seed)):
            with pytest.raises(ValueError, match=f"seed must be between 0 and {MAX_SEED}, got {seed}$"):
                call()


def test_generate_takes_numpy_integers_and_refuses_a_prompt_or_model_on_another_device() -> None:
    """new_tokens and seed as numpy integers (the CLI's config takes them) were refused while a
    numpy temperature ran; a prompt or model on the meta device met torch's "Tensor.item()
    cannot be called on meta tensors" from the token-range check, not a word on its device."""
    from ctxpar.limits import MAX_COUNT

    model, prompt = cases.build(), cases.prompt_tokens()
    want = reference_generate(model, prompt, new_tokens=2, temperature=1.0, seed=5).tolist()
    for new_tokens, seed in ((np.int64(2), np.int64(5)), (np.int32(2), np.uint32(5))):
        got = generate(model, prompt, layout="zigzag", new_tokens=new_tokens, temperature=1.0, seed=seed)
        assert got.tokens.tolist() == want
        assert reference_generate(model, prompt, new_tokens=new_tokens, temperature=1.0, seed=seed).tolist() == want
    # a numpy int32's sum with the prompt's length wraps: the largest count passed the cache-size check (and
    # reference_generate went on into 2**31 steps)
    with pytest.raises(ValueError, match=f"need a KV cache of {MAX_COUNT + prompt.shape[1] - 1} positions, more "):
        generate(model, prompt, layout="zigzag", new_tokens=np.int32(MAX_COUNT))
    meta, split = cases.build().to("meta"), cases.build()
    split.embed.to("meta")
    for (model_, prompt_), message in (((model, prompt.to("meta")), "the prompt is on meta but the model is on cpu"),
                                       ((meta, prompt), "the model is on the meta device, its weights not loaded"),
                                       ((meta, prompt.to("meta")), "the model is on the meta device"),
                                       ((split, prompt), r"the model's parameters are on several devices \(cpu, "
                                                         r"meta\): generate runs it on one")):
        for call in (lambda: generate(model_, prompt_, layout="zigzag", new_tokens=2),
                     lambda: reference_generate(model_, prompt_, new_tokens=2)):
            with pytest.raises(ValueError, match=f"^{message}"):
                call()


def test_sharded_attention_under_autocast_keeps_float64_q_k_v_exact() -> None:
    """As SDPA does, sharded_attention under autocast(bfloat16) casts float32 inputs and leaves
    float64 ones alone: a float64 call stays float64 and within 1e-12 of float64 attention
    (cast down, as a planted mutation did unnoticed: bfloat16, 5e-3 off)."""
    from ctxpar.inference import sharded_attention
    from ctxpar.kernels.reference import reference_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 2, 8, generator=gen, dtype=torch.float64)
    kv = [torch.randn(1, 2, 7, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sharded_attention(q, *kv, group=None, scale=None, sinks=sinks)
    want, _ = reference_attention(q, *kv, causal=False, sinks=sinks)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 is cast, as SDPA casts it
        assert sharded_attention(q.float(), *(t.float() for t in kv), group=None, scale=None).dtype == torch.bfloat16


def test_sharded_attention_refuses_sinks_of_another_shape_or_not_finite_and_two_groupings() -> None:
    from ctxpar.inference import sharded_attention

    q, kv = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=re.escape("sinks must be a tensor of shape (H,) = (4,)")):
        sharded_attention(q, kv, kv, group=None, scale=8**-0.5, sinks=torch.zeros(2))
    inf = torch.tensor([0, 0, 0, float("inf")])
    for check in (True, False):  # the host refuses them, whatever check_consistency is (docs/reliability.md)
        with pytest.raises(ValueError, match="sinks must be finite in torch.float32"):
            sharded_attention(q, kv, kv, group=None, scale=8**-0.5, sinks=inf, check_consistency=check)
        with pytest.raises(ValueError, match="sinks must be finite in torch.float32"):
            ctxpar.attention(q, q, q, layout="contiguous", sinks=inf, check_consistency=check)
    with pytest.raises(ValueError, match=re.escape("takes group= or mesh=, not both")):
        sharded_attention(q, kv, kv, group=object(), mesh=object(), scale=8**-0.5)
    with pytest.raises(ValueError, match="mesh= must be a torch DeviceMesh"):
        sharded_attention(q, kv, kv, group=None, mesh="2x2", scale=8**-0.5)


@pytest.mark.parametrize("grad", ["q", "k", "v", "sinks"])
def test_sharded_attention_is_inference_only(grad: str) -> None:
    """Under grad mode, inputs that require grad are refused: the all-gather cut the graph on 2
    or more ranks (no gradient, or the sinks' alone), and on one the kernel's lse had none (dq,
    dk wrong with sinks). Without grad mode, or under inference mode, the same tensors attend."""
    from ctxpar.inference import sharded_attention

    gen = torch.Generator().manual_seed(4)
    inputs = dict(q=torch.randn(1, 4, 2, 8, generator=gen), k=torch.randn(1, 2, 3, 8, generator=gen),
                  v=torch.randn(1, 2, 3, 8, generator=gen), sinks=torch.randn(4, generator=gen))
    inputs[grad].requires_grad_()
    with pytest.raises(ValueError, match=f"inference only, but grad mode is on and {grad} set requires_grad"):
        sharded_attention(**inputs, group=None, scale=None)
    q, k, v, sinks = (inputs[name].detach() for name in ("q", "k", "v", "sinks"))
    scores = torch.cat([q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 8**-0.5,
                        sinks.view(1, -1, 1, 1).expand(1, -1, 2, 1)], dim=-1)  # (B, H, S, n + 1)
    want = scores.softmax(-1)[..., :-1] @ v.repeat_interleave(2, 1)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = sharded_attention(**inputs, group=None, scale=None)
        assert cases.rel_error(got, want) <= FP32_RTOL


@pytest.mark.parametrize("heads, kv_heads", [(6, 4), (2, 4)])
def test_sharded_attention_refuses_heads_that_do_not_group(heads: int, kv_heads: int) -> None:
    """Once garbage rows (6 over 4) or a SIGFPE (2 over 4), before any collective."""
    from ctxpar.inference import sharded_attention

    q, kv = torch.randn(1, heads, 1, 8), torch.randn(1, kv_heads, 3, 8)
    with pytest.raises(ValueError, match="H a multiple of H_kv"):
        sharded_attention(q, kv, kv, group=None, scale=8**-0.5)


_Q, _KV = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 3, 8)


@pytest.mark.parametrize("q, kv, scale, message", [
    (_Q.long(), _KV.long(), None, "q, k, v are torch.int64, torch.int64, torch.int64; they must share one of"),
    (_Q, _KV.double(), None, "q, k, v are torch.float32, torch.float64, torch.float64"),
    (_Q[:, :, :0], _KV, None, "q (1, 4, 0, 8) is empty"),
    (_Q[..., :0], _KV[..., :0], None, "q (1, 4, 1, 0) is empty"),
    (_Q, _KV, float("nan"), "scale must be a positive finite number"),
], ids=["integer", "mixed", "no_queries", "no_head_dim", "nan_scale"])
def test_sharded_attention_refuses_what_it_cannot_attend(q, kv, scale, message: str) -> None:
    """Integer tensors once gave integer 'attention', zero queries a SIGFPE in the CPU kernel."""
    from ctxpar.inference import sharded_attention

    with pytest.raises(ValueError, match=re.escape(message)):
        sharded_attention(q, kv, kv, group=None, scale=scale)


def test_generation_inputs_are_refused_by_name_not_by_torch() -> None:
    """Each of these once surfaced as torch's own error (an IndexError in the embedding, the
    allocator's, a TypeError) or named something the caller never passed."""
    from ctxpar.inference import decode_step

    model, prompt = cases.build(), cases.prompt_tokens()
    refused = {
        "ids outside the vocabulary": (lambda: reference_generate(model, prompt + 200, new_tokens=2),
                                       "token ids from 201 to 327 in its prompt, outside its vocabulary of 128"),
        # one id outside: named (the range alone read as if every id from its least were outside)
        "one id outside the vocabulary": (lambda: reference_generate(model, torch.cat([prompt, prompt[:, :1] * 0 + 130],
                                                                                       dim=1), new_tokens=2),
                                          "outside its vocabulary of 128 (0..127): the id 130"),
        "float ids": (lambda: reference_generate(model, prompt.float(), new_tokens=2),
                      "integer token ids (int64), got torch.float32"),
        "prompts of two lengths": (lambda: reference_generate(model, torch.nested.nested_tensor(
            [prompt[0], prompt[1, :3]], layout=torch.jagged), new_tokens=2),
            "the prompt: expected token ids as a dense (B, T) tensor, one length for every prompt, got a nested"),
        "a sparse prompt": (lambda: reference_generate(model, prompt.to_sparse(), new_tokens=2),
                            "got a sparse_coo tensor; convert it with .to_dense()"),
        "a float one-token prompt": (lambda: generate(model, prompt[:, :1].float(), layout="zigzag", new_tokens=2),
                                     "the prompt must hold integer token ids"),
        "new_tokens past the cache's range": (
            lambda: generate(model, prompt, layout="zigzag", new_tokens=2**31 - 1),
            "a prompt of 24 tokens and new_tokens=2147483647 need a KV cache of 2147483670 positions"),
        "on_token": (lambda: generate(model, prompt, layout="zigzag", new_tokens=2, on_token="progress"),
                     "on_token must be None or a function of no arguments, called after each new token, got str"),
        "dtype by name": (lambda: KVCache.for_model(model.cfg, batch=1, capacity=8, dtype="float32"),
                          "KVCache dtype must be a floating-point torch.dtype"),
        "integer dtype": (lambda: KVCache.for_model(model.cfg, batch=1, capacity=8, dtype=torch.int32),
                          "got torch.int32"),
        "device": (lambda: KVCache.for_model(model.cfg, batch=1, capacity=8, device="gpu0"),
                   "KVCache device must be a torch.device or its name"),
        "no config": (lambda: KVCache.for_model(None, batch=1, capacity=8),
                      "KVCache.for_model takes a ctxpar.models.ModelConfig (model.cfg), got NoneType"),
        "memory": (lambda: KVCache.for_model(model.cfg, batch=2**20, capacity=2**24),
                   "rank 0's KVCache shard, 16777216 of its 16777216 positions"),
        "empty batch": (lambda: prefill(model, KVCache.for_model(model.cfg, batch=2, capacity=24), prompt[:0],
                                        layout="zigzag"), "batch B=0 but the KV cache was built for batch 2; pass at "
                                                          "least one sequence"),
    }
    cache = KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=cases.PROMPT_LEN + 2)
    prefill(model, cache, prompt, layout="zigzag")
    refused["decode tokens (1, B)"] = (lambda: decode_step(model, cache, prompt[:, :1].T),
                                       "pass them as (B, n) = (2, 1) or (B,), one token per sequence, not (1, B)")
    refused["0-d decode token"] = (lambda: decode_step(model, cache, prompt[0, 0]), "a decode step takes one token "
                                   "per sequence, (B,) or (B, 1), got () (one sequence's: tokens.view(1))")
    refused["3-d decode tokens"] = (lambda: decode_step(model, cache, prompt[:, :1, None]),
                                    "a decode step takes one token per sequence, (B,) or (B, 1), got (2, 1, 1)")
    refused["nested decode tokens"] = (lambda: decode_step(model, cache, torch.nested.nested_tensor(
        [prompt[0, :1], prompt[1, :1]], layout=torch.jagged)), "decode tokens: expected token ids as a dense (B, n)")
    for name, (call, message) in refused.items():
        try:
            call()
        except ValueError as e:
            assert message in str(e), (name, str(e))
        else:
            pytest.fail(f"{name}: no error")


# -- what the engine hands on and counts (mutation round 54's misses), one process each --------------------------

generate_module = importlib.import_module("ctxpar.inference.generate")  # the package's `generate` is the function


def test_generate_calls_on_token_after_every_token_the_first_included(monkeypatch) -> None:
    """on_token ("called after each new token", the command's progress bar): new_tokens calls, the
    first once the first token is sampled, before any decode step (one short passed every test)."""
    steps, calls = [], []
    real = generate_module.decode_step

    def step(*args, **kwargs):
        steps.append(len(calls))
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_module, "decode_step", step)
    generate(cases.build(), cases.prompt_tokens(), layout="zigzag", new_tokens=4, on_token=lambda: calls.append(1))
    assert len(calls) == 4 and steps == [1, 2, 3], (calls, steps)


def test_a_caches_held_bytes_count_v_at_its_own_width() -> None:
    """A latent cache's K of head_dim 6 beside V of value_dim 2: held_bytes counting V as wide as K
    passed every test (nbytes was checked)."""
    latents = KVCache(layers=1, batch=2, kv_heads=1, head_dim=6, value_dim=2, capacity=10)
    latents.write(0, 0, torch.randn(2, 1, 3, 6), torch.randn(2, 1, 3, 2))
    latents.commit(torch.arange(3), seq_len=3)
    assert latents.held_bytes == 3 * 2 * (6 + 2) * 4
    assert latents.nbytes == 10 * 2 * (6 + 2) * 4


def test_partial_prefill_auto_asks_the_planner_with_the_cached_and_new_counts(monkeypatch) -> None:
    """auto's choice turns on T_new / (T_cached + T_new): the total passed as T_cached picked pass-Q at
    cached 1000, new 600 on 4 ranks (20% more bytes than pass-KV), unseen: the tails' picks are far
    from the threshold."""
    from ctxpar.inference import partial

    asked = []
    monkeypatch.setattr(partial, "choose_partial_prefill", lambda **kwargs: (asked.append(kwargs), ("pass-kv", ""))[1])
    model = cases.build()
    cache = KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=cases.PROMPT_LEN + 3)
    prefill(model, cache, cases.prompt_tokens(), layout="zigzag")
    partial_prefill(model, cache, cases.prompt_tokens(3, seed=7))
    assert [(a["cached"], a["new"], a["world"], a["batch"]) for a in asked] == [(cases.PROMPT_LEN, 3, 1, cases.BATCH)]


def test_generate_passes_check_consistency_to_every_call_it_makes(monkeypatch) -> None:
    """check_consistency=False reaches prefill, partial_prefill and every decode step (a decode step
    checking whatever it was told, an all-gather per token, passed every test)."""
    from hostile_cases import BlockedLayout

    seen = []

    def spying(name, fn):
        def call(*args, **kwargs):
            seen.append((name, kwargs.get("check_consistency")))
            return fn(*args, **kwargs)
        return call

    for name in ("prefill", "partial_prefill", "decode_step"):
        monkeypatch.setattr(generate_module, name, spying(name, getattr(generate_module, name)))
    prompt = cases.prompt_tokens(cases.PROMPT_LEN + 1)  # blocks of 2 split 24 of 25: one token by partial_prefill
    for flag in (False, True):
        seen.clear()
        generate(cases.build(), prompt, layout=BlockedLayout(1, block=2), new_tokens=3, check_consistency=flag)
        assert seen == [("prefill", flag), ("partial_prefill", flag), ("decode_step", flag), ("decode_step", flag)]


def test_prefill_hands_check_consistency_to_each_layers_attention(monkeypatch) -> None:
    """prefill's docstring: "each attention call checks its own"."""
    prefill_module = importlib.import_module("ctxpar.inference.prefill")
    seen = []
    real = prefill_module.attention
    monkeypatch.setattr(prefill_module, "attention",
                        lambda *args, **kwargs: (seen.append(kwargs["check_consistency"]), real(*args, **kwargs))[1])
    model = cases.build()
    for flag in (True, False):
        seen.clear()
        cache = KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=cases.PROMPT_LEN)
        prefill(model, cache, cases.prompt_tokens(), layout="zigzag", check_consistency=flag)
        assert seen == [flag] * model.cfg.layers


def test_decode_and_pass_q_merge_partials_in_the_accumulation_dtype(monkeypatch) -> None:
    """A bfloat16 model's partial (out, lse) are merged in float32: merged in bfloat16, attention at P=4
    over 4096 keys came out 4.6e-2 off instead of 5.2e-3, which the autocast test's tiny model (24
    positions, 2e-2 on logits) does not show, and at P=1 nothing is merged across ranks at all."""
    from ctxpar.inference import decode, partial

    seen = []
    for module in (decode, partial):
        real, name = module.merge_packed, module.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(module, "merge_packed",
                            lambda packed, real=real, name=name: (seen.append((name, packed.dtype)), real(packed))[1])
    model = cases.build().to(torch.bfloat16)
    cache = KVCache.for_model(model.cfg, batch=cases.BATCH, capacity=cases.PROMPT_LEN + 4, dtype=torch.bfloat16)
    prefill(model, cache, cases.prompt_tokens(), layout="zigzag")
    decode_step(model, cache, cases.prompt_tokens(1, seed=3)[:, 0])
    partial_prefill(model, cache, cases.prompt_tokens(3, seed=4), method="pass-q")
    layers = model.cfg.layers
    assert seen == [("decode", torch.float32)] * layers + [("partial", torch.float32)] * layers, seen
