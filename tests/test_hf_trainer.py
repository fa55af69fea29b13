"""transformers' Trainer under CP (``ContextParallelTrainer``): the losses logged, gradient
norms, learning rates, trained weights and evaluation loss of Trainer without CP, computed
here in float64 from the batches each data-parallel replica was dealt."""

from __future__ import annotations

import os
import tempfile
import traceback
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import spawned
from hf_families import tiny_llama

WORLD = 4
SEQ = 16
PACKING = (5, 7, 4)  # the documents of a packed row
STEPS, ACCUMULATE, BATCH, LR = 2, 2, 2, 0.5
TRAIN_EXAMPLES, EVAL_EXAMPLES = 20, 7  # 7: the last evaluation batch is cut (and padded on a second replica)
# what torchrun gives each process, which accelerate reads to see the processes
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
MESH = "dp 2 x (ring 1, ulysses 2)"  # 2 replicas, each a hybrid mesh
STRIDED = ((0, 2), (1, 3))  # 2 replicas of CP 2: replica 0 is ranks 0 and 2, replica 1 ranks 1 and 3


class Run(NamedTuple):
    groups: tuple | str | None  # the CP groups (None: WORLD), or MESH
    strategy: str
    layout: str
    max_grad_norm: float = 100.0  # never reached, but 1
    average: bool = True  # average_tokens_across_devices
    checkpointing: bool = False  # gradient_checkpointing
    packing: tuple[int, ...] | None = None  # the documents each row packs (examples)


RUNS = {
    "cp4": Run(None, "ring", "zigzag", packing=(SEQ,)),
    "dp2xcp2": Run(STRIDED, "allgather", "zigzag", max_grad_norm=1.0),
    "dp2xcp2 own tokens": Run(STRIDED, "ring", "contiguous", average=False),
    "dp2 x hybrid": Run(MESH, "hybrid", "striped", checkpointing=True),
    "dp2xcp2 packed": Run(((0, 1), (2, 3)), "ring", "zigzag", packing=PACKING),
}


def examples(count: int, seed: int, packing: tuple[int, ...] | None = None) -> list[dict]:
    """Rows of SEQ tokens whose first 0-9 labels are -100 (a prompt), so that batches hold different
    numbers of labelled tokens and a mean per batch differs from the mean per token. ``packing``:
    each row packs documents of these lengths, position_ids restarting at 0 in each, the first
    label of each but the row's -100 (as DataCollatorWithFlattening gives them); (SEQ,): one
    document, position_ids 0..SEQ-1, as collators add them."""
    g = torch.Generator().manual_seed(seed)
    starts = [sum(packing[:i]) for i in range(1, len(packing))] if packing else []
    rows = []
    for _ in range(count):
        ids = torch.randint(0, 128, (SEQ,), generator=g)
        labels = ids.clone()
        labels[:int(torch.randint(0, 10, (), generator=g))] = -100  # 0: a row labelled from its first token
        rows.append(dict(input_ids=ids, labels=labels))
        if packing:
            labels[starts] = -100
            rows[-1]["position_ids"] = torch.cat([torch.arange(n) for n in packing])
    return rows


def _arguments(output_dir: str, **changes):
    from transformers import TrainingArguments

    settings = dict(use_cpu=True, report_to=[], save_strategy="no", max_steps=STEPS, per_device_train_batch_size=BATCH,
                    per_device_eval_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATE, logging_steps=1,
                    optim="sgd", learning_rate=LR, max_grad_norm=100.0, disable_tqdm=True, seed=0,
                    include_num_input_tokens_seen="all")
    return TrainingArguments(output_dir=output_dir, **{**settings, **changes})


