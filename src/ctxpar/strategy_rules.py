"""What each CP strategy asks of the shapes and how it splits the ranks: the one description
the strategies, the commands and the planner share (plain arithmetic, no torch).

    strategy    all-to-all degree U    ring degree R    constraint
    ring        1                      P                none
    allgather   1                      P                none
    alltoall    P                      1                H % P == 0
    hybrid      given, dividing P      P / U            H % U == 0

GQA under an all-to-all: K/V heads are split over the U ranks too; when H_kv is not a
multiple of U each KV head is sent f = U / gcd(H_kv, U) times (``kv_copies``).
"""

from __future__ import annotations

import math

STRATEGY_NAMES = ("ring", "allgather", "alltoall", "hybrid")
MAX_GATHERS = 8  # all-gather head groups per pass (why eight: strategies/allgather.py)
AUTO = "auto"  # a call's strategy picked per call by ``ctxpar.auto`` among ring, allgather and alltoall
CALL_STRATEGIES = (*STRATEGY_NAMES, AUTO)  # what a call (and demo, train, generate) may ask for


def named_with_choice(strategy: str, chosen: dict[str, str]) -> str:
    """``strategy`` as a command's report names it, with what "auto" chose: "auto -> ring"."""
    return f"{strategy} -> {', '.join(chosen)}" if chosen else strategy


def choice_lines(chosen: dict[str, str], indent: str = "") -> list[str]:
    """A command report's line for each strategy "auto" chose, with the planner's reason."""
    return [f"{indent}auto chose {strategy}: {why}" for strategy, why in chosen.items()]


def check_strategy(strategy: object, *, auto_allowed: bool = False) -> str:
    """``strategy`` if it names one (``auto_allowed``: "auto" too, where a call may ask for it)."""
    names = CALL_STRATEGIES if auto_allowed else STRATEGY_NAMES
    if not isinstance(strategy, str) or strategy not in names:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(names)}")
    return strategy


def ulysses_degree(strategy: str, world: int, ulysses: int | None = None, name: str = "ulysses degree") -> int:
    """U, the ranks one all-to-all spans, for ``strategy`` on ``world`` ranks.

    ``ulysses`` is hybrid's own degree (its ring degree is world / ulysses); the other
    strategies take none. ``name``: what errors call it (a command passes its flag).
    """
    check_strategy(strategy)
    if strategy == "hybrid":
        if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or world % ulysses:
            got = "none was given" if ulysses is None else f"got {ulysses!r}"
            raise ValueError(f"strategy 'hybrid' needs a {name} dividing the {world} CP ranks (the ring degree "
                             f"is CP ranks / {name}); {got}")
        return ulysses
    if ulysses is not None:
        raise ValueError(f"a {name} is only for strategy 'hybrid', not {strategy!r}")
    return world if strategy == "alltoall" else 1


def call_ulysses_degree(strategy: str, world: int, ulysses: int | None = None, name: str = "ulysses degree") -> int:
    """``ulysses_degree`` for a call that may ask for ``AUTO``: 1 there, since auto takes
    all-to-all only where P divides the heads (so ``check_heads_split`` has nothing to refuse),
    and auto takes no degree of its own."""
    if strategy == AUTO:
        if ulysses is not None:
            raise ValueError(f"a {name} is only for strategy 'hybrid', not {AUTO!r}")
        return 1
    return ulysses_degree(strategy, world, ulysses, name)


def check_heads_split(strategy: str, heads: int, kv_heads: int, ulysses: int) -> None:
    """Refuse query heads that ``strategy``'s all-to-all over ``ulysses`` ranks cannot split."""
    if heads % ulysses:
        over = "P" if strategy == "alltoall" else "ulysses degree"
        raise ValueError(f"strategy {strategy!r} splits the query heads H={heads} (H_kv={kv_heads}) over "
                         f"{over}={ulysses} ranks, which does not divide them; use strategy 'ring' or "
                         f"'allgather', or a {over} that divides {heads}")


def kv_copies(kv_heads: int, ulysses: int) -> int:
    """f: copies of each KV head that make H_kv * f divisible by U (the fewest)."""
    return ulysses // math.gcd(kv_heads, ulysses)


def gather_group_heads(kv_heads: int) -> int:
    """KV heads the all-gather gathers at a time: the H_kv heads in at most ``MAX_GATHERS``
    equal groups (the last may be smaller)."""
    return -(-kv_heads // MAX_GATHERS)


def gather_groups(kv_heads: int) -> int:
    """The all-gather's head groups per pass: one gather each (and a reduce-scatter backward)."""
    return -(-kv_heads // gather_group_heads(kv_heads))
