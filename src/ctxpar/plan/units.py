"""Reading and writing quantities: bandwidths, FLOP rates, latencies, bytes and seconds.

Conventions (stated in every report): bandwidth prefixes are decimal, as vendors and
nccl-tests quote them, so ``100GB/s`` = 100e9 bytes/s and ``400Gb/s`` = 400e9 bits/s =
50e9 bytes/s; ``GiB/s`` and ``MiB/s`` are binary. Sizes are printed in binary units
(MiB = 2**20 bytes, GiB = 2**30 bytes), since that is how memory is allocated.
"""

from __future__ import annotations

import re

_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "e": 1e18}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_BANDWIDTH = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]i?)?([bB])?(?:/s|ps)?\s*$", re.I)
# What a flag may say: beyond these, the figures describe no machine and the arithmetic
# over them overflows (or divides by zero). The patterns read a sign, so that a negative
# value is refused by these ranges, not as "not understood".
BANDWIDTH_RANGE = (1e3, 1e18, "1kB/s .. 1e18B/s")
FLOPS_RANGE = (1e6, 1e24, "1M .. 1e24 FLOP/s")
LATENCY_RANGE = (0.0, 1.0, "0 .. 1 s")
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_LATENCY = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*$", re.I)
_FLOPS = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtpe])?(?:flop/?s|flops)?\s*$", re.I)


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``100GB/s``, ``400Gb/s`` (bits), ``25GiB/s``, ``1.5e11`` (bytes/s).

    A lower-case ``b`` means bits, upper-case ``B`` bytes; no unit letter means bytes/s.
    """
    m = _BANDWIDTH.match(str(text))
    if not m:
        raise ValueError(f"--bandwidth {text!r} is not understood; write e.g. 100GB/s, 400Gb/s or 25GiB/s")
    value, prefix, unit = float(m.group(1)), (m.group(2) or "").lower(), m.group(3)
    if prefix and unit is None:
        raise ValueError(f"--bandwidth {text!r} has no unit; write {m.group(1)}{m.group(2)}B/s (bytes) "
                         f"or {m.group(1)}{m.group(2)}b/s (bits)")
    scale = _BINARY[prefix] if prefix.endswith("i") else _DECIMAL[prefix]
    bytes_per_s = value * scale / (8 if unit == "b" else 1)
    return _within(bytes_per_s, BANDWIDTH_RANGE, "--bandwidth", "bytes/s", "100GB/s", given=text)


def parse_flops(text: str) -> float:
    """FLOP/s from ``989T``, ``989TFLOPS``, ``2.25P``, ``9.89e14``."""
    return _within(_scaled(text, _FLOPS, _DECIMAL, "--flops", "989T, 989TFLOPS or 9.89e14"), FLOPS_RANGE, "--flops",
                   "FLOP/s", "989T", given=text)


def parse_latency(text: str, flag: str = "--latency") -> float:
    """Seconds from ``20us``, ``0.5ms``, ``2e-5`` (no unit: seconds); 0 is allowed (no fixed cost).
    ``flag`` names the option in errors (--latency, --launch-overhead, --step-overhead, --tile-overhead)."""
    return check_seconds(_scaled(text, _LATENCY, _SECONDS, flag, "20us, 0.5ms or 0.00002 (seconds)"), flag, given=text)


def parse_tile_overhead(text: str, flag: str = "--tile-overhead") -> tuple[float, float]:
    """(forward, backward) seconds from ``20us,10us``; one value is both."""
    parts = str(text).split(",")
    if len(parts) > 2:
        raise ValueError(f"{flag} {text!r} has {len(parts)} values; give forward,backward (e.g. 20us,10us) or one "
                         f"value for both")
    values = [parse_latency(part.strip(), flag) for part in parts]
    return values[0], values[-1]


def check_seconds(seconds: float, flag: str = "--latency", given: object = None, example: str = "20us") -> float:
    """``seconds`` if within ``LATENCY_RANGE``: the flags' check of latencies and overheads,
    and ``get_hardware``'s for the same figures given in Python (``given``: what the user
    wrote, default the value; ``example``: a value to suggest, written as they would)."""
    return _within(seconds, LATENCY_RANGE, flag, "s", example, given)


def _within(value: float, bounds: tuple[float, float, str], flag: str, unit: str, example: str, given: object) -> float:
    low, high, written = bounds
    if not low <= value <= high:
        raise ValueError(f"{flag} {value if given is None else given!r} = {value:g} {unit} is outside {written}; "
                         f"write e.g. {example}")
    return value


def _scaled(text: str, pattern: re.Pattern, scales: dict[str, float], flag: str, examples: str) -> float:
    """A number times the scale of its (case-insensitive) unit prefix."""
    m = pattern.match(str(text))
    if not m:
        raise ValueError(f"{flag} {text!r} is not understood; write e.g. {examples}")
    return float(m.group(1)) * scales[(m.group(2) or "").lower()]


def format_bytes(n: float) -> str:
    """``268435456`` -> ``256 MiB``; up to three decimals, trailing zeros dropped."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{_trim(n / size)} {unit}"
    return f"{_trim(n)} B"


def format_seconds(s: float) -> str:
    """``0.00100663296`` -> ``1.007 ms``."""
    if s == 0:
        return "0 s"
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= size:
            return f"{_trim(s / size)} {unit}"
    return f"{_trim(s / 1e-9)} ns"


def format_bandwidth(bytes_per_s: float) -> str:
    """Decimal, like the flags: ``1e11`` -> ``100 GB/s``."""
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6)):
        if bytes_per_s >= size:
            return f"{_trim(bytes_per_s / size)} {unit}"
    return f"{_trim(bytes_per_s)} B/s"


def format_flops(rate: float) -> str:
    for unit, size in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if rate >= size:
            return f"{_trim(rate / size)} {unit}"
    return f"{_trim(rate)} FLOP/s"


def format_tokens(t: int) -> str:
    """``32768`` -> ``32K``, ``1048576`` -> ``1M``; other lengths verbatim."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if t >= size and t % size == 0:
            return f"{t // size}{unit}"
    return str(t)


def _trim(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")
