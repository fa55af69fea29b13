"""Everything the distributed tests run inside one spawned process group per world size.

Spawning costs seconds, a case milliseconds: so each world size spawns once
(``run_all``) and every case runs inside that group, reporting numbers that the test
functions in ``test_distributed.py`` then assert on.
"""

from __future__ import annotations

import functools
import itertools
import traceback
import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import ctxpar
from ctxpar import agreement, comm, kernels
from ctxpar.kernels.reference import reference_attention
from ctxpar.masks import Mask
from ctxpar.strategy_rules import kv_copies
from ctxpar.verify import (
    FP32_RTOL, TENSORS, UNIT_ROUNDOFF, max_abs_errors, rounded_partials_on, tolerances, torch_sdpa,
)

STRATEGIES = ("ring", "allgather", "alltoall", "hybrid")
LAYOUTS = ("contiguous", "zigzag", "striped")
# 12 query heads split over 1-4 ranks; 4 KV heads need 3 copies each for all-to-all on 3
# ranks, 1 KV head needs P copies; 9 KV heads are gathered by the all-gather in groups of 2
# and a last group of 1 (the grid's head counts all split into equal groups)
HEADS = {"mha": (12, 12), "gqa": (12, 4), "mqa": (12, 1), "gqa9": (18, 9)}
GRID_HEADS = ("mha", "gqa", "mqa")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
HYBRID_MESH = (2, 2)  # (ring, ulysses) degrees on 4 ranks


@dataclass(frozen=True)
class Case:
    strategy: str
    layout: str
    causal: bool
    heads: str
    dtype: str
    chunk: int = 3  # tokens per zigzag chunk: T = 2 * P * chunk
    scale: float | None = None
    memory: str = "dense"  # how q/k/v sit in memory: a key of MEMORY, or "per_rank": each rank its own
    documents: str | None = None  # a key of DOCUMENTS
    window: int | None = None
    sinks: bool = False

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        extra = f"-T{self.chunk}" if self.chunk != 3 else ""
        extra += f"-scale{self.scale}" if self.scale is not None else ""
        extra += f"-{self.memory}" if self.memory != "dense" else ""
        extra += f"-docs_{self.documents}" if self.documents else ""
        extra += f"-window{self.window}" if self.window else ""
        extra += "-sinks" if self.sinks else ""
        return f"{self.strategy}-{self.layout}-{mask}-{self.heads}-{self.dtype}{extra}"

    def documents_for(self, seq_len: int) -> tuple[int, ...] | None:
        return None if self.documents is None else DOCUMENTS[self.documents](seq_len)

    def runs_on(self, world: int) -> bool:
        if self.strategy == "hybrid":
            return world == HYBRID_MESH[0] * HYBRID_MESH[1]
        return self.strategy != "alltoall" or HEADS[self.heads][0] % world == 0


