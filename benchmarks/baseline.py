"""Another checkout's ctxpar imported beside this one (``--baseline SRC``), so that a benchmark
alternates the code before and after a change call by call in one run: drift on a shared
machine then hits both alike."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import ctxpar
from report import write_json


def ctxpar_modules() -> dict:
    return {name: module for name, module in sys.modules.items() if name.split(".")[0] == "ctxpar"}


def check_baseline(src: str) -> None:
    """Refuse a ``--baseline`` that holds no ctxpar package, or this checkout's own."""
    if not (Path(src) / "ctxpar" / "__init__.py").is_file():
        raise ValueError(f"--baseline {src} holds no ctxpar package (give a checkout's src/)")
    # by resolved path: ../src from benchmarks/ compared this checkout with itself, and read "identical"
    if (Path(src) / "ctxpar").resolve() == Path(ctxpar.__file__).resolve().parent:
        raise ValueError(f"--baseline {src} is this checkout's ctxpar; give another checkout's src/")


def load_baseline(src: str, names: tuple[str, ...]) -> dict:
    """The modules of the ctxpar package under ``src`` (``ctxpar`` and ``ctxpar.<name>`` for
    each of ``names``), imported beside this process's own: swapped into ``sys.modules`` while
    they import (each binds its siblings then)."""
    ours = ctxpar_modules()
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, src)
    try:
        for name in ("ctxpar", *(f"ctxpar.{name}" for name in names)):
            importlib.import_module(name)
        theirs = ctxpar_modules()
    finally:
        sys.path.remove(src)
        for name in ctxpar_modules():
            del sys.modules[name]
        sys.modules.update(ours)
    if theirs["ctxpar"].__file__ == ours["ctxpar"].__file__:
        raise ValueError(f"--baseline {src} holds no other ctxpar package")
    return theirs


def bits(row: dict) -> str:
    """A table's last column: whether the row's results are bit-identical to the baseline's."""
    return f" {'identical' if row['identical'] else 'DIFFER':>9}"


def write_and_judge(args, rows: list[dict], differ: str) -> None:
    """The rows as --json asked, then, against a --baseline, exit status 1 naming ``differ``
    where a row's results are not bit-identical (after the table: the figures still count)."""
    if args.json:
        write_json(args.json, args, rows=rows)
    if args.baseline and not all(row["identical"] for row in rows):
        raise SystemExit(differ)
