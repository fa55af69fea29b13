"""``apply_context_parallel`` on the reference model, 4 gloo ranks in one spawned group: the
forward is exact with the positions ``shard_batch`` gives, and refused on every rank
together when the positions are forgotten or come from another layout (both were once
silently wrong: RoPE read positions that the causal mask did not share), through
``hidden_states`` too; ``cp_loss`` is exact in float64 and refuses labels that do not fit
on one rank on every rank together (the others once waited in its all-reduce)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ctxpar
import spawned
from ctxpar.layout import get_layout
from ctxpar.models import Transformer
from ctxpar.models.llama import Block, causal_sdpa, rope_cos_sin
from ctxpar.models.config import get_config
from ctxpar.parallelize import IGNORE_INDEX, apply_context_parallel, batch_code, cp_loss, shard_batch

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
            last, chunk = rank == world - 1, SEQ // (2 * world)
            # chunk P + r, where zigzag's is 2P - 1 - r: another chunk on every rank for an even P (WORLD is 4)
            mirrored = torch.arange(chunk) + (world + cp_rank) * chunk
            outside = batch.tokens.clone()
            outside[0, 0] = 256 if last else 0  # the vocabulary is 0..255
            found[name] = dict(
                outside_the_vocabulary=_attempt(lambda: model(outside, batch.positions)),
                exact=_attempt(lambda: (model(batch.tokens, batch.positions)
                                        - layout.shard(full, cp_rank, dim=1)).abs().max().item()),
                documents=_attempt(lambda: (model(docs.tokens, docs.positions, documents=docs.documents)
                                            - layout.shard(packed, cp_rank, dim=1)).abs().max().item()),
                forgotten=_attempt(lambda: model(batch.tokens)),
                # a list, an array, a column: AttributeError, or "must be the global positions" of right values
                positions_list=_attempt(lambda: model(batch.tokens, batch.positions.tolist())),
                positions_array=_attempt(lambda: model(batch.tokens, batch.positions.numpy())),
                positions_column=_attempt(lambda: model(batch.tokens, batch.positions.reshape(-1, 1))),
                positions_rows=_attempt(lambda: model(batch.tokens, batch.positions.reshape(1, -1).expand(3, -1))),
                other_layout=_attempt(lambda: model(other.tokens, other.positions)),
                global_with_documents=_attempt(lambda: model(docs.tokens, batch.positions, documents=DOCUMENTS)),
                one_rank_forgets=_attempt(lambda: model(batch.tokens, None if last else batch.positions)),
                # (B, S) positions whose second row alone is wrong, on the last rank: once the guard compared the
                # first row only, and row 1's logits were silently wrong
                second_row_wrong=_attempt(lambda: model(batch.tokens, torch.stack(
                    [batch.positions, batch.positions.flip(0) if last else batch.positions]))),
                # zigzag positions hand-rolled with the wrong mirrored chunk (P + r, not 2P - 1 - r), wrong in
                # their second half alone: a guard comparing the first half passed them at P = 2
                wrong_mirror=_attempt(lambda: model(batch.tokens, torch.cat([batch.positions[:chunk], mirrored]))),
                hidden_states_one_rank_forgets=_attempt(lambda: model.hidden_states(
                    batch.tokens, None if last else batch.positions)),
                after=_attempt(lambda: (model(batch.tokens, batch.positions)
                                        - layout.shard(full, cp_rank, dim=1)).abs().max().item()),
            )
            found[name].update(_batches_compared(model, tokens, layout, cp_rank, last, full))
            found[name].update(_models_compared(kwargs, layout, batch, last))
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
        found[name].update(_losses(layout, cp_rank, last, {"mesh": kwargs["mesh"]} if "mesh" in kwargs else {}))
    found["groups"] = _group_cases(rank, world)
    return found


def _group_cases(rank: int, world: int) -> dict:
    """The odd and the even ranks as CP groups listed in descending order ([3, 1], [2, 0]):
    torch numbers each by ascending global rank, so a shard taken by the place in the list
    holds another rank's positions (silently wrong attention through ``ctxpar.attention``);
    and cp_loss given a (dp, cp) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    listed = [list(range(world - 1, -1, -2)), list(range(world - 2, -1, -2))]
    parities = [dist.new_group(ranks) for ranks in listed]
    group, mine = parities[rank % 2 == 0], listed[rank % 2 == 0]
    layout = get_layout("zigzag", len(mine))
    model = apply_context_parallel(Transformer(get_config("tiny")).eval(), layout=layout, group=group)
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(rank % 2))  # one per group
    by_place = shard_batch(tokens, layout=layout, rank=mine.index(rank))
    dp_cp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    with torch.no_grad():
        return dict(group_rank=dist.get_rank(group), by_place_in_the_list=_attempt(lambda: model(by_place.tokens,
                                                                                                 by_place.positions)),
                    whole_sequence=_attempt(lambda: model(tokens, torch.arange(SEQ))),
                    cp_loss_on_a_dp_cp_mesh=_attempt(lambda: cp_loss(torch.randn(1, 4, 8), torch.zeros(
                        1, 4, dtype=torch.long), mesh=dp_cp)))