def _seeded_lengths(seq_len: int, seed: int, longest: int) -> tuple[int, ...]:
    """Document lengths 1..longest drawn from a seed (the same on every rank), summing to T."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], seq_len
    while left:
        n = min(left, int(torch.randint(1, longest + 1, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    return tuple(lengths)


# packed rows, as functions of T: 1-token documents, documents shorter than P, one
# document spanning several ranks, random lengths
DOCUMENTS = {
    "ones": lambda t: (1,) * t,
    "mixed": lambda t: (1, 2, t - 7, 1, 3),
    "random": lambda t: _seeded_lengths(t, seed=t, longest=9),
}


def mask_cases() -> list[Case]:
    """Documents, sliding windows (1 key, a few, more than T) and sinks, every strategy
    and layout; T = 2 * P * 5."""
    grid = []
    for strategy, layout in itertools.product(STRATEGIES, LAYOUTS):
        mask = functools.partial(Case, strategy, layout, heads="gqa", dtype="float32", chunk=5)
        # scale 0.3, not D**-0.5: a PARTIAL tile's backward dropping the caller's scale for the
        # default passed every case here
        grid += [mask(causal=True, documents="random"), mask(causal=False, documents="mixed", scale=0.3),
                 mask(causal=True, window=1), mask(causal=True, window=6, scale=0.3), mask(causal=True, window=100),
                 mask(causal=True, documents="mixed", window=4), mask(causal=True, sinks=True),
                 mask(causal=False, documents="random", sinks=True)]
    for strategy in STRATEGIES:
        grid += [Case(strategy, "balanced", True, "gqa", "float32", chunk=6, documents="random"),
                 Case(strategy, "balanced", True, "mqa", "float32", chunk=6, documents="mixed", window=5),
                 Case(strategy, "balanced", False, "mha", "float32", chunk=6, documents="random", sinks=True),
                 Case(strategy, "zigzag", True, "mha", "bfloat16", chunk=5, documents="random", window=5, sinks=True),
                 Case(strategy, "striped", True, "mqa", "float64", chunk=5, documents="ones"),
                 Case(strategy, "zigzag", True, "gqa", "float32", chunk=40, documents="random", window=17),
                 # windows of 16 keys or more over shards as long: the band is cut as ANTI_CAUSAL tiles on
                 # every P and strategy (shorter ones mostly as PARTIAL). Their forward computed in
                 # float32 for float64 inputs, or with the default scale, passed every case before
                 Case(strategy, "contiguous", True, "gqa", "float64", chunk=10, window=16),
                 Case(strategy, "zigzag", True, "mqa", "float64", chunk=20, documents="mixed", window=17),
                 Case(strategy, "contiguous", True, "gqa", "float32", chunk=10, window=16, scale=0.3)]
    return grid


def exactness_cases() -> list[Case]:
    grid = [Case(*c) for c in itertools.product(STRATEGIES, LAYOUTS, (True, False), GRID_HEADS,
                                                 ("float32", "bfloat16"))]
    for strategy in STRATEGIES:
        # longer shards cross the fused kernel's internal tile boundaries
        grid += [Case(strategy, layout, True, "gqa", "float32", chunk=40) for layout in LAYOUTS]
        grid += [Case(strategy, "zigzag", True, "gqa", "float64"), Case(strategy, "striped", False, "mqa", "float64")]
        grid += [Case(strategy, "zigzag", True, "mha", "float32", scale=0.3),
                 Case(strategy, "striped", True, "gqa", "bfloat16", memory="bshd"),
                 Case(strategy, "zigzag", True, "gqa", "float32", memory="interleaved"),
                 Case(strategy, "contiguous", False, "mha", "bfloat16", memory="d_major"),
                 Case(strategy, "zigzag", True, "gqa", "float32", memory="heads_last"),
                 # each rank's q, k, v laid out otherwise: the ring once refused heads-innermost K/V from
                 # inside the strategy, its peers waiting until the timeout, where one rank's were so
                 Case(strategy, "striped", True, "gqa", "float32", memory="per_rank"),
                 # float16: blocks computed and merged in float32, lse returned in float32 (accumulators
                 # in float16 passed every bfloat16 and float32 case)
                 Case(strategy, "zigzag", True, "gqa", "float16")]
    # the all-gather's last, smaller group of K/V heads (9 = 4 x 2 + 1): dropping it passed the
    # grid, whose head counts all split into equal groups
    grid += [Case("allgather", "zigzag", True, "gqa9", "float32"),
             Case("allgather", "striped", False, "gqa9", "bfloat16")]
    return grid + mask_cases()


def _inputs(case: Case, world: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Global fp64 q, k, v, dout, already rounded to the case's dtype."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv = HEADS[case.heads]
    b, t, d = 2, 2 * world * case.chunk, 8
    shapes = [(b, h, t, d), (b, hkv, t, d), (b, hkv, t, d), (b, h, t, d)]
    dtype = DTYPES[case.dtype]
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in shapes)


# (B, H, S, D) leaves laid out in memory as users produce them
MEMORY = {
    "dense": lambda t: t,
    "bshd": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),  # (B, S, H, D) memory
    "interleaved": lambda t: torch.stack([t, t], -1)[..., 0],  # unbound from (..., D, 2): last-dim stride 2
    "d_major": lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),  # (B, H, D, S) memory
    "heads_last": lambda t: t.contiguous(memory_format=torch.channels_last),  # (B, S, D, H) memory
}


def _local(t: torch.Tensor, dtype: torch.dtype, memory: str, rank: int) -> torch.Tensor:
    """A leaf in ``dtype`` with the strides of ``MEMORY[memory]`` (per_rank: the rank's own)."""
    if memory == "per_rank":
        memory = ("heads_last", "dense", "d_major", "bshd", "interleaved")[rank % 5]
    return MEMORY[memory](t.to(dtype)).detach().requires_grad_()


def check_case(case: Case, rank: int, world: int, group=None, group_rank: int | None = None, mesh=None,
               device: str = "cpu") -> str:
    """Run one case through ctxpar on this rank (its tensors on ``device``) and compare its
    shard with the fp64 reference, computed on the CPU: "ok", or what is wrong, with the
    case, the rank and the numbers (the message a failing test prints)."""
    try:
        problems = _case_problems(case, rank, world, group, group_rank, mesh, device)
    except Exception:  # reported like any other problem: one case must not hide the others
        problems = [f"raised\n{traceback.format_exc()}"]
    return "ok" if not problems else f"rank {rank} of P={world}, {case.id}: " + "; ".join(problems)


def _case_problems(case: Case, rank: int, world: int, group, group_rank: int | None, mesh, device: str) -> list[str]:
    group_rank = rank if group_rank is None else group_rank
    if mesh is not None:
        group_rank = ctxpar.hybrid_rank(mesh)
    dtype = DTYPES[case.dtype]
    q, k, v, dout = _inputs(case, world, seed=zlib.crc32(case.id.encode()))
    scale = case.scale if case.scale is not None else q.shape[-1] ** -0.5
    seq_len = q.shape[2]
    documents = case.documents_for(seq_len)
    if case.layout == "balanced":
        layout = ctxpar.balanced_layout(world, seq_len, causal=case.causal, documents=documents, window=case.window)
    else:
        layout = ctxpar.get_layout(case.layout, world)
    sinks = torch.linspace(-1.0, 2.0, q.shape[1], dtype=torch.float64) if case.sinks else None

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = sinks.clone().requires_grad_() if case.sinks else None
    mask = Mask(case.causal, documents, case.window if case.window and case.window < seq_len else None)
    out, lse = reference_attention(*ref_in, causal=case.causal, scale=scale, mask=mask, sinks=ref_sinks)
    out.backward(dout)
    ref = dict(out=out.detach(), lse=lse.detach(), dq=ref_in[0].grad, dk=ref_in[1].grad, dv=ref_in[2].grad)

    baseline = None
    if dtype != torch.float32:  # (with sinks: the same call without them, for the error scale of this dtype)
        dense = dense_mask(mask, seq_len)
        low = torch_sdpa(*(t.to(device, dtype) for t in (q, k, v, dout)), causal=case.causal, scale=scale,
                         mask=None if dense is None else dense.to(device))
        baseline = max_abs_errors({n: t.cpu() for n, t in low.items()}, ref)

    shard = lambda t: layout.shard(t, group_rank, dim=2)  # noqa: E731
    local = [_local(shard(t).to(device), dtype, case.memory, rank) for t in (q, k, v)]
    local_sinks = sinks.to(device, torch.float32).requires_grad_() if case.sinks else None
    got_out, got_lse = ctxpar.attention_with_lse(
        *local, layout=layout, group=group, mesh=mesh, causal=case.causal, scale=case.scale, strategy=case.strategy,
        documents=documents, window=case.window, sinks=local_sinks,
    )
    got_out.backward(shard(dout).to(device, dtype))
    got = {n: t.detach().cpu() for n, t in
           dict(out=got_out, lse=got_lse, dq=local[0].grad, dk=local[1].grad, dv=local[2].grad).items()}
    errors = max_abs_errors(got, {n: shard(t) for n, t in ref.items()})
    tol = tolerances(dtype, ref, baseline, rounded_partials=rounded_partials_on(local[0], world))
    problems = [f"{n} max abs error {errors[n]:.3g} > tolerance {tol[n]:.3g}" for n in TENSORS
                if not errors[n] <= tol[n]]
    problems += [f"{n} not finite" for n in TENSORS if not bool(torch.isfinite(got[n]).all())]
    if dtype in UNIT_ROUNDOFF and not rounded_partials_on(local[0], world):
        copies = {"alltoall": world, "hybrid": mesh["ulysses"].size() if mesh is not None else 1}.get(case.strategy, 1)
        problems += _final_rounding_problems(
            got, ref, (q, k, v, dout), dense_mask(mask, seq_len), layout, shard, group, group_rank,
            causal=case.causal, scale=scale, kv_copies=kv_copies(k.shape[1], copies))
    if case.sinks:  # each rank holds its rows' share of the sinks' gradient
        total = local_sinks.grad.detach().double()
        if dist.is_initialized():
            dist.all_reduce(total, group=group)
        error = (total.cpu() - ref_sinks.grad).abs()
        # d/d sink_h = -sum over rows of p_sink * (dout . out): out rounded to the case's
        # dtype (as the kernels' delta is) perturbs each term by up to its eps
        terms = torch.exp(sinks.view(1, -1, 1) - ref["lse"]) * (dout * ref["out"]).abs().sum(-1)
        eps = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(dtype, FP32_RTOL)
        allowed = 2 * eps * terms.sum((0, 2)) + FP32_RTOL * ref_sinks.grad.abs().max()
        if not bool((error <= allowed).all()):
            problems.append(f"sink gradient max abs error {float(error.max()):.3g} > tolerance "
                            f"{float(allowed[error.argmax()]):.3g}")
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    dtypes = (got_out.dtype, got_lse.dtype, *(t.grad.dtype for t in local))
    if dtypes != (dtype, lse_dtype, dtype, dtype, dtype):
        problems.append(f"dtypes of out, lse, dq, dk, dv are {dtypes} for {dtype} inputs")
    return problems


def dense_mask(mask: Mask, seq_len: int) -> torch.Tensor | None:
    """``mask`` as a (T, T) bool tensor; None where it is plain causal or none."""
    return None if mask.is_plain else mask.visible(torch.arange(seq_len), torch.arange(seq_len), seq_len)


def _final_rounding_problems(got: dict, ref: dict, inputs: tuple, dense: torch.Tensor | None, layout, shard, group,
                             group_rank: int, *, causal: bool, scale: float, kv_copies: int) -> list[str]:
    """Where blocks are computed and summed in float32 (the CPU kernels on low-precision
    inputs), a low-precision result is the float32 one rounded once: out and each gradient
    within one unit roundoff of themselves (plus float32's noise) of exact attention on the
    rounded inputs, the gradients' taken with the backward's delta = rowsum(dout * out) of
    the rounded out (as single-process attention takes it). Much tighter than ``tolerances``'
    twice SDPA's error, which lets through a strategy summing partials in the low dtype.
    All-to-all's K/V head copies round each copy's dK/dV once more before autograd sums
    them (known, allowed per copy)."""
    pieces = [(group_rank, got["out"].double(), got["lse"].double())]
    if dist.is_initialized():
        pieces = [None] * dist.get_world_size(group)
        dist.all_gather_object(pieces, (group_rank, got["out"].double(), got["lse"].double()), group=group)
    pieces = [piece[1:] for piece in sorted(pieces, key=lambda piece: piece[0])]
    out, lse = (layout.unshard([piece[i] for piece in pieces], dim=2) for i in (0, 1))
    q, k, v, dout = inputs
    want = dict(out=ref["out"], **dict(zip(("dq", "dk", "dv"), kernels.attention_backward(
        dout, q, k, v, out, lse, causal=causal and dense is None, scale=scale, mask=dense))))
    unit = UNIT_ROUNDOFF[got["out"].dtype]
    gradients = max(want[n].abs().max().item() for n in ("dq", "dk", "dv"))
    problems = []
    for name, exact in want.items():
        exact = shard(exact)
        slack = FP32_RTOL * (gradients if name != "out" else exact.abs().max().item())
        if name in ("dk", "dv"):
            slack += (kv_copies - 1) * unit * gradients
        excess = ((got[name].double() - exact).abs() - unit * exact.abs() - slack).max().item()
        if excess > 0:
            problems.append(f"{name} off by {excess:.3g} more than one {got['out'].dtype} rounding of the float32 "
                            f"result")
    return problems


def _bad_inputs(world: int, mesh) -> dict[str, tuple]:
    """name -> (args, kwargs) of calls that must raise ValueError on every rank."""
    good = lambda h=4, dt=torch.float32, n=6: torch.randn(1, h, n, 8, dtype=dt)  # noqa: E731
    q, kv = good(), good(2)
    wrong_world = ctxpar.ZigzagLayout(world + 1)
    bad = {
        "heads": ((q, good(3), good(3)), dict(layout="zigzag")),
        "dtype": ((q, kv.double(), kv.double()), dict(layout="zigzag")),
        "device": ((q, kv.to("meta"), kv.to("meta")), dict(layout="zigzag")),
        "kv_shape": ((q, kv, good(2, n=8)), dict(layout="zigzag")),
        "seq_mismatch": ((q, good(2, n=8), good(2, n=8)), dict(layout="zigzag")),
        # q of 2 rows against K/V of 1: once accepted, out read uninitialised memory (values near 1e257)
        "batch_mismatch": ((torch.randn(2, 4, 6, 8), kv, kv), dict(layout="zigzag")),
        "rank3": ((q[0], kv[0], kv[0]), dict(layout="zigzag")),
        "layout_world": ((q, kv, kv), dict(layout=wrong_world)),
        "layout_name": ((q, kv, kv), dict(layout="spiral")),
        "layout_type": ((q, kv, kv), dict(layout=["zigzag"])),
        "strategy": ((q, kv, kv), dict(layout="zigzag", strategy="telepathy")),
        "scale": ((q, kv, kv), dict(layout="zigzag", scale=-1.0)),
        "scale_overflow": ((q, kv, kv), dict(layout="zigzag", scale=10**400)),
        "scale_under_float32": ((q, kv, kv), dict(layout="zigzag", scale=1e-50)),  # once NaN, for finite inputs
        # finite as a Python float, inf in float32: without its upper bound most outputs were NaN
        "scale_over_float32": ((q, kv, kv), dict(layout="zigzag", scale=1e39)),
        "int_dtype": ((q.long(), kv.long(), kv.long()), dict(layout="zigzag")),
        "empty": ((good(n=0), good(2, n=0), good(2, n=0)), dict(layout="zigzag")),
        "causal_type": ((q, kv, kv), dict(layout="zigzag", causal="no")),
        "consistency_type": ((q, kv, kv), dict(layout="zigzag", check_consistency="no")),  # once read as True
        "hybrid_without_mesh": ((q, kv, kv), dict(layout="zigzag", strategy="hybrid")),
        "hybrid_with_group": ((q, kv, kv), dict(layout="zigzag", strategy="hybrid", group=dist.group.WORLD)),
        "mesh_for_ring": ((q, kv, kv), dict(layout="zigzag", strategy="ring", mesh=object())),
        "mesh_type": ((q, kv, kv), dict(layout="zigzag", strategy="hybrid", mesh="2x2")),
        "group_type": ((q, kv, kv), dict(layout="zigzag", group="cp")),
        "documents_sum": ((q, kv, kv), dict(layout="zigzag", documents=(3, 4))),
        "documents_empty": ((q, kv, kv), dict(layout="zigzag", documents=(6 * world, 0))),
        "documents_float": ((q, kv, kv), dict(layout="zigzag", documents=torch.tensor([6.0 * world]))),
        "documents_cu_seqlens_short": ((q, kv, kv), dict(layout="zigzag", documents=[0, 2, 5])),
        "window_zero": ((q, kv, kv), dict(layout="zigzag", window=0)),
        "window_not_causal": ((q, kv, kv), dict(layout="zigzag", window=3, causal=False)),
        "sinks_shape": ((q, kv, kv), dict(layout="zigzag", sinks=torch.zeros(3))),
        "sinks_nan": ((q, kv, kv), dict(layout="zigzag", sinks=torch.full((4,), float("nan")))),
        # finite in float64, inf in the float32 q's attention is computed in: it gave NaN gradients
        "sinks_past_float32": ((q, kv, kv), dict(layout="zigzag", sinks=torch.full((4,), 1e39, dtype=torch.float64))),
        "sinks_int": ((q, kv, kv), dict(layout="zigzag", sinks=torch.zeros(4, dtype=torch.long))),
        "sinks_meta": ((q, kv, kv), dict(layout="zigzag", sinks=torch.zeros(4, device="meta"))),
    }
    if world > 1:  # gloo carries CPU and CUDA tensors only
        bad["gloo_device"] = ((q.to("meta"), kv.to("meta"), kv.to("meta")), dict(layout="zigzag"))
    if world > 1:  # zigzag needs an even local length, and 5 is odd (one rank takes any length)
        bad["length"] = ((good(n=5), good(2, n=5), good(2, n=5)), dict(layout="zigzag"))
    if world > 1:  # 5 query heads cannot be split over 2, 3 or 4 ranks
        bad["alltoall_heads"] = ((good(5), good(5), good(5)), dict(layout="zigzag", strategy="alltoall"))
    if mesh is not None:
        bad["hybrid_layout_world"] = ((q, kv, kv), dict(layout=ctxpar.ZigzagLayout(2), strategy="hybrid", mesh=mesh))
        bad["hybrid_heads"] = ((good(5), good(5), good(5)), dict(layout="zigzag", strategy="hybrid", mesh=mesh))
        # ranks not ascending along a dim: once silently wrong (group ranks taken for coordinates)
        permuted = DeviceMesh("cpu", torch.tensor([[3, 1], [0, 2]]), mesh_dim_names=("ring", "ulysses"))
        bad["hybrid_mesh_permuted"] = ((q, kv, kv), dict(layout="zigzag", strategy="hybrid", mesh=permuted))
        # descending along the ring dim alone (the mesh above descends along both): prefill's owner of the last
        # position, found by the mesh's coordinates, was another rank than the one holding it
        rows_down = DeviceMesh("cpu", torch.tensor([[2, 3], [0, 1]]), mesh_dim_names=("ring", "ulysses"))
        bad["hybrid_mesh_rows_descending"] = ((q, kv, kv), dict(layout="zigzag", strategy="hybrid", mesh=rows_down))
        # meshes given where another kind is taken: each refusal names what to pass instead
        from torch.distributed.device_mesh import init_device_mesh

        dp_cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        bad["group_dp_cp_mesh"] = ((q, kv, kv), dict(layout="zigzag", group=dp_cp))
        bad["group_mesh_dim"] = ((q, kv, kv), dict(layout="zigzag", group=dp_cp["cp"]))  # torch's idiom
        bad["group_hybrid_mesh"] = ((q, kv, kv), dict(layout="zigzag", group=mesh))
        bad["hybrid_dp_cp_mesh"] = ((q, kv, kv), dict(layout="zigzag", strategy="hybrid", mesh=dp_cp))
        replicas = init_device_mesh("cpu", (1, *HYBRID_MESH), mesh_dim_names=("dp", "ring", "ulysses"))
        bad["hybrid_3d_mesh"] = ((q, kv, kv), dict(layout="zigzag", strategy="hybrid", mesh=replicas))
        # a tensor-parallel plan that keeps DTensor outputs: torch's error came from inside the ring
        from torch.distributed.tensor import Replicate, distribute_tensor

        bad["q_dtensor"] = ((distribute_tensor(q, mesh["ulysses"], [Replicate()]), kv, kv), dict(layout="zigzag"))
    return bad


def attention_or_refusal(*args, **kwargs) -> torch.Tensor | str:
    """``ctxpar.attention(*args, **kwargs)``'s output, or its ValueError's message. A refusal
    after K/V moved (a check placed inside a strategy) reads as that, not as its message:
    refusals come before any transfer (the consistency check's all-gather, of signatures,
    counts as a collective of no bytes)."""
    with ctxpar.record(timing=False) as moved:
        try:
            return ctxpar.attention(*args, **kwargs)
        except ValueError as e:
            if moved.bytes_sent or moved.bytes_received:
                return f"refused only after moving K/V ({moved.bytes_sent} bytes sent, {moved.bytes_received} received)"
            return str(e)


def _refusal(*args, **kwargs) -> str:
    result = attention_or_refusal(*args, **kwargs)
    return result if isinstance(result, str) else "NO ERROR"


def _check_bad_inputs(rank: int, world: int, mesh) -> dict[str, str]:
    messages = {}
    for name, (args, kwargs) in _bad_inputs(world, mesh).items():
        messages[name] = _refusal(*args, **kwargs)
    if world > 1:  # a group this rank is not in: every rank must take part in new_group
        others = dist.new_group(list(range(1, world)))
        if rank == 0:
            messages["non_member"] = _refusal(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8),
                                              torch.randn(1, 2, 4, 8), layout="contiguous", group=others)
            messages.update(_non_member_entries(others))
    # no rank was left inside a collective: a full attention call still works afterwards
    messages["after"] = check_case(Case("ring", "zigzag", True, "gqa", "float32"), rank, world)
    return messages


