"""Hostile calls to ``ctxpar.attention`` on 4 gloo ranks, all in one spawned group.

Each check reports what happened (a message, or the non-finite pattern of every
tensor) and ``test_hostile.py`` asserts on it. A check that hung on the old code makes
the whole group time out, which fails every test of the module.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ctxpar
from dist_cases import attention_or_refusal

WORLD = 4


def _call(q, k, v, **kwargs) -> str:
    out = attention_or_refusal(q, k, v, **kwargs)
    if isinstance(out, str):
        return out
    try:
        if out.requires_grad:
            out.sum().backward()
        return "ok"
    except ValueError as e:
        return str(e)


def _tensors(heads: int = 4, kv_heads: int = 2, local_len: int = 4, head_dim: int = 8, grad: bool = True):
    q = torch.randn(1, heads, local_len, head_dim, requires_grad=grad)
    kv = [torch.randn(1, kv_heads, local_len, head_dim, requires_grad=grad) for _ in range(2)]
    return q, *kv


def _converted(tensors: tuple, index: int, convert) -> list:
    """``tensors`` with the one at ``index`` passed through ``convert`` (None: unchanged)."""
    tensors = list(tensors)
    if convert is not None:
        tensors[index] = convert(tensors[index])
    return tensors


@dataclass(frozen=True)
class BlockedLayout(ctxpar.Layout):
    """A layout of the user's: blocks of ``block`` positions dealt round-robin."""

    block: int = 1
    name = "blocked"

    @property
    def multiple(self) -> int:
        return self.world_size * self.block

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        return torch.arange(seq_len).view(-1, self.block)[rank::self.world_size].flatten()


def disagreeing_ranks(rank: int, world: int, mesh) -> dict[str, str]:
    """One rank (the last) calls differently from the others; every rank must raise."""
    odd = rank == world - 1
    same_bytes = dict(local_len=8, head_dim=4) if odd else dict(local_len=4, head_dim=8)  # equal byte counts

    def without_grad_mode_on_the_last_rank():
        with torch.set_grad_enabled(not odd):
            return _call(*_tensors(), layout="zigzag")

    cases = {
        "kv_shape_same_bytes": lambda: _call(*_tensors(**same_bytes), layout="zigzag"),
        "layout": lambda: _call(*_tensors(), layout="striped" if odd else "zigzag"),
        "causal": lambda: _call(*_tensors(), layout="zigzag", causal=not odd),
        "scale": lambda: _call(*_tensors(), layout="zigzag", scale=0.5 if odd else None),
        "strategy_invalid": lambda: _call(*_tensors(), layout="zigzag", strategy="rign" if odd else "ring"),
        "strategy_other": lambda: _call(*_tensors(), layout="zigzag", strategy="allgather" if odd else "ring"),
        "requires_grad": lambda: _call(*_tensors(grad=not odd), layout="zigzag"),
        "sinks_requires_grad": lambda: _call(*_tensors(), layout="zigzag", sinks=torch.zeros(4, requires_grad=odd)),
        "hybrid_one_rank_invalid": lambda: _call(*_tensors(kv_heads=3 if rank == 0 else 2), layout="zigzag",
                                                 strategy="hybrid", mesh=mesh),
        "hybrid_one_rank_causal": lambda: _call(*_tensors(), layout="zigzag", strategy="hybrid", mesh=mesh,
                                                causal=rank != 0),
        "hybrid_vs_ring": lambda: _call(*_tensors(), layout="zigzag", strategy="ring" if odd else "hybrid",
                                        mesh=mesh),
        "layout_not_a_name": lambda: _call(*_tensors(), layout=["zigzag"] if odd else "zigzag"),
        # same name and P, another deal: once silently wrong (errors up to 1.96)
        "layout_of_the_users": lambda: _call(*_tensors(), layout=BlockedLayout(world, 4 if odd else 2)),
        "scale_overflows_a_float": lambda: _call(*_tensors(), layout="zigzag", scale=10**400 if odd else None),
        "sinks_on_meta": lambda: _call(*_tensors(), layout="zigzag",
                                       sinks=torch.zeros(4, device="meta" if odd else "cpu")),
        # once past every check: the sparse k failed inside the ring, the nested q in the
        # signature, and either left the other ranks waiting until the timeout
        "k_sparse": lambda: _call(*_converted(_tensors(), 1, torch.Tensor.to_sparse if odd else None),
                                  layout="zigzag"),
        "q_nested": lambda: _call(*_converted(_tensors(), 0, (lambda q: torch.nested.nested_tensor(list(q)))
                                              if odd else None), layout="zigzag"),
        # each part of the signature, left out, let the ranks compute (a mutation audit): other sinks silently,
        # bf16 read as fp16 (finite garbage), other windows until gloo's size mismatch
        "sinks_values": lambda: _call(*_tensors(), layout="zigzag", sinks=torch.full((4,), 1.0 if odd else 0.0)),
        "dtype_same_bytes": lambda: _call(*(t.to(torch.float16 if odd else torch.bfloat16) for t in _tensors()),
                                          layout="zigzag"),
        "window": lambda: _call(*_tensors(), layout="zigzag", window=5 if odd else 3),
        # left out of the signature in a mutation audit, each computed silently (errors up to 3.0), or hung (grad mode)
        "kv_heads": lambda: _call(*_tensors(kv_heads=1 if odd else 2), layout="zigzag", strategy="alltoall"),
        "window_with_documents": lambda: _call(*_tensors(), layout="zigzag", strategy="allgather",
                                               documents=(8, 8), window=5 if odd else 3),
        "sinks_values_bf16": lambda: _call(*(t.bfloat16() for t in _tensors(grad=False)), layout="zigzag",
                                           sinks=torch.full((4,), 1.001 if odd else 1.0)),
        "grad_mode": without_grad_mode_on_the_last_rank,
        # the batch alone: left out, gloo's size mismatch aborted every rank
        "batch": lambda: _call(*(t.detach().expand(2, -1, -1, -1).contiguous() if odd else t
                                 for t in _tensors(grad=False)), layout="zigzag"),
        "agreeing": lambda: _call(*_tensors(), layout="zigzag"),
        # the same sinks, -0.0 on one rank: once refused as different sinks (their bytes differ)
        "agreeing_signed_zero": lambda: _call(*_tensors(), layout="zigzag",
                                              sinks=torch.full((4,), -0.0 if odd else 0.0)),
    }
    return {name: case() for name, case in cases.items()}


