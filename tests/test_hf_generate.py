"""``model.generate()`` of a transformers causal LM under CP: the tokens of generate without CP.

P = 2, 3, 4 run inside hf_cases' one spawn of 4 gloo ranks (``hf_generate_cases``); P = 1
runs here, without a process group.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

import hf_cases  # noqa: E402
import hf_families  # noqa: E402
import hf_generate_cases as cases  # noqa: E402
import torch  # noqa: E402

import ctxpar  # noqa: E402
from ctxpar.auto import CANDIDATES  # noqa: E402
from ctxpar.integrations.transformers import ShardedCache, enable_context_parallel  # noqa: E402

ONE = ctxpar.get_layout("zigzag", 1)


def _part(rank: int, name: str):
    """Rank ``rank``'s results of the part ``name`` of hf_generate_cases (failed if it raised)."""
    got = hf_cases.results()[rank]["generate"][name]
    if isinstance(got, str):
        pytest.fail(got)
    return got


def _runs(world: int, key: str) -> list[dict]:
    """The ranks of the CP group of ``world`` ranks that ran ``key``."""
    return [_part(rank, "tokens")[(world, key)] for rank in range(world)]


@pytest.mark.parametrize("world, key", [(p, key) for p in cases.WORLDS for key in cases.cases(p)])
def test_generate_under_cp_gives_the_tokens_of_generate_without_cp(world: int, key: str) -> None:
    """Greedy and seeded sampling, 8 new tokens after a 24-token prompt, batch 2: every
    rank returns the sequences the same model's generate returns without CP."""
    runs = _runs(world, key)
    for rank, r in enumerate(runs):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["equal"], f"rank {rank}: tokens differ from generate without CP at (row, column) {r['first_mismatch']}"
    copies = cases.cases(world)[key][3].get("num_return_sequences", 1)
    assert runs[0]["shape"] == (cases.BATCH * copies, cases.PROMPT_LEN + cases.NEW_TOKENS)
    assert len({r["digest"] for r in runs}) == 1


@pytest.mark.parametrize("world, key", [(p, key) for p in cases.WORLDS for key in cases.cases(p)])
def test_strategy_auto_asks_the_planner_once_per_layer_in_the_prefill_only(world: int, key: str) -> None:
    """strategy="auto" (its tokens: the test above) resolves through ``ctxpar.attention``:
    each layer of the prefill records one of auto's candidates, the same on every rank;
    decode steps do not ask (they merge over the group whatever the prefill moved). An
    explicit strategy records nothing."""
    runs = _runs(world, key)
    for rank, r in enumerate(runs):
        assert "error" not in r, f"rank {rank}: {r['error']}"
    if cases.cases(world)[key][2] != "auto":
        assert all(r["chosen"] == [] for r in runs), [r["chosen"] for r in runs]
        return
    assert len(runs[0]["chosen"]) == runs[0]["layers"], runs[0]["chosen"]
    assert set(runs[0]["chosen"]) <= set(CANDIDATES), runs[0]["chosen"]
    assert all(r["chosen"] == runs[0]["chosen"] for r in runs), [r["chosen"] for r in runs]


@pytest.mark.parametrize("case", [c for c in hf_families.CASES if c not in hf_families.REFUSED])
def test_every_family_that_runs_under_cp_generates_its_tokens_or_is_refused_naming_why(case: str) -> None:
    """2 ranks, zigzag, 4 new tokens after 16: never other tokens than generate without CP."""
    verdicts = [_part(rank, "families")[case] for rank in range(4) if case in _part(rank, "families")]
    assert len(verdicts) == 2, f"{case} ran on {len(verdicts)} ranks"
    for kind, detail in verdicts:
        if case in cases.GENERATE_REFUSED:
            assert kind == "refused" and cases.GENERATE_REFUSED[case] in detail, f"{case}: {kind}: {detail}"
        else:
            assert kind == "equal", f"{case} must generate the tokens of generate without CP; it was {kind}: {detail}"