def _non_member_entries(group) -> dict[str, str]:
    """The refusals of ctxpar's other entries taking a CP group, called on a rank outside
    ``group`` (they once all said to call ctxpar.attention only on its ranks)."""
    from ctxpar.inference import KVCache, generate
    from ctxpar.models import ModelConfig, Transformer
    from ctxpar.parallelize import apply_context_parallel, cp_loss

    cfg = ModelConfig(layers=1, hidden=16, heads=4, kv_heads=2, head_dim=4, ffn=16, vocab=20)
    calls = {
        "cp_loss": lambda: cp_loss(torch.randn(1, 4, 20), torch.zeros(1, 4, dtype=torch.long), group=group),
        "apply_context_parallel": lambda: apply_context_parallel(Transformer(cfg), layout="zigzag", group=group),
        "KVCache": lambda: KVCache.for_model(cfg, batch=1, capacity=8, group=group),
        "generate": lambda: generate(Transformer(cfg), torch.zeros(1, 4, dtype=torch.long), layout="zigzag",
                                     group=group, new_tokens=1),
    }
    messages = {}
    for entry, call in calls.items():
        try:
            call()
            messages[f"non_member_{entry}"] = "NO ERROR"
        except ValueError as e:
            messages[f"non_member_{entry}"] = str(e)
    return messages