KEY_SCORED_MINUS_INF = "key scored -inf"
POISONS = {  # (tensor, value) written into one element at global position 5
    "k+inf": ("k", float("inf")),
    "k-inf": ("k", float("-inf")),
    "k_nan": ("k", float("nan")),
    "v+inf": ("v", float("inf")),
    "v-inf": ("v", float("-inf")),
    "v_nan": ("v", float("nan")),
    "q+inf": ("q", float("inf")),
    "q-inf": ("q", float("-inf")),
    "q_nan": ("q", float("nan")),
    # key 0 scored -inf by every query, its other dims finite: under the striped layout a
    # row's tile of rank 0's keys can hold key 0 alone, which once merged as a phantom key
    KEY_SCORED_MINUS_INF: ("k", float("-inf")),
}


def _poisoned(poison: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 4, 8 * WORLD, 8), (1, 2, 8 * WORLD, 8), (1, 2, 8 * WORLD, 8), (1, 4, 8 * WORLD, 8)]
    q, k, v, dout = (torch.randn(s, generator=gen) for s in shapes)
    name, value = POISONS[poison]
    if poison == KEY_SCORED_MINUS_INF:
        q[:, :2, :, 0] = q[:, :2, :, 0].abs() + 0.5  # the queries of K/V head 0 (GQA) score key 0 at -inf
        k[:, 0, 0, 0] = value
    else:
        dict(q=q, k=k, v=v)[name][0, 0, 5, 3] = value
    return q, k, v, dout


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(B, H, S) bool: rows holding a non-finite value."""
    return ~torch.isfinite(t).all(-1)


def _max_abs(t: torch.Tensor, rows: torch.Tensor) -> float:
    picked = t[rows]
    return picked.abs().max().item() if picked.numel() else 0.0


def nonfinite_inputs(rank: int, world: int) -> dict:
    """``rows``: which rows of out, dq, dk, dv are non-finite under CP and in single-process SDPA;
    ``lse_changed``: the cases whose returned lse the backward changed (the -inf of a row seeing
    no finite key once turned +inf in place, in the tensor saved for the backward)."""
    results, lse_changed = {}, []
    for poison, causal, strategy in itertools.product(POISONS, (True, False), ("ring", "allgather", "alltoall")):
        layout = ctxpar.get_layout("striped" if poison == KEY_SCORED_MINUS_INF else "zigzag", world)
        q, k, v, dout = _poisoned(poison)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        single = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
        single.backward(dout)
        local = [layout.shard(t, rank, dim=2).requires_grad_() for t in (q, k, v)]
        out, lse = ctxpar.attention_with_lse(*local, layout=layout, causal=causal, strategy=strategy)
        lse_before = lse.detach().clone()
        out.backward(layout.shard(dout, rank, dim=2))
        if not torch.equal(lse.detach().nan_to_num(0.0), lse_before.nan_to_num(0.0)):  # inf == inf; NaN as 0
            lse_changed.append((poison, causal, strategy))
        got = [out.detach(), *(t.grad for t in local)]
        pieces = []
        for t in got:
            gathered = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(gathered, t.contiguous())
            pieces.append(layout.unshard(gathered, dim=2))
        want = [single.detach(), *(t.grad for t in leaves)]
        results[(poison, causal, strategy)] = {
            name: dict(cp=_rows(c), single=_rows(w), both_finite_err=_max_abs(c - w, ~(_rows(c) | _rows(w))),
                       scale=_max_abs(w, ~_rows(w)))
            for name, c, w in zip(("out", "dq", "dk", "dv"), pieces, want)
        }
    return dict(rows=results, lse_changed=lse_changed)


def dense_once(rank: int, world: int) -> dict:
    """What the block kernels receive when q's last dim is strided (stride 2)."""
    from ctxpar.strategies import blockwise

    dense, storages = [], set()
    real = blockwise.kernels.attention_forward

    def spy(q, k, v, **kwargs):
        dense.append(all(t.stride(-1) == 1 for t in (q, k, v)))
        storages.add(q.untyped_storage().data_ptr())
        return real(q, k, v, **kwargs)

    blockwise.kernels.attention_forward = spy
    try:
        q = torch.randn(1, 4, 8, 8, 2)[..., 0]  # (B, H, S, D), last-dim stride 2
        k, v = (torch.randn(1, 2, 8, 8) for _ in range(2))
        ctxpar.attention(q, k, v, layout="zigzag")
    finally:
        blockwise.kernels.attention_forward = real
    return dict(blocks=len(dense), dense=all(dense), query_storages=len(storages))


