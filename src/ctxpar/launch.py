"""Starting P ranks: local CPU processes with gloo, or the ranks torchrun launched.

``run_local(fn, nproc, ...)`` starts ``nproc`` processes on this machine (on Linux forked
from a server process that imported torch once, ``ctxpar.rank_server``; elsewhere spawned),
joins them in a gloo group on 127.0.0.1, calls ``fn(rank, world_size, *args)`` in each and
returns the list of results (rank order). What it guarantees:

- No wall-clock limit by default: a healthy run takes as long as it takes. ``timeout_s``
  bounds one wait at one collective (and the rendezvous); ``deadline_s`` optionally bounds
  the run from the moment every rank's process is launched (a rank server's start not counted).
- Workers die with the parent, however it ends (SIGTERM, SIGINT, SIGKILL): on Linux the
  kernel kills them (``PR_SET_PDEATHSIG``, as their server ends with the parent); a thread in
  each worker also notices the parent is gone within ``PARENT_POLL_S``.
- A rank that dies is noticed at once (the parent waits on every worker's exit as well as
  on its results), reported with its exit code or signal, and the others are stopped.
- A rank that never arrives where the others wait is named: they time out after
  ``timeout_s`` and report; the rank that is still running is the one they waited for.
  A rank that leaves ``fn`` (returns, or calls sys.exit) while the others are in a
  collective is named as the cause of their failure (under gloo at once: "Connection
  closed by peer"; elsewhere when they time out).
- On glibc, a local rank keeps the memory it frees for its next allocations instead of
  handing it back to the OS (``heap.keep_freed_memory``), unless the environment sets
  glibc's thresholds itself. Ranks torchrun starts are the user's processes: left alone.

``run(fn, nproc, ...)`` picks the mode: the ranks of a real torchrun launch
(``launched_by_torchrun``), or ``nproc`` local ranks, and says which on stderr. A torchrun
rank's process is best ended with ``exit_torchrun_rank`` (the ``ctxpar`` command does).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import datetime
import faulthandler
import functools
import inspect
import io
import json
import logging
import math
import os
import pickle
import re
import signal
import socket
import sys
import sysconfig
import threading
import time
import tokenize
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, resource_tracker
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from ctxpar import heap, rank_server
from ctxpar.limits import as_real, whole

# The longest one wait at one collective may last: torch's own default for NCCL. A healthy
# run on CPU or GPU waits far less at any collective (for a peer to finish its step or a
# checkpoint); a rank that never arrives is named when it expires.
DEFAULT_TIMEOUT_S = 600.0
# After the first rank raises, how long the others get to report their own errors (often
# the same one) before they are stopped (plus one collective timeout after a timeout);
# also how long a stopped rank gets to end.
GRACE_S = 2.0
PARENT_POLL_S = 1.0
# The parent reads a rank's exit status this often besides waiting on its sentinel: a process the
# rank forked holds the sentinel open, and the rank's death went unseen until that one ended.
EXIT_POLL_S = 0.5
PROBE_S = 0.5  # for a stuck rank to write where it is
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # beyond a week it is no longer a timeout
# Below a second a healthy run fails: ranks connect at the rendezvous and reach each
# collective up to seconds apart on a loaded machine (at 1 ms the rendezvous's own
# localhost connection times out, with torch's error instead of the launcher's).
MIN_TIMEOUT_S = 1.0
# Local ranks: at least 8 (tests of a few ranks on a small machine), else 4 per core; past
# that, the ranks' own imports and groups take minutes and the memory of several GiB.
MIN_RANKS_CAP = 8
RANKS_PER_CORE = 4
# Torch threads per local rank: past the cores they only time-share them, and by the thousands
# a rank cannot create them (gloo's init failed with "Resource temporarily unavailable").
THREADS_PER_CORE = 4

# Every variable torch's elastic agent sets for its workers (torch/distributed/elastic/
# agent/server/local_elastic_agent.py); a launch is torchrun's only if all are present.
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")
# What torch.distributed, device meshes or gloo read from the environment: left over from
# another job, they would redirect a local run (e.g. TORCHELASTIC_USE_AGENT_STORE makes rank
# 0 a store client of MASTER_ADDR:MASTER_PORT, LOCAL_RANK picks a device).
LAUNCHER_VARS = (*TORCHRUN_VARS, "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                 "GLOO_SOCKET_IFNAME")

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36  # <linux/prctl.h>
_collective_timeout: datetime.timedelta | None = None  # this process's, once it joined a group
_launch_store: dist.Store | None = None  # torchrun's store, unprefixed: it lasts as long as the launch
_joins = 0  # torchrun groups this process joined
_in_local_rank = False  # this process is a rank run_local started


class StopRun(Exception):
    """Raised in a rank to end the run on purpose (a non-finite loss, a checkpoint that could not be
    written), its message saying what happened and what to do: local runs report that message
    alone, once for the ranks that raised it, without a traceback."""


class RankFailure(RuntimeError):
    """Local ranks that failed, died or never finished; the message says which and why.

    Attributes:
        failed: rank -> traceback of an exception raised in that rank (for a ``StopRun``, its message).
        died: rank -> how the process ended without reporting ("killed by SIGKILL", ...).
        stuck: ranks still running when the run was given up, then stopped.
    """

    def __init__(self, message: str, failed: dict[int, str], died: dict[int, str], stuck: list[int]) -> None:
        super().__init__(message)
        self.failed, self.died, self.stuck = failed, died, stuck

    def __reduce__(self):  # to another process (a pool's worker running a sweep): the default passes the message alone
        return type(self), (self.args[0], self.failed, self.died, self.stuck), self.__dict__


def _local_store(timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The rendezvous store of a local run, served by the parent on 127.0.0.1 alone (a store
    its rank 0 made from a tcp:// address listened on every address of the machine), on a
    port bound before any rank starts (none can take it in between). Returns it and its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port, fd = listener.getsockname()[1], listener.detach()  # the store closes it
    try:
        store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return store, port


def launched_by_torchrun() -> bool:
    """True only in a worker that torchrun (torch's elastic agent) started.

    RANK / WORLD_SIZE / MASTER_* alone are not enough: they are often left over in a shell
    from another job, and trusting them would ignore ``--nproc`` and wait for ranks that
    never come.
    """
    return all(name in os.environ for name in TORCHRUN_VARS)


def torchrun_restart() -> int:
    """How many times torchrun has restarted this run's ranks (``--max-restarts``): 0 for the
    first attempt and outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if launched_by_torchrun() else 0


def world_size(nproc: int) -> int:
    """Ranks a run will have: torchrun's WORLD_SIZE under torchrun, else ``nproc``."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else nproc


def local_ranks(nproc: int) -> int:
    """Ranks a run will have on this machine: torchrun's LOCAL_WORLD_SIZE, else ``nproc``."""
    return int(os.environ["LOCAL_WORLD_SIZE"]) if launched_by_torchrun() else nproc


def max_local_ranks() -> int:
    """The most local ranks ``run_local`` starts: each is a process with its own torch."""
    return max(MIN_RANKS_CAP, RANKS_PER_CORE * (os.cpu_count() or 1))


def check_nproc(nproc: int, name: str = "nproc") -> None:
    """Refuse a number of local ranks that is not an int, below 1, or beyond what this machine can run."""
    if whole(nproc) is None:
        raise ValueError(f"{name} {nproc!r} must be an int: the number of local ranks to spawn")
    if nproc < 1:
        raise ValueError(f"{name} {nproc} must be >= 1: the number of local ranks to spawn")
    if nproc > max_local_ranks():
        raise ValueError(f"{name} {nproc} is more local ranks than this machine runs ({os.cpu_count()} cores, at "
                         f"most {max_local_ranks()} ranks); use fewer, or torchrun across machines for more")


def check_local_memory(needed: int, what: str, fix: str) -> None:
    """Refuse a local run that needs more than this machine's memory (``needed`` is a lower bound, bytes)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > ram:
        raise ValueError(f"{what} needs at least {needed / 2**30:,.1f} GiB, more than this machine's "
                         f"{ram / 2**30:.1f} GiB; {fix}")


def check_timeout(seconds: float, name: str = "timeout_s") -> None:
    """Refuse a collective timeout that is not a number of seconds from a second to a week."""
    if not MIN_TIMEOUT_S <= as_real(seconds) <= MAX_TIMEOUT_S:  # NaN for a bool, a string, None
        raise ValueError(f"{name} {seconds!r} must be a number of seconds from {MIN_TIMEOUT_S:g} to "
                         f"{MAX_TIMEOUT_S:.0f} (shorter waits fail healthy runs: ranks join and reach each collective "
                         f"up to seconds apart); the default is {DEFAULT_TIMEOUT_S:.0f}")


DEVICE_TYPES = ("cpu", "cuda")


def resolve_device_type(device_type: str | None, name: str = "device_type") -> str:
    """The device the ranks compute on: ``device_type``, or by default the GPU under
    torchrun when there is one and the CPU for local ranks."""
    if device_type is None:
        return "cuda" if launched_by_torchrun() and torch.cuda.is_available() else "cpu"
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"{name} {device_type!r}: choose one of {', '.join(DEVICE_TYPES)}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} cuda: this process sees no CUDA device (torch.cuda.is_available() is False); "
                         f"use {name} cpu, or a machine (and torch build) with a GPU")
    return device_type


def local_placement(nproc: int, device_type: str) -> tuple[str, list[torch.device]]:
    """(backend, device of each local rank). CPU: gloo. CUDA: NCCL with a GPU per rank when
    there are enough GPUs; else gloo with ranks sharing GPUs round-robin, their tensors
    staged through host memory (``ctxpar.comm``: the test and debug path)."""
    if device_type == "cpu":
        return "gloo", [torch.device("cpu")] * nproc
    gpus = torch.cuda.device_count()
    if nproc <= gpus:
        return "nccl", [torch.device("cuda", r) for r in range(nproc)]
    return "gloo", [torch.device("cuda", r % gpus) for r in range(nproc)]


def hybrid_mesh(device_type: str, world: int, ulysses: int):
    """The hybrid strategy's (ring, ulysses) mesh of ``world`` ranks: all-to-all over ``ulysses``
    neighbouring ranks, a ring across the world / ulysses groups."""
    return init_mesh(device_type, (world // ulysses, ulysses), ("ring", "ulysses"))


def init_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """``init_device_mesh`` whose groups wait as long as the run's collective timeout.

    torch gives a DeviceMesh's dimension groups its default timeout (30 minutes for gloo),
    not the one the process group was created with, so a frozen rank would hold the others
    far past ``--timeout`` and the launcher would blame a healthy rank still waiting.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    timeout = _collective_timeout or datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    for name in names:
        distributed_c10d._set_pg_timeout(timeout, mesh.get_group(name))
    return mesh


def _join(backend: str, timeout_s: float, **init) -> None:
    """``init_process_group``, remembering the timeout for the groups ``init_mesh`` makes."""
    global _collective_timeout
    _collective_timeout = datetime.timedelta(seconds=timeout_s)
    # the groups fn makes (dist.new_group, init_device_mesh) wait as long as the run's: torch's defaults are 30
    # minutes (gloo) and 10 (NCCL)
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = _collective_timeout
    dist.init_process_group(backend, timeout=_collective_timeout, **init)


def local_gpu() -> torch.device:
    """This torchrun rank's GPU: ``cuda:LOCAL_RANK`` where the process sees a GPU for each of
    its node's LOCAL_WORLD_SIZE ranks, ``cuda:0`` where it sees exactly one that
    CUDA_VISIBLE_DEVICES chose (a scheduler giving each rank its own, as SLURM's GPU binding
    does) or where it is the node's only rank. Anything else is refused before joining, on
    every rank of the node alike: NCCL takes one GPU per rank (ranks sharing one fail later,
    "duplicate GPU"), and which of several a rank should take would be a guess. Whether
    the one GPU each rank sees is really its own (not one that CUDA_VISIBLE_DEVICES set for
    the whole job shows them all) only the node's ranks together can tell:
    ``check_own_gpus``, which ``init_from_env`` runs after the rendezvous."""
    local_rank, local_world = _local_ranks()
    gpus = torch.cuda.device_count()
    if gpus == 1 and (local_world == 1 or os.environ.get("CUDA_VISIBLE_DEVICES")):
        return torch.device("cuda", 0)
    if gpus and local_world <= gpus:
        return torch.device("cuda", local_rank)
    if not gpus:
        raise ValueError(f"torchrun rank {local_rank} of this node sees no GPU (torch.cuda.device_count() == 0): run "
                         f"on GPU nodes with a CUDA build of torch, or use --device cpu (gloo)")
    raise ValueError(f"torchrun started {local_world} ranks on this node, and each sees {gpus} GPUs: NCCL needs a GPU "
                     f"per rank; start at most {gpus} (--nproc-per-node {gpus}), or give each rank its own GPU "
                     f"(CUDA_VISIBLE_DEVICES, one per rank), or use --device cpu (gloo)")


def _local_ranks() -> tuple[int, int]:
    """(this rank's place on its node, the node's ranks), as torchrun sets them (LOCAL_RANK,
    LOCAL_WORLD_SIZE); without them, one rank alone on its node."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, device_type: str = "cuda") -> torch.device:
    """Join the group torchrun describes: NCCL on this rank's local GPU (``device_type``
    "cuda", ``local_gpu``), or gloo on the CPU. ``timeout_s`` bounds each collective (and the
    rendezvous)."""
    check_timeout(timeout_s)
    if device_type == "cuda":
        device = local_gpu()
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # torchrun's store outlives a restart (--max-restarts) and torch keys nothing by attempt:
    # restarted ranks would read the failed attempt's addresses and never connect
    global _launch_store, _joins
    _launch_store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    _joins += 1  # a second group this process joins must not read the first one's keys either
    store = dist.PrefixStore(f"ctxpar/attempt-{torchrun_restart()}/join-{_joins}", _launch_store)
    local_rank, local_world = _local_ranks()
    # builds whose devices report no UUID (some ROCm builds) cannot tell their GPUs apart: NCCL will
    gpu = getattr(torch.cuda.get_device_properties(device), "uuid", None) if device_type == "cuda" else None
    if gpu is not None and local_world > 1:
        # torchrun numbers a node's ranks on from its first: rank - LOCAL_RANK names the node
        check_own_gpus(store, node=rank - local_rank, local_rank=local_rank, local_world=local_world, rank=rank,
                       device=device, gpu=str(gpu), timeout_s=timeout_s)
    _join(backend, timeout_s, store=store, rank=rank, world_size=world)
    return device


def check_own_gpus(store: dist.Store, *, node: int, local_rank: int, local_world: int, rank: int,
                   device: torch.device, gpu: str, timeout_s: float) -> None:
    """Refuse ranks of one node that would share a GPU, on every one of them alike, before
    they join: each publishes the UUID of its GPU (``gpu``) in ``store`` and reads its
    node-mates' (``local_world`` keys, whatever the world's size). ``device`` is how this
    rank sees it. ``local_gpu`` cannot tell alone: CUDA_VISIBLE_DEVICES=0 set for a whole
    job gives every rank one GPU, the same one, as does a per-rank list naming one GPU twice.
    A node-mate that never publishes (it failed before) is named after ``timeout_s``."""
    mates = dist.PrefixStore(f"gpus/node-{node}", store)
    mates.set(str(local_rank), json.dumps([rank, str(device), gpu]))
    keys = [str(r) for r in range(local_world)]
    try:
        mates.wait(keys, datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        missing = [int(k) for k in keys if not mates.check([k])]
        if missing:  # else the last arrived as the wait gave up
            raise RuntimeError(f"torchrun rank {rank} waited {timeout_s:g} s for local ranks {missing} of its node "
                               f"to say which GPU they took; see their errors") from None
    published = [json.loads(value) for value in mates.multi_get(keys)]  # [rank, device, uuid] by local rank
    sharing: dict[str, list[list]] = {}
    for entry in published:
        sharing.setdefault(entry[2], []).append(entry)
    shared = [entries for entries in sharing.values() if len(entries) > 1]
    if not shared:
        return
    said = "; ".join(f"torchrun ranks {', '.join(f'{r} ({d})' for r, d, _ in entries)} would share one GPU "
                     f"(UUID {entries[0][2]})" for entries in shared)
    raise ValueError(f"{said}: NCCL needs a GPU per rank, and the {local_world} ranks of this node see "
                     f"{len(sharing)} between them (CUDA_VISIBLE_DEVICES set alike for the whole job shows every "
                     f"rank the same one); give each rank its own GPU (CUDA_VISIBLE_DEVICES, one per rank, as "
                     f"SLURM's --gpus-per-task=1 sets it), or start at most {len(sharing)} (--nproc-per-node "
                     f"{len(sharing)}), or use --device cpu (gloo)")


def joined_torchrun() -> bool:
    """Whether this process joined torchrun's group through ``init_from_env`` (or ``run``),
    which launch marks need."""
    return _launch_store is not None


def mark_launch(name: str) -> None:
    """Record ``name`` for the rest of this torchrun launch: its restarts see it
    (``launch_marked``), a new launch does not."""
    _joined_launch().set(f"ctxpar/marks/{name}", "1")


def launch_marked(name: str) -> bool:
    """Whether an attempt of this torchrun launch recorded ``name`` (``mark_launch``)."""
    return _joined_launch().check([f"ctxpar/marks/{name}"])


def launch_token() -> str:
    """A token naming this torchrun launch, the same in all its attempts: the first rank to ask
    draws it, and the launch's store keeps it."""
    return _joined_launch().compare_set("ctxpar/launch-token", "", uuid.uuid4().hex).decode()


