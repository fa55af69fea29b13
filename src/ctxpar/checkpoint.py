"""Checkpoints that a run resumes from only if they were written completely and read back intact.

A checkpoint is a directory ``step-<N>`` (zero-padded to six digits) under
``--checkpoint-dir``, holding what ``torch.distributed.checkpoint`` (DCP) writes
(``.metadata``, ``__<rank>_<i>.distcp``) and, written last, ``manifest.json``:

    {"format": "ctxpar-checkpoint/1",
     "step": 3,
     "run": {"--model": "tiny", "--seq": 128, ...},      # what a continuation must share
     "files": {".metadata": {"bytes": 40281, "sha256": "9f2c..."},
               "__0_0.distcp": {"bytes": 740247, "sha256": "..."}, ...},
     "checksum": "..."}                                   # sha256 of the fields above

The manifest goes to a temporary name, is fsynced and renamed into place once every data
file is on disk, so a directory without a valid manifest is by definition partial: the
run stopped while saving it. Resume walks the checkpoints newest first and takes the
first whose manifest is intact and whose files all have the recorded size and sha256;
what it passes over comes back with the reason. While saving, rank 0 holds an exclusive
``flock`` on ``.ctxpar-save.lock`` in the directory (released when the save ends or the
process dies), so two runs saving into one directory are refused, not mixed.

Every function here that a rank calls with a process group up is collective: rank 0
reads directories and manifests and broadcasts what it found (or the error it hit), the
ranks hash a share of the files each and all-gather the digests, so every rank reaches
the same verdict from the same data and all load or all raise together; none is left
waiting in a collective. The checksums catch crashes and storage faults (truncated,
bit-flipped, deleted files), not someone who rewrites a manifest on purpose.

``torch.distributed.checkpoint`` is imported by the functions that use it: importing it
takes 0.6 s (torch.distributed.tensor with it), which every ``ctxpar`` command paid at start.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ctxpar.plan.units import format_bytes

MANIFEST = "manifest.json"
FORMAT = "ctxpar-checkpoint/1"
OWN_FILES = ".ctxpar-"  # the prefix of this module's own entries in a checkpoint directory (a lock, a probe)
SAVE_LOCK = OWN_FILES + "save.lock"  # held by the rank 0 that is saving into the directory
RUN_LOCK = OWN_FILES + "run.lock"  # held by the process that launched a run on the directory, for the run's life
_CANNOT_LOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # flock's errors where the file system has none
_STEP_DIR = re.compile(r"step-([0-9]+)")
_UNSEALED = f"no {MANIFEST}: incomplete, the run stopped while saving it"
_READ_BYTES = 1 << 22

T = TypeVar("T")


@dataclass(frozen=True)
class Skipped:
    """An entry of the checkpoint directory that resume did not use, and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class Resumable:
    """The checkpoint to resume from, and what newer or stray entries were passed over."""

    step: int
    path: str
    skipped: tuple[Skipped, ...]


def step_path(directory: str, step: int) -> str:
    """Where checkpoint ``step`` lives: ``directory/step-000042``."""
    return os.path.join(directory, f"step-{step:06d}")


def list_checkpoints(directory: str) -> tuple[list[tuple[int, str]], list[Skipped]]:
    """The ``step-<N>`` directories in ``directory`` as (N, path), newest first, and every other entry.

    Lists this process's view only (not collective); nothing is verified here.
    """
    found, ignored = [], []
    for name in sorted(os.listdir(directory)):
        if name.startswith(OWN_FILES):
            continue
        path = os.path.join(directory, name)
        match = _STEP_DIR.fullmatch(name)
        if match and os.path.isdir(path):
            found.append((int(match[1]), path))
        else:
            ignored.append(Skipped(path, "a file, not a checkpoint directory" if match else
                                   "not a checkpoint (expected step-<number> directories)"))
    found.sort(reverse=True)
    return found, ignored


