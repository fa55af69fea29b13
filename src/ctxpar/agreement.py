"""Opt-in check that every rank of the CP group called attention with the same arguments.

Local validation catches inputs that are wrong everywhere. Inputs that differ between
ranks (one rank with another sequence length, dtype or layout, or one rank whose inputs
fail validation) would leave the other ranks waiting inside a collective. With
``check_consistency=True``, every rank first contributes a small signature of its call
to one all-gather; then all ranks raise the same kind of error together, or all go on.
"""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist

from ctxpar.topology import Topology

FIELDS = ("rejected", "batch", "heads", "kv_heads", "local_len", "head_dim", "dtype", "causal", "scale",
          "strategy", "layout")


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def signature(q, k, *, layout_name: str, causal, scale, strategy: str, rejected: bool) -> list[int]:
    """Integers describing one call; shape fields are -1 where the inputs are not tensors."""
    shape = list(q.shape) if isinstance(q, torch.Tensor) and q.dim() == 4 else [-1] * 4
    kv_heads = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1
    dtype = _code(str(q.dtype)) if isinstance(q, torch.Tensor) else -1
    scale_bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0] if isinstance(scale, (int, float)) else -1
    return [int(rejected), shape[0], shape[1], kv_heads, shape[2], shape[3], dtype, int(bool(causal)), scale_bits,
            _code(strategy), _code(layout_name)]


def check_ranks_agree(sig: list[int], topo: Topology, error: ValueError | None) -> None:
    """All-gather ``sig`` over the groups ``topo`` communicates on; raise on every rank if
    any rank rejected its inputs or the signatures differ. Re-raises ``error`` on the
    rank that had it."""
    for group in topo.process_groups:
        world = dist.get_world_size(group)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        mine = torch.tensor(sig, dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=group)
        table = torch.stack(rows).cpu()  # (W, fields)
        if error is not None:
            raise error
        rejected = table[:, 0].nonzero().flatten().tolist()
        if rejected:
            raise ValueError(f"ranks {rejected} of the CP group rejected their attention inputs; see their errors")
        differs = [FIELDS[i] for i in range(1, len(FIELDS)) if not bool((table[:, i] == table[0, i]).all())]
        if differs:
            raise ValueError(
                f"the ranks of the CP group called attention with different {', '.join(differs)}; every rank "
                f"must pass the same shapes, dtype, causal flag, scale, strategy and layout"
            )