def _joined_launch() -> dist.Store:
    if _launch_store is None:
        raise RuntimeError("launch marks need the torchrun group that init_from_env (or run) joins")
    return _launch_store


def _stray_launcher_vars() -> list[str]:
    return [name for name in LAUNCHER_VARS if name in os.environ]


def describe_mode(nproc: int, timeout_s: float, device_type: str = "cpu") -> str:
    """The one line ``run`` prints: which ranks it uses, and what it ignores."""
    if launched_by_torchrun():
        backend = "nccl" if device_type == "cuda" else "gloo"
        return (f"ctxpar: joining torchrun's group of {os.environ['WORLD_SIZE']} ranks with backend {backend} "
                f"(collective timeout {timeout_s:g} s)")
    backend, devices = local_placement(nproc, device_type)
    where = "the CPU" if device_type == "cpu" else ", ".join(sorted({str(d) for d in devices}))
    shared = ""
    if device_type == "cuda" and backend == "gloo":
        shared = " (sharing GPUs: transfers staged through host memory)"
    line = (f"ctxpar: spawning {nproc} local {backend} ranks on 127.0.0.1, computing on {where}{shared} "
            f"(collective timeout {timeout_s:g} s)")
    stray = _stray_launcher_vars()
    if stray:
        line += (f"; ignoring {', '.join(stray)} from the environment (not a torchrun launch: "
                 f"{', '.join(n for n in TORCHRUN_VARS if n not in os.environ)} unset)")
    return line


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def _isolate_from_launcher_env() -> None:
    """Make this worker see no launcher: its group is the one of the parent's store on 127.0.0.1."""
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    loopback = _loopback_interface()
    if loopback is not None:  # gloo otherwise binds the address the hostname resolves to
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def _watch_parent(parent_pid: int, interval: float = PARENT_POLL_S) -> None:
    """Exit this process once ``parent_pid`` is no longer its parent (it died; we were re-parented)."""
    while os.getppid() == parent_pid:
        time.sleep(interval)
    os._exit(1)  # from any thread, even while the main one is blocked in a collective


