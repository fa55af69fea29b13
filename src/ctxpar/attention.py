"""The public entry point: ``ctxpar.attention`` on one rank's shard of the sequence."""

from __future__ import annotations

import functools
import math
import reprlib
import sys
from collections.abc import Iterable
from typing import NoReturn

import torch
import torch.distributed as dist

from ctxpar import agreement, auto, kernels, limits, topology
from ctxpar.layout import Layout, as_checked, fingerprint, get_layout
from ctxpar.limits import as_real
from ctxpar.masks import make_mask
from ctxpar.strategies import STRATEGIES, Strategy
from ctxpar.strategy_rules import check_strategy

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def as_sdpa_under_autocast(fn):
    """``fn(q, k, v, ...)`` run as scaled_dot_product_attention runs under autocast on q's
    device: each of q, k, v that is floating but not float64 cast to autocast's dtype (RoPE in
    float32 often leaves q and k there and v not; a float32 KV cache meets a bfloat16 query),
    then computed without further casts."""
    @functools.wraps(fn)
    def under_autocast(q, k, v, *args, **kwargs):
        device = q.device.type if isinstance(q, torch.Tensor) else None
        if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
            return fn(q, k, v, *args, **kwargs)
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                   else t for t in (q, k, v))
        with torch.autocast(device, enabled=False):
            return fn(q, k, v, *args, **kwargs)
    return under_autocast