def _losses(layout, cp_rank: int, last: bool, ranks: dict) -> dict:
    """``cp_loss`` over the CP ranks (``ranks``: cp_loss's mesh= for the hybrid mesh) on float64
    logits: its loss and this rank's logit gradients against the unsplit float64 loss's, then
    labels that do not fit on one rank only."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, SEQ, 256, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 256, (2, SEQ), generator=gen)
    labels[0, :5] = IGNORE_INDEX
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    want_grad, = torch.autograd.grad(want, logits)
    local = layout.shard(logits.detach(), cp_rank, dim=1).requires_grad_()
    mine = layout.shard(labels, cp_rank, dim=1)
    share, loss = cp_loss(local, mine, **ranks)
    share.backward()
    found = dict(loss_error=abs(loss.item() - want.item()) / want.item(),
                 gradient_error=((local.grad - layout.shard(want_grad, cp_rank, dim=1)).abs().max()
                                 / want_grad.abs().max()).item())
    for case, value in (("vocab", 256), ("minus_one", -1)):
        bad = mine.clone()
        bad[1, 3] = value if last else bad[1, 3]
        found[f"label_{case}_on_one_rank"] = _attempt(lambda: cp_loss(local, bad, **ranks))
    found["labels_of_another_shape_on_one_rank"] = _attempt(lambda: cp_loss(local, mine[:, 1:] if last else mine,
                                                                            **ranks))
    # logits that are no tensor on one rank (a model output object passed whole): it raised alone
    found["logits_not_a_tensor_on_one_rank"] = _attempt(lambda: cp_loss(dict(logits=local) if last else local, mine,
                                                                        **ranks))
    # float32 logits on one rank, float64 on the others: the loss's all-reduce in two widths aborted gloo
    found["logits_narrower_on_one_rank"] = _attempt(lambda: cp_loss(local.float() if last else local, mine, **ranks))
    found["loss_after"] = abs(cp_loss(local, mine, **ranks)[1].item() - want.item()) / want.item()
    return found


def _batches_compared(model, tokens, layout, cp_rank: int, last: bool, full) -> dict:
    """Forwards of shards cut from different batches (refused), and of shards that cannot
    say which batch they came from (run)."""
    own = torch.Generator().manual_seed(100 + cp_rank)  # a DistributedSampler over every rank
    mine = shard_batch(torch.randint(0, 256, tokens.shape, generator=own), layout=layout, rank=cp_rank)
    fresh = 255 - tokens  # not sharded before: sharded with other labels, its shard would name neither
    relabelled = shard_batch(fresh, layout=layout, rank=cp_rank, labels=torch.zeros_like(fresh) if last else None)
    # two batches that differ only where CP rank 0 holds no tokens: its shard names neither (as
    # a shard of padding would), the others' name their own
    held = layout.positions(tokens.shape[1], 0).tolist()
    first, second = tokens.clone(), tokens.clone()
    second[:, [p for p in range(tokens.shape[1]) if p not in held]] += 1
    first_shard, second_shard = (shard_batch(t, layout=layout, rank=cp_rank) for t in (first, second))
    want = layout.shard(full, cp_rank, dim=1)
    return dict(
        another_batch=_attempt(lambda: model(mine.tokens.clone(), mine.positions)),
        another_labelling=_attempt(lambda: model(relabelled.tokens, relabelled.positions)),
        unnamed_first=_attempt(lambda: (model(first_shard.tokens, first_shard.positions) - want).abs().max().item()),
        unnamed_second=_attempt(lambda: tuple(model(second_shard.tokens, second_shard.positions).shape)),
    )


def _models_compared(kwargs: dict, layout, batch, last: bool) -> dict:
    """Forwards of models built otherwise on the last rank: the reference model with another
    config, and a module of one's own (no config: its parameters' shapes) around one."""
    found = {}
    tiny = get_config("tiny")
    with torch.random.fork_rng():  # the last rank draws more weights: the models after must stay alike
        for case, changes in (("rope_theta", dict(rope_theta=10000.0)), ("norm_eps", dict(norm_eps=1e-2)),
                              ("vocab", dict(vocab=300)), ("layers", dict(layers=3))):
            model = Transformer(tiny.with_(**changes) if last else tiny).eval()
            for wrapped in (False, True):
                guarded = apply_context_parallel(_Wrapped(model) if wrapped else model, layout=layout, **kwargs)
                found[f"{case}{'_wrapped' if wrapped else ''}_on_one_rank"] = _attempt(
                    lambda: guarded(batch.tokens, batch.positions))
        torch.manual_seed(1 if last else 0)  # seeded by rank before building the model
        drawn = apply_context_parallel(Transformer(tiny).eval(), layout=layout, **kwargs)
        found["weights_on_one_rank"] = _attempt(lambda: drawn(batch.tokens, batch.positions))
        torch.manual_seed(0)
        trained = apply_context_parallel(Transformer(tiny).eval(), layout=layout, **kwargs)
        found["mode_alike"] = _attempt(lambda: tuple(trained(batch.tokens, batch.positions).shape))
        trained.train(last)  # after a forward alike: the mode is compared at every forward, not at the first alone
        found["mode_on_one_rank"] = _attempt(lambda: trained(batch.tokens, batch.positions))
    return found


spawned.declare("parallelize", _cases, WORLD, timeout_s=60)


def results() -> list[dict]:
    return spawned.results("parallelize")


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
        # the rank the guard expects, and how to read it (here every rank's place is its global rank)
        holder = f"CP rank {rank} (ctxpar.hybrid_rank(mesh))" if strategy == "hybrid" else \
            f"group rank {rank} (dist.get_rank(group))"
        assert "got no positions under context parallelism" in r["forgotten"], (rank, r["forgotten"])
        assert f"of this rank, {holder}: batch = shard_batch(tokens, layout=layout, rank={rank})" in r["forgotten"]
        assert f"global positions of {holder} under the zigzag layout" in r["other_layout"], (rank, r["other_layout"])
        assert f"global positions of {holder} under the zigzag layout" in r["wrong_mirror"], (rank, r["wrong_mirror"])
        assert f"global positions within each document of {holder}" in r["global_with_documents"], rank
        assert f"shard_batch(tokens, layout=layout, rank={rank}, documents=documents)" in r["global_with_documents"], \
            r["global_with_documents"]
        assert "got no positions" in r["by_name_forgotten"], (rank, r["by_name_forgotten"])
        assert "got no positions" in r["copy_forgotten"], (rank, r["copy_forgotten"])
        # under the hybrid mesh a rank outside the culprit's row and column hears of it second hand, unnamed
        want = "got no positions" if rank == WORLD - 1 else "of the CP group rejected their forward inputs"
        assert want in r["one_rank_forgets"], (rank, r["one_rank_forgets"])
        want = f"global positions of {holder} under the zigzag layout" if rank == WORLD - 1 else \
            "of the CP group rejected their forward inputs"
        assert isinstance(r["second_row_wrong"], str) and want in r["second_row_wrong"], (rank, r["second_row_wrong"])


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_positions_of_another_type_or_shape_are_refused_naming_the_shape(strategy: str) -> None:
    local = SEQ // WORLD
    for rank, res in enumerate(results()):
        r = res[strategy]
        for case, got in (("list", "list"), ("array", "ndarray"), ("column", f"shape ({local}, 1)"),
                          ("rows", f"shape (3, {local})")):  # 3 rows for 2: once k and v's shapes refused
            want = f"takes positions as a ({local},) or (2, {local}) tensor for tokens (2, {local}) " \
                   f"(shard_batch's batch.positions), got {got}"
            assert want in r[f"positions_{case}"], (rank, case, r[f"positions_{case}"])


def test_a_shard_taken_by_the_place_in_new_groups_list_is_refused_naming_the_group_rank() -> None:
    """new_group([3, 1]): torch numbers global rank 1 as the group's rank 0. Sharding by the
    place in the list (rank 3 taking shard 0) was refused telling rank 1 to pass 'rank=rank';
    the refusal names the group rank, how to read it and the rank to pass."""
    for rank, res in enumerate(results()):
        r = res["groups"]
        assert r["group_rank"] == rank // 2, (rank, r["group_rank"])
        want = f"positions must be the global positions of group rank {rank // 2} (dist.get_rank(group)) under the " \
               f"zigzag layout"
        assert want in r["by_place_in_the_list"], (rank, r["by_place_in_the_list"])
        assert f"shard_batch(tokens, layout=layout, rank={rank // 2})" in r["by_place_in_the_list"], rank
        # written as runs, where the first positions of each, cut to a list of 6, once read alike
        mine, theirs = ("8..23", "0..7, 24..31") if rank // 2 else ("0..7, 24..31", "8..23")
        want = f"got {theirs}, where this rank's are {mine} (its token 0 is at {mine[0]}, not {theirs[0]}): "
        assert want in r["by_place_in_the_list"], (rank, r["by_place_in_the_list"])


def test_the_whole_sequence_passed_on_every_rank_is_named_as_such() -> None:
    """Read as the shard of a sequence twice as long: the refusal said only that the positions
    were not this rank's, quoting two lists that began alike."""
    for rank, res in enumerate(results()):
        mine = "16..47" if rank // 2 else "0..15, 48..63"
        want = f"got 0..31, where this rank's are {mine} (its token {0 if rank // 2 else 16} is at " \
               f"{16 if rank // 2 else 48}, not {0 if rank // 2 else 16}); numbered from 0 to 31: if they are the " \
               f"whole sequence's, passed on each rank, each of the 2 ranks must pass its shard of T/2 tokens instead"
        assert want in res["groups"]["whole_sequence"], (rank, res["groups"]["whole_sequence"])


