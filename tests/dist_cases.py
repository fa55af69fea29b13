"""Everything the distributed tests run inside one spawned process group per world size.

Spawning costs seconds, a case milliseconds: so each world size spawns once
(``run_all``) and every case runs inside that group, reporting numbers that the test
functions in ``test_distributed.py`` then assert on.
"""

from __future__ import annotations

import itertools
import traceback
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ctxpar
from ctxpar.kernels.reference import reference_attention
from ctxpar.verify import TENSORS, max_abs_errors, tolerances, torch_sdpa

LAYOUTS = ("contiguous", "zigzag", "striped")
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    layout: str
    causal: bool
    heads: str
    dtype: str
    chunk: int = 5  # tokens per zigzag chunk: T = 2 * P * chunk
    scale: float | None = None

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        extra = f"-T{self.chunk}" if self.chunk != 5 else ""
        extra += f"-scale{self.scale}" if self.scale is not None else ""
        return f"{self.layout}-{mask}-{self.heads}-{self.dtype}{extra}"


def exactness_cases() -> list[Case]:
    grid = [Case(*c) for c in itertools.product(LAYOUTS, (True, False), HEADS, DTYPES)]
    # longer shards cross the fused kernel's internal tile boundaries; a custom scale
    grid += [Case(layout, True, "gqa", "float32", chunk=80) for layout in LAYOUTS]
    grid += [Case("zigzag", True, "mha", "float32", scale=0.3)]
    return grid


def _inputs(case: Case, world: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Global fp64 q, k, v, dout, already rounded to the case's dtype."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv = HEADS[case.heads]
    b, t, d = 2, 2 * world * case.chunk, 16
    shapes = [(b, h, t, d), (b, hkv, t, d), (b, hkv, t, d), (b, h, t, d)]
    dtype = DTYPES[case.dtype]
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in shapes)


def _check_case(case: Case, rank: int, world: int, group=None, group_rank: int | None = None) -> dict:
    """Run one case through ctxpar on this rank; compare its shard with the fp64 reference."""
    group_rank = rank if group_rank is None else group_rank
    layout = ctxpar.get_layout(case.layout, world)
    dtype = DTYPES[case.dtype]
    q, k, v, dout = _inputs(case, world, seed=zlib.crc32(case.id.encode()))
    scale = case.scale if case.scale is not None else q.shape[-1] ** -0.5

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*ref_in, causal=case.causal, scale=scale)
    out.backward(dout)
    ref = dict(out=out.detach(), lse=lse.detach(), dq=ref_in[0].grad, dk=ref_in[1].grad, dv=ref_in[2].grad)

    baseline = None
    if dtype != torch.float32:
        low = torch_sdpa(*(t.to(dtype) for t in (q, k, v, dout)), causal=case.causal, scale=scale)
        baseline = max_abs_errors(low, ref)

    shard = lambda t: layout.shard(t, group_rank, dim=2)  # noqa: E731
    local = [shard(t).to(dtype).requires_grad_() for t in (q, k, v)]
    got_out, got_lse = ctxpar.attention_with_lse(
        *local, layout=layout, group=group, causal=case.causal, scale=case.scale
    )
    got_out.backward(shard(dout).to(dtype))
    got = dict(out=got_out, lse=got_lse, dq=local[0].grad, dk=local[1].grad, dv=local[2].grad)
    dtypes_ok = got_out.dtype == dtype and got_lse.dtype == torch.float32 and local[1].grad.dtype == dtype
    return dict(
        errors=max_abs_errors(got, {n: shard(t) for n, t in ref.items()}),
        tolerances=tolerances(dtype, ref, baseline),
        dtypes_ok=dtypes_ok,
        finite=all(bool(torch.isfinite(got[n]).all()) for n in TENSORS),
    )


