"""Communication for CP strategies, with every byte counted (see ``ctxpar.profile``).

Bytes are counted per rank as what the operation must move in and out of that rank,
independent of the algorithm the backend picks (the "bus bandwidth" convention of
nccl-tests): a rank's own chunk of a collective is never counted.

    ring step          sends its buffer, receives one of the same size
    all_to_all         sends (W-1)/W of its buffer, receives (W-1)/W of the result
    all_gather         sends its shard to W-1 ranks, receives W-1 shards
    reduce_scatter     sends W-1 of its W chunks, receives W-1 chunks to add into its own

``RingComm`` is the ring's point-to-point exchange: each rank sends to rank+1 and
receives from rank-1 of its group (or, with ``shift``, to rank+shift from rank-shift).
``start`` posts the transfer and returns at once; ``wait`` blocks until it has landed.
A strategy posts the transfer of the next block before computing the current one, so
the two overlap::

    comm.start(send=current, recv=arriving)    # post step i+1's transfer
    compute(current)                           # step i, overlapped with the transfer
    comm.wait()                                # arriving now holds step i+1's block
    current = arriving

Devices: NCCL groups carry CUDA tensors, gloo groups CPU tensors. A gloo group may also
carry CUDA tensors: they are staged through host memory (copied to the CPU before they
are sent, back to the GPU once received). That is the test and debug path, for several
ranks sharing one GPU, which NCCL refuses; it serialises transfers with compute. NCCL is
the fast path whenever every rank has its own GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ctxpar import profile

# torch renamed these (same signatures); prefer the new names where present. gloo wants
# the gathered output as the shards concatenated along dim 0.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _staged(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether ``t`` must go through host memory: a GPU tensor on a gloo group."""
    return t.device.type != "cpu" and dist.get_backend(group) == "gloo"


class RingComm:
    """Non-blocking send-to-next / receive-from-previous on one process group.

    Args:
        group: the CP process group (None = WORLD).
        tag: separates independent streams on the same ring (e.g. K/V vs dK/dV).
        shift: send to rank + shift, receive from rank - shift (mod the group size).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, tag: int = 0, shift: int = 1) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.tag = tag
        self._next = dist.get_global_rank(self._group(), (self.rank + shift) % self.world_size)
        self._prev = dist.get_global_rank(self._group(), (self.rank - shift) % self.world_size)
        self._pending: list = []
        self._device = torch.device("cpu")
        self._recv = self._landing = self._sent = None  # the posted transfer's buffers

    def _group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Post: ``send`` goes to rank+shift, rank-shift's tensor lands in ``recv``. An
        empty tensor on either side is not sent (or awaited): both ends know the sizes."""
        if self._sent is not None:
            raise RuntimeError("RingComm.start called twice without wait()")
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("ring buffers must be contiguous")
        self._device, self._recv = send.device, recv
        if _staged(send, self.group):
            send, recv = send.cpu(), torch.empty(recv.shape, dtype=recv.dtype)
        self._landing = recv
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self._next, self.group, self.tag))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self._prev, self.group, self.tag))
        self._sent = send  # kept alive until the transfer is done
        self._pending = dist.batch_isend_irecv(ops) if ops else []
        if ops:  # a transfer of nothing either way is no synchronisation point
            profile.add_traffic(_nbytes(send), _nbytes(recv))

    def wait(self) -> None:
        """Block until the posted transfer has completed (both directions)."""
        if self._sent is None:
            raise RuntimeError("RingComm.wait called without start()")
        if self._pending:
            with profile.timed("wait", self._device):
                for req in self._pending:
                    req.wait()
                if self._landing is not self._recv:  # staged through host memory
                    self._recv.copy_(self._landing)
        # drop the transfer's buffers: a RingComm reused for later transfers keeps none alive
        self._pending, self._sent, self._recv, self._landing = [], None, None, None

    @property
    def posted(self) -> bool:
        """A transfer was started and not yet waited for."""
        return self._sent is not None