def test_cp_loss_on_a_dp_cp_mesh_names_the_groups_to_pass() -> None:
    """Its mesh= is a hybrid mesh's ranks: a (dp, cp) mesh was refused as no hybrid mesh, naming no fix."""
    for rank, res in enumerate(results()):
        got = res["groups"]["cp_loss_on_a_dp_cp_mesh"]
        assert "for the ranks of its CP dim pass group=mesh.get_group('cp') instead (the mean over one CP group's " \
               "tokens), or group=None (over every rank's: DP x CP)" in got, (rank, got)


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_hidden_states_is_guarded_as_the_forward_is(strategy: str) -> None:
    """``model.hidden_states`` ran without the forward's guard: a shard numbered from 0 on one
    rank went through silently wrong (max error 0.027)."""
    for rank, res in enumerate(results()):
        got = res[strategy]["hidden_states_one_rank_forgets"]
        want = "got no positions" if rank == WORLD - 1 else "of the CP group rejected their forward inputs"
        assert isinstance(got, str) and want in got, (rank, got)


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_cp_loss_is_exact_in_float64(strategy: str) -> None:
    """It computed in float32 whatever the logits' dtype (relative error 1e-7)."""
    for rank, res in enumerate(results()):
        r = res[strategy]
        assert r["loss_error"] < 1e-13 and r["gradient_error"] < 1e-13, (rank, r["loss_error"], r["gradient_error"])


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_labels_that_do_not_fit_on_one_rank_are_refused_on_every_rank(strategy: str) -> None:
    """A label outside the vocabulary (the vocabulary's size, or -1 meant as "ignore"), labels of
    another shape or logits that are no tensor on one rank raised there alone; the others
    waited in cp_loss's all-reduce until the timeout; float32 logits on one rank aborted
    gloo in the loss's all-reduce. Every rank now names the value and the rank, and cp_loss
    works after."""
    for rank, res in enumerate(results()):
        r = res[strategy]
        for case, value in (("vocab", 256), ("minus_one", -1)):
            want = f"labels hold 1 value(s) outside the vocabulary 0..255 of the logits ({value}, on rank {WORLD - 1})"
            assert want in r[f"label_{case}_on_one_rank"], (rank, case, r[f"label_{case}_on_one_rank"])
        want = f"and labels (2, 7) (rank {rank})" if rank == WORLD - 1 else f"rank {WORLD - 1}'s labels do not fit"
        assert want in r["labels_of_another_shape_on_one_rank"], (rank, r["labels_of_another_shape_on_one_rank"])
        want = "got logits dict and labels (2, 8)" if rank == WORLD - 1 else f"rank {WORLD - 1}'s labels do not fit"
        assert want in r["logits_not_a_tensor_on_one_rank"], (rank, r["logits_not_a_tensor_on_one_rank"])
        want = f"the logits are float64 on {WORLD - 1} of the {WORLD} ranks and narrower on the others " \
               f"({'float32' if rank == WORLD - 1 else 'float64'} on rank {rank})"
        assert want in r["logits_narrower_on_one_rank"], (rank, r["logits_narrower_on_one_rank"])
        assert r["loss_after"] < 1e-13, (rank, r["loss_after"])


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_a_token_outside_the_vocabulary_is_refused_on_every_rank(strategy: str) -> None:
    """It raised IndexError on the one rank holding it, the others waiting in attention."""
    for rank, res in enumerate(results()):
        got = res[strategy]["outside_the_vocabulary"]
        want = "outside its vocabulary of 256 (0..255)" if rank == WORLD - 1 else "rejected their forward inputs"
        assert want in got, (rank, got)


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_shards_of_different_batches_are_refused_on_every_rank(strategy: str) -> None:
    """Each rank sharding a batch of its own (a DistributedSampler over every rank) once ran
    silently wrong; shards that name no batch alone (cut alike from two) still run."""
    for rank, res in enumerate(results()):
        r = res[strategy]
        assert "every rank of a CP group shards the same batch" in r["another_batch"], (rank, r["another_batch"])
        # one rank's labels differ: under the hybrid mesh a rank outside its row and column hears second hand
        assert "disagree on the forward" in r["another_labelling"], (rank, r["another_labelling"])
        assert isinstance(r["unnamed_first"], float) and r["unnamed_first"] < 1e-5, (rank, r["unnamed_first"])
        assert r["unnamed_second"] == (2, SEQ // WORLD, 256), (rank, r["unnamed_second"])


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_a_model_built_otherwise_on_one_rank_is_refused_on_every_rank(strategy: str) -> None:
    """Another RoPE theta or norm eps on one rank trained silently wrong (a gradient 23% and
    75% off), another vocabulary too; another layer count waited out the timeout. Compared
    in each forward: the config, or a module of one's own's parameter shapes, and the mode
    (train() on one rank, eval() on another); at the first, the weights (a model built after
    seeding the ranks apart)."""
    for rank, res in enumerate(results()):
        r = res[strategy]
        for case in ("rope_theta", "norm_eps", "vocab", "layers"):
            for wrapped in ("", "_wrapped"):
                got = r[f"{case}{wrapped}_on_one_rank"]
                # under the hybrid mesh a rank outside the last rank's row and column hears second hand
                heard = ["disagree on the forward: model (a checksum of its config"]
                if strategy == "hybrid" and rank != WORLD - 1:
                    heard.append("disagree on the forward: (seen by another rank)")
                assert isinstance(got, str) and any(want in got for want in heard), (rank, case, wrapped, got)
        got = r["weights_on_one_rank"]  # trained a mixture of models, silently
        assert isinstance(got, str) and "disagree on the forward" in got, (rank, got)
        assert rank != WORLD - 1 or "weights (a checksum of each parameter's first values" in got, got
        assert r["mode_alike"] == (2, SEQ // WORLD, 256), (rank, r["mode_alike"])
        got = r["mode_on_one_rank"]  # model.train() on one rank: a model with dropout would drop on its shard alone
        assert isinstance(got, str) and "disagree on the forward" in got, (rank, got)
        assert rank != WORLD - 1 or "mode (call model.train() or model.eval() on every rank" in got and \
            "'train'" in got and "'eval'" in got, got


def _reported(fn) -> str | float:
    """fn()'s value, or the type and message of what it raised (a rank raising alone, not only
    a ValueError, is then a case that fails rather than the whole group)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


class _Wrapper(torch.nn.Module):
    """A module of one's own around the reference model, its forward's arguments named otherwise."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, pos)


class _Wrapped(_Wrapper):
    """A module of one's own around the reference model, with no config of its own, its
    forward's arguments named as the reference model's."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(tokens, positions)


class _OwnModel(torch.nn.Module):
    """A model of one's own, nanoGPT's names: its token embedding is ``wte``, not ``embed``."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = get_config("tiny")
        self.wte = torch.nn.Embedding(self.cfg.vocab, self.cfg.hidden)
        self.blocks = torch.nn.ModuleList(Block(self.cfg) for _ in range(2))
        self.head = torch.nn.Linear(self.cfg.hidden, self.cfg.vocab, bias=False)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1])
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.wte(tokens)  # (B, T, d)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(x)  # (B, T, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(tokens, positions)


