"""Runs inside hf_cases' 4 spawned gloo ranks: ``model.generate()`` under CP against the same
model's generate without CP, on CP groups of P = 2, 3 and 4 of those ranks.

- ``tokens``: for each (P, case), on every rank of the group: whether the generated
  sequences equal the unsplit model's, and a digest of them (the same on every rank).
  Tiny Llama and Mistral (a sliding window of 4, so decode steps see only some of each
  rank's keys), gpt-oss (sink logits; a window on every other layer), DeepSeek-V3 (its
  cache holds latents, expanded into K/V at every step), every layout, the
  three inference strategies and ``strategy="auto"`` (with the strategies the planner
  chose, one per layer of the prefill), greedy and seeded sampling, num_return_sequences=2.
- ``families``: every family that runs under CP (not ``hf_families.REFUSED``) on two CP
  groups of 2 ranks (zigzag, 16-token prompt, 4 new tokens): the same tokens as without
  CP, or refused naming what the sharded cache cannot serve (``GENERATE_REFUSED``).
- ``cache``: on all 4 ranks (zigzag), the positions each rank's ``ShardedCache`` holds
  after generate (``return_dict_in_generate=True`` returns it) and the sequence length.
- ``refusals``: on all 4 ranks, what generate and a forward over a ``ShardedCache`` must
  refuse (the message each rank got), including arguments that differ between ranks and a
  rank that cannot allocate its share of the cache, and a generate that runs afterwards.
- ``hybrid``: ``strategy="hybrid"`` on a 2x2 mesh of the 4 ranks, and on two data-parallel
  replicas each a mesh of its own: the tokens of generate without CP.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist

import ctxpar
from ctxpar.integrations.transformers import ShardedCache, enable_context_parallel, generation

# 24: a multiple of 2P for P = 2, 3, 4; 8 new tokens: every rank of 4 caches two of them
PROMPT_LEN, BATCH, NEW_TOKENS = 24, 2, 8
WORLDS = (2, 3, 4)
LAYOUTS = ("contiguous", "zigzag", "striped")
SEED = 5


def prompt(seed: int = 1, length: int = PROMPT_LEN) -> torch.Tensor:
    import hf_families

    return torch.randint(3, hf_families.VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))


# (family, layout, strategy, generate kwargs): per P; alltoall splits the 4 query heads
SAMPLE = dict(do_sample=True, temperature=0.9, top_k=20)


def cases(world: int) -> dict[str, tuple]:
    """Llama in every layout; Mistral (its window) in every layout on 4 ranks, one on 2 and 3;
    gpt-oss (its sinks) sampled; DeepSeek-V3 (multi-head latent attention); penalties."""
    found = {f"llama/{layout}": ("llama", layout, "ring", {}) for layout in LAYOUTS}
    for layout in LAYOUTS if world == 4 else LAYOUTS[world - 1:world]:
        found[f"mistral/{layout}"] = ("mistral", layout, "ring", {})
    found["llama/zigzag/allgather"] = ("llama", "zigzag", "allgather", {})
    if 4 % world == 0:
        found["llama/striped/alltoall"] = ("llama", "striped", "alltoall", {})
    found["llama/zigzag/auto"] = ("llama", "zigzag", "auto", {})
    found["mistral/striped/auto"] = ("mistral", "striped", "auto", {})
    found["gpt_oss/striped/sampled"] = ("gpt_oss", "striped", "ring", SAMPLE)  # sinks, windows on every other layer
    found["deepseek_v3/contiguous"] = ("deepseek_v3", "contiguous", "ring", {})  # latents cached, expanded per step
    found["llama/zigzag/sampled"] = ("llama", "zigzag", "ring", SAMPLE)
    found["mistral/striped/sampled x2"] = ("mistral", "striped", "ring", dict(SAMPLE, num_return_sequences=2))
    # logits processors reading the whole sequence so far (prompt and new tokens), beside the sampling filters
    found["llama/zigzag/penalised"] = ("llama", "zigzag", "ring", dict(
        SAMPLE, top_p=0.9, min_p=0.02, repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[5], [7, 8]]))
    return found


# family -> the words of generate's refusal: what the sharded cache cannot serve
GENERATE_REFUSED = {
    **dict.fromkeys(("diffllama", "jetmoe"), "attends with K/V other than the ones its cache returned"),
    "dory": "(looped or extra layers)",
}


def generate(model, tokens: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """``model.generate`` for NEW_TOKENS tokens (no early stop at EOS), seeded when sampling."""
    torch.manual_seed(SEED)
    return model.generate(tokens, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kwargs)


def _tokens(rank: int, world: int) -> dict:
    import hf_families

    groups = {p: dist.new_group(list(range(p))) for p in WORLDS}  # every rank creates every group, in order
    tokens = prompt()
    out = {}
    for p in WORLDS:
        if rank >= p:
            continue
        for name, (family, layout, strategy, kwargs) in cases(p).items():
            model = hf_families.build(family)
            want = generate(model, tokens, kwargs)  # without CP; then the same model under CP
            try:
                enable_context_parallel(model, layout=ctxpar.get_layout(layout, p), group=groups[p], strategy=strategy)
                with ctxpar.record(timing=False) as rec:
                    got = generate(model, tokens, kwargs)
            except Exception as e:  # noqa: BLE001  reported by the test
                out[(p, name)] = dict(error=f"{type(e).__name__}: {e}")
                continue
            out[(p, name)] = dict(equal=torch.equal(got, want), shape=tuple(got.shape),
                                  digest=hash(tuple(got.flatten().tolist())), layers=model.config.num_hidden_layers,
                                  chosen=[chosen for chosen, _ in rec.strategy_choices],
                                  first_mismatch=(got != want).nonzero()[:1].tolist() if got.shape == want.shape
                                  else None)
    return out


def _families(rank: int, world: int) -> dict:
    """{case: ("equal" | "different" | "refused" | "error", message)} for this rank's pair."""
    import hf_families

    pairs = [dist.new_group([start, start + 1]) for start in range(0, world, 2)]
    group, index = pairs[rank // 2], rank // 2
    layout = ctxpar.get_layout("zigzag", 2)
    tokens = prompt(length=16)
    out = {}
    for case in [c for c in hf_families.CASES if c not in hf_families.REFUSED][index::len(pairs)]:
        run = dict(max_new_tokens=4, min_new_tokens=4)
        model = hf_families.build(case)
        want = model.generate(tokens, **run)  # without CP; then the same model under CP
        try:
            got = enable_context_parallel(model, layout=layout, group=group).generate(tokens, **run)
        except NotImplementedError as e:
            out[case] = ("refused", str(e))
            continue
        except Exception as e:  # noqa: BLE001  reported by the test
            out[case] = ("error", f"{type(e).__name__}: {e}")
            continue
        out[case] = ("equal", "") if torch.equal(got, want) else ("different", str((got != want).nonzero()[:1]))
    return out


def _cache(rank: int, world: int) -> dict:
    import hf_families

    model = enable_context_parallel(hf_families.build("llama"), layout=ctxpar.get_layout("zigzag", world))
    out = generate(model, prompt(), dict(return_dict_in_generate=True, output_scores=True))
    want = generate(hf_families.build("llama"), prompt(), dict(return_dict_in_generate=True, output_scores=True))
    return dict(positions=out.cache.kv.positions().tolist(), seq_len=out.cache.get_seq_length(),
                equal=torch.equal(out.sequences, want.sequences),
                same_masked=all(torch.equal(a.isfinite(), b.isfinite()) for a, b in zip(out.scores, want.scores)),
                scores_err=max(float((a - b)[b.isfinite()].abs().max()) for a, b in zip(out.scores, want.scores)))


def _attempt(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "ran"


def _switched(layout):
    """Llama under CP, then switched to sdpa: each rank would attend within its own shard."""
    import hf_families

    model = enable_context_parallel(hf_families.build("llama"), layout=layout)
    model.set_attn_implementation("sdpa")
    return model


# strategy="hybrid" on the 2x2 mesh: (family, layout, prompt length, generate kwargs); 27 tokens:
# zigzag on 4 ranks prefills 24, then 3 one at a time
HYBRID = {"llama/zigzag/27 tokens": ("llama", "zigzag", 27, {}),
          "gpt_oss/striped/sampled": ("gpt_oss", "striped", PROMPT_LEN, SAMPLE),
          "deepseek_v3/contiguous": ("deepseek_v3", "contiguous", PROMPT_LEN, {})}


def _hybrid(rank: int, world: int) -> dict:
    """strategy="hybrid": on the (ring 2) x (ulysses 2) mesh of all 4 ranks, each ``HYBRID``
    case; then on (dp 2) x (ring 1, ulysses 2), each replica generating from a prompt and for a
    number of tokens of its own. {case: equal to generate without CP, or the error}."""
    import hf_families
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    replicas = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "ring", "ulysses"))
    replica = rank // 2
    runs = {name: (family, ctxpar.get_layout(layout, world), mesh, prompt(length=length), NEW_TOKENS, kwargs)
            for name, (family, layout, length, kwargs) in HYBRID.items()}
    runs["replicas"] = ("llama", ctxpar.get_layout("zigzag", 2), replicas["ring", "ulysses"],
                        prompt(seed=10 + replica, length=16), 4 + 2 * replica, {})
    out = {}
    for name, (family, layout, on, tokens, new, kwargs) in runs.items():
        model = hf_families.build(family)
        run = dict(max_new_tokens=new, min_new_tokens=new, **kwargs)
        torch.manual_seed(SEED)
        want = model.generate(tokens, **run)  # without CP; then the same model under CP
        try:
            enable_context_parallel(model, layout=layout, strategy="hybrid", mesh=on)
            torch.manual_seed(SEED)
            out[name] = torch.equal(model.generate(tokens, **run), want)
        except Exception as e:  # noqa: BLE001  reported by the test
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _refusals(rank: int, world: int) -> dict:
    import hf_families
    from transformers import DynamicCache

    layout = ctxpar.get_layout("zigzag", world)
    model = enable_context_parallel(hf_families.build("llama"), layout=layout)
    tokens = prompt()
    padded = torch.ones_like(tokens)
    padded[0, :3] = 0  # a left-padded row
    other = tokens.clone()
    other[0, 0] += rank == 1  # rank 1's prompt differs in one token
    outside = tokens.clone()
    outside[1, 0] = hf_families.VOCAB + 5  # position 0: in rank 0's shard only
    run = dict(max_new_tokens=4)
    out = {
        "beam search": _attempt(lambda: model.generate(tokens, num_beams=2, **run)),
        "assisted": _attempt(lambda: model.generate(tokens, assistant_model=hf_families.build("llama"), **run)),
        "cache passed in": _attempt(lambda: model.generate(tokens, past_key_values=DynamicCache(), **run)),
        "static cache": _attempt(lambda: model.generate(tokens, cache_implementation="static", **run)),
        "no cache": _attempt(lambda: model.generate(tokens, use_cache=False, **run)),
        "chunked prefill": _attempt(lambda: model.generate(tokens, prefill_chunk_size=8, **run)),
        "padding": _attempt(lambda: model.generate(tokens, attention_mask=padded, **run)),
        # transformers made position ids of these, refused then as position ids the caller never passed
        "mask of halves": _attempt(lambda: model.generate(tokens, attention_mask=torch.full(tokens.shape, 0.5), **run)),
        "mask of another length": _attempt(lambda: model.generate(tokens, attention_mask=torch.ones(BATCH, 30),
                                                                  **run)),
        "float prompt": _attempt(lambda: model.generate(tokens.double(), **run)),
        "inputs_embeds": _attempt(lambda: model.generate(inputs_embeds=model.get_input_embeddings()(tokens), **run)),
        "output_attentions": _attempt(lambda: model.generate(tokens, output_attentions=True,
                                                             return_dict_in_generate=True, **run)),
        "longrope head": _attempt(lambda: enable_context_parallel(  # long factors from position 8: the head's 0-7
            hf_families.build("phi3+longrope"), layout=layout).generate(tokens[:, :12], **run)),
        # Phi-3's generate runs the whole sequence again with the long factors once it passes 8 tokens
        "longrope switch": _attempt(lambda: enable_context_parallel(
            hf_families.build("phi3+longrope"), layout=layout).generate(tokens[:, :8], **run)),
        # 12 tokens: zigzag on 4 ranks prefills 8, then 4 one at a time, which the first 8 would never see
        "bidirectional, prompt fed in parts": _attempt(lambda: enable_context_parallel(
            hf_families.build("electra"), layout=layout).generate(tokens[:, :12], **run)),
        "empty batch": _attempt(lambda: model.generate(tokens[:0], **run)),
        "guidance_scale": _attempt(lambda: model.generate(tokens, guidance_scale=1.5, **run)),
        "synced_gpus": _attempt(lambda: model.generate(tokens, synced_gpus=True, **run)),
        "beam search on rank 1 only": _attempt(lambda: model.generate(tokens, num_beams=1 + (rank == 1), **run)),
        "prompts differ": _attempt(lambda: model.generate(other, **run)),
        "seeds differ": _attempt(lambda: (torch.manual_seed(rank), model.generate(tokens, do_sample=True, **run))),
        # one seed, one draw more on rank 1: the RNG's state differs, not its seed
        "one draw more": _attempt(lambda: (torch.manual_seed(5), rank == 1 and torch.rand(1),
                                           model.generate(tokens, do_sample=True, **run))),
        "longrope prefill": _attempt(lambda: enable_context_parallel(  # rank 0 holds positions 0-5 of 24, limit 8
            hf_families.build("phi3+longrope"), layout=ctxpar.get_layout("contiguous", world)).generate(tokens, **run)),
        "sdpa after enable": _attempt(lambda: _switched(layout).generate(tokens, **run)),
        "token outside the vocabulary": _attempt(lambda: model.generate(outside, **run)),
        "token outside the vocabulary, forward": _attempt(lambda: model(
            input_ids=layout.shard(outside, rank, dim=1), position_ids=layout.positions(PROMPT_LEN, rank)[None])),
        "dynamic cache in forward": _attempt(lambda: model(input_ids=layout.shard(tokens, rank, dim=1),
                                                           position_ids=layout.positions(PROMPT_LEN, rank)[None],
                                                           past_key_values=DynamicCache())),
        # a forward of one's own over the sharded cache, checked as any forward under CP: an all-True 4-D mask
        # on rank 1 only (dropped: the causal logits, silently), a token outside the vocabulary (an IndexError
        # on the rank holding it), logits_to_keep past the one row it returns
        "4-D mask over the sharded cache on rank 1": _attempt(lambda: _over_cache(
            model, input_ids=tokens,
            attention_mask=torch.ones(BATCH, 1, PROMPT_LEN, PROMPT_LEN, dtype=torch.bool) if rank == 1 else None)),
        "token outside the vocabulary over the sharded cache": _attempt(lambda: _over_cache(model, input_ids=outside)),
        "logits_to_keep over the sharded cache": _attempt(lambda: _over_cache(model, input_ids=tokens,
                                                                              logits_to_keep=3)),
        # the prefill routes each rank's share of the prompt: its router logits and aux_loss were that share's
        "router logits over the sharded cache": _attempt(lambda: _over_cache(model, input_ids=tokens,
                                                                             output_router_logits=True)),
        # a decode step's all-gather has no gradient: attention's share of the backward was silently missing
        "grad mode over the sharded cache on rank 1": _attempt(lambda: _over_cache(model, grad=rank == 1,
                                                                                   input_ids=tokens)),
        "max_new_tokens past the count": _attempt(lambda: model.generate(tokens, max_new_tokens=2**31)),
        "cache unallocated on rank 1": _unallocated_on_rank_1(model, tokens, rank),
        **_another_config_on_rank_1(layout, tokens, rank),
    }
    out.update(_stops_and_last_tokens(model, tokens, rank))
    # zigzag on 4 ranks splits multiples of 8: a head of 8 or 16, then one token at a time; a
    # shorter prompt, one token at a time from the start (ranks holding no position yet: multi-head
    # latent attention once failed on their empty K/V); a batch of one row (whose last column,
    # input_ids[:, -1], once failed the per-step checksum)
    # A 1-token prompt fed alone is fed whole, bidirectional layers too (it was refused as a prompt fed
    # in parts); Llama with LongRoPE keeps its cache past original_max_position_embeddings, as CP does
    # (refused as Phi-3 is, whose generate runs the sequence again there)
    longrope = dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 4,
                                         long_factor=[4.0] * 4, original_max_position_embeddings=8))
    for name, family, changes, part in (
            ("9-token prompt", "llama", {}, tokens[:, :9]), ("22-token prompt", "llama", {}, tokens[:, :22]),
            ("7-token prompt", "llama", {}, tokens[:, :7]), ("1-token prompt", "llama", {}, tokens[:, :1]),
            ("5-token prompt, MLA", "deepseek_v3", {}, tokens[:, :5]),
            ("3-token prompt, sinks", "gpt_oss", {}, tokens[:, :3]),
            ("batch of 1", "llama", {}, tokens[:1]),
            ("1-token prompt, bidirectional", "electra", {}, tokens[:, :1]),
            ("LongRoPE past its switch, cache kept", "llama", longrope, tokens[:, :8])):
        try:
            want = hf_families.build(family, **changes).generate(part, **run)
            enabled = model if (family, changes) == ("llama", {}) else enable_context_parallel(
                hf_families.build(family, **changes), layout=layout)
            out[name] = torch.equal(enabled.generate(part, **run), want)
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    want = hf_families.build("llama").generate(tokens, **run)
    try:
        out["after"] = torch.equal(model.generate(tokens, **run), want)
    except Exception as e:  # noqa: BLE001
        out["after"] = f"{type(e).__name__}: {e}"
    return out