def check_directory(directory: str, *, resuming: bool, checkpoint_bytes: int = 0) -> None:
    """Refuse a ``--checkpoint-dir`` that would fail or destroy work later, before any rank starts.

    A run saves to it (at least its last step), so it must be writable (created here if
    missing; a probe file is written and removed), have ``checkpoint_bytes`` free (a lower
    bound of one checkpoint's size: a run on a full file system trained to its end and failed
    there) and hold no checkpoints of an earlier run unless resuming it, since a fresh run
    would overwrite them step by step. Resuming needs at least one ``step-<N>`` directory;
    whether one is intact is decided by :func:`find_resumable`.
    """
    _refuse_what_is_no_directory(directory, "--checkpoint-dir")
    if resuming and not os.path.isdir(directory):
        raise ValueError(f"--resume: --checkpoint-dir {directory!r} does not exist; pass the directory the "
                         "earlier run saved to, or drop --resume to start a new run")
    try:
        found, ignored = list_checkpoints(directory) if os.path.isdir(directory) else ([], [])
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {directory!r} cannot be listed ({e.strerror or e}); pass a directory "
                         "this user can read") from e
    if resuming and not found:
        also = f" (ignored: {', '.join(os.path.basename(s.path) for s in ignored)})" if ignored else ""
        raise ValueError(f"--resume: no step-<number> checkpoint directory in {directory!r}{also}; pass the "
                         "directory the earlier run saved to, or drop --resume to start a new run")
    sealed = [path for _, path in found if _is_sealed(path)]  # a save cut short is replaced, not a checkpoint
    if not resuming and sealed:
        raise ValueError(f"--checkpoint-dir {directory!r} already holds checkpoints (newest: "
                         f"{os.path.basename(sealed[0])}) that this new run would overwrite; add --resume to "
                         "continue that run, or pass an empty directory")
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=OWN_FILES + "write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {directory!r} is not writable ({e.strerror or e}); pass a "
                         "directory this user can create files in, or drop --checkpoint-dir") from e
    save_lock = os.path.join(directory, SAVE_LOCK)
    try:  # every save takes it: one that cannot be opened failed the first save, after the training
        os.close(os.open(save_lock, os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {directory!r}: its save lock {save_lock} cannot be opened "
                         f"({e.strerror or e}); remove it if it is no file, or make it writable") from None
    room = os.statvfs(directory)
    free = room.f_bavail * room.f_frsize
    if free < checkpoint_bytes:
        raise ValueError(f"--checkpoint-dir {directory!r} has {format_bytes(free)} free, less than one checkpoint of "
                         f"this run takes (at least {format_bytes(checkpoint_bytes)}: the model's parameters and the "
                         "optimizer's state); free space there, or pass a directory on a file system with room")


def _refuse_what_is_no_directory(directory: str, named: str) -> None:
    """Refuse a ``directory`` path that names a file (spelt with a trailing slash too) or a
    link to a missing path: makedirs would say only "File exists"."""
    path = directory.rstrip(os.sep) or directory  # "afile/" names the file
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{named} {directory!r} is a symbolic link to {os.readlink(path)!r}, which does not exist; "
                         "create the directory it points to, or pass another path")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{named} {directory!r} is a file, not a directory; pass a directory path")


class HeldByAnotherRun(ValueError):
    """The checkpoint directory is held by another live run (``hold_for_run``)."""


