"""transformers' ``Trainer`` under context parallelism: ``ContextParallelTrainer``.

    model = enable_context_parallel(LlamaForCausalLM(config), layout="zigzag", group=cp_group)
    trainer = ContextParallelTrainer(model=model, args=TrainingArguments(...), train_dataset=data)
    trainer.train()        # every CP rank: the whole batch, sharded in compute_loss

It trains what ``Trainer`` trains on the same batches without CP (one process per
data-parallel replica), to rounding: the same losses logged, the same gradient norms, the
same steps. Three things differ from a plain ``Trainer`` under ``torchrun``:

- data: the data loaders deal batches out over the data-parallel replicas only (the CP
  groups), so that every rank of a CP group gets the same whole batch;
- the loss: ``compute_loss`` shards each batch over the CP group (``shard_inputs``, which
  shifts the labels on the whole sequence) and scales the model's ``labels=`` loss (the
  micro-batch's token mean, the same on every CP rank) as ``Trainer`` scales its own:
  by ``num_items_in_batch``, the labelled tokens of the whole accumulated batch over the
  replicas, counted once per replica (the CP ranks of a replica count the same batch);
- the gradient: DDP averages over every rank, P per replica, where each CP rank holds its
  share of the replica's gradient; the loss's gradient is scaled by P (its value is not:
  the losses logged are ``Trainer``'s), so the average is the replicas' mean, as without CP.

Evaluation computes the loss alike, one copy per replica gathered, and its predictions are
the sequence's logits (each rank's shard gathered over the CP group, in order); Trainer's
counts of tokens seen and floating-point operations count each replica's batch once; loader
workers are seeded by replica. Refused, as their CP form is not built: label smoothing,
NEFTune, a router's auxiliary loss, a ``compute_loss_func``, ``model_init``, DeepSpeed and FSDP through accelerate,
accelerate's own ``parallelism_config`` and ``dispatch_batches``, an iterable dataset, batch
rebalancing, DataParallel, padding masks. Packed rows (``position_ids`` restarting at 0 in
each document, every row of a batch alike) attend and predict within each document
(``shard_inputs(..., documents=)``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from transformers import Trainer

from ctxpar import agreement, comm, topology
from ctxpar.integrations.transformers import shard_inputs
from ctxpar.integrations.transformers.attention import PADDING_REFUSED, Settings
from ctxpar.parallelize import IGNORE_INDEX

__all__ = ["ContextParallelTrainer"]

_INPUTS = ("input_ids", "labels", "attention_mask", "position_ids", "token_type_ids")  # what a batch may hold
_NO_LABELS = ("ContextParallelTrainer needs labels in the batch (for next-token prediction, a copy of input_ids with "
              "unlabelled tokens set to -100, unshifted: the model shifts them)")


_PACKED_APART = ("ContextParallelTrainer got a batch whose rows pack different documents; ctxpar's documents= "
                 "describes every row alike: per_device_train_batch_size=1 (and eval) gives one row a batch")
_DOCUMENT_START_LABELLED = (f"ContextParallelTrainer got a label on the first token of a packed document; set them to "
                            f"{IGNORE_INDEX} (as DataCollatorWithFlattening does): without CP the model would learn to "
                            f"predict each document's first token from the one before, which CP does not do")


def _packing(positions: torch.Tensor) -> tuple[int, ...]:
    """The lengths of the documents packed into a row, from its ``position_ids`` (T,), which
    restart at 0 in each (TRL's packing, transformers' DataCollatorWithFlattening); one host read."""
    row = positions.tolist()
    starts = [i for i, p in enumerate(row) if p == 0]
    if not starts or starts[0] != 0:
        raise ValueError(f"ContextParallelTrainer got position_ids starting at {row[0]}: packed rows restart at 0 in "
                         f"each document, the first included")
    lengths = tuple(b - a for a, b in zip(starts, starts[1:] + [len(row)]))
    if row != [p for n in lengths for p in range(n)]:
        raise ValueError("ContextParallelTrainer got position_ids that do not count 0, 1, 2, ... within each "
                         "document: only packed documents (positions restarting at 0) are taken")
    return lengths


def _settings(model) -> Settings:
    if model is None:
        raise ValueError("ContextParallelTrainer takes model=, a model enable_context_parallel was applied to "
                         "(model_init=, a model made anew for each trial, is not supported)")
    found = next((m.ctxpar_settings for m in model.modules()
                  if isinstance(getattr(m, "ctxpar_settings", None), Settings)), None)
    if found is None:
        raise ValueError("ContextParallelTrainer trains a model enable_context_parallel was applied to; enable it "
                         "(ctxpar.integrations.transformers.enable_context_parallel) before building the trainer")
    return found


class ContextParallelTrainer(Trainer):
    """``Trainer`` for a model ``enable_context_parallel`` made context-parallel: every rank
    of a CP group gets the same whole batch, ``compute_loss`` shards it, and the gradients
    are those of ``Trainer`` without CP (module docstring). Launch as for ``Trainer`` (one
    process per rank, ``torchrun``), with torch.distributed initialised over every rank;
    the CP groups must split WORLD into data-parallel replicas of equal size."""

    def __init__(self, model=None, args=None, *positional, **kwargs) -> None:
        settings = _settings(model)
        super().__init__(model, args, *positional, **kwargs)
        self._layout, self._peers = settings.layout, settings.peers()
        self._output_keys: list[str] = []  # the model's outputs besides the loss, as evaluation last saw them
        self._check_set_up()
        self._replica, self._leaders = self._replicas_of(settings)

    @property
    def _cp(self) -> int:
        """The ranks of a CP group, which share each batch."""
        return self._peers.world_size

    @property
    def _replicas(self) -> int:
        """The data-parallel replicas: the CP groups."""
        return len(self._leaders)

    def _check_set_up(self) -> None:
        args, accelerator = self.args, self.accelerator
        refusals = [
            (args.label_smoothing_factor != 0, f"label_smoothing_factor={args.label_smoothing_factor}"),
            (self.compute_loss_func is not None, "compute_loss_func= (it computes the loss itself, sharded)"),
            (args.n_gpu > 1, f"torch.nn.DataParallel over {args.n_gpu} GPUs of one process (launch a process per GPU)"),
            (self.is_deepspeed_enabled, "DeepSpeed"),
            (self.is_fsdp_enabled, "FSDP through accelerate"),
            (getattr(accelerator, "parallelism_config", None) is not None,
             "accelerate's parallelism_config (its own context, tensor and sequence parallelism)"),
            (args.train_sampling_strategy == "batch_rebalance", "train_sampling_strategy='batch_rebalance'"),
            (args.neftune_noise_alpha is not None, f"neftune_noise_alpha={args.neftune_noise_alpha} (its noise is "
             f"scaled by the length of each rank's shard: sqrt(P) times too large)"),
            (any(getattr(getattr(m, "config", None), "output_router_logits", False) for m in self.model.modules()),
             "output_router_logits=True (Trainer adds the router's auxiliary loss at its own scale, which the "
             "loss's scaling here does not keep apart)"),
            (accelerator.dispatch_batches is True, "dispatch_batches=True (batches sent out from rank 0 over every "
             "rank, not over the data-parallel replicas)"),
        ]
        refused = [what for bad, what in refusals if bad]
        if refused:
            raise ValueError(f"ContextParallelTrainer does not support {', '.join(refused)}")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if accelerator.num_processes != world:
            raise ValueError(f"accelerate sees {accelerator.num_processes} process(es) where torch.distributed has "
                             f"{world}: launch with torchrun (or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
                             f"MASTER_PORT before TrainingArguments), so that DDP sums the CP ranks' gradient shares")

    def _replicas_of(self, settings: Settings) -> tuple[int, list[int]]:
        """(this rank's data-parallel replica, each replica's leader): a replica is a CP group,
        led by its lowest global rank, and numbered in their order."""
        world = self.accelerator.num_processes
        if world == 1:
            return 0, [0]
        members = sorted(topology.global_ranks(settings.group, settings.mesh))
        mine = torch.tensor([members[0], len(members), agreement.text_code(str(members))], dtype=torch.int64,
                            device=comm.collective_device(None))
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        leaders, sizes, groups = zip(*(t.tolist() for t in everyone))
        replicas = sorted(set(leaders))
        # judged from what every rank gathered, so that every rank refuses alike: a leader's ranks name one group
        if len(set(sizes)) > 1 or any(len({g for g, r in zip(groups, leaders) if r == leader}) > 1
                                      or leaders.count(leader) != sizes[0] for leader in replicas):
            raise ValueError(f"the CP groups do not split WORLD into replicas of one size (each rank's group's first "
                             f"rank {list(leaders)}, its size {list(sizes)}); ContextParallelTrainer needs every rank "
                             f"in exactly one CP group, all of one size")
        return replicas.index(members[0]), replicas

    def get_cp_size(self) -> int:
        """The ranks sharing each batch: ``Trainer`` divides the token count gathered over every
        rank by it, and the world size by it for the data-parallel batch size."""
        return self._cp

    def floating_point_ops(self, inputs: dict) -> int:
        """Trainer's estimate for the whole batch, which every CP rank holds, shared out: summed
        over every rank, each replica's batch counted once."""
        return super().floating_point_ops(inputs) // self._cp

    def _track_num_input_tokens(self, inputs) -> None:
        """Trainer's count of the tokens seen, gathered over every rank: each replica's counted once."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self._cp

    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        sampler = getattr(loader, "batch_sampler", None)  # a resumed epoch's skipping wraps it later
        if self.accelerator.num_processes > 1:
            if not hasattr(sampler, "num_processes"):
                raise ValueError(f"ContextParallelTrainer deals batches out over the data-parallel replicas and cannot "
                                 f"with {type(loader).__name__} over {type(loader.dataset).__name__}, an iterable "
                                 f"dataset: use a dataset with a length")
            # as Trainer does for its own rank-aware sampler: accelerate shards over every rank, we over the replicas
            sampler.num_processes, sampler.process_index = self._replicas, self._replica
            if self._replicas == 1:  # as Trainer in one process, which accelerate does not shard: a short last
                sampler.even_batches = False  # batch stays short, not padded with the epoch's first rows
            # Trainer seeds each worker by global rank: by replica, a random dataset or collator gives every CP
            # rank of a replica the same batch (as Trainer without CP seeds replica r's workers)
            base = getattr(loader, "base_dataloader", loader)  # accelerate's adapter forwards reads, not writes
            seed = getattr(base, "worker_init_fn", None)
            if isinstance(seed, functools.partial) and "rank" in seed.keywords:
                base.worker_init_fn = functools.partial(seed.func, *seed.args, **{**seed.keywords,
                                                                                  "rank": self._replica})
        return loader

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """Shard the whole batch over the CP group and return the loss ``Trainer`` would
        compute without CP, whose gradient is this rank's share scaled by P."""
        # the replicas hold different batches: one refusing, the others would wait for it in DDP's buffer broadcast
        # (the forward's start), its gradient all-reduce or evaluation's gather; every rank hears it first
        with agreement.Refusal() as refusal:
            labels = inputs.get("labels")
            sharded, shifted = self._shard(inputs, labels)
        self._join(refusal, "batch")
        with agreement.Refusal() as refusal:  # the forward refuses on every rank of a CP group together
            outputs = model(**sharded, labels=shifted)
        self._join(refusal, "forward")
        loss = outputs.loss  # the micro-batch's token mean over the CP group, the same on every CP rank
        if num_items_in_batch is not None:  # as Trainer without CP: the sum over the accumulated batch's tokens
            if self.args.average_tokens_across_devices:
                loss = loss * self._replicas  # DDP averages over the replicas
            else:  # this replica's count, which Trainer divides by get_cp_size() as if gathered over every rank
                num_items_in_batch = num_items_in_batch * self._cp
            # times the micro-batch's labelled targets, as Trainer counts them (a document's first label is -100)
            loss = loss * (labels[..., 1:] != IGNORE_INDEX).sum() / num_items_in_batch
        # DDP averages over every rank, P per replica, each holding its share: P times the gradient, the same value
        if loss.requires_grad:
            loss = loss + (self._cp - 1) * (loss - loss.detach())
        if return_outputs:  # to name them where predictions cannot be put back in order
            self._output_keys = [key for key in outputs.keys() if key != "loss"] if hasattr(outputs, "keys") else []
        return (loss, outputs) if return_outputs else loss

    def _shard(self, inputs: dict, labels) -> tuple[dict, torch.Tensor]:
        """This rank's model inputs and shifted labels of the whole batch ``inputs``."""
        unknown = sorted(set(inputs) - set(_INPUTS))
        if unknown:
            raise ValueError(f"ContextParallelTrainer got batch keys {unknown}; it shards {list(_INPUTS)} (a "
                             f"collator adding others is not supported)")
        if labels is None:
            raise ValueError(_NO_LABELS)
        mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
        if positions is not None and tuple(positions.shape) != tuple(inputs["input_ids"].shape):
            raise ValueError(f"ContextParallelTrainer got position_ids {tuple(positions.shape)} for input_ids "
                             f"{tuple(inputs['input_ids'].shape)}: position_ids must be (B, T), one per token")
        documents = None if positions is None else _packing(positions[0])
        checks = {}  # what the batch's device tensors must not hold, read in one copy to the host
        if mask is not None:
            checks[PADDING_REFUSED] = ~mask.bool().all()
        if documents is not None:
            checks[_PACKED_APART] = (positions != positions[0]).any()
            starts = torch.tensor(documents[:-1], dtype=torch.int64, device=labels.device).cumsum(0)
            checks[_DOCUMENT_START_LABELLED] = (labels[:, starts] != IGNORE_INDEX).any()
        if checks:
            for refusal, found in zip(checks, torch.stack(list(checks.values())).tolist()):
                if found:
                    raise ValueError(refusal)
        return shard_inputs(inputs["input_ids"], layout=self._layout, rank=self._peers.rank, labels=labels,
                            documents=documents, token_type_ids=inputs.get("token_type_ids"))

    def _join(self, refusal: agreement.Refusal, what: str) -> None:
        """Raise on every rank where a rank refused its ``what``; one replica alone needs no exchange
        (its ranks hold the same batch, and the forward refuses on all of them together)."""
        if self._replicas > 1:
            refusal.join(lambda: {}, None, f"ContextParallelTrainer {what}", world_size=self.accelerator.num_processes)
        elif refusal.error is not None:
            raise refusal.error

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys=None):
        """Trainer's (loss, logits, labels), the logits the whole sequence's: every rank's
        shard gathered over the CP group and put back in sequence order."""
        if "labels" not in inputs:  # Trainer would run the model on the whole batch, unsharded
            raise ValueError(_NO_LABELS)
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if logits is not None:
            logits = self._whole(logits, *inputs["input_ids"].shape)
        return loss, logits, labels

    def _whole(self, local, batch: int, length: int):
        """An output of this rank's shard, (B, T/P, ...), or a tuple of them -> the sequence's (B, T, ...)."""
        if isinstance(local, (tuple, list)):
            return type(local)(self._whole(one, batch, length) for one in local)
        if not isinstance(local, torch.Tensor) or local.dim() < 2 or local.shape[0] != batch or \
                local.shape[1] * self._cp != length:
            shown = tuple(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__
            raise ValueError(f"ContextParallelTrainer cannot put the model's output {shown} back in sequence order "
                             f"(not (B={batch}, {length // self._cp} tokens of a shard, ...)); the outputs besides the "
                             f"loss: {', '.join(self._output_keys)}: pass the others than logits in ignore_keys, or "
                             f"evaluate the loss only (prediction_loss_only=True)")
        return self._layout.unshard(list(topology.all_gather(local.contiguous(), self._peers)), dim=1)

    def evaluation_loop(self, *args, **kwargs):
        self.gather_function = self._gather_replicas  # which Trainer's loop sets back to gather_for_metrics at its end
        return super().evaluation_loop(*args, **kwargs)

    def _gather_replicas(self, tensor):
        """``gather_for_metrics`` over the replicas: every rank's rows gathered, one CP rank's
        kept per replica (the others hold the same), and the last batch's padding dropped."""
        state = self.accelerator.gradient_state
        cut = state.remainder if state.end_of_dataloader and state.remainder > 0 else None

        def kept(everyone: torch.Tensor) -> torch.Tensor:
            return everyone.unflatten(0, (self.accelerator.num_processes, -1))[self._leaders].flatten(0, 1)[:cut]

        return recursively_apply(kept, self.accelerator.gather(tensor))  # nested outputs too, as gather_for_metrics