class DealingLayout(ctxpar.Layout):
    """A layout of the user's whose deal is set per instance, outside the dataclass fields, so
    instances dealing otherwise compare equal (``world_size`` is their only field)."""

    name = "dealing"

    def __init__(self, world_size: int, deal) -> None:
        super().__init__(world_size)
        object.__setattr__(self, "deal", deal)

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        return self.deal(seq_len, rank)


def layouts_equal_but_for_their_deal(rank: int, world: int, mesh) -> dict[str, float]:
    """Two instances of one user layout class that compare equal but deal otherwise, called one
    after the other: each call's max error against unsplit attention (the second once ran the
    first one's cached block plan: errors up to 1.46)."""
    deals = {"striped": lambda t, r: torch.arange(r, t, world),
             "contiguous": lambda t, r: torch.arange(r * t // world, (r + 1) * t // world)}
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 8 * world, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    found = {}
    for strategy in ("ring", "allgather", "alltoall", "hybrid"):
        for name, deal in deals.items():
            layout = DealingLayout(world, deal)
            place = ctxpar.hybrid_rank(mesh) if strategy == "hybrid" else rank
            shards = (layout.shard(t, place, dim=2) for t in (q, k, v))
            out = ctxpar.attention(*shards, layout=layout, strategy=strategy,
                                   **(dict(mesh=mesh) if strategy == "hybrid" else {}))
            found[f"{strategy} {name}"] = (out - layout.shard(want, place, dim=2)).abs().max().item()
    return found


def double_backward(mesh) -> dict[str, str]:
    """A gradient penalty: differentiate a gradient of the output again. Single-process
    SDPA on the CPU refuses it; so must every strategy (its backward is not differentiable),
    instead of returning a gradient detached from the graph."""
    found = {}
    for strategy, loss in itertools.product(("ring", "allgather", "alltoall", "hybrid"), ("square", "linear")):
        q, k, v = _tensors()
        out = ctxpar.attention(q, k, v, layout="zigzag", strategy=strategy, mesh=mesh if strategy == "hybrid" else None)
        # a loss linear in the output: the incoming gradient does not require grad, but dq
        # still depends on q, k, v (once detached: the penalty added nothing, without a word)
        (dq,) = torch.autograd.grad((out**2).sum() if loss == "square" else out.sum(), q, create_graph=True)
        try:
            (out.sum() + (dq**2).sum()).backward()
            found[strategy, loss] = f"no error; dq.requires_grad={dq.requires_grad}"
        except RuntimeError as e:
            found[strategy, loss] = str(e)
    return found


def torch_func(mesh) -> dict[str, str]:
    """torch.func.grad, vmap and jvp around attention: refused by name on every rank (once
    torch's message asking for a setup_context in ctxpar's autograd Functions); a plain
    call works afterwards."""
    q, k, v = _tensors()
    found = {}
    sinks = torch.zeros(q.shape[1])
    transforms = {"grad": lambda f: torch.func.grad(f)(q), "vmap": lambda f: torch.func.vmap(f)(q[None]),
                  "jvp": lambda f: torch.func.jvp(f, (q,), (torch.ones_like(q),)),
                  "grad of sinks": lambda f: torch.func.grad(lambda s: f(q, s))(sinks)}
    for (name, transform), strategy in itertools.product(transforms.items(), ("ring", "hybrid")):
        kwargs = dict(layout="zigzag", strategy=strategy, mesh=mesh if strategy == "hybrid" else None)
        try:
            transform(lambda x, s=sinks: ctxpar.attention(x, k, v, sinks=s, **kwargs).sum())
            found[name, strategy] = "no error"
        except ValueError as e:
            found[name, strategy] = str(e)
    ctxpar.attention(q, k, v, layout="zigzag").sum().backward()
    found["after"] = "ok" if q.grad is not None and bool(torch.isfinite(q.grad).all()) else "no gradient"
    return found


def loss_on_lse(mesh) -> dict[str, str]:
    """A loss term on the returned lse (a z-loss on attention): once it silently added nothing
    to q.grad (lse was detached); now the backward refuses it. The output alone still trains."""
    found = {}
    for strategy in ("ring", "allgather", "alltoall", "hybrid"):
        q, k, v = _tensors()
        kwargs = dict(layout="zigzag", strategy=strategy, mesh=mesh if strategy == "hybrid" else None)
        out, lse = ctxpar.attention_with_lse(q, k, v, **kwargs)
        try:
            (out.sum() + lse.square().sum()).backward()
            found[strategy] = "no error"
        except RuntimeError as e:
            found[strategy] = str(e)
        out, lse = ctxpar.attention_with_lse(q, k, v, **kwargs)
        out.sum().backward()
        found[f"{strategy} out only"] = "ok" if q.grad is not None and bool(torch.isfinite(q.grad).all()) else "no grad"
    return found


def interrupted_once(module, name: str, error: type[BaseException]):
    """``module.name`` raising ``error`` on its first call (Ctrl-C in a compute step, or any
    failure), itself again afterwards."""
    real = getattr(module, name)

    def once(*args, **kwargs):
        setattr(module, name, real)
        raise error("interrupted in a compute step")

    setattr(module, name, once)


def interrupted_steps() -> dict[str, float | str]:
    """Ctrl-C (or a RuntimeError) on every rank in a strategy's first compute step, forward and
    then backward, with its communication in flight: the same call again must work and agree,
    out and every gradient (the largest difference). The ring once hung (its posted transfer
    was dropped and paired with the retry's); the all-gather's and all-to-all's collectives
    are checked alike."""
    from ctxpar.strategies import allgather, blockwise, ring

    q, k, v = _tensors()

    def out_and_gradients(strategy: str) -> tuple[torch.Tensor, ...]:
        out = ctxpar.attention(q, k, v, layout="zigzag", strategy=strategy)
        return out.detach(), *torch.autograd.grad((out * out).sum(), (q, k, v))

    found = {}
    for strategy, module, names in (("ring", ring, ("forward_tiles", "backward_tiles")),
                                    ("allgather", allgather, ("_attend_forward", "_attend_backward")),
                                    ("alltoall", blockwise, ("forward_tiles", "backward_tiles"))):
        want = out_and_gradients(strategy)
        for (phase, name), error in itertools.product(zip(("forward", "backward"), names),
                                                      (KeyboardInterrupt, RuntimeError)):
            case = f"{strategy} {phase} {error.__name__}"
            interrupted_once(module, name, error)
            try:
                out_and_gradients(strategy)
                found[case] = "not interrupted"
                continue
            except error:
                pass  # retried below, once the interrupted call's frames (and its transfers) are gone
            found[case] = max(float((a - b).abs().max()) for a, b in zip(out_and_gradients(strategy), want))
    return found


def under_autocast(rank: int, world: int) -> dict[str, dict[str, float]]:
    """q and k in float32 (as RoPE leaves them), v in bfloat16, under CPU autocast: once
    refused ("q, k, v dtypes differ") where SDPA casts all three to bfloat16. Errors of the
    output and of every gradient (summed over ranks) against float64 attention of the
    bfloat16-cast inputs, for ctxpar and for SDPA under autocast."""
    torch.manual_seed(11)
    full = [torch.randn(1, 4, 8 * world, 16), torch.randn(1, 2, 8 * world, 16),
            torch.randn(1, 2, 8 * world, 16).bfloat16()]
    weights = torch.randn(1, 4, 8 * world, 16)
    leaves = [t.clone().requires_grad_() for t in full]
    exact = [t.bfloat16().double().requires_grad_() for t in full]
    want = F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True)
    (want * weights).sum().backward()
    found = {}
    for strategy in ("ring", "allgather", "alltoall"):
        layout = ctxpar.get_layout("zigzag", world)
        cp = [t.clone().requires_grad_() for t in full]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ctxpar.attention(*(layout.shard(t, rank, dim=2) for t in cp), layout=layout, strategy=strategy)
            single = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        (out.float() * layout.shard(weights, rank, dim=2)).sum().backward()
        grads = torch.cat([t.grad.flatten() for t in cp])
        dist.all_reduce(grads)
        if strategy == "ring":
            (single.float() * weights).sum().backward()
        errors = {"out dtype": out.dtype == torch.bfloat16, "grad dtypes": [t.grad.dtype for t in cp] == [
            t.dtype for t in full]}
        errors["out"] = (out.double() - layout.shard(want, rank, dim=2)).abs().max().item()
        errors["out sdpa"] = (layout.shard(single, rank, dim=2).double() - layout.shard(want, rank, dim=2)
                              ).abs().max().item()
        errors["grads"] = (grads.double() - torch.cat([t.grad.flatten() for t in exact])).abs().max().item()
        errors["grads sdpa"] = (torch.cat([t.grad.flatten() for t in leaves]).double()
                                - torch.cat([t.grad.flatten() for t in exact])).abs().max().item()
        found[strategy] = errors
    return found


def run(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    return dict(disagree=disagreeing_ranks(rank, world, mesh), nonfinite=nonfinite_inputs(rank, world),
                dense_once=dense_once(rank, world), equal_layouts=layouts_equal_but_for_their_deal(rank, world, mesh),
                double_backward=double_backward(mesh), torch_func=torch_func(mesh),
                loss_on_lse=loss_on_lse(mesh), interrupted_steps=interrupted_steps(),
                under_autocast=under_autocast(rank, world))