def _watch_caller(pid: int, start: str, interval: float = PARENT_POLL_S) -> None:
    """Exit this process once process ``pid``, started at ``start`` (``_stat``), has ended."""
    while _is_running(pid, start):
        time.sleep(interval)
    os._exit(1)


def _die_with_parent(parent_pid: int, caller: tuple[int, str | None]) -> None:
    """Make this worker end when the process that called run_local does, however that one ends.
    ``parent_pid``: this worker's parent, the caller or the server that forked it
    (``rank_server``), which ends with the caller; ``caller``: its (pid, start time), the start
    time None where there is no /proc."""
    if sys.platform.startswith("linux"):
        # The kernel sends SIGKILL to this process when the thread that started it ends: it
        # works even when the parent is SIGKILLed and this process is blocked in C++.
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # What its children orphan (a daemon's double fork) is re-parented to this worker, not to
        # init, so that the end of the run finds it among the worker's descendants and ends it.
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    # A thread that notices the caller gone within a second: the only mechanism outside Linux,
    # and on Linux a second one (PDEATHSIG follows the starting *thread*, not the process, and
    # a server outlives the caller while a child that inherited its "alive" pipe holds it).
    pid, start = caller
    watch, args = (_watch_caller, (pid, start)) if start is not None else (_watch_parent, (parent_pid,))
    threading.Thread(target=watch, args=args, daemon=True, name="ctxpar-parent-watch").start()


# Asked of a rank still running when a run is given up: where its main thread is. Inside
# torch.distributed means it waits in a collective (or the rendezvous); anywhere else means
# it never arrived where the others wait.
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)


def _dump_stack_on_request(writer: connection.Connection) -> None:
    """Write this process's stacks to ``writer``, a pipe to the parent, when it asks (a pipe, not
    a file: a parent ended by SIGTERM or SIGKILL leaves nothing behind). faulthandler holds
    only its descriptor: the worker keeps ``writer`` open for the life of the process."""
    if _STACK_SIGNAL is None:
        return
    os.write(writer.fileno(), f"main thread {threading.get_ident():#x}\n".encode())
    faulthandler.register(_STACK_SIGNAL, file=writer.fileno(), all_threads=True)