def _over_cache(model, grad: bool = False, **kwargs):
    """A forward of one's own over a new sharded cache, inference only (as generate's) unless ``grad``."""
    with torch.set_grad_enabled(grad):
        return model(cache=_sharded(model), **kwargs)


def _another_config_on_rank_1(layout, tokens: torch.Tensor, rank: int) -> dict:
    """A model loaded with another norm epsilon on rank 1 (generate, and a forward over the
    sharded cache), or with other weights (generate): tokens and logits without a word."""
    import hf_families

    other = enable_context_parallel(hf_families.build("llama", **(dict(rms_norm_eps=1e-2) if rank == 1 else {})),
                                    layout=layout)
    drawn = hf_families.build("llama")
    with torch.no_grad():
        next(drawn.parameters()).view(-1)[0] += rank == 1  # weights drawn apart, as another seed would
    drawn = enable_context_parallel(drawn, layout=layout)
    return {"another config on rank 1": _attempt(lambda: other.generate(tokens, max_new_tokens=4)),
            "another config on rank 1 over the sharded cache": _attempt(lambda: _over_cache(other, input_ids=tokens)),
            "other weights on rank 1": _attempt(lambda: drawn.generate(tokens, max_new_tokens=4))}


def _sharded(model) -> ShardedCache:
    return ShardedCache(layers=model.config.num_hidden_layers, batch=BATCH, capacity=PROMPT_LEN)