class _AttendsOutsideAttentionFn(_OwnModel):
    """Block 0 attends through its attention_fn; after the blocks, a layer of its own attends
    with ``attend`` (F.scaled_dot_product_attention, or an nn.MultiheadAttention's forward),
    which under CP would see this rank's shard alone."""

    def __init__(self, attend: str) -> None:
        super().__init__()
        self.attend = attend
        self.mha = torch.nn.MultiheadAttention(self.cfg.hidden, 2, batch_first=True)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.head.weight.T[None, None, :, :].expand(1, 1, -1, -1)  # (1, 1, vocab, d): any q, k, v
        if self.attend == "sdpa":
            direct = F.scaled_dot_product_attention(x, x, x, is_causal=True).mean()
        else:
            hidden = self.wte(tokens)
            direct = self.mha(hidden, hidden, hidden, need_weights=False)[0].mean()
        return self.run(tokens, positions) + direct


class _NamedOtherwise(_OwnModel):
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(input_ids, position_ids)


class _NumbersItsOwnTokens(_OwnModel):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.run(tokens, None)


class _FeatureModel(torch.nn.Module):
    """A model of one's own whose forward takes (tokens, positions), its tokens features
    (B, T/P, C) rather than ids: the guard's checks of token ids are not for it."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(8, 3 * 2 * 4)
        self.attention_fn = causal_sdpa

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = tokens.shape
        q, k, v = self.project(tokens).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)  # (B, H, S, D) each
        return self.attention_fn(q, k, v)


def _dynamic_compile_error(layout, rank: int) -> float:
    """Max error against SDPA of torch.compile(dynamic=True) of a function calling
    ctxpar.attention (its scale symbolic from the first call)."""
    compiled = torch.compile(lambda q, k, v: ctxpar.attention(q, k, v, layout=layout), backend="eager", dynamic=True)
    full = [torch.randn(1, 2, 4 * layout.world_size, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want = layout.shard(torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True), rank, dim=2)
    return (compiled(*(layout.shard(t, rank, dim=2) for t in full)) - want).abs().max().item()


def _wrapped_cases(rank: int, world: int) -> dict:
    """2 ranks: a function calling ctxpar.attention compiled with dynamic=True; then the
    reference model wrapped before apply_context_parallel (a module of one's own, DDP,
    torch.compile: compiled without dynamic=True after the other, in the same process, on
    purpose), tokens only one rank cannot embed, heads the all-to-all cannot split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    layout = get_layout("zigzag", world)
    found = {"dynamic_compile": _reported(lambda: _dynamic_compile_error(layout, rank))}
    base = Transformer(get_config("tiny")).eval()
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = layout.shard(base(tokens), rank, dim=1)
    batch = shard_batch(tokens, layout=layout, rank=rank)
    other = shard_batch(tokens, layout=get_layout("striped", world), rank=rank)
    last = rank == world - 1
    wrappers = dict(own=_Wrapper, ddp=DistributedDataParallel, compiled=lambda m: torch.compile(m, backend="eager"))
    for name, wrap in wrappers.items():
        model = apply_context_parallel(wrap(copy.deepcopy(base)), layout=layout)
        with torch.no_grad():
            found[name] = dict(
                exact=_reported(lambda: (model(batch.tokens, batch.positions) - want).abs().max().item()),
                forgotten=_reported(lambda: model(batch.tokens)),
                other_layout=_reported(lambda: model(other.tokens, other.positions)),
                outside_the_vocabulary_on_one_rank=_reported(lambda: model(
                    batch.tokens.clone().fill_(256) if last else batch.tokens, batch.positions)),
            )
    model = apply_context_parallel(copy.deepcopy(base), layout=layout)
    bad_tokens = dict(float=batch.tokens.float(), uint8=batch.tokens.to(torch.uint8), bool=batch.tokens > 3,
                      one_dimensional=batch.tokens[0], on_meta=batch.tokens.to("meta"))
    found["one_rank"] = {case: _reported(lambda: model(bad if last else batch.tokens, batch.positions))
                         for case, bad in bad_tokens.items()}
    found["one_rank"]["after"] = _reported(lambda: (model(batch.tokens, batch.positions) - want).abs().max().item())
    found["one_rank"]["int32"] = _reported(  # every rank's ids int32, which nn.Embedding takes: run, as int64's
        lambda: (model(batch.tokens.to(torch.int32), batch.positions) - model(batch.tokens, batch.positions)).abs()
        .max().item())
    with torch.device("meta"):
        on_meta = apply_context_parallel(Transformer(get_config("tiny")), layout=layout)
    found["meta_forward"] = _reported(lambda: on_meta(batch.tokens.to("meta"), batch.positions.to("meta")))
    odd = Transformer(dataclasses.replace(get_config("tiny"), heads=3, kv_heads=1))  # P = 2 does not divide 3
    found["alltoall_heads"] = _reported(lambda: type(apply_context_parallel(odd, layout=layout, strategy="alltoall")))
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    found["hybrid_heads"] = _reported(lambda: type(apply_context_parallel(odd, layout=layout, strategy="hybrid",
                                                                    mesh=mesh)))
    found["unchanged"] = all(m.attention_fn is causal_sdpa for m in odd.modules() if hasattr(m, "attention_fn"))
    own = _OwnModel().eval()
    with torch.no_grad():
        want = layout.shard(own(tokens), rank, dim=1)
        apply_context_parallel(own, layout=layout)
        found["wte"] = dict(
            exact=_reported(lambda: (own(batch.tokens, batch.positions) - want).abs().max().item()),
            outside_the_vocabulary_on_one_rank=_reported(lambda: own(
                batch.tokens.clone().fill_(256) if last else batch.tokens, batch.positions)))
    for attend in ("sdpa", "multihead"):  # after a forward refused, the next is refused too
        own = apply_context_parallel(_AttendsOutsideAttentionFn(attend), layout=layout)
        found[f"attends outside attention_fn, {attend}"] = [
            _reported(lambda: own(batch.tokens, batch.positions)) for _ in range(2)]
    features, own = torch.randn(1, 16, 8), _FeatureModel()
    with torch.no_grad():
        want = layout.shard(own(features), rank, dim=2)
        apply_context_parallel(own, layout=layout)
        found["features"] = _reported(lambda: (own(layout.shard(features, rank, dim=1), layout.positions(16, rank))
                                               - want).abs().max().item())
    return found