# (B, H, H_kv, S, D): GQA, MQA (P copies of its K/V head for all-to-all), and 2 K/V heads, which on 4 ranks need
# U / gcd(H_kv, U) = 2 copies each: sending U = 4 once moved about a quarter more, and the two shapes before could not
# tell (their fewest copies are 1 or U)
TRAFFIC_SHAPES = [(2, 12, 4, 6, 8), (1, 12, 1, 4, 8), (1, 12, 2, 4, 8)]


def _check_traffic(rank: int, world: int, mesh) -> dict:
    """Bytes counted by the comm layer, forward and backward, per strategy, shape, dtype."""
    counted = {}
    for strategy, shape, dtype in itertools.product(STRATEGIES, TRAFFIC_SHAPES, (torch.bfloat16, torch.float64)):
        if strategy == "hybrid" and mesh is None:
            continue
        b, h, hkv, s, d = shape
        q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
        k = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
        v = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
        kwargs = dict(mesh=mesh) if strategy == "hybrid" else {}
        with ctxpar.record() as fwd:
            out = ctxpar.attention(q, k, v, layout="zigzag", strategy=strategy, **kwargs)
        with ctxpar.record() as bwd:
            out.sum().backward()
        counted[(strategy, shape, str(dtype))] = dict(
            forward=(fwd.bytes_sent, fwd.bytes_received), backward=(bwd.bytes_sent, bwd.bytes_received),
            syncs=(fwd.collectives, fwd.waits, bwd.collectives, bwd.waits))
    return counted


