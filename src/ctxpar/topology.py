"""Who talks to whom: the process groups a strategy uses, resolved once per call.

Ring, all-gather and all-to-all use one CP group of P ranks. Hybrid uses a 2D
``DeviceMesh`` with dims named ``"ulysses"`` (all-to-all, U ranks, best inside a node)
and ``"ring"`` (R ranks, across nodes), U * R = P. Its rank in the CP layout is

    cp_rank = ring_coordinate * U + ulysses_coordinate

which is the global rank for ``init_device_mesh(device, (R, U), mesh_dim_names=("ring", "ulysses"))``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ctxpar import comm
from ctxpar.launch import launched_by_torchrun


@dataclass(frozen=True)
class Topology:
    rank: int  # position in the CP layout
    world_size: int  # P
    group: dist.ProcessGroup | None = None  # the whole CP group (None = WORLD)
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    ulysses_degree: int = 1
    ring_degree: int = 1
    ulysses_rank: int = 0
    ring_rank: int = 0
    hybrid: bool = False

    @property
    def process_groups(self) -> list[dist.ProcessGroup | None]:
        """The groups the strategy will communicate on."""
        return [self.ulysses_group, self.ring_group] if self.hybrid else [self.group]


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


_alone = 0  # ``alone()`` blocks entered and not left


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Within it, this process computes on its own on purpose (``ctxpar train --compare``'s
    reference, after a torchrun launch's group is gone): a call without a process group is
    one rank's, not refused as one that forgot to join its torchrun launch."""
    global _alone
    _alone += 1
    try:
        yield
    finally:
        _alone -= 1


def from_group(group: dist.ProcessGroup | None, who: str, axis: str = "ring") -> Topology:
    """One CP group used along one axis ("ring": K/V move around the group; "ulysses":
    the whole group does all-to-alls), as ``who`` (the entry called, named in refusals) was
    given it. Without an initialised process group, one rank (refused in a torchrun launch of
    several). A rank's place in the layout is its rank in the group (``ctxpar.layout``'s
    docstring)."""
    if not _initialised():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1 and not _alone:
            # one rank would attend over its own shard alone: wrong results on every rank, silently
            raise ValueError(f"{who} was called in rank {os.environ['RANK']} of a torchrun launch of "
                             f"{os.environ['WORLD_SIZE']} processes, but torch.distributed is not initialised here; "
                             f"call torch.distributed.init_process_group() (or ctxpar.launch.init_from_env()) on "
                             f"every rank first (a process meant to run alone: start it without torchrun, or with "
                             f"WORLD_SIZE=1)")
        return Topology(rank=0, world_size=1)
    if axis not in ("ring", "ulysses"):
        raise ValueError(f"axis must be 'ring' or 'ulysses', got {axis!r}")
    if isinstance(group, DeviceMesh):
        fix = (f"mesh={hybrid} (the hybrid strategy's) instead" if (hybrid := _hybrid_part(group))
               else f"its CP dim's process group, group={_cp_group_of(group)}")
        raise ValueError(f"group= must be a torch.distributed ProcessGroup (None: WORLD), got a DeviceMesh "
                         f"({_described(group)}); pass {fix}")
    # new_group gives the ranks outside the group a sentinel: refused as "not a member" below
    if not (group is None or group is dist.GroupMember.NON_GROUP_MEMBER or isinstance(group, dist.ProcessGroup)):
        raise ValueError(f"group= must be a torch.distributed ProcessGroup (None: WORLD), got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the given process group; call "
            f"{who} only on the ranks of the CP group"
        )
    world = dist.get_world_size(group)
    if axis == "ulysses":
        return Topology(rank=rank, world_size=world, group=group, ulysses_group=group, ulysses_degree=world,
                        ulysses_rank=rank)
    return Topology(rank=rank, world_size=world, group=group, ring_group=group, ring_degree=world, ring_rank=rank)


def _described(mesh: DeviceMesh) -> str:
    return f"{mesh.ndim}D with mesh_dim_names {tuple(mesh.mesh_dim_names or ()) or None}"


def _cp_group_of(mesh: DeviceMesh) -> str:
    """How to get the process group of ``mesh``'s CP dim: a 1-D mesh's only one (``mesh["cp"]``
    sliced from a larger mesh included), or its "cp" dim's."""
    if mesh.ndim == 1:
        return "mesh.get_group()"
    return "mesh.get_group('cp')" if "cp" in (mesh.mesh_dim_names or ()) else "mesh.get_group(<its CP dim>)"


def _hybrid_part(mesh: DeviceMesh) -> str | None:
    """How to get the ('ring', 'ulysses') mesh in ``mesh``, if it has those dims (torch
    slices them in the mesh's own order alone)."""
    names = tuple(mesh.mesh_dim_names or ())
    if not {"ring", "ulysses"} <= set(names):
        return None
    return "mesh" if mesh.ndim == 2 else f"mesh[{', '.join(repr(n) for n in names if n in ('ring', 'ulysses'))}]"


# what a mesh whose CP ranks are one of its dims is refused with by attention's callers: group= alone is
# refused for strategy="hybrid"
WITH_A_GROUP_STRATEGY = " with a strategy that takes group= (ring, allgather, alltoall or auto)"


