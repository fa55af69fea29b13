"""A synthetic long-range task: associative recall across the whole sequence.

    BOS k1 v1 k2 v2 ... kn vn  f f f f ... f f f  SEP kq vq kq' vq' ...
    └─ pairs at the start ─┘  └──── filler ────┘  └─ queries at the end ─┘

Each query repeats a key from the start; the value after it can only be predicted by
attending back across the whole filler, i.e. across CP shards. A broken CP (wrong
positions, wrong mask, a lost K/V block) shows up as recall that does not improve.
Batches are a pure function of (seed, step), so a resumed run sees the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BOS, SEP = 0, 1
FIRST_KEY = 2


@dataclass(frozen=True)
class RecallTask:
    vocab: int
    seq_len: int
    pairs: int = 16
    queries: int = 8

    def __post_init__(self) -> None:
        if self.vocab < 16:
            raise ValueError(f"the recall task needs a vocabulary of at least 16 tokens, got {self.vocab}")
        if self.queries > self.pairs or self.pairs > self.keys:
            raise ValueError(f"need queries <= pairs <= {self.keys} keys, got {self.queries}, {self.pairs}")
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
        queried value (where the model must look back)."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        n, t = self.keys, self.seq_len
        first_value, first_filler = FIRST_KEY + n, FIRST_KEY + 2 * n
        tokens = torch.randint(first_filler, self.vocab, (size, t), generator=gen)
        recall = torch.zeros(size, t, dtype=torch.bool)
        tokens[:, 0] = BOS
        query_start = t - 2 * self.queries
        tokens[:, query_start - 1] = SEP
        for row in range(size):
            keys = torch.randperm(n, generator=gen)[: self.pairs]
            values = torch.randint(0, n, (self.pairs,), generator=gen)
            tokens[row, 1 : 1 + 2 * self.pairs : 2] = FIRST_KEY + keys
            tokens[row, 2 : 2 + 2 * self.pairs : 2] = first_value + values
            asked = torch.randperm(self.pairs, generator=gen)[: self.queries]
            tokens[row, query_start::2] = FIRST_KEY + keys[asked]
            tokens[row, query_start + 1 :: 2] = first_value + values[asked]
            recall[row, query_start::2] = True
        return tokens, recall