def _train(rank: int, world: int, run: str, output_dir: str) -> dict:
    from ctxpar.integrations.transformers import enable_context_parallel

    from torch.distributed.device_mesh import init_device_mesh

    groups = RUNS[run].groups
    group = mesh = None
    if groups == MESH:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "ring", "ulysses"))["ring", "ulysses"]
    elif groups is not None:
        group = _cp_group(rank, groups)
    seen = {True: [], False: []}  # the batches compute_loss was given, training and evaluating
    model = enable_context_parallel(tiny_llama(), layout=RUNS[run].layout, group=group, mesh=mesh,
                                    strategy=RUNS[run].strategy)
    args = _arguments(output_dir, max_grad_norm=RUNS[run].max_grad_norm,
                      average_tokens_across_devices=RUNS[run].average, gradient_checkpointing=RUNS[run].checkpointing)
    trainer = _recording(seen)(model=model, args=args, train_dataset=examples(TRAIN_EXAMPLES, 1, RUNS[run].packing))
    trainer.train()
    evaluated = trainer.evaluate(examples(EVAL_EXAMPLES, 2, RUNS[run].packing))
    evaluation = list(seen[False])  # predict's batches are the same
    predicted = trainer.predict(examples(EVAL_EXAMPLES, 2, RUNS[run].packing))
    return dict(logs=[log for log in trainer.state.log_history if "loss" in log], eval_loss=evaluated["eval_loss"],
                weights=_weights(model), train=seen[True], eval=evaluation, replica=trainer._replica,
                flos=trainer.state.total_flos, checkpointing=model.is_gradient_checkpointing,
                predictions=torch.from_numpy(predicted.predictions), test_loss=predicted.metrics["test_loss"],
                # the rank Trainer's seed function seeds the loader's workers by
                worker_seed_rank=trainer.get_train_dataloader().base_dataloader.worker_init_fn.keywords["rank"])