def from_mesh(mesh, group_also: str = WITH_A_GROUP_STRATEGY) -> Topology:
    """A 2D DeviceMesh with dims "ulysses" and "ring" (any order). ``group_also``: what else
    the caller takes, beside ``group=`` a dim's process group, for a mesh whose CP ranks
    are one of its dims, named in its refusal."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh= must be a torch DeviceMesh (2D, dims 'ulysses' and 'ring'), got {type(mesh).__name__}")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim != 2 or set(names) != {"ulysses", "ring"}:
        if hybrid := _hybrid_part(mesh):
            fix = f"pass its sub-mesh {hybrid}"
        elif mesh.ndim == 1 or "cp" in names:
            fix = f"for the ranks of its CP dim pass group={_cp_group_of(mesh)} instead{group_also}"
        else:
            fix = "build it with init_device_mesh(device, (ring, ulysses), mesh_dim_names=('ring', 'ulysses'))"
        raise ValueError(
            f"hybrid needs a 2D DeviceMesh with mesh_dim_names ('ring', 'ulysses'), got {_described(mesh)}; {fix}"
        )
    ranks = mesh.mesh  # (d0, d1) global ranks, the same tensor on every rank: so is this verdict
    if not all(bool((ranks.diff(dim=dim) > 0).all()) for dim in (0, 1)):
        raise ValueError(f"hybrid needs a mesh whose global ranks ascend along each dim, as init_device_mesh builds "
                         f"them (torch numbers each dim's process group in ascending rank order, and the strategy "
                         f"takes that number for the coordinate); got {ranks.tolist()}: build it with "
                         f"init_device_mesh(device, (ring, ulysses), mesh_dim_names=('ring', 'ulysses'))")
    if mesh.get_coordinate() is None:
        raise ValueError(f"global rank {dist.get_rank()} is not in the hybrid mesh")
    u, r = mesh.size(names.index("ulysses")), mesh.size(names.index("ring"))
    u_rank, r_rank = mesh.get_local_rank("ulysses"), mesh.get_local_rank("ring")
    return Topology(
        rank=r_rank * u + u_rank, world_size=u * r,
        ulysses_group=mesh.get_group("ulysses"), ring_group=mesh.get_group("ring"),
        ulysses_degree=u, ring_degree=r, ulysses_rank=u_rank, ring_rank=r_rank, hybrid=True,
    )


def of(group: dist.ProcessGroup | None, mesh, who: str, mesh_is: str = "",
       group_also: str = WITH_A_GROUP_STRATEGY) -> Topology:
    """The CP ranks ``who`` was given: ``group``'s (None: WORLD, or one process without one),
    or instead a hybrid ``mesh``'s (``mesh_is``: what to call it in the refusal of both;
    ``group_also``: ``from_mesh``'s)."""
    if mesh is not None and group is not None:
        raise ValueError(f"{who} takes group= or mesh={mesh_is}, not both")
    return from_mesh(mesh, group_also) if mesh is not None else from_group(group, who)


def global_ranks(group: dist.ProcessGroup | None, mesh=None) -> list[int]:
    """The global ranks of a CP group: ``mesh``'s where given, else ``group``'s (None: WORLD)."""
    if mesh is not None:
        return mesh.mesh.flatten().tolist()
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def all_reduce(tensor, topo: Topology) -> None:
    """Sum ``tensor`` in place over every rank of the CP group: for a hybrid mesh, over its
    ulysses groups, then over its ring groups, which sum those sums over the whole grid."""
    if _initialised():
        for group in topo.process_groups:
            dist.all_reduce(tensor, group=group)


def all_gather(tensor: torch.Tensor, topo: Topology) -> torch.Tensor:
    """(P, *tensor.shape): every rank's ``tensor`` of the CP group, in layout order. For a
    hybrid mesh, gathered along its ulysses groups, then those (U, ...) along its ring groups:
    (R, U, ...) is layout order (cp_rank = ring * U + ulysses)."""
    if not topo.hybrid:
        return comm.PendingAllGather(tensor, topo.group).wait()
    row = comm.PendingAllGather(tensor, topo.ulysses_group).wait()
    return comm.PendingAllGather(row, topo.ring_group).wait().flatten(0, 1)


def broadcast(tensor: torch.Tensor, src: int, topo: Topology) -> torch.Tensor:
    """``tensor`` as the rank at place ``src`` of the CP layout holds it, on every rank (each
    passes one of the same shape and dtype). For a hybrid mesh, along the ring groups from
    ``src``'s ring coordinate (which carries it into the ulysses coordinate of ``src``
    everywhere), then along the ulysses groups from that coordinate."""
    if not topo.hybrid:
        return comm.broadcast(tensor, src, topo.group)
    tensor = comm.broadcast(tensor, src // topo.ulysses_degree, topo.ring_group)
    return comm.broadcast(tensor, src % topo.ulysses_degree, topo.ulysses_group)


def hybrid_rank(mesh) -> int:
    """This rank's index in the CP layout under a hybrid mesh (use it to shard inputs)."""
    return from_mesh(mesh).rank


def hybrid_group_rank(mesh, layout_rank: int, group: dist.ProcessGroup | None) -> int:
    """The inverse of ``hybrid_rank``: the rank in ``group`` (None: WORLD) of the hybrid mesh's
    member at ``layout_rank`` (``from_mesh``'s order: ring-major, ulysses-minor)."""
    names = tuple(mesh.mesh_dim_names)
    u = mesh.size(names.index("ulysses"))
    index = [0, 0]
    index[names.index("ulysses")], index[names.index("ring")] = layout_rank % u, layout_rank // u
    return dist.get_group_rank(group or dist.group.WORLD, int(mesh.mesh[tuple(index)]))
