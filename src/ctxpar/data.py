"""A synthetic long-range task: associative recall across the whole sequence.

    BOS k1 v1 k2 v2 ... kn vn  f f f f ... f f f  SEP kq vq kq' vq' ...
    └─ pairs at the start ─┘  └──── filler ────┘  └─ queries at the end ─┘

Each query repeats a key from the start; the value after it can only be predicted by
attending back across the whole filler, i.e. across CP shards. A broken CP (wrong
positions, wrong mask, a lost K/V block) shows up as recall that does not improve.
Batches are a pure function of (seed, step), so a resumed run sees the same data, and
runs of different seeds see different data at every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ctxpar import limits

BOS, SEP = 0, 1
FIRST_KEY = 2


@dataclass(frozen=True)
class RecallTask:
    vocab: int
    seq_len: int
    pairs: int = 16
    queries: int = 8

    STREAM = "recall/2"  # the data's version: (seed, step) give other batches in another (a checkpoint names it)

    def __post_init__(self) -> None:
        limits.plain_values(self, "RecallTask")  # 256.5 or "64" failed in torch's randint, bools passed as 1
        if not 16 <= self.vocab <= limits.MAX_COUNT:
            raise ValueError(f"the recall task needs a vocabulary of 16 to {limits.MAX_COUNT} tokens, got {self.vocab}")
        if not 1 <= self.queries <= self.pairs <= self.keys:  # negative counts failed with an IndexError
            raise ValueError(f"RecallTask needs 1 <= queries <= pairs <= {self.keys} keys (a quarter of the "
                             f"vocabulary), got queries={self.queries}, pairs={self.pairs}")
        if self.seq_len < self.shortest(self.pairs, self.queries):
            raise ValueError(f"sequence length {self.seq_len} is too short for {self.pairs} pairs and "
                             f"{self.queries} queries: at least {self.shortest(self.pairs, self.queries)}")

    @staticmethod
    def shortest(pairs: int, queries: int) -> int:
        """The shortest sequence holding BOS, the pairs, SEP and the queries."""
        return 2 * pairs + 2 * queries + 2

    @property
    def keys(self) -> int:  # a quarter of the vocabulary each for keys and values, the rest filler
        return (self.vocab - FIRST_KEY) // 4

    def batch(self, size: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (size, T) int64, and recall (size, T) bool: positions whose next token is a
        queried value (where the model must look back). ``size`` >= 1; ``seed`` and ``step``
        integers >= 0 (``seed`` at most ``limits.MAX_SEED``)."""
        if limits.whole(size) is None or not 1 <= size <= limits.MAX_COUNT:
            raise ValueError(f"RecallTask.batch size must be an integer from 1 to {limits.MAX_COUNT}, got {size!r}")
        if limits.whole(seed) is None or not 0 <= seed <= limits.MAX_SEED:
            raise ValueError(f"RecallTask.batch seed must be an integer from 0 to {limits.MAX_SEED}, got {seed!r}")
        if limits.whole(step) is None or step < 0:
            raise ValueError(f"RecallTask.batch step must be an integer >= 0, got {step!r}")
        # Python's Mersenne Twister is seeded from every bit of the key (torch's from the low 32 bits of its
        # seed: seed * 1_000_003 + step gave seed 0's step 1_000_003 the batch of seed 1's step 0)
        rng = random.Random(f"{self.STREAM} {int(seed)} {int(step)}")
        n, t = self.keys, self.seq_len
        first_value, first_filler = FIRST_KEY + n, FIRST_KEY + 2 * n
        draws = torch.frombuffer(bytearray(rng.randbytes(8 * size * t)), dtype=torch.int64).view(size, t)
        tokens = first_filler + draws.remainder(self.vocab - first_filler)  # 64 random bits each: bias below 2^-32
        recall = torch.zeros(size, t, dtype=torch.bool)
        tokens[:, 0] = BOS
        query_start = t - 2 * self.queries
        tokens[:, query_start - 1] = SEP
        for row in range(size):
            keys = torch.tensor(rng.sample(range(n), self.pairs))
            values = torch.tensor([rng.randrange(n) for _ in range(self.pairs)])
            tokens[row, 1 : 1 + 2 * self.pairs : 2] = FIRST_KEY + keys
            tokens[row, 2 : 2 + 2 * self.pairs : 2] = first_value + values
            asked = torch.tensor(rng.sample(range(self.pairs), self.queries))
            tokens[row, query_start::2] = FIRST_KEY + keys[asked]
            tokens[row, query_start + 1 :: 2] = first_value + values[asked]
            recall[row, query_start::2] = True
        return tokens, recall
