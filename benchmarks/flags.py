"""Benchmark flags checked before any work: a bad value is argparse's error (exit status 2)
naming the flag, not a traceback from inside the ranks or a table of inf after a run.

Types for ``add_argument(type=...)``, and ``refusals(parser)`` for the checks that take
several flags together, made by the library's own checks (``DemoConfig.validate``)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

from ctxpar import cli, launch
from ctxpar.limits import MAX_COUNT


def count(text: str) -> int:
    """An integer in 1..MAX_COUNT: a length, a head count, a number of repeats."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_COUNT}, got {value}")
    return value


def counts(text: str) -> list[int]:
    """Comma-separated ``count``s."""
    return [count(part) for part in text.split(",")]


def ranks(text: str) -> int:
    """A number of local ranks this machine can spawn (``launch.check_nproc``)."""
    value = count(text)
    try:
        launch.check_nproc(value, "")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
    return value


def ranks_list(text: str) -> list[int]:
    """Comma-separated ``ranks``."""
    return [ranks(part) for part in text.split(",")]


def output_file(text: str) -> str:
    """A file --json can write, as ``ctxpar demo`` and ``plan`` check theirs (``cli.check_output``):
    a directory or a missing parent once cost the whole run, refused only when it was written."""
    try:
        cli.check_output("", text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
    return text


def positive(text: str) -> float:
    """A finite number above 0: seconds, GiB."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):  # NaN too
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def names(choices: tuple[str, ...] | list[str]) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``choices``."""

    def parse(text: str) -> list[str]:
        given = text.split(",")
        unknown = [name for name in given if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, unknown))}: choose from {', '.join(choices)}")
        return given

    parse.__name__ = "names"
    return parse


@contextlib.contextmanager
def refusals(parser: argparse.ArgumentParser) -> Iterator[None]:
    """The library's refusals (a ``ValueError`` naming the flag) inside, as ``parser.error``."""
    try:
        yield
    except ValueError as e:
        parser.error(str(e))