def _unallocated_on_rank_1(model, tokens: torch.Tensor, rank: int) -> str:
    """generate where rank 1 cannot allocate its share of the sharded cache (its KVCache raising
    as KVCache does when out of memory); it raised alone inside the prefill, its peers waiting in
    attention."""
    real = generation.KVCache

    class OutOfMemory(real):
        def __init__(self, **kwargs) -> None:
            raise ValueError("rank 1's KVCache shard could not be allocated (out of memory, simulated)")

    generation.KVCache = OutOfMemory if rank == 1 else real
    try:
        return _attempt(lambda: model.generate(tokens, max_new_tokens=4))
    finally:
        generation.KVCache = real


def _stops_and_last_tokens(model, tokens: torch.Tensor, rank: int) -> dict:
    """Stops that differ between ranks (a clock's, a criterion of rank 1 alone), a last token
    that does (a logits processor biased per rank, one new token), max_new_tokens that do,
    a streamer on rank 0 alone: ("ran", the generated sequences) or ("refused", the message)."""
    from transformers import (LogitsProcessor, LogitsProcessorList, MaxTimeCriteria, StoppingCriteria,
                              StoppingCriteriaList, TemperatureLogitsWarper,
                              UnbatchedClassifierFreeGuidanceLogitsProcessor)
    from transformers.generation.streamers import BaseStreamer

    class StopOnRank1(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), rank == 1, dtype=torch.bool)

    class StopRow0(StoppingCriteria):
        def __init__(self, here: bool) -> None:
            self.here = here

        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([self.here] + [False] * (input_ids.shape[0] - 1))

    class FailOnRank1(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if rank == 1:
                raise RuntimeError("a criterion of rank 1 failed")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    class FailOnRank1AtStep2(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if rank == 1 and input_ids.shape[1] == PROMPT_LEN + 1:
                raise RuntimeError("a processor of rank 1 failed")
            return scores

    class FavourOwnToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 5 + rank] += 1e4
            return scores

    class ReseedPerRank(LogitsProcessor):
        """The same scores everywhere, then each rank's own draw of the token."""

        def __call__(self, input_ids, scores):
            torch.manual_seed(rank)
            return scores

    class ReseedPerRankButTheLastRow(LogitsProcessor):
        """Each rank's own draw for row 0; the last row's token forced alike on every rank."""

        def __call__(self, input_ids, scores):
            torch.manual_seed(rank)
            scores[-1] = float("-inf")
            scores[-1, 7] = 0.0
            return scores

    def sequences_reseeded(**kwargs):
        """``sequences`` with every rank's RNG alike again (a case before left each its own)."""
        torch.manual_seed(SEED)
        return sequences(**kwargs)

    def sequences(**kwargs):
        try:
            return "ran", model.generate(tokens, **{"max_new_tokens": 4, **kwargs}).tolist()
        except Exception as e:  # noqa: BLE001  the message is what the test checks
            return "refused", f"{type(e).__name__}: {e}"

    class Watching(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    class ClosedPipe(BaseStreamer):
        """Fails at its put number ``at`` (1: the prompt's, before the prefill; 5: the last token's)."""

        def __init__(self, at: int) -> None:
            self.puts, self.at = 0, at

        def put(self, value):
            self.puts += 1
            if self.puts == self.at:
                raise BrokenPipeError("printing to a closed pipe")

        def end(self):
            pass

    import hf_families

    reference = hf_families.build("llama")  # the same model without CP
    plain = reference.generate(tokens, max_new_tokens=4)
    row_eos = dict(eos_token_id=int(plain[0, PROMPT_LEN + 1]), pad_token_id=0)  # row 0's second new token
    spelled = _characters()
    stop = dict(stop_strings=[spelled.decode([int(plain[0, PROMPT_LEN + 1])])], tokenizer=spelled)

    def differing(changes: dict):
        """generate with ``model.generation_config`` changed on rank 1 alone (restored after)."""
        saved = {key: getattr(model.generation_config, key) for key in changes}
        if rank == 1:
            for key, value in changes.items():
                setattr(model.generation_config, key, value)
        try:
            return sequences()
        finally:
            for key, value in saved.items():
                setattr(model.generation_config, key, value)

    def hooked_on_rank_1(**kwargs):
        """``sequences`` with rank 1's lm_head adding 1e-3 to its decode steps' logits."""
        handle = model.lm_head.register_forward_hook(
            lambda module, inputs, logits: logits + 1e-3 if rank == 1 and inputs[0].shape[1] == 1 else logits)
        try:
            return sequences(**kwargs)
        finally:
            handle.remove()

    torch.manual_seed(0)  # sampled calls below: the RNG alike on every rank
    return {"max_time": sequences(max_time=1e-9),  # once refused: each rank stopped by its own clock
            # raised on rank 1 alone, its peers waited in the step's all-reduce until the timeout
            "a processor failing on rank 1": sequences(logits_processor=LogitsProcessorList([FailOnRank1AtStep2()])),
            # one class with other parameters: accepted, each rank returning its own scores (compared by type)
            "a processor's parameter differing": sequences(
                logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5 if rank == 0 else 2.0)])),
            # transformers passes the tokenizer on to the forward: refused by attention as an argument it ignores
            "stop strings": (sequences(**stop), reference.generate(tokens, max_new_tokens=4, **stop).tolist()),
            # refused as guidance_scale is; it failed inside its own forward of the last token, another message
            "a guidance processor": sequences(logits_processor=LogitsProcessorList(
                [UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, model)])),
            "max_new_tokens 3.5": (sequences(max_new_tokens=3.5),
                                   reference.generate(tokens, max_new_tokens=3.5).tolist()),
            # a criterion's state may differ (a clock's start): AgreedStop agrees on its stops
            "a clock of one's own": (sequences(stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(1e6)])),
                                     plain.tolist()),
            # served without CP; refused naming ShardedCache's capacity, an argument never given
            "max_new_tokens 3.0": (sequences(max_new_tokens=3.0), plain[:, :PROMPT_LEN + 3].tolist()),
            # its private hash of a string differs per process: compared, it refused a copy of the model's config
            "the model's generation config passed in": (
                sequences(generation_config=copy.deepcopy(model.generation_config)), plain.tolist()),
            # blamed on the logits processors (none in the first), the first scores compared
            "logits differing": hooked_on_rank_1(),
            "logits differing, a processor": hooked_on_rank_1(
                logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)])),
            "temperature differing": sequences(do_sample=True, temperature=0.5 + 0.25 * rank),
            "top_p differing": sequences(do_sample=True, top_p=0.5 + 0.125 * rank),
            "model.generation_config differing": differing(dict(repetition_penalty=1.3)),
            # each row stops on its own: ("ran", the CP sequences), the sequences without CP
            "a row's eos": (sequences(**row_eos), reference.generate(tokens, max_new_tokens=4, **row_eos).tolist()),
            "a stop of row 0 on rank 1": (
                sequences(stopping_criteria=StoppingCriteriaList([StopRow0(rank == 1)])),
                reference.generate(tokens, max_new_tokens=4,
                                   stopping_criteria=StoppingCriteriaList([StopRow0(True)])).tolist()),
            "max_new_tokens differ": sequences(max_new_tokens=4 + rank),
            "a stop failing on rank 1": sequences(stopping_criteria=StoppingCriteriaList([FailOnRank1()])),
            "a streamer on rank 0": sequences(streamer=Watching() if rank == 0 else None),
            # raised on rank 0 alone between steps: its peers waited in the next step's collective
            **{f"a streamer on rank 0 failing at put {at}": sequences(streamer=ClosedPipe(at) if rank == 0 else None)
               for at in (1, 3, 5)},
            "a stop of rank 1": sequences(stopping_criteria=StoppingCriteriaList([StopOnRank1()])),
            # an empty list is None's: it was refused
            "no stops listed on rank 0": sequences(stopping_criteria=StoppingCriteriaList() if rank == 0 else None),
            # named, not "arguments (crc32) [...]"
            "a logits processor on rank 0": sequences(
                logits_processor=LogitsProcessorList([FavourOwnToken()]) if rank == 0 else None),
            # the same scores, then another token drawn on each rank
            "last token differs": sequences(max_new_tokens=1, do_sample=True, temperature=100.0,
                                            logits_processor=LogitsProcessorList([ReseedPerRank()])),
            # every row is compared, not the last alone
            "row 0's last token differs": sequences_reseeded(
                max_new_tokens=1, do_sample=True, temperature=100.0,
                logits_processor=LogitsProcessorList([ReseedPerRankButTheLastRow()]))}


def _characters():
    """A tokenizer of one character per token id, made here (no hub): what stop_strings needs."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import hf_families

    characters = (string.ascii_letters + string.digits + string.punctuation + " ")[:hf_families.VOCAB]
    made = Tokenizer(models.WordLevel({c: i for i, c in enumerate(characters)}, unk_token=characters[0]))
    made.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    made.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=made, unk_token=characters[0], eos_token=characters[2],
                                   pad_token=characters[1])


def run(rank: int, world: int) -> dict:
    """Every part on every rank; a part that raises is reported (as a string), so that it
    fails its own tests and not the other HF tests sharing this spawn."""
    out = {}
    for name, part in (("tokens", _tokens), ("families", _families), ("cache", _cache), ("refusals", _refusals),
                       ("hybrid", _hybrid)):
        try:
            out[name] = part(rank, world)
        except Exception:  # noqa: BLE001
            out[name] = f"rank {rank} raised\n{traceback.format_exc()}"
    return out
