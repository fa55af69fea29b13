"""Every temporary file of the suite, its subprocesses' included, goes under pytest's own
folder, which pytest prunes: a launcher a test kills with SIGKILL cannot remove its
scratch folder, nor can torchrun's agent its own, and /tmp kept a few of each per run.

The tests that read spawned groups run last, the groups spawned in the background from the
start, where the session also runs tests that read none (``spawned.run_in_background``)."""

import tempfile

import pytest

import spawned

_groups_in_background = False


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
def pytest_collection_modifyitems(items) -> None:
    global _groups_in_background
    reading = {item: None for item in items if spawned.reads_groups(getattr(item, "module", None))}  # in order
    if reading and len(reading) < len(items):
        items[:] = [item for item in items if item not in reading] + list(reading)
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
    if _groups_in_background:
        spawned.run_in_background(tmp_path_factory.mktemp("spawned"))
    yield
    spawned.stop_background()
