"""``model(**inputs, labels=labels).loss`` under context parallelism.

transformers' causal-LM heads call ``self.loss_function(logits=..., labels=..., ...)``,
which shifts the labels and averages over the tokens it sees. Under CP that would be
wrong twice: ``shard_inputs`` already shifted the labels on the unsplit sequence (a
second shift pairs tokens with the wrong targets), and a per-rank mean weighs shards with
different numbers of labelled tokens wrongly. The replacement below takes the labels as
already shifted and returns

    loss = global_mean + (share - share.detach())

whose value is the global token-weighted mean loss (the same bits on every rank, the number
to log) and whose gradient is exactly this rank's share, as with
``ctxpar.parallelize.cp_loss``: the parameter gradients of all CP ranks, summed, are the
gradients of the unsplit loss.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ctxpar.parallelize import IGNORE_INDEX, cp_loss


LOSS_KEYWORDS = ("num_items_in_batch", "ignore_index", "shift_labels")  # what a forward passes on to the loss
# the head losses (``head_loss``) whose labels= loss is next-token prediction, which this loss
# computes (None: transformers' default, the causal LM's; ForConditionalGeneration: a decoder's LM head)
CAUSAL_LM_LOSSES = (None, "ForCausalLM", "ForConditionalGeneration")


def head_loss(model) -> str | None:
    """The loss of the model's head: its ``loss_type``, else what transformers' naming rule
    gives the nearest class of its MRO (a subclass of LlamaForTokenClassification named
    otherwise has loss_type None, which reads as the causal LM's)."""
    if getattr(model, "loss_type", None) is not None:
        return model.loss_type
    from transformers.loss.loss_utils import LOSS_MAPPING

    kinds = re.compile("|".join(map(re.escape, sorted(LOSS_MAPPING, key=len, reverse=True))))
    for cls in type(model).__mro__:
        found = kinds.search(cls.__name__)
        if found:
            return found[0]
    return None


def loss_refusal(labels, rows: tuple[int, ...], *, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                 shift_labels=None) -> str | None:
    """Why a ``labels=`` loss over ``rows`` (B, S) local tokens cannot be computed under CP, or
    None. The model's forward asks before it runs, so that every rank refuses together; the
    loss asks again, for a call that did not come through the forward."""
    if shift_labels is not None:
        return ("shift_labels= is not used under context parallelism: the labels shard_inputs returns are already "
                "shifted; pass them as labels=")
    if num_items_in_batch is not None:
        return ("num_items_in_batch= is not supported under context parallelism (is it this rank's count or the "
                "global one?); compute the loss with ctxpar.parallelize.cp_loss and scale it yourself, or train with "
                "ctxpar.integrations.transformers.ContextParallelTrainer (transformers' Trainer passes it, and does "
                "not sum the ranks' gradient shares over the CP group)")
    if ignore_index != IGNORE_INDEX:
        return (f"ignore_index={ignore_index} is not supported under context parallelism; mark unlabelled tokens "
                f"with {IGNORE_INDEX}")
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(rows):
        shown = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        return f"labels {shown} must be this rank's shifted labels from shard_inputs, one per local token {rows}"
    return None


class CPCausalLMLoss:
    """A ``loss_function`` for transformers causal-LM heads; counts its calls so that a
    model computing its loss some other way can be caught (see ``enable_context_parallel``)."""

    def __init__(self, group: dist.ProcessGroup | None, mesh=None) -> None:
        self.group, self.mesh = group, mesh
        self.calls = 0
        self.last: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch=None,
                 ignore_index: int = IGNORE_INDEX, shift_labels: torch.Tensor | None = None,
                 **kwargs) -> torch.Tensor:
        """logits (B, S, vocab) and labels (B, S) of this rank, labels already shifted by
        ``shard_inputs`` -> the global mean loss, with this rank's share as gradient."""
        self.calls += 1
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):  # a head other than a causal LM's calls
            raise ValueError(f"ctxpar's labels= loss under context parallelism is next-token prediction, called with "
                             f"{type(vocab_size).__name__} where a causal LM head passes its vocabulary size; compute "
                             f"this head's loss from its logits with ctxpar.parallelize.cp_loss")
        refusal = loss_refusal(labels, tuple(logits.shape[:-1]), num_items_in_batch=num_items_in_batch,
                               ignore_index=ignore_index, shift_labels=shift_labels)
        if refusal is not None:
            raise ValueError(refusal)
        share, loss = cp_loss(logits, labels.to(logits.device), group=self.group, mesh=self.mesh)
        # the all-reduced mean's bits as value (the same on every rank), this rank's share as gradient
        self.last = loss  # detached: what a model adding its router loss in place (loss += ...) leaves (moe.py)
        return loss + (share - share.detach())