def _flock(path: str) -> int | None:
    """An exclusive ``flock`` on the file ``path`` (created): its descriptor (closing it releases
    the lock), or None where the file system has no locks (NFS mounted nolock, Lustre noflock).

    Raises:
        BlockingIOError: another open file holds the lock.
        OSError: the file cannot be opened (no permission, a directory in its place).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in _CANNOT_LOCK:
            return None
        raise
    return fd


def hold_for_run(directory: str, owner: str = "") -> int | None:
    """Lock ``directory`` for one run's life and return the lock's descriptor (closing it, or
    the process's end, releases it); None where its file system has no locks. A second run
    started on it meanwhile, ``--resume`` included, is refused before its ranks start: a
    resume beside a live run took its newest checkpoint as the last, saved over its later
    steps, and one of the two died at its next save. The lock file names this process's host
    and pid, and ``owner`` (a torchrun launch) beside them, which the refusal quotes. It is
    left in the directory, which resume passes over (``OWN_FILES``).

    Raises:
        HeldByAnotherRun: another process holds the directory, naming its host and pid.
        ValueError: the lock file cannot be opened or locked.
    """
    path = os.path.join(directory, RUN_LOCK)
    try:
        lock = _flock(path)
    except BlockingIOError:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                holder = f" ({f.read(256).strip()})"
        except OSError:
            holder = ""
        raise HeldByAnotherRun(f"another ctxpar train is running on --checkpoint-dir {directory!r}{holder}; wait for "
                               f"it to end (--resume then continues it), or give this run a directory of its own"
                               ) from None
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {directory!r}: its run lock {path} cannot be taken ({e.strerror or e}); "
                         f"remove it if it is no file, or make it writable") from None
    if lock is not None:
        os.ftruncate(lock, 0)
        os.write(lock, f"{socket.gethostname()} pid {os.getpid()}{', ' + owner if owner else ''}\n".encode())
    return lock


def check_and_hold(directory: str, *, resuming: bool, checkpoint_bytes: int = 0, owner: str = "") -> int | None:
    """:func:`check_directory`, then :func:`hold_for_run`; a writable directory that exists
    is held first, so that a live run on it is named before what it saved there ("holds
    checkpoints: add --resume", which the lock then refused)."""
    first = os.path.isdir(directory) and os.access(directory, os.W_OK)  # else check_directory says why not
    held = hold_for_run(directory, owner) if first else None
    try:
        check_directory(directory, resuming=resuming, checkpoint_bytes=checkpoint_bytes)
        return held if first else hold_for_run(directory, owner)
    except BaseException:
        if held is not None:
            os.close(held)
        raise


def check_and_hold_together(directory: str, *, resuming: bool, checkpoint_bytes: int = 0, checked: bool = True,
                            owner: str = "") -> int | None:
    """:func:`check_and_hold` by rank 0 (``checked`` False: :func:`hold_for_run` alone), raising
    on every rank (collective); rank 0's descriptor there, None elsewhere."""
    hold = partial(check_and_hold, directory, resuming=resuming, checkpoint_bytes=checkpoint_bytes, owner=owner) \
        if checked else partial(hold_for_run, directory, owner)
    held = _on_rank0(hold)
    return held if _rank_world()[0] == 0 else None


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str, step: int,
         run: dict[str, Any]) -> str:
    """Save model and optimizer state as ``directory/step-<step>`` and seal it (collective); return its path.

    A leftover at that path (a partial save, or a checkpoint of this run that resume passed
    over) is removed first, so no file of it can end up under the new manifest. Rank 0 holds
    a lock on the directory while saving (where its file system has locks), so another run
    saving into it at the same time is refused rather than left to remove or mix files with
    this one; a sealed checkpoint of another run (other ``run`` settings) is never replaced.

    Raises:
        ValueError: a step that is not an int >= 0, ``run`` not a dict JSON can hold, a
            directory that is a file, the directory locked by another save, or ``step``
            sealed there by another run; on every rank, before any file of the checkpoint
            is written.
        OSError: the checkpoint could not be written (no space left, a file-size limit, no
            permission), on every rank with one message naming the OS's error; what was
            written is left unsealed, which resume skips.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an int >= 0 (resume finds step-<number> directories), got "
                         f"{step!r}")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    settings = _checked_run(run)
    path = step_path(directory, step)
    _check_ranks_agree(directory, step)
    try:
        lock = _on_rank0(partial(_claim, directory, path, step, settings))  # rank 0's descriptor
    except OSError as e:
        raise _unwritten(path, step, e) from None
    try:
        model_state, optim_state = _state_without_stepping(model, optimizer)
        try:
            dcp.save({"model": model_state, "optim": optim_state}, storage_writer=_writer_class()(path))
        except CheckpointException as e:  # a BaseException: an `except Exception` would miss it
            # every rank holds every rank's failure: the first rank's, the OS's error where one had it
            failures = [failure for _, (failure, _) in sorted(e.failures.items())]
            first = failures[0]
            raise next((f for f in failures if isinstance(f, OSError)),
                       OSError(f"{type(first).__name__}: {first}")) from None
        write_manifest(path, step, settings)
    except OSError as e:
        raise _unwritten(path, step, e) from None
    finally:
        if _rank_world()[0] == 0 and lock is not None:
            os.close(lock)  # releases the lock
    return path


def _check_ranks_agree(directory: str, step: int) -> None:
    """Refuse, on every rank, ranks saving other steps or into other directories (collective):
    each wrote its shard where it was told, and rank 0 sealed a checkpoint missing them."""
    rank, world = _rank_world()
    if world == 1:
        return
    mine = (step, os.path.realpath(directory))
    every = [None] * world
    dist.all_gather_object(every, mine)
    if any(theirs != every[0] for theirs in every):
        told = ", ".join(f"rank {r}: step {s} in {d}" for r, (s, d) in enumerate(every))
        raise ValueError(f"the ranks disagree on the checkpoint to save ({told}); every rank must save the same step "
                         f"into the same directory, on a file system they all share")


def _unwritten(path: str, step: int, cause: OSError) -> OSError:
    why = cause.strerror or cause
    return OSError(f"checkpoint step {step} could not be written to {path} ({why}); what was written of it is left "
                   f"unsealed (no {MANIFEST}), which resume skips")


@cache
def _writer_class() -> type:
    """DCP's file writer, raising the OS's error where a write failed. torch's serializer turns
    one into its own ("[enforce fail at inline_container.cc:672] unexpected pos", a file-size
    limit's "File too large" only its context), and DCP pickles each rank's failure for the
    others, which drops the context. Made at the first save, as DCP is imported there."""
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except Exception as e:
                cause = e
                while cause is not None and not isinstance(cause, OSError):
                    cause = cause.__cause__ or cause.__context__
                if cause is None or cause is e:
                    raise
                if cause.errno is None:  # an OSError of a message alone: OSError(None, None) would say "None"
                    raise OSError(str(cause)) from e
                raise OSError(cause.errno, cause.strerror, cause.filename) from e

    return Writer


def _state_without_stepping(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts, the optimizer left as it was. For an optimizer
    that has not stepped yet, torch's ``get_state_dict`` makes its state with a step at lr 0,
    which counts as a step: saved before training, AdamW then corrected its moments one step
    late for the rest of the run. That state is dropped again and none is saved, so a run
    resumed from the checkpoint starts its optimizer afresh as the saving run does."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    stepped = bool(optimizer.state)
    model_state, optim_state = get_state_dict(model, optimizer)
    if not stepped and optimizer.state:
        optimizer.state.clear()
        optim_state = {**optim_state, "state": {}}
    return model_state, optim_state


def write_manifest(path: str, step: int, run: dict[str, Any]) -> None:
    """Record the size and sha256 of every file in ``path`` as checkpoint ``step`` of ``run`` (collective).

    Call it only once the DCP save has returned on every rank (its last collective comes
    after the metadata is written); the manifest is the last thing written.
    """
    names = _on_rank0(lambda: sorted(n for n in os.listdir(path) if not n.startswith(MANIFEST)))
    digests = _digests(path, names)
    unreadable = {name: d for name, d in digests.items() if isinstance(d, str)}
    if unreadable:
        shared = (" (files rank 0 lists are missing for other ranks: is it on a file system every rank shares?)"
                  if "missing" in unreadable.values() and _rank_world()[1] > 1 else "")
        raise OSError(f"cannot read back the checkpoint files just written in {path}{shared}: {unreadable}")
    body = {"format": FORMAT, "step": step, "run": _as_json(run), "files": digests}
    _on_rank0(partial(_write_atomically, path, {**body, "checksum": _checksum(body)}))


def find_resumable(directory: str, run: dict[str, Any], *, required: bool = True) -> Resumable | None:
    """The newest complete, verified checkpoint in ``directory`` (collective); None if none
    verifies and not ``required``.

    Checkpoints without an intact manifest (partial saves), with a file missing or not
    matching its recorded size and sha256, and stray entries are skipped and named.

    Raises:
        ValueError: a verified checkpoint was written by a run whose ``run`` settings
            differ (naming each difference), or no verified checkpoint remains (``required``).
    """
    run = _checked_run(run)
    _on_rank0(partial(_check_is_directory, directory))
    candidates, strays = _on_rank0(partial(list_checkpoints, directory))
    skipped = list(strays)
    for step, path in candidates:
        problems = _problems(path, step, run)
        if not problems:
            return Resumable(step, path, tuple(skipped))
        skipped.append(Skipped(path, "; ".join(problems)))
    if not required:
        return None
    listing = "".join(f"\n  {s.path}: {s.reason}" for s in skipped) or " (it is empty)"
    # a new run is refused only where a checkpoint was sealed (check_directory); saves cut short it replaces
    steps = skipped[len(strays):]
    if steps and all(s.reason == _UNSEALED for s in steps):
        fix = "none was sealed: start a new run here, without --resume (its saves replace those cut short)"
    else:
        fix = "start a new run without --resume (in an empty --checkpoint-dir)"
    raise ValueError(f"--resume: no complete, verified checkpoint in {directory!r}:{listing}\n{fix}")


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Resumable | str) -> None:
    """Load a checkpoint into model and optimizer (collective): the one :func:`find_resumable`
    found (and verified), or a ``step-<N>`` directory's path, verified here against its
    manifest first (a flipped byte once loaded a wrong weight without a word).

    The optimizer's settings (learning rate, betas, weight decay) become the checkpoint's, as
    torch's ``load_state_dict`` makes them; tensors are cast to the model's dtypes, with a
    warning naming those that differ.

    Raises:
        ValueError: the checkpoint is not sealed or does not match its manifest; it holds
            parameters the model does not (a model with fewer layers once loaded the rest
            silently), lacks some it has, or holds them in other shapes, naming them; its
            optimizer state is of another kind (state of other names, or amsgrad,
            decoupled weight decay, maximize, nesterov or centered set otherwise), naming it;
            or it was saved by an optimizer over other parameters, naming them. On every rank
            where any rank's model or optimizer is refused, naming that rank, before DCP
            writes any tensor (it loads into the model's and the optimizer's own).
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    path = checkpoint.path if isinstance(checkpoint, Resumable) else _verified(checkpoint)
    parameters, saved_state, dtypes = _on_rank0(partial(_saved_entries, path))
    error = None
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        _check_parameters(path, parameters, model_state)
        _warn_casts(path, dtypes, model_state)
        # Only the parameters the saving optimizer held state for: none where it was saved before the first step
        # (_state_without_stepping), not those that never had a gradient. get_state_dict made state for every one.
        optim_state = {**optim_state, "state": {name: v for name, v in optim_state["state"].items()
                                                if f"optim.state.{name}" in saved_state}}
        _check_optimizer_state(path, optim_state["state"], saved_state)
    except Exception as e:  # noqa: BLE001  any failure: raised on every rank together, below
        error = e
    _raise_together(error)
    # the saving optimizer's settings alone first (a few values): refused after the whole load, the model and
    # optimizer already held the checkpoint's tensors, which DCP writes in place
    saved_groups = copy.deepcopy(optim_state["param_groups"])
    _load_from_dcp({"optim": {"param_groups": saved_groups}}, path)
    try:
        _check_optimizer_parameters(path, [list(group["params"]) for group in optim_state["param_groups"]],
                                    [list(group["params"]) for group in saved_groups])
        _check_optimizer_kind(path, optimizer.param_groups, saved_groups)
    except Exception as e:  # noqa: BLE001  any failure: raised on every rank together, below
        error = e
    _raise_together(error)
    state = {"model": model_state, "optim": optim_state}
    _load_from_dcp(state, path)
    set_model_state_dict(model, state["model"])
    # not strict: the parameters without saved state start without, as the saving optimizer's would have stepped
    set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))


