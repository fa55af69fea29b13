"""Everything the inference tests run inside one spawned process group per world size.

``run_all`` runs every case on every rank and reports numbers and messages, which
``test_inference.py`` asserts on: the logits of prefill and of every decode step against
the single-process model, greedy and sampled tokens against ``reference_generate``, what
each rank's cache holds, and the errors for bad input.
"""

from __future__ import annotations

import sys
import traceback
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ctxpar.inference import (KVCache, decode_step, generate, partial_prefill, prefill, reference_generate,
                              sharded_attention)
from ctxpar import profile, topology
from hostile_cases import BlockedLayout
from ctxpar.topology import hybrid_group_rank as group_rank
from ctxpar.layout import Layout, get_layout
from ctxpar.plan import get_hardware, traffic
from ctxpar.models import ModelConfig, Transformer

LAYOUTS = ("contiguous", "zigzag", "striped")
STRATEGIES = ("ring", "allgather", "alltoall")
WITH_AUTO = (*STRATEGIES, "auto")  # auto: ctxpar.attention asks the planner at each prefill layer
# 12 query heads split over 1-4 ranks for all-to-all; 4 KV heads (GQA), 1 (MQA)
CONFIGS = {
    "gqa": ModelConfig(layers=2, hidden=32, heads=12, kv_heads=4, head_dim=8, ffn=64, vocab=128),
    "mqa": ModelConfig(layers=2, hidden=32, heads=12, kv_heads=1, head_dim=8, ffn=64, vocab=128),
}
BATCH = 2
PROMPT_LEN = 24  # a multiple of 2P for P = 1..4
FORCED_STEPS = 6  # decode steps fed fixed tokens, logits compared at each
GREEDY_TOKENS = 33
SAMPLED_TOKENS = 16
TEMPERATURE, SEED = 0.8, 5


def build(config: str = "gqa") -> Transformer:
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    return Transformer(CONFIGS[config]).eval()