@as_sdpa_under_autocast
def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str | Layout,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    scale: float | None = None,
    strategy: str = "ring",
    mesh=None,
    check_consistency: bool = True,
    documents=None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Each rank passes its own shard (as produced by ``layout.shard``) and gets back the
    rows of full, unsplit attention for the positions it holds::

        T = 8, P = 2, zigzag: rank 0 holds positions 0 1 6 7, rank 1 holds 2 3 4 5
        causal: position 6 on rank 0 attends to keys 0..6, wherever they live

    Args:
        q: (B, H, S, D) local queries, S = T / P.
        k, v: (B, H_kv, S, D) local keys and values; H must be a multiple of H_kv
            (GQA / MQA). K/V are never repeated to H heads.
        layout: ``"contiguous" | "zigzag" | "striped"`` or a ``Layout`` built for this
            group's size; the causal mask follows its global positions.
        group: the CP process group (default WORLD). Without an initialised process
            group this is plain single-device attention. Each rank holds the shard at
            its rank in the group, ``dist.get_rank(group)``: torch numbers a group's ranks
            by ascending global rank, whatever order ``new_group`` was given them in
            (``new_group([3, 1])``: global rank 1 holds shard 0); for the group of a dim of
            a mesh built by ``init_device_mesh``, ``mesh.get_local_rank("cp")``. Shards
            taken by the place in one's own list have the right shapes and give wrong
            attention, silently.
        causal: query at global position i sees keys at positions <= i.
        scale: softmax scale, default D ** -0.5.
        strategy: how K/V move between ranks (all give the same result):
            ``"ring"``: K/V circulate, overlapped with compute.
            ``"allgather"``: every rank gathers all K/V (by head group).
            ``"alltoall"``: Ulysses; heads for sequence, needs H % P == 0.
            ``"hybrid"``: all-to-all over the mesh's "ulysses" dim, ring over "ring".
            ``"auto"``: the one of ring, allgather, alltoall the planner predicts
            fastest for these shapes on this hardware (``ctxpar.auto``), the same on
            every rank; ``ctxpar.record()`` says which and why.
            Traffic and memory of each: docs/strategies.md.
        mesh: for ``"hybrid"`` only, a 2D DeviceMesh with dims "ulysses" and "ring";
            the rank in the layout is ``ctxpar.hybrid_rank(mesh)``.
        check_consistency: first all-gather a small signature of every rank's call
            (shapes, dtype, causal, scale, strategy, layout, whether a backward will
            run), so that ranks called with different arguments (or one rank with
            invalid inputs) all raise together instead of computing a wrong result or
            waiting on each other. One tiny collective per call (cost measured by
            ``benchmarks/consistency.py``, figures in docs/benchmarks.md); turn it off
            only on every rank at once, for calls already known to agree.
        documents: the documents packed into the row (the whole sequence, T tokens):
            their lengths, or ``cu_seqlens`` (0, ..., T); a query sees only keys of its
            own document. Any lengths: 1-token documents, documents shorter than P or
            split across ranks. The same on every rank.
        window: causal sliding window: the query at position p sees keys p-window+1..p
            (itself included; ``window >= T`` is plain causal). Needs causal=True.
        sinks: (H,) per-head attention-sink logits (gpt-oss): exp(sink) joins every
            row's softmax denominator, with no value; differentiable: summed over the
            CP group, as for any parameter replicated over it, the gradients are the
            unsplit one (ring and all-gather give each rank its rows' share, all-to-all
            each rank its heads' over every row, hybrid each rank its heads' over its
            ulysses group's rows). The same values on every rank.

    Returns:
        out (B, H, S, D) in q's dtype, differentiable w.r.t. q, k, v (and sinks); and
        lse (B, H, S) float32 (float64 for float64 inputs), the natural-log sum of
        exp(scaled scores) over all visible keys of the whole sequence, sinks included
        (not differentiable: a backward that reaches it raises, rather than leave a loss term
        on it without effect; ``lse.detach()`` where it only weighs or inspects).

    Raises:
        ValueError: for any invalid input, before any K/V move. With
            ``check_consistency`` every rank raises when any rank's inputs are invalid
            or differ from the others'; without it the checks are local, and ranks
            called differently may compute wrong results or wait on each other.
    """
    topo, mask, layout_name, chosen_why = None, None, None, None
    with agreement.Refusal() as refusal:  # any failure: a rank that left here would strand its peers below
        limits.check_flag("check_consistency", check_consistency)  # "no" once ran the check, "" skipped it
        chosen, topo, layout = _settings(layout, group, strategy, mesh, "ctxpar.attention")
        scale = _eager(_validate)(q, k, v, layout, topo, scale)
        seq_len = q.shape[2] * layout.world_size
        layout = as_checked(layout, seq_len)  # a layout of the user's: its deal checked
        layout_name = fingerprint(layout)
        mask = make_mask(seq_len, causal=causal, documents=documents, window=window)
        check_sinks(sinks, q)
        if strategy == auto.AUTO:
            strategy, chosen_why = auto.choose(q, k, world=topo.world_size, layout_name=layout.name, mask=mask,
                                               backward=agreement.needs_grad(q, k, v, sinks))
            chosen = _strategy(strategy)
            topo = _topology(chosen.axis, strategy, group, mesh, "ctxpar.attention")
        chosen.check(q.shape[1], k.shape[1], topo)
    error = refusal.error
    if check_consistency is not False:  # an invalid flag (None, 0) joins too: its peers hear its refusal
        # a rank whose own arguments name no valid strategy or topology still joins the
        # exchange its peers run, on the groups its group= or mesh= describe
        _check_ranks_agree(q, k, v, topo or _fallback_topology(group, mesh), error,
                           layout_name=layout_name or _layout_name(layout),
                           causal=causal, scale=scale, strategy=strategy, mask=mask, sinks=sinks)
    if error is not None:
        raise error
    if chosen_why is not None:
        auto.note(strategy, chosen_why)
    # once per shard, not per block; k and v need no copy here: every strategy copies them
    # into its own send buffers (the stacked K/V of the ring and all-gather, the all-to-all's)
    q = kernels.unit_stride(q)
    return chosen.run(q, k, v, sinks, layout=layout, topo=topo, mask=mask, scale=scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """Like ``attention_with_lse`` but returns only ``out`` (B, H, S, D)."""
    return attention_with_lse(q, k, v, **kwargs)[0]


def refuse_with_peers(error: Exception, q, k, v, *, layout: str | Layout, group: dist.ProcessGroup | None = None,
                      strategy: str = "ring", mesh=None) -> NoReturn:
    """Raise ``error``, a refusal that code calling ``attention`` (with ``check_consistency``)
    made on this rank before the call (a model layer's), once this rank has joined the
    exchange that its peers' call runs first: they raise with it ("ranks [r] of the CP group
    rejected their attention inputs") rather than wait for it, and the group stays in step
    for the next call."""
    _check_ranks_agree(q, k, v, _fallback_topology(group, mesh), error, layout_name=_layout_name(layout),
                       causal=True, scale=None, strategy=strategy)
    raise error


def _check_ranks_agree(q, k, v, peers: topology.Topology | None, error: Exception | None, **call) -> None:
    """``agreement.check_ranks_agree`` on this call's signature. Under ``torch.compile`` it
    runs eagerly: a host-side exchange of concrete values (dynamo recursed packing a
    symbolic scale under ``dynamic=True``)."""
    if peers is None or peers.world_size == 1:
        return
    _eager(_exchange)(q, k, v, peers, error, **call)


def _exchange(q, k, v, peers: topology.Topology, error: Exception | None, **call) -> None:
    agreement.check_ranks_agree(agreement.signature(q, k, v, rejected=error is not None, **call), peers, error)


def _eager(fn):
    """``fn``, run eagerly under ``torch.compile``: host-side checks of concrete values. The
    input checks compiled under ``dynamic=True`` (the default scale symbolic in the head dim)
    were reused by a later compile without it, in the same process, and raised there (torch
    2.13: "'NoneType' object has no attribute 'item'"). Dynamo is loaded once torch.compile is
    used; importing it for everyone cost 0.6 s per process."""
    return _compiler_disabled(fn) if "torch._dynamo" in sys.modules else fn


@functools.cache
def _compiler_disabled(fn):
    return torch.compiler.disable(fn)


def loaded_class(module: str, name: str) -> type | tuple:
    """``module``'s class ``name`` where the module is loaded, else () (no instance of it can
    exist yet, and ``isinstance(x, ())`` is False): what tests for DTensors and FSDP units use,
    since importing torch.distributed's tensor or fsdp package takes about half a second."""
    return getattr(sys.modules.get(module), name, ())


def is_dtensor(t) -> bool:
    return isinstance(t, loaded_class("torch.distributed.tensor", "DTensor"))


def _strategy(name: str) -> Strategy:
    return STRATEGIES[check_strategy(name)]


def _layout_name(layout) -> str:
    return fingerprint(layout) if isinstance(layout, Layout) else str(layout)


def _fallback_topology(group, mesh) -> topology.Topology | None:
    """The groups that ``group=`` or ``mesh=`` name, or None if they name none we belong to."""
    try:
        return topology.from_mesh(mesh) if mesh is not None else topology.from_group(group, "ctxpar.attention")
    except Exception:  # noqa: BLE001  a mesh= of the wrong type, a group we are not in
        return None


def check_settings(*, layout: str | Layout, group: dist.ProcessGroup | None = None, strategy: str = "ring",
                   mesh=None, heads: Iterable[tuple[int, int]] = (), who: str) -> Layout:
    """The CP settings a model's attention calls will take, checked once, before
    ``apply_context_parallel`` or ``enable_context_parallel`` change the model (each call
    checks them again): the strategy's name, ``mesh=`` given exactly for "hybrid", the
    groups they name (this rank among them), the layout for their size, and the model's
    ``heads``, each (H, H_kv) its attention modules have, which the all-to-all (and hybrid's)
    must split over its ranks. ``who``: the entry called, named in refusals. Returns the
    layout built for that size."""
    chosen, topo, placed = _settings(layout, group, strategy, mesh, who)
    for h, kv_heads in heads:  # "auto" is checked as ring: it chooses among the strategies the heads allow
        chosen.check(h, kv_heads, topo)
    return placed


def _settings(layout, group, strategy, mesh, who: str) -> tuple[Strategy, topology.Topology, Layout]:
    chosen = STRATEGIES["ring" if check_strategy(strategy, auto_allowed=True) == auto.AUTO else strategy]
    if strategy == auto.AUTO and mesh is not None:
        raise ValueError("strategy='auto' chooses among ring, allgather and alltoall on group=; a hybrid mesh= "
                         "is used with strategy='hybrid' (for auto on the mesh's ranks, pass group= a process group "
                         "of them, or leave it None for all ranks, instead of mesh=)")
    topo = _topology(chosen.axis, strategy, group, mesh, who)
    return chosen, topo, _layout_for(layout, topo)


def _topology(axis: str, strategy: str, group, mesh, who: str) -> topology.Topology:
    if axis == "mesh":
        if mesh is None or group is not None:
            given = "not group=" if group is not None else "and none was given"
            raise ValueError(f"strategy={strategy!r} takes mesh= (a 2D DeviceMesh with dims 'ulysses' and 'ring'), "
                             f"{given}")
        return topology.from_mesh(mesh)
    if mesh is not None:
        raise ValueError(f"mesh= is for strategy='hybrid'; strategy={strategy!r} takes group=")
    return topology.from_group(group, who, axis)


def _layout_for(layout: str | Layout, topo: topology.Topology) -> Layout:
    if topo.hybrid and isinstance(layout, Layout) and layout.world_size != topo.world_size:
        raise ValueError(
            f"the {layout.name} layout was built for P={layout.world_size} ranks but the hybrid mesh has "
            f"ulysses degree {topo.ulysses_degree} x ring degree {topo.ring_degree} = {topo.world_size}; "
            f"build it with world_size={topo.world_size} or change the mesh"
        )
    return get_layout(layout, topo.world_size)


def _validate(q, k, v, layout: Layout, topo: topology.Topology, scale: float | None) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and (t.is_nested or t.layout != torch.strided):
            kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
            raise ValueError(f"{name} must be a dense (strided) tensor, got a {kind} tensor; convert it with "
                             f".to_dense() or torch.nested.to_padded_tensor")
        check_not_transformed(name, t)
        if is_dtensor(t):  # torch's own error came from inside the strategy's collectives
            raise ValueError(f"{name} is a DTensor ({t.placements} over a mesh of {t.device_mesh.size()}); pass "
                             f"this rank's local heads ({name}.to_local(): under tensor parallelism each TP rank "
                             f"runs CP over its own heads, on the CP group)")
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, H, S, D), got {got}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    (b, h, s, d), (bk, hk, sk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, local sequence "
            f"length and head dim (B, _, S, D)"
        )
    if 0 in q.shape or 0 in k.shape:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k/v {tuple(k.shape)}; every dim of (B, H, S, D) "
                         f"must be >= 1")
    if h % hk:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads H_kv={hk}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {', '.join(map(str, SUPPORTED_DTYPES))}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if layout.world_size > 1:
        for group in topo.process_groups:
            _check_backend(dist.get_backend(group), q.device)
    try:
        layout.validate(s * layout.world_size)
    except ValueError as e:
        raise ValueError(f"local length S={s} on each of P={layout.world_size} ranks: {e}") from None
    return check_scale(scale, q)