def _load_from_dcp(state: dict, path: str) -> None:
    """DCP's load of ``state``'s entries from checkpoint ``path`` (collective), in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as e:  # a BaseException: an `except Exception` would miss it
        last = next((line for line in reversed(str(e).splitlines()) if line.strip()), type(e).__name__)
        raise ValueError(f"the checkpoint {path} does not fit this model and optimizer: {last.strip()}") from None


def _raise_together(error: Exception | None) -> None:
    """Raise on every rank where any rank's own check of its model or optimizer failed
    (collective): that rank its own error, the others naming it. Refused on one rank alone,
    its peers went on into DCP's collectives and waited there, or loaded and trained on."""
    rank, world = _rank_world()
    if world > 1:
        every: list[str | None] = [None] * world
        dist.all_gather_object(every, None if error is None else str(error))
        failed = [(r, message) for r, message in enumerate(every) if message is not None]
        if error is None and failed:
            other, message = failed[0]
            raise ValueError(f"rank {other} cannot load this checkpoint: {message}")
    if error is not None:
        raise error


def _problems(path: str, step: int, run: dict[str, Any] | None = None) -> list[str]:
    """Why checkpoint ``step`` at ``path`` cannot be used (collective): no intact manifest, or
    files that differ from it; none where it verifies. A sealed checkpoint of other ``run``
    settings (where given) is refused, before its files are read."""
    manifest, why = _on_rank0(partial(_read_manifest, path, step))
    if manifest is None:
        return [why]
    if run is not None:
        _refuse_other_run(path, manifest["run"], run)
    return _file_problems(path, manifest["files"])


