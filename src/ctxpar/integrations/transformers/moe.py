"""A mixture-of-experts model's router load-balancing loss (``aux_loss``) under context parallelism.

transformers' MoE causal LMs (Mixtral, Qwen-MoE, OLMoE, Jamba, ... with
``output_router_logits=True``) return, and add ``router_aux_loss_coef`` times it to a
``labels=`` loss, Switch Transformer's load-balancing loss over every token the forward
routes:

    aux = E * sum_e f_e * p_e,   f_e = the share of top-k choices that went to expert e,
                                 p_e = the mean router probability of expert e,

both over the rows of every layer's router logits. On one shard it is that shard's: not
linear in the tokens, so no sum of the ranks' values gives the sequence's. ``global_aux_loss``
recomputes it from the ranks' counts and probability sums (all-reduced), after checking
that it reproduces the model's own value on this rank's rows (a family computing another
formula is refused, not replaced). Its value is the sequence's, the same bits on every rank,
its gradient this rank's share, as the labels= loss's: summed over the CP ranks, the
unsplit gradients.
"""

from __future__ import annotations

import torch

from ctxpar import comm, topology

# the model's own aux_loss on this rank's rows against the formula above (float32 sums, as transformers'),
# and its labels= loss against the labels= part plus coef x aux_loss (one float32 addition)
_MATCH_RTOL = 1e-5


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
        # scatter_add, not bincount, whose minlength reads the counts back to the host on a GPU
        choices = choices.scatter_add(0, chosen.reshape(-1), torch.ones_like(chosen, dtype=torch.float32).reshape(-1))
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
    and all raise together where one cannot. Two small all-reduces (every rank's verdict,
    then the sums) and one read of the verdicts on the host (a synchronisation on a GPU)."""
    router_logits = getattr(out, "router_logits", None)
    top_k, coef = _top_k(model), _coefficient(model)
    device = comm.collective_device(peers.process_groups[0])
    usable = isinstance(out.aux_loss, torch.Tensor) and isinstance(router_logits, tuple) and bool(router_logits) \
        and top_k is not None
    # this rank's verdicts (no router logits to use; another formula; the router term added otherwise), then
    # E and E² (equal widths on all P ranks sum to P·E and P·E²): summed, a refusal anywhere reaches every rank
    verdicts = torch.zeros(5, dtype=torch.float64, device=device)  # E² exact far past float32
    if usable:
        sums = _local_sums(router_logits, top_k)
        own = out.aux_loss.detach().float()
        tolerance = _MATCH_RTOL * own.abs().clamp_min(1e-12)
        verdicts[1] = ((_formula(*sums).detach() - own).abs() > tolerance).to(device)
        if labelled_loss is not None:
            total = out.loss.detach().float()
            added = total - labelled_loss.float().to(total.device)
            off = (added - (coef or 0.0) * own.to(total.device)).abs() > _MATCH_RTOL * total.abs().clamp_min(1e-12)
            verdicts[2] = (off | torch.tensor(coef is None, device=total.device)).to(device)
        experts = sums[0].numel()
        verdicts[3:] = torch.tensor([experts, experts * experts], dtype=torch.float64)
    else:
        verdicts[0] = 1
    mine = verdicts.clone()
    topology.all_reduce(verdicts, peers)
    mine, verdicts = torch.stack([mine, verdicts]).tolist()
    no_logits, formula, added_otherwise, experts = mine[0], mine[1], mine[2], int(mine[3])
    widths, squares = verdicts[3:]
    if any(verdicts[:3]) or widths != peers.world_size * experts or squares != experts * widths:
        reason = ("it returns no router_logits (or names no num_experts_per_tok) to recompute it from" if no_logits
                  else "its aux_loss is not Switch Transformer's load-balancing loss over its router_logits" if formula
                  else "its labels= loss adds the router loss otherwise than its router_aux_loss_coef (or "
                       "aux_loss_coef) times aux_loss" if added_otherwise
                  else "another rank of the CP group could not recompute it")
        raise ValueError(f"{name} returned aux_loss, its router load-balancing loss over this rank's tokens only, "
                         f"which ctxpar cannot make the sequence's: {reason}; pass output_router_logits=False, or "
                         f"compute it yourself from the experts' token fractions and mean probabilities summed over "
                         f"the CP group")
    choices, probabilities, rows = sums
    summed = torch.cat([choices, probabilities.detach(), torch.tensor([rows], dtype=torch.float32,
                                                                       device=choices.device)]).to(device)
    topology.all_reduce(summed, peers)
    summed = summed.to(probabilities.device)
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