spawned.declare("parallelize_wrapped", _wrapped_cases, 2, timeout_s=60)


def wrapped_results() -> list[dict]:
    return spawned.results("parallelize_wrapped")


@pytest.mark.parametrize("wrapper", ["own", "ddp", "compiled"])
def test_a_wrapped_model_is_guarded_as_the_model_is(wrapper: str) -> None:
    """apply_context_parallel guarded the root module alone, and only where its forward took
    positions: wrapped (a module of one's own, DDP, torch.compile), the inner model ran CP
    attention unguarded. Forgotten positions gave a relative error of 0.0078, another
    layout's shards 1.1, silently; a token outside the vocabulary on one rank left the other
    waiting until the timeout."""
    for rank, res in enumerate(wrapped_results()):
        r = res[wrapper]
        assert isinstance(r["exact"], float) and r["exact"] < 1e-5, (rank, r["exact"])
        assert "Transformer got no positions under context parallelism" in r["forgotten"], (rank, r["forgotten"])
        assert f"global positions of group rank {rank} (dist.get_rank(group)) under the zigzag layout" in \
            r["other_layout"], (rank, r["other_layout"])
        want = "outside its vocabulary of 256" if rank == 1 else "rejected their forward inputs"
        assert want in r["outside_the_vocabulary_on_one_rank"], (rank, r["outside_the_vocabulary_on_one_rank"])


