"""Every temporary file of the suite, its subprocesses' included, goes under pytest's own
folder, which pytest prunes: a launcher a test kills with SIGKILL cannot remove its
scratch folder, nor can torchrun's agent its own, and /tmp kept a few of each per run."""

import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_pytests_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tmpdir"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", folder)
        patch.setattr(tempfile, "tempdir", folder)
        yield
