"""``ctxpar train``: train the reference model with CP (and FSDP2 data parallelism).

Ranks form a 2D mesh ("dp", "cp"), or ("dp", "ring", "ulysses") for the hybrid strategy:
each data-parallel group of ``cp`` ranks splits its sequences with the layout; FSDP2
shards parameters, gradients and optimizer state over all dp x cp ranks. The loss is the
token-weighted mean over the whole global batch, so the run computes what single-process
training on that batch computes, which ``--compare`` checks by training the same model
that way with the same seed and data: step 1's gradients and the first losses must agree.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import ctxpar
from ctxpar import agreement, checkpoint, limits, profile, strategy_rules, topology
from ctxpar.attention import is_dtensor
from ctxpar.data import RecallTask
from ctxpar import launch
from ctxpar.models import Transformer, get_config
from ctxpar.parallelize import apply_context_parallel, cp_loss, shard_batch, shift_labels

TRAIN_STRATEGIES = strategy_rules.CALL_STRATEGIES  # auto: ctxpar.auto picks per call
ADAM_BETAS = (0.9, 0.95)
# --compare's verdict on a run from step 0: step 1's gradients, each parameter's within GRADIENT_RTOL of
# the reference's (|g - g_ref| / |g_ref|, Frobenius norms), and the first JUDGED_STEPS losses (the
# forward on the same weights, then one update) within LOSS_RTOL of the reference's. The gradients
# are what shows wrong attention: at initialisation the loss barely depends on it (attention at
# twice the scale moved step 1's loss by 4.7e-6 of it, its wk gradient by 100%; a window of 120 at
# --seq 128, 9e-6 and 2.4e-2), while exact fp32 runs (ring, allgather, alltoall, hybrid, auto,
# dp 2 x cp 2, 2 to 4 ranks, --seq 120 to 2048, tiny and small) differ by at most 6e-7. Later steps' losses are
# shown, not judged: training amplifies float32 summation order (CP vs unsplit) step by step, to
# 5e-2 within 60 steps at --lr 0.01 on 4 ranks, while step 1 differs by about 5e-7; nor are
# post-AdamW parameters, whose update flips with the sign of a gradient near 0
LOSS_RTOL, JUDGED_STEPS, GRADIENT_RTOL = 1e-4, 2, 1e-4
OWN_CHECKPOINTS = "train: this launch saves to"  # + the directory: a torchrun launch mark (launch.mark_launch)


@dataclass(frozen=True)
class TrainConfig:
    nproc: int = 4
    dp: int = 1  # data-parallel degree; the CP degree is nproc / dp
    seq: int = 2048
    batch: int = 1  # sequences per data-parallel group per step
    steps: int = 20
    lr: float = 3e-3
    model: str = "tiny"
    strategy: str = "ring"
    ulysses_degree: int | None = None  # hybrid only; its ring degree is the CP degree / ulysses_degree
    layout: str = "zigzag"
    seed: int = 0
    activation_checkpointing: bool = False
    compare: bool = False
    checkpoint_dir: str | None = None  # given: the last step is always saved there
    save_every: int = 0  # steps between checkpoints besides the last (0: the last only)
    resume: bool = False  # continue from the newest verified checkpoint in checkpoint_dir
    progress: bool = True
    return_parameters: bool = False  # include the final full parameters in the report (tests)
    device: str | None = None  # "cpu" | "cuda"; None: launch.resolve_device_type's default

    def cp(self, world: int) -> int:
        return world // self.dp

    def validate(self, world: int, seq_flag: str = "--seq") -> None:
        """Refuse what ``ctxpar train`` cannot run on ``world`` ranks, naming the flag of each
        value (``seq_flag``: the flag the length came from, a benchmark's ``--short-seq``)."""
        limits.plain_values(self)
        if self.dp < 1 or world % self.dp:
            raise ValueError(f"--dp {self.dp} must be a whole number >= 1 dividing the {world} ranks (CP degree = "
                             f"ranks / dp)")
        if self.strategy not in TRAIN_STRATEGIES:
            raise ValueError(f"--strategy {self.strategy!r} is not supported by train; use one of "
                             f"{', '.join(TRAIN_STRATEGIES)}")
        for field in ("seq", "batch", "steps"):
            limits.check_count(field, getattr(self, field))
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr {self.lr} must be a positive finite learning rate, e.g. {TrainConfig.lr}")
        largest = torch.finfo(torch.float32).max * (1 - ADAM_BETAS[0])
        if self.lr > largest:  # AdamW's step size lr / (1 - beta1) must be a float32, or torch raises mid-step
            raise ValueError(f"--lr {self.lr:g} is beyond {largest:.3g}, where AdamW's first step size overflows "
                             f"float32; e.g. {TrainConfig.lr}")
        limits.check_seed(self.seed)
        cfg = get_config(self.model)
        layout = ctxpar.get_layout(self.layout, self.cp(world))
        shortest = RecallTask.shortest(RecallTask.pairs, RecallTask.queries)
        if self.seq < shortest:  # before the layout's check, whose nearest lengths may be this short
            fits = -(-shortest // layout.multiple) * layout.multiple
            raise ValueError(f"{seq_flag} {self.seq} is too short for the recall task ({RecallTask.pairs} pairs, "
                             f"{RecallTask.queries} queries): at least {shortest}, e.g. {seq_flag} {fits} (a multiple "
                             f"of {layout.multiple} for --layout {self.layout} on {self.cp(world)} CP ranks)")
        limits.check_splits(layout, self.seq, seq_flag)
        u = strategy_rules.call_ulysses_degree(self.strategy, self.cp(world), self.ulysses_degree,
                                               name="--ulysses-degree")
        strategy_rules.check_heads_split(self.strategy, cfg.heads, cfg.kv_heads, u)
        if self.save_every < 0:
            raise ValueError(f"--save-every {self.save_every} must be >= 0 (steps between checkpoints; 0: the last "
                             "step only)")
        if self.checkpoint_dir is not None and not self.checkpoint_dir.strip():
            raise ValueError("--checkpoint-dir needs a directory path, e.g. checkpoints; got an empty one")
        if (self.save_every or self.resume) and not self.checkpoint_dir:
            raise ValueError("--save-every and --resume need --checkpoint-dir")
        self.task()

    def memory_needed(self, ranks: int) -> int:
        """Bytes ``ranks`` local ranks need at least: each builds the whole fp32 model before FSDP
        shards it, and the fp32 logits of the global batch are spread over the ranks."""
        model = get_config(self.model)
        return 4 * (ranks * model.parameters + self.dp * self.batch * self.seq * model.vocab)

    def check_memory(self, ranks: int) -> None:
        """Refuse a run this machine cannot hold (``memory_needed``)."""
        launch.check_local_memory(
            self.memory_needed(ranks), f"--model {self.model} on {ranks} rank{'s' if ranks > 1 else ''} with --seq "
            f"{self.seq} and --batch {self.batch}", "choose a smaller --model, or lower --seq, --batch or the ranks on "
            "this machine (--nproc, or torchrun's --nproc-per-node)")

    def checkpoint_settings(self) -> dict:
        """What a resumed run must share with the run that saved: what it trains on and with.

        The layout, strategy and the dp x cp split may change (DCP reshards, and CP
        computes the same loss), but a different model, data stream (seed, sequence
        length, global batch) or learning rate would not continue that run; the lr would
        not even apply, as the optimizer state loaded from the checkpoint carries it.
        """
        # the preset's shape, not just its name: presets can change between versions
        shape = ", ".join(f"{k}={v}" for k, v in asdict(get_config(self.model)).items())
        return {"--model": f"{self.model} ({shape})", "--seq": self.seq,
                "global batch (--batch x --dp)": self.batch * self.dp, "--seed": self.seed, "--lr": self.lr,
                "data stream": RecallTask.STREAM}

    def checkpoint_bytes(self) -> int:
        """A lower bound of one checkpoint's size: the parameters and AdamW's two moments, float32."""
        return 3 * 4 * get_config(self.model).parameters

    def task(self) -> RecallTask:
        return RecallTask(vocab=get_config(self.model).vocab, seq_len=self.seq)


def build_model(cfg: TrainConfig, device: torch.device) -> Transformer:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and in the reference
    model = Transformer(get_config(cfg.model)).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    return model


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=ADAM_BETAS, weight_decay=0.0)


def _run_steps(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig, start: int,
    inputs: Callable[[int], tuple], after_step: Callable[[int], None], show: bool, grad_scale: float = 1.0,
    after_backward: Callable[[int], None] = lambda step: None,
) -> dict[str, list[float]]:
    """The training loop shared by CP and the single-process reference.

    ``inputs(step)`` gives (tokens, positions, labels, recall) for this rank. The loss
    shares of all ranks sum to the global mean loss; FSDP averages gradients over its
    ranks, so ``grad_scale`` (= their number) turns that average back into the sum.
    ``after_backward(step)`` sees the step's gradients before the optimizer uses them.
    """
    history: dict[str, list[float]] = {"loss": [], "recall_accuracy": [], "tokens_per_second": []}
    global_tokens = cfg.batch * cfg.dp * cfg.seq
    bar = None
    if show and cfg.progress and launch.stderr_is_a_terminal():
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step")
    for step in range(start, cfg.steps):
        begin = time.perf_counter()
        tokens, positions, labels, recall = inputs(step)
        logits = model(tokens, positions)  # (B, S, vocab)
        share, loss = cp_loss(logits, labels)
        (share * grad_scale).backward()
        after_backward(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        hits = torch.stack([((logits.argmax(-1) == labels) & recall).sum(), recall.sum()]).float()
        if dist.is_initialized():
            dist.all_reduce(hits)
        seconds = time.perf_counter() - begin
        value = loss.item()
        if not math.isfinite(value):
            # the loss is all-reduced, so every rank stops here at the same step, none waits in a collective
            raise launch.StopRun(
                f"step {step + 1}: the loss is {value}; stopped before anything of this step is saved. Start a new "
                "run with a lower --lr (a resumed run keeps the saved one), or, after --resume, check the "
                "checkpoint it resumed from (its weights may not be finite)")
        history["loss"].append(value)
        history["recall_accuracy"].append((hits[0] / hits[1].clamp(min=1)).item())
        history["tokens_per_second"].append(global_tokens / seconds)
        if bar is not None:
            bar.set_postfix(loss=f"{value:.4f}", recall=f"{history['recall_accuracy'][-1]:.2f}",
                            tok_s=f"{global_tokens / seconds:,.0f}")
            bar.update()
        after_step(step + 1)
    if bar is not None:
        bar.close()
    return history


# what each rank may hold of its own: the bar (rank 0's alone shows), a test's switch, the ranks
# spawned (torchrun's flag, not this one, starts them)
OWN_SETTINGS = ("progress", "return_parameters", "nproc")


def check_ranks_share(cfg: TrainConfig) -> None:
    """Refuse, on every rank (collective), ranks given other settings: torchrun starts each
    with its own command line, so a wrapper per rank may give them other flags. Ranks given
    other --lr values trained silently apart, each FSDP shard at its own rate, and --resume
    on one rank alone left the others waiting until the timeout."""
    mine = {name: value for name, value in asdict(cfg).items() if name not in OWN_SETTINGS}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differing = [name for name in mine if len({repr(settings[name]) for settings in every}) > 1]
    if differing:
        told = " / ".join(f"--{name.replace('_', '-')} "
                          + agreement.by_value({rank: repr(settings[name]) for rank, settings in enumerate(every)})
                          for name in differing)
        raise ValueError(f"the ranks were given different settings ({told}); give every rank of the launch the "
                         f"same flags")


def _within_a_torchrun_launch(cfg: TrainConfig, rank: int, holds: list[int]) -> checkpoint.Resumable | None:
    """Where a torchrun rank starts, decided by the ranks together (collective): the checkpoint
    to continue from, or None. Rank 0 holds the directory for the run (``checkpoint.hold_for_run``),
    its descriptor put in ``holds``.

    torchrun restarts failed ranks with the same arguments (``--max-restarts``), so an
    attempt tells a restart from a new launch by the mark an earlier attempt of the launch
    left in torchrun's store before its first save, not by its own restart count (an agent
    whose ranks did not fail does not count one). A restart continues from the newest
    verified checkpoint the launch saved, as ``--resume`` would, or starts over where none
    verifies (a save cut short is replaced when its step comes again); a new launch checks
    the directory as local runs do before their ranks start.
    """
    mark = f"{OWN_CHECKPOINTS} {os.path.abspath(cfg.checkpoint_dir)}"
    restarted = launch.launch_marked(mark)
    dist.barrier()  # every rank has read the mark before rank 0 sets it below
    owner = f"torchrun launch {launch.launch_token()}"
    try:
        held = checkpoint.check_and_hold_together(cfg.checkpoint_dir, resuming=cfg.resume, owner=owner,
                                                  checkpoint_bytes=cfg.checkpoint_bytes(), checked=not restarted)
    except checkpoint.HeldByAnotherRun as e:
        if not restarted or f"{owner})" not in str(e):
            raise
        # this launch's failed attempt's lock, on a file system that keeps a dead host's locks for a while (NFS)
        held = None
        if rank == 0:
            launch.note(f"ctxpar train: torchrun restarted the run, and the directory's run lock is still held: {e}; "
                        f"continuing without it")
    if held is not None:
        holds.append(held)
    found = None
    if cfg.resume:  # asked for, on every attempt
        found = find_resume_point(cfg)
    elif restarted:
        found = checkpoint.find_resumable(cfg.checkpoint_dir, cfg.checkpoint_settings(), required=False)
        if found is not None and found.step >= cfg.steps:
            raise ValueError(f"torchrun restarted a run that had saved its last step ({found.step} of --steps "
                             f"{cfg.steps}): its training is complete there; the failure came after it (see the "
                             f"previous attempt's log)")
    if rank == 0:
        launch.mark_launch(mark)  # before this launch saves any checkpoint
        if restarted:
            what = (f"continuing from its checkpoint at step {found.step}" if found
                    else "no checkpoint of it verifies: starting over from step 0")
            launch.note(f"ctxpar train: torchrun restarted the run: {what} (--checkpoint-dir "
                        f"{cfg.checkpoint_dir!r})")
        if found:
            _say_skipped(found)
    return found


def find_resume_point(cfg: TrainConfig) -> checkpoint.Resumable:
    """The verified checkpoint ``--resume`` continues from (collective under a process group).

    Raises:
        ValueError: naming the flag: no checkpoint verifies, the newest verified one was
            saved with other settings (``--seed``, ``--lr``, ...), or it leaves nothing of ``--steps``.
    """
    found = checkpoint.find_resumable(cfg.checkpoint_dir, cfg.checkpoint_settings())
    if found.step >= cfg.steps:
        raise ValueError(f"--resume: the newest verified checkpoint is at step {found.step}, nothing left of --steps "
                         f"{cfg.steps}; ask for more steps")
    return found


def _say_skipped(found: checkpoint.Resumable) -> None:
    for skipped in found.skipped:
        launch.note(f"ctxpar train: --resume skipped {skipped.path}: {skipped.reason}")


def train_rank(rank: int, world: int, cfg: TrainConfig, resume_from: checkpoint.Resumable | None = None,
               device: torch.device | None = None) -> dict | None:
    """One rank of a CP (x DP) training run; returns the report on rank 0.

    With ``cfg.resume``, ``resume_from`` is the checkpoint the launching process found and
    verified (local ranks share its file system); None: the ranks find it together (torchrun),
    rank 0 holding the checkpoint directory until the run ends.
    """
    holds: list[int] = []
    try:
        return _train_rank(rank, world, cfg, resume_from, device, holds)
    finally:
        for held in holds:
            os.close(held)


def _train_rank(rank: int, world: int, cfg: TrainConfig, resume_from: checkpoint.Resumable | None,
                device: torch.device | None, holds: list[int]) -> dict | None:
    from torch.distributed.fsdp import fully_shard

    device = device or torch.device("cpu")
    cfg.validate(world)
    if launch.joined_torchrun():  # local ranks are given one configuration
        check_ranks_share(cfg)
    cp = cfg.cp(world)
    if cfg.strategy == "hybrid":
        u = cfg.ulysses_degree
        mesh = launch.init_mesh(device.type, (cfg.dp, cp // u, u), ("dp", "ring", "ulysses"))
        cp_dims: tuple[str, ...] = ("ring", "ulysses")
        cp_ranks = dict(mesh=mesh[cp_dims])
        cp_rank = ctxpar.hybrid_rank(cp_ranks["mesh"])
    else:
        mesh = launch.init_mesh(device.type, (cfg.dp, cp), ("dp", "cp"))
        cp_dims = ("cp",)
        cp_ranks = dict(group=mesh.get_group("cp"))
        cp_rank = mesh.get_local_rank("cp")
    dp_rank = mesh.get_local_rank("dp")
    layout = ctxpar.get_layout(cfg.layout, cp)
    task = cfg.task()

    model = build_model(cfg, device)
    apply_context_parallel(model, layout=layout, strategy=cfg.strategy, **cp_ranks)
    shard_mesh = mesh[("dp", *cp_dims)]._flatten()
    for layer in model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    optimizer = _optimizer(model, cfg)

    resumed = resume_from
    if cfg.checkpoint_dir and launch.joined_torchrun():
        resumed = _within_a_torchrun_launch(cfg, rank, holds)
    elif cfg.resume and resumed is None:
        resumed = find_resume_point(cfg)
        if rank == 0:
            _say_skipped(resumed)
    start = resumed.step if resumed else 0
    if resumed:
        checkpoint.load(model, optimizer, resumed)

    rows = slice(dp_rank * cfg.batch, (dp_rank + 1) * cfg.batch)

    def inputs(step: int) -> tuple:
        tokens, recall = task.batch(cfg.batch * cfg.dp, cfg.seed, step)
        local = shard_batch(tokens[rows], layout=layout, rank=cp_rank)
        recall = layout.shard(recall[rows], cp_rank, dim=1)
        return local.tokens.to(device), local.positions.to(device), local.labels.to(device), recall.to(device)

    gradients: dict[str, torch.Tensor] = {}  # step 1's whole gradients on rank 0, for --compare's verdict

    def after_backward(step: int) -> None:
        if cfg.compare and step == 0:
            gradients.update(full_gradients(model, keep=rank == 0))

    sealed = start if resumed else None  # the newest checkpoint of this run

    def after_step(done: int) -> None:
        nonlocal sealed
        if cfg.checkpoint_dir and (done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
            try:
                checkpoint.save(model, optimizer, cfg.checkpoint_dir, done, cfg.checkpoint_settings())
            except ValueError as e:  # a refusal (another run's save or checkpoint), alike on every rank
                raise launch.StopRun(f"step {done}: {e}") from None
            except OSError as e:  # alike on every rank too: said once, without a worker's traceback
                raise launch.StopRun(f"{e}. {_after_a_failed_save(cfg, sealed)}") from None
            sealed = done

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = profile.current_memory(device)
    with profile.record(timing=False) as rec:  # what strategy="auto" chose, without synchronising the device
        history = _run_steps(model, optimizer, cfg, start, inputs, after_step, show=rank == 0, grad_scale=world,
                             after_backward=after_backward)
    chosen = dict(rec.strategy_choices)  # strategy="auto": {strategy: why}, one entry per distinct choice
    growth = [None] * world
    dist.all_gather_object(growth, profile.peak_memory(device)[0] - before)
    params = None
    if cfg.return_parameters:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))[0]
        params = {name: t.clone() for name, t in full.items()} if rank == 0 else None
    if rank != 0:
        return None
    return dict(config=dict(asdict(cfg), nproc=world, cp=cp), start_step=start, parameters=params,
                first_step_gradients=gradients or None,
                resumed_from=resumed.path if resumed else None,
                skipped_checkpoints=[asdict(s) for s in resumed.skipped] if resumed else [],
                rank_peak_growth_bytes=growth, peak_memory_source=profile.peak_memory(device)[1],
                strategy_chosen=chosen, device=str(device), backend=dist.get_backend(), **history)


def _after_a_failed_save(cfg: TrainConfig, sealed: int | None) -> str:
    """What to do once a save failed, ``sealed`` the step of the run's newest checkpoint (None: none)."""
    fix = "Fix that (free space, a file-size limit, write permission), then "
    if sealed is None:
        return fix + "run the same command again: it starts over, replacing what was written"
    return fix + (f"run the same command{'' if cfg.resume else ' with --resume'}: it continues from step {sealed}, "
                  f"whose checkpoint is sealed")


def train_reference(cfg: TrainConfig) -> dict:
    """The same training on unsplit sequences in this process (no process group; under
    torchrun, rank 0 alone, once the launch's group is gone)."""
    if dist.is_initialized():
        raise RuntimeError("the reference run must not share a process group")
    with topology.alone():  # cp_loss refused it as a torchrun rank that forgot to join its launch
        return _train_reference(cfg)


def _train_reference(cfg: TrainConfig) -> dict:
    model = build_model(cfg, torch.device("cpu"))
    optimizer = _optimizer(model, cfg)
    task = cfg.task()

    def inputs(step: int) -> tuple:
        tokens, recall = task.batch(cfg.batch * cfg.dp, cfg.seed, step)
        return tokens, None, shift_labels(tokens), recall

    gradients: dict[str, torch.Tensor] = {}

    def after_backward(step: int) -> None:
        if step == 0:
            gradients.update(full_gradients(model))

    history = _run_steps(model, optimizer, cfg, 0, inputs, lambda done: None, show=False,
                         after_backward=after_backward)
    params = {n: p.detach().clone() for n, p in model.state_dict().items()} if cfg.return_parameters else None
    return dict(parameters=params, first_step_gradients=gradients, **history)


def full_gradients(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name, on the CPU. FSDP's shards are gathered, so
    under FSDP every rank calls it (collective); ``keep``: this rank keeps them (rank 0, as
    ``return_parameters`` keeps the gathered parameters)."""
    gradients = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is None:  # on every rank alike (one model): a parameter the loss does not reach
            continue
        grad = parameter.grad.full_tensor() if is_dtensor(parameter.grad) else parameter.grad
        if keep:
            gradients[name] = grad.detach().to("cpu", copy=True)
    return gradients


def gradient_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's relative gradient error |got - want| / |want| (Frobenius norms); where
    ``want``'s norm is 0: 0 if ``got``'s is too, else inf (a NaN in either: NaN or inf)."""
    if set(got) != set(want):
        missing = sorted(set(got) ^ set(want))
        return {name: math.inf for name in missing}  # a gradient one run has and the other lacks: no match
    errors = {}
    for name, reference in want.items():
        diff, scale = (got[name] - reference).norm().item(), reference.norm().item()
        errors[name] = diff / scale if scale else (0.0 if diff == 0 else math.inf)
    return errors


def run_train(cfg: TrainConfig, *, timeout_s: float = launch.DEFAULT_TIMEOUT_S) -> dict | None:
    """Train on local gloo ranks (or torchrun's), then the reference if ``cfg.compare``.

    The configuration is checked before any rank starts, and so, for local ranks, is the
    checkpoint ``--resume`` continues from (under torchrun the ranks find it together);
    ``timeout_s`` bounds each wait at a collective.
    """
    cfg.validate(launch.world_size(cfg.nproc))
    cfg.check_memory(launch.local_ranks(cfg.nproc))
    resume_from, held = None, None
    # here, not in validate (which every rank runs): it may create the directory; torchrun's
    # ranks check and hold it together once joined (``_within_a_torchrun_launch``)
    checked_here = bool(cfg.checkpoint_dir) and not launch.launched_by_torchrun()
    if checked_here:
        held = checkpoint.check_and_hold(cfg.checkpoint_dir, resuming=cfg.resume,
                                         checkpoint_bytes=cfg.checkpoint_bytes())
    try:
        if checked_here and cfg.resume:
            resume_from = find_resume_point(cfg)
            _say_skipped(resume_from)
        report = launch.run(train_rank, cfg.nproc, (cfg, resume_from), device_type=cfg.device, timeout_s=timeout_s)
    finally:
        if held is not None:
            os.close(held)
    if report is not None:
        gradients = report.pop("first_step_gradients")  # step 1's whole gradients, with --compare from step 0
        if cfg.compare:
            report.update(compare_with_reference(report, gradients, train_reference(cfg)))
    return report


def compare_with_reference(report: dict, gradients: dict[str, torch.Tensor] | None, reference: dict) -> dict:
    """``--compare``'s fields: the CP run's ``report`` and its step 1's whole ``gradients``
    (None where it resumed: not judged) against ``reference``, ``train_reference``'s."""
    pairs = list(zip(report["loss"], reference["loss"][report["start_step"]:]))
    fields = dict(reference_loss=reference["loss"], reference_parameters=reference["parameters"],
                  max_abs_loss_diff=max(abs(a - b) for a, b in pairs), losses_match=None, gradients_match=None,
                  max_gradient_error=None, max_gradient_error_parameter=None)
    if report["start_step"]:  # resumed: from weights whose earlier steps' rounding the reference does not share
        return fields
    fields["losses_match"] = all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in pairs[:JUDGED_STEPS])
    errors = gradient_errors(gradients, reference["first_step_gradients"])
    worst = max(errors, key=lambda name: (math.isnan(errors[name]), errors[name]))  # NaN first: it matches nothing
    fields.update(max_gradient_error=errors[worst], max_gradient_error_parameter=worst,
                  gradients_match=errors[worst] <= GRADIENT_RTOL)
    return fields


def format_report(report: dict) -> str:
    c = report["config"]
    strategy = c["strategy"]
    if strategy == "hybrid":
        strategy += f" ulysses {c['ulysses_degree']} x ring {c['cp'] // c['ulysses_degree']}"
    strategy = strategy_rules.named_with_choice(strategy, report.get("strategy_chosen", {}))
    steps = len(report["loss"])
    lines = [f"ctxpar train: {c['model']} model, T={c['seq']}, {c['nproc']} rank{'s' * (c['nproc'] != 1)} = dp "
             f"{c['dp']} x cp {c['cp']} ({strategy}, {c['layout']}), {steps} step{'s' * (steps != 1)}"
             + (f" (steps {report['start_step'] + 1}-{c['steps']})" if report["start_step"] else "")]
    if report.get("resumed_from"):
        lines.append(f"  resumed from {report['resumed_from']}")
    lines += strategy_rules.choice_lines(report.get("strategy_chosen", {}), indent="  ")
    ref = report.get("reference_loss")
    header = f"{'step':>5} {'loss':>10} {'recall':>7}" + (f" {'reference':>10} {'|diff|':>9}" if ref else "")
    lines.append(header)
    for i, loss in enumerate(report["loss"]):
        step = report["start_step"] + i + 1
        row = f"{step:>5} {loss:>10.5f} {report['recall_accuracy'][i]:>7.2f}"
        if ref:
            r = ref[step - 1]
            row += f" {r:>10.5f} {abs(loss - r):>9.2e}"
        lines.append(row)
    tps = report["tokens_per_second"]
    lines.append(f"tokens/s (median over steps): {statistics.median(tps):,.0f}")
    if ref:
        lines.append(f"max |loss - reference_loss| = {report['max_abs_loss_diff']:.2e}")
        lines.append(_verdict(report))
    chance = f"(ln vocab = {math.log(get_config(c['model']).vocab):.4f})"
    if len(report["loss"]) == 1:  # one step: nothing to fall from
        lines.append(f"loss: {report['loss'][0]:.4f} {chance}")
    else:
        falls = report["loss"][-1] < report["loss"][0]
        lines.append(f"loss {'fell' if falls else 'did not fall'}: {report['loss'][0]:.4f} -> "
                     f"{report['loss'][-1]:.4f} {chance}")
    return "\n".join(lines)


def _verdict(report: dict) -> str:
    """``--compare``'s line: OK, MISMATCH saying what differs, or why a resumed run is not judged."""
    if report["losses_match"] is None:
        return (f"not judged: resumed at step {report['start_step']}, from weights whose earlier steps' rounding the "
                f"reference does not share")
    steps = f"the first {min(JUDGED_STEPS, len(report['loss']))} step(s)"
    worst = f"{report['max_gradient_error']:.2e} of its norm, in {report['max_gradient_error_parameter']}"
    if report["losses_match"] and report["gradients_match"]:
        return (f"OK: step 1's gradients within {GRADIENT_RTOL:g} of the reference's (at most {worst}) and the "
                f"losses of {steps} within {LOSS_RTOL:g} (later steps shown, not judged: training amplifies rounding)")
    wrong = [] if report["gradients_match"] else [
        f"a gradient of step 1 differs from the reference's by more than {GRADIENT_RTOL:g} ({worst})"]
    if not report["losses_match"]:
        wrong.append(f"a loss of {steps} differs from the reference's by more than {LOSS_RTOL:g} of it")
    return f"MISMATCH: {'; '.join(wrong)}"
