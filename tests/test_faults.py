"""Launcher faults (issue 8, items 7-9): no hangs, no lost or orphaned work.

Each test reproduces a reported failure and finishes in bounded time:

- item 7: no wall-clock limit unless asked for one; ``timeout_s`` bounds waits at collectives.
- item 8: a rank killed mid-run, a rank gone before the rendezvous, a frozen rank: the
  parent names the rank and why, at once (or after the collective timeout for a frozen
  rank), and stops the others. Killing the parent of ``ctxpar train`` / ``demo``
  (SIGKILL, SIGTERM, Ctrl-C) kills its workers; they are checked by pid.
- item 9: RANK / WORLD_SIZE / MASTER_* / ... left in the environment neither redirect nor
  stall a local run; only a real torchrun launch joins torchrun's group.

Processes are inspected through /proc, hence Linux only.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import itertools
import json
import multiprocessing
import os
import pickle
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ctxpar
from ctxpar import launch, rank_server
from ctxpar.launch import run_local

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks processes through /proc")

PR_GET_PDEATHSIG = 2  # <linux/prctl.h>
TINY_DEMO = ("--seq", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16")


# -- what the ranks run (module level: spawned ranks import this module) ---------------------


def sleep_then_return(rank: int, world: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def time_out_on_rank_0_sleep_on_the_others(rank: int, world: int) -> int:
    if rank == 0:
        raise dist.DistStoreError("wait timed out after 1 s")  # as a store.wait of fn's own says it
    time.sleep(600)
    return rank


def parent_death_signal(rank: int, world: int) -> int:
    sig = ctypes.c_int()
    ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    return sig.value


def kill_one_rank_mid_run(rank: int, world: int, victim: int, forked: str | None = None) -> None:
    """With ``forked``, the victim first forks a child that outlives it (its pid written there)."""
    dist.barrier()
    if rank == victim:
        if forked is not None:
            child = os.fork()
            if child == 0:
                time.sleep(300)
                os._exit(0)
            Path(forked).write_text(str(child))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))


def start_state_of_rank(rank: int, world: int, seconds: float = 0.0) -> dict:
    """What a rank took at its start, after ``seconds``: the environment it started with is the one
    glibc read (/proc/self/environ: for a forked rank, its server's at the server's start)."""
    import resource

    time.sleep(seconds)
    umask = os.umask(0)
    os.umask(umask)
    started_with = dict(entry.split("=", 1) for entry in Path("/proc/self/environ").read_text().split("\0")
                        if "=" in entry)
    return dict(probe=os.environ.get("CTXPAR_TEST_PROBE"), arenas=os.environ.get("MALLOC_ARENA_MAX"),
                arenas_at_start=started_with.get("MALLOC_ARENA_MAX"),
                files=resource.getrlimit(resource.RLIMIT_NOFILE)[0], umask=umask, parent=os.getppid())


def draw_from_numpy(rank: int, world: int) -> int:
    import numpy

    return int(numpy.random.randint(2**62))


def load_with_two_workers(rank: int, world: int) -> tuple[str, list[int]]:
    from torch.utils.data import DataLoader

    sums = [int(batch.sum()) for batch in DataLoader(list(range(8)), batch_size=2, num_workers=2)]
    return multiprocessing.get_start_method(), sums


def freeze_one_rank(rank: int, world: int, frozen: int) -> None:
    dist.barrier()
    if rank == frozen:
        time.sleep(300)  # alive, never arrives at the all-reduce
    dist.all_reduce(torch.ones(4))


def stop_one_rank(rank: int, world: int, stopped: int, when: str) -> None:
    """Rank ``stopped`` writes the time to the file ``when``, then stops itself."""
    dist.barrier()
    if rank == stopped:
        Path(when).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)  # as Ctrl-Z or a debugger would: it cannot answer where it is
    dist.all_reduce(torch.ones(4))


def leave_children_behind(rank: int, world: int, pids: str, fail: bool) -> None:
    """Rank 0 forks a copy of itself that ignores SIGTERM, rank 1 spawns a shell that spawns a
    program (the rank's grandchild, whose pid is written); neither waits. Each rank also
    spawns a program from a thread that stays, waiting for it (a loader's or a server's
    thread): Linux lists that child under the thread, not the rank's main thread; and a shell
    that starts a program in the background and exits, orphaning it (a daemon's double fork:
    once re-parented to init, out of the rank's reach). Each child's pid goes to the file
    ``pids``; then, with ``fail``, rank 1 raises and rank 0 sleeps, to be stopped by the
    launcher."""
    def sleeper() -> subprocess.Popen:  # each outlives the test's wait: it ends only if the run ends it
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])

    if rank == 0:
        pid = os.fork()
        if pid == 0:  # the copy: the rank's memory and sockets, lingering
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(300)
            os._exit(0)
    else:
        sleep = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(300)'"
        shell = subprocess.Popen(["sh", "-c", f"{sleep} & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        pid = int(shell.stdout.readline())
    from_thread = []
    started = threading.Event()

    def spawn_and_wait() -> None:
        from_thread.append(sleeper())
        started.set()
        from_thread[0].wait()

    threading.Thread(target=spawn_and_wait, daemon=True).start()
    started.wait()
    orphaned = subprocess.run(["sh", "-c", f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(300)' "
                               f"> /dev/null & echo $!"], stdout=subprocess.PIPE, text=True, check=True)
    with open(pids, "a") as f:
        f.write(f"{pid}\n{from_thread[0].pid}\n{int(orphaned.stdout)}\n")
    dist.barrier()  # both written
    if fail and rank == 1:
        raise RuntimeError("rank 1 fails")
    if fail:
        time.sleep(60)


def freeze_one_rank_in_a_mesh(rank: int, world: int, frozen: int, late: int) -> None:
    """Rank ``frozen`` never arrives; healthy rank ``late`` arrives 3 s after the others.
    The collective runs on a DeviceMesh dimension group, which torch would give its own
    30-minute timeout."""
    mesh = launch.init_mesh("cpu", (1, world), ("dp", "cp"))
    dist.barrier()
    if rank == frozen:
        time.sleep(300)
    if rank == late:
        time.sleep(3)
    dist.all_reduce(torch.ones(4), group=mesh.get_group("cp"))


def exit_in_the_first_rank_to_load(marker: str) -> None:
    """Unpickled in each rank before it joins the group: the first one exits with code 3."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return None
    os._exit(3)


class ExitBeforeRendezvous:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exit_in_the_first_rank_to_load, (self.marker,)


def barrier(rank: int, world: int, _unused: None) -> None:
    dist.barrier()


class RebuiltOnlyInTheRank:
    """A result that pickles in the rank and fails to unpickle in the parent."""

    def __reduce__(self):
        return (_refuse_to_rebuild, ())


def _refuse_to_rebuild():
    raise RuntimeError("cannot be rebuilt in the parent")


def unloadable_result_on(rank: int, world: int, victim: int):
    return RebuiltOnlyInTheRank() if rank == victim else rank


def leave_early(rank: int, world: int, leaver: int, how: str) -> int:
    """Rank ``leaver`` leaves fn (``how``: "return" or "exit", sys.exit(0)) where the others go on to a collective."""
    dist.barrier()
    if rank == leaver:
        if how == "exit":
            sys.exit(0)
        return rank
    dist.all_reduce(torch.ones(4))
    return rank


def leave_a_point_to_point_exchange_early(rank: int, world: int) -> int:
    """Rank 0 sends to rank 1, which returns having received it, then waits for rank 2, which
    returned at once."""
    if rank == 0:
        dist.send(torch.ones(4), 1)
        dist.recv(torch.ones(4), 2)
    elif rank == 1:
        dist.recv(torch.ones(4), 0)
    return rank


def raise_quoting_a_collectives_traceback(rank: int, world: int) -> int:
    """Rank 0 raises, outside any collective, an error whose message quotes another process's
    traceback of a collective that lost its peer (as a job runner's error does); rank 1 has
    returned."""
    dist.barrier()
    if rank == 0:
        raise RuntimeError('the evaluation job failed:\nTraceback (most recent call last):\n  File '
                           f'"{os.path.join("torch", "distributed", "distributed_c10d.py")}", line 2800, in '
                           'all_reduce\n    work.wait()\nRuntimeError: Connection closed by peer')
    return rank


def wait_on_a_receive_rank_1_never_sends(rank: int, world: int) -> int:
    """Rank 0 waits on a posted receive (Work.wait: no Python frame in torch.distributed);
    rank 1 is elsewhere (it would sleep 60 s)."""
    dist.barrier()
    if rank == 0:
        dist.irecv(torch.zeros(1), src=1).wait()
    else:
        time.sleep(60)
    return rank


def raise_own_timeout_error(rank: int, world: int) -> int:
    """Rank 0's own error says "timed out" (a download's), outside any collective; rank 1 is still
    computing (it would sleep 60 s)."""
    dist.barrier()
    if rank == 0:
        raise TimeoutError("The read operation timed out")
    time.sleep(60)
    return rank


class StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


def raise_an_exception_whose_str_raises(rank: int, world: int) -> int:
    dist.barrier()
    if rank == 0:
        raise StrRaises()
    return rank


def change_the_arguments_and_return_a_view(rank: int, world: int, shared: torch.Tensor, big: torch.Tensor):
    """Each rank writes its own element of ``shared`` in place and returns it, with 8 elements of
    ``big``."""
    shared[rank] = 100 + rank
    dist.barrier()
    return shared.clone(), big[:8]


def _refuse_to_unpickle() -> None:
    raise RuntimeError("this object cannot be rebuilt here")


class UnpicklableOnArrival:
    def __reduce__(self):
        return _refuse_to_unpickle, ()


def raise_in_a_finished_gather(rank: int, world: int) -> int:
    """Rank 0 raises inside gather_object, unpickling rank 1's object after rank 1 has finished it."""
    dist.gather_object(UnpicklableOnArrival() if rank == 1 else 0, [None] * world if rank == 0 else None, dst=0)
    return rank


def leave_before_the_ring(rank: int, world: int) -> int:
    """Rank 1 leaves fn; rank 0 runs ring attention without the consistency check, so it waits in the
    ring's own receive (a Work.wait, with no Python frame in torch.distributed)."""
    dist.barrier()
    if rank == 0:
        q = torch.randn(1, 2, 4, 8)
        ctxpar.attention(q, q, q, layout="contiguous", check_consistency=False)
    return rank


def raise_in_a_ring_step_after_the_peer_left(rank: int, world: int) -> int:
    """Rank 0 raises its own error in a ring step, its transfer posted, where rank 1 has returned
    (once rank 0 is raising: returned earlier, on a loaded machine its leaving closed the
    connection before rank 0 posted the transfer, a failure of the transfer's, rightly the leaver's)."""
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 0:
        from ctxpar import kernels

        def refuse(*args, **kwargs):
            store.set("rank 0 raises", "1")
            raise ValueError("this rank's own error in a ring step")

        kernels.attention_forward = refuse
        q = torch.randn(1, 2, 4, 8)
        ctxpar.attention(q, q, q, layout="contiguous", check_consistency=False)
    store.wait(["rank 0 raises"])
    return rank


def freeze_one_rank_in_a_new_group(rank: int, world: int, frozen: int) -> None:
    """A group the function makes itself, which torch would give its 30-minute default timeout."""
    group = dist.new_group(list(range(world)))
    dist.barrier()
    if rank == frozen:
        time.sleep(300)
    dist.all_reduce(torch.ones(4), group=group)


def listening_addresses(rank: int, world: int) -> list[str] | None:
    """On rank 0, once every rank has joined: the addresses this rank and the parent (which
    serves the rendezvous store) listen on, from /proc."""
    dist.barrier()
    if rank != 0:
        return None
    inodes = set()
    for pid in (os.getpid(), os.getppid()):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except FileNotFoundError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, state, inode = fields[1].split(":")[0], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                found.append("127.0.0.1" if address == "0100007F" else f"{table} {address}")
    return found


# -- helpers ---------------------------------------------------------------------------------


def free_port() -> int:
    """A port for a torchrun launch's MASTER_PORT (run_local binds its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits for a reaper that may never come)."""
    return launch.process_state(pid) not in (None, "Z", "X")


def workers_of(parent: int) -> list[int]:
    """Pids of the ranks ``parent`` started: those its rank server forked (a new interpreter running
    ctxpar.rank_server, or a copy of ``parent`` made by fork: ``rank_server.start_here``), or it
    spawned (not multiprocessing's resource tracker)."""
    processes = {}  # pid -> (parent pid, command line)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            processes[int(entry.name)] = ppid, (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    own = processes.get(parent, (0, b""))[1]  # a server made by fork runs the parent's command line
    servers = {pid for pid, (ppid, cmdline) in processes.items()
               if ppid == parent and (b"ctxpar.rank_server" in cmdline or cmdline == own)}
    return sorted(pid for pid, (ppid, cmdline) in processes.items()
                  if ppid in servers or (ppid == parent and b"spawn_main" in cmdline))


def has_socket(pid: int) -> bool:
    """A rank opens its first socket to join the group, after it is tied to its parent."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except FileNotFoundError:
        return False
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(fd))
        except FileNotFoundError:
            continue
    return any(link.startswith("socket:") for link in links)


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """``condition()``'s first true value; fails when ``proc`` ends first or ``timeout`` passes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the command ended (status {proc.returncode}) before {what}:\n"
                                 f"{proc.communicate()[1]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """The command as a terminal starts it: Ctrl-C (SIGINT) at its default even when these
    tests run in the background, where the shell starts them with SIGINT ignored."""
    return subprocess.Popen([sys.executable, "-m", "ctxpar.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def assert_all_die(pids: list[int], within: float = 5.0) -> None:
    try:
        wait_for(lambda: not any(alive(p) for p in pids), within, f"workers {pids} to die")
    finally:  # never leave a worker behind, whatever the outcome
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


# -- item 7: timeouts ------------------------------------------------------------------------


def test_no_wall_clock_limit_by_default() -> None:
    """The collective timeout bounds waits at collectives, not the run: a rank computing for
    longer than it (here 2.5 s against 1 s) finishes."""
    for fn in (launch.run_local, launch.run):
        assert inspect.signature(fn).parameters["deadline_s"].default is None
    assert run_local(sleep_then_return, 1, (2.5,), timeout_s=1.0) == [0]


def test_an_optional_deadline_stops_the_run_and_says_so() -> None:
    """The deadline (it counts from the spawn) leaves the ranks three times what starting
    them has just taken, so that they are stopped in their worker code even on a loaded
    machine: a fixed 12 s was too little under heavy load, where importing torch took 16 s."""
    start = time.monotonic()
    run_local(sleep_then_return, 2, (0.0,))
    deadline = round(max(6.0, 3 * (time.monotonic() - start)))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 0 was still running at the {deadline} s deadline \(\d+ s after the "
                                           r"start\), at test_faults.py:\d+ in sleep_then_return") as e:
        run_local(sleep_then_return, 2, (300.0,), deadline_s=deadline)
    assert e.value.stuck == [0, 1]
    assert time.monotonic() - start < deadline + 30
    # a rank's timeout starts a grace period of timeout_s for its peers to time out too: the deadline still ends it
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 never arrived at a collective"):
        run_local(time_out_on_rank_0_sleep_on_the_others, 2, timeout_s=300, deadline_s=deadline)
    assert time.monotonic() - start < deadline + 30


# -- item 8: dead and frozen ranks -----------------------------------------------------------


@pytest.mark.parametrize("forks", [False, True])
def test_a_rank_killed_mid_run_is_named_at_once(forks: bool, tmp_path) -> None:
    """``forks``: the rank forked a child first, which holds what the rank held open (its end
    of the pipe whose closing told the parent it exited, its report pipe, its peers' sockets):
    the death went unseen until the child ended (62 s in a trial with a 60 s child)."""
    forked = tmp_path / "forked"
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="rank 1 died during the run: killed by SIGKILL") as e:
            run_local(kill_one_rank_mid_run, 2, (1, str(forked) if forks else None), timeout_s=120)
    finally:
        if forked.exists() and alive(int(forked.read_text())):
            os.kill(int(forked.read_text()), signal.SIGKILL)
    assert e.value.died == {1: "killed by SIGKILL"}
    assert time.monotonic() - start < 60  # not the 120 s collective timeout


def test_a_rank_that_exits_before_the_rendezvous_is_named_at_once(tmp_path) -> None:
    """One rank exits while the other waits for it to join: no silent wait for the timeout."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank \d died before joining the process group: exited with code 3") as e:
        run_local(barrier, 2, (ExitBeforeRendezvous(str(tmp_path / "marker")),), timeout_s=120)
    assert list(e.value.died.values()) == ["exited with code 3"]
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("leaver, how, left", [(1, "return", "returned from fn"),
                                               (0, "exit", r"exited fn \(SystemExit: 0\)")])
def test_a_rank_that_leaves_fn_while_the_others_are_in_a_collective_is_named(leaver, how, left) -> None:
    """Only the waiting rank was named, by gloo's "Connection closed by peer ... remote worker
    crashing", though the parent had the leaver's result."""
    start = time.monotonic()
    with pytest.raises(launch.RankFailure) as e:
        run_local(leave_early, 2, (leaver, how), timeout_s=120)
    waiter = 1 - leaver
    lines = str(e.value).splitlines()
    assert re.fullmatch(rf"rank {leaver} {left} while rank {waiter} was still in a collective: fn must make the same "
                        rf"collective calls on every rank \(.*\)", lines[0]), lines
    assert re.match(rf"rank {waiter} failed in all_reduce \(torch.distributed\), called from test_faults.py:\d+ in "
                    rf"leave_early, waiting: RuntimeError: ", lines[1]), lines
    assert len(lines) == 2 and "Traceback" not in str(e.value)
    assert time.monotonic() - start < 60  # not the 120 s collective timeout


def test_ranks_that_left_fn_are_not_each_blamed_where_one_may_have_done_its_part() -> None:
    """Of two ranks that returned while rank 0 waited, only rank 2 skipped its part (rank 1
    had received what it was sent). Each was named as leaving fn early, "while rank 0 was
    still in a collective", which the report cannot know of either."""
    with pytest.raises(launch.RankFailure) as e:
        run_local(leave_a_point_to_point_exchange_early, 3, timeout_s=120)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("ranks 1, 2 had left fn while rank 0 was still in a collective, one or more of them "
                               "early: fn must make the same collective calls on every rank"), lines
    assert lines[1:3] == ["rank 1 returned from fn", "rank 2 returned from fn"], lines
    assert re.match(r"rank 0 failed in recv \(torch.distributed\), called from test_faults.py:\d+ in "
                    r"leave_a_point_to_point_exchange_early, waiting: ", lines[3]), lines


def test_a_rank_left_waiting_in_ctxpars_own_transfers_names_the_rank_that_left() -> None:
    """A rank waiting in the ring's receive when its peer left fn got its raw traceback: only
    torch.distributed's frames counted as a collective, and the ring waits in ctxpar.comm.
    Where the peer's going is seen as the transfer is posted, the report names the ring's
    call, not comm.py's (which posts every transfer)."""
    with pytest.raises(launch.RankFailure) as e:
        run_local(leave_before_the_ring, 2, timeout_s=120)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("rank 1 returned from fn while rank 0 was still in a collective"), lines
    assert re.match(r"rank 0 failed in (wait \(ctxpar\.comm\)|batch_isend_irecv \(torch\.distributed\)), "
                    r"called from ring.py:\d+ in forward, waiting: ", lines[1]), lines


@pytest.mark.parametrize("fn, error", [
    # rank 0 failed in gather_object on its own (an object it could not unpickle, as torch's gather fails
    # without numpy), after rank 1 had returned: rank 1 was blamed for leaving fn early
    (raise_in_a_finished_gather, "RuntimeError: this object cannot be rebuilt here"),
    # the ring waits for its posted transfer on the way out of an exception; where the peer had gone, that
    # wait failed too and its error replaced the rank's own, which the report lost
    (raise_in_a_ring_step_after_the_peer_left, "ValueError: this rank's own error in a ring step"),
    # placed by the last traceback in its text, the one its message quotes: in a collective that lost its peer
    (raise_quoting_a_collectives_traceback, "RuntimeError: Connection closed by peer"),
    # str() of it raised in the report's classification: nothing was sent, and rank 0 "died"
    (raise_an_exception_whose_str_raises, "StrRaises: <exception str() failed>"),
], ids=["unpickling in a finished gather", "own error with a ring transfer posted", "quoting a traceback",
        "str raises"])
def test_a_rank_that_raises_its_own_error_is_the_cause_not_its_peer_that_returned(fn, error: str) -> None:
    """Only a collective that lost its peer (the connection closed, a timeout) is the leaver's."""
    with pytest.raises(launch.RankFailure) as e:
        run_local(fn, 2, timeout_s=120)
    message = str(e.value)
    assert message.startswith("rank 0 failed:") and "returned from fn" not in message, message
    assert message.rstrip().endswith(error), message


def test_a_backends_timeout_raised_from_cpp_names_the_rank_that_never_arrived() -> None:
    """gloo's "Timed out waiting" from a Work.wait() carries no frame in torch.distributed: read as
    the waiting rank's own failure, it blamed the rank that waited."""
    with pytest.raises(RuntimeError, match=r"rank 1 never arrived at a collective: ranks \[0\] timed out after 5 s"):
        run_local(wait_on_a_receive_rank_1_never_sends, 2, timeout_s=5)


def test_fns_own_timeout_error_is_that_ranks_failure_not_a_collectives() -> None:
    """Read as a collective's timeout by its text, it blamed the healthy rank ("rank 1 never arrived
    at a collective") and the run waited a timeout more."""
    start = time.monotonic()
    with pytest.raises(launch.RankFailure) as e:
        run_local(raise_own_timeout_error, 2, timeout_s=5)
    message = str(e.value)
    assert "never arrived" not in message and "timed out after" not in message, message
    assert "rank 0 failed:" in message and message.rstrip().endswith("TimeoutError: The read operation timed out")
    # fn's own frames in its traceback (one limited to its first frame showed only launch.py's _worker)
    assert re.search(r'test_faults\.py", line \d+, in raise_own_timeout_error\n', message), message
    assert time.monotonic() - start < 30


def test_a_frozen_rank_is_named_when_the_others_time_out() -> None:
    start = time.monotonic()
    # 5 s, not less: the rendezvous has the same timeout, and ranks finish importing torch
    # seconds apart on a loaded machine
    with pytest.raises(RuntimeError, match=r"rank 1 never arrived at a collective: ranks \[0\] timed out after 5 s"
                       ) as e:
        run_local(freeze_one_rank, 2, (1,), timeout_s=5)
    assert e.value.stuck == [1]
    assert time.monotonic() - start < 60  # the frozen rank sleeps 300 s: it was stopped
    back = pickle.loads(pickle.dumps(e.value))  # as a pool's worker running the run sends it back
    assert [type(back), str(back), back.failed, back.died, back.stuck] == [
        launch.RankFailure, str(e.value), e.value.failed, e.value.died, [1]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process state from /proc")
def test_what_a_rank_forks_or_spawns_ends_with_the_run(tmp_path) -> None:
    """A forked copy of a rank or a program it spawned outlived the run, re-parented, the copy
    holding the rank's memory and sockets: ended when the rank ends, or is stopped (SIGKILL
    after the grace period for the copy that ignores SIGTERM)."""
    for fail in (False, True):
        pids = tmp_path / f"pids-{fail}"
        if fail:  # rank 0, holding the copy, is stopped once rank 1 has failed
            with pytest.raises(launch.RankFailure, match="rank 1 fails") as e:
                run_local(leave_children_behind, 2, (str(pids), fail), timeout_s=60)
            assert e.value.stuck == [0]
        else:
            run_local(leave_children_behind, 2, (str(pids), fail), timeout_s=60)
        children = [int(pid) for pid in pids.read_text().split()]
        try:
            assert len(children) == 6
            # a rank ends its own as it exits, a SIGTERM-ignoring copy GRACE_S later: 10 s passed under load 8 on
            # 2 cores; each sleeps 300 s, so one the run did not end is still there
            wait_for(lambda: not any(alive(pid) for pid in children), 60, f"children {children} to end")
        finally:  # none left behind by a failing run
            for pid in children:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process state from /proc")
def test_a_rank_stopped_by_a_signal_is_named_as_such(tmp_path) -> None:
    """A SIGSTOPped rank cannot answer the request for its stack: it was "still running", where
    unknown (a debugger, a cgroup freezer: what to look for). Nor can it time out: the run ends
    at the others' timeout, without the grace of a timeout more for peers to time out too."""
    when = tmp_path / "stopped_at"
    with pytest.raises(RuntimeError, match=r"rank 1 never arrived at a collective: ranks \[0\] timed out after 5 s "
                                           r"waiting; it was frozen by a signal \(SIGSTOP or a debugger") as e:
        run_local(stop_one_rank, 2, (1, str(when)), timeout_s=5)
    assert e.value.stuck == [1]
    # rank 0's 5 s, the 2 s grace and the stack probe's 0.5 s; with the grace of a timeout more: 12.5 s
    assert time.time() - float(when.read_text()) < 5 + launch.GRACE_S + launch.PROBE_S + 2.5


def test_an_exit_status_reads_as_an_exit_or_a_signal() -> None:
    """A rank's exit status in a failure report: 0 is an exit like any other, a negative one
    the signal (``multiprocessing``'s convention), by name where Python knows it."""
    assert rank_server.exit_reason(0) == "exited with code 0"
    assert rank_server.exit_reason(3) == "exited with code 3"
    assert rank_server.exit_reason(None) == "exited with code None"
    assert rank_server.exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert rank_server.exit_reason(-200) == "killed by signal 200"


def test_a_local_rank_sees_no_launcher_variable(monkeypatch) -> None:
    """Every variable a launcher sets is dropped before a local rank joins, not only torchrun's
    own (a leftover TORCHELASTIC_USE_AGENT_STORE makes rank 0 a store client); gloo is bound to
    the loopback interface."""
    for name in launch.LAUNCHER_VARS:
        monkeypatch.setenv(name, "3")
    launch._isolate_from_launcher_env()
    left = {name: os.environ[name] for name in launch.LAUNCHER_VARS if name in os.environ}
    assert left == ({"GLOO_SOCKET_IFNAME": launch._loopback_interface()} if launch._loopback_interface() else {})


def test_a_leftover_torchrun_error_file_is_left_alone_outside_torchrun(monkeypatch, tmp_path) -> None:
    """``TORCHELASTIC_ERROR_FILE`` alone, left in the shell by another job, is no torchrun
    launch: a local run's failure is not written over that job's file."""
    path = tmp_path / "error.json"
    for name in launch.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    launch.tell_torchrun("a local failure")
    assert not path.exists() and not launch.told_torchrun()


def test_local_ranks_get_a_gpu_each_with_nccl_where_there_are_enough(monkeypatch) -> None:
    """As many ranks as GPUs (or fewer): NCCL, a GPU each. More: gloo, sharing them round-robin."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = [torch.device("cuda", r) for r in (0, 1, 0)]
    assert launch.local_placement(1, "cuda") == ("nccl", cuda[:1])
    assert launch.local_placement(2, "cuda") == ("nccl", cuda[:2])
    assert launch.local_placement(3, "cuda") == ("gloo", cuda)
    assert launch.local_placement(3, "cpu") == ("gloo", [torch.device("cpu")] * 3)


def stop_myself() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def test_a_stopped_rank_takes_its_sigterm() -> None:
    """A rank frozen by SIGSTOP keeps a SIGTERM pending: it waited the grace period for the SIGKILL."""
    process = multiprocessing.get_context("spawn").Process(target=stop_myself)
    process.start()
    wait_for(lambda: launch.process_state(process.pid) == "T", 60, "the process to stop itself")
    launch._stop([process])
    assert process.exitcode == -signal.SIGTERM


def ignore_sigterm_and_sleep(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(600)


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period() -> None:
    """Without the SIGKILL after GRACE_S, stopping a rank that ignores SIGTERM hung the run
    (a planted mutation passed every test)."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=ignore_sigterm_and_sleep, args=(ready,))
    process.start()
    try:
        assert ready.wait(60), "the process never started"
        start = time.monotonic()
        stopping = threading.Thread(target=launch._stop, args=([process],), daemon=True)
        stopping.start()
        stopping.join(launch.GRACE_S + 10)
        hung, exitcode, took = stopping.is_alive(), process.exitcode, time.monotonic() - start
    finally:
        if process.is_alive():  # not left behind by a failing test
            process.kill()
    assert not hung, "stopping a rank that ignores SIGTERM hangs"
    assert exitcode == -signal.SIGKILL and took >= launch.GRACE_S


def test_a_frozen_rank_is_named_at_the_timeout_in_a_group_the_function_made() -> None:
    """dist.new_group in the ranks' function: it waited torch's 30 minutes, naming no one."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 never arrived at a collective: ranks \[0\] timed out after 5 s"):
        run_local(freeze_one_rank_in_a_new_group, 2, (1,), timeout_s=5, deadline_s=120)
    assert time.monotonic() - start < 60


def test_a_local_run_listens_on_127_0_0_1_alone() -> None:
    """The rendezvous store once listened on every address of the machine (rank 0's store,
    made from tcp://127.0.0.1:PORT, bound the wildcard address); the parent serves it now."""
    found = run_local(listening_addresses, 2)[0]
    assert found and set(found) == {"127.0.0.1"}, found


def test_a_rank_stuck_in_a_library_is_placed_in_the_code_that_called_it() -> None:
    """A rank stuck in a runaway regular expression read "at __init__.py:166 in match"."""
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [(os.path.join(stdlib, "re", "__init__.py"), "166", "match"), ("/home/me/train.py", "42", "step"),
              ("/home/me/train.py", "90", "main")]  # innermost first, as faulthandler dumps them
    assert launch._whereabouts(frames).where == "at re/__init__.py:166 in match, called from train.py:42 in step"
    assert launch._whereabouts(frames[1:]).where == "at train.py:42 in step"


def test_a_transfer_ctxpar_posts_is_placed_in_the_code_that_asked_for_it() -> None:
    """A ring step's receive that failed as it was posted read "called from comm.py:91 in
    start", the one place every transfer is posted from."""
    frames = [(os.path.join("torch", "distributed", "distributed_c10d.py"), "2800", "batch_isend_irecv"),
              (os.path.join("src", "ctxpar", "comm.py"), "91", "start"),
              (os.path.join("src", "ctxpar", "strategies", "ring.py"), "120", "forward"),
              ("/home/me/train.py", "42", "step")]  # innermost first
    posted = "in batch_isend_irecv (torch.distributed), called from"
    assert launch._whereabouts(frames).where == f"{posted} ring.py:120 in forward"
    assert launch._whereabouts([frames[0], frames[3]]).where == f"{posted} train.py:42 in step"


def test_each_rank_gets_its_own_copy_of_a_tensor_argument_and_a_view_comes_back_alone() -> None:
    """Tensor arguments were moved to shared memory: one rank's in-place op reached every rank
    and the caller. A view result carried its whole storage (8 floats of 512 MiB: 512 MiB)."""
    shared, big = torch.zeros(2), torch.arange(2.0**16)
    results = run_local(change_the_arguments_and_return_a_view, 2, (shared, big), timeout_s=60)
    assert [r[0].tolist() for r in results] == [[100.0, 0.0], [0.0, 101.0]]
    assert shared.tolist() == [0.0, 0.0] and not shared.is_shared()
    for _, view in results:
        assert view.tolist() == list(range(8)) and view.untyped_storage().nbytes() == 8 * 4
    square = torch.arange(16.0).reshape(4, 4)
    for view in (square[:, :2], square.T, square[1:, ::2]):  # as the parent unpickles a rank's result
        back = pickle.loads(launch._result_bytes(("ok", view)))[1]
        assert back.shape == view.shape and torch.equal(back, view)
        assert back.untyped_storage().nbytes() == view.numel() * 4


def test_a_rank_can_start_processes_of_its_own() -> None:
    """A DataLoader's workers: the ranks were daemonic processes, which multiprocessing forbids
    to start any (its bare assertion from the DataLoader's first iteration). They start by the
    platform's default method, as under torchrun (spawned, as the ranks were, each took seconds
    importing torch, and a lambda in the loader could not be pickled for them)."""
    default = multiprocessing.get_all_start_methods()[0]  # a fresh interpreter's
    assert run_local(load_with_two_workers, 2, timeout_s=60) == [(default, [1, 5, 9, 13])] * 2


def test_a_result_the_parent_cannot_unpickle_is_that_ranks_failure() -> None:
    """It escaped run_local as the unpickler's own exception, naming no rank."""
    with pytest.raises(launch.RankFailure, match="rank 1 failed:\nits result could not be unpickled in the parent"):
        run_local(unloadable_result_on, 2, (1,), timeout_s=60)


def test_run_local_refuses_what_its_ranks_could_not_start_with(monkeypatch) -> None:
    """In the parent, before any rank starts. Some once reached every rank, which died before
    it could report why ("it reported no result"; the cause on stderr only, which a notebook
    does not show); a run_local inside a rank failed on multiprocessing's bare assertion that
    daemonic processes have no children; a lambda, or an argument that does not pickle, on
    pickle's error naming neither."""

    def nested(rank: int, world: int) -> None:
        pass

    queue = multiprocessing.get_context("spawn").Queue()  # ranks can take one: pickled as they start
    for bad, says in [
        (dict(threads=0), "threads 0 must be a positive int"),
        (dict(threads=True), "threads True must be a positive int"),  # not 1 thread
        (dict(threads=10**6), r"threads 1000000 must be a positive int \(torch threads per rank\) of at most \d+"),
        (dict(nproc=2.5), "nproc 2.5 must be an int: the number of local ranks"),
        (dict(nproc="2"), "nproc '2' must be an int"),
        (dict(nproc=None), "nproc None must be an int"),
        (dict(nproc=True), "nproc True must be an int"),
        (dict(timeout_s=True), "timeout_s True must be a number of seconds"),
        (dict(deadline_s="5"), "deadline_s '5' must be a positive number of seconds"),
        (dict(deadline_s=True), "deadline_s True must be a positive number of seconds"),
        (dict(fn=42), "fn 42 is not callable"),
        (dict(fn=lambda rank, world: rank), r"fn '.*<lambda>' cannot be pickled for the ranks \(Can't pickle local "
                                            r"object .*\): pass a function defined at the top level of a module"),
        (dict(fn=nested), r"fn '.*<locals>.nested' cannot be pickled for the ranks"),
        (dict(args=5), r"args must be a tuple \(or list\) of fn's arguments .* not 'int'; for one argument x, "
                       r"args=\(x,\)"),
        # a queue pickles as a rank starts, and is not the one named
        (dict(args=[queue, threading.Lock()]), r"args\[1\], a lock, cannot be pickled for the ranks \(cannot pickle "
                                               r"'_thread.lock' object\)"),
        (dict(args=[threading.Lock(), 5, threading.RLock()]), r"args\[0\], a lock, cannot be pickled"),  # the first
    ]:
        with pytest.raises(ValueError, match=says):
            run_local(**dict(dict(fn=sleep_then_return, nproc=2, args=(0,)), **bad))
    with pytest.raises(ValueError, match="nproc 2.5 must be an int"):  # before run says what it spawns
        launch.run(sleep_then_return, 2.5, (0,))

    with monkeypatch.context() as inside_a_rank:
        inside_a_rank.setattr(launch, "_in_local_rank", True)  # as _worker sets it
        with pytest.raises(ValueError, match="a rank of another run_local: ranks cannot spawn ranks; start one"):
            run_local(sleep_then_return, 1, (0,))
    with monkeypatch.context() as in_a_pool:
        in_a_pool.setitem(multiprocessing.current_process()._config, "daemon", True)  # as a pool's worker is
        with pytest.raises(ValueError, match="a daemonic process .*, which cannot start processes: call run_local"):
            run_local(sleep_then_return, 1, (0,))

    def defined_in_a_notebook(rank: int, world: int) -> None:
        pass

    defined_in_a_notebook.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", type(sys)("__main__"))  # a __main__ without a file
    for fn in (defined_in_a_notebook, functools.partial(defined_in_a_notebook)):
        with pytest.raises(ValueError, match="defined in an interactive session .* cannot import"):
            run_local(fn, 2)


SCRIPT_WITH_A_MAIN_GUARD = """
def above(rank, world):
    return rank
if "__main__" == __name__:
    import functools

    @functools.lru_cache
    def inside(rank, world):
        return rank
else:
    def in_the_else(rank, world):
        return rank
if __name__ == "__main__":
    def in_a_second_guard(rank, world):
        return rank
if __name__ == "__main__":
    @functools.lru_cache
    def decorated_first(rank, world):
        return rank
"""


def test_a_fn_defined_inside_the_scripts_main_guard_is_refused_naming_where_to_move_it(tmp_path, monkeypatch) -> None:
    """The ranks import the script without running its guarded block: each rank died
    unpickling fn, and the report guessed the opposite ("without an if __name__ ==
    '__main__': guard")."""
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT_WITH_A_MAIN_GUARD)
    main = type(sys)("__main__")
    main.__file__ = str(script)
    exec(compile(SCRIPT_WITH_A_MAIN_GUARD, str(script), "exec"), main.__dict__)  # as `python train_script.py` runs it
    main.in_the_else = main.above  # the else branch ran on import instead; its own def is checked below
    monkeypatch.setitem(sys.modules, "__main__", main)
    # a decorated def opening its guard: its code starts at the decorator, a line before the guard's first statement
    for fn in (main.inside.__wrapped__, main.inside, main.in_a_second_guard, functools.partial(main.in_a_second_guard),
               main.decorated_first):
        with pytest.raises(ValueError, match=r"run_local's fn '(inside|in_a_second_guard|decorated_first)' is defined "
                                             r"inside the script's if __name__ == '__main__': block, .* move its "
                                             r"definition"):
            run_local(fn, 2)
    launch._check_importable(main.above)  # defined where an import runs: no refusal
    in_the_else = compile(SCRIPT_WITH_A_MAIN_GUARD, str(script), "exec").co_consts
    else_code = next(c for c in in_the_else if getattr(c, "co_name", "") == "in_the_else")
    assert not launch._defined_under_main_guard(type(main.above)(else_code, main.__dict__))


def test_a_frozen_rank_is_named_even_when_a_healthy_peer_times_out_later() -> None:
    """Four ranks on a mesh group: the --timeout reaches the mesh's groups, and a healthy
    rank that timed out seconds after the others is not mistaken for the frozen one."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 2 never arrived at a collective: ranks \[[0-9, ]+\] timed out "
                                           r"after 5 s waiting; it was at test_faults.py:\d+ in "
                                           r"freeze_one_rank_in_a_mesh") as e:
        run_local(freeze_one_rank_in_a_mesh, 4, (2, 0), timeout_s=5, deadline_s=90)
    message = str(e.value)
    assert all(f"rank {r} never arrived" not in message for r in (0, 1, 3)), message
    assert 2 in e.value.stuck
    assert time.monotonic() - start < 60


def test_a_stop_made_on_purpose_reads_as_its_message_and_a_crash_keeps_its_traceback() -> None:
    """Ranks that raise ``launch.StopRun`` (train's non-finite loss: end to end in
    test_checkpoints.py) are named with its message, once for the ranks that share it; a
    crash is still shown with its traceback."""
    crash = 'Traceback (most recent call last):\n  File "m.py", line 1, in f\nZeroDivisionError: division by zero\n'
    stop = "step 2: the loss is nan; start a new run with a lower --lr"
    failed = {2: ("error", crash), 1: ("stopped", stop), 0: ("stopped", stop), 3: ("error", crash)}
    message = launch._failure_message(failed, {}, [], {0, 1, 2, 3}, {}, 5.0, None, 1.0)
    assert message.splitlines() == [
        "rank 2 failed:", *crash.rstrip().splitlines(), f"ranks 0, 1 stopped: {stop}",
        "rank 3 failed too: ZeroDivisionError: division by zero"]
    alone = launch._failure_message({1: ("stopped", stop)}, {}, [], {0, 1}, {}, 5.0, None, 1.0)
    assert alone == f"rank 1 stopped: {stop}"


def test_a_rank_killed_by_sigkill_or_sigabrt_is_said_what_most_often_sends_it() -> None:
    """A gloo collective whose ranks' sizes differ aborts the rank that receives ("terminate called
    after throwing an instance of 'gloo::EnforceNotMet'" on its stderr): the report said only "killed
    by SIGABRT"."""
    said = launch._failure_message({}, {0: "killed by SIGABRT", 1: "killed by SIGKILL", 2: "exited with code 3"}, [],
                                   {0, 1, 2}, {}, 5.0, None, 1.0).splitlines()
    assert said[0].startswith("rank 0 died during the run: killed by SIGABRT (an abort, most often torch.distributed"
                              "'s backend's: gloo's where the ranks' collectives differ in size or kind")
    assert said[1] == ("rank 1 died during the run: killed by SIGKILL (kill -9, or the kernel's out-of-memory "
                       "killer); it reported no result")
    assert said[2] == "rank 2 died during the run: exited with code 3; it reported no result"


def test_workers_are_tied_to_the_parent() -> None:
    assert run_local(parent_death_signal, 2) == [signal.SIGKILL, signal.SIGKILL]


def test_the_portable_watchdog_ends_a_worker_whose_parent_died(tmp_path) -> None:
    """The fallback where prctl is missing: a process watching its parent exits once re-parented."""
    marker = tmp_path / "watching"
    child = ("import os, sys; from ctxpar.launch import _watch_parent; ppid = os.getppid(); "
             "open(sys.argv[1], 'w').close(); _watch_parent(ppid, 0.05)")
    middle = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}, {str(marker)!r}]); print(p.pid, flush=True); "
              "time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        wait_for(lambda: marker.exists() or not alive(grandchild), 60, "the watcher to start")
        assert marker.exists(), "the watcher ended before its parent did"
        proc.kill()
        proc.wait()
        assert_all_die([grandchild])
    finally:
        proc.kill()
        proc.wait()