def _verified(path: str) -> str:
    """``path``, once its manifest and files are found intact as ``find_resumable`` checks them
    (collective); refused otherwise, naming why."""
    _on_rank0(partial(_check_is_directory, path))
    match = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
    if match is None:
        raise ValueError(f"{path!r} is not a checkpoint (a step-<N> directory save() wrote); pass one, or the "
                         f"checkpoint find_resumable returns")
    problems = _problems(path, int(match[1]))
    if problems:
        raise ValueError(f"the checkpoint {path} cannot be loaded: {'; '.join(problems)}; load another (find_resumable "
                         f"returns the newest that verifies)")
    return path


# optimizer settings that change what its state means: loading state saved under another value once ran on
# (AdamW's decoupled weight decay in an Adam) or failed at the next step (amsgrad's missing max_exp_avg_sq)
_OPTIMIZER_KIND = ("amsgrad", "decoupled_weight_decay", "maximize", "nesterov", "centered")


def _check_optimizer_state(path: str, here: dict[str, dict], saved: set[str]) -> None:
    """Refuse optimizer state of other names than this optimizer's (another kind, or amsgrad set
    otherwise), naming them: the saved names it does not ask for were dropped unseen."""
    below: dict[str, set[str]] = {}  # each saved prefix -> the names one level below it
    for key in saved:
        parent, _, child = key.rpartition(".")
        below.setdefault(parent, set()).add(child)
    for name, entries in here.items():
        saved_names = below.get(f"optim.state.{name}", set())
        if saved_names != set(entries):
            only_saved, only_here = sorted(saved_names - set(entries)), sorted(set(entries) - saved_names)
            what = "; ".join(f"{where} {', '.join(names)}" for names, where in
                             ((only_saved, "only the checkpoint's holds"), (only_here, "only this one's holds"))
                             if names)
            raise ValueError(f"the checkpoint {path} was saved by an optimizer of another kind or setting: its state "
                             f"for {name} differs ({what}); make the optimizer the saving run made")


