"""Starting P ranks: local CPU processes with gloo, or the ranks torchrun launched.

``run_local(fn, nproc, ...)`` spawns ``nproc`` processes on this machine, joins them in
a gloo group on 127.0.0.1, calls ``fn(rank, world_size, *args)`` in each and returns
the list of results (rank order). A failing rank's traceback is re-raised in the
parent; ranks still running ``timeout_s`` after the start are killed and reported,
never waited on forever.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_from_env(timeout_s: float = 600) -> torch.device:
    """Join the group torchrun describes: NCCL on the local GPU when there is one, else gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def _worker(rank, world_size, port, threads, timeout_s, fn, args, results) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # plain pickle copies tensors into the message; the queue's default would share
        # their memory with a process that is about to exit
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, including failed asserts, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    threads: int | None = None,
    timeout_s: float = 600,
) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` local gloo ranks; return their results.

    ``fn`` must be importable (module level) and its arguments and result picklable.
    ``threads`` per rank defaults to the machine's cores shared out between the ranks.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nproc, port, threads, timeout_s, fn, args, results), daemon=True)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failed: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(failed) < nproc:
            # once one rank has failed, the others are likely blocked on it: don't wait long
            wait = min(10.0, deadline - time.monotonic()) if failed else deadline - time.monotonic()
            try:
                rank, ok, value = results.get(timeout=max(wait, 0.01))
            except queue.Empty:
                missing = sorted(set(range(nproc)) - set(outputs) - set(failed))
                why = "after another rank failed" if failed else f"within {timeout_s:.0f} s"
                failed[-1] = f"ranks {missing} did not finish {why}; they were killed"
                break
            if ok:
                outputs[rank] = pickle.loads(value)
            else:
                failed[rank] = f"rank {rank} failed:\n{value}"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if failed:
        raise RuntimeError("\n".join(failed[r] for r in sorted(failed)))
    return [outputs[r] for r in range(nproc)]


def run(fn: Callable[..., Any], nproc: int, args: tuple = (), *, timeout_s: float = 600) -> Any:
    """Run ``fn(rank, world_size, *args, device)`` on every rank.

    Under torchrun this process is one of the launched ranks (NCCL on its GPU when
    there is one) and gets its own rank's result; otherwise ``nproc`` local gloo ranks
    are spawned and this process gets rank 0's result.
    """
    if launched_by_torchrun():
        device = init_from_env()
        try:
            return fn(dist.get_rank(), dist.get_world_size(), *args, device)
        finally:
            dist.destroy_process_group()
    return run_local(fn, nproc, (*args, torch.device("cpu")), timeout_s=timeout_s)[0]