@dataclass(frozen=True)
class _Whereabouts:
    in_collective: bool
    where: str  # "in all_reduce (torch.distributed)" or "at train.py:42 in step"


def _probe(procs: list, ranks: list[int], stacks: list[connection.Connection]) -> dict[int, _Whereabouts]:
    """Where each of ``ranks`` (alive) is: its main thread's innermost frames, by signal."""
    if _STACK_SIGNAL is None:
        return {}
    asked, found = [], {}
    for r in ranks:
        if procs[r].is_alive() and _frozen(procs[r].pid):  # it cannot answer: the signal waits for it
            found[r] = _Whereabouts(False, "frozen by a signal (SIGSTOP or a debugger: process state T)")
        elif procs[r].is_alive():
            os.kill(procs[r].pid, _STACK_SIGNAL)
            asked.append(r)
    dumps = {r: b"" for r in asked}
    open_ = {stacks[r]: r for r in asked}
    end = time.monotonic() + PROBE_S
    while open_ and (left := end - time.monotonic()) > 0:  # read as they write: a pipe holds only 64 KiB
        for reader in connection.wait(list(open_), left):
            chunk = os.read(reader.fileno(), 1 << 16)
            if chunk:
                dumps[open_[reader]] += chunk
            else:  # the process is gone
                del open_[reader]
    for r, dump in dumps.items():
        if not dump:  # the signal's default action ended it: it was still importing
            found[r] = _Whereabouts(False, "still starting (importing, before its worker code)")
            continue
        frames = _main_thread_frames(dump.decode(errors="replace"))
        if frames:
            found[r] = _whereabouts(frames)
    return found


def _stat(pid: int) -> list[str]:
    """The fields of Linux's /proc/<pid>/stat after the command name (which may hold spaces):
    [0] the state, [19] the start time; [] where it is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return []


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter ("R", "S", "T": stopped by a signal, "Z": a zombie, "X":
    dead); None where it is gone or cannot be read."""
    fields = _stat(pid)
    return fields[0] if fields else None


def _frozen(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (False where it cannot tell)."""
    return process_state(pid) in ("T", "t")


def _main_thread_frames(dump: str) -> list[tuple[str, str, str]]:
    """(file, line, function) of the main thread, innermost first, from a faulthandler dump."""
    header = re.match(r"main thread (0x[0-9a-f]+)", dump)
    if header is None:
        return []
    main = int(header[1], 16)
    frames, current = [], None
    for line in dump.splitlines():
        thread = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", line)
        if thread:
            current = int(thread[1], 16)
            frames = [] if current == main else frames
            continue
        frame = re.match(r'\s+File "(.+)", line (\d+) in (\S+)', line)
        if frame and current == main:
            frames.append(frame.groups())
    return frames


_DECORATORS = {"wrapper", "inner", "_fn", "decorated"}  # torch wraps its collectives in these


_COMM = os.path.join("ctxpar", "comm.py")  # ctxpar's own transfers: the ring's receive waits in a Work.wait,
# which has no Python frame in torch.distributed


def _whereabouts(frames: list[tuple[str, str, str]]) -> _Whereabouts:
    """Where ``frames`` (file, line, function; innermost first) stand: in a collective or not."""
    outermost_first = list(reversed(frames))
    inside = [i for i, f in enumerate(outermost_first) if f"torch{os.sep}distributed" in f[0]]
    calls = [outermost_first[i][2] for i in inside if outermost_first[i][2] not in _DECORATORS]
    if calls:  # the outermost: the call made, and the code that made it (outside ctxpar.comm's own transfers)
        caller = next((f for f in reversed(outermost_first[:inside[0]]) if _COMM not in f[0]), None)
        return _Whereabouts(True, f"in {calls[0]} (torch.distributed)" + _called_from(caller))
    waiting = next((i for i, f in enumerate(frames) if _COMM in f[0]), None)
    if waiting is not None:  # the innermost, and the code outside comm and the libraries that reached it
        caller = next((f for f in frames[waiting + 1:] if _COMM not in f[0] and not _in_library(f[0])), None)
        return _Whereabouts(True, f"in {frames[waiting][2]} (ctxpar.comm)" + _called_from(caller))
    file, line, function = frames[0]
    # stuck inside a library call: also the user's code that made it
    caller = next((f for f in frames if not _in_library(f[0])), None) if _in_library(file) else None
    return _Whereabouts(False, f"at {_shown(file)}:{line} in {function}" + _called_from(caller))


def _called_from(frame: tuple[str, str, str] | None) -> str:
    return "" if frame is None else f", called from {_shown(frame[0])}:{frame[1]} in {frame[2]}"


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(paths[key], "") for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def _in_library(file: str) -> bool:
    """Python's own modules and installed packages (not ctxpar's source tree, nor the user's)."""
    return file.startswith("<") or file.startswith(_library_roots())


def _shown(file: str) -> str:
    """A frame's file as a stack report names it: a library's module by its path in the
    library (``re/__init__.py``), any other by its name."""
    root = next((r for r in _library_roots() if file.startswith(r)), None)
    return file[len(root):] if root else os.path.basename(file)


def _frames_of(e: BaseException) -> list[tuple[str, str, str]]:
    """The frames (file, line, function; innermost first) that ``e`` came through on its way out
    of fn: its own traceback, not one it was chained to, nor one its message quotes."""
    return [(f.filename, str(f.lineno), f.name) for f in reversed(traceback.extract_tb(e.__traceback__))]


def _text(e: BaseException) -> str:
    """``str(e)``, or "" where the exception's own ``__str__`` raises (its report was once lost)."""
    try:
        return str(e)
    except Exception:  # noqa: BLE001  whatever it raised
        return ""


# what a backend's own timeout says, raised from C++ (a Work.wait() leaves no Python frame in torch.distributed)
_BACKEND_TIMEOUT = re.compile(r"gloo|nccl|Timed out waiting", re.IGNORECASE)


def _is_timeout(e: BaseException) -> bool:
    """A wait in a collective or the rendezvous that expired: a torch.distributed error, one
    raised inside torch.distributed or ctxpar.comm, or a backend's; not fn's own error that
    says "timed out" (a download's), which once blamed a healthy peer and added a timeout
    to the run."""
    if isinstance(e, dist.DistStoreError):
        return True
    text = _text(e)
    return "timed out" in text.lower() and (isinstance(e, dist.DistError) or bool(_BACKEND_TIMEOUT.search(text))
                                            or _whereabouts(_frames_of(e)).in_collective)


def _worker(rank, world_size, port, threads, timeout_s, parent_pid, caller, backend, device, stack_writer, fn,
            args, conn) -> None:
    global _in_local_rank
    _in_local_rank = True
    # daemonic to this process's parent, which stops it at its exit; not to itself, so that fn may start
    # processes (a DataLoader's workers), which end with it (the finally below), by the platform's default
    # start method, as under torchrun (the method that started this process set itself as the default: spawn's had
    # each worker import torch anew)
    mp.current_process().daemon = False
    mp.set_start_method(None, force=True)
    _die_with_parent(parent_pid, caller)
    _dump_stack_on_request(stack_writer)
    # Ctrl-C reaches every process of the terminal's group; the parent alone handles it
    # (and stops the workers), so that one interrupt gives one message. Started with SIGINT
    # blocked (run_local), so that one during the start-up waited; ignored, it is discarded.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _isolate_from_launcher_env()
    heap.keep_freed_memory()
    try:
        torch.set_num_threads(threads)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)  # the parent serves it
        _join(backend, timeout_s, store=store, rank=rank, world_size=world_size)
        store.set(f"{_JOINED}{rank}", "")
        conn.send_bytes(pickle.dumps(("joined", None)))
        result = fn(rank, world_size, *args, *(() if device is None else (device,)))
        conn.send_bytes(_result_bytes(("ok", result)))
    except StopRun as e:  # on purpose: the message says it all
        conn.send_bytes(pickle.dumps(("stopped", _text(e))))
    except SystemExit:  # sys.exit in fn: a failure, and the rank leaves fn as a return does
        conn.send_bytes(pickle.dumps(("exited", traceback.format_exc())))
    except BaseException as e:  # report everything, including failed asserts, to the parent
        conn.send_bytes(pickle.dumps(("timeout" if _is_timeout(e) else "error", (traceback.format_exc(),
                                                                                 _frames_of(e)))))
    finally:
        conn.close()
        try:
            if dist.is_initialized():
                _stay_until_all_joined(store, world_size, timeout)
                dist.destroy_process_group()
        finally:
            _end(_descendants(os.getpid()))  # what fn forked or spawned and left running