def test_torch_compile_with_dynamic_shapes_runs_exactly_and_so_does_a_model_compiled_after_it() -> None:
    """dynamic=True: the consistency check once made dynamo recurse packing the symbolic scale (a
    2,660-line traceback); it runs eagerly. The model compiled without dynamic=True after it, in
    the same process (``[compiled]`` above: exact), raised "'NoneType' object has no attribute
    'item'" (torch 2.13): ctxpar's input checks, compiled for the first call with the head dim
    symbolic, were reused for it; they run eagerly too."""
    for rank, res in enumerate(wrapped_results()):
        assert isinstance(res["dynamic_compile"], float) and res["dynamic_compile"] < 1e-5, (rank, res)
        assert isinstance(res["compiled"]["exact"], float), (rank, res["compiled"]["exact"])


def test_tokens_one_rank_cannot_embed_are_refused_on_every_rank() -> None:
    """Float, uint8 or bool tokens, or tokens on another device, passed the range check and
    raised in the embedding on that rank alone, the other waiting until the timeout; 1-D
    tokens raised IndexError. A model on the meta device raised Tensor.item() from the guard.
    int32 ids, which the embedding takes, run as int64's (once refused: "as int64 or int32, got
    torch.int32")."""
    wants = dict(float="takes token ids as int64 or int32, got torch.float32",
                 uint8="takes token ids as int64 or int32, got torch.uint8",
                 bool="takes token ids as int64 or int32, got torch.bool",
                 one_dimensional="takes this rank's tokens as a (B, T/P) tensor", on_meta="got tokens on meta")
    for rank, res in enumerate(wrapped_results()):
        for case, want in wants.items():
            got = res["one_rank"][case]
            assert (want if rank == 1 else "ranks [1] of the CP group rejected their forward inputs") in got, (
                rank, case, got)
        assert res["one_rank"]["after"] < 1e-5
        assert res["one_rank"]["int32"] == 0.0, (rank, res["one_rank"]["int32"])
        assert "the tensors are on meta; move them to the CPU" in res["meta_forward"], (rank, res["meta_forward"])


def test_a_model_of_ones_own_checks_its_tokens_against_its_one_embedding_whatever_its_name() -> None:
    """The range check looked for an nn.Embedding named embed: a model of one's own embedding
    with wte raised IndexError on the rank holding an id outside the vocabulary, its peer
    failing with 'Connection closed by peer'."""
    for rank, res in enumerate(wrapped_results()):
        r = res["wte"]
        assert isinstance(r["exact"], float) and r["exact"] < 1e-5, (rank, r["exact"])
        want = "_OwnModel got token ids from 256 to 256, outside its vocabulary of 256" if rank == 1 else (
            "ranks [1] of the CP group rejected their forward inputs")
        assert want in r["outside_the_vocabulary_on_one_rank"], (rank, r["outside_the_vocabulary_on_one_rank"])


@pytest.mark.parametrize("attend, call", [("sdpa", "scaled_dot_product_attention"),
                                          ("multihead", "multi_head_attention_forward")])
def test_attention_outside_the_attention_fn_is_refused_on_every_rank(attend: str, call: str) -> None:
    """A model of one's own mixing attention_fn with attention it runs itself (a layer calling
    F.scaled_dot_product_attention, an nn.MultiheadAttention) trained silently wrong: those
    layers attended within each rank's shard (loss 1e-3 off, gradients 70-130%)."""
    for res in wrapped_results():
        for message in res[f"attends outside attention_fn, {attend}"]:
            assert message.startswith(f"ValueError: _AttendsOutsideAttentionFn calls torch.nn.functional.{call} "
                                      f"itself, outside the attention_fn that apply_context_parallel replaced"), message


@pytest.mark.parametrize("model", [_NamedOtherwise, _NumbersItsOwnTokens], ids=["input_ids", "tokens_alone"])
def test_a_model_whose_forward_takes_no_tokens_and_positions_is_refused_before_it_changes(model) -> None:
    """Its forward went unguarded: position_ids forgotten, or positions numbered inside the
    forward, each shard ran as if it began the sequence, logits off by 3.5%, silently."""
    own = model()
    with pytest.raises(ValueError, match=re.escape(
            f"{model.__name__}: no module's forward around its attention takes parameters named tokens and "
            f"positions")):
        apply_context_parallel(own, layout=get_layout("zigzag", 1))
    assert all(m.attention_fn is causal_sdpa for m in own.modules() if hasattr(m, "attention_fn"))
    assert not any(m._forward_pre_hooks for m in own.modules())


