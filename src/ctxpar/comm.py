"""Communication for CP strategies, with every byte counted (see ``ctxpar.profile``).

``RingComm`` is the ring's point-to-point exchange: each rank sends to rank+1 and
receives from rank-1 of its group. ``start`` posts the transfer and returns at once;
``wait`` blocks until it has landed. A strategy posts the transfer of the next block
before computing the current one, so the two overlap::

    comm.start(send=current, recv=spare)    # post step i+1's transfer
    compute(current)                        # step i, overlapped with the transfer
    comm.wait()                             # spare now holds step i+1's block
    current, spare = spare, current         # double buffering: no allocation per step
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ctxpar import profile


class RingComm:
    """Non-blocking send-to-next / receive-from-previous on one process group.

    Args:
        group: the CP process group (None = WORLD).
        tag: separates independent streams on the same ring (e.g. K/V vs dK/dV).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, tag: int = 0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.tag = tag
        self._next = dist.get_global_rank(self._group(), (self.rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(self._group(), (self.rank - 1) % self.world_size)
        self._pending: list = []
        self._device = torch.device("cpu")

    def _group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Post: ``send`` goes to rank+1, rank-1's tensor lands in ``recv``."""
        if self._pending:
            raise RuntimeError("RingComm.start called twice without wait()")
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("ring buffers must be contiguous")
        ops = [
            dist.P2POp(dist.isend, send, self._next, self.group, self.tag),
            dist.P2POp(dist.irecv, recv, self._prev, self.group, self.tag),
        ]
        self._pending = dist.batch_isend_irecv(ops)
        self._device = send.device
        profile.add_traffic(send.numel() * send.element_size(), recv.numel() * recv.element_size())

    def wait(self) -> None:
        """Block until the posted transfer has completed (both directions)."""
        with profile.timed("wait", self._device):
            for req in self._pending:
                req.wait()
        self._pending = []
