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


def test_each_parametrize_names_arguments_of_its_test():
    """Tests skipped on this machine (test_cuda.py without a GPU) are never collected here: a
    parametrize left on the wrong function (it once named 'strategy' for a test without one)
    stopped every CUDA test from being collected on a GPU."""
    import ast

    wrong = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            takes = {a.arg for a in node.args.args}
            for mark in node.decorator_list:
                if isinstance(mark, ast.Call) and getattr(mark.func, "attr", "") == "parametrize" and \
                        isinstance(mark.args[0], ast.Constant):
                    wrong += [f"{path.name}::{node.name} is parametrized by {name!r}, which it does not take"
                              for name in (n.strip() for n in mark.args[0].value.split(",")) if name not in takes]
    assert not wrong, "\n".join(wrong)