def test_a_model_of_ones_own_whose_tokens_are_features_runs() -> None:
    """The guard refused every forward of it: 'takes this rank's tokens as a (B, T/P) tensor,
    got (1, 8, 8)', checks meant for the reference model's token ids."""
    for rank, res in enumerate(wrapped_results()):
        assert isinstance(res["features"], float) and res["features"] < 1e-6, (rank, res["features"])


def test_the_installed_attention_fn_takes_documents_as_causal_sdpa_does() -> None:
    """attention_fn(q, k, v, documents), as causal_sdpa takes it, raised "attention() takes 3
    positional arguments but 4 were given"."""
    model = apply_context_parallel(Transformer(get_config("tiny")), layout=get_layout("zigzag", 1))
    fn = model.layers[0].attention.attention_fn
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    want = causal_sdpa(q, k, v, (3, 5))
    assert torch.allclose(fn(q, k, v, (3, 5)), want) and torch.allclose(fn(q, k, v, documents=(3, 5)), want)


def test_heads_the_all_to_all_cannot_split_are_refused_when_applied() -> None:
    """They were accepted and refused at every forward."""
    for rank, res in enumerate(wrapped_results()):
        assert "strategy 'alltoall' splits the query heads H=3 (H_kv=1) over P=2" in res["alltoall_heads"], rank
        assert "strategy 'hybrid' splits the query heads H=3 (H_kv=1) over ulysses degree=2" in res["hybrid_heads"]
        assert res["unchanged"]


def test_pickling_an_applied_model_is_refused_saying_what_to_save(tmp_path) -> None:
    """torch.save(model) failed with "Can't pickle local object '_guard_positions.<locals>.check'"."""
    model = Transformer(get_config("tiny"))
    for unchecked in (False, True):  # without the guard, its attention holds the process group alike
        apply_context_parallel(model, layout=get_layout("zigzag", 1), check_consistency=not unchecked)
        for whole in (model, _Wrapper(model)):
            with pytest.raises(TypeError, match=r"cannot be pickled .* save model.state_dict\(\)"):
                torch.save(whole, tmp_path / "model.pt")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    Transformer(get_config("tiny")).load_state_dict(torch.load(tmp_path / "weights.pt"))  # single-rank evaluation
    copied = copy.deepcopy(model)
    assert copied.layers[0].attention.attention_fn is model.layers[0].attention.attention_fn


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


@pytest.mark.parametrize("settings, message", [
    (dict(strategy="rnig"), "unknown strategy 'rnig'"),
    (dict(layout="zigzga"), "unknown layout 'zigzga'"),
    (dict(layout=get_layout("zigzag", 3)), "is for P=3 ranks but torch.distributed is not initialised"),
    (dict(mesh=object()), "mesh= is for strategy='hybrid'"),
    (dict(strategy="hybrid"), "strategy='hybrid' takes mesh= .* and none was given"),
    (dict(check_consistency="no"), "check_consistency must be True or False, got 'no'"),  # once read as True
], ids=["strategy", "layout", "layout_for_another_p", "mesh_without_hybrid", "hybrid_without_mesh", "check_flag"])
def test_settings_are_refused_before_the_model_changes(settings: dict, message: str) -> None:
    """Each was accepted, the model changed, and refused only at the first forward."""
    model = Transformer(get_config("tiny"))
    before = [m.attention_fn for m in model.modules() if hasattr(m, "attention_fn")]
    with pytest.raises(ValueError, match=message):
        apply_context_parallel(model, **{"layout": "zigzag", **settings})
    assert [m.attention_fn for m in model.modules() if hasattr(m, "attention_fn")] == before