def _check_window_traffic(rank: int, world: int) -> dict:
    """Ring bytes (sent, received) and (posts, waits) of the forward and the backward under
    sliding windows on the contiguous layout: halos of one shard or less, of more than one
    shard, and a window wider than the sequence."""
    b, h, hkv, s, d = 1, 4, 2, 6, 8
    counted = {}
    for window in (1, 4, s + 3, 2 * s + 1, 10 * s * world):
        q = torch.randn(b, h, s, d, requires_grad=True)
        k, v = (torch.randn(b, hkv, s, d, requires_grad=True) for _ in range(2))
        with ctxpar.record() as fwd:
            out = ctxpar.attention(q, k, v, layout="contiguous", window=window)
        with ctxpar.record() as bwd:
            out.sum().backward()
        counted[window] = dict(sent=(fwd.bytes_sent, bwd.bytes_sent), received=(fwd.bytes_received,
                                                                                bwd.bytes_received),
                               syncs=(fwd.collectives, fwd.waits, bwd.collectives, bwd.waits))
    return counted


def _check_subgroups(rank: int, world: int) -> dict:
    """CP over two disjoint halves of the world at once (the group is not WORLD); then over
    the odd and the even ranks, each listed in descending order to ``new_group``, each rank
    sharding by its rank in the group, which torch numbers by ascending global rank."""
    half = world // 2
    groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, world)))]
    mine, group_rank = (groups[0], rank) if rank < half else (groups[1], rank - half)
    found = {strategy: check_case(Case(strategy, "striped", True, "gqa", "float32"), rank, half, group=mine,
                                   group_rank=group_rank)
             for strategy in ("ring", "allgather", "alltoall")}
    # the last rank passes K/V of 3 heads for 2 in the upper half, whose group ranks are not its global ranks:
    # once the refusal named the culprit by its group rank (rank half - 1, a rank of the other half)
    q, kv = torch.randn(1, 4, 4, 8), torch.randn(1, 3 if rank == world - 1 else 2, 4, 8)
    found["refused_by_global_rank"] = _refusal(q, kv, kv, layout="zigzag", group=mine)
    # the same through the exchange of the other calls (prefill, decode, a model's forward); and a value
    # unknown (-1) on one rank compared nowhere: judged by each rank's own value, the rank that knew it not
    # went on alone while its peers raised
    def compared(values: dict, error=None, where_known=()) -> str:
        try:
            agreement.check_values_agree(values, mine, error, "decode step", where_known)
            return "NO ERROR"
        except ValueError as e:
            return str(e)

    found["values_refused_by_global_rank"] = compared({"step": 4}, ValueError("mine") if rank == world - 1 else None)
    # requires_grad on the upper half's group rank 0 alone: once named by group ranks, "rank 0", of the other half
    q_grad, kv_grad = (t.clone().requires_grad_(rank != world - 1) for t in (q, torch.randn(1, 2, 4, 8)))
    found["requires_grad_by_global_rank"] = _refusal(q_grad, kv_grad, kv_grad, layout="zigzag", group=mine)
    # a hybrid mesh's rows, then its columns (decode's exchange): rank 0's refusal reaches rank 3, which shares
    # no row with it, through the columns; passed on in the rows alone, rank 3 went on alone
    rows = [dist.new_group(list(range(r, r + half))) for r in range(0, world, half)]
    columns = [dist.new_group(list(range(c, world, half))) for c in range(half)]
    agreed = [rows[rank // half], columns[rank % half]]
    try:
        agreement.check_values_agree({"step": 4}, agreed, ValueError("mine") if rank == 0 else None, "decode step")
        found["refusal_through_rows_and_columns"] = "NO ERROR"
    except ValueError as e:
        found["refusal_through_rows_and_columns"] = str(e)
    found["unknown_on_one_rank"] = [compared({"weights": -1 if rank % 2 == 0 else 7}, where_known=("weights",)),
                                    compared({"weights": 7 + rank}, where_known=("weights",)),
                                    # -1 is a value like any other where it may not stand for unknown
                                    compared({"step": -1 if rank % 2 == 0 else 7})]
    # a layout for two ranks on a group of one, torch.distributed initialised: the group's size is the cause
    alone = [dist.new_group([r]) for r in range(world)][rank]
    found["layout_for_two_on_a_group_of_one"] = _refusal(q, q, q, layout=ctxpar.get_layout("zigzag", 2), group=alone)
    listed = [list(range(world - 1, -1, -2)), list(range(world - 2, -1, -2))]  # P=4: [3, 1], [2, 0]
    parities = [dist.new_group(ranks) for ranks in listed]
    group = parities[rank % 2 == 0]
    found["listed_descending"] = check_case(Case("ring", "zigzag", True, "gqa", "float32"), rank, half, group=group,
                                            group_rank=dist.get_rank(group))
    # from each group rank (prefill broadcasts over the cache's group so): a source taken as a global rank
    # delivered group [3, 1]'s rank 1 from global rank 1, with no error; and the bytes each rank counts
    # (sent by the source, received by the others: a source compared with the global rank swapped them)
    found["broadcast_from_each_group_rank"], found["broadcast_bytes"] = [], []
    for src in range(half):
        with ctxpar.record(timing=False) as rec:
            found["broadcast_from_each_group_rank"].append(comm.broadcast(torch.tensor([float(rank)]), src,
                                                                          group).item())
        found["broadcast_bytes"].append((rec.bytes_sent, rec.bytes_received))
    return found


def _check_hybrid_meshes(rank: int, world: int) -> dict:
    """Hybrid on meshes other than the square one: all-to-all only, ring only, and the
    dims named in the other order (so the CP rank is not the global rank; and on 4 x 1,
    degrees read by the dims' positions, not their names, would be swapped). On each, what
    ``topology.broadcast`` from every place and ``topology.all_gather`` deliver of the CP ranks'
    own places (only a mesh with U != R tells a ulysses coordinate from a ring one)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ctxpar import topology

    meshes = {"ring1xulysses4": ((1, 4), ("ring", "ulysses")), "ring4xulysses1": ((4, 1), ("ring", "ulysses")),
              "ulysses2xring2": ((2, 2), ("ulysses", "ring")), "ulysses4xring1": ((4, 1), ("ulysses", "ring"))}
    out = {}
    for name, (shape, names) in meshes.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        topo = topology.from_mesh(mesh)
        place = torch.tensor([float(topo.rank)])
        q = torch.randn(1, 4, 4, 8, requires_grad=rank != 0)
        # with sinks too: each rank's heads' sinks sliced by the global rank, not the ulysses one, passed the
        # square mesh's default dim order alone
        out[name] = dict(degrees=(topo.ulysses_degree, topo.ring_degree),
                         verdict=check_case(Case("hybrid", "zigzag", True, "gqa", "float32"), rank, world, mesh=mesh),
                         sinks_verdict=check_case(Case("hybrid", "zigzag", True, "gqa", "float32", sinks=True), rank,
                                                  world, mesh=mesh),
                         cp_rank=ctxpar.hybrid_rank(mesh),
                         # a copy each time: the ranks other than src receive into the tensor they pass
                         broadcast=[topology.broadcast(place.clone(), src, topo).item() for src in range(world)],
                         all_gather=topology.all_gather(place, topo).flatten().tolist(),
                         requires_grad_on_rank_0_alone=_refusal(q, q, q, layout="zigzag", strategy="hybrid",
                                                                mesh=mesh))
    return out


def _check_consistency(rank: int, world: int) -> dict:
    """check_consistency=True with rank-dependent mistakes: every rank raises, none hangs."""
    def call(local_len: int = 4, kv_heads: int = 2, causal: bool = True, layout="zigzag", documents=None,
             check=True) -> str:
        q = torch.randn(1, 4, local_len, 8)
        kv = torch.randn(1, kv_heads, local_len, 8)
        try:
            ctxpar.attention(q, kv, kv, layout=layout, causal=causal, documents=documents, check_consistency=check)
            return "ok"
        except ValueError as e:
            return str(e)

    last = rank == world - 1
    return dict(
        length=call(local_len=6 if last else 4),
        invalid=call(kv_heads=3 if last else 2),
        causal=call(causal=not last),
        documents=call(documents=(1, 4 * world - 1) if last else (2, 4 * world - 2)),
        balanced_deal=call(local_len=8, layout=ctxpar.balanced_layout(world, 8 * world, chunks=4 if last else 2)),
        # dealt by other documents on the last rank: a fingerprint without the deal once let it pass
        balanced_documents=call(local_len=8, layout=ctxpar.balanced_layout(
            world, 8 * world, documents=(8 * world - 3, 3) if last else (3, 8 * world - 3), tolerance=2)),
        # a falsy flag the last rank alone refused skipped the exchange there: its peers waited out the timeout
        invalid_flag=call(check=None if last else True),
        agreeing=call(),
    )


def _check_auto(rank: int, world: int) -> dict:
    """strategy="auto": forward and backward equal to the ring's, the same choice recorded on
    every rank; then the last rank predicting on other hardware: every rank raises."""
    from ctxpar import auto
    from ctxpar.plan import get_hardware

    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, h, 64, 16, generator=gen, requires_grad=True) for h in (8, 2, 2))
    dout = torch.randn(1, 8, 64, 16, generator=gen)
    grads = {}
    for strategy in ("auto", "ring"):
        with ctxpar.record() as rec:
            out = ctxpar.attention(q, k, v, layout="zigzag", strategy=strategy)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        grads[strategy] = (out, dq, dk, dv)
        if strategy == "auto":
            choices = rec.strategy_choices
    error = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads["auto"], grads["ring"]))
    # an H100 at its bf16 rates for these float32 inputs (no float32 figure): there, unlike at its
    # float32 rates, the CPU default and the H100 choose differently
    h100 = replace(get_hardware("H100-SXM"), fp32_peak_flops=0.0)

    def predicted(hw) -> str:
        auto.set_hardware(hw)
        try:
            return auto.choose(q, k, world=world, layout_name="zigzag", mask=Mask(causal=True), backward=True)[0]
        finally:
            auto.set_hardware(None)

    on_cpu, on_h100 = predicted(None), predicted(h100)  # the CPU default and an H100 choose differently here
    if rank == world - 1:
        auto.set_hardware(h100)
    try:
        with ctxpar.record() as refused:
            ctxpar.attention(q, k, v, layout="zigzag", strategy="auto")
        disagreeing = "ok"
    except ValueError as e:
        disagreeing = str(e)
    finally:
        auto.set_hardware(None)
    return dict(error=error, choices=choices, predicted=(on_cpu, on_h100), disagreeing=disagreeing,
                refused_choices=refused.strategy_choices)


def _check_loss_weighting(rank: int, world: int) -> dict:
    """cp_loss when ranks hold different numbers of labelled tokens (rank 0: none)."""
    from ctxpar.parallelize import IGNORE_INDEX, cp_loss

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 4 * world, 5, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 5, (1, 4 * world), generator=gen)
    if world > 1:
        labels[0, :4] = IGNORE_INDEX  # every label of rank 0's contiguous shard
    labels[0, -1] = IGNORE_INDEX
    want = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=IGNORE_INDEX).item()
    local = slice(4 * rank, 4 * rank + 4)
    share, loss = cp_loss(logits[:, local], labels[:, local])
    shares = torch.tensor([share.item()], dtype=torch.float64)
    dist.all_reduce(shares)
    return dict(want=want, loss=loss.item(), sum_of_shares=shares.item())


class _LazyTransfers:
    """Stands in for ``dist.batch_isend_irecv``'s requests: the transfer is posted only when one
    of its requests is first waited for, so a send buffer is read at the latest moment a
    transport may read it (NCCL on a busy stream, gloo for large messages): a buffer written
    again before its ``wait`` sends the new contents. ``waited``: which requests were."""

    def __init__(self, ops) -> None:
        self.ops, self.real, self.waited = ops, None, [False] * len(ops)

    def request(self, i: int):
        transfers = self

        class Request:
            def wait(self) -> bool:
                if transfers.real is None:
                    transfers.real = dist.batch_isend_irecv(transfers.ops)
                transfers.waited[i] = True
                return transfers.real[i].wait()

            def is_completed(self) -> bool:
                return transfers.real is not None and transfers.real[i].is_completed()

        return Request()


def _check_ring_on_a_lazy_transport(rank: int, world: int) -> dict:
    """Ring attention, plain causal and with a window that ends the ring early, forward and
    backward on ``_LazyTransfers``: the errors against float64, requests never waited for, and
    for each forward tile whether the next shard's transfer was posted while it was computed
    (the overlap: a forward waiting before it computes changed no number and no counter)."""
    import ctxpar.strategies.ring as ring

    posted: list[_LazyTransfers] = []

    class LazyDist:  # ctxpar.comm's dist, its batch_isend_irecv lazy
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def batch_isend_irecv(ops):
            posted.append(_LazyTransfers(ops))
            return [posted[-1].request(i) for i in range(len(ops))]

    comms, overlapped = [], []
    real_init, real_forward_tiles = ring.RingComm.__init__, ring.forward_tiles

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        comms.append(self)

    def forward_tiles(*args, **kwargs):
        overlapped.append(any(c.posted for c in comms))
        return real_forward_tiles(*args, **kwargs)

    comm.dist, ring.RingComm.__init__, ring.forward_tiles = LazyDist(), init, forward_tiles
    found = {}
    try:
        for name, window in (("causal", None), ("window", 5)):
            comms.clear(), overlapped.clear(), posted.clear()
            gen = torch.Generator().manual_seed(3)
            layout = ctxpar.get_layout("contiguous" if window else "zigzag", world)
            q, k, v, dout = (torch.randn(1, h, 8 * world, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
            local = [layout.shard(x, rank, dim=2).clone().requires_grad_() for x in (q, k, v)]
            out = ctxpar.attention(*local, layout=layout, window=window, check_consistency=False)
            forward_overlapped = list(overlapped)
            out.backward(layout.shard(dout, rank, dim=2))
            whole = [x.clone().requires_grad_() for x in (q, k, v)]
            ref, _ = reference_attention(*whole, causal=True, scale=8 ** -0.5, mask=Mask(True, None, window))
            ref.backward(dout)
            errors = [float((got - layout.shard(want, rank, dim=2)).abs().max())
                      for got, want in zip((out, *(x.grad for x in local)), (ref, *(x.grad for x in whole)))]
            found[name] = dict(errors=errors, forward_overlapped=forward_overlapped,
                               unwaited=sum(not w for t in posted for w in t.waited))
    finally:
        comm.dist, ring.RingComm.__init__, ring.forward_tiles = dist, real_init, real_forward_tiles
    return found


def run_all(rank: int, world: int) -> dict:
    """Every distributed check for one world size; failures are reported, not raised."""
    mesh = None
    if world == HYBRID_MESH[0] * HYBRID_MESH[1]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", HYBRID_MESH, mesh_dim_names=("ring", "ulysses"))
    results: dict = {"exactness": {}}
    for case in exactness_cases():
        if not case.runs_on(world):
            continue
        results["exactness"][case.id] = check_case(case, rank, world, mesh=mesh if case.strategy == "hybrid" else None)
    results["bad_inputs"] = _check_bad_inputs(rank, world, mesh)
    results["traffic"] = _check_traffic(rank, world, mesh)
    results["window_traffic"] = _check_window_traffic(rank, world)
    results["loss_weighting"] = _check_loss_weighting(rank, world)
    results["auto"] = _check_auto(rank, world)
    if world > 1:
        results["consistency"] = _check_consistency(rank, world)
    if world == 3:
        results["lazy_transport"] = _check_ring_on_a_lazy_transport(rank, world)
    if world >= 4 and world % 2 == 0:
        results["subgroups"] = _check_subgroups(rank, world)
    if world == 4:
        results["hybrid_meshes"] = _check_hybrid_meshes(rank, world)
    return results
