"""Local ranks forked from a server process that imported torch once.

A spawned rank is a fresh interpreter that imports torch: 2-3 s for a run of 2 ranks on 2
cores, 4-7 s for 4, paid by every ``run_local`` (``benchmarks/rank_start.py``). Instead
``run_local`` has a server process fork each rank: multiprocessing's forkserver loop, in a
server of ctxpar's own (the process-wide one preloads the caller's ``__main__``, where a script
that touches CUDA at import would initialise it in the server and no forked rank could use the
GPU; and it may be someone else's, with their preloads). The server imports torch and ctxpar's
launcher, nothing else, and lives as long as the process that started it.

A forked rank starts from the server's state, not the caller's as a spawned one does. What the
process takes at its start is kept equal: the environment variables read at start
(``READ_AT_START``: glibc reads ``MALLOC_*`` as the process starts, OpenMP ``OMP_*`` as torch
loads), resource limits, CPU affinity, umask, the blocked and ignored signals and ``sys.path``
are compared with the server's at each run, and a server started under others is replaced (a
concurrent run still using it: that run spawns); the caller's whole environment and its standard
output and error, which a test's capture or a redirect may have moved since, are handed to each
rank and put in place before the rank runs any code of its own. Where the server cannot be used (not
Linux, no ``/proc``), or where the environment sets ``CTXPAR_RANK_SERVER=0``, ranks are spawned.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import io
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection, forkserver, reduction, spawn, util
from multiprocessing import context as mp_context
from typing import Any, NamedTuple

import multiprocessing as mp

# what the server imports before it forks: what every rank imports first (torch alone is 2-3 s), and what a rank's
# first backward imports (sympy, for symbolic shapes: 0.9 s a rank)
PRELOAD = ("torch", "torch.distributed", "ctxpar.launch", "torch.fx.experimental.symbolic_shapes")
OFF_SWITCH = "CTXPAR_RANK_SERVER"  # "0": spawn every rank
# a key of the preparation data a rank unpickles first, before multiprocessing imports the caller's
# script in it: its reconstructor gives the rank the caller's environment, standard output and error
_CALLER_KEY = "ctxpar_caller"
# Environment variables read as a process starts or as the server imports PRELOAD: by glibc's heap,
# the dynamic loader, Python, OpenMP and the BLAS libraries, numpy, torch, CUDA and NCCL (at import or
# at their start), the locale. A rank forked from a server started under other values of these would
# run with the server's: the server is replaced. The rest of the caller's environment a rank takes
# whole as it starts (``_settle_forked_rank``): pytest alone changes PYTEST_CURRENT_TEST at every test.
READ_AT_START = ("MALLOC_", "GLIBC_", "LD_", "PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "NPY_",
                 "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "LANG", "LC_")


class _StartState(NamedTuple):
    """What a process takes from its parent at its start (``_start_state``)."""

    read_at_start: tuple
    rlimits: tuple
    umask: str | None
    affinity: tuple
    blocked: tuple
    ignored: tuple
    sys_path: tuple  # absolute: a server started in another working directory reads "" or "." elsewhere
    stdio_open: tuple


@dataclass
class _Server:
    forkserver: forkserver.ForkServer
    folder: str  # its socket's, which it removes as it ends
    started_under: _StartState
    runs: int = 0  # runs starting or running ranks on it
    exitcode: int | None = None  # once it has ended and been reaped: as a Process's (-N: killed by signal N)

    @property
    def pid(self) -> int:
        return self.forkserver._forkserver_pid


_lock = threading.Lock()
_server: _Server | None = None


def _forget_the_parents_server() -> None:
    """In a copy of this process made by os.fork: the server is the original's, not this copy's child
    (it could not wait for it), and the copy of its "alive" writer held here would keep it alive,
    and its ranks, after the original ended."""
    global _lock, _server
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _server is not None:
        os.close(_server.forkserver._forkserver_alive_fd)
        _server = None


os.register_at_fork(after_in_child=_forget_the_parents_server)


def _end_own_server() -> None:
    """At this process's exit, end its server now: it would end once it read the "alive" pipe's
    end, after what it was still importing (a command refused at once left its server 1-2 s of
    CPU of imports to finish). SIGTERM ends it by its handler, which removes its folder (the
    signal is held from before the server starts until the handler is in place: ``_start``);
    removed here too, as the handler may still be running (a server under a caller that
    ignores SIGTERM ignores it too, and ends by the pipe)."""
    if not _lock.acquire(timeout=1):  # another thread starting a run as the process ends: the pipe ends the server
        return
    try:
        if _server is None or _ended(_server):
            return
        os.kill(_server.pid, signal.SIGTERM)
        shutil.rmtree(_server.folder, ignore_errors=True)
    except ChildProcessError:  # reaped by a wait of the caller's own: its pid may be another process's now
        pass
    finally:
        _lock.release()


atexit.register(_end_own_server)


def usable() -> bool:
    """Whether ranks are forked from a server here: Linux, with /proc (a forked rank's parent is the
    server: it watches the caller by its pid and start time there) and descriptor passing, unless
    the environment sets ``CTXPAR_RANK_SERVER=0``."""
    return (os.environ.get(OFF_SWITCH) != "0" and sys.platform.startswith("linux") and os.path.exists("/proc/self/stat")
            and reduction.HAVE_SEND_HANDLE)


def acquire() -> tuple[Any, _Server | None]:
    """(what makes this run's ranks, as a Process class does, the server that forks them): a server
    started under this process's present state, or spawn's and None. Pair with ``release``; call
    it with SIGINT blocked in this thread (a server started now inherits the mask, and every rank
    it forks: see run_local)."""
    global _server
    if not usable():
        return mp.get_context("spawn").Process, None
    state = _start_state()
    with _lock:
        if _server is not None and _ended(_server):
            _server = None
        if _server is not None and _server.started_under != state:
            if _server.runs:  # another run's ranks are its children: stopping it would kill them
                return mp.get_context("spawn").Process, None
            os.close(_server.forkserver._forkserver_alive_fd)  # it ends, removing its folder
            _server.exitcode = os.waitstatus_to_exitcode(os.waitpid(_server.pid, 0)[1])
            _server = None
        if _server is None:
            _server = _start(state)
        _server.runs += 1
        return functools.partial(_RankProcess, _server), _server


def start_here(preload: tuple[str, ...] = ()) -> None:
    """Start this process's server now, as a copy of this process made by fork, instead of a new
    interpreter importing torch when the first run needs one (2-4 s of CPU on 2 cores, on that
    run's critical path). Only for a process that has imported what its ranks need and done
    nothing else yet (no thread of its own, no accelerator initialised, no torch op run), as the
    ``ctxpar`` command at its start: the server, and every rank it forks, is this process as it is
    now, with PRELOAD and ``preload`` imported (by the server, while this process goes on). A
    no-op where a server runs already, or where ranks are spawned (``usable``)."""
    global _server
    if not usable():
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # as acquire's: the server and its ranks
    try:
        with _lock:
            if _server is None:
                _server = _start(_start_state(), fork=preload)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def release(server: _Server | None) -> None:
    """The ranks of a run that ``acquire`` gave ``server`` have ended."""
    if server is not None:
        with _lock:
            server.runs -= 1


def _ended(server: _Server) -> bool:
    """Whether ``server`` has ended (killed: its own end removes its folder), reaped and cleaned up if so;
    call with ``_lock`` held."""
    if server.exitcode is None:
        pid, status = os.waitpid(server.pid, os.WNOHANG)
        if not pid:
            return False
        server.exitcode = os.waitstatus_to_exitcode(status)
        os.close(server.forkserver._forkserver_alive_fd)
        shutil.rmtree(server.folder, ignore_errors=True)
    return True


BY_ANOTHER = ", by another process"


def how_it_ended(server: _Server, wait_s: float = 2.0) -> str:
    """How ``server``, found gone (its connection to a rank closed), ended: "killed by SIGKILL, by another
    process", "exited with code 1; its error is on stderr"; "ended" if it is still running ``wait_s`` later."""
    give_up = time.monotonic() + wait_s
    while True:
        with _lock:
            if _ended(server):
                break
        if time.monotonic() >= give_up:
            return "ended"
        time.sleep(0.01)
    handled = {128 + sig: sig for sig in _ENDING_SIGNALS}  # its handler's exit: ``_end_server``
    if server.exitcode in handled:
        return f"ended by {signal.Signals(handled[server.exitcode]).name}{BY_ANOTHER}"
    how = exit_reason(server.exitcode)
    if server.exitcode in (-signal.SIGKILL, *(-sig for sig in _ENDING_SIGNALS)):
        return f"{how}{BY_ANOTHER}"
    return f"{how}; its error is on stderr"  # a preload that failed, a crash


def exit_reason(exitcode: int | None) -> str:
    """How a process ended, from its exit code as multiprocessing gives it."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _start_state() -> _StartState:
    """What a process takes from its parent at its start, as this process (and thread) has it now."""
    import resource  # POSIX's: usable() is False elsewhere

    rlimits = tuple((name, resource.getrlimit(getattr(resource, name))) for name in sorted(dir(resource))
                    if name.startswith("RLIMIT_"))
    with open("/proc/self/status") as f:  # Linux 4.7 on; os.umask would set it, for every thread, a moment
        umask = next((line for line in f if line.startswith("Umask:")), None)
    # SIGINT aside: run_local holds it (blocked, its own handler) while the ranks start, and they ignore it
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ()) - {signal.SIGINT}
    ignored = {s for s in signal.valid_signals() if s != signal.SIGINT and signal.getsignal(s) is signal.SIG_IGN}
    # which of stdout and stderr are open: in a server started without one, its number may be another file
    # in a rank, which the caller's must not replace
    stdio = tuple(_is_open(fd) for fd in (1, 2))
    read_at_start = sorted((name, value) for name, value in os.environ.items() if name.startswith(READ_AT_START))
    sys_path = tuple(os.path.abspath(entry) if entry else os.getcwd() for entry in sys.path)
    return _StartState(tuple(read_at_start), rlimits, umask, tuple(sorted(os.sched_getaffinity(0))),
                       tuple(sorted(blocked)), tuple(sorted(ignored)), sys_path, stdio)


def _start(state: _StartState, *, fork: tuple[str, ...] | None = None) -> _Server:
    """Start a server: multiprocessing's forkserver loop (``serve``), in a new interpreter with this
    process's sys.path (the stdlib's server of Python 3.11 ignores the one it is given), or, with
    ``fork`` (what it imports besides PRELOAD), in a copy of this process (``start_here``). It ends
    once every copy of the "alive" pipe's writer is closed: this process's at its exit, and each
    rank closes the one it inherits (``_settle_forked_rank``), so that the server, and by
    PDEATHSIG its ranks, die with this process (which also sends it SIGTERM as it exits:
    ``_end_own_server``). Its socket is a file only this user can open (a socket of the abstract
    namespace any local user could ask to fork code of theirs), in a folder it removes as it ends:
    a caller ended by SIGTERM removes nothing."""
    server = forkserver.ForkServer()
    server.set_forkserver_preload(list(PRELOAD))  # were the stdlib to restart it
    folder = tempfile.mkdtemp(prefix="ctxpar-ranks-")
    try:
        address = os.path.join(folder, "server")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            # held (blocked) from before the fork until the server's handler is in place: a SIGTERM
            # as it started killed it by the default action, leaving its folder
            held = set(_ENDING_SIGNALS) - signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING_SIGNALS)
            try:
                if fork is not None:
                    pid = _serve_in_a_fork(listener.fileno(), alive_r, folder, fork, held)
                else:
                    command = _server_command(listener.fileno(), alive_r, folder, state.sys_path, held)
                    executable = spawn.get_executable()
                    pid = util.spawnv_passfds(executable,
                                              [executable, *util._args_from_interpreter_flags(), "-c", command],
                                              [listener.fileno(), alive_r])
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return _Server(server, folder, state)


def _server_command(listener_fd: int, alive_r: int, folder: str, sys_path: tuple, held: set[int]) -> str:
    """A new interpreter's code that runs ``serve``. Its SIGTERM and SIGHUP end it as ``serve``'s
    handler does from its first line, not from the end of its imports (1-2 s of torch), and
    ``held``, those the starter blocked for it, are unblocked once that handler is in place: a
    launcher ending a rank that had started a server of its own (a script calling ``ctxpar``
    without a main guard, re-run by the rank) killed the server as it started, leaving its
    folder. The folder is removed however the code ends."""
    return "\n".join([
        "import shutil, signal, sys",
        f"ending = [s for s in {sorted(map(int, _ENDING_SIGNALS))!r} if signal.getsignal(s) is signal.SIG_DFL]",
        "for s in ending:",
        "    signal.signal(s, lambda signum, frame: sys.exit(128 + signum))",
        "try:",
        f"    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sorted(map(int, held))!r})  # one held ends it here",
        f"    sys.path[:] = {list(sys_path)!r}",
        "    from ctxpar.rank_server import serve",
        f"    serve({listener_fd}, {alive_r}, {folder!r}, ending=ending)",
        "finally:",
        f"    shutil.rmtree({folder!r}, ignore_errors=True)",
    ])


def _serve_in_a_fork(listener_fd: int, alive_r: int, folder: str, preload: tuple[str, ...], held: set[int]
                     ) -> int:
    """The pid of a copy of this process that runs ``serve`` with ``preload``, holding what the new interpreter of
    ``_start`` would: standard input, output and error, the listener and the "alive" reader and no
    other descriptor (this process's "alive" writer among them), and the signal dispositions exec
    leaves (ignored ones kept, handled ones reset; SIGINT Python's own)."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in (0, 1, 2, listener_fd, alive_r):
                try:
                    os.close(fd)
                except OSError:  # the listing's own, closed already
                    pass
        signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        serve(listener_fd, alive_r, folder, preload, held=held)
        status = 0
    except SystemExit as e:  # the loop's end (the "alive" pipe closed), or _end_server's
        status = e.code if isinstance(e.code, int) else 0
    except BaseException:
        traceback.print_exc()  # as the interpreter of a server that failed would
    finally:
        os._exit(status)


def serve(listener_fd: int, alive_r: int, folder: str, preload: tuple[str, ...] = (),
          ending: list[int] | None = None, held: set[int] = frozenset()) -> None:
    """A server's main: multiprocessing's forkserver loop, preloading PRELOAD and ``preload``, until
    the "alive" pipe closes; then, or at a SIGTERM or SIGHUP (a signal to the caller's whole group),
    it removes its folder. ``ending``: the signals its start handles already (``_server_command``),
    else those at their default action (not one the caller ignores: nohup). ``held``: those its
    starter blocked until this handler is in place (``_start``)."""
    if ending is None:
        ending = [sig for sig in _ENDING_SIGNALS if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in ending:
        signal.signal(sig, _end_server)  # the handler each forked rank resets to the default
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)  # one held ends it here, its folder removed
        for name in (*PRELOAD, *preload):
            try:
                importlib.import_module(name)
            except ImportError:  # as the stdlib's server: a rank that needs it raises it itself
                pass
        # what every rank starts with is never garbage: a rank's full collection skips it (torch's objects alone
        # took 0.16 s to scan, and scanning wrote to every page of them, each then copied from the server)
        gc.freeze()
        forkserver.main(listener_fd, alive_r, [])  # imported above
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _end_server(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


class _FromTheCaller:
    """This process's environment and standard output and error (descriptors 1 and 2) as they are
    now, for a rank: put in place as the rank unpickles this, before it runs any code of the caller's."""

    def __reduce__(self):
        return _settle_forked_rank, (dict(os.environ), *(reduction.DupFd(fd) if _is_open(fd) else None
                                                         for fd in (1, 2)))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _settle_forked_rank(environment: dict[str, str], stdout: Any, stderr: Any) -> None:
    """The first thing a forked rank runs: SIGTERM and SIGHUP at their defaults, as in a spawned
    rank; the caller's environment in place of the server's (those of its variables read at start
    are the server's already: ``READ_AT_START``); the caller's stdout and stderr in place of the
    server's (one the caller has closed, the server had closed too: ``_start_state``); the
    server's "alive" writer closed (held here, it kept the server, and so this rank, alive after
    the caller died); numpy's global random state drawn anew, as a spawned rank's is (forked,
    every rank would draw the server's numbers)."""
    for sig in _ENDING_SIGNALS:
        if signal.getsignal(sig) is _end_server:
            signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(environment)
    for target, inherited in ((1, stdout), (2, stderr)):
        if inherited is not None:
            fd = inherited.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


if sys.platform != "win32":  # multiprocessing's forkserver start is POSIX's (usable() is False elsewhere)
    from multiprocessing.popen_forkserver import Popen as _ForkServerPopen
else:
    _ForkServerPopen = object


class _RankPopen(_ForkServerPopen):
    """multiprocessing's forkserver start, on the server the run was given, handing the rank the
    caller's environment and stdio."""

    def _launch(self, process_obj) -> None:
        server = process_obj.rank_server
        prep_data = {_CALLER_KEY: _FromTheCaller(), **spawn.get_preparation_data(process_obj._name)}
        buffer = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buffer)
            reduction.dump(process_obj, buffer)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = server.forkserver.connect_to_new_process(self._fds)
        # the rank's mp.parent_process() watches this writer, as forkserver's start keeps it
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buffer.getbuffer())
        try:
            self.pid = forkserver.read_signed(self.sentinel)
        except EOFError:
            how = how_it_ended(server)
            raise RuntimeError(f"ctxpar's rank server (pid {server.pid}) ended before it started {process_obj.name}: "
                               f"{how}{'; the next run starts a new one' if how.endswith(BY_ANOTHER) else ''}"
                               ) from None

    server_ended = False  # before it could say how the rank ended: the kernel killed the rank with it

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        """The rank's exit status, which the server writes once it has reaped it; where the server
        ended first (killed), the rank's end by PDEATHSIG, SIGKILL (the stdlib says 255, as for an exit)."""
        if self.returncode is None:
            if not connection.wait([self.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            try:
                self.returncode = forkserver.read_signed(self.sentinel)
            except (OSError, EOFError):
                self.returncode, self.server_ended = -signal.SIGKILL, True
        return self.returncode


class _RankProcess(getattr(mp_context, "ForkServerProcess", mp_context.Process)):
    """A rank forked from ``rank_server``, the server ``acquire`` gave its run (the module's current
    one may be another by the time it starts: a killed server is replaced at the next acquire)."""

    def __init__(self, rank_server: _Server, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rank_server = rank_server

    def __getstate__(self) -> dict:  # sent to the rank, which has no use for the server (nor could unpickle it)
        state = dict(self.__dict__)
        del state["rank_server"]
        return state

    @staticmethod
    def _Popen(process_obj):
        return _RankPopen(process_obj)
