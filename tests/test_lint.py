"""The code passes the linter the project uses (pyproject.toml's [tool.ruff]): an unused import,
an undefined name or an over-long line fails the suite, not a later reader."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_code_passes_ruff():
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks"],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr
