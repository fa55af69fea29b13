"""Every temporary file of the suite, its subprocesses' included, goes under pytest's own
folder, which pytest prunes: a launcher a test kills with SIGKILL cannot remove its
scratch folder, nor can torchrun's agent its own, and /tmp kept a few of each per run.

In a run of every test collected (none deselected by -k, -m, --lf...) that reads spawned
groups and runs tests that read none, the groups run in the background from the start and
the tests that read them last (``spawned.run_in_background``)."""

import sys
import tempfile

import pytest

_deselected = False
_groups_in_background = False


def pytest_deselected(items) -> None:
    global _deselected
    _deselected = True


def pytest_collection_finish(session) -> None:
    """After every plugin has chosen and ordered the tests (--lf, --ff, -k)."""
    global _groups_in_background
    spawned = sys.modules.get("spawned")  # imported by every module that reads a group
    if spawned is None or _deselected:
        return
    reading = {item: None for item in session.items if spawned.reads_groups(getattr(item, "module", None))}
    if reading and len(reading) < len(session.items):
        session.items[:] = [item for item in session.items if item not in reading] + list(reading)
        _groups_in_background = True


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_pytests_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tmpdir"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", folder)
        patch.setattr(tempfile, "tempdir", folder)
        yield


@pytest.fixture(scope="session", autouse=True)
def spawned_groups_in_background(temporary_files_under_pytests_folder, tmp_path_factory):
    if not _groups_in_background:
        yield
        return
    spawned = sys.modules["spawned"]
    spawned.run_in_background(tmp_path_factory.mktemp("spawned"))
    yield
    spawned.stop_background()