def _recording(seen: dict[bool, list]):
    """ContextParallelTrainer recording the batches compute_loss is given in ``seen[model.training]``:
    (input_ids, labels, position_ids or None)."""
    from ctxpar.integrations.transformers import ContextParallelTrainer

    class Recording(ContextParallelTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen[model.training].append((inputs["input_ids"].clone(), inputs["labels"].clone(),
                                         inputs.get("position_ids")))
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def _cp_group(rank: int, groups: tuple[tuple[int, ...], ...]) -> dist.ProcessGroup | None:
    """This rank's group of ``groups``, none where it is in none: every rank makes every group."""
    mine = None
    for ranks in groups:
        made = dist.new_group(list(ranks))
        mine = made if rank in ranks else mine
    return mine


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _resumed(rank: int, world: int, output_dir: str) -> dict:
    """Two steps of AdamW (Trainer's default) over 2 replicas of CP 2, and again, resumed from the
    checkpoint saved after the first (mid-epoch: the deal over the replicas resumed too)."""
    from ctxpar.integrations.transformers import ContextParallelTrainer, enable_context_parallel

    shared = [output_dir]
    dist.broadcast_object_list(shared, src=0)  # Trainer saves where every rank reads, as on a shared file system

    group = _cp_group(rank, STRIDED)

    def trainer():
        args = _arguments(shared[0], optim="adamw_torch", learning_rate=1e-2, save_strategy="steps", save_steps=1)
        model = enable_context_parallel(tiny_llama(), layout="zigzag", group=group)
        return ContextParallelTrainer(model=model, args=args, train_dataset=examples(TRAIN_EXAMPLES, 1))

    whole, resumed = trainer(), trainer()
    whole.train()
    resumed.train(resume_from_checkpoint=os.path.join(shared[0], "checkpoint-1"))
    return dict(whole=_weights(whole.model), resumed=_weights(resumed.model), logs=[
        [log["loss"] for log in t.state.log_history if "loss" in log] for t in (whole, resumed)])


def _hidden_states(output_dir: str) -> tuple[torch.Tensor, ...]:
    """predict()'s outputs of a model returning its hidden states too: logits, then one (B, T, d)
    per layer and the embeddings', each put back in sequence order."""
    from ctxpar.integrations.transformers import ContextParallelTrainer, enable_context_parallel

    model = enable_context_parallel(tiny_llama(), layout="zigzag")
    model.config.output_hidden_states = True
    logits, hidden = ContextParallelTrainer(model=model, args=_arguments(output_dir)).predict(
        examples(EVAL_EXAMPLES, 2)).predictions
    return (torch.from_numpy(logits), *map(torch.from_numpy, hidden))


class RandomRows(torch.utils.data.Dataset):
    """Rows drawn anew at each read, from the loader worker's random state (as a random crop of a
    long text is)."""

    def __len__(self) -> int:
        return TRAIN_EXAMPLES

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(0, 128, (SEQ,))
        return dict(input_ids=ids, labels=ids.clone())


def _drawn_by_workers(rank: int, world: int, output_dir: str) -> list[torch.Tensor] | str:
    """The batches a run of 2 replicas of CP 2 drew from ``RandomRows`` in a loader worker per
    rank, or what it raised: a replica's ranks must draw alike (or the forward refuses their
    shards, as of different batches)."""
    from ctxpar.integrations.transformers import enable_context_parallel

    seen = {True: [], False: []}
    model = enable_context_parallel(tiny_llama(), layout="zigzag", group=_cp_group(rank, ((0, 1), (2, 3))))
    try:
        _recording(seen)(model=model, args=_arguments(output_dir, max_steps=1, dataloader_num_workers=1),
                         train_dataset=RandomRows()).train()
    except Exception:  # noqa: BLE001  reported by its test
        return f"rank {rank} raised\n{traceback.format_exc()}"
    return [ids for ids, _, _ in seen[True]]


def _refusal(fn) -> str:
    """What ``fn()`` raised (a ValueError), or "no error"."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _trainer_without_launch_variables(output_dir: str):
    from ctxpar.integrations.transformers import ContextParallelTrainer, enable_context_parallel

    return ContextParallelTrainer(model=enable_context_parallel(tiny_llama(), layout="zigzag"),
                                  args=_arguments(output_dir), train_dataset=examples(4, 3))


def _refusals(rank: int, world: int, output_dir: str) -> dict:
    from transformers import Trainer

    from ctxpar.integrations.transformers import ContextParallelTrainer, enable_context_parallel

    data = examples(4, 3)
    enabled = enable_context_parallel(tiny_llama(), layout="zigzag")
    padded = [dict(row, attention_mask=torch.ones(SEQ, dtype=torch.int64)) for row in data]
    padded[0]["attention_mask"][-2:] = 0
    extra = [dict(row, special_tokens_mask=torch.zeros(SEQ, dtype=torch.int64)) for row in data]
    unlabelled = [dict(input_ids=row["input_ids"]) for row in data]
    packed = examples(4, 3, PACKING)
    packed_apart = [dict(row, position_ids=torch.arange(SEQ)) if i == 1 else row for i, row in enumerate(packed)]
    shifted = [dict(row, position_ids=row["position_ids"] + 1) for row in packed]
    counting_on = [dict(row, position_ids=torch.tensor([0, 1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]))
                   for row in packed]
    labelled_start = [dict(row, labels=row["input_ids"]) for row in packed]
    positions_3d = [dict(row, position_ids=torch.arange(SEQ).expand(3, SEQ)) for row in data]  # (3, T): mrope's
    routed = enable_context_parallel(tiny_llama(), layout="zigzag")
    routed.config.output_router_logits = True
    # 2 replicas of CP 2: the 4 rows of a step's first micro-batches, 2 on each
    on_replicas = enable_context_parallel(tiny_llama(), layout="zigzag", group=_cp_group(rank, STRIDED))
    pair = dist.new_group([0, 1])  # ranks 0 and 1 in a CP group of 2, ranks 2 and 3 in WORLD's of 4
    two_sizes = enable_context_parallel(tiny_llama(), layout="zigzag", group=pair if rank < 2 else None)
    # each group of 2, led by rank 0 or 1, but ranks 2 and 3 in different groups led by 1, which is in neither
    made = [dist.new_group(list(ranks)) for ranks in ((0, 1), (1, 2), (1, 3))]
    crossing = enable_context_parallel(tiny_llama(), layout="zigzag", group=made[0] if rank < 2 else made[rank - 1])
    one_out_of_vocabulary = [dict(row) for row in data]
    one_out_of_vocabulary[0]["labels"] = torch.full((SEQ,), 500)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data)

    def train(dataset, model=enabled, **changes):
        args = _arguments(output_dir, **changes)
        return ContextParallelTrainer(model=model, args=args, train_dataset=dataset).train()

    return {
        "not enabled": _refusal(lambda: train(data, model=tiny_llama())),
        "label smoothing": _refusal(lambda: train(data, label_smoothing_factor=0.1)),
        "compute_loss_func": _refusal(lambda: ContextParallelTrainer(model=enabled, args=_arguments(output_dir),
                                                                    compute_loss_func=lambda *a, **k: 0)),
        "padding": _refusal(lambda: train(padded)),
        "extra key": _refusal(lambda: train(extra, remove_unused_columns=False)),
        "no labels": _refusal(lambda: train(unlabelled)),
        "iterable dataset": _refusal(lambda: train(Stream())),
        "packed rows apart": _refusal(lambda: train(packed_apart)),
        "packed from 1": _refusal(lambda: train(shifted)),
        "packed counting on": _refusal(lambda: train(counting_on)),
        "document start labelled": _refusal(lambda: train(labelled_start)),
        "position_ids not (B, T)": _refusal(lambda: train(positions_3d)),
        "router logits": _refusal(lambda: train(data, model=routed)),
        "batch rebalance": _refusal(lambda: train(data, train_sampling_strategy="batch_rebalance")),
        "neftune": _refusal(lambda: train(data, neftune_noise_alpha=5.0)),
        "dispatch batches": _refusal(lambda: train(data, accelerator_config={"dispatch_batches": True})),
        "model_init": _refusal(lambda: ContextParallelTrainer(model_init=lambda: enabled, args=_arguments(output_dir))),
        "evaluate without labels": _refusal(lambda: ContextParallelTrainer(
            model=enabled, args=_arguments(output_dir)).evaluate(unlabelled)),
        "groups of two sizes": _refusal(lambda: train(data, model=two_sizes)),
        "groups crossing": _refusal(lambda: train(data, model=crossing)),
        "output not per token": _refusal(lambda: ContextParallelTrainer(
            model=enabled, args=_arguments(output_dir))._whole(torch.zeros(2), BATCH, SEQ)),
        # (B * T/P, E) as a MoE's router logits, whose E * P is T here
        "output flattened over tokens": _refusal(lambda: ContextParallelTrainer(
            model=enabled, args=_arguments(output_dir))._whole(torch.zeros(BATCH * SEQ // world, world), BATCH, SEQ)),
        # one replica's batch refused: the other's ranks hear it, not wait for it (in DDP's broadcast or all-reduce)
        "padding on one replica": _refusal(lambda: train(padded, model=on_replicas)),
        "label out of vocabulary on one replica": _refusal(lambda: train(one_out_of_vocabulary, model=on_replicas)),
        # the plain Trainer on the enabled model: its num_items_in_batch= is refused
        "plain Trainer": _refusal(lambda: Trainer(model=enabled, args=_arguments(output_dir),
                                                 train_dataset=data).train()),
    }


def run(rank: int, world: int) -> dict:
    import warnings

    from accelerate.state import AcceleratorState
    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    saved = {key: os.environ.pop(key, None) for key in LAUNCH_VARS}
    out = {}
    try:
        with tempfile.TemporaryDirectory() as output_dir:  # Trainer's, where nothing is saved (save_strategy="no")
            # first without the variables, which accelerate reads once (then afresh): it sees one process
            AcceleratorState._reset_state(reset_partial_state=True)
            unseen = _refusal(lambda: _trainer_without_launch_variables(output_dir))
            AcceleratorState._reset_state(reset_partial_state=True)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                              OMP_NUM_THREADS=str(torch.get_num_threads()))
            for name in RUNS:
                try:
                    out[name] = _train(rank, world, name, output_dir)
                except Exception:  # noqa: BLE001  reported by its own test
                    out[name] = f"rank {rank} raised\n{traceback.format_exc()}"
            out["refusals"] = {**_refusals(rank, world, output_dir), "no torchrun variables": unseen}
            out["resumed"] = _resumed(rank, world, output_dir)
            out["hidden"] = _hidden_states(output_dir)
            out["drawn by workers"] = _drawn_by_workers(rank, world, output_dir)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the group's later batches: no accelerate state
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out


spawned.declare("hf_trainer", run, WORLD, timeout_s=60)


def _logits(model, ids: torch.Tensor, positions: torch.Tensor | None) -> list[tuple[int, int, torch.Tensor]]:
    """(start, end, logits) of each document of a batch, unsplit: a packed batch's documents each a
    sequence of its own, else the whole rows."""
    starts = [0] if positions is None else (positions[0] == 0).nonzero().flatten().tolist()
    return [(a, b, model(input_ids=ids[:, a:b], use_cache=False).logits)
            for a, b in zip(starts, starts[1:] + [ids.shape[1]])]


def _token_sum(model, batch) -> tuple[torch.Tensor, int]:
    """The summed next-token loss of a batch and its number of labelled targets, unsplit."""
    ids, labels, positions = batch
    total, count = 0, 0
    for a, b, logits in _logits(model, ids, positions):
        targets = labels[:, a + 1:b]
        total = total + F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                                        reduction="sum")
        count += int((targets != -100).sum())
    assert count == int((labels[:, 1:] != -100).sum())  # Trainer's count: a document's first label is -100
    return total, count


def _reference(run: str, dealt: list[list]) -> dict:
    """What Trainer without CP computes, one process per replica: ``dealt[r]`` the micro-batches
    replica r was given, in order. float64, SGD on a linear schedule, clipped at max_grad_norm."""
    model = tiny_llama().double()
    model.set_attn_implementation("sdpa")
    params = list(model.parameters())
    logs = []
    for step in range(STEPS):
        micro = [replica[step * ACCUMULATE:(step + 1) * ACCUMULATE] for replica in dealt]
        sums = [[_token_sum(model, batch) for batch in replica] for replica in micro]
        if RUNS[run].average:  # each token's loss over every replica's tokens of the step
            total = sum(n for replica in sums for _, n in replica)
            loss = sum(s for replica in sums for s, _ in replica) / total
        else:  # each replica's mean over its own tokens, the replicas' means averaged (DDP)
            loss = sum(sum(s for s, _ in replica) / sum(n for _, n in replica) for replica in sums) / len(sums)
        grads = torch.autograd.grad(loss, params)
        norm = torch.cat([g.flatten() for g in grads]).norm()
        lr = LR * (STEPS - step) / STEPS
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * min(1.0, RUNS[run].max_grad_norm / (float(norm) + 1e-6)) * g
        logs.append(dict(loss=loss.item(), grad_norm=norm.item(), learning_rate=lr))
    return dict(logs=logs, weights=_weights(model), model=model)


def _eval_reference(run: str, dealt: list[list], model) -> float:
    """Trainer's evaluation loss without CP, of the trained ``model``: per step, each replica's
    batch loss (its token sum over the step's labelled tokens, times the replicas, where they are
    averaged), one value per row, the padding rows of the last step dropped, the rows' mean."""
    rows = []
    with torch.no_grad():
        for step in zip(*dealt):
            sums = [_token_sum(model, batch) for batch in step]
            total = sum(n for _, n in sums)
            for (s, n), batch in zip(sums, step):
                value = s / total * len(step) if RUNS[run].average else s / n
                rows += [value.item()] * batch[0].shape[0]
    return sum(rows[:EVAL_EXAMPLES]) / EVAL_EXAMPLES


# the rows of each evaluation batch, per replica, as Trainer deals them without CP to R processes: in one, the
# last batch short; over 2, batch k to replica k mod 2, the last one padded with the first row (accelerate's even
# batches, whose padding evaluation's gather drops)
EVAL_DEAL = {1: [[[0, 1], [2, 3], [4, 5], [6]]], 2: [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawned.results("hf_trainer")


@pytest.mark.parametrize("run", list(RUNS))
def test_trainer_matches_trainer_without_cp(ranks, run):
    results = [r[run] for r in ranks]
    for result in results:
        assert not isinstance(result, str), result
    replicas = sorted({r["replica"] for r in results})
    dealt = {part: [next(r[part] for r in results if r["replica"] == k) for k in replicas]
             for part in ("train", "eval")}
    for result in results:  # every CP rank of a replica: its whole batches
        for part in ("train", "eval"):
            mine = dealt[part][result["replica"]]
            assert len(result[part]) == len(mine)
            assert all(all(x is y or torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(result[part], mine))
    # the epoch's examples dealt once each (STEPS * ACCUMULATE * BATCH rows of each replica's fit in it)
    trained = [tuple(row) for replica in dealt["train"] for batch in replica for row in batch[0].tolist()]
    assert len(trained) == len(set(trained)) == STEPS * ACCUMULATE * BATCH * len(replicas) <= TRAIN_EXAMPLES
    rows = examples(EVAL_EXAMPLES, 2, RUNS[run].packing)
    for replica, batches in enumerate(EVAL_DEAL[len(replicas)]):  # evaluation's batches: Trainer's without CP
        assert [batch[0].tolist() for batch in dealt["eval"][replica]] == \
            [[rows[i]["input_ids"].tolist() for i in batch] for batch in batches]
    want = _reference(run, dealt["train"])
    if RUNS[run].max_grad_norm < 100:  # clipped indeed
        assert want["logs"][0]["grad_norm"] > RUNS[run].max_grad_norm
    moved = (want["weights"] - _weights(tiny_llama().double())).abs().max()
    flops = 6 * tiny_llama().num_parameters(exclude_embeddings=True)  # per token: Trainer's rule
    eval_loss = _eval_reference(run, dealt["eval"], want["model"])
    with torch.no_grad():  # predict()'s logits: the evaluation rows' in order, each row's whole sequence
        ids = torch.stack([row["input_ids"] for row in rows])
        positions = torch.stack([row["position_ids"] for row in rows]) if RUNS[run].packing else None
        logits = torch.cat([piece for _, _, piece in _logits(want["model"], ids, positions)], dim=1)
    for result in results:
        assert result["checkpointing"] == RUNS[run].checkpointing
        assert len(result["logs"]) == STEPS
        for got, expected in zip(result["logs"], want["logs"]):
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
            assert got["learning_rate"] == pytest.approx(expected["learning_rate"])
        assert result["worker_seed_rank"] == result["replica"]  # a random dataset's draws alike on a replica's ranks
        tokens = STEPS * ACCUMULATE * BATCH * SEQ * len(replicas)
        assert result["logs"][-1]["num_input_tokens_seen"] == tokens
        assert result["flos"] == flops * tokens
        assert (result["weights"].double() - want["weights"]).abs().max() < 1e-4 * moved
        assert result["eval_loss"] == pytest.approx(eval_loss, rel=1e-5)
        assert result["test_loss"] == pytest.approx(eval_loss, rel=1e-5)
        assert result["predictions"].shape == logits.shape
        assert (result["predictions"].double() - logits).abs().max() < 1e-4 * logits.abs().max()


REFUSED = {
    "not enabled": "enable it",
    "label smoothing": "label_smoothing_factor=0.1",
    "compute_loss_func": "does not support compute_loss_func=",
    "padding": "padding masks are not supported",
    "extra key": "batch keys ['special_tokens_mask']",
    "no labels": "needs labels in the batch",
    "iterable dataset": "use a dataset with a length",
    "packed rows apart": "whose rows pack different documents",
    "packed from 1": "position_ids starting at 1",
    "packed counting on": "do not count 0, 1, 2, ... within each document",
    "document start labelled": "a label on the first token of a packed document",
    "position_ids not (B, T)": "position_ids must be (B, T), one per token",
    "router logits": "output_router_logits=True",
    "batch rebalance": "train_sampling_strategy='batch_rebalance'",
    "neftune": "neftune_noise_alpha=5.0",
    "dispatch batches": "dispatch_batches=True",
    "model_init": "(model_init=, a model made anew for each trial, is not supported)",
    "evaluate without labels": "needs labels in the batch",
    "groups of two sizes": "do not split WORLD into replicas of one size",
    "groups crossing": "do not split WORLD into replicas of one size",
    "output not per token": "cannot put the model's output (2,) back in sequence order",
    "output flattened over tokens": "cannot put the model's output (8, 4) back in sequence order",
    "no torchrun variables": "accelerate sees 1 process(es) where torch.distributed has 4",
    "plain Trainer": "num_items_in_batch= is not supported",
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_trainer_cannot_train_exactly_is_refused_on_every_rank(ranks, case):
    for result in ranks:
        assert REFUSED[case] in result["refusals"][case]


def test_a_run_resumed_from_its_checkpoint_trains_the_same_bits(ranks):
    for result in ranks:
        assert torch.equal(result["resumed"]["whole"], result["resumed"]["resumed"])
        whole, resumed = result["resumed"]["logs"]
        assert len(whole) == STEPS and whole == resumed


ONE_REPLICA_REFUSED = {
    "padding on one replica": ("padding masks are not supported", "rejected their ContextParallelTrainer batch"),
    "label out of vocabulary on one replica": ("labels= got token ids",
                                               "rejected their ContextParallelTrainer forward"),
}


@pytest.mark.parametrize("case", list(ONE_REPLICA_REFUSED))
def test_a_refusal_on_one_replica_reaches_every_rank(ranks, case):
    refused, heard = ONE_REPLICA_REFUSED[case]
    messages = [result["refusals"][case] for result in ranks]
    assert sum(refused in m for m in messages) == 2 and sum(heard in m for m in messages) == 2, messages


def test_a_random_dataset_read_by_loader_workers_gives_a_replica_one_batch(ranks):
    """Workers seeded by replica, not by rank: each CP rank's worker draws the batch its replica's
    other ranks draw, and the two replicas draw different ones."""
    drawn = [result["drawn by workers"] for result in ranks]
    assert not any(isinstance(d, str) for d in drawn), next(d for d in drawn if isinstance(d, str))
    assert len(drawn[0]) == ACCUMULATE
    for a, b in ((0, 1), (2, 3)):
        assert all(torch.equal(x, y) for x, y in zip(drawn[a], drawn[b]))
    assert not torch.equal(drawn[0][0], drawn[2][0])


def test_predictions_hold_every_output_of_the_sequence_in_order(ranks):
    rows = examples(EVAL_EXAMPLES, 2)
    with torch.no_grad():
        want = tiny_llama()(input_ids=torch.stack([row["input_ids"] for row in rows]), use_cache=False,
                            output_hidden_states=True)
    for result in ranks:
        got = result["hidden"]
        assert len(got) == 1 + len(want.hidden_states)
        for mine, theirs in zip(got, (want.logits, *want.hidden_states)):
            assert mine.shape == theirs.shape
            assert (mine - theirs).abs().max() < 1e-4 * theirs.abs().max()
