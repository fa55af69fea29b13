"""Checkpoints: resume only from what was saved completely and reads back intact; never train on a non-finite loss.

One real run is killed with SIGKILL while it saves; its directory (complete checkpoints
followed by the one the kill interrupted) is the material the other tests corrupt.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ctxpar import checkpoint
from ctxpar.train import TrainConfig, run_train, train_reference

COMMON = dict(nproc=2, seq=128, model="tiny", progress=False)
CLI_COMMON = ["--nproc", "2", "--seq", "128", "--model", "tiny", "--no-progress"]
SETTINGS = TrainConfig(**COMMON).checkpoint_settings()


SAVES = ("steps differ", "directories differ", "the manifest cannot be written", "one directory")


def save_each_way(rank: int, world: int, root: str) -> dict[str, str]:
    """Each rank saves the tiny model, in a directory of ``root`` per way of ``SAVES``: at step 3 +
    rank ("steps differ"); at step 3 into a directory of its own ("directories differ"); with the
    disk full as the manifest is written; into one directory that rank 1 spells relative to its
    working directory, through a symbolic link to its parent ("one directory", last: it changes
    rank 1's working directory). What each save said."""
    from ctxpar.models import Transformer, get_config

    said = {}
    for how in SAVES:
        model = Transformer(get_config("tiny"))
        optimizer = torch.optim.AdamW(model.parameters())
        directory = os.path.join(root, how.replace(" ", "-"), "ckpt")
        place, step = directory, 3
        write_manifest = checkpoint._write_atomically
        if how == "steps differ":
            step += rank
        elif how == "directories differ":
            place = os.path.join(directory, f"rank{rank}")
        elif how == "the manifest cannot be written":
            def full(path, manifest):
                raise OSError(28, "No space left on device")
            checkpoint._write_atomically = full
        elif rank == 1:
            parent = os.path.dirname(directory)
            os.makedirs(parent, exist_ok=True)
            os.chdir(parent)
            os.symlink(parent, "link")  # inside the test's own directory
            place = os.path.join("link", os.path.basename(directory))
        try:
            checkpoint.save(model, optimizer, place, step, SETTINGS)
            said[how] = "saved"
        except (ValueError, OSError) as e:
            said[how] = str(e)
        finally:
            checkpoint._write_atomically = write_manifest
    return said


@pytest.fixture(scope="module")
def saved_each_way(tmp_path_factory) -> tuple[str, list[dict[str, str]]]:
    from ctxpar.launch import run_local

    root = str(tmp_path_factory.mktemp("saves"))
    return root, run_local(save_each_way, 2, (root,), timeout_s=60)


def ctxpar_train(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ctxpar.cli", "train", *CLI_COMMON, *args], **popen)


def manifest_of(step_dir) -> bool:
    return os.path.exists(os.path.join(step_dir, checkpoint.MANIFEST))


def flip_bit(file, offset: int, mask: int = 0x10) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def stop_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGSTOP the process group and return once each of its processes has stopped (a signal
    is delivered asynchronously: a process may run on for a moment after killpg returns)."""
    os.killpg(pgid, signal.SIGSTOP)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, pgrp
            except OSError:  # gone meanwhile
                continue
            if int(fields[2]) == pgid:
                states.append(fields[0])
        if all(state in "TtZX" for state in states):
            return
        time.sleep(0.0005)
    raise TimeoutError(f"process group {pgid} did not stop within {timeout} s of SIGSTOP")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> tuple[str, int]:
    """(directory, N) of a run SIGKILLed while saving step N >= 3, after steps 1..N-1 were saved whole.

    The directory is polled every half millisecond; the moment DCP has begun a data file of
    ``step-N``, the run is stopped, and killed if no manifest is there yet. The rest of a save
    (the data, DCP's metadata round, fsyncs, hashing) takes milliseconds, so the kill
    lands inside it, usually with a data file cut short; if a save ever completes between
    two polls, the next one is the target.
    """
    directory = str(tmp_path_factory.mktemp("killed") / "ckpt")
    with open(tmp_path_factory.mktemp("log") / "stderr", "w+") as log:
        proc = ctxpar_train("--steps", "1000", "--save-every", "1", "--checkpoint-dir", directory,
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline, target, caught = time.monotonic() + 120, 3, False
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                path = checkpoint.step_path(directory, target)
                names = os.listdir(path) if os.path.isdir(path) else []
                if any(name.endswith(".distcp") for name in names):
                    try:
                        stop_group(proc.pid)  # frozen, so that the manifest cannot appear between a look and the kill
                    except ProcessLookupError:  # the run has just ended: the loop's condition sees it
                        continue
                    if not manifest_of(path):
                        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks at once
                        caught = True
                        break
                    os.killpg(proc.pid, signal.SIGCONT)
                    target += 1  # this save finished between two polls: wait for the next
                time.sleep(0.0005)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        assert caught, f"no save of step >= 3 was caught within 120 s; the run said:\n{log.read()}"
    return directory, target


def test_a_run_killed_while_saving_leaves_a_partial_checkpoint_that_resume_skips(killed_run) -> None:
    directory, n = killed_run
    assert not manifest_of(checkpoint.step_path(directory, n)), "the kill must land before the manifest"
    assert all(manifest_of(checkpoint.step_path(directory, s)) for s in range(1, n))
    found = checkpoint.find_resumable(directory, SETTINGS)
    assert found.step == n - 1
    assert [(s.path, s.reason) for s in found.skipped] == [
        (checkpoint.step_path(directory, n), "no manifest.json: incomplete, the run stopped while saving it")]


def test_resume_falls_back_past_a_bit_flip_and_a_partial_save_and_names_them(killed_run, tmp_path, capfd) -> None:
    directory = str(tmp_path / "ckpt")
    shutil.copytree(killed_run[0], directory)
    n = killed_run[1]
    corrupt = checkpoint.step_path(directory, n - 1)
    flip_bit(os.path.join(corrupt, "__1_0.distcp"), 1000)  # one bit in rank 1's tensor data
    os.mkdir(os.path.join(directory, "step-foo"))  # strays: crashed the old int() parse
    open(os.path.join(directory, "notes.txt"), "w").close()

    # another layout and strategy than the run that saved: DCP reshards, CP computes the same loss
    cfg = TrainConfig(steps=n, resume=True, checkpoint_dir=directory, layout="striped", strategy="allgather",
                      **COMMON)
    report = run_train(cfg)

    assert report["start_step"] == n - 2 and report["resumed_from"] == checkpoint.step_path(directory, n - 2)
    uninterrupted = train_reference(TrainConfig(steps=n, **COMMON))["loss"]
    torch.testing.assert_close(torch.tensor(report["loss"]), torch.tensor(uninterrupted[n - 2:]), rtol=1e-4, atol=0)
    skipped = {os.path.basename(s["path"]): s["reason"] for s in report["skipped_checkpoints"]}
    assert skipped == {
        f"step-{n:06d}": "no manifest.json: incomplete, the run stopped while saving it",
        f"step-{n - 1:06d}": "__1_0.distcp does not match its sha256 in the manifest (corrupted)",
        "step-foo": "not a checkpoint (expected step-<number> directories)",
        "notes.txt": "not a checkpoint (expected step-<number> directories)",
    }
    err = capfd.readouterr().err
    assert f"--resume skipped {corrupt}: __1_0.distcp does not match its sha256" in err


def test_resume_refuses_when_no_checkpoint_verifies_and_names_each_fault(killed_run, tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    shutil.copytree(killed_run[0], directory)
    n = killed_run[1]
    first, second = checkpoint.step_path(directory, 1), checkpoint.step_path(directory, 2)
    garbled, renamed = checkpoint.step_path(directory, 50), checkpoint.step_path(directory, 60)
    shutil.copytree(second, garbled)
    shutil.copytree(first, renamed)
    for step in range(3, n):  # whole checkpoints, there only if a save finished between two polls
        shutil.rmtree(checkpoint.step_path(directory, step))
    data = os.path.join(first, "__0_0.distcp")
    size = os.path.getsize(data)
    os.truncate(data, size // 2)
    os.remove(os.path.join(second, ".metadata"))
    manifest = os.path.join(garbled, checkpoint.MANIFEST)
    with open(manifest, "rb") as f:
        at = f.read().index(b'"checksum": "') + len(b'"checksum": "')
    flip_bit(manifest, at, mask=0x01)  # still valid JSON: one hex digit for another
    open(os.path.join(directory, "step-000099"), "w").close()  # a file with a checkpoint's name

    with pytest.raises(ValueError, match="no complete, verified checkpoint") as info:
        checkpoint.find_resumable(directory, SETTINGS)
    reasons = dict(line.strip().split(": ", 1) for line in str(info.value).splitlines()[1:-1])
    assert reasons == {
        checkpoint.step_path(directory, 99): "a file, not a checkpoint directory",
        renamed: "manifest.json is for step 1, not 60",
        garbled: "manifest.json does not match its own checksum (corrupted)",
        checkpoint.step_path(directory, n): "no manifest.json: incomplete, the run stopped while saving it",
        second: ".metadata is missing",
        first: f"__0_0.distcp has {size // 2} bytes, the manifest says {size} (truncated or overwritten)",
    }


def test_the_checkpoint_writer_raises_the_os_error_it_finds_message_and_all(tmp_path, monkeypatch) -> None:
    """torch hides the OSError of a failed write as the cause of its own; the writer raises it. One
    without an errno (a message alone) once came out as '[Errno None] None'."""
    import torch.distributed.checkpoint as dcp

    for cause, said in ((OSError(28, "No space left on device", "x"), "No space left on device"),
                        (OSError("the quota of this user is spent"), "the quota of this user is spent")):
        def failing(self, plan, planner, cause=cause):
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") from cause

        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", failing)
        with pytest.raises(OSError, match=re.escape(said)) as e:
            checkpoint._writer_class()(str(tmp_path)).write_data(None, None)
        assert "None" not in str(e.value)


def test_every_byte_of_a_checkpoints_files_is_verified(tmp_path, monkeypatch) -> None:
    """Files are read in chunks (4 MiB, made 4 KiB here: the tiny model's files hold one): a bit
    flipped past the first chunk is found, and so are bytes appended, named by the size."""
    monkeypatch.setattr(checkpoint, "_READ_BYTES", 4096)
    model, optimizer = _tiny_model_and_adamw()
    _train(model, optimizer, 1)
    directory = str(tmp_path / "ckpt")
    path = checkpoint.save(model, optimizer, directory, 1, SETTINGS)
    data = max((os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp")), key=os.path.getsize)
    name, size = os.path.basename(data), os.path.getsize(data)
    assert size > 100 * 4096
    flip_bit(data, size - 1000)
    with pytest.raises(ValueError, match=re.escape(f"{name} does not match its sha256 in the manifest (corrupted)")):
        checkpoint.find_resumable(directory, SETTINGS)
    flip_bit(data, size - 1000)  # flipped back
    assert checkpoint.find_resumable(directory, SETTINGS).step == 1
    with open(data, "ab") as grown:
        grown.write(bytes(100))
    with pytest.raises(ValueError, match=re.escape(f"{name} has {size + 100} bytes, the manifest says {size} "
                                                   "(truncated or overwritten)")):
        checkpoint.find_resumable(directory, SETTINGS)


def test_a_directory_of_saves_cut_short_takes_a_new_run(tmp_path) -> None:
    """A directory holding only a save cut short (its first save killed, or out of space): a new
    run there was told it would overwrite checkpoints and to add --resume, and --resume to start a
    new run without it: circular. Saves cut short are not checkpoints; a new run's save replaces them."""
    directory = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(directory, "step-foo"))  # a stray entry alone: nothing was cut short
    with pytest.raises(ValueError, match=re.escape("directories)\nstart a new run without --resume (in an empty")):
        checkpoint.find_resumable(directory, SETTINGS)
    os.rmdir(os.path.join(directory, "step-foo"))
    cut_short = checkpoint.step_path(directory, 2)
    os.makedirs(cut_short)
    open(os.path.join(cut_short, "__0_0.distcp"), "wb").close()
    checkpoint.check_directory(directory, resuming=False)  # no refusal
    with pytest.raises(ValueError, match=re.escape(
            f"no complete, verified checkpoint in {directory!r}:\n  {cut_short}: no manifest.json: incomplete, the "
            "run stopped while saving it\nnone was sealed: start a new run here, without --resume (its saves replace "
            "those cut short)")):
        checkpoint.find_resumable(directory, SETTINGS)
    sealed = checkpoint.step_path(directory, 1)
    os.makedirs(sealed)
    checkpoint.write_manifest(sealed, 1, SETTINGS)
    with pytest.raises(ValueError, match=re.escape("already holds checkpoints (newest: step-000001) that this new run "
                                                   "would overwrite")):
        checkpoint.check_directory(directory, resuming=False)
    with open(os.path.join(cut_short, "__3_0.distcp"), "wb") as stray:  # of a save on 4 ranks cut short
        stray.write(b"x" * 100)
    model, optimizer = _tiny_model_and_adamw()
    checkpoint.save(model, optimizer, directory, 2, SETTINGS)  # replaces the save cut short, strays and all
    assert sorted(os.listdir(cut_short)) == [".metadata", "__0_0.distcp", checkpoint.MANIFEST]


def test_resume_refuses_a_checkpoint_of_other_settings_and_names_the_difference(killed_run) -> None:
    directory, n = killed_run
    other = TrainConfig(lr=1e-3, dp=2, **dict(COMMON, nproc=4, layout="striped")).checkpoint_settings()
    with pytest.raises(ValueError, match=r"--lr 0\.003 there, 0\.001 here; global batch \(--batch x --dp\) 1 "
                                         r"there, 2 here\), so resuming it would not continue that run"):
        checkpoint.find_resumable(directory, other)
    # the CP degree, layout and strategy may change: DCP reshards, and CP computes the same loss
    reshaped = TrainConfig(**dict(COMMON, nproc=4, layout="striped", strategy="allgather")).checkpoint_settings()
    assert checkpoint.find_resumable(directory, reshaped).step == n - 1


def test_resume_refuses_a_checkpoint_of_the_recall_data_before_its_stream_was_named(tmp_path) -> None:
    """Checkpoints saved before RecallTask.STREAM (recall/2) drew their batches otherwise: a resume
    would not continue their run. Their settings lack the entry; the refusal says so."""
    old = {key: value for key, value in SETTINGS.items() if key != "data stream"}
    path = checkpoint.step_path(str(tmp_path), 1)
    os.makedirs(path)
    checkpoint.write_manifest(path, 1, old)
    with pytest.raises(ValueError, match=r"data stream 'recall/2' here, none there \(saved before ctxpar recorded "
                                         r"it\)\), so resuming it would not continue that run"):
        checkpoint.find_resumable(str(tmp_path), SETTINGS)


def test_a_non_finite_loss_stops_training_with_the_step_and_a_non_zero_exit(killed_run, tmp_path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    # a checkpoint whose weights hold NaN but whose manifest is valid: what verification can't catch
    directory = tmp_path / "ckpt"
    dcp_to_torch_save(checkpoint.step_path(killed_run[0], 1), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    state["model"]["norm.weight"].fill_(float("nan"))
    torch.save(state, tmp_path / "state.pt")
    torch_save_to_dcp(tmp_path / "state.pt", checkpoint.step_path(str(directory), 1))
    checkpoint.write_manifest(checkpoint.step_path(str(directory), 1), 1, SETTINGS)

    proc = ctxpar_train("--steps", "3", "--resume", "--save-every", "1", "--checkpoint-dir", str(directory),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    # a stop the library makes on purpose reads as its message, once, not as a worker's traceback
    assert re.search(r"ctxpar train: error: ranks? [0-9, ]+ stopped: step 2: the loss is nan", err), err
    assert "Traceback" not in err and err.count("the loss is nan") == 1, err
    assert not os.path.exists(checkpoint.step_path(str(directory), 2)), "nothing of the NaN step is saved"


@pytest.mark.parametrize("case", ["file-size limit", "save lock held"])
def test_a_save_that_fails_or_is_refused_stops_the_run_with_one_message(case: str, tmp_path) -> None:
    """A save the OS refuses (here a file-size limit: no root needed, unlike a full disk) named only
    torch's CheckpointException in its headline ("ranks:dict_keys([0, 1])", under `ulimit -f`
    "[enforce fail at inline_container.cc:672] unexpected pos") over 40-60 lines of traceback; a
    refusal inside the ranks (another process saving into the directory) read as "rank 1 failed:"
    and a traceback, for each rank. Now the OS's error or the refusal, once, and what to do."""
    import fcntl
    import resource

    directory = tmp_path / "ckpt"
    directory.mkdir()
    limit = 100_000  # bytes: below a rank's share of the tiny model's checkpoint (about 700 kB)

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    with open(directory / checkpoint.SAVE_LOCK, "w") as lock:
        if case == "save lock held":  # as another run's save holds it
            fcntl.flock(lock, fcntl.LOCK_EX)
        proc = ctxpar_train("--steps", "1", "--checkpoint-dir", str(directory), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=limit_file_size if case == "file-size limit" else None)
        out, err = proc.communicate(timeout=120)
    said = {
        "file-size limit": f"checkpoint step 1 could not be written to {directory}/step-000001 (File too large); what "
                           "was written of it is left unsealed (no manifest.json), which resume skips. Fix that (free "
                           "space, a file-size limit, write permission), then run the same command again: it starts "
                           "over, replacing what was written",
        "save lock held": f"step 1: another process is saving a checkpoint into {directory} right now; give each run a "
                          "--checkpoint-dir of its own",
    }[case]
    assert proc.returncode == 1, out
    assert err.splitlines()[1:] == [f"ctxpar train: error: ranks 0, 1 stopped: {said}"], err
    assert not manifest_of(checkpoint.step_path(str(directory), 1))


TRAIN_WHOSE_SECOND_SAVE_FAILS = """
from ctxpar import checkpoint, cli

save = checkpoint.save
def save_or_fail(model, optimizer, directory, step, *rest):
    if step == 2:
        raise OSError(28, "No space left on device")
    save(model, optimizer, directory, step, *rest)
checkpoint.save = save_or_fail  # in the parent and in each rank, which imports this script
if __name__ == "__main__":
    cli.entry()
"""


def test_a_failed_save_names_the_newest_checkpoint_sealed_before_it(tmp_path) -> None:
    """Step 1 saved and sealed, step 2's save failed: the way on is from step 1 (taken as
    sealed before its save was done, it named step 2, which resume skips), also in a run
    resumed from step 1."""
    script = tmp_path / "train_script.py"
    script.write_text(TRAIN_WHOSE_SECOND_SAVE_FAILS)
    directory = tmp_path / "ckpt"
    for resume in ([], ["--resume"]):  # resumed from step 1, its step 2 failing again: step 1 is still the way on
        proc = subprocess.run([sys.executable, str(script), "train", *CLI_COMMON, "--steps", "3", "--save-every", "1",
                               "--checkpoint-dir", str(directory), *resume], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "No space left on device. Fix that (free space, a file-size limit, write permission), then run the " \
               f"same command{'' if resume else ' with --resume'}: it continues from step 1, whose checkpoint is " \
               "sealed" in proc.stderr, (resume, proc.stderr)
        assert manifest_of(checkpoint.step_path(str(directory), 1))


@pytest.mark.parametrize("case", ["negative save-every", "dir is a file", "dir not writable", "stray dir only",
                                  "new run over old checkpoints", "dir not writable, no --save-every",
                                  "new run over old checkpoints, no --save-every"])
def test_checkpoint_flags_are_refused_before_any_rank_starts(case: str, tmp_path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    (tmp_path / "stray" / "step-foo").mkdir(parents=True)
    (tmp_path / "used" / "step-000004").mkdir(parents=True)
    checkpoint.write_manifest(str(tmp_path / "used" / "step-000004"), 4, SETTINGS)  # sealed: not a save cut short
    cfg, match = {
        "negative save-every": (dict(save_every=-1, checkpoint_dir=str(tmp_path)), "--save-every -1 must be >= 0"),
        "dir is a file": (dict(save_every=1, checkpoint_dir=str(a_file)), "is a file, not a directory"),
        "dir not writable": (dict(save_every=1, checkpoint_dir=str(a_file / "ckpt")), "is not writable"),
        "stray dir only": (dict(resume=True, checkpoint_dir=str(tmp_path / "stray")),
                           r"no step-<number> checkpoint directory .* \(ignored: step-foo\)"),
        "new run over old checkpoints": (dict(save_every=1, checkpoint_dir=str(tmp_path / "used")),
                                         "already holds checkpoints .*add --resume"),
        # a --checkpoint-dir always gets the last step, whatever --save-every says
        "dir not writable, no --save-every": (dict(checkpoint_dir=str(a_file / "ckpt")),
                                              "is not writable .*drop --checkpoint-dir"),
        "new run over old checkpoints, no --save-every": (dict(checkpoint_dir=str(tmp_path / "used")),
                                                          "already holds checkpoints .*add --resume"),
    }[case]
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        run_train(TrainConfig(steps=2, **COMMON, **cfg))
    assert time.monotonic() - started < 5, "refused before spawning any rank"


def test_a_checkpoint_dir_without_room_for_one_checkpoint_is_refused_before_any_rank_starts(tmp_path,
                                                                                          monkeypatch) -> None:
    """A file system with (nearly) no space passed the check (an empty probe file needs none): the
    run trained every step, then failed at its save, losing them. Free space as os.statvfs says."""
    import types

    from ctxpar import launch

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started before the directory was refused")

    monkeypatch.setattr(launch, "run_local", refuse)
    monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=10, f_frsize=4096))
    cfg = TrainConfig(steps=2, checkpoint_dir=str(tmp_path / "ckpt"), **COMMON)
    assert cfg.checkpoint_bytes() == 12 * 106_816  # the tiny model's parameters, AdamW's two moments, float32
    with pytest.raises(ValueError, match=re.escape(
            f"--checkpoint-dir {cfg.checkpoint_dir!r} has 40 KiB free, less than one checkpoint of this run takes (at "
            "least 1.222 MiB: the model's parameters and the optimizer's state); free space there, or pass a directory "
            "on a file system with room")):
        run_train(cfg)
    sealed = checkpoint.step_path(cfg.checkpoint_dir, 1)
    os.makedirs(sealed)
    checkpoint.write_manifest(sealed, 1, SETTINGS)
    with pytest.raises(ValueError, match="has 40 KiB free, less than one checkpoint"):  # a resumed run saves too
        checkpoint.check_directory(cfg.checkpoint_dir, resuming=True, checkpoint_bytes=cfg.checkpoint_bytes())


def test_resume_values_that_do_not_fit_the_checkpoint_are_refused_before_any_rank_starts(
        killed_run, tmp_path, monkeypatch, capsys) -> None:
    """Another run's settings, or --steps not beyond the newest verified checkpoint: exit 2
    naming the flag, read from the checkpoint's manifest before any rank starts."""
    from ctxpar import launch
    from ctxpar.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started before the bad value was refused")

    monkeypatch.setattr(launch, "run_local", refuse)
    directory = str(tmp_path / "ckpt")
    shutil.copytree(killed_run[0], directory)
    n = killed_run[1]  # step-N is partial: the newest verified checkpoint is N - 1
    after = str(n + 1)
    cases = [
        (("--steps", after, "--seed", "1"), "(--seed 0 there, 1 here)"),
        (("--steps", after, "--lr", "0.001"), "(--lr 0.003 there, 0.001 here)"),
        (("--steps", after, "--seq", "256"), "(--seq 128 there, 256 here)"),
        (("--steps", after, "--batch", "2"), "(global batch (--batch x --dp) 1 there, 2 here)"),
        (("--steps", after, "--model", "small"), "(--model 'tiny (layers=2, "),
        (("--steps", str(n - 1)), f"the newest verified checkpoint is at step {n - 1}, nothing left of --steps "
                                  f"{n - 1}"),
        (("--steps", "1"), f"the newest verified checkpoint is at step {n - 1}, nothing left of --steps 1"),
    ]
    wrong = []
    for args, expected in cases:
        status = main(["train", *CLI_COMMON, "--resume", "--checkpoint-dir", directory, *args])
        err = capsys.readouterr().err
        if status != 2 or expected not in err or "ctxpar train: error: --resume: " not in err:
            wrong.append(f"{' '.join(args)} -> status {status}: {err.strip()!r}")
    assert not wrong, "\n".join(wrong)


def test_the_checkpoint_api_refuses_what_would_lose_or_mix_work(tmp_path) -> None:
    """In one process, as a user's own training loop calls it: each of these once passed (a
    smaller model loaded part of a checkpoint; a second run's save replaced the first's, or
    mixed files with it), saved what resume can never find (step -1), or raised torch's own
    error (a CheckpointException, which `except Exception` does not catch)."""
    import dataclasses
    import fcntl

    from ctxpar.models import Transformer, get_config

    def model_and_optimizer(**changes):
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(get_config("tiny"), **changes))
        return model, torch.optim.AdamW(model.parameters())

    model, optimizer = model_and_optimizer()
    model(torch.zeros(1, 4, dtype=torch.int64)).sum().backward()
    optimizer.step()  # the checkpoint holds optimizer state for the SGD below to not fit
    optimizer.zero_grad()
    directory = str(tmp_path / "ckpt")
    path = checkpoint.save(model, optimizer, directory, 1, SETTINGS)

    def refused(call, message: str) -> None:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()

    refused(lambda: checkpoint.load(*model_and_optimizer(layers=1), path),
            "is of another model: 9 entries only the checkpoint holds (layers.1.attention.wk.weight, ")
    refused(lambda: checkpoint.load(*model_and_optimizer(layers=3), path), "9 entries only the model has")
    refused(lambda: checkpoint.load(*model_and_optimizer(hidden=96), path), "of other shapes (embed.weight (")
    sgd = torch.optim.SGD(model.parameters(), momentum=0.9)
    sgd.step()  # momentum buffers the checkpoint does not hold
    refused(lambda: checkpoint.load(model, sgd, path),  # once 17 lines of DCP's traceback
            "saved by an optimizer of another kind or setting: its state for embed.weight differs (only the "
            "checkpoint's holds exp_avg, exp_avg_sq, step; only this one's holds momentum_buffer)")
    # state of the same names under settings that change what it means: once loaded, then a KeyError at the next
    # step (amsgrad), or AdamW's decoupled weight decay run by an Adam, silently
    amsgrad = torch.optim.AdamW(model.parameters(), amsgrad=True)
    refused(lambda: checkpoint.load(model, amsgrad, path), "only this one's holds max_exp_avg_sq")
    refused(lambda: checkpoint.load(model, torch.optim.Adam(model.parameters()), path),
            "another kind or setting (decoupled_weight_decay=True there, False here)")
    refused(lambda: checkpoint.load(model, torch.optim.AdamW(model.parameters(), maximize=True), path),
            "another kind or setting (maximize=False there, True here)")
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    momentum.step()
    sgd_path = checkpoint.save(model, momentum, str(tmp_path / "sgd"), 1, SETTINGS)
    refused(lambda: checkpoint.load(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                                    sgd_path), "another kind or setting (nesterov=False there, True here)")
    # a path loaded directly is verified as find_resumable verifies: a flipped byte once loaded a wrong weight
    copy = str(tmp_path / "copy" / "step-000001")
    shutil.copytree(path, copy)
    data = next(os.path.join(copy, n) for n in sorted(os.listdir(copy)) if n.endswith(".distcp"))
    flip_bit(data, os.path.getsize(data) // 2)
    refused(lambda: checkpoint.load(model, optimizer, copy), "does not match its sha256 in the manifest (corrupted)")
    os.remove(os.path.join(copy, checkpoint.MANIFEST))
    refused(lambda: checkpoint.load(model, optimizer, copy), "cannot be loaded: no manifest.json: incomplete")
    refused(lambda: checkpoint.load(model, optimizer, str(tmp_path / "copy")), "is not a checkpoint (a step-<N>")
    with pytest.warns(UserWarning, match=r"holds \d+ entries in other dtypes than the model's, loaded as the model's "
                                         r"\(embed.weight torch.float32 there, torch.bfloat16 here") as cast:
        checkpoint.load(copy_model := model_and_optimizer()[0].to(torch.bfloat16),
                        torch.optim.AdamW(copy_model.parameters()), path)
    assert cast[0].filename == __file__  # the caller's line, not ctxpar's
    for step in (-1, 1.5, "3", True):
        refused(lambda: checkpoint.save(model, optimizer, directory, step, SETTINGS), "step must be an int >= 0")
    refused(lambda: checkpoint.save(model, optimizer, directory, 2, None), "run must be a dict")
    # a file for the directory: once "could not be written ... (File exists); what was written of it is left unsealed"
    for file in (path + "/manifest.json", path + "/manifest.json/"):
        refused(lambda: checkpoint.save(model, optimizer, file, 2, SETTINGS),
                f"checkpoint directory {file!r} is a file, not a directory; pass a directory path")
    os.symlink(str(tmp_path / "missing"), str(tmp_path / "dangling"))
    refused(lambda: checkpoint.save(model, optimizer, str(tmp_path / "dangling"), 2, SETTINGS),
            f"is a symbolic link to {str(tmp_path / 'missing')!r}, which does not exist")
    refused(lambda: checkpoint.save(model, optimizer, directory, 2, {"dtype": torch.float32}),
            "run must hold what JSON can")
    with open(os.path.join(directory, checkpoint.SAVE_LOCK), "w") as held:  # another run, saving right now
        fcntl.flock(held, fcntl.LOCK_EX)
        refused(lambda: checkpoint.save(model, optimizer, directory, 2, SETTINGS),
                "another process is saving a checkpoint into")
    refused(lambda: checkpoint.save(model, optimizer, directory, 1, {**SETTINGS, "--seed": 1}),
            "holds a checkpoint sealed by another run (--seed 0 there, 1 here), which is not replaced")
    assert sorted(os.listdir(directory)) == [checkpoint.SAVE_LOCK, "step-000001"]  # nothing written by the refusals
    blocked = tmp_path / "blocked"
    (blocked / checkpoint.SAVE_LOCK).mkdir(parents=True)  # once "step 2 could not be written to .../step-000002"
    refused(lambda: checkpoint.save(model, optimizer, str(blocked), 2, SETTINGS),
            f"the checkpoint directory's save lock {blocked / checkpoint.SAVE_LOCK} cannot be opened or locked (Is a "
            f"directory)")
    assert os.listdir(blocked) == [checkpoint.SAVE_LOCK]
    found = checkpoint.find_resumable(directory, SETTINGS)
    assert (found.step, found.skipped) == (1, ())  # the lock is not a stray entry
    checkpoint.load(model, optimizer, path)
    refused(lambda: checkpoint.find_resumable(path + "/manifest.json", SETTINGS), "is not a directory")
    refused(lambda: checkpoint.find_resumable(str(tmp_path / "missing"), SETTINGS), "does not exist")
    assert checkpoint.save(model, optimizer, directory, 1, SETTINGS) == path  # this run may replace its own

    # a module's extra state as a dict, which DCP saves one entry per key: the same model loads it
    class Scaled(torch.nn.Linear):
        def get_extra_state(self):
            return {"version": 3, "scale": torch.ones(1)}

        def set_extra_state(self, state) -> None:
            assert state["version"] == 3

    scaled = Scaled(2, 2)
    sgd = torch.optim.SGD(scaled.parameters())
    checkpoint.load(scaled, sgd, checkpoint.save(scaled, sgd, str(tmp_path / "scaled"), 1, SETTINGS))


def _tiny_model_and_adamw(parameters=None):
    """The tiny reference model, seeded alike every call, and AdamW over ``parameters(model)``
    (default: all of them)."""
    from ctxpar.models import Transformer, get_config

    torch.manual_seed(0)
    model = Transformer(get_config("tiny"))
    return model, torch.optim.AdamW(parameters(model) if parameters else model.parameters(), lr=0.01)


def _train(model, optimizer, steps: int) -> list[float]:
    """``steps`` updates on one fixed batch; the losses."""
    tokens = torch.randint(0, model.cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("how", ["steps differ", "directories differ", "one directory"])
def test_ranks_that_disagree_on_the_checkpoint_to_save_are_refused_on_every_rank(how: str, saved_each_way) -> None:
    """Each rank wrote its shard where it was told and rank 0 sealed a checkpoint without the
    others' (or failed naming a missing file): stray shards, and no word of the disagreement.
    One directory spelt two ways (relative, through a link) is one directory."""
    root, said_by_rank = saved_each_way
    said = [on_rank[how] for on_rank in said_by_rank]
    directory = os.path.join(root, how.replace(" ", "-"), "ckpt")
    if how == "one directory":
        assert said == ["saved", "saved"] and checkpoint.find_resumable(directory, SETTINGS).step == 3
        return
    want = (f"rank 0: step 3 in {os.path.join(directory, 'rank0')}, rank 1: step 3 in "
            f"{os.path.join(directory, 'rank1')}" if how == "directories differ"
            else f"rank 0: step 3 in {directory}, rank 1: step 4 in {directory}")
    for message in said:
        assert message.startswith("the ranks disagree on the checkpoint to save (") and want in message, message
    assert not [d for _, dirs, _ in os.walk(os.path.dirname(directory)) for d in dirs if d.startswith("step-")]


def test_a_manifest_that_cannot_be_written_fails_the_save_on_every_rank(saved_each_way) -> None:
    """The manifest is written by rank 0 and its outcome shared: written by another rank without a
    collective (a planted bug no test saw), a failure there was that rank's alone, and rank 0
    returned as if the checkpoint were sealed (in train, going on to its next step)."""
    for rank, on_rank in enumerate(saved_each_way[1]):
        said = on_rank["the manifest cannot be written"]
        assert "checkpoint step 3 could not be written" in said and "No space left on device" in said, (rank, said)


def test_a_manifest_whose_write_is_cut_short_leaves_the_checkpoint_unsealed(tmp_path, monkeypatch) -> None:
    """The manifest is written to a temporary name and renamed into place. Written in place (a
    planted bug no test saw), a write cut short (a full disk, a kill) left half a manifest.json:
    resume called it unreadable, and a new run there was refused as one that would overwrite
    checkpoints, though nothing there could be resumed."""
    real_dump, cut = checkpoint.json.dump, []

    def dump_half_then_fail(value, f, **kwargs):
        real_dump(value, f, **kwargs)
        if os.path.basename(f.name).startswith(checkpoint.MANIFEST):  # the manifest alone, whatever else save dumps
            f.flush()
            f.truncate(f.tell() // 2)
            cut.append(f.name)
            raise OSError(28, "No space left on device")

    model, optimizer = _tiny_model_and_adamw()
    directory = str(tmp_path / "ckpt")
    with monkeypatch.context() as patched, pytest.raises(OSError, match="No space left on device"):
        patched.setattr(checkpoint.json, "dump", dump_half_then_fail)
        checkpoint.save(model, optimizer, directory, 1, SETTINGS)
    assert len(cut) == 1, cut
    step = checkpoint.step_path(directory, 1)
    assert not os.path.lexists(os.path.join(step, checkpoint.MANIFEST)), sorted(os.listdir(step))
    checkpoint.check_directory(directory, resuming=False)  # a new run may start here: nothing was sealed
    with pytest.raises(ValueError, match="none was sealed: start a new run here"):
        checkpoint.find_resumable(directory, SETTINGS)


def load_where_rank_1_differs(rank: int, world: int, directory: str) -> dict[str, str]:
    """Both ranks save the tiny model and AdamW at step 1, then load it into a model with one
    parameter renamed on rank 1 ("renamed", refused before DCP's load), or into an Adam on
    rank 1 ("adam", refused after it), or as saved ("alike"): what load said on each."""
    model, optimizer = _tiny_model_and_adamw()
    _train(model, optimizer, 1)
    path = checkpoint.save(model, optimizer, directory, 1, SETTINGS)
    said = {}
    for how in ("renamed", "adam", "alike"):
        model, optimizer = _tiny_model_and_adamw()
        if rank == 1 and how == "renamed":
            model.norm.register_parameter("gain", model.norm._parameters.pop("weight"))
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        elif rank == 1 and how == "adam":
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        try:
            checkpoint.load(model, optimizer, path)
            said[how] = "loaded"
        except ValueError as e:
            said[how] = str(e)
    return said


def test_a_model_or_optimizer_that_one_rank_alone_cannot_load_into_is_refused_on_every_rank(tmp_path) -> None:
    """Rank 1's refusal was its own: rank 0 waited in DCP's load until rank 1 left (a renamed
    parameter), or loaded and trained on (an optimizer of another kind on rank 1)."""
    from ctxpar.launch import run_local

    said = run_local(load_where_rank_1_differs, 2, (str(tmp_path / "ckpt"),), timeout_s=60)
    own = {"renamed": "is of another model: 1 entry only the checkpoint holds (norm.weight); 1 entry only the "
                      "model has (norm.gain)",
           "adam": "was saved by an optimizer of another kind or setting (decoupled_weight_decay=True there, "
                   "False here)"}
    for how, words in own.items():
        assert words in said[1][how] and not said[1][how].startswith("rank 1"), (how, said[1][how])
        assert said[0][how].startswith("rank 1 cannot load this checkpoint: the checkpoint ") \
            and words in said[0][how], (how, said[0][how])
    assert said[0]["alike"] == said[1]["alike"] == "loaded"


def test_a_save_before_the_first_step_leaves_the_optimizer_as_it_was_and_resumes_it_so(tmp_path) -> None:
    """torch's get_state_dict makes an optimizer's state with a step at lr 0 where it has
    none: a checkpoint saved before training left AdamW's step count at 1, so every update
    after it corrected the moments one step late (and a run resumed from it too)."""
    uninterrupted = _train(*_tiny_model_and_adamw(), 3)
    model, optimizer = _tiny_model_and_adamw()
    path = checkpoint.save(model, optimizer, str(tmp_path / "ckpt"), 0, SETTINGS)
    assert not optimizer.state
    assert _train(model, optimizer, 3) == uninterrupted
    model, optimizer = _tiny_model_and_adamw()
    _train(model, optimizer, 1)  # state that the checkpoint's absence of any must replace
    checkpoint.load(model, optimizer, path)
    assert _train(model, optimizer, 3) == uninterrupted
    model = _tiny_model_and_adamw()[0]
    with pytest.raises(ValueError, match="does not fit this model and optimizer"):  # an optimizer of another kind
        checkpoint.load(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), path)


def test_a_refused_optimizer_leaves_the_model_and_the_optimizer_as_they_were(tmp_path) -> None:
    """An optimizer of another setting (Adam for AdamW) or over other parameters was refused
    after DCP's load, which had written the checkpoint's weights and moments into the
    model's and the optimizer's own tensors."""
    model, optimizer = _tiny_model_and_adamw()
    _train(model, optimizer, 1)
    path = checkpoint.save(model, optimizer, str(tmp_path / "ckpt"), 1, SETTINGS)
    for other in ("Adam", "other parameters"):
        torch.manual_seed(1)
        fresh = type(model)(model.cfg)
        kept = fresh.embed.weight if other == "Adam" else fresh.output.weight
        mine = (torch.optim.Adam(fresh.parameters(), lr=0.01) if other == "Adam" else
                torch.optim.AdamW([p for p in fresh.parameters() if p is not fresh.embed.weight], lr=0.01))
        _train(fresh, mine, 1)
        weights, moments = copy.deepcopy(fresh.state_dict()), mine.state[kept]["exp_avg"].clone()
        with pytest.raises(ValueError, match="decoupled_weight_decay=True there" if other == "Adam" else
                           "saved by an optimizer over other parameters"):
            checkpoint.load(fresh, mine, path)
        assert all(torch.equal(weights[name], value) for name, value in fresh.state_dict().items()), other
        assert torch.equal(mine.state[kept]["exp_avg"], moments), other


def test_an_optimizer_with_state_for_some_parameters_only_resumes_exactly(tmp_path) -> None:
    """Parameters that never had a gradient have no AdamW state: load refused such a
    checkpoint (torch's get_state_dict makes state for every parameter, which the
    checkpoint then lacked), into a fresh optimizer and into the one that saved it. An
    optimizer over other parameters than the saving one's is refused, naming them."""
    model, optimizer = _tiny_model_and_adamw()
    model.embed.weight.square().sum().backward()  # a first step that reaches the embedding alone
    optimizer.step()
    optimizer.zero_grad()
    assert len(optimizer.state) == 1
    path = checkpoint.save(model, optimizer, str(tmp_path / "ckpt"), 1, SETTINGS)
    uninterrupted = _train(model, optimizer, 2)
    resumed = _tiny_model_and_adamw()
    checkpoint.load(*resumed, path)
    assert len(resumed[1].state) == 1
    assert _train(*resumed, 2) == uninterrupted
    without_embedding = _tiny_model_and_adamw(lambda m: [p for n, p in m.named_parameters() if n != "embed.weight"])
    with pytest.raises(ValueError, match=re.escape("1 only the checkpoint's optimizer holds (embed.weight)")):
        checkpoint.load(*without_embedding, path)
    path = checkpoint.save(*without_embedding, str(tmp_path / "other"), 1, SETTINGS)
    with pytest.raises(ValueError, match=re.escape("1 only this optimizer holds (embed.weight)")):
        checkpoint.load(*_tiny_model_and_adamw(), path)  # its embedding once started afresh, silently


def test_the_optimizers_hyperparameters_are_resumed_with_its_state(tmp_path) -> None:
    """A learning rate a scheduler lowered comes back with the moments: the resumed-losses tests
    could not tell (dcp.load restores the moments in place, and their lr is constant)."""
    model, optimizer = _tiny_model_and_adamw()
    _train(model, optimizer, 1)
    for group in optimizer.param_groups:
        group["lr"] *= 0.25
    path = checkpoint.save(model, optimizer, str(tmp_path / "ckpt"), 1, SETTINGS)
    uninterrupted = _train(model, optimizer, 2)
    resumed = _tiny_model_and_adamw()
    checkpoint.load(*resumed, path)
    assert [g["lr"] for g in resumed[1].param_groups] == [g["lr"] for g in optimizer.param_groups]
    assert _train(*resumed, 2) == uninterrupted


def test_an_optimizers_nested_state_is_saved_and_loaded(tmp_path) -> None:
    """State an optimizer keeps in nested dicts (per parameter, {"moments": {"m": ...}}),
    as some optimizers of one's own do: its entries are deeper than "<parameter>.<name>"."""

    class Nested(torch.optim.Optimizer):
        def __init__(self, params) -> None:
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        m = self.state[p].setdefault("moments", {"m": torch.zeros_like(p)})["m"]
                        m.add_(p.grad)
                        p.data.add_(m, alpha=-group["lr"])

    model = torch.nn.Linear(3, 2)
    optimizer = Nested(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = checkpoint.save(model, optimizer, str(tmp_path / "ckpt"), 1, SETTINGS)
    fresh = torch.nn.Linear(3, 2)
    loaded = Nested(fresh.parameters())
    checkpoint.load(fresh, loaded, path)
    assert [loaded.state[p]["moments"]["m"].tolist() for p in fresh.parameters()] == \
        [optimizer.state[p]["moments"]["m"].tolist() for p in model.parameters()]


def test_a_file_system_without_locks_saves_unlocked(tmp_path, monkeypatch) -> None:
    """NFS mounted nolock, Lustre noflock: flock fails with ENOLCK or ENOSYS there. A save
    goes on without the lock, as it did before there was one (it once failed outright)."""
    import errno
    import fcntl

    from ctxpar.models import Transformer, get_config

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    model = Transformer(get_config("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    path = checkpoint.save(model, optimizer, str(tmp_path), 1, SETTINGS)
    assert checkpoint.find_resumable(str(tmp_path), SETTINGS).path == path
    assert checkpoint.hold_for_run(str(tmp_path)) is None  # a run goes unlocked there too


def test_a_run_on_a_directory_a_live_run_holds_is_refused_before_any_rank_starts(tmp_path, monkeypatch) -> None:
    """``ctxpar train --resume`` beside a live run on its directory took the live run's newest
    checkpoint, saved over its later steps, and one of the two died at its next save. The
    launching process holds the directory for its run's life, ended or failed."""
    from ctxpar import train

    fresh, used = str(tmp_path / "fresh"), tmp_path / "used"
    (used / "step-000004").mkdir(parents=True)
    checkpoint.write_manifest(str(used / "step-000004"), 4, SETTINGS)
    os.makedirs(fresh)
    held = [checkpoint.hold_for_run(fresh), checkpoint.hold_for_run(str(used))]
    try:
        started = time.monotonic()
        # a new run beside a live run that saved: the live run is named, not "holds checkpoints: add --resume"
        for directory, resume in ((fresh, False), (str(used), True), (str(used), False)):
            with pytest.raises(ValueError, match=f"another ctxpar train is running on --checkpoint-dir "
                                                 f"'{re.escape(directory)}' \\(.* pid {os.getpid()}\\); wait for it"):
                run_train(TrainConfig(steps=8, resume=resume, checkpoint_dir=directory, **COMMON))
        assert time.monotonic() - started < 5, "refused before spawning any rank"
    finally:
        for fd in held:
            os.close(fd)
    runs = iter([{"first_step_gradients": None}, RuntimeError("a rank failed")])

    def launched(*args, **kwargs):
        # held while the ranks run (a hold released before the launch let a second run in; the refusals
        # above hold the lock themselves, so they cannot tell)
        with pytest.raises(checkpoint.HeldByAnotherRun):
            checkpoint.hold_for_run(fresh)
        outcome = next(runs)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(train.launch, "run", launched)
    run_train(TrainConfig(steps=2, checkpoint_dir=fresh, **COMMON))
    with pytest.raises(RuntimeError, match="a rank failed"):
        run_train(TrainConfig(steps=2, checkpoint_dir=fresh, **COMMON))
    os.close(checkpoint.hold_for_run(fresh))  # free again after a run that ended and one that failed
    odd = tmp_path / "odd"
    (odd / checkpoint.RUN_LOCK).mkdir(parents=True)  # a lock that cannot be taken: once the run went unlocked
    with pytest.raises(ValueError, match=f"its run lock {re.escape(str(odd / checkpoint.RUN_LOCK))} cannot be taken"):
        run_train(TrainConfig(steps=2, checkpoint_dir=str(odd), **COMMON))
    # the save lock too: once found at the first save, after the training, and named as the step's path
    for kind, make in (("a directory", os.mkdir), ("a link to nowhere", lambda p: os.symlink(tmp_path / "no/lock", p))):
        odd = tmp_path / f"odd {kind}"
        odd.mkdir()
        make(odd / checkpoint.SAVE_LOCK)
        with pytest.raises(ValueError, match=f"its save lock {re.escape(str(odd / checkpoint.SAVE_LOCK))} cannot be "
                                             f"opened"):
            run_train(TrainConfig(steps=2, checkpoint_dir=str(odd), **COMMON))
