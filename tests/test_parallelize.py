"""``apply_context_parallel`` on the reference model, 4 gloo ranks in one spawned group: the
forward is exact with the positions ``shard_batch`` gives, and refused on every rank
together when the positions are forgotten or come from another layout (both were once
silently wrong: RoPE read positions that the causal mask did not share)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import ctxpar
import spawned
from ctxpar.layout import get_layout
from ctxpar.models import Transformer
from ctxpar.models.config import get_config
from ctxpar.parallelize import apply_context_parallel, shard_batch

WORLD, SEQ = 4, 32
DOCUMENTS = (5, 19, 8)


def _attempt(fn) -> str | float:
    """fn()'s value, or the message of the ValueError it raised."""
    try:
        return fn()
    except ValueError as e:
        return str(e)


def _cases(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, SEQ))
    layout = get_layout("zigzag", world)
    found = {}
    for name, kwargs, cp_rank in (("ring", {}, rank), ("hybrid", None, None)):
        model = Transformer(get_config("tiny")).eval()
        full_model = copy.deepcopy(model)
        if kwargs is None:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
            kwargs, cp_rank = dict(strategy="hybrid", mesh=mesh), ctxpar.hybrid_rank(mesh)
        with torch.no_grad():
            full = model(tokens)
            packed = model(tokens, shard_batch(tokens, layout=get_layout("zigzag", 1), rank=0,
                                               documents=DOCUMENTS).positions, documents=DOCUMENTS)
            apply_context_parallel(model, layout=layout, **kwargs)
            batch = shard_batch(tokens, layout=layout, rank=cp_rank)
            docs = shard_batch(tokens, layout=layout, rank=cp_rank, documents=DOCUMENTS)
            other = shard_batch(tokens, layout=get_layout("contiguous", world), rank=cp_rank)
            last = rank == world - 1
            found[name] = dict(
                exact=_attempt(lambda: (model(batch.tokens, batch.positions)
                                        - layout.shard(full, cp_rank, dim=1)).abs().max().item()),
                documents=_attempt(lambda: (model(docs.tokens, docs.positions, documents=docs.documents)
                                            - layout.shard(packed, cp_rank, dim=1)).abs().max().item()),
                forgotten=_attempt(lambda: model(batch.tokens)),
                other_layout=_attempt(lambda: model(other.tokens, other.positions)),
                global_with_documents=_attempt(lambda: model(docs.tokens, batch.positions, documents=DOCUMENTS)),
                one_rank_forgets=_attempt(lambda: model(batch.tokens, None if last else batch.positions)),
                after=_attempt(lambda: (model(batch.tokens, batch.positions)
                                        - layout.shard(full, cp_rank, dim=1)).abs().max().item()),
            )
            copied = copy.deepcopy(model)  # an EMA copy: once unguarded, its attention a copy the guard missed
            found[name]["copy_exact"] = _attempt(lambda: (copied(batch.tokens, batch.positions)
                                                          - layout.shard(full, cp_rank, dim=1)).abs().max().item())
            found[name]["copy_forgotten"] = _attempt(lambda: copied(batch.tokens))
            if name == "ring":  # a group= of its own, which a deep copy once failed to pickle
                grouped = apply_context_parallel(copy.deepcopy(full_model), layout=layout,
                                                 group=dist.new_group(list(range(world))))
                found[name]["copy_on_a_group"] = _attempt(lambda: (copy.deepcopy(grouped)(batch.tokens, batch.positions)
                                                                   - layout.shard(full, cp_rank, dim=1)
                                                                   ).abs().max().item())
            apply_context_parallel(model, layout="zigzag", **kwargs)  # by name, as ctxpar.attention takes it
            found[name]["by_name"] = _attempt(lambda: (model(batch.tokens, batch.positions)
                                                       - layout.shard(full, cp_rank, dim=1)).abs().max().item())
            found[name]["by_name_forgotten"] = _attempt(lambda: model(batch.tokens))
            apply_context_parallel(model, layout=layout, check_consistency=False, **kwargs)
            found[name]["unchecked"] = _attempt(lambda: tuple(model(batch.tokens).shape))
    return found


def results() -> list[dict]:
    return spawned.results("parallelize", _cases, WORLD, timeout_s=60)


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_the_positions_shard_batch_gives_are_exact(strategy: str) -> None:
    for rank, res in enumerate(results()):
        r = res[strategy]
        grouped = ["copy_on_a_group"] if strategy == "ring" else []
        for case in ["exact", "documents", "after", "by_name", "copy_exact", *grouped]:
            assert isinstance(r[case], float) and r[case] < 1e-5, f"rank {rank} {case}: {r[case]}"


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_wrong_positions_are_refused_on_every_rank(strategy: str) -> None:
    for rank, res in enumerate(results()):
        r = res[strategy]
        assert "got no positions under context parallelism" in r["forgotten"], (rank, r["forgotten"])
        assert "global positions under the zigzag layout" in r["other_layout"], (rank, r["other_layout"])
        assert "global positions within each document" in r["global_with_documents"], rank
        assert "shard_batch(tokens, layout=layout, rank=rank, documents=documents)" in r["global_with_documents"] \
            or strategy == "hybrid", r["global_with_documents"]
        assert "got no positions" in r["by_name_forgotten"], (rank, r["by_name_forgotten"])
        assert "got no positions" in r["copy_forgotten"], (rank, r["copy_forgotten"])
        # under the hybrid mesh a rank outside the culprit's row and column hears of it second hand, unnamed
        want = "got no positions" if rank == WORLD - 1 else "of the CP group rejected their forward inputs"
        assert want in r["one_rank_forgets"], (rank, r["one_rank_forgets"])


def test_check_consistency_false_skips_the_guard() -> None:
    """The opt-out ctxpar.attention has, for calls known to agree: the forward runs unchecked."""
    for res in results():
        assert res["ring"]["unchecked"] == (2, SEQ // WORLD, 256)


def test_one_rank_needs_no_positions() -> None:
    """Without a process group the model is plain single-device code: 0..T-1 is right."""
    torch.manual_seed(0)
    model = Transformer(get_config("tiny")).eval()
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        want = model(tokens)
        apply_context_parallel(model, layout=get_layout("zigzag", 1))
        torch.testing.assert_close(model(tokens), want)


def test_the_guard_is_replaced_not_stacked_when_applied_again() -> None:
    model = Transformer(get_config("tiny"))
    apply_context_parallel(model, layout=get_layout("zigzag", 1))
    apply_context_parallel(model, layout=get_layout("striped", 1))
    assert len(model._forward_pre_hooks) == 1
