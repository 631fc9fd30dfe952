"""Words and numbers in messages: sizes and counts, as every layer writes them."""

from __future__ import annotations


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