def check_scale(scale, q: torch.Tensor) -> float:
    """The softmax scale of attention over ``q`` (B, H, S, D): None for D ** -0.5, else a
    positive number that ``q``'s accumulation dtype holds."""
    if scale is None:
        return q.shape[-1]**-0.5
    if isinstance(scale, torch.Tensor):
        raise ValueError(f"scale must be a number, got a tensor ({reprlib.repr(scale)}); for a learnable or per-head "
                         f"scale, multiply q by it and pass scale=1.0")
    value = as_real(scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a positive finite number, got {reprlib.repr(scale)}")
    computed_in = torch.finfo(kernels.accumulation_dtype(q.dtype))
    if not computed_in.tiny <= value <= computed_in.max:  # it would round to 0, lose digits, or be inf
        raise ValueError(f"scale {value!r} is outside {computed_in.dtype}'s range ({computed_in.tiny:g} to "
                         f"{computed_in.max:g}), in which {q.dtype} attention is computed")
    return value


def check_not_transformed(name: str, t) -> None:
    """Refuse ``t`` inside a torch.func transform, which cannot run ctxpar's autograd Functions
    around collectives (torch's own error asked them for a setup_context). Not asked while
    torch.compile traces (dynamo cannot trace the query, and breaks the graph on it)."""
    if (isinstance(t, torch.Tensor) and not torch.compiler.is_compiling()
            and torch._C._functorch.is_functorch_wrapped_tensor(t)):
        raise ValueError(f"{name} is inside a torch.func transform (grad, vmap, jvp, ...), which cannot run ctxpar's "
                         f"attention; differentiate with torch.autograd (loss.backward(), torch.autograd.grad, or "
                         f"torch.autograd.functional with vectorize=False), and batch by stacking along B")


def check_sinks(sinks, q: torch.Tensor) -> None:
    """``sinks`` None, or (H,) finite logits, one per query head of ``q`` (B, H, S, D). On a GPU
    reading whether they are finite waits for its queued work, whatever ``check_consistency``
    is: a non-finite sink gave NaN gradients silently, and only the host can refuse it before
    the call computes."""
    if sinks is None:
        return
    check_not_transformed("sinks", sinks)
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (q.shape[1],):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a tensor of shape (H,) = ({q.shape[1]},), one logit per query head, got {got}")
    if not sinks.dtype.is_floating_point:
        raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}")
    computed_in = kernels.accumulation_dtype(q.dtype)
    if not bool(torch.isfinite(sinks.to(computed_in)).all()):  # 1e39 in float64 is inf in float32
        raise ValueError(f"sinks must be finite in {computed_in}, in which {q.dtype} attention is computed "
                         f"(use sinks=None for no sink)")


def _check_backend(backend: str, device: torch.device) -> None:
    """The group can carry tensors on ``device``: NCCL the current CUDA device, gloo the CPU
    (and CUDA, staged through host memory: the debug path for ranks sharing a GPU)."""
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"the process group uses NCCL but the tensors are on {device}; move them to CUDA")
        if device.index is not None and device.index != torch.cuda.current_device():
            raise ValueError(f"the tensors are on {device} but this rank's NCCL device is "
                             f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device({device.index}) before "
                             f"creating the process group, or move the tensors")
    elif backend == "gloo" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"the process group uses gloo, which carries CPU or CUDA tensors, but the tensors are on "
                         f"{device}; move them to the CPU")