def test_each_rank_caches_its_prompt_positions_and_every_pth_decoded_one() -> None:
    """Zigzag on 4 ranks: rank r holds the layout's prompt positions, then the decoded
    positions p with p mod 4 = r; the cache reports the global length; the scores
    (return_dict_in_generate) are the unsplit model's."""
    layout = ctxpar.get_layout("zigzag", 4)
    total = cases.PROMPT_LEN + cases.NEW_TOKENS - 1  # the last token is returned, not fed back
    for rank in range(4):
        got = _part(rank, "cache")
        decoded = [p for p in range(cases.PROMPT_LEN, total) if p % 4 == rank]
        assert got["positions"] == layout.positions(cases.PROMPT_LEN, rank).tolist() + decoded
        assert got["seq_len"] == total
        assert got["equal"] and got["same_masked"] and got["scores_err"] <= 1e-4, got


REFUSED = {  # what generate must refuse on every rank, and the words of the error
    "beam search": "NotImplementedError: generation mode 'beam_search' (num_beams=2)",
    "assisted": "NotImplementedError: assisted decoding",
    "cache passed in": "NotImplementedError: generate got past_key_values=",
    "static cache": "NotImplementedError: generate with cache_implementation='static'",
    "no cache": "NotImplementedError: generate with use_cache=False",
    "chunked prefill": "NotImplementedError: generate with prefill_chunk_size=8",
    "padding": "ValueError: padding",
    "mask of halves": "ValueError: generate got an attention_mask holding 0.5: a mask holds 0 (padding) and 1",
    "mask of another length": f"ValueError: generate got an attention_mask of shape (2, 30) for input_ids of shape "
                              f"(2, {cases.PROMPT_LEN}): pass a mask of the prompt's shape, or none",
    # torch's embedding error ("Expected tensor for argument #1 'indices'"), the argument unnamed
    "float prompt": "ValueError: LlamaForCausalLM got token ids of dtype torch.float64: token ids are integers",
    "inputs_embeds": "NotImplementedError: generate from inputs_embeds",
    "output_attentions": "NotImplementedError: generate with output_attentions=True",
    "longrope head": "ValueError: Phi3ForCausalLM uses LongRoPE (long factors from position 8): a prompt of 12 tokens "
                     "is prefilled as its first 8",
    # the cache's keys stayed rotated with the short factors: the next logits 6.6 off, other tokens, silently
    "longrope switch": "ValueError: Phi3ForCausalLM uses LongRoPE: its generate runs the whole sequence again with "
                       "the long factors once it passes original_max_position_embeddings=8 tokens, which the sharded "
                       "cache cannot follow (its keys stay rotated with the short factors); from this prompt of 8 "
                       "tokens generate at most 1 new token, or start from a prompt longer than 8",
    # the head's tokens never saw the rest, as they do in the whole prompt: logits up to 10 off, silently
    "bidirectional, prompt fed in parts": "ValueError: ElectraSelfAttention attends bidirectionally, and the prompt "
                                          "of 12 tokens, a length the zigzag layout does not split (it splits "
                                          "multiples of 8), is fed as its first 8 tokens, then one token at a time",
    # it named the cache's batch ("ShardedCache batch must be an int between 1 and ...")
    "empty batch": "ValueError: generate under context parallelism needs the whole prompt as input_ids (B, T), the "
                   "same on every rank, got (0, 24)",
    "guidance_scale": "NotImplementedError: generate with guidance_scale=1.5 is not supported under context "
                      "parallelism: classifier-free guidance",
    # a replica done early ran forwards past its cache's capacity; the others waited in transformers' all-reduce
    "synced_gpus": "NotImplementedError: generate with synced_gpus (which transformers turns on under FSDP",
    "prompts differ": "ValueError: the ranks of the CP group disagree on the generate call: arguments",
    "seeds differ": "ValueError: the ranks of the CP group disagree on the generate call: RNG state",
    "one draw more": "ValueError: the ranks of the CP group disagree on the generate call: RNG state",
    # another norm epsilon on rank 1: tokens and logits without a word
    "another config on rank 1": "ValueError: the ranks of the CP group disagree on the generate call: model (a "
                                "checksum of its config",
    "another config on rank 1 over the sharded cache": "ValueError: the ranks of the CP group disagree on the "
                                                       "generate forward: model (a checksum of its config",
    "other weights on rank 1": "ValueError: the ranks of the CP group disagree on the generate call: weights (a "
                               "checksum of each parameter's first values",
    "dynamic cache in forward": "ValueError: LlamaForCausalLM got past_key_values=DynamicCache",
    # an IndexError on the one rank whose shard held it, its peers waiting, the group out of step for the next call
    "token outside the vocabulary": "ValueError: LlamaForCausalLM got token ids from",
    "longrope prefill": "ValueError: Phi3ForCausalLM uses LongRoPE",
    "sdpa after enable": "ValueError: LlamaForCausalLM's attention implementation is now 'sdpa'",
    # once raised inside the prefill, naming the cache's capacity (an argument the caller never gave)
    "max_new_tokens past the count": "ValueError: generate with max_new_tokens=2147483648 and a prompt of 24 tokens "
                                     "sizes the sharded KV cache for 2147483671 positions, more than the 2147483647",
    # a forward over the sharded cache: an IndexError on the rank holding it, the others a "different call"
    "token outside the vocabulary over the sharded cache": "ValueError: LlamaForCausalLM got token ids from 5 to 101",
    "logits_to_keep over the sharded cache": "ValueError: LlamaForCausalLM got logits_to_keep=3 with ctxpar's "
                                             "sharded cache",
    "router logits over the sharded cache": "ValueError: LlamaForCausalLM got output_router_logits=True (in the call "
                                            "or its config) with ctxpar's sharded cache",
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_generate_cannot_honour_is_refused_on_every_rank(case: str) -> None:
    for rank in range(4):
        got = _part(rank, "refusals")[case]
        assert got.startswith(REFUSED[case]), f"rank {rank}: {got}"


def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank_and_generate_works_after() -> None:
    """Beam search asked on rank 1 only: rank 1 says why, the others name rank 1; then a
    plain generate on the same model gives the tokens of generate without CP."""
    for rank in range(4):
        got = _part(rank, "refusals")
        if rank == 1:
            assert got["beam search on rank 1 only"].startswith(REFUSED["beam search"])
        else:
            assert "ranks [1] of the CP group rejected their generate call inputs" in got["beam search on rank 1 only"]
        assert got["after"] is True


def test_a_prompt_the_layout_does_not_split_is_prefilled_in_part_then_token_by_token() -> None:
    """A length the layout does not split was refused, advising padding, which generate refuses;
    one shorter than its multiple (8 for zigzag on 4 ranks) was refused too: each of its tokens
    is now a decode step from the start, ranks holding no position yet adding nothing."""
    for rank in range(4):
        for case in ("9-token prompt", "22-token prompt", "7-token prompt", "1-token prompt", "5-token prompt, MLA",
                     "3-token prompt, sinks", "batch of 1", "1-token prompt, bidirectional",
                     "LongRoPE past its switch, cache kept"):
            assert _part(rank, "refusals")[case] is True, (rank, case, _part(rank, "refusals")[case])


def test_every_rank_stops_where_any_rank_stops_and_compares_the_last_token() -> None:
    """max_time was refused (each rank stopped by its own clock, the others waited); a stopping
    criterion of one rank stopped that rank alone; a last token that differed between ranks
    (it reaches no forward, whose check compares tokens) was returned without a word."""
    runs = [_part(rank, "refusals") for rank in range(4)]
    for case in ("max_time", "a stop of rank 1"):
        kinds = {run[case][0] for run in runs}
        assert kinds == {"ran"}, (case, [run[case] for run in runs])
        assert all(run[case] == runs[0][case] for run in runs), case  # the same sequences on every rank
        assert len(runs[0][case][1][0]) == cases.PROMPT_LEN + 1, case  # stopped after the first new token
    for case in ("a row's eos", "a stop of row 0 on rank 1"):  # one row stopping stopped every row once
        for rank, run in enumerate(runs):
            (kind, got), want = run[case]
            assert (kind, got) == ("ran", want), (case, rank, run[case])
            assert len(want[1]) == cases.PROMPT_LEN + 4, case  # row 1 ran on to max_new_tokens
    eos_run = runs[0]["a row's eos"][1]
    assert eos_run[0][cases.PROMPT_LEN + 2:] == [0, 0] and 0 not in eos_run[1][cases.PROMPT_LEN:]  # row 0 padded
    stop_run = runs[0]["a stop of row 0 on rank 1"][1]
    assert len(set(stop_run[0][cases.PROMPT_LEN + 1:])) == 1 < len(set(stop_run[1][cases.PROMPT_LEN + 1:]))  # padded
    for rank, run in enumerate(runs):
        for case in ("last token differs", "row 0's last token differs"):
            kind, message = run[case]
            assert kind == "refused" and "appended different tokens at position 24" in message, (case, rank, message)
        kind, message = run["a stop failing on rank 1"]  # the others waited in the all-reduce until the timeout
        want = "a criterion of rank 1 failed" if rank == 1 else "a stopping criterion failed on another rank"
        assert kind == "refused" and want in message, (rank, message)


def test_a_logits_processor_failing_on_one_rank_fails_every_rank_at_that_step() -> None:
    """It raised on rank 1 alone, its peers waiting in the step's all-reduce until the timeout;
    a processor's parameters are compared (logits that differ are not blamed on them), a
    stopping criterion's state (a clock's start) is not, and a whole float max_new_tokens is
    served as without CP."""
    runs = [_part(rank, "refusals") for rank in range(4)]
    for rank, run in enumerate(runs):
        kind, message = run["a processor failing on rank 1"]
        want = "a processor of rank 1 failed" if rank == 1 else "a logits processor failed on another rank"
        assert kind == "refused" and want in message, (rank, message)
        kind, message = run["a processor's parameter differing"]
        assert kind == "refused" and "the logits processors of the ranks of the CP group gave different scores for " \
            f"position {cases.PROMPT_LEN}: a logits processor (its parameters)" in message, (rank, message)
        for case in ("logits differing", "logits differing, a processor"):
            kind, message = run[case]
            assert kind == "refused" and "the model gave the ranks of the CP group different logits for position " \
                f"{cases.PROMPT_LEN + 1} (before any logits processor): a forward hook" in message, (case, message)
        kind, message = run["a guidance processor"]
        assert kind == "refused" and "generate with a UnbatchedClassifierFreeGuidanceLogitsProcessor is not " \
            "supported" in message, (rank, message)
        for case in ("a clock of one's own", "max_new_tokens 3.0", "max_new_tokens 3.5",
                     "the model's generation config passed in", "stop strings"):
            (kind, got), want = run[case]
            assert (kind, got) == ("ran", want), (case, rank, run[case])


def test_generates_arguments_are_compared_by_value_type_or_code() -> None:
    """What the ranks compare of generate's arguments before any collective: plain values and
    containers of them by value (sets in any order; dict keys by their own checksum, not by
    str(), which shows addresses), functions by name and code (two lambdas written in one
    place once compared equal), other objects by type alone: a creation time or an id held
    by a processor refused calls alike everywhere. A cycle ends; a meta tensor raises."""
    from transformers import MaxTimeCriteria, TemperatureLogitsWarper

    from ctxpar.integrations.transformers.generation import _crc

    class Processor:
        def __init__(self, started) -> None:
            self.started, self.words = started, list({"alpha", "beta", "gamma"})

    def allowed(batch, ids):
        return [5]

    assert _crc(Processor(1.0)) == _crc(Processor(2.0)) and _crc([MaxTimeCriteria(5.0, initial_timestamp=1.0)]) == \
        _crc([MaxTimeCriteria(5.0, initial_timestamp=2.0)])
    assert _crc([TemperatureLogitsWarper(0.5)]) == _crc([TemperatureLogitsWarper(2.0)])  # compared by their scores
    assert _crc({1, 2, 3}) == _crc({3, 2, 1}) != _crc({1, 2}) and _crc({"b", "a"}) == _crc({"a", "b"})
    assert _crc({allowed: 1, Processor(1.0): 2}) == _crc({allowed: 1, Processor(2.0): 2})
    assert _crc([1, 2]) != _crc((1, 2)) and _crc({"a": [1, 2]}) != _crc({"a": [2, 1]})
    looped = []
    looped.append(looped)
    assert _crc(looped) == _crc(looped)
    lambdas = [lambda batch, ids: [5], lambda batch, ids: [6]]
    assert _crc(lambdas[0]) != _crc(lambdas[1]) and _crc(allowed) != _crc(lambdas[0])
    assert _crc(Processor(1.0).__init__) == _crc(Processor(2.0).__init__)
    with pytest.raises(NotImplementedError):
        _crc(torch.zeros(2, device="meta"))


def test_a_forward_over_the_sharded_cache_compares_every_token() -> None:
    """Its signature holds a checksum of all its tokens, not of the last column alone (rank
    0 went on with logits for a prompt it never passed, 0.02 off)."""
    from ctxpar.integrations.transformers.generation import _forward_signature

    tokens = torch.arange(24).view(2, 12)
    other = tokens.clone()
    other[0, 5] += 1
    cache = ShardedCache(layers=1, batch=2, capacity=16)
    assert _forward_signature(cache, {"input_ids": tokens}) != _forward_signature(cache, {"input_ids": other})


def test_position_ids_over_the_sharded_cache_are_checked_in_every_row_and_the_row_named() -> None:
    """A forward of one's own over the cache with position_ids other than the sequence's, in one
    row of the prefill or in a decode step, is refused (a check of any row, or none in a decode
    step, passed every test), naming the row that differs (row 0's right ids were shown)."""
    model = enable_context_parallel(hf_families.build("llama"), layout=ONE)
    tokens = cases.prompt()[:, :8]
    shifted = torch.arange(8).repeat(2, 1)
    shifted[1] += 100
    with torch.no_grad():
        with pytest.raises(ValueError, match=re.escape("got position_ids (row 1) 100..107 for positions 0..7 of "
                                                       "the sequence")):
            model(input_ids=tokens, position_ids=shifted, cache=ShardedCache(layers=2, batch=2, capacity=16))
        cache = ShardedCache(layers=2, batch=2, capacity=16)
        model(input_ids=tokens, position_ids=torch.arange(8).repeat(2, 1), cache=cache)  # the right ones run
        # a decode step's mask covers the cached tokens too (a mask of the new token alone masked the cache's
        # keys without CP, 0.54 off, and ran unmasked here)
        with pytest.raises(ValueError, match=re.escape("got an attention_mask of shape (2, 1), for 9 tokens in each "
                                                       "of 2 rows; pass the mask of the whole sequence so far")):
            model(input_ids=tokens[:, :1], attention_mask=torch.ones(2, 1), cache=cache)
        with pytest.raises(ValueError, match=re.escape("got position_ids (row 0) 3 for positions 8..8")):
            model(input_ids=tokens[:, :1], position_ids=torch.tensor([[3], [8]]), cache=cache)
        model(input_ids=tokens[:, :1], position_ids=torch.tensor([[8], [8]]), cache=cache)
    from ctxpar.integrations.transformers.generation import _check_position_ids

    want = torch.arange(8)
    for odd, shown in ((torch.zeros(2, 0, dtype=torch.long), "of shape (2, 0)"), (torch.tensor(3), "of shape ()"),
                       (torch.zeros(0, 8, dtype=torch.long), "of shape (0, 8)"), ([0, 1], "as list")):
        with pytest.raises(ValueError, match=re.escape(f"got position_ids {shown} for positions 0..7")):
            _check_position_ids("M", odd, want, 0)  # a RuntimeError or StopIteration of its own, once
    three_d = torch.arange(8).repeat(3, 2, 1)  # (3, B, n), as a multimodal RoPE's
    three_d[1, 1, 0] = 5
    with pytest.raises(ValueError, match=re.escape("got position_ids (row (1, 1)) 5, 1..7 for positions 0..7")):
        _check_position_ids("M", three_d, want, 0)


def test_a_prompt_fed_in_parts_is_refused_where_dynamic_rope_passes_its_limit_within_it() -> None:
    """The whole prompt's largest position decides, not the head's the layout splits (a head of
    60 under max_position_embeddings=62 passed a 63-token prompt: logits 2e-4 off)."""
    from ctxpar.integrations.transformers.attention import Settings
    from ctxpar.integrations.transformers.generation import _head_rope_refusal

    def settings(limit: int) -> Settings:
        return Settings(ctxpar.get_layout("zigzag", 2), None, "ring", None, dynamic=(limit,))

    refusal = _head_rope_refusal("M", settings(62), head=60, length=63)
    assert isinstance(refusal, ValueError) and "reaches position 62" in str(refusal), refusal
    assert _head_rope_refusal("M", settings(64), head=60, length=63) is None


def test_the_most_max_new_tokens_a_refusal_advises_is_taken_and_one_more_is_not() -> None:
    from transformers import GenerationConfig

    from ctxpar.integrations.transformers.generation import _check_cache_length

    for setting, prompt_len in (("max_new_tokens", 24), ("max_length", 24)):
        with pytest.raises(ValueError) as e:
            _check_cache_length(prompt_len, GenerationConfig(**{setting: 2**31 + 5}))
        most = int(str(e.value).rsplit(f"ask for {setting} at most ", 1)[1])
        _check_cache_length(prompt_len, GenerationConfig(**{setting: most}))
        with pytest.raises(ValueError, match=f"at most {most}$"):
            _check_cache_length(prompt_len, GenerationConfig(**{setting: most + 1}))


def test_a_difference_in_a_common_setting_is_named_and_a_streamer_on_one_rank_runs() -> None:
    """Both were refused with checksums alone ("arguments (crc32) [...]")."""
    runs = [_part(rank, "refusals") for rank in range(4)]
    for rank, run in enumerate(runs):
        kind, message = run["max_new_tokens differ"]
        assert kind == "refused" and "max_new_tokens [4, 5, 6, 7]" in message, (rank, message)
        kind, message = run["temperature differing"]  # said as checksums of the arguments and config alone
        assert kind == "refused" and "temperature ['0.5', '0.75', '1.0', '1.25']" in message, (rank, message)
        kind, message = run["top_p differing"]
        assert kind == "refused" and "top_p ['0.5', '0.625', '0.75', '0.875']" in message, (rank, message)
        kind, message = run["model.generation_config differing"]
        assert kind == "refused" and "repetition_penalty ['1.0', '1.3', '1.0', '1.0']" in message, (rank, message)
        assert "the call's settings over model.generation_config" in message, message
        unlisted = run["no stops listed on rank 0"]
        assert unlisted == runs[0]["a streamer on rank 0"], (rank, unlisted)
        kind, message = run["a logits processor on rank 0"]
        assert kind == "refused" and "disagree on the generate call: logits_processor (crc32) [" in message, message
        streamed = run["a streamer on rank 0"]
        assert streamed[0] == "ran" and streamed == runs[0]["a streamer on rank 0"], (rank, streamed)
        for at in (1, 3):  # raised at the next forward, on every rank together
            got = run[f"a streamer on rank 0 failing at put {at}"]
            want = "BrokenPipeError: printing to a closed pipe" if rank == 0 else \
                "ValueError: ranks [0] of the CP group rejected their generate forward"
            assert got[0] == "refused" and got[1].startswith(want), (rank, at, got)
        # the last token's put: no forward follows, the peers are done; rank 0 raises alone, from the streamer's end
        got = run["a streamer on rank 0 failing at put 5"]
        want = ("refused", "BrokenPipeError: printing to a closed pipe") if rank == 0 else streamed
        assert got == want, (rank, got)


def test_a_forward_with_a_token_outside_the_vocabulary_on_one_rank_is_refused_on_every_rank() -> None:
    for rank in range(4):
        got = _part(rank, "refusals")["token outside the vocabulary, forward"]
        want = ("ValueError: LlamaForCausalLM got token ids from" if rank == 0 else
                "ValueError: LlamaForCausalLM: another rank of the CP group refused its inputs")
        assert got.startswith(want), f"rank {rank}: {got}"
    assert "to 101, outside its vocabulary of 96 (0..95)" in _part(0, "refusals")["token outside the vocabulary"]


def test_a_forward_over_the_sharded_cache_refuses_a_mask_of_one_rank_on_every_rank() -> None:
    """An all-True 4-D mask was dropped by a forward over the sharded cache (the causal logits,
    0.02 off the masked model's, silently), where the same forward without it refuses it; so
    is grad mode (a decode step's attention has no gradient: its share was silently missing)."""
    for rank in range(4):
        got = _part(rank, "refusals")["4-D mask over the sharded cache on rank 1"]
        want = ("ValueError: LlamaForCausalLM got an explicit attention mask (2, 1, 24, 24)" if rank == 1 else
                "ValueError: ranks [1] of the CP group rejected their generate forward inputs")
        assert got.startswith(want), f"rank {rank}: {got}"
        got = _part(rank, "refusals")["grad mode over the sharded cache on rank 1"]
        want = ("ValueError: LlamaForCausalLM over ctxpar's sharded cache is inference only, but grad mode is on"
                if rank == 1 else "ValueError: ranks [1] of the CP group rejected their generate forward inputs")
        assert got.startswith(want), f"rank {rank}: {got}"


def test_a_rank_that_cannot_allocate_its_share_of_the_cache_raises_with_the_others() -> None:
    """Each layer's cache is made at its first store in the prefill; a rank short of memory
    raised there alone, its peers waiting in attention (gloo: "Connection closed by peer")."""
    for rank in range(4):
        got = _part(rank, "refusals")["cache unallocated on rank 1"]
        want = ("ValueError: rank 1's KVCache shard could not be allocated" if rank == 1 else
                "ValueError: ranks [1] of the CP group could not allocate their share of the sharded KV cache")
        assert got.startswith(want), f"rank {rank}: {got}"
        assert _part(rank, "refusals")["after"] is True


def test_a_sharded_cache_refuses_sizes_it_cannot_hold() -> None:
    """A capacity past what ctxpar counts was taken, and refused by each layer's cache inside
    the first forward."""
    with pytest.raises(ValueError, match=re.escape("ShardedCache capacity must be an int between 1 and 2147483647, "
                                                   "got 100000000000")):
        ShardedCache(layers=2, batch=2, capacity=10**11)
    with pytest.raises(ValueError, match="ShardedCache batch must be an int"):
        ShardedCache(layers=2, batch=True, capacity=8)


@pytest.mark.parametrize("case", [*cases.HYBRID, "replicas"])
def test_the_hybrid_strategy_generates_the_tokens_of_generate_without_cp(case: str) -> None:
    """On a (ring 2) x (ulysses 2) mesh: prefill with the hybrid strategy, decode steps merged
    over the whole mesh (an all-gather along each of its dims), the logits broadcast from the
    rank holding the prompt's last position along both; a prompt the layout does not split
    (27 tokens), sink logits, multi-head latent attention. "replicas": two data-parallel
    replicas each of a (ring 1) x (ulysses 2) mesh, generating for different numbers of steps,
    each over its own ranks alone."""
    for rank in range(4):
        got = _part(rank, "hybrid")[case]
        assert got is True, f"rank {rank}: {got}"


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_one_rank_without_a_process_group_generates_as_without_cp(family: str) -> None:
    tokens = cases.prompt()
    for kwargs in ({}, cases.SAMPLE):
        want = cases.generate(hf_families.build(family), tokens, kwargs)
        model = enable_context_parallel(hf_families.build(family), layout=ONE)
        assert torch.equal(cases.generate(model, tokens, kwargs), want)
    out = model.generate(tokens, max_new_tokens=3, return_dict_in_generate=True)
    assert isinstance(out.cache, ShardedCache) and out.cache.get_seq_length() == cases.PROMPT_LEN + 2
    with pytest.raises(NotImplementedError, match="beam_search"):
        model.generate(tokens, num_beams=2, max_new_tokens=2)
    with pytest.raises(NotImplementedError, match="cannot reorder its sequences"):
        out.cache.reorder_cache(torch.tensor([1, 0]))
    with torch.no_grad(), pytest.raises(ValueError, match="call generate again with the whole sequence"):  # "full"
        model(input_ids=out.sequences[:, -1:], past_key_values=out.cache)
    with pytest.raises(ValueError, match="over ctxpar's sharded cache is inference only, but grad mode is on"):
        model(input_ids=out.sequences[:, -1:], past_key_values=out.cache)
    with pytest.raises(ValueError, match=re.escape("strategy='hybrid' takes mesh=")):  # on a mesh: 4 ranks below
        enable_context_parallel(hf_families.build(family), layout=ONE, strategy="hybrid")


def test_chunked_attention_decodes_past_a_chunks_last_position() -> None:
    """Llama 4's chunks of 4: a decode step at a chunk's last position (p % 4 = 3) sees its
    chunk's keys; 8 new tokens after 16 reach two such steps (the spawned batch's 4 reach none:
    a chunk start taken from p + 1 gave the tokens of another sequence from step 5)."""
    tokens = cases.prompt(length=16)
    want = hf_families.build("llama4_text").generate(tokens, max_new_tokens=8, min_new_tokens=8)
    model = enable_context_parallel(hf_families.build("llama4_text"), layout=ONE)
    assert torch.equal(model.generate(tokens, max_new_tokens=8, min_new_tokens=8), want)


def test_a_moe_routing_in_its_config_generates_and_its_own_forward_over_the_cache_is_refused() -> None:
    """A config asking for router logits (as training sets it) made generate refuse every
    prefill; a forward of one's own over the sharded cache would return each rank's share's
    aux_loss: refused."""
    tokens = cases.prompt()
    want = cases.generate(hf_families.build("mixtral", output_router_logits=True), tokens, {})
    model = enable_context_parallel(hf_families.build("mixtral", output_router_logits=True), layout=ONE)
    assert torch.equal(cases.generate(model, tokens, {}), want)
    with torch.no_grad(), pytest.raises(ValueError, match=r"output_router_logits=True \(in the call or its config\)"):
        model(input_ids=tokens, cache=ShardedCache(layers=2, batch=tokens.shape[0], capacity=tokens.shape[1]))


def test_a_layer_that_stores_in_the_prefill_and_skips_a_decode_step_is_refused() -> None:
    """A layer skipped in a decode step (layer skipping, early exit) left that position's slot
    of its cache counted as held, holding whatever was in memory."""
    model = enable_context_parallel(hf_families.build("llama"), layout=ONE)
    layer = model.model.layers[1]
    forward = layer.forward

    def skipped_when_decoding(hidden_states, *args, **kwargs):
        return hidden_states if hidden_states.shape[1] == 1 else forward(hidden_states, *args, **kwargs)

    layer.forward = skipped_when_decoding
    with pytest.raises(NotImplementedError, match=re.escape("stored no K/V for layers [1] in this step")):
        model.generate(cases.prompt(), max_new_tokens=3, min_new_tokens=3)