def _check_optimizer_kind(path: str, here: list[dict], saved: list[dict]) -> None:
    for mine, theirs in zip(here, saved):
        differ = [f"{key}={theirs[key]!r} there, {mine[key]!r} here" for key in _OPTIMIZER_KIND
                  if key in mine and key in theirs and mine[key] != theirs[key]]
        if differ:
            raise ValueError(f"the checkpoint {path} was saved by an optimizer of another kind or setting "
                             f"({', '.join(differ)}); make the optimizer the saving run made")


def _warn_casts(path: str, saved: dict[str, torch.dtype], model_state: dict) -> None:
    """Warn where the checkpoint holds a parameter in another dtype than the model's: loaded cast."""
    cast = [f"{name} {saved[name]} there, {value.dtype} here" for name, value in model_state.items()
            if isinstance(value, torch.Tensor) and name in saved and saved[name] != value.dtype]
    if cast:
        warnings.warn(f"the checkpoint {path} holds {len(cast)} entries in other dtypes than the model's, loaded as "
                      f"the model's ({_first(cast)})", stacklevel=3)


def _check_is_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise ValueError(f"checkpoint directory {directory!r} {what}; pass the directory a run saved to")


def _saved_entries(path: str) -> tuple[dict[str, tuple[int, ...] | None], set[str], dict[str, torch.dtype]]:
    """{entry name: its saved shape (None: not a tensor)} of the model in checkpoint ``path``;
    its optimizer state's entries and every dotted prefix of them: "optim.state.<parameter>" is
    among them where it holds state for that parameter (its entries are
    "optim.state.<parameter>.<state name>", or deeper where an optimizer nests its state);
    and {entry name: its saved dtype} of the model's tensors."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model = {key.removeprefix("model."): entry for key, entry in saved.items() if key.startswith("model.")}
    parameters = {name: tuple(entry.size) if hasattr(entry, "size") else None for name, entry in model.items()}
    dtypes = {name: entry.properties.dtype for name, entry in model.items() if hasattr(entry, "properties")}
    parts = [key.split(".") for key in saved if key.startswith("optim.state.")]
    return parameters, {".".join(names[:i]) for names in parts for i in range(3, len(names) + 1)}, dtypes


def _check_optimizer_parameters(path: str, here: list[list[str]], saved: list[list[str]]) -> None:
    """Refuse an optimizer over other parameters than the saving one's, naming them: loaded
    without a complaint, a parameter the saving optimizer did not hold started afresh. The
    order within a group does not matter: torch loads the state by parameter name."""
    if [sorted(group) for group in here] == [sorted(group) for group in saved]:
        return
    only_here = sorted({n for g in here for n in g} - {n for g in saved for n in g})
    only_saved = sorted({n for g in saved for n in g} - {n for g in here for n in g})
    what = "; ".join(f"{len(names)} only {where} ({_first(names)})" for names, where in
                     ((only_saved, "the checkpoint's optimizer holds"), (only_here, "this optimizer holds"))
                     if names) or "the same parameters, grouped otherwise"
    raise ValueError(f"the checkpoint {path} was saved by an optimizer over other parameters than this one's: {what}; "
                     f"make the optimizer over the parameters (and in the groups) the saving run's was")


def _check_parameters(path: str, saved: dict[str, tuple[int, ...] | None], model_state: dict) -> None:
    """Refuse a model whose parameters are not the checkpoint's, by name and shape: the
    model's entries named as DCP flattens them (a module's dict ``_extra_state`` is saved
    as one entry per key)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({"model": model_state})
    here = {name.removeprefix("model."): tuple(value.shape) if isinstance(value, torch.Tensor) else None
            for name, value in flat.items()}
    problems = []
    for what, names in (("only the checkpoint holds", sorted(set(saved) - set(here))),
                        ("only the model has", sorted(set(here) - set(saved)))):
        if names:
            problems.append(f"{len(names)} {'entry' if len(names) == 1 else 'entries'} {what} ({_first(names)})")
    reshaped = [f"{name} {saved[name]} there, {here[name]} here" for name in sorted(set(saved) & set(here))
                if saved[name] != here[name]]
    if reshaped:
        problems.append(f"{len(reshaped)} of other shapes ({_first(reshaped)})")
    if problems:
        raise ValueError(f"the checkpoint {path} is of another model: {'; '.join(problems)}; load it into a "
                         f"model shaped as the one that saved it")