@contextlib.contextmanager
def settled(*comms: RingComm | None) -> Iterator[None]:
    """On the way out of an exception (Ctrl-C in a compute step), wait for the transfers
    ``comms`` still have posted: dropped half-way, they leave the group's later
    point-to-point transfers paired with the wrong ones, and the next call hangs. Every
    rank interrupted at the same step gets a usable group back; a rank whose peers went on
    waits for them at most the collective timeout, as any collective does. The exception
    that came is the one raised: a wait that fails too (its peer gone) would hide it."""
    try:
        yield
    except BaseException:
        for comm in comms:
            if comm is not None and comm.posted:
                with contextlib.suppress(Exception):
                    comm.wait()
        raise


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _world_size(group: dist.ProcessGroup | None) -> int:
    """1 without an initialised process group (single-rank use needs no communication)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_to_all(*sends: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Each of ``sends`` (W, ...) contiguous: chunk j goes to rank j; returns, for each, a
    (W, ...) tensor whose chunk j came from rank j. All are posted at once and waited for
    together: one synchronisation point. With W = 1, ``sends`` themselves."""
    world = _world_size(group)
    if world == 1:
        return list(sends)
    device = sends[0].device
    posted = []
    for send in sends:
        host = send.cpu() if _staged(send, group) else send
        recv = torch.empty_like(host)
        moved = _nbytes(host) * (world - 1) // world
        profile.add_traffic(moved, moved)
        posted.append((host, recv, dist.all_to_all_single(recv, host, group=group, async_op=True)))
    with profile.timed("wait", device):
        for _, _, work in posted:
            work.wait()
    return [recv.to(device) for _, recv, _ in posted]


class _Pending:
    """A collective in flight on ``_work`` (None: nothing to wait for); ``wait()`` returns
    ``_out`` on the device its input came from."""

    _device: torch.device
    _out: torch.Tensor
    _work = None

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with profile.timed("wait", self._device):
                self._work.wait()
        return self._out.to(self._device)


class PendingAllGather(_Pending):
    """An all-gather in flight; ``wait()`` returns the (W, *shard.shape) result."""

    def __init__(self, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        world = _world_size(group)
        self._device = shard.device
        self._shard = shard = shard.contiguous()  # kept alive until the gather has read it
        self._out = shard.unsqueeze(0)
        if world > 1:
            if _staged(shard, group):
                self._shard = shard = shard.cpu()
            self._out = shard.new_empty((world, *shard.shape))
            flat = self._out.view(world * shard.shape[0], *shard.shape[1:])
            self._work = all_gather_into(flat, shard, group=group, async_op=True)
            profile.add_traffic(_nbytes(shard) * (world - 1), _nbytes(shard) * (world - 1))


class PendingReduceScatter(_Pending):
    """A reduce-scatter in flight: input (W, *shape), rank r gets the sum of every rank's
    chunk r; ``wait()`` returns it."""

    def __init__(self, chunks: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        world = chunks.shape[0]
        self._device = chunks.device
        self._out = chunks[0]
        if world > 1:
            if _staged(chunks, group):
                chunks = chunks.cpu()
            self._out = chunks.new_empty(chunks.shape[1:])
            self._input = chunks.contiguous().view(world * chunks.shape[1], *chunks.shape[2:])  # kept alive
            self._work = _reduce_scatter(self._out, self._input, group=group, async_op=True)
            moved = _nbytes(self._out) * (world - 1)
            profile.add_traffic(moved, moved)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective of ``group`` lives: this rank's GPU under NCCL, else
    the host (one process without a group included)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``t`` as rank ``src`` of ``group`` (its rank in the group) holds it, on every rank.
    Every rank passes a tensor of the same shape and dtype (the others' values are not
    read). Counted as the source sending ``t`` once and every other rank receiving it
    once. With W = 1, ``t`` itself."""
    world = _world_size(group)
    if world == 1:
        return t
    device = t.device
    buf = t.cpu() if _staged(t, group) else t.contiguous()
    mine = dist.get_rank(group) == src
    profile.add_traffic(_nbytes(buf) if mine else 0, 0 if mine else _nbytes(buf))
    with profile.timed("wait", device):
        dist.broadcast(buf, src=dist.get_global_rank(group or dist.group.WORLD, src), group=group)
    return buf.to(device)
