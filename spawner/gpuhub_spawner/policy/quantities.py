"""Kubernetes-style quantities and human durations.

The policy file speaks Kubernetes (``500m`` CPU, ``16Gi`` memory) so that the same
numbers render into Kueue objects; admission compares integers (millicores, bytes).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(m|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?\s*$")
# Possessive: no backtracking into a run of digits (a long one made the match quadratic).
_DURATION = re.compile(r"(?<![\d.])(\d++(?:\.\d++)?)\s*+(d|h|m|s)")
_DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def _split(value: str | int | float) -> tuple[Decimal, str]:
    if isinstance(value, bool):
        raise ValueError(f"expected a quantity, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"must not be negative (got {value})")
        return Decimal(str(value)), ""
    m = _QUANTITY.match(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a quantity (examples: 4, 500m, 16Gi)")
    try:
        return Decimal(m.group(1)), m.group(2) or ""
    except InvalidOperation as e:  # pragma: no cover - regex already guards
        raise ValueError(f"{value!r} is not a quantity") from e


def parse_cpu_millis(value: str | int | float) -> int:
    """``4`` -> 4000, ``"500m"`` -> 500."""
    number, suffix = _split(value)
    if suffix == "m":
        return int(number)
    if suffix:
        raise ValueError(f"{value!r}: CPU takes whole or milli cores (4, 0.5, 500m)")
    return int(number * 1000)


def parse_memory_bytes(value: str | int | float) -> int:
    """``"16Gi"`` -> 17179869184; plain numbers are bytes."""
    number, suffix = _split(value)
    if suffix == "m":
        raise ValueError(f"{value!r}: memory in milli-bytes makes no sense; use Mi or Gi")
    factor = _BINARY.get(suffix) or _DECIMAL[suffix]
    return int(number * factor)


def format_cpu(millis: int) -> str:
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def format_memory(nbytes: int) -> str:
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        if nbytes and nbytes % _BINARY[suffix] == 0:
            return f"{nbytes // _BINARY[suffix]}{suffix}"
    return str(nbytes)


def parse_duration(value: str | int | float) -> float:
    """Seconds from ``90``, ``"90s"``, ``"15m"``, ``"1h30m"``, ``"2d"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"must not be negative (got {value})")
        return float(value)
    text = str(value).strip()
    if len(text) > 64:  # a user's ?since= or timeLimit: bounded before the regex (quadratic in digits)
        raise ValueError(f"{text[:20]!r}... is too long for a duration (examples: 90s, 15m, 1h30m, 2d)")
    parts = _DURATION.findall(text)
    if not parts or _DURATION.sub("", text).strip():
        raise ValueError(f"{value!r} is not a duration (examples: 90s, 15m, 1h30m, 2d)")
    return float(sum(float(n) * _DURATION_UNITS[u] for n, u in parts))


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            out.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(out[:2])