def _first(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (", ..." if len(items) > n else "")


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _on_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` evaluated on rank 0 only; every rank returns its result, or raises its error."""
    rank, world = _rank_world()
    box: list = [None]
    if rank == 0:
        try:
            box[0] = (fn(), None)
        except Exception as e:  # any error: the other ranks are about to wait for this broadcast
            box[0] = (None, e)
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    value, error = box[0]
    if error is not None:
        raise error
    return value


def _digests(path: str, names: list[str]) -> dict[str, dict | str]:
    """{name: {"bytes", "sha256"}, or why it can't be read}, each rank hashing every world-th file."""
    rank, world = _rank_world()
    mine: dict[str, dict | str] = {}
    for name in names[rank::world]:
        try:
            mine[name] = _digest(os.path.join(path, name))
        except FileNotFoundError:
            mine[name] = "missing"
        except OSError as e:
            mine[name] = f"unreadable ({e.strerror or e})"
    shares = [mine]
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, mine)
    return {name: d for share in shares for name, d in share.items()}


def _digest(file: str) -> dict:
    sha, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def _file_problems(path: str, files: dict[str, dict]) -> list[str]:
    """What differs between the files in ``path`` and the manifest's record of them (collective)."""
    digests = _digests(path, sorted(files))
    problems = []
    for name in sorted(files):
        want, got = files[name], digests[name]
        if isinstance(got, str):
            problems.append(f"{name} is {got}")
        elif got["bytes"] != want["bytes"]:
            problems.append(f"{name} has {got['bytes']} bytes, the manifest says {want['bytes']} (truncated or "
                            "overwritten)")
        elif got["sha256"] != want["sha256"]:
            problems.append(f"{name} does not match its sha256 in the manifest (corrupted)")
    return problems


def _read_manifest(path: str, step: int) -> tuple[dict | None, str | None]:
    """(manifest, None) if ``path`` has an intact manifest for ``step``, else (None, why not)."""
    if not _is_sealed(path):
        return None, _UNSEALED
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        return None, f"{MANIFEST} is unreadable ({e})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"{MANIFEST} is not a {FORMAT} manifest"
    checksum = manifest.pop("checksum", None)
    if checksum != _checksum(manifest):
        return None, f"{MANIFEST} does not match its own checksum (corrupted)"
    if manifest["step"] != step:
        return None, f"{MANIFEST} is for step {manifest['step']}, not {step}"
    return manifest, None


def _is_sealed(path: str) -> bool:
    """Whether checkpoint directory ``path`` got its manifest (intact or not): else a save cut short."""
    return os.path.lexists(os.path.join(path, MANIFEST))


def _refuse_other_run(path: str, saved: dict[str, Any], wanted: dict[str, Any]) -> None:
    if saved != wanted:
        raise ValueError(f"--resume: {path} was saved by a run with other settings ({_differences(saved, wanted)}), "
                         "so resuming it would not continue that run; pass the same values, or a new "
                         "--checkpoint-dir to start a new run")


def _differences(saved: dict[str, Any], wanted: dict[str, Any]) -> str:
    return "; ".join(f"{key} {wanted[key]!r} here, none there (saved before ctxpar recorded it)" if key not in saved
                     else f"{key} {saved.get(key)!r} there, {wanted.get(key)!r} here"
                     for key in sorted(set(saved) | set(wanted)) if saved.get(key) != wanted.get(key))


def _checked_run(run: Any) -> dict[str, Any]:
    """``run`` as JSON reads it back, refused where it is not a dict JSON can hold (checked
    before anything is written: once a TypeError after the data files, leaving them unsealed)."""
    if not isinstance(run, dict):
        raise ValueError(f"checkpoint run must be a dict of the settings a continuation must share, got "
                         f"{type(run).__name__}")
    try:
        return _as_json(run)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint run must hold what JSON can (numbers, strings, lists, dicts): {e}") from None


def _claim(directory: str, path: str, step: int, run: dict[str, Any]) -> int | None:
    """Lock ``directory`` for this run's save of ``step`` at ``path`` and clear what is there;
    return the lock's descriptor (closing it releases the lock, as the process's end does),
    None where the file system has no locks."""
    _refuse_what_is_no_directory(directory, "checkpoint directory")
    os.makedirs(directory, exist_ok=True)
    save_lock = os.path.join(directory, SAVE_LOCK)
    try:
        # None on a file system without locks: saves go unlocked there, as they did before the
        # lock; a sealed checkpoint of another run is still refused below
        lock = _flock(save_lock)
    except BlockingIOError:
        raise ValueError(f"another process is saving a checkpoint into {directory} right now; give each run a "
                         f"--checkpoint-dir of its own") from None
    except OSError as e:  # not the step's path, which nothing was written to
        raise ValueError(f"the checkpoint directory's save lock {save_lock} cannot be opened or locked "
                         f"({e.strerror or e}); remove it if it is no file, or make it writable") from None
    try:
        manifest, _ = _read_manifest(path, step)
        if manifest is not None and manifest["run"] != run:
            raise ValueError(f"{path} holds a checkpoint sealed by another run ({_differences(manifest['run'], run)})"
                             f", which is not replaced; give each run a --checkpoint-dir of its own")
        _remove(path)
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise
    return lock


def _write_atomically(path: str, manifest: dict) -> None:
    # the data files' directory entries must be durable before a manifest vouches for them
    _fsync_directory(path)
    file = os.path.join(path, MANIFEST)
    with open(file + ".tmp", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(file + ".tmp", file)
    _fsync_directory(path)


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        # manifest first: a run killed while removing leaves a partial checkpoint, never a sealed one
        if os.path.lexists(os.path.join(path, MANIFEST)):
            os.remove(os.path.join(path, MANIFEST))
        shutil.rmtree(path)


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples as lists), so saved and current settings compare equal."""
    return json.loads(json.dumps(value))