_JOINED = "ctxpar/joined/"  # + a rank: set in the run's store once that rank has joined the group


def _stay_until_all_joined(store: dist.Store, world_size: int, timeout: datetime.timedelta) -> None:
    """Leave only once every rank has joined the group: gloo's join connects each pair, and a
    rank whose fn made no collective and returned at once closed its side of a pair its peer
    was still connecting ("Connection closed by peer" in init_process_group, on a loaded
    machine). A rank that never joins ends the run at the parent, which stops this one."""
    try:
        store.wait([f"{_JOINED}{r}" for r in range(world_size)], timeout)
    except dist.DistStoreError:
        pass  # the parent has this rank's report, and the others' failure to say


def _descendants(pid: int) -> list[tuple[int, str]]:
    """The processes ``pid`` started and theirs, still running, each as (pid, start time): the
    pair names the process even once its pid is reused (Linux's /proc; none elsewhere)."""
    found, parents = [], [pid]
    while parents:
        parent = parents.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:  # gone, or no /proc
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue
            found += [(child, fields[19]) for child in children if len(fields := _stat(child)) > 19]
            parents += children
    return found


def _is_running(pid: int, start: str) -> bool:
    """Whether process ``pid``, started at ``start`` (``_stat``), runs (a pid reused since is another process)."""
    return bool(fields := _stat(pid)) and fields[19:20] == [start] and fields[0] not in ("Z", "X")


def _end(processes: list[tuple[int, str]]) -> None:
    """End what a rank forked or spawned and left running (``_descendants``), as the rank ends:
    it outlived the run, re-parented, a forked copy holding the rank's memory and sockets.
    SIGTERM, then SIGKILL to what still runs ``GRACE_S`` later."""
    def running() -> list[int]:
        return [pid for pid, start in processes if _is_running(pid, start)]

    def send(pids: list[int], sent: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sent)

    send(running(), signal.SIGTERM)
    deadline, left = time.monotonic() + GRACE_S, running()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = running()
    send(left, signal.SIGKILL)


def _stop(procs: list) -> None:
    """SIGTERM, then SIGKILL what is still there a few seconds later; then end what each rank
    stopped so had started (``_end``: a rank that ends itself ends its own)."""
    started = {p.pid: _descendants(p.pid) for p in procs if p.is_alive()}  # before they are re-parented
    for p in procs:
        if p.is_alive():
            p.terminate()
            if hasattr(signal, "SIGCONT"):  # a rank frozen by SIGSTOP takes the SIGTERM only once continued
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        if p.pid is None:  # never started
            continue
        while p.exitcode is None and time.monotonic() < deadline:  # not join(timeout): see EXIT_POLL_S
            time.sleep(0.01)
        if p.exitcode is None:
            p.kill()
            p.join()  # waitpid, which a sentinel held open does not delay
    _end([process for p in procs for process in started.get(p.pid, [])])  # one grace period for them all