def hybrid_mesh(world: int):
    """ulysses x ring = 2 x (P/2) where P is even, 1 x P otherwise. Ulysses-major, so at P=4
    a rank's place in the layout (ring-major) is not its rank: prefill must map them."""
    from ctxpar.launch import init_mesh

    u = 2 if world % 2 == 0 else 1
    return init_mesh("cpu", (u, world // u), ("ulysses", "ring"))


def prompt_tokens(seq_len: int = PROMPT_LEN, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, seq_len), generator=torch.Generator().manual_seed(seed))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def digest(t: torch.Tensor) -> int:
    """Bitwise identity of a tensor across ranks."""
    return zlib.crc32(t.detach().contiguous().cpu().numpy().tobytes())


def run_all(rank: int, world: int) -> dict:
    """Every inference check for one world size; failures are reported, not raised."""
    results: dict = {}
    for name, check in (("first_call_imports", _first_call_imports), ("logits", _check_logits),
                        ("greedy", _check_greedy), ("sampled", _check_sampled),
                        ("any_length", _check_any_length),
                        ("empty_shard", _check_empty_shard), ("partial", _check_partial),
                        ("autocast", _check_autocast),
                        ("bad_inputs", _check_bad_inputs)):
        try:
            results[name] = check(rank, world)
        except Exception:  # noqa: BLE001  one check must not hide the others
            results[name] = f"rank {rank} of P={world} raised\n{traceback.format_exc()}"
    return results


def _first_call_imports(rank: int, world: int) -> dict:
    """Run first in a fresh process: which of torch's heavy modules a generate call loaded
    (the weights check imported torch.distributed.fsdp and DTensor's package, ~0.5 s that
    the first call's ttft_s counted: 1.2 s where later calls took 15 ms)."""
    heavy = ("torch.distributed.tensor", "torch.distributed.fsdp")
    before = [name for name in heavy if name in sys.modules]
    generate(build(), prompt_tokens(), layout="zigzag", new_tokens=2)
    return dict(before=before, loaded=[name for name in heavy if name in sys.modules and name not in before])


@dataclass(frozen=True)
class RotatedLayout(Layout):
    """A layout of the user's: contiguous blocks, place r holding block (r + 2) mod P, so at
    P=4 position T-1 sits at place 1, group rank 2 of hybrid's 2 x 2 mesh; the built-in
    layouts keep it at place 0 or P-1, whose ranks the places share."""

    name = "rotated"

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        n, block = seq_len // self.world_size, (rank + 2) % self.world_size
        return torch.arange(block * n, (block + 1) * n)


def _check_logits(rank: int, world: int) -> dict:
    """Prefill and FORCED_STEPS decode steps fed fixed tokens, for every layout x strategy
    and auto (GQA) and the ring under MQA: (max relative error vs the single-process model,
    digest)."""
    out = {}
    cases = [(c, lay, s) for c in ("gqa",) for lay in LAYOUTS for s in WITH_AUTO]
    cases += [("mqa", lay, "ring") for lay in LAYOUTS]
    mesh = None
    if world > 1:  # hybrid: all-to-all over 2 ranks where P is even, ring over the rest
        cases += [("gqa", lay, "hybrid") for lay in LAYOUTS]
        cases += [("gqa", RotatedLayout(world), "hybrid")] if world == 4 else []  # a place that is not its rank
        mesh = hybrid_mesh(world)
    # a layout of the user's holding T-1 on a rank the built-in layouts never put it on (P=3: rank 0, P=4: rank 1):
    # its last logits broadcast from the rank of the built-in rule were 1.3 off, unseen
    cases += [("gqa", RotatedLayout(world), "ring")] if world > 2 else []
    for config, layout, strategy in cases:
        model, vocab = build(config), CONFIGS[config].vocab
        prompt = prompt_tokens(vocab=vocab)
        forced = prompt_tokens(FORCED_STEPS, vocab, seed=2)  # (B, steps)
        with torch.no_grad():
            full = torch.cat([prompt, forced], dim=1)
            want = [model(full[:, : PROMPT_LEN + i])[:, -1] for i in range(FORCED_STEPS + 1)]
        cache = KVCache.for_model(model.cfg, batch=BATCH, capacity=PROMPT_LEN + FORCED_STEPS)
        got = [prefill(model, cache, prompt, layout=layout, strategy=strategy,
                       mesh=mesh if strategy == "hybrid" else None)]
        got += [decode_step(model, cache, forced[:, i]) for i in range(FORCED_STEPS)]
        out[f"{config}-{getattr(layout, 'name', layout)}-{strategy}"] = ([rel_error(g, w) for g, w in zip(got, want)],
                                                                          digest(torch.stack(got)))
    if mesh is not None:  # every place's rank, not only the places that hold T-1 in the cases above
        out["place_to_rank"] = group_rank(mesh, topology.hybrid_rank(mesh), None) == rank
    return out


def _check_greedy(rank: int, world: int) -> dict:
    """GREEDY_TOKENS greedy tokens per layout x strategy and auto: the tokens, the
    reference's, this rank's cache (positions held, bytes), and the strategies auto chose
    (``ctxpar.record``) during the whole generation."""
    model = build()
    prompt = prompt_tokens()
    out = {"reference": reference_generate(model, prompt, new_tokens=GREEDY_TOKENS).tolist()}
    for layout in LAYOUTS:
        for strategy in WITH_AUTO:
            with profile.record(timing=False) as rec:
                r = generate(model, prompt, layout=layout, strategy=strategy, new_tokens=GREEDY_TOKENS)
            out[f"{layout}-{strategy}"] = dict(
                tokens=r.tokens.tolist(), positions=r.cache.positions().tolist(), kv_cache_bytes=r.kv_cache_bytes,
                held_bytes=r.cache.held_bytes, bytes_per_position=r.cache.bytes_per_position,
                ttft_s=r.ttft_s, tpot_s=r.tpot_s, chosen=[chosen for chosen, _ in rec.strategy_choices],
                prompt_positions=get_layout(layout, world).positions(PROMPT_LEN, rank).tolist())
    return out


def _check_sampled(rank: int, world: int) -> dict:
    model = build()
    prompt = prompt_tokens()
    r = generate(model, prompt, layout="zigzag", new_tokens=SAMPLED_TOKENS, temperature=TEMPERATURE, seed=SEED)
    ref = reference_generate(model, prompt, new_tokens=SAMPLED_TOKENS, temperature=TEMPERATURE, seed=SEED)
    return {"tokens": r.tokens.tolist(), "reference": ref.tolist()}


def _check_any_length(rank: int, world: int) -> dict:
    """generate from prompts the zigzag layout does not split (its head prefilled, the rest a
    partial prefill) and shorter than one multiple (all of it a partial prefill), and from one
    a layout of the user's (blocks of 2 dealt round-robin: multiples of 2P) does not split,
    sampled: {(layout, length): the tokens equal the single-process ones}, and each prompt's
    tail: (tokens, the pass partial_prefill ran them by)."""
    model = build()
    out: dict = {"prompt_len": [], "tails": []}
    for layout, length in (("zigzag", 2 * world * 3 + 1), ("zigzag", 2 * world - 1),
                           (BlockedLayout(world, block=2), 2 * world * 3 + 1)):
        prompt = prompt_tokens(length, seed=length)
        r = generate(model, prompt, layout=layout, new_tokens=SAMPLED_TOKENS, temperature=TEMPERATURE, seed=SEED)
        ref = reference_generate(model, prompt, new_tokens=SAMPLED_TOKENS, temperature=TEMPERATURE, seed=SEED)
        out[(getattr(layout, "name", layout), length)] = r.tokens.tolist() == ref.tolist()
        out["prompt_len"].append(r.cache.prompt_len)
        out["tails"].append(r.tail and (r.tail.tokens, r.tail.method))
    return out


def _check_empty_shard(rank: int, world: int) -> dict:
    """``sharded_attention`` with keys dealt unevenly, rank 0 holding none: relative error
    against attention over all keys at once, without and with sink logits (one more
    softmax term per head, with no value, as gpt-oss's), and how much the sinks change it;
    for even P, also over a hybrid mesh of the P ranks (``mesh_err``, with sinks)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 1, 8, generator=gen)
    k, v = torch.randn(2, 2, 10, 8, generator=gen), torch.randn(2, 2, 10, 8, generator=gen)
    sinks = torch.randn(6, generator=gen) + 1.0
    counts = [0] + [10 // (world - 1) + (r < 10 % (world - 1)) for r in range(world - 1)] if world > 1 else [10]
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    got = sharded_attention(q, k[:, :, mine], v[:, :, mine], group=None, scale=8**-0.5)
    with_sinks = sharded_attention(q, k[:, :, mine], v[:, :, mine], group=None, scale=8**-0.5, sinks=sinks)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    scores = q.double() @ k.double().repeat_interleave(3, dim=1).transpose(-1, -2) * 8**-0.5  # (B, H, 1, 10)
    columns = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(2, -1, 1, 1)], dim=-1)
    want_sinks = columns.softmax(-1)[..., :-1] @ v.double().repeat_interleave(3, dim=1)
    out = dict(err=rel_error(got, want), sinks_err=rel_error(with_sinks, want_sinks),
               sinks_effect=rel_error(want, want_sinks))
    if world % 2 == 0:  # over a (ring P/2) x (ulysses 2) mesh, whose layout ranks are the global ones
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ring", "ulysses"))
        on_mesh = sharded_attention(q, k[:, :, mine], v[:, :, mine], group=None, mesh=mesh, scale=8**-0.5,
                                    sinks=sinks)
        out["mesh_err"] = rel_error(on_mesh, want_sinks)
    return out


# a conversation after the prompt: (kind, tokens) turns; chunks of 1 token, of fewer tokens
# than ranks (some ranks get none), and of more; decode steps between them
TURNS = (("decode", 1), ("chunk", 1), ("chunk", 3), ("decode", 1), ("chunk", 13), ("decode", 1), ("chunk", 8))
TURN_TOKENS = sum(n for _, n in TURNS)


def _check_partial(rank: int, world: int) -> dict:
    """For every layout x method (GQA) and pass-Q under MQA, and from an empty cache: after
    the prompt, TURNS; relative error of every turn's logits against the single-process
    model over the whole sequence so far, their digest, and the positions this rank holds."""
    out = {}
    cases = [("gqa", lay, m) for lay in LAYOUTS for m in ("pass-kv", "pass-q", "auto")]
    cases += [("mqa", "zigzag", "pass-q"), ("gqa", None, "pass-q"), ("gqa", None, "pass-kv")]
    for config, layout, method in cases:
        model, vocab = build(config), CONFIGS[config].vocab
        prompt, turns = prompt_tokens(vocab=vocab), prompt_tokens(TURN_TOKENS, vocab, seed=4)
        full = torch.cat([prompt, turns], dim=1)
        cache = KVCache.for_model(model.cfg, batch=BATCH, capacity=PROMPT_LEN + TURN_TOKENS)
        if layout is None:  # no prefill: the prompt itself as the first chunk
            got, ends = [partial_prefill(model, cache, prompt, method=method)], [PROMPT_LEN]
        else:
            got, ends = [prefill(model, cache, prompt, layout=layout)], [PROMPT_LEN]
        fed = 0
        for kind, n in TURNS:
            piece = turns[:, fed: fed + n]
            got.append(decode_step(model, cache, piece[:, 0]) if kind == "decode"
                       else partial_prefill(model, cache, piece, method=method))
            fed += n
            ends.append(PROMPT_LEN + fed)
        with torch.no_grad():
            want = [model(full[:, :end])[:, -1] for end in ends]
        out[f"{config}-{layout or 'empty'}-{method}"] = dict(
            errors=[rel_error(g, w) for g, w in zip(got, want)], digest=digest(torch.stack(got)),
            logits=torch.stack(got).tolist(), positions=cache.positions().tolist(),
            prompt_positions=get_layout(layout, world).positions(PROMPT_LEN, rank).tolist() if layout else None)
    out["bytes"] = _partial_bytes(rank, world)
    return out


def _check_autocast(rank: int, world: int) -> dict:
    """A float32 model under autocast(bfloat16), as a user serving in bf16 runs it: prefill,
    then TURNS (decode steps and partial prefills): per call the logits' dtype, relative
    error against the same model's forward under autocast, and a digest (every rank must
    hold the same logits: the prefill's are broadcast by the rank holding the last position,
    in the dtype the output layer gives under autocast)."""
    model = build()
    prompt, turns = prompt_tokens(), prompt_tokens(TURN_TOKENS, seed=4)
    full = torch.cat([prompt, turns], dim=1)
    cache = KVCache.for_model(model.cfg, batch=BATCH, capacity=PROMPT_LEN + TURN_TOKENS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, ends, fed = [prefill(model, cache, prompt, layout="zigzag")], [PROMPT_LEN], 0
        for kind, n in TURNS:
            piece = turns[:, fed: fed + n]
            got.append(decode_step(model, cache, piece[:, 0]) if kind == "decode"
                       else partial_prefill(model, cache, piece, method="pass-q"))
            fed += n
            ends.append(PROMPT_LEN + fed)
        with torch.no_grad():
            want = [model(full[:, :end])[:, -1] for end in ends]
    return dict(dtypes=sorted({str(g.dtype) for g in got}), errors=[rel_error(g, w) for g, w in zip(got, want)],
                digest=digest(torch.stack(got).float()))


def _partial_bytes(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """(bytes this rank sent in one chunk of 11 tokens, what ``plan.traffic.partial_prefill``
    says per layer x layers + the positions' all-gather + the logits' broadcast)."""
    model, cfg = build(), CONFIGS["gqa"]
    prompt, chunk = prompt_tokens(), prompt_tokens(11, seed=6)
    out = {}
    for method in ("pass-kv", "pass-q"):
        cache = KVCache.for_model(cfg, batch=BATCH, capacity=PROMPT_LEN + 11)
        prefill(model, cache, prompt, layout="zigzag")
        with profile.record() as rec:
            partial_prefill(model, cache, chunk, method=method, check_consistency=False)
        per_layer = traffic.partial_prefill(method, batch=BATCH, cached=PROMPT_LEN, new=11, heads=cfg.heads,
                                            kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, world=world, elem=4, acc=4)
        positions = (world - 1) * cache.local_capacity * 8
        logits = BATCH * cfg.vocab * 4 if world > 1 and rank == (PROMPT_LEN + 10) % world else 0
        out[method] = (rec.bytes_sent, cfg.layers * per_layer + positions + logits)
    return out


def _attempt(fn) -> str:
    try:
        fn()
        return "NO ERROR"
    except ValueError as e:
        return str(e)


def _interrupted_chunk(model, cache: KVCache, fresh: KVCache, prompt: torch.Tensor) -> str:
    """Ctrl-C on every rank in a pass-KV chunk's first compute step, with the K/V hop posted;
    the same chunk again must give the logits of an uninterrupted one (it once hung: the
    dropped transfer was paired with the retry's)."""
    import ctxpar.inference.partial as partial_module

    real = partial_module.forward_tiles

    def once(*args, **kwargs):
        partial_module.forward_tiles = real
        raise KeyboardInterrupt

    partial_module.forward_tiles = once
    try:
        partial_prefill(model, cache, prompt[:, 3:5], method="pass-kv")
        return "not interrupted"
    except KeyboardInterrupt:
        pass  # retried below, once the interrupted call's frames (and its transfers) are gone
    finally:
        partial_module.forward_tiles = real
    got = partial_prefill(model, cache, prompt[:, 3:5], method="pass-kv")
    want = partial_prefill(model, fresh, prompt[:, 3:5], method="pass-kv")
    return "ok: the retry gives the uninterrupted logits" if torch.equal(got, want) else "the retry differs"


def _check_bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Each bad call's message on this rank; then a good generation must still work."""
    model, cfg = build(), CONFIGS["gqa"]
    prompt = prompt_tokens()

    def cache(**changes) -> KVCache:
        shape = dict(layers=cfg.layers, batch=BATCH, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                     capacity=PROMPT_LEN + 4)
        return KVCache(**{**shape, **changes})

    def prefilled(c: KVCache) -> KVCache:
        prefill(model, c, prompt, layout="zigzag")
        return c

    messages = {
        "capacity": _attempt(lambda: prefill(model, cache(capacity=PROMPT_LEN - 2), prompt, layout="zigzag")),
        # one position short: a check relaxed by P - 1 (the slots of P shards of ceil(capacity / P)) once took it at P=2
        "capacity_one_short": _attempt(lambda: prefill(model, cache(capacity=PROMPT_LEN - 1), prompt, layout="zigzag")),
        "batch": _attempt(lambda: prefill(model, cache(batch=3), prompt, layout="zigzag")),
        "heads": _attempt(lambda: prefill(model, cache(kv_heads=2), prompt, layout="zigzag")),
        "strategy": _attempt(lambda: prefill(model, cache(), prompt, layout="zigzag", strategy="ulysses")),
        "consistency_type": _attempt(lambda: prefill(model, cache(), prompt, layout="zigzag", check_consistency="")),
        "hybrid_no_mesh": _attempt(lambda: prefill(model, cache(), prompt, layout="zigzag", strategy="hybrid")),
        "mesh_not_hybrid": _attempt(lambda: prefill(model, cache(), prompt, layout="zigzag", mesh=object())),
        "mesh_with_auto": _attempt(lambda: prefill(model, cache(), prompt, layout="zigzag", strategy="auto",
                                                   mesh=object())),
        "mesh_not_a_mesh": _attempt(lambda: prefill(model, cache(), prompt, layout="zigzag", strategy="hybrid",
                                                    mesh=object())),
        "before_prefill": _attempt(lambda: decode_step(model, cache(), prompt[:, 0])),
        "prefill_twice": _attempt(lambda: prefill(model, prefilled(cache()), prompt, layout="zigzag")),
        "decode_batch": _attempt(lambda: decode_step(model, prefilled(cache()), prompt[:1, 0])),
        "new_tokens": _attempt(lambda: generate(model, prompt, layout="zigzag", new_tokens=0)),
        # a prompt shorter than zigzag's 2P has no head to prefill, whose checks once were the only ones
        "short_prompt_strategy": _attempt(lambda: generate(model, prompt[:, :1], layout="zigzag", new_tokens=2,
                                                           strategy="ulysses")),
        "short_prompt_hybrid": _attempt(lambda: generate(model, prompt[:, :1], layout="zigzag", new_tokens=2,
                                                         strategy="hybrid")),
        "temperature": _attempt(lambda: generate(model, prompt, layout="zigzag", new_tokens=2, temperature=-1.0)),
        "chunk_capacity": _attempt(lambda: partial_prefill(model, prefilled(cache()), prompt[:, :5])),
        "chunk_batch": _attempt(lambda: partial_prefill(model, prefilled(cache()), prompt[:1, :2])),
        "chunk_method": _attempt(lambda: partial_prefill(model, prefilled(cache()), prompt[:, :2], method="pass-x")),
        "chunk_empty": _attempt(lambda: partial_prefill(model, prefilled(cache()), prompt[:, :0])),
        "cache_not_a_cache": _attempt(lambda: prefill(model, None, prompt, layout="zigzag")),
        "empty_prompt": _attempt(lambda: prefill(model, cache(), prompt[:, :0], layout="zigzag")),
        "temperature_overflow": _attempt(lambda: generate(model, prompt, layout="zigzag", new_tokens=2,
                                                          temperature=10**400)),
    }
    # sharded_attention is inference only: its all-gather cuts the graph (once requires_grad=False, or a
    # gradient for the sinks alone), and the kernel's lse has no gradient (once wrong dq, dk with sinks)
    q, kv = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(3)), torch.randn(1, 2, rank + 1, 8)
    messages["attention_grad"] = _attempt(lambda: sharded_attention(q.requires_grad_(), kv, kv, group=None,
                                                                    scale=None, sinks=torch.zeros(4)))
    q.requires_grad_(False)
    # prefilled in inference mode, decoded outside it, where torch refuses to write the cache's inference
    # tensors: once on the owner rank alone, inside the step's write, the others waiting in attention
    with torch.inference_mode():
        frozen = prefilled(cache())
    messages["inference_mode_cache"] = _attempt(lambda: decode_step(model, frozen, prompt[:, 0]))
    # a value_dim that is not the model's head_dim: once found inside the layer
    messages["value_dim"] = _attempt(lambda: prefill(model, cache(value_dim=2 * cfg.head_dim), prompt,
                                                     layout="zigzag"))
    # prompts of several lengths, or sparse: once torch's internal errors
    ragged = torch.nested.nested_tensor([prompt[0], prompt[1, :5]], layout=torch.jagged)
    messages["nested_prompt"] = _attempt(lambda: generate(model, ragged, layout="zigzag", new_tokens=2))
    messages["sparse_prompt"] = _attempt(lambda: prefill(model, cache(), prompt.to_sparse(), layout="zigzag"))
    full = prefilled(cache(capacity=PROMPT_LEN + 1))
    decode_step(model, full, prompt[:, 0])
    messages["cache_full"] = _attempt(lambda: decode_step(model, full, prompt[:, 1]))
    messages["decode_consistency_type"] = _attempt(lambda: decode_step(model, full, prompt[:, 1],
                                                                       check_consistency="no"))
    if world > 1:  # one rank takes a prompt of any length
        messages["layout_length"] = _attempt(lambda: prefill(model, cache(), prompt_tokens(2 * world * 3 + 1),
                                                             layout="zigzag"))
        behind, ahead = prefilled(cache()), prefilled(cache())
        decode_step(model, ahead, prompt[:, 0])
        # rank 0 one step ahead of the others, feeding the same token
        messages["step"] = _attempt(lambda: decode_step(model, ahead if rank == 0 else behind, prompt[:, 1]))
        # rank 0 feeding another token at the same step
        token = prompt[:, 1] if rank == 0 else prompt[:, 2]
        messages["tokens_differ"] = _attempt(lambda: decode_step(model, behind, token))
        # rank 0 extending by another chunk at the same position
        chunk = prompt[:, 3:5] if rank == 0 else prompt[:, 5:7]
        messages["chunks_differ"] = _attempt(lambda: partial_prefill(model, prefilled(cache()), chunk))
        # method="auto" everywhere, but rank 0 predicts on hardware whose latency favours pass-KV while the
        # others choose pass-Q by bytes: the methods they resolve to disagree
        slow = get_hardware("H100-SXM", latency=1e-3) if rank == 0 else None
        messages["methods_differ"] = _attempt(lambda: partial_prefill(model, prefilled(cache()), prompt[:, 3:5],
                                                                     hardware=slow))
        # only the last rank's prompt is wrong: it raises its own error, the others name it
        rows = prompt[:1] if rank == world - 1 else prompt
        messages["one_rank_bad"] = _attempt(lambda: prefill(model, cache(), rows, layout="zigzag"))
        # rank 0 decodes the token the others feed as a one-token chunk: different calls, once a gloo abort
        # (their signatures had different sizes)
        kind = lambda c: decode_step(model, c, prompt[:, 1]) if rank == 0 else partial_prefill(model, c, prompt[:, 1:2])  # noqa: E731
        messages["calls_differ"] = _attempt(lambda: kind(prefilled(cache())))
        # empty caches of other capacities filled by a chunk: once a gloo abort in the chunk's position exchange
        messages["chunk_capacities_differ"] = _attempt(lambda: partial_prefill(
            model, cache(capacity=PROMPT_LEN + 4 + rank), prompt[:, :4]))
        # rewound into the prompt, refilled to capacity: one rank's shard fills first (the prompt's last
        # positions leave rank 0, the refill deals them round-robin); once blamed on misuse of the cache
        rewound = prefilled(cache(capacity=PROMPT_LEN))
        rewound.rewind(PROMPT_LEN - 2)
        messages["rewound_refill"] = _attempt(lambda: [decode_step(model, rewound, prompt[:, i]) for i in (0, 1)])
        # so for a chunk: rewound into a contiguous prompt, rank 0's shard (its first positions) fills first; once
        # unchecked, a torch error on rank 0 and 'Connection closed by peer' on the others
        contiguous = cache(capacity=PROMPT_LEN)
        prefill(model, contiguous, prompt, layout="contiguous")
        contiguous.rewind(2)
        messages["rank_0_shard_full"] = _attempt(lambda: partial_prefill(model, contiguous, prompt[:, 2:]))
        messages["interrupted_chunk"] = _interrupted_chunk(model, prefilled(cache()), prefilled(cache()), prompt)
        # only the last rank's temperature is out of float range: once an OverflowError that left the others waiting
        hot = 10**400 if rank == world - 1 else 1.0
        messages["one_rank_overflow"] = _attempt(lambda: generate(model, prompt, layout="zigzag", new_tokens=2,
                                                                  temperature=hot))
        # a cache held over a mesh is model.generate()'s (HF): the library's entries take one on a group
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ring", "ulysses"))
        messages["cache_on_a_mesh"] = _attempt(lambda: prefill(model, cache(mesh=mesh), prompt, layout="zigzag",
                                                               strategy="hybrid", mesh=mesh))
        messages["cache_on_group_and_mesh"] = _attempt(lambda: cache(group=topology.from_mesh(mesh).ring_group,
                                                                     mesh=mesh))
        # sharded_attention of queries that differ on rank 0: once a merge of partials of different queries,
        # returned on every rank without a word (of other shapes: a gloo abort)
        messages["attention_queries_differ"] = _attempt(lambda: sharded_attention(q + (rank == 0), kv, kv, group=None,
                                                                                  scale=None))
        # another scale, or other sinks, on rank 0: out of its signature (planted mutations), every rank returned
        # a merge of partials of different softmaxes without a word
        messages["attention_scales_differ"] = _attempt(lambda: sharded_attention(q, kv, kv, group=None,
                                                                                 scale=0.5 if rank == 0 else 0.25))
        messages["attention_sinks_differ"] = _attempt(lambda: sharded_attention(
            q, kv, kv, group=None, scale=None, sinks=torch.full((4,), float(rank == 0))))
        # the last rank's keys have 3 heads for 4 query heads: it raised alone, the others waited in the all-gather
        bad_kv = torch.randn(1, 3, 2, 8) if rank == world - 1 else kv
        messages["one_rank_bad_keys"] = _attempt(lambda: sharded_attention(q, bad_kv, bad_kv, group=None, scale=None))
        # check_consistency=False compares nothing: calls that differ between ranks run (an exchange left in
        # would refuse them, and cost every call its all-gather)
        other = prompt.flip(1) if rank == 0 else prompt
        unchecked = {"prefill": lambda: prefill(model, cache(), other, layout="zigzag", check_consistency=False),
                     "chunk": lambda: partial_prefill(model, prefilled(cache()), other[:, :2], check_consistency=False),
                     "decode": lambda: decode_step(model, prefilled(cache()), other[:, 0], check_consistency=False),
                     "attention": lambda: sharded_attention(q + (rank == 0), kv, kv, group=None, scale=None,
                                                            check_consistency=False)}
        for entry, call in unchecked.items():
            messages[f"unchecked_{entry}"] = _attempt(call)
        # only the last rank's keys require grad: it raises its own error, the others name it
        grad_kv = kv.clone().requires_grad_(rank == world - 1)
        messages["one_rank_attention_grad"] = _attempt(lambda: sharded_attention(q, grad_kv, kv, group=None,
                                                                                 scale=None))
        # only the last rank's cache has another value_dim / its prompt is nested: once found inside the layer
        # (the others saw "Connection closed by peer"), or read outside the checks (the others waited)
        messages["one_rank_value_dim"] = _attempt(lambda: prefill(
            model, cache(value_dim=2 * cfg.head_dim if rank == world - 1 else None), prompt, layout="zigzag"))
        rows = ragged if rank == world - 1 else prompt
        messages["one_rank_nested_prompt"] = _attempt(lambda: prefill(model, cache(), rows, layout="zigzag"))
        # a falsy flag that the last rank alone refuses: it once skipped the exchange there, its peers' exchange
        # meeting its next call's
        flag = None if rank == world - 1 else True
        messages["one_rank_flag_prefill"] = _attempt(lambda: prefill(model, cache(), prompt, layout="zigzag",
                                                                     check_consistency=flag))
        messages["one_rank_flag_decode"] = _attempt(lambda: decode_step(model, prefilled(cache()), prompt[:, 0],
                                                                        check_consistency=flag))
        messages["one_rank_flag_chunk"] = _attempt(lambda: partial_prefill(model, prefilled(cache()), prompt[:, :2],
                                                                           check_consistency=flag))
        messages["one_rank_flag_generate"] = _attempt(lambda: generate(model, prompt, layout="zigzag", new_tokens=2,
                                                                       check_consistency=flag))
        messages["one_rank_flag_attention"] = _attempt(lambda: sharded_attention(q, kv, kv, group=None, scale=None,
                                                                                 check_consistency=flag))
        # an empty name among those that differ: its row of the names' exchange once failed on that rank alone
        messages["one_rank_empty_strategy"] = _attempt(lambda: generate(
            model, prompt, layout="zigzag", new_tokens=2, strategy="" if rank == world - 1 else "ring"))
        # values that differ are named as themselves: once float bits and checksums of the names
        messages["temperature_differs"] = _attempt(lambda: generate(model, prompt, layout="zigzag", new_tokens=2,
                                                                    temperature=0.5 + rank * 1e-16))
        messages["names_differ"] = _attempt(lambda: prefill(
            model, cache(), prompt, layout="zigzag" if rank == 0 else "striped",
            strategy="ring" if rank == 0 else "allgather"))
        # rank 0's model has another vocabulary: once uninitialised logits on the others (another layer count: a hang)
        wider = Transformer(ModelConfig(**{**vars(cfg), "vocab": cfg.vocab + 2})).eval()
        messages["models_differ"] = _attempt(lambda: generate(wider if rank == 0 else model, prompt, layout="zigzag",
                                                              new_tokens=2))
        # rank 0's weights drawn apart (its first value moved, as another seed would): once other logits, silently
        drawn = Transformer(cfg).eval()
        drawn.load_state_dict(model.state_dict())
        with torch.no_grad():
            next(drawn.parameters()).view(-1)[0] += rank == 0
        messages["weights_differ"] = _attempt(lambda: generate(drawn, prompt, layout="zigzag", new_tokens=2))
        messages["prefill_weights_differ"] = _attempt(lambda: prefill(drawn, cache(), prompt, layout="zigzag"))
        # the last rank's on_token is not a function: it once raised after the prefill, leaving the others waiting
        on_token = "progress" if rank == world - 1 else None
        messages["one_rank_on_token"] = _attempt(lambda: generate(model, prompt, layout="zigzag", new_tokens=2,
                                                                  on_token=on_token))
        # two caches of other prompts, at one position, taken in another order on rank 0: once every rank's
        # logits were plausible and of neither sequence (so for the same prompt dealt by two layouts)
        first, second = prefilled(cache()), cache()
        prefill(model, second, prompt.flip(1), layout="zigzag")
        swap = lambda a, b: a if rank == 0 else b  # noqa: E731
        messages["caches_swapped"] = _attempt(lambda: decode_step(model, swap(first, second), prompt[:, 0]))
        messages["chunk_caches_swapped"] = _attempt(lambda: partial_prefill(model, swap(second, first), prompt[:, :2]))
        dealt = cache()
        prefill(model, dealt, prompt, layout="striped")
        messages["deals_differ"] = _attempt(lambda: decode_step(model, swap(first, dealt), prompt[:, 0]))
        messages["generate_layouts_differ"] = _attempt(lambda: generate(
            model, prompt[:, :3], layout=swap("zigzag", "striped"), new_tokens=2))
        if world == 4:
            # a hybrid mesh over ranks {0, 2} and {1, 3}, the caches over {0, 1} and {2, 3}: once a prefill mixing
            # the two groups' prompts, then a broadcast from another group's rank (the others waited)
            from torch.distributed.device_mesh import init_device_mesh

            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            across = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("ring", "dp", "ulysses"))["ring", "ulysses"]
            messages["mesh_over_other_ranks"] = _attempt(lambda: prefill(
                model, cache(group=pairs[rank // 2]), prompt, layout="zigzag", strategy="hybrid", mesh=across))
            messages["generate_mesh_over_other_ranks"] = _attempt(lambda: generate(
                model, prompt, layout="zigzag", group=pairs[rank // 2], strategy="hybrid", mesh=across, new_tokens=2))
            messages["generate_mesh_of_fewer_ranks"] = _attempt(lambda: generate(
                model, prompt, layout="zigzag", strategy="hybrid", mesh=across, new_tokens=2))
            # the last rank's keys of 3 heads over a 2 x 2 mesh: compared over the rows, then the columns (over the
            # rows alone, ranks 0 and 1 went on into the all-gather); rank 0 hears of it in the second exchange
            square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
            said = _attempt(lambda: sharded_attention(q, bad_kv, bad_kv, group=None, mesh=square, scale=None))
            heard = "H a multiple of H_kv" if rank == world - 1 else "of the CP group rejected their sharded attention"
            messages["one_rank_bad_keys_on_a_mesh"] = "refused alike" if heard in said else said
    # no rank was left inside a collective: a whole generation still works afterwards
    r = generate(model, prompt, layout="zigzag", new_tokens=4)
    ok = r.tokens.tolist() == reference_generate(model, prompt, new_tokens=4).tolist()
    messages["after"] = "ok" if ok else f"tokens {r.tokens.tolist()} differ from the reference"
    return messages