class _Encoder(torch.nn.Module):
    """A model of one's own: one attention module, its ``attention_fn(q, k, v)`` given."""

    def __init__(self, attention_fn) -> None:
        super().__init__()
        self.qkv, self.attention_fn = torch.nn.Linear(8, 24), attention_fn

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: features (B, T, 8); no RoPE, so no use for the positions."""
        q, k, v = self.qkv(tokens).view(*tokens.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        return self.attention_fn(q, k, v).transpose(1, 2).flatten(2)  # (B, T, 8)


@pytest.mark.parametrize("attention_fn, name", [
    (F.scaled_dot_product_attention, "'scaled_dot_product_attention'"),
    (functools.partial(F.scaled_dot_product_attention, is_causal=True, scale=1.0), "functools.partial"),
    # causal_sdpa's own documents= bound in a partial: accepted as causal_sdpa, it ran across the documents
    (functools.partial(causal_sdpa, documents=[4, 4]), "functools.partial"),
], ids=["bidirectional", "own_scale", "causal_sdpa_with_documents"])
def test_an_attention_fn_other_than_causal_attention_is_refused_before_the_model_changes(attention_fn,
                                                                                         name: str) -> None:
    """It was replaced by causal attention at the default scale without a word (errors up to 1.19)."""
    model = Transformer(get_config("tiny"))
    model.layers[1].attention.attention_fn = attention_fn
    before = [m.attention_fn for m in model.modules() if hasattr(m, "attention_fn")]
    with pytest.raises(ValueError, match=f"layers.1.attention's attention_fn is {name}.*, not the model's causal "
                                         f"attention.*set attention_fn = causal_sdpa"):
        apply_context_parallel(model, layout=get_layout("zigzag", 1))
    assert [m.attention_fn for m in model.modules() if hasattr(m, "attention_fn")] == before
    assert not model._forward_pre_hooks
    with pytest.raises(ValueError, match="_Encoder's attention_fn is 'scaled_dot_product_attention'"):
        apply_context_parallel(_Encoder(F.scaled_dot_product_attention), layout=get_layout("zigzag", 1))
    x = torch.randn(1, 6, 8)
    own = _Encoder(causal_sdpa)
    want = own(x)
    torch.testing.assert_close(apply_context_parallel(own, layout=get_layout("zigzag", 1))(x), want)


def test_the_guard_is_replaced_not_stacked_when_applied_again() -> None:
    model = Transformer(get_config("tiny"))
    apply_context_parallel(model, layout=get_layout("zigzag", 1))
    apply_context_parallel(model, layout=get_layout("striped", 1))
    assert len(model._forward_pre_hooks) == 1


def test_a_shard_names_the_batch_it_was_cut_from_unless_two_batches_share_it(monkeypatch) -> None:
    monkeypatch.setattr(ctxpar.parallelize, "_SHARDED", ctxpar.parallelize._ShardedLately())  # none of other tests'
    layout = get_layout("zigzag", 2)
    first = torch.arange(16).reshape(1, 16) + 1000
    second = first.clone()
    second[:, layout.positions(16, 1)] += 100  # rank 0's shards of the two are equal
    shards = {(name, rank): shard_batch(tokens, layout=layout, rank=rank).tokens
              for name, tokens in (("first", first), ("second", second)) for rank in (0, 1)}
    codes = {key: batch_code(shard) for key, shard in shards.items()}
    assert codes[("first", 0)] == codes[("second", 0)] == -1  # names neither batch
    assert codes[("first", 1)] != codes[("second", 1)] and min(codes[("first", 1)], codes[("second", 1)]) >= 0
    shard = shard_batch(first, layout=layout, rank=1).tokens
    assert batch_code(shard.clone().to(torch.int32)) == codes[("first", 1)]  # moved or cast: the same values
    relabelled = shard_batch(first + 1, layout=layout, rank=1, labels=torch.zeros_like(first))
    assert batch_code(relabelled.tokens) not in (-1, batch_code(shard_batch(first + 2, layout=layout, rank=1).tokens))
    assert batch_code(torch.full((1, 8), 7)) == -1  # never sharded here
    assert batch_code(shard.float()) == batch_code(None) == -1


def test_the_config_and_weights_checksums_are_alike_in_every_process_and_skip_sharded_parameters() -> None:
    """A config value's repr may hold an address (an object) or the hash seed's order (a set),
    which differ between processes: a refusal of ranks holding one model. FSDP1's parameters
    are each rank's flat shard: "other weights" on every step of a correct run."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ctxpar.parallelize import _computed, model_code, weights_code

    assert _computed({"a": {3, 1, 2}, "b": object(), "c": {"_name_or_path": "/node/1", "k": (1, None)}}) == [
        ("a", [1, 2, 3]), ("b", "object"), ("c", [("k", [1, None])])]
    model = Transformer(get_config("tiny"))
    same = copy.deepcopy(model)
    with torch.no_grad():  # a parameter held transposed: its first row read as a view, alike
        same.embed.weight = torch.nn.Parameter(model.embed.weight.detach().t().contiguous().t())
    assert weights_code(same) == weights_code(model) != -1
    with torch.no_grad():
        same.embed.weight[0, 0] += 1
    assert weights_code(same) != weights_code(model)
    frozen = copy.deepcopy(model)
    frozen.embed.requires_grad_(False)  # a frozen part (LoRA-style) is compared too
    changed = copy.deepcopy(frozen)
    with torch.no_grad():
        changed.embed.weight[0, 1] += 1
    assert weights_code(changed) != weights_code(frozen) == weights_code(model)
    unit = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # an FSDP1 unit, without a process group
    torch.nn.Module.__init__(unit)
    wrapped = _Wrapped(same)
    wrapped.unit = unit
    assert weights_code(wrapped) == -1
    wider = _Wrapped(Transformer(get_config("tiny").with_(vocab=300)))
    assert model_code(wider) != model_code(_Wrapped(same))  # a module of one's own: its parameters' shapes
    wider.unit = unit
    assert model_code(wider) == model_code(wrapped)  # left out under FSDP1, whose flat shards differ by rank


def test_attention_modules_finds_an_attention_fn_however_it_is_held() -> None:
    """``has_attention_fn`` (hasattr without Module.__getattr__'s raised AttributeError, which
    made a tenth of a decode step) finds what hasattr finds: an instance attribute, a module
    held as one, a class attribute; and nothing on a module without one."""
    from ctxpar.parallelize import attention_modules, has_attention_fn

    class OnTheClass(torch.nn.Module):
        attention_fn = staticmethod(causal_sdpa)

    class AsAModule(torch.nn.Module):
        def forward(self, q, k, v):
            return causal_sdpa(q, k, v)

    holder = torch.nn.Module()
    holder.attention_fn = AsAModule()  # registered in _modules, not the instance's __dict__
    model = Transformer(dataclasses.replace(get_config("tiny"), layers=2))
    model.extra = torch.nn.ModuleList([OnTheClass(), holder, torch.nn.Linear(2, 2)])
    modules = list(model.modules())
    assert [has_attention_fn(m) for m in modules] == [hasattr(m, "attention_fn") for m in modules]
    assert attention_modules(model) == [m for m in modules if hasattr(m, "attention_fn")]
    assert len(attention_modules(model)) == 2 + 2  # the two layers', then the class's and the held module's