def run_local(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    threads: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline_s: float | None = None,
    device_type: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` local ranks; return their results.

    ``fn`` must be importable (module level) and its arguments and result picklable.
    ``threads`` per rank (at most ``THREADS_PER_CORE`` per core) defaults to the machine's
    cores shared out between the ranks.
    ``timeout_s`` bounds each collective and the rendezvous; ``deadline_s`` (default: none)
    bounds the run from the moment every rank's process is launched (a rank server's start
    not counted). ``device_type`` None: a gloo group and ``fn(rank, nproc, *args)``;
    "cpu" or "cuda": the placement of ``local_placement`` and ``fn(rank, nproc, *args,
    device)``. Raises ``RankFailure`` naming every rank that failed, died or never
    finished; the other ranks are stopped first.
    """
    _check_can_spawn()
    check_nproc(nproc)
    backend, devices = "gloo", [None] * nproc
    if device_type is not None:
        backend, devices = local_placement(nproc, resolve_device_type(device_type))
    check_timeout(timeout_s)
    if deadline_s is not None and not 0 < as_real(deadline_s) < math.inf:
        raise ValueError(f"deadline_s {deadline_s!r} must be a positive number of seconds, or None for no deadline")
    cores = os.cpu_count() or 1
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= THREADS_PER_CORE * cores):
        raise ValueError(f"threads {threads!r} must be a positive int (torch threads per rank) of at most "
                         f"{THREADS_PER_CORE * cores} ({THREADS_PER_CORE} per core of this machine's {cores}: more "
                         f"only time-share them), or None to share the machine's cores out between the ranks")
    _check_importable(fn)
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"run_local's args must be a tuple (or list) of fn's arguments after (rank, nproc), not "
                         f"{type(args).__name__!r}; for one argument x, args=(x,)")
    threads = threads or max(1, cores // nproc)
    pipes = [mp.Pipe(duplex=False) for _ in range(nproc)]
    stack_pipes = [mp.Pipe(duplex=False) for _ in range(nproc)]
    store, port = _local_store(timeout_s)
    caller = (os.getpid(), next(iter(_stat(os.getpid())[19:20]), None))  # its start time: None without /proc
    procs: list = []
    process_class = server = None
    try:
        # Ctrl-C waits until every worker is started: one interrupted halfway through a start
        # would run on untracked, holding the terminal's pipes, until it notices the parent gone.
        # The workers inherit SIGINT blocked (until _worker ignores it): a Ctrl-C while they still
        # import torch (seconds) reaches the terminal's whole group, and printed their
        # KeyboardInterrupt tracebacks. This thread blocking it is not enough: another thread of
        # this process (the store's) may take it, so the handler holds it until the starts are done
        # (ignored meanwhile, as it once was, it was lost: the run went on after the Ctrl-C). The
        # handler goes in first, so that nothing raises between the mask and the try that restores it;
        # not over a handler set outside Python (it could not be put back).
        held: list[int] = []
        holding = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None
        handler = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)) if holding else None
        blocked = None
        try:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the caller's mask, put back below
            for r, ((_, writer), (_, stack_writer)) in enumerate(zip(pipes, stack_pipes)):
                # multiprocessing's resource tracker, started (first, or again if it died) within a start,
                # unblocks SIGINT and SIGTERM in this thread before the rank is spawned: started here first
                resource_tracker.ensure_running()
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                if process_class is None:  # a rank server started now has SIGINT blocked, as has every rank it forks
                    process_class, server = rank_server.acquire()
                procs.append(process_class(
                    target=_worker, name=f"ctxpar-rank-{r}", daemon=True,
                    args=(r, nproc, port, threads, timeout_s, server.pid if server else os.getpid(), caller, backend,
                          devices[r], stack_writer, _ForRanks(fn, "fn"), _ForRanks(args, "args"), writer)))
                procs[-1].start()
                writer.close()  # the worker holds the only writer: its end of file means it is gone
                stack_writer.close()
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if holding:
                signal.signal(signal.SIGINT, handler)
        if held:
            signal.raise_signal(signal.SIGINT)  # to the handler it was meant for, now every worker is tracked
        return _collect(procs, [reader for reader, _ in pipes], [reader for reader, _ in stack_pipes], timeout_s,
                        deadline_s)
    finally:
        _stop(procs)
        rank_server.release(server)
        del store  # its server stops, and its port is free again
        for pipe in (*pipes, *stack_pipes):
            for end in pipe:
                end.close()


def _check_can_spawn() -> None:
    """Refuse to start ranks from a rank of run_local (one run_local starts every rank a job
    needs), or from a daemonic process, which multiprocessing forbids to start any, with a bare
    assertion at the first start."""
    this = mp.current_process()
    if _in_local_rank:
        raise ValueError(f"run_local called in {this.name!r}, a rank of another run_local: ranks cannot spawn ranks; "
                         f"start one run_local with all the ranks the job needs, and split them with dist.new_group "
                         f"inside fn")
    if this.daemon:
        raise ValueError(f"run_local called in {this.name!r}, a daemonic process (a multiprocessing pool's worker, "
                         f"say), which cannot start processes: call run_local from the main process")


def _check_importable(fn) -> None:
    """Refuse, before spawning, an ``fn`` that is not callable (each rank failed calling it), or
    one that spawned ranks cannot import: one defined in a notebook cell, the REPL, ``python -c``
    or a script read from stdin (a ``__main__`` without a file), or inside the script's
    ``if __name__ == "__main__":`` block, which the ranks' import of the script skips. Each
    rank failed to unpickle it before it could report why. A lambda or nested function fails
    to pickle: ``_ForRanks``."""
    if not callable(fn):
        raise ValueError(f"run_local's fn {fn!r} is not callable: pass the function each rank calls as "
                         f"fn(rank, nproc, *args)")
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None)
    if module == "__main__" and getattr(sys.modules.get("__main__"), "__file__", None) is None:
        raise ValueError(f"run_local's fn {getattr(fn, '__qualname__', fn)!r} is defined in an interactive session "
                         f"(a notebook cell, the REPL, python -c or stdin), which the spawned ranks cannot import; "
                         f"define it in a module file and import it from there")
    if module == "__main__" and _defined_under_main_guard(fn):
        raise ValueError(f"run_local's fn {fn.__qualname__!r} is defined inside the script's "
                         f"if __name__ == '__main__': block, which the spawned ranks do not run when they import "
                         f"the script; move its definition above that block")


def _defined_under_main_guard(fn) -> bool:
    """Whether ``fn``'s def (of the ``__main__`` script) lies in a top-level ``if __name__ ==
    "__main__":`` block; False where the script cannot be read or parsed."""
    try:
        code, script = inspect.unwrap(fn).__code__, sys.modules["__main__"].__file__  # through decorators
        if os.path.realpath(code.co_filename) != os.path.realpath(script):  # defined elsewhere (runpy.run_path)
            return False
        with tokenize.open(script) as f:  # its coding cookie honoured
            tree = ast.parse(f.read())
    except Exception:  # noqa: BLE001  unreadable: the ranks' own error will say
        return False
    line = code.co_firstlineno

    def is_main_guard(test: ast.expr) -> bool:
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            return False
        sides = (test.left, test.comparators[0])
        return any(isinstance(a, ast.Name) and a.id == "__name__" and isinstance(b, ast.Constant)
                   and b.value == "__main__" for a, b in (sides, sides[::-1]))

    # from the guard's own line, not its body's first statement: a decorated def's code starts at its decorator, a
    # line before the statement (a guard opening with one went unrefused); its body, not its else
    return any(isinstance(node, ast.If) and is_main_guard(node.test)
               and node.lineno <= line <= node.body[-1].end_lineno for node in tree.body)


class _CopyingPickler(ForkingPickler):
    """multiprocessing's pickler (its queues, locks and connections pickle for the ranks) without
    torch's reductions, which move a tensor's storage to shared memory: each rank gets a copy
    of a tensor argument, as of any other (a rank's in-place op once reached every rank and the
    caller: attention 0.9 off where each rank scaled its q in place)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for kind in [k for k in self.dispatch_table if isinstance(k, type)]:
            if issubclass(kind, torch.Tensor) or (kind.__module__.startswith("torch") and "Storage" in kind.__name__):
                del self.dispatch_table[kind]


class _ResultPickler(pickle.Pickler):
    """Plain pickle (multiprocessing's would share a tensor's memory with a process about to
    exit), sending a view of a larger tensor as a copy of its own elements: pickle sends the
    whole storage (8 floats of a 512 MiB tensor once took 512 MiB per rank). Plain tensors
    only: a Parameter or another subclass is sent as pickle sends it."""

    def reducer_override(self, obj):
        if (type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.requires_grad
                and obj.device.type != "meta" and obj.untyped_storage().nbytes() > obj.numel() * obj.element_size()):
            return obj.clone().__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return NotImplemented


def _result_bytes(message: tuple) -> bytes:
    buffer = io.BytesIO()
    _ResultPickler(buffer, pickle.DEFAULT_PROTOCOL).dump(message)
    return buffer.getvalue()


class _ForRanks:
    """``fn`` or ``args`` on its way to a rank, pickled on its own so that a failure names it
    (pickle's error names neither: "Can't pickle local object", "cannot pickle '_thread.lock'
    object"). Pickled as the rank starts, before its process exists: the first rank fails
    before any runs, and in spawn's context, where multiprocessing's queues and locks pickle
    (a check beforehand would refuse them)."""

    def __init__(self, value: Any, name: str) -> None:
        self.value, self.name = value, name

    def __reduce__(self):
        try:
            return pickle.loads, (bytes(_CopyingPickler.dumps(self.value)),)
        except Exception as e:  # noqa: BLE001  whatever the pickler raised: named, with the fix
            if self.name == "fn":
                raise ValueError(f"run_local's fn {getattr(self.value, '__qualname__', self.value)!r} cannot be "
                                 f"pickled for the ranks ({e}): pass a function defined at the top level of a module "
                                 f"(not a lambda, nor a function defined inside another), or a functools.partial of "
                                 f"one whose arguments pickle") from e
            what, error = "args", e  # unless one argument fails alone: that one
            for i, arg in enumerate(self.value):
                try:
                    _CopyingPickler.dumps(arg)
                except Exception as arg_error:  # noqa: BLE001
                    what, error = f"args[{i}], a {type(arg).__name__},", arg_error
                    break
            raise ValueError(f"run_local's {what} cannot be pickled for the ranks ({error}): pass what pickles "
                             f"(tensors, numbers, strings, dataclasses...) and make the rest in fn") from e


def _collect(procs: list, readers: list, stacks: list[connection.Connection], timeout_s: float,
             deadline_s: float | None) -> list[Any]:
    """Wait on every rank's messages and exit at once; the results in rank order, or RankFailure."""
    start = time.monotonic()
    pending = set(range(len(procs)))
    silent: set[int] = set()  # pipe closed: only the exit is left to see
    joined: set[int] = set()
    outputs: dict[int, Any] = {}
    failed: dict[int, tuple[str, str]] = {}  # rank -> (kind, traceback), in the order they arrived
    raised_at: dict[int, _Whereabouts] = {}  # of the ranks that raised: where, by the frames of what they raised
    died: dict[int, str] = {}
    with_their_server: set[int] = set()  # of the dead, those the kernel killed as their rank server ended
    give_up = start + deadline_s if deadline_s is not None else None
    grace_started = False

    def read(r: int) -> None:
        """Take every message rank ``r`` has sent so far."""
        while r in pending and r not in silent and readers[r].poll():
            try:
                message = readers[r].recv_bytes()
            except EOFError:
                silent.add(r)
                return
            try:
                kind, value = pickle.loads(message)
            except Exception:  # noqa: BLE001  a result the parent cannot rebuild: that rank's failure, named
                kind, value = "error", (f"its result could not be unpickled in the parent:\n"
                                        f"{traceback.format_exc()}", [])
            if kind == "joined":
                joined.add(r)
                continue
            pending.discard(r)
            if kind == "ok":
                outputs[r] = value
                return
            if kind in ("error", "timeout"):
                value, frames = value
                if frames:
                    raised_at[r] = _whereabouts(frames)
            failed[r] = (kind, value)

    while pending:
        wait = EXIT_POLL_S if give_up is None else max(0.0, min(EXIT_POLL_S, give_up - time.monotonic()))
        watched = [readers[r] for r in pending if r not in silent] + [procs[r].sentinel for r in pending]
        ready = set(connection.wait(watched, wait))
        if not ready and give_up is not None and time.monotonic() >= give_up:
            break
        for r in sorted(pending):
            if readers[r] in ready:
                read(r)
        for r in sorted(pending):
            if procs[r].sentinel in ready or procs[r].exitcode is not None:  # the status: see EXIT_POLL_S
                read(r)  # a rank that reported and then exited: its report is in the pipe
                if r in pending:
                    pending.discard(r)
                    procs[r].join(timeout=GRACE_S)  # its pipe closes an instant before it can be reaped
                    died[r] = rank_server.exit_reason(procs[r].exitcode)
                    if getattr(procs[r]._popen, "server_ended", False):
                        with_their_server.add(r)
                        died[r] += (f" when its rank server (ctxpar.rank_server) ended "
                                    f"({rank_server.how_it_ended(procs[r].rank_server)}): the kernel ends a rank with "
                                    f"the server that forked it")
        if died:  # a process gone without a word was killed or crashed: that is the cause, stop now
            break
        if failed and pending and not grace_started:
            grace_started = True
            # a rank that timed out waited for a peer; healthy ranks that reached that
            # collective later time out up to timeout_s later, and only once they have
            # reported is the rank still running known to be the one that never arrived.
            # Ranks frozen by a signal (SIGSTOP, a debugger) will not time out: none else, no wait
            first_kind = next(iter(failed.values()))[0]
            peers_may_time_out = first_kind == "timeout" and not all(_frozen(procs[r].pid) for r in pending)
            grace_end = time.monotonic() + GRACE_S + (timeout_s if peers_may_time_out else 0.0)
            give_up = grace_end if give_up is None else min(give_up, grace_end)
    if not (failed or died or pending):
        return [outputs[r] for r in range(len(procs))]
    stuck = sorted(pending)
    whereabouts = {**raised_at, **(_probe(procs, stuck, stacks) if stuck and not died else {})}
    message = _failure_message(failed, died, stuck, joined, whereabouts, timeout_s, deadline_s,
                               time.monotonic() - start, returned=frozenset(outputs),
                               with_their_server=frozenset(with_their_server))
    raise RankFailure(message, {r: tb for r, (_, tb) in failed.items()}, died, stuck)


def _failure_message(
    failed: dict[int, tuple[str, str]], died: dict[int, str], stuck: list[int], joined: set[int],
    whereabouts: dict[int, _Whereabouts], timeout_s: float, deadline_s: float | None, elapsed: float,
    returned: frozenset[int] = frozenset(), with_their_server: frozenset[int] = frozenset(),
) -> str:
    """Root cause first: the dead, then the ranks the others waited for, then what the ranks raised in the
    order it came: the first crash's traceback, the last line of later ones, and a ``StopRun``'s message
    once for all the ranks that raised it. Where every rank that raised did so waiting in a collective
    and some rank had left ``fn`` (``returned`` its result, or called sys.exit), that rank is the cause.
    ``with_their_server``: the dead the kernel killed as their rank server ended (not dead at start-up)."""
    left = _left_early(failed, died, stuck, whereabouts, returned)
    if left:
        return left
    why_signal = {  # what most often sends it to a rank
        "killed by SIGKILL": " (kill -9, or the kernel's out-of-memory killer)",
        "killed by SIGABRT": " (an abort, most often torch.distributed's backend's: gloo's where the ranks' "
                             "collectives differ in size or kind, NCCL's on an operation failed or timed out; "
                             "the rank's message is on stderr)",
    }
    # before it reports, a rank can only die in spawn's start-up: its error is on stderr
    early = ("; its error is on stderr: a rank that dies this early most often re-ran a script that calls "
             "run_local without an if __name__ == '__main__': guard, or could not import fn or its arguments")
    lines = [f"rank {r} died {'during the run' if r in joined else 'before joining the process group'}: "
             f"{why}{why_signal.get(why, '')}; it reported no result"
             f"{'' if r in joined or r in with_their_server else early}" for r, why in died.items()]
    timed_out = sorted(r for r, (kind, _) in failed.items() if kind == "timeout")
    for r in stuck if not died else []:
        seen = whereabouts.get(r)
        it_was = f"it was {seen.where}" if seen else "it was still running"
        if not failed:
            lines.append(f"rank {r} was still running at the {deadline_s:g} s deadline ({elapsed:.0f} s after the "
                         f"start), {seen.where if seen else 'where unknown'}, and was stopped")
        elif timed_out and not (seen and seen.in_collective):
            # the others gave up waiting at a collective this rank never reached
            at = "at a collective" if r in joined else "at the rendezvous (it never joined the process group)"
            lines.append(f"rank {r} never arrived {at}: ranks {timed_out} timed out after {timeout_s:g} s "
                         f"waiting; {it_was} and was stopped")
        else:
            lines.append(f"rank {r} was still waiting ({seen.where if seen else 'where unknown'}), most likely for "
                         f"the ranks named here, and was stopped")
    stopped: dict[str, list[int]] = {}
    for r, (kind, text) in failed.items():
        if kind == "stopped":
            stopped.setdefault(text, []).append(r)
    crashed = False
    for r, (kind, text) in failed.items():
        if kind == "stopped":
            ranks = sorted(stopped.pop(text, []))
            if ranks:  # the first rank that raised this message: every rank that did
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
                lines.append(f"{who} stopped: {text}")
        elif not crashed:
            crashed = True
            lines.append(f"rank {r} failed:\n{text.rstrip()}")
        else:
            lines.append(f"rank {r} failed too: {text.strip().splitlines()[-1] if text.strip() else 'no message'}")
    return "\n".join(lines)


# how a collective fails for want of a peer that has gone (gloo; NCCL's are mostly timeouts), anywhere in the
# rank's traceback: NCCL's message runs over several lines, and fn may raise another error from it
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited")


def _lost_a_peer(kind: str, text: str) -> bool:
    return kind == "timeout" or any(sign in text.lower() for sign in _PEER_GONE)


def _left_early(failed: dict[int, tuple[str, str]], died: dict[int, str], stuck: list[int],
                whereabouts: dict[int, _Whereabouts], returned: frozenset[int]) -> str | None:
    """The failure of a run in which ranks left ``fn`` (returned or exited) while the others were still
    in a collective, which then failed for want of them (gloo: "Connection closed by peer"; NCCL: the
    timeout), naming those ranks; None for any other failure (one raised in a collective by the rank
    itself, such as an object it could not unpickle after its peers had finished, is its own)."""
    exited = {r: text.strip().splitlines()[-1] for r, (kind, text) in failed.items() if kind == "exited"}
    waiting = {r: whereabouts.get(r) for r, (kind, _) in failed.items() if kind in ("error", "timeout")}
    if died or not (returned or exited) or not waiting or len(exited) + len(waiting) < len(failed):
        return None  # a rank stopped on purpose, or none left early: the usual report
    if not all(_lost_a_peer(*failed[r]) for r in waiting):
        return None
    if not all(seen and seen.in_collective for seen in (*waiting.values(), *(whereabouts.get(r) for r in stuck))):
        return None  # a rank failed (or is stuck) on its own, outside a collective: that is the cause
    waited = sorted((*waiting, *stuck))
    who = f"rank {waited[0]} was" if len(waited) == 1 else f"ranks {', '.join(map(str, waited))} were"
    left = sorted({*returned, *exited})
    how = {r: f"exited fn ({exited[r]})" if r in exited else "returned from fn" for r in left}
    rule = "fn must make the same collective calls on every rank"
    if len(left) == 1:
        lines = [f"rank {left[0]} {how[left[0]]} while {who} still in a collective: {rule} (a rank that leaves fn "
                 f"early leaves the others waiting for it)"]
    else:  # which of them the collective waited for is not known: one may have made every call it had to
        lines = [f"ranks {', '.join(map(str, left))} had left fn while {who} still in a collective, one or more of "
                 f"them early: {rule} (a rank that leaves fn early leaves the others waiting for it)"]
        lines += [f"rank {r} {how[r]}" for r in left]
    lines += [f"rank {r} failed {seen.where}, waiting: {failed[r][1].strip().splitlines()[-1]}"
              for r, seen in sorted(waiting.items())]
    lines += [f"rank {r} was still waiting ({whereabouts[r].where}) and was stopped" for r in stuck]
    return "\n".join(lines)


def run(
    fn: Callable[..., Any], nproc: int, args: tuple = (), *, device_type: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S, deadline_s: float | None = None,
) -> Any:
    """Run ``fn(rank, world_size, *args, device)`` on every rank.

    Under torchrun this process is one of the launched ranks and gets its own rank's
    result; otherwise ``nproc`` local ranks are spawned (whatever RANK / WORLD_SIZE /
    MASTER_* the environment holds) and this process gets rank 0's result. One line on
    stderr says which. ``device_type`` ("cpu" | "cuda", default: see
    ``resolve_device_type``) picks the device and so the backend: NCCL on one GPU per rank,
    gloo otherwise. ``timeout_s`` bounds each collective; ``deadline_s`` (local ranks only,
    default none) the run from the moment every rank's process is launched.
    """
    check_timeout(timeout_s)
    device_type = resolve_device_type(device_type)
    if launched_by_torchrun():
        if os.environ["RANK"] == "0":
            note(describe_mode(nproc, timeout_s, device_type))
        device = init_from_env(timeout_s, device_type)
        try:
            return fn(dist.get_rank(), dist.get_world_size(), *args, device)
        finally:
            if dist.is_initialized():  # fn may have destroyed it (its result was once lost to an AssertionError)
                dist.destroy_process_group()
    check_nproc(nproc)  # before the line that describes the ranks
    note(describe_mode(nproc, timeout_s, device_type))
    return run_local(fn, nproc, args, timeout_s=timeout_s, deadline_s=deadline_s, device_type=device_type)[0]


def note(text: str) -> None:
    """``text`` as a line on stderr, never failing the run for it: nothing where stderr is
    closed (None in a process started with it closed: the note went to stdout) or cannot be
    written (its reader gone, its disk full: a launch line once ended the run before any rank
    started, and said nothing)."""
    if sys.stderr is None:
        return
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # ValueError: a stream closed in this process
        pass


def stderr_is_a_terminal() -> bool:
    """Whether progress bars have a terminal to draw on (stderr may be closed: None)."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except ValueError:  # closed in this process
        return False


def tell_torchrun(message: str, details: str | None = None) -> None:
    """Write why this rank fails to the error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``,
    in the format of torch's ``errors.record``), so that torchrun's failure summary names
    the cause instead of "error_file: <N/A>": ``message`` in one line, ``details`` (a
    traceback; default the message) under "traceback". Outside torchrun, nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not launched_by_torchrun():  # a leftover variable must not redirect a local run's
        return
    extra = {"py_callstack": message if details is None else details, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": extra}}, f)
    except OSError:  # the summary then says <N/A>; the rank's own message is on its stderr
        pass


def told_torchrun() -> bool:
    """Whether this rank wrote torchrun's error file (``tell_torchrun``)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return bool(path) and os.path.exists(path)


def exit_torchrun_rank(status: int) -> NoReturn:
    """End this torchrun rank's process with ``status`` now, flushing output but skipping
    the interpreter's finalization.

    Process groups can outlive ``destroy_process_group``: DTensor's caches keep FSDP2's
    DeviceMesh alive, and the mesh its gloo groups. A gloo worker thread of such a group
    that is still releasing a finished collective's tensors asks for the GIL; during
    finalization Python 3.11 ends such a thread from inside C++, which aborts the process
    ("terminate called without an active exception", SIGABRT) after the run succeeded.
    Under torchrun, 6 of 40 runs of ``ctxpar train`` on 2 ranks ended so. Call it once the
    rank's files are closed: atexit handlers do not run. Output that cannot be flushed (a
    closed stream, a reader gone) is dropped: the status stands.
    """
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:  # noqa: BLE001  nobody is left to read it
                pass
    finally:
        os._exit(status)
