"""Documents packed into a row, for the planner: lengths given, or drawn from a distribution.

A packed row of T tokens is the first T tokens of a stream of documents: the lengths given
(``--documents 8192,512,30000``) repeated, or lengths drawn one after another from a
distribution (``--doc-dist lognormal:MEAN,SIGMA``) with a fixed seed, so that a plan is
reproducible; the document that crosses T is cut there. The same stream gives the row of
every length the planner's sweep asks about (``pack``)::

    stream   | 8192    |512| 30000                        | 8192    |512| ...
    T=16384  | 8192    |512| 7680      |                                       (cut)

Distributions (``parse_doc_dist``):

    fixed:LEN              every document LEN tokens
    lognormal:MEAN,SIGMA   round(X), X ~ exp(N(mu, SIGMA^2)) with mu = ln(MEAN) - SIGMA^2/2,
                           so E[X] = MEAN (lengths under 1 become 1); the long tail
                           of real corpora: SIGMA 1-2 puts a few documents at 10-50x MEAN
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from ctxpar.limits import MAX_COUNT

DISTRIBUTIONS = ("fixed", "lognormal")
MAX_SIGMA = 5.0  # beyond it one draw is e^25 times the median: not a corpus, a typo


@dataclass(frozen=True)
class DocDist:
    """A document-length distribution: ``kind`` in DISTRIBUTIONS, its parameters in tokens."""

    kind: str
    mean: float  # fixed: the length
    sigma: float = 0.0

    def __str__(self) -> str:
        return f"fixed:{int(self.mean)}" if self.kind == "fixed" else f"lognormal:{self.mean:g},{self.sigma:g}"


def parse_lengths(text: str, flag: str = "--documents") -> tuple[int, ...]:
    """'8192,512,30000' -> (8192, 512, 30000); ValueError naming ``flag`` for anything else."""
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        lengths = ()
    if not lengths or not all(1 <= n <= MAX_COUNT for n in lengths):
        raise ValueError(f"{flag} {text!r} must be comma-separated document lengths, each an integer between 1 and "
                         f"{MAX_COUNT}, e.g. {flag} 8192,512,30000")
    return lengths


def parse_doc_dist(text: str, flag: str = "--doc-dist") -> DocDist:
    """'fixed:LEN' or 'lognormal:MEAN,SIGMA' (see the module docstring); ValueError naming ``flag``."""
    usage = f"write {flag} fixed:LEN or {flag} lognormal:MEAN,SIGMA, e.g. lognormal:2048,1.5"
    kind, _, params = text.partition(":")
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"{flag} {text!r}: unknown distribution {kind!r} (one of {', '.join(DISTRIBUTIONS)}); {usage}")
    if kind == "fixed":
        try:
            length = int(params)
        except ValueError:
            length = 0
        if not 1 <= length <= MAX_COUNT:
            raise ValueError(f"{flag} {text!r}: fixed takes one length, 1 to {MAX_COUNT}; {usage}")
        return DocDist("fixed", float(length))
    try:
        mean, sigma = (float(x) for x in params.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: lognormal takes MEAN,SIGMA; {usage}") from None
    if not (math.isfinite(mean) and 1 <= mean <= MAX_COUNT):
        raise ValueError(f"{flag} {text!r}: MEAN {mean:g} must be a document length in tokens, 1 to {MAX_COUNT}")
    if not (math.isfinite(sigma) and 0 <= sigma <= MAX_SIGMA):
        raise ValueError(f"{flag} {text!r}: SIGMA {sigma:g} must be between 0 and {MAX_SIGMA:g} (the spread of ln "
                         f"length; 1-2 for real corpora)")
    return DocDist("lognormal", mean, sigma)


def sample_lengths(dist: DocDist, tokens: int, seed: int = 0) -> tuple[int, ...]:
    """Document lengths drawn from ``dist`` (Python's ``random``, seeded: the same on every
    machine) until they cover ``tokens``; the last one is cut at ``tokens``."""
    if dist.kind == "fixed":
        return (int(dist.mean),)  # repeated by ``pack``
    rng = random.Random(seed)
    mu = math.log(dist.mean) - dist.sigma**2 / 2
    lengths, total = [], 0
    while total < tokens:
        n = min(max(1, round(rng.lognormvariate(mu, dist.sigma))), tokens - total)
        lengths.append(n)
        total += n
    return tuple(lengths)


def pack(lengths: tuple[int, ...], seq: int) -> tuple[int, ...]:
    """The first ``seq`` tokens of ``lengths`` repeated: the documents of one packed row."""
    period = sum(lengths)
    row = list(lengths) * (seq // period)
    left = seq - period * (seq // period)
    for n in lengths:
        if left == 0:
            break
        row.append(min(n, left))
        left -= row[-1]
    return tuple(row)


def describe(lengths: tuple[int, ...]) -> dict:
    """count, mean, median and max of a row's document lengths (for the report)."""
    return dict(count=len(lengths), mean=sum(lengths) / len(lengths), median=float(statistics.median(lengths)),
                max=max(lengths))