def _bad_inputs(world: int) -> dict[str, tuple]:
    """name -> (args, kwargs) of calls that must raise ValueError on every rank."""
    s = 5 if world > 1 else 3  # zigzag needs an even local length: 5 is odd for every P
    good = lambda h=4, dt=torch.float32, n=6: torch.randn(1, h, n, 8, dtype=dt)  # noqa: E731
    q, kv = good(), good(2)
    wrong_world = ctxpar.ZigzagLayout(world + 1)
    return {
        "length": ((good(n=s), good(2, n=s), good(2, n=s)), dict(layout="zigzag")),
        "heads": ((q, good(3), good(3)), dict(layout="zigzag")),
        "dtype": ((q, kv.double(), kv.double()), dict(layout="zigzag")),
        "device": ((q, kv.to("meta"), kv.to("meta")), dict(layout="zigzag")),
        "kv_shape": ((q, kv, good(2, n=8)), dict(layout="zigzag")),
        "seq_mismatch": ((q, good(2, n=8), good(2, n=8)), dict(layout="zigzag")),
        "rank3": ((q[0], kv[0], kv[0]), dict(layout="zigzag")),
        "layout_world": ((q, kv, kv), dict(layout=wrong_world)),
        "layout_name": ((q, kv, kv), dict(layout="spiral")),
        "strategy": ((q, kv, kv), dict(layout="zigzag", strategy="telepathy")),
        "scale": ((q, kv, kv), dict(layout="zigzag", scale=-1.0)),
        "int_dtype": ((q.long(), kv.long(), kv.long()), dict(layout="zigzag")),
    }


def _check_bad_inputs(rank: int, world: int) -> dict[str, str]:
    messages = {}
    for name, (args, kwargs) in _bad_inputs(world).items():
        try:
            ctxpar.attention(*args, **kwargs)
            messages[name] = "NO ERROR"
        except ValueError as e:
            messages[name] = str(e)
    if world > 1:  # a group this rank is not in: every rank must take part in new_group
        others = dist.new_group(list(range(1, world)))
        if rank == 0:
            try:
                ctxpar.attention(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8),
                                 layout="contiguous", group=others)
                messages["non_member"] = "NO ERROR"
            except ValueError as e:
                messages["non_member"] = str(e)
    # no rank was left inside a collective: a full attention call still works afterwards
    messages["after"] = "ok" if _check_case(Case("zigzag", True, "gqa", "float32"), rank, world)["finite"] else "bad"
    return messages


def _check_traffic(rank: int, world: int) -> dict:
    """Bytes counted by the comm layer in forward and in backward."""
    b, h, hkv, s, d = 2, 4, 2, 6, 8
    q = torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, s, d, dtype=torch.bfloat16, requires_grad=True)
    with ctxpar.record() as fwd:
        out = ctxpar.attention(q, k, v, layout="zigzag")
    with ctxpar.record() as bwd:
        out.sum().backward()
    return dict(shape=(b, h, hkv, s, d), element_size=2,
                forward=(fwd.bytes_sent, fwd.bytes_received), backward=(bwd.bytes_sent, bwd.bytes_received))


def _check_subgroups(rank: int, world: int) -> dict:
    """CP over two disjoint halves of the world at once (the group is not WORLD)."""
    half = world // 2
    groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, world)))]
    mine, group_rank = (groups[0], rank) if rank < half else (groups[1], rank - half)
    return _check_case(Case("striped", True, "gqa", "float32"), rank, half, group=mine, group_rank=group_rank)


def run_all(rank: int, world: int) -> dict:
    """Every distributed check for one world size; failures are reported, not raised."""
    results: dict = {"exactness": {}}
    for case in exactness_cases():
        try:
            results["exactness"][case.id] = _check_case(case, rank, world)
        except Exception:
            results["exactness"][case.id] = dict(exception=traceback.format_exc())
    results["bad_inputs"] = _check_bad_inputs(rank, world)
    results["traffic"] = _check_traffic(rank, world)
    if world >= 4 and world % 2 == 0:
        results["subgroups"] = _check_subgroups(rank, world)
    return results
