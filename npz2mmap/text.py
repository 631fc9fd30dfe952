"""Words and numbers in messages: sizes, counts and quoted values, as every layer writes them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def human_bytes(nbytes: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as disks and network speeds are quoted)."""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def plural(count: int, noun: str) -> str:
    """1 -> '1 sample', 1000 -> '1,000 samples': a count with its noun in the right number."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def brief(value: Any, limit: int = 240) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages quoting what a file holds.

    Safe for any value decoded from a file: an int too long to print is
    described by its size, and so is a structure too deep to print.
    """
    if type(value) is int and value.bit_length() > 128:
        return f"a {value.bit_length()}-bit integer"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= limit else f"{text[:limit]}..."


def quoted(names: Iterable[str], limit: int = 20) -> str:
    """``'a', ' b'`` (or ``none``): names as repr quotes them, so names that differ only by white
    space are told apart, the first ``limit`` of them and a count of the rest."""
    names = list(names)
    shown = ", ".join(brief(name, 80) for name in names[:limit])
    rest = f", and {len(names) - limit:,} more" if len(names) > limit else ""
    return shown + rest if names else "none"


def printable(text: str) -> str:
    """``text`` with every character Python would not print (controls, bidirectional overrides such
    as U+202E, zero-width ones, lone surrogates) escaped as repr escapes it, for tables of names."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
