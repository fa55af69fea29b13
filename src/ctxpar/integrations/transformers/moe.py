"""A mixture-of-experts model's router load-balancing loss (``aux_loss``) under context parallelism.

transformers' MoE causal LMs (Mixtral, Qwen-MoE, OLMoE, Jamba, ... with
``output_router_logits=True``) return, and add ``router_aux_loss_coef`` times it to a
``labels=`` loss, Switch Transformer's load-balancing loss over every token the forward
routes:

    aux = E * sum_e f_e * p_e,   f_e = the share of top-k choices that went to expert e,
                                 p_e = the mean router probability of expert e,

both over the rows of every layer's router logits. On one shard it is that shard's: not
linear in the tokens, so no sum of the ranks' values gives the sequence's. ``global_aux_loss``
recomputes it from the ranks' counts and probability sums (one all-reduce), after checking
that it reproduces the model's own value on this rank's rows (a family computing another
formula is refused, not replaced). Its value is the sequence's, the same bits on every rank,
its gradient this rank's share, as the labels= loss's: summed over the CP ranks, the
unsplit gradients.
"""

from __future__ import annotations

import torch

from ctxpar import topology

# the model's own aux_loss on this rank's rows against the formula above (float32, as transformers sums)
_MATCH_RTOL = 1e-4


def _top_k(model) -> int | None:
    for owner in (model, model.config):
        k = getattr(owner, "num_experts_per_tok", None)
        if isinstance(k, int) and not isinstance(k, bool) and k > 0:
            return k
    return None


def _coefficient(model) -> float | None:
    for owner in (model, model.config):
        for key in ("router_aux_loss_coef", "aux_loss_coef"):  # JetMoE's name
            coef = getattr(owner, key, None)
            if isinstance(coef, (int, float)) and not isinstance(coef, bool):
                return float(coef)
    return None


def _local_sums(router_logits: tuple[torch.Tensor, ...], top_k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(choices per expert (E,), router probabilities summed per expert (E,), rows), float32,
    over every layer's rows of this rank."""
    experts = router_logits[0].shape[-1]
    device = router_logits[0].device
    choices = torch.zeros(experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = 0
    for logits in router_logits:
        weights = torch.softmax(logits.to(device).reshape(-1, experts), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        choices = choices + torch.bincount(chosen.reshape(-1), minlength=experts).float()
        probabilities = probabilities + weights.float().sum(dim=0)
        rows += weights.shape[0]
    return choices, probabilities, rows


def _formula(choices: torch.Tensor, probabilities: torch.Tensor, rows) -> torch.Tensor:
    return choices.numel() * torch.sum((choices / rows) * (probabilities / rows))


def global_aux_loss(name: str, model, out, peers: topology.Topology, labelled_loss: torch.Tensor | None) -> None:
    """Replace ``out.aux_loss`` (this rank's rows') with the sequence's, and ``out.loss``'s
    router term where a labels= loss holds one (``labelled_loss``: the value of the labels=
    part, as ctxpar's loss returned it, before the model added the router term). Every rank
    of ``peers`` calls it for the same forward (the ranks agreed on output_router_logits),
    and all raise together where one cannot. On a GPU it reads a few scalars back (one
    synchronisation per forward with router logits)."""
    router_logits = getattr(out, "router_logits", None)
    top_k, coef = _top_k(model), _coefficient(model)
    why = None
    if not isinstance(out.aux_loss, torch.Tensor) or not isinstance(router_logits, tuple) or not router_logits \
            or top_k is None:
        why = "it returns no router_logits (or names no num_experts_per_tok) to recompute it from"
        sums = None
    else:
        sums = _local_sums(router_logits, top_k)
        own = float(out.aux_loss.detach())
        if abs(float(_formula(*sums).detach()) - own) > _MATCH_RTOL * max(abs(own), 1e-12):
            why = "its aux_loss is not Switch Transformer's load-balancing loss over its router_logits"
        elif labelled_loss is not None and (coef is None or abs(float(out.loss.detach()) - float(
                labelled_loss.detach()) - coef * own) > _MATCH_RTOL * max(abs(float(out.loss.detach())), 1e-12)):
            why = "its labels= loss adds the router loss otherwise than router_aux_loss_coef times aux_loss"
    device = next(model.parameters()).device  # where the group's backend takes tensors
    experts = sums[0].numel() if sums is not None else 0
    # every rank's verdict and width first (a rank that cannot recompute must not leave the others in
    # the second all-reduce): equal widths E on all P ranks sum to P·E and P·E²
    header = torch.tensor([why is not None, experts, experts * experts], dtype=torch.int64, device=device)
    topology.all_reduce(header, peers)
    refused, widths, squares = header.tolist()
    if why is not None or refused or widths != peers.world_size * experts or squares != experts * widths:
        reason = why or "another rank of the CP group could not recompute it"
        raise ValueError(f"{name} returned aux_loss, its router load-balancing loss over this rank's tokens only, "
                         f"which ctxpar cannot make the sequence's: {reason}; pass output_router_logits=False, or "
                         f"compute it yourself from the experts' token fractions and mean probabilities summed over "
                         f"the CP group")
    choices, probabilities, rows = sums
    summed = torch.cat([choices, probabilities.detach(), torch.tensor([rows], dtype=torch.float32, device=device)])
    topology.all_reduce(summed, peers)
    counts, rows = summed[:experts], summed[-1]
    # values from the all-reduced sums alone (the same bits on every rank, as the labels= loss's), gradients
    # through zero-valued terms: this rank's probabilities against the sequence's counts
    own_share = _formula(counts, probabilities, rows)
    aux = _formula(counts, summed[experts:-1], rows) + (own_share - own_share.detach())
    aux = aux.to(out.aux_loss.device, out.aux_loss.dtype)
    if labelled_loss is not None:  # the model's own router term out (its labels= part's gradient kept)
        labelled_part = out.loss - coef * out.aux_loss.to(out.loss.device)
        out["loss"] = (labelled_loss + coef * aux.detach().to(out.loss.device)) \
            + (labelled_part - labelled_part.detach()) + coef * (aux - aux.detach()).to(out.loss.device)
    out["aux_loss"] = aux