def test_killing_the_parent_of_train_kills_its_workers(tmp_path) -> None:
    """Mid-run (checkpoints being written), the parent is SIGKILLed, so no code of its runs:
    its workers die anyway, and no checkpoint is written after."""
    ckpt = tmp_path / "ckpt"
    proc = start_cli("train", "--nproc", "2", "--seq", "64", "--steps", "100000", "--checkpoint-dir", str(ckpt),
                     "--save-every", "1", "--no-progress")
    try:
        workers = wait_for(lambda: len(workers_of(proc.pid)) == 2 and workers_of(proc.pid), 60, "2 workers", proc)
        # a step's directory: the run's lock files are there from its start
        wait_for(lambda: ckpt.is_dir() and any(p.name.startswith("step-") for p in ckpt.iterdir()), 60,
                 "a first checkpoint", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert_all_die(workers)
        written = sorted(ckpt.iterdir())
        time.sleep(1.0)
        assert sorted(ckpt.iterdir()) == written
    finally:
        proc.kill()
        proc.communicate()


def test_sigterm_to_the_parent_of_demo_kills_its_workers(tmp_path) -> None:
    """Once the ranks are joining the group, the parent gets SIGTERM. (A rank still importing
    torch when its parent dies exits as soon as it has started, before it joins.) Nothing is
    left in the temporary directory: the ranks' stacks once went through files in a
    ctxpar-stacks-* directory there, which only run_local's `finally` removed, and SIGTERM's
    default action skips it."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    proc = start_cli("demo", "--nproc", "2", "--seq", "16384", env=dict(os.environ, TMPDIR=str(temporary)))
    try:
        workers = wait_for(lambda: len(workers_of(proc.pid)) == 2 and workers_of(proc.pid), 60, "2 workers", proc)
        wait_for(lambda: all(has_socket(w) for w in workers), 60, "the workers to join", proc)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        assert_all_die(workers)
        assert list(temporary.iterdir()) == []
    finally:
        proc.kill()
        proc.communicate()


def test_ctrl_c_on_demo_stops_the_workers_with_one_message() -> None:
    proc = start_cli("demo", "--nproc", "2", "--seq", "16384")
    try:
        workers = wait_for(lambda: len(workers_of(proc.pid)) == 2 and workers_of(proc.pid), 60, "2 workers", proc)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)  # a cold CI machine once took over 20 s here
        assert proc.returncode == 130, err
        assert "ctxpar demo: interrupted; the ranks were stopped" in err and "Traceback" not in err
        assert_all_die(workers, within=1.0)
    finally:
        proc.kill()


@pytest.mark.parametrize("caller_sigint", ["Python's handler", "ignored"])
def test_ctrl_c_while_run_local_starts_its_ranks_stops_the_run_once_they_are_started(caller_sigint: str,
                                                                                     monkeypatch) -> None:
    """Ignored while the ranks started, a Ctrl-C taken by another thread of the parent (the
    store's) was lost: the run went on to its end (and the demo's Ctrl-C test hung 60 s
    under load, its interrupt landing in that window). A caller that ignores SIGINT (nohup,
    a shell's background job) goes on ignoring it: the run is not interrupted."""
    import multiprocessing.process

    started, start = [], multiprocessing.process.BaseProcess.start

    def start_then_ctrl_c(process) -> None:
        start(process)
        started.append(process.pid)
        if len(started) == 1:  # halfway through the starts
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # delivered now, to whichever thread takes it

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_then_ctrl_c)
    # set either way: a suite run in the background starts with SIGINT ignored (the first case failed there, its run
    # going on to its end), in a terminal with Python's handler
    ignored = caller_sigint == "ignored"
    caller = signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    began = time.monotonic()
    try:
        if ignored:
            try:
                assert run_local(sleep_then_return, 2, (1,)) == [0, 1]
            except KeyboardInterrupt:  # failed here, not raised on to end the whole session
                pytest.fail("a Ctrl-C the caller ignores interrupted the run")
        else:
            with pytest.raises(KeyboardInterrupt):
                run_local(sleep_then_return, 2, (30,))
    finally:
        signal.signal(signal.SIGINT, caller)
    assert len(started) == 2 and time.monotonic() - began < 20  # every rank started, then stopped
    assert_all_die(started, within=5.0)


RANKS_REPORT_THEIR_SIGNAL_MASK = """
import sys
if __name__ != "__main__":  # a rank importing the script, before run_local's worker runs
    status = open("/proc/self/status").read().split("SigBlk:")[1].split()[0]
    print("rank starts with SIGINT blocked:", bool(int(status, 16) >> 1 & 1), flush=True)
from ctxpar.launch import run_local


def fn(rank, world):
    return rank


if __name__ == "__main__":
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    print(run_local(fn, 2))
    print("the caller's mask after:", sorted(signal.pthread_sigmask(signal.SIG_BLOCK, ())))
"""


def test_ranks_start_with_sigint_blocked_in_a_fresh_process(tmp_path) -> None:
    """The first start of a process also starts multiprocessing's resource tracker, which
    unblocks SIGINT in the starting thread: the ranks of every first run_local (each
    ctxpar demo and train) started with it unblocked, and a Ctrl-C while they imported torch
    printed their KeyboardInterrupt tracebacks (2 runs in 10 at 2-3 s). The caller's own mask
    is put back (read after the tracker's start, it was left with SIGINT and SIGTERM unblocked)."""
    script = tmp_path / "masks.py"
    script.write_text(RANKS_REPORT_THEIR_SIGNAL_MASK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("rank starts with SIGINT blocked: True") == 2, proc.stdout
    assert "[0, 1]" in proc.stdout
    assert "the caller's mask after: [<Signals.SIGINT: 2>, <Signals.SIGTERM: 15>]" in proc.stdout, proc.stdout


def test_ctrl_c_to_the_whole_group_while_the_ranks_start_gives_one_message() -> None:
    """A terminal's Ctrl-C reaches every process of its group: ranks still importing torch
    printed their KeyboardInterrupt tracebacks before the parent's message."""
    proc = start_cli("demo", "--nproc", "2", "--seq", "16384")
    try:
        wait_for(lambda: len(workers_of(proc.pid)) == 2, 60, "2 workers", proc)
        # the terminal's SIGINT to its group, as it reaches the run; the workers first: the parent, given it first,
        # could stop one before it was sent its own (ProcessLookupError, 1 run of test_faults in 2 here)
        for pid in [*workers_of(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    finally:
        proc.kill()


# -- ranks forked from a rank server (ctxpar.rank_server) -------------------------------------


RANKS_PRINT_WHERE_THE_CALLERS_OUTPUT_GOES_NOW = """
import os, sys


def say(stream, line):  # one write per line: print writes the newline apart, unbuffered (PYTHONUNBUFFERED)
    stream.write(line + "\\n")
    stream.flush()


if __name__ != "__main__":  # a rank importing the script, before run_local's worker runs
    say(sys.stdout, "a rank imports the script")
    say(sys.stderr, "a rank imports the script, on stderr")
from ctxpar.launch import run_local


def fn(rank, world):
    say(sys.stdout, f"rank {rank} says")
    say(sys.stderr, f"rank {rank} warns")
    return os.getppid()


if __name__ == "__main__":
    run_local(fn, 2)  # the server starts, its output where the caller's is now
    saved = os.dup(1), os.dup(2)
    with open(sys.argv[1], "w") as out, open(sys.argv[2], "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        parents = run_local(fn, 2)
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    print("forked:", all(parent != os.getpid() for parent in parents))
"""


def test_a_forked_ranks_output_goes_where_the_callers_goes_when_it_starts(tmp_path) -> None:
    """A server forks each rank with the standard output and error it was started with: a caller
    that redirected its own since (a test's capture, a log file) lost its ranks' output to the old
    place. The caller's present ones are put in place before the rank imports the caller's script."""
    script, out, err = tmp_path / "script.py", tmp_path / "out", tmp_path / "err"
    script.write_text(RANKS_PRINT_WHERE_THE_CALLERS_OUTPUT_GOES_NOW)
    done = subprocess.run([sys.executable, str(script), str(out), str(err)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("a rank imports the script\n") == 2 and "forked: True" in done.stdout, done.stdout
    assert sorted(out.read_text().splitlines()) == ["a rank imports the script"] * 2 + ["rank 0 says", "rank 1 says"]
    assert sorted(err.read_text().splitlines()) == (["a rank imports the script, on stderr"] * 2
                                                    + ["rank 0 warns", "rank 1 warns"])


CHANGES = ["a variable read at start", "another variable", "a resource limit", "the umask"]


@pytest.mark.parametrize("changed", CHANGES)
def test_forked_ranks_take_the_callers_present_environment_limits_and_umask(changed: str, monkeypatch) -> None:
    """What a process takes at its start comes from the server's start: a server started under
    other environment variables read at start (glibc reads MALLOC_* only as a process starts),
    resource limits or umask is replaced, so that a rank has the caller's as a spawned one does;
    the rest of the environment each rank takes as it starts, from the same server."""
    import resource

    before = run_local(start_state_of_rank, 2)[0]
    assert before["parent"] != os.getpid()  # forked by a server
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    umask = before["umask"]
    expected = {**before}
    if changed == "a variable read at start":
        monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
        expected.update(arenas="2", arenas_at_start="2")
    elif changed == "another variable":
        monkeypatch.setenv("CTXPAR_TEST_PROBE", "changed")
        expected.update(probe="changed")
    elif changed == "a resource limit":
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits[0] - 1, limits[1]))
        expected.update(files=limits[0] - 1)
    else:
        os.umask(umask ^ 0o070)
        expected.update(umask=umask ^ 0o070)
    try:
        after = run_local(start_state_of_rank, 2)
    finally:
        monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
        monkeypatch.delenv("CTXPAR_TEST_PROBE", raising=False)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        os.umask(umask)
    if changed == "another variable":  # the same server
        assert after == [expected] * 2
    else:  # a server started anew
        assert [{**state, "parent": None} for state in after] == [{**expected, "parent": None}] * 2
        assert after[0]["parent"] not in (before["parent"], os.getpid())
    again = run_local(start_state_of_rank, 2)
    assert [{**state, "parent": None} for state in again] == [{**before, "parent": None}] * 2


def test_a_run_beside_one_on_a_server_of_another_state_spawns(monkeypatch) -> None:
    """A server still running another run's ranks is not replaced (its ranks would die with it):
    a run that needs another state spawns its ranks meanwhile."""
    beside: list = []
    thread = threading.Thread(target=lambda: beside.extend(run_local(start_state_of_rank, 1, (3.0,))))
    thread.start()
    try:
        wait_for(lambda: launch.rank_server._server is not None and launch.rank_server._server.runs, 60,
                 "the run beside to start")
        monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
        spawned = run_local(start_state_of_rank, 1)[0]
        assert spawned["arenas_at_start"] == "2" and spawned["parent"] == os.getpid()
    finally:
        thread.join()
    assert beside[0]["arenas_at_start"] is None and beside[0]["parent"] != os.getpid()
    assert run_local(start_state_of_rank, 1)[0]["parent"] not in (beside[0]["parent"], os.getpid())  # once free


def test_the_off_switch_spawns_every_rank(monkeypatch) -> None:
    monkeypatch.setenv("CTXPAR_RANK_SERVER", "0")
    assert [state["parent"] for state in run_local(start_state_of_rank, 2)] == [os.getpid()] * 2  # the caller's


def test_forked_ranks_draw_their_own_numpy_numbers() -> None:
    """Forked, every rank started from the server's numpy random state and drew the same numbers
    (a spawned rank seeds its own)."""
    first, second = run_local(draw_from_numpy, 2), run_local(draw_from_numpy, 2)
    assert len({*first, *second}) == 4


def test_a_server_that_died_is_started_again_and_its_folder_removed() -> None:
    server = run_local(start_state_of_rank, 1)[0]["parent"]
    folder = Path(launch.rank_server._server.folder)
    assert (folder / "server").is_socket() and folder.stat().st_mode & 0o077 == 0  # this user's alone
    os.kill(server, signal.SIGKILL)
    wait_for(lambda: not alive(server), 10, "the server to die")
    assert run_local(start_state_of_rank, 1)[0]["parent"] not in (server, os.getpid())
    assert not folder.exists()


def test_a_server_ended_as_it_starts_removes_its_folder() -> None:
    """A SIGTERM as a server's interpreter started (a launcher ending a rank that had started a
    server of its own: a script calling ctxpar without a main guard, re-run by each rank) killed
    it by the default action, leaving its folder in the temporary directory at each such run.
    The starter holds the signal until the server's handler is in place, then the server takes
    the starter's mask."""
    def masked(pid: int, field: str) -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(re.search(rf"^{field}:\s*([0-9a-f]+)$", status, re.M).group(1), 16)

    term = 1 << signal.SIGTERM - 1
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    state = rank_server._start_state()
    for fork, delay in itertools.product((None, ()), (0.0, 0.01, None)):  # a new interpreter, a copy of this one
        server = rank_server._start(state, fork=fork)
        try:
            if delay is None:  # left to start: it handles the signal, no longer holding it
                wait_for(lambda: masked(server.pid, "SigCgt") & term and not masked(server.pid, "SigBlk") & term, 30,
                         "the server to handle SIGTERM, unblocked")
            else:
                time.sleep(delay)
            os.kill(server.pid, signal.SIGTERM)
            _, status = os.waitpid(server.pid, 0)
        finally:
            os.close(server.forkserver._forkserver_alive_fd)
        server.exitcode = os.waitstatus_to_exitcode(status)
        assert server.exitcode == 128 + signal.SIGTERM, (fork, delay, status)
        # its handler's exit: once "exited with code 143; its error is on stderr"
        assert rank_server.how_it_ended(server) == "ended by SIGTERM, by another process"
        assert not os.path.exists(server.folder), (fork, delay)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == mask  # the starter's own, as it was


def test_a_run_starts_its_ranks_on_the_server_it_was_given() -> None:
    """The server its acquire gave it, not whichever the module holds as a rank starts: another
    thread's acquire may have replaced it meanwhile (finding it killed, or under other state)."""
    server_module = launch.rank_server
    make, given = server_module.acquire()
    with server_module._lock:
        server_module._server = None  # as another thread's acquire does with a server it found killed
    _, other = server_module.acquire()
    rank = make(target=time.sleep, args=(60,), daemon=True)
    try:
        rank.start()
        parent = int(Path(f"/proc/{rank.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert (parent, other.pid != given.pid) == (given.pid, True)
    finally:
        if rank.pid is not None:
            rank.kill()
            rank.join()
        server_module.release(other)
        server_module.release(given)
        os.close(given.forkserver._forkserver_alive_fd)  # the server the module no longer holds ends
        os.waitpid(given.pid, 0)


def test_a_run_whose_server_is_killed_names_it() -> None:
    """A rank's status comes from the server that forked it, which reaps it: a server killed mid-run
    takes its ranks with it (PDEATHSIG) and cannot say how they ended (the stdlib read that as an
    exit with status 255)."""
    def kill_the_server() -> None:
        wait_for(lambda: len(workers_of(os.getpid())) == 2, 60, "the ranks to start")
        os.kill(launch.rank_server._server.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_server)
    killer.start()
    try:
        with pytest.raises(RuntimeError, match=r"rank \d died (during the run|before joining the process group): "
                                               r"killed by SIGKILL when its rank server \(ctxpar.rank_server\) "
                                               r"ended \(killed by SIGKILL, by another process\): the kernel") as e:
            run_local(sleep_then_return, 2, (300,), deadline_s=60)
    finally:
        killer.join()
    assert "its error is on stderr" not in str(e.value)  # the hint for a rank dying as it starts
    assert run_local(sleep_then_return, 2, (0,)) == [0, 1]  # on a new server


A_CALLER_WHOSE_SERVER_FAILS = """
import sys
sys.path.insert(0, sys.argv[1])  # its sympy.py fails: the server imports sympy before it forks
from ctxpar.launch import run_local


def fn(rank, world):
    return rank


if __name__ == "__main__":
    try:
        run_local(fn, 1)
    except RuntimeError as e:
        print(e)
"""


@pytest.mark.parametrize("failure, said", [
    ("import os; os.abort()", "killed by SIGABRT; its error is on stderr"),
    ("import sys; sys.exit(3)", "exited with code 3; its error is on stderr"),
])
def test_a_server_that_fails_as_it_starts_is_said_to_have_so(tmp_path, failure: str, said: str) -> None:
    """A server that crashed or exited as it started (here importing a broken sympy) is said to have
    done so, not to have been killed by another process with a new one for the next run."""
    (tmp_path / "sympy.py").write_text(failure)
    script = tmp_path / "script.py"
    script.write_text(A_CALLER_WHOSE_SERVER_FAILS)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert re.fullmatch(rf"ctxpar's rank server \(pid \d+\) ended before it started ctxpar-rank-0: {said}\n",
                        proc.stdout), proc.stdout + proc.stderr


A_CALLER_WHOSE_CHILD_KEEPS_THE_SERVER = """
import subprocess, sys, time
from ctxpar import rank_server
from ctxpar.launch import run_local


def fn(rank, world, seconds):
    time.sleep(seconds)


if __name__ == "__main__":
    run_local(fn, 1, (0,))  # the server starts
    # a child holding the server's "alive" writer (as one a C library forks would) keeps the server alive
    alive = rank_server._server.forkserver._forkserver_alive_fd
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], pass_fds=[alive])
    print(child.pid, flush=True)
    run_local(fn, 2, (300,))
"""


def test_forked_ranks_die_with_the_caller_while_its_server_lives_on(tmp_path) -> None:
    """A server ends once nobody holds its "alive" pipe, and its ranks then by PDEATHSIG; a child
    of the caller that inherited the pipe keeps it alive (a copy of the caller made by os.fork
    closes it). The ranks watch the caller itself."""
    script = tmp_path / "script.py"
    script.write_text(A_CALLER_WHOSE_CHILD_KEEPS_THE_SERVER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        workers = wait_for(lambda: len(workers_of(proc.pid)) == 2 and workers_of(proc.pid), 60, "2 workers", proc)
        server = int(Path(f"/proc/{workers[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert_all_die(workers, within=3.0)
        assert alive(server)  # what the ranks' own watch ended them without
        os.kill(child, signal.SIGKILL)
        assert_all_die([server])
    finally:
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.communicate()  # once the child, and then the server, no longer hold its output pipes


A_CALLER_THAT_FORKS = """
import os, sys, time
from ctxpar.launch import run_local


def fn(rank, world):
    return os.getppid()


if __name__ == "__main__":
    first = run_local(fn, 1)[0]  # the server starts
    copy = os.fork()
    if copy == 0:  # its own server: the first is not its child, and the copy must not keep it alive
        os._exit(0 if run_local(fn, 1)[0] not in (first, os.getpid()) else 1)
    _, status = os.waitpid(copy, 0)
    with open(sys.argv[1], "w") as f:
        f.write(f"the copy ran on a server of its own: {os.waitstatus_to_exitcode(status) == 0}")
    time.sleep(300)  # while the copy, had it kept the first server's "alive" pipe, outlived this process
"""


def test_a_copy_of_the_caller_made_by_fork_starts_its_own_server_and_keeps_none_alive(tmp_path) -> None:
    script, said = tmp_path / "script.py", tmp_path / "said"
    script.write_text(A_CALLER_THAT_FORKS)
    proc = subprocess.Popen([sys.executable, str(script), str(said)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(lambda: said.exists() and said.read_text(), 60, "the copy's run", proc)
        assert said.read_text() == "the copy ran on a server of its own: True"
        servers = [pid for pid in map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
                   if b"ctxpar.rank_server" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(servers) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert_all_die(servers)  # nothing else held its "alive" pipe
    finally:
        proc.kill()
        proc.communicate()


A_CALLER_THAT_STARTS_ITS_SERVER_BY_FORK = """
import json, os, signal, sys, time
from ctxpar import rank_server
from ctxpar.launch import run_local


def fn(rank, world):
    return os.getppid(), "xml.dom.minidom" in sys.modules


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: None)  # the caller's handler: the server must not keep it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup: the server must keep it ignored
    held_r, held_w = os.pipe()  # a descriptor the server must not hold
    rank_server.start_here(("xml.dom.minidom",))  # a module the ranks find imported, by the server alone
    server = rank_server._server
    os.close(held_w)
    parents, preloaded = zip(*run_local(fn, 2))
    status = open(f"/proc/{server.pid}/status").read()
    ignored = int(status.split("SigIgn:")[1].split()[0], 16)
    os.set_blocking(held_r, False)
    try:
        pipe_closed = os.read(held_r, 1) == b""
    except BlockingIOError:  # a writer is open still
        pipe_closed = False
    said = dict(
        forked=open(f"/proc/{server.pid}/cmdline", "rb").read() == open("/proc/self/cmdline", "rb").read(),
        parents=parents, server=server.pid, kept=rank_server._server is server, pipe_closed=pipe_closed,
        hup_ignored=bool(ignored >> (signal.SIGHUP - 1) & 1), preloaded=preloaded,
        by_the_caller="xml.dom.minidom" in sys.modules)
    os.kill(server.pid, signal.SIGTERM)  # the server's own handler ends it and removes its folder
    for _ in range(100):
        pid, status = os.waitpid(server.pid, os.WNOHANG)
        if pid:
            said.update(status=os.waitstatus_to_exitcode(status), folder_left=os.path.exists(server.folder))
            break
        time.sleep(0.1)
    else:
        os.kill(server.pid, signal.SIGKILL)
        said.update(status="still running 10 s after its SIGTERM")
    print(json.dumps(said))
"""


def test_a_server_started_by_fork_is_the_caller_with_only_what_a_new_interpreter_holds(tmp_path) -> None:
    """rank_server.start_here (the ctxpar command at its start): the server is a copy of the caller
    made by fork, not a new interpreter importing torch; its ranks run on it; it holds no
    descriptor of the caller's beyond standard input, output and error (a pipe's other end sees
    its end), takes the caller's ignored signals and not its handlers (SIGTERM ends it as it ends
    a new one), imports what it is asked to for the ranks (not the caller), and a run under the
    same state keeps it."""
    script = tmp_path / "script.py"
    script.write_text(A_CALLER_THAT_STARTS_ITS_SERVER_BY_FORK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout)
    assert said == dict(forked=True, parents=[said["server"]] * 2, server=said["server"], kept=True, pipe_closed=True,
                        hup_ignored=True, preloaded=[True, True], by_the_caller=False, status=128 + signal.SIGTERM,
                        folder_left=False), said


A_CALLER_THAT_ENDS_WHILE_ITS_SERVER_IMPORTS = """
import json
from ctxpar import rank_server

rank_server.start_here(("slow_to_import",))
print(json.dumps(dict(server=rank_server._server.pid, folder=rank_server._server.folder)))
"""


def test_a_server_still_importing_ends_with_its_caller(tmp_path) -> None:
    """A caller that ends (a command refused at once) ends its server at once, its folder removed:
    the server went on with its imports (1-2 s of CPU for ctxpar train's) until it read the end of
    the "alive" pipe."""
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(300)\n")
    script = tmp_path / "script.py"
    script.write_text(A_CALLER_THAT_ENDS_WHILE_ITS_SERVER_IMPORTS)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout)
    try:
        wait_for(lambda: not alive(said["server"]) and not os.path.exists(said["folder"]), 30,
                 "the server to end and remove its folder")
    finally:
        if alive(said["server"]):
            os.kill(said["server"], signal.SIGKILL)


# -- item 9: the environment -----------------------------------------------------------------


def test_stray_launcher_variables_do_not_redirect_a_local_run(tmp_path) -> None:
    """Left over from another job: torchrun's rank variables, a master nobody serves, the agent-store
    switch and a network interface that does not exist. --nproc 2 still means 2 local ranks."""
    stray = dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="5", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                 TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME="ctxpar-none0")
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "ctxpar.cli", "demo", "--nproc", "2", *TINY_DEMO, "--json", str(out)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, **stray))
    assert proc.returncode == 0, proc.stderr
    assert "ctxpar: spawning 2 local gloo ranks on 127.0.0.1" in proc.stderr
    assert "ignoring RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in proc.stderr
    assert json.loads(out.read_text())["config"]["nproc"] == 2


def test_a_torchrun_rank_without_a_process_group_is_refused_not_run_as_one_rank(monkeypatch) -> None:
    """torch.distributed not initialised under torchrun: each rank attended over its own shard alone
    (0.77 off), and a layout for P=2 was refused as "the process group has 1"."""
    from ctxpar.layout import get_layout
    from ctxpar.models import ModelConfig, Transformer
    from ctxpar.parallelize import apply_context_parallel

    for name, value in dict(TORCHELASTIC_RUN_ID="none", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    q = torch.randn(1, 2, 8, 4)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        said = f"was called in rank {rank} of a torchrun launch of 2 processes, but torch.distributed is not"
        for layout in ("zigzag", get_layout("zigzag", 2)):
            with pytest.raises(ValueError, match=f"ctxpar.attention {said}"):
                ctxpar.attention(q, q, q, layout=layout)
        with pytest.raises(ValueError, match=f"apply_context_parallel {said}"):
            tiny = ModelConfig(layers=1, hidden=8, heads=2, kv_heads=2, head_dim=4, ffn=8, vocab=8)
            apply_context_parallel(Transformer(tiny), layout="zigzag")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ctxpar.attention(q, q, q, layout="zigzag").shape == q.shape  # one process: itself


RUN_AS_A_TORCHRUN_RANK = """
from torch.distributed import distributed_c10d
import torch.distributed as dist
from ctxpar import launch

def fn(rank, world, device):
    timeouts = {distributed_c10d.default_pg_timeout.total_seconds(),
                distributed_c10d.default_pg_nccl_timeout.total_seconds()}
    dist.destroy_process_group()
    return timeouts

print("returned", launch.run(fn, 1, timeout_s=7))
"""


def test_run_under_torchrun_gives_fns_groups_its_timeout_and_returns_after_fn_destroyed_the_group() -> None:
    """Groups fn made under torchrun waited torch's 30 minutes, not timeout_s, as under run_local; and
    fn's result was lost to an AssertionError where fn had destroyed the group itself."""
    proc = subprocess.run([sys.executable, "-c", RUN_AS_A_TORCHRUN_RANK], capture_output=True, text=True,
                          timeout=120, env=_as_torchrun_rank(0))
    assert proc.returncode == 0, proc.stderr
    assert "returned {7.0}" in proc.stdout


def test_only_the_full_torchrun_environment_counts_as_torchrun(monkeypatch) -> None:
    """What torch's elastic agent sets for every worker (local_elastic_agent.py), all of it."""
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    assert not launch.launched_by_torchrun() and launch.world_size(4) == 4
    # two nodes of one rank each: the run's ranks are WORLD_SIZE's, this machine's LOCAL_WORLD_SIZE's
    for name, value in dict(TORCHELASTIC_RUN_ID="none", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    assert launch.launched_by_torchrun() and launch.world_size(4) == 2 and launch.local_ranks(4) == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two: the group is the run's, not the node's
    assert "joining torchrun's group of 4 ranks" in launch.describe_mode(2, 30)
    monkeypatch.setattr(launch, "_launch_store", dist.HashStore())
    assert launch.launch_token() == launch.launch_token() != ""  # one token for the launch: its restarts' too
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name)
    assert launch.describe_mode(2, 30).endswith("; ignoring RANK, WORLD_SIZE from the environment (not a torchrun "
                                                "launch: TORCHELASTIC_RUN_ID, LOCAL_RANK, LOCAL_WORLD_SIZE, "
                                                "MASTER_ADDR, MASTER_PORT unset)")
    launch.check_nproc(launch.max_local_ranks())  # the cap itself runs, one more is refused
    with pytest.raises(ValueError, match="more local ranks than this machine runs"):
        launch.check_nproc(launch.max_local_ranks() + 1)


@pytest.mark.parametrize("local_rank, local_world, gpus, visible, takes", [
    (5, 8, 8, None, 5), (1, 2, 4, None, 1), (5, 8, 1, "5", 0), (0, 1, 1, None, 0),
    (5, 8, 4, None, "torchrun started 8 ranks on this node, and each sees 4 GPUs: NCCL needs a GPU per rank; start "
                    "at most 4 (--nproc-per-node 4)"),
    (1, 4, 2, None, "start at most 2"), (0, 2, 0, None, "sees no GPU"),
    (1, 2, 1, None, "torchrun started 2 ranks on this node, and each sees 1 GPUs"),  # once both took cuda:0
    (1, None, 1, None, "torchrun started 2 ranks on this node"),  # LOCAL_WORLD_SIZE unset: ranks 0 and 1 at least
])
def test_a_torchrun_rank_takes_its_own_gpu_or_is_refused_before_joining(local_rank, local_world, gpus, visible,
                                                                         takes, monkeypatch) -> None:
    """A GPU for each of the node's ranks: LOCAL_RANK's; one GPU that CUDA_VISIBLE_DEVICES gave
    each rank: that one, where set_device(LOCAL_RANK) raised; more ranks than GPUs (one GPU
    that all of them see included): refused, on every rank of the node, before the rendezvous."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "rendezvous", lambda *args, **kwargs: pytest.fail("joined"))
    if isinstance(takes, int):
        with pytest.raises(pytest.fail.Exception, match="joined"):
            launch.init_from_env(30, "cuda")
        assert chosen == [torch.device("cuda", takes)]
    else:
        with pytest.raises(ValueError, match=re.escape(takes)):
            launch.init_from_env(30, "cuda")
        assert chosen == []


def _own_gpus_check(nodes: list[list[str]], missing: tuple[int, int] | None = None,
                    timeout_s: float = 30) -> dict[tuple[int, int], str]:
    """``launch.check_own_gpus`` on one store, a thread per local rank of each node (a list of
    the UUIDs its ranks' GPUs have), as torchrun numbers them; what each (node, local rank)
    raised ("" for nothing). ``missing``: a rank that never publishes."""
    store, said, threads, first = dist.HashStore(), {}, [], 0

    def check(node: int, local_rank: int, local_world: int, gpu: str) -> None:
        try:
            launch.check_own_gpus(store, node=node, local_rank=local_rank, local_world=local_world,
                                  rank=node + local_rank, device=torch.device("cuda", 0), gpu=gpu,
                                  timeout_s=timeout_s)
            said[node, local_rank] = ""
        except (ValueError, RuntimeError) as e:
            said[node, local_rank] = str(e)

    for gpus in nodes:
        threads += [threading.Thread(target=check, args=(first, i, len(gpus), gpu)) for i, gpu in enumerate(gpus)
                    if (first, i) != missing]
        first += len(gpus)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return said


def test_ranks_of_one_node_that_would_share_a_gpu_are_refused_alike_before_joining() -> None:
    """CUDA_VISIBLE_DEVICES=0 set for the whole job and --nproc-per-node 2: both ranks took cuda:0,
    each seeing one GPU, and NCCL failed later ("Duplicate GPU detected"). Each rank publishes
    its GPU's UUID for its node-mates: every rank of the node raises the same error, naming the
    ranks, the GPU and the fix; GPUs of their own pass, on any node."""
    said = _own_gpus_check([["GPU-a", "GPU-a"]])
    assert said[0, 0] == said[0, 1] != ""
    assert said[0, 0].startswith("torchrun ranks 0 (cuda:0), 1 (cuda:0) would share one GPU (UUID GPU-a): NCCL "
                                 "needs a GPU per rank, and the 2 ranks of this node see 1 between them")
    assert "start at most 1 (--nproc-per-node 1)" in said[0, 0] and "CUDA_VISIBLE_DEVICES, one per rank" in said[0, 0]
    said = _own_gpus_check([["GPU-a", "GPU-b", "GPU-c", "GPU-b"], ["GPU-a", "GPU-b"]])  # node 0: ranks 1 and 3
    assert {said[0, i] for i in range(4)} == {said[0, 0]} and said[4, 0] == said[4, 1] == ""
    assert said[0, 0].startswith("torchrun ranks 1 (cuda:0), 3 (cuda:0) would share one GPU (UUID GPU-b)")
    assert "start at most 3" in said[0, 0]
    said = _own_gpus_check([["GPU-a", "GPU-a", "GPU-b", "GPU-b"]])[0, 0]  # two pairs: both named
    assert "1 (cuda:0) would share one GPU (UUID GPU-a); torchrun ranks 2 (cuda:0), 3 (cuda:0) would share" in said
    assert set(_own_gpus_check([["GPU-a", "GPU-b"], ["GPU-c", "GPU-d", "GPU-e"]]).values()) == {""}
    said = _own_gpus_check([["GPU-a", "GPU-b", "GPU-c"]], missing=(0, 1), timeout_s=0.5)  # rank 1 failed before
    for r in (0, 2):
        assert said[0, r] == (f"torchrun rank {r} waited 0.5 s for local ranks [1] of its node to say which GPU "
                              f"they took; see their errors")


def _as_torchrun_rank_1_of_2(monkeypatch, *, gpus: int, properties) -> list[int]:
    """This process as local rank 1 of 2 under torchrun, seeing ``gpus`` simulated GPUs whose
    properties are ``properties``, its rendezvous on a store of its own; the ranks it joins as
    (empty until init_from_env joins)."""
    for name, value in dict(RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RESTART_COUNT="0").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch, "_launch_store", None)  # restored after: this process joined no launch
    monkeypatch.setattr(launch, "_joins", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    monkeypatch.setattr(dist, "rendezvous", lambda *args, **kwargs: iter([(dist.HashStore(), 1, 2)]))
    joined: list[int] = []
    monkeypatch.setattr(launch, "_join", lambda backend, timeout_s, **init: joined.append(init["rank"]))
    return joined


@pytest.mark.parametrize("mates_gpu, refused", [("GPU-0", True), ("GPU-1", False)])
def test_init_from_env_checks_the_gpus_of_the_node_before_joining(mates_gpu, refused, monkeypatch) -> None:
    """Local rank 1 of 2 under CUDA_VISIBLE_DEVICES=0 set for the whole job (the GPU simulated: one,
    and its UUID), its node-mate in a thread on the same store: both refused before joining where
    the mate's GPU is the same one, joined where each has its own."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    joined = _as_torchrun_rank_1_of_2(monkeypatch, gpus=1, properties=types.SimpleNamespace(uuid="GPU-0"))
    check, mate_said = launch.check_own_gpus, []

    def with_mate(store, **this_rank) -> None:  # local rank 0 publishes beside it, on its own GPU
        def mate() -> None:
            try:
                check(store, **dict(this_rank, local_rank=0, rank=0, gpu=mates_gpu))
            except ValueError as e:
                mate_said.append(str(e))
        thread = threading.Thread(target=mate)
        thread.start()
        try:
            check(store, **this_rank)
        finally:
            thread.join()

    monkeypatch.setattr(launch, "check_own_gpus", with_mate)
    if refused:
        with pytest.raises(ValueError, match=re.escape("torchrun ranks 0 (cuda:0), 1 (cuda:0) would share one GPU "
                                                       "(UUID GPU-0)")) as e:
            launch.init_from_env(30, "cuda")
        assert mate_said == [str(e.value)] and joined == []
    else:
        assert launch.init_from_env(30, "cuda") == torch.device("cuda", 0)
        assert mate_said == [] and joined == [1]


def test_a_gpu_without_a_uuid_joins_unchecked(monkeypatch) -> None:
    """Some builds (ROCm) report no UUID: init_from_env raised AttributeError on every launch;
    it joins, NCCL's own check left to tell GPUs apart."""
    joined = _as_torchrun_rank_1_of_2(monkeypatch, gpus=2, properties=types.SimpleNamespace(name="gpu"))
    assert launch.init_from_env(30, "cuda") == torch.device("cuda", 1) and joined == [1]


def test_a_real_torchrun_launch_joins_torchruns_group_and_train_compare_runs_its_reference_after_it(tmp_path) -> None:
    """The launch joins torchrun's group; train --compare's reference came after the group was
    gone, and its loss refused it as a torchrun rank that had not joined: every step trained,
    then exit status 2 and no report."""
    out = tmp_path / "train.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()), "-m", "ctxpar.cli", "train", "--seq", "128", "--steps",
                           "2", "--compare", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    assert f"ctxpar: joining torchrun's group of 2 ranks with backend {backend}" in proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["nproc"] == 2 and report["losses_match"] and report["gradients_match"], report
    assert len(report["reference_loss"]) == 2


FAKE_TORCHRUN_RANK = """
import atexit, sys
from ctxpar import cli
atexit.register(lambda: print("finalized", file=sys.__stderr__))
if sys.argv[1] == "crash":
    cli.COMMANDS["plan"] = (cli.COMMANDS["plan"][0], lambda args: 1 / 0)
if sys.argv[1] == "report":  # a report that failed its own check (demo's mismatch): no exception
    cli.COMMANDS["plan"] = (cli.COMMANDS["plan"][0], lambda args: 3)
if sys.argv[1] == "no":  # started with stdout closed (1>&-)
    sys.stdout = None
sys.argv[1:] = sys.argv[2:]
cli.entry()
"""


@pytest.mark.parametrize("case, argv, status, says", [
    ("ok", ["plan", "--seq", "8192", "--cp", "2"], 0, "CP-2"),
    ("bad value", ["plan", "--head-dim", "0"], 2, "ctxpar plan: error: --head-dim must be between 1 and"),
    ("crash", ["plan"], 1, "ZeroDivisionError"),
    ("report failed", ["plan"], 3, "ctxpar plan: exit status 3; rank 0's report says why"),
    ("usage", ["plan", "--seq", "x"], 2, "argument --seq: invalid int value: 'x'"),  # argparse's own refusal
    # once an AttributeError flushing None, then the finalization; then exit status 0, the report lost unsaid
    ("no stdout", ["plan"], 1, "the report could not be written to stdout (it is closed)"),
])
def test_the_command_ends_a_torchrun_rank_without_finalizing(case, argv, status, says, tmp_path) -> None:
    """Under torchrun the ``ctxpar`` command ends its rank's process itself, with the command's exit
    status and its output flushed, so that no gloo thread of a group FSDP2's mesh keeps alive
    can meet the interpreter's finalization: ranks used to abort after training (SIGABRT,
    "terminate called without an active exception"; 6 of 40 launches of 2 ranks). An atexit
    handler shows whether finalization ran. Why it failed goes to the error file torchrun
    names in its summary (it said "<N/A>")."""
    error_file = tmp_path / "error.json"
    rank_env = dict(TORCHELASTIC_RUN_ID="none", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCHELASTIC_ERROR_FILE=str(error_file))
    proc = subprocess.run([sys.executable, "-c", FAKE_TORCHRUN_RANK, case.split()[0], *argv], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, **rank_env))
    assert proc.returncode == status, proc.stderr
    assert says in proc.stdout + proc.stderr or case == "report failed"  # its report said why, on rank 0
    assert "finalized" not in proc.stderr
    if status == 0:
        assert not error_file.exists()
    else:
        told = json.loads(error_file.read_text())["message"]
        assert says in told["message"] and says in told["extraInfo"]["py_callstack"]
        assert ("Traceback" in told["extraInfo"]["py_callstack"]) == (case == "crash")


def _as_torchrun_rank(restart: int) -> dict[str, str]:
    """The environment torchrun gives the one rank of a one-rank launch, at its ``restart``."""
    return dict(os.environ, TORCHELASTIC_RUN_ID="none", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                TORCHELASTIC_RESTART_COUNT=str(restart))


def test_a_restart_of_a_launch_refused_at_first_refuses_again(tmp_path) -> None:
    """torchrun restarts a launch whose first attempt refused the --checkpoint-dir (another
    run's checkpoints, no --resume): the restart refuses it too rather than continue the
    other run, and in an empty directory it starts from step 0. (A fresh store per process
    here: no attempt of this launch recorded that it trained.)"""
    def train(restart: int, steps: int, directory: Path) -> tuple[subprocess.CompletedProcess, dict | None]:
        out = tmp_path / f"restart{restart}-{steps}.json"
        proc = subprocess.run([sys.executable, "-m", "ctxpar.cli", "train", "--seq", "256", "--steps", str(steps),
                               "--no-progress", "--checkpoint-dir", str(directory), "--json", str(out)],
                              capture_output=True, text=True, timeout=180, env=_as_torchrun_rank(restart))
        return proc, json.loads(out.read_text()) if out.exists() else None

    other_run = tmp_path / "other"
    proc, first = train(0, 2, other_run)
    assert proc.returncode == 0, proc.stderr
    for restart in (0, 1):
        proc, _ = train(restart, 4, other_run)
        assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr, proc.stderr
    proc, fresh = train(1, 2, tmp_path / "empty")
    assert proc.returncode == 0, proc.stderr
    assert fresh["start_step"] == 0 and fresh["loss"] == first["loss"]
    # what ran, as the demo's report says (the config's device is the flag: None)
    assert (fresh["device"], fresh["backend"], fresh["config"]["device"]) == ("cpu", "gloo", None)


RANK_FAILING_IN_ITS_FIRST_SAVE = """
import os, sys
from ctxpar import checkpoint, cli

WHEN = os.environ.pop("CTXPAR_TEST_FAIL")  # "after": once the checkpoint is sealed; "during": before
seal = checkpoint.write_manifest
def seal_or_fail(*args):
    if WHEN == "after":
        seal(*args)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        os._exit(1)  # as a rank lost in or after its first checkpoint
    if WHEN == "during":
        seal(*args)
checkpoint.write_manifest = seal_or_fail
cli.entry()
"""


@pytest.mark.parametrize("when, start", [("after", 2), ("during", 0)])
def test_torchrun_restarts_a_failed_rank_and_training_continues_from_its_checkpoint(when, start, tmp_path) -> None:
    """torchrun --max-restarts 1, rank 1 lost after or during its step-2 checkpoint: the
    restarted ranks join a fresh group (the failed attempt's addresses stay in torchrun's
    store, and gloo used to connect to them and fail) and continue from step 2, or start
    over past the save that was cut short (the restart used to refuse its own directory)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_FAILING_IN_ITS_FIRST_SAVE)
    out = tmp_path / "train.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), "train",
                           "--seq", "256", "--steps", "4", "--save-every", "2", "--no-progress",
                           "--checkpoint-dir", str(tmp_path / "ck"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, CTXPAR_TEST_FAIL=when))
    assert proc.returncode == 0, proc.stderr
    said = "continuing from its checkpoint at step 2" if start else "no checkpoint of it verifies: starting over"
    assert f"torchrun restarted the run: {said}" in proc.stderr
    assert "terminate called" not in proc.stderr
    report = json.loads(out.read_text())
    assert report["start_step"] == start and len(report["loss"]) == 4 - start
