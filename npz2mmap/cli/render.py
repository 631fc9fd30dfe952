"""Text rendering for the CLI: sizes, tables, dataset summaries and histograms."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..fsutil import absolute_path
from ..ingest.patterns import Pattern, is_pattern
from ..text import human_bytes, printable


def render_summary(summary: dict[str, Any]) -> str:
    """What `npz2mmap inspect` prints for a dataset: header lines, parts, fields, lengths, stats."""
    lines = [
        f"dataset  {printable(summary['path'])}",
        f"format   {summary['format']} v{summary['version']} (written by npz2mmap {summary['tool_version']})",
        f"samples  {summary['num_samples']:,}",
        _blob_line(summary),
        *_skipped_lines(summary.get("skipped")),
        "",
    ]
    if summary["parts"]:
        lines[2:2] = [f"parts    {len(summary['parts'])}, read in order as one dataset"]
        part_rows = [("part", "samples", "first sample", "blob", "blob bytes")]
        part_rows += [
            (
                printable(p["path"]),
                _part_samples(p),
                f"{p['start']:,}",
                printable(p["blob"]),
                human_bytes(p["blob_nbytes"]),
            )
            for p in summary["parts"]
        ]
        lines += [*_table(part_rows), ""]
    if summary["fields"]:
        rows = [("field", "kind", "dtype", "shape", "bytes")]
        for f in summary["fields"]:
            name = printable(f["name"])
            rows.append((name, f["kind"], f["dtype"], _shape_text(f), human_bytes(f["nbytes"])))
        lines += _table(rows)
    else:
        lines.append("fields   none (no samples)")
    if "stats" in summary:
        stat_rows: list[tuple[str, ...]] = [("field", "count", "nan", "inf", "min", "max", "mean", "std")]
        for name, s in summary["stats"].items():
            counts = [f"{s[k]:,}" for k in ("count", "nan", "inf")]
            figures = [_figure(s[k]) if k in s else "-" for k in ("min", "max", "mean", "std")]
            stat_rows.append((printable(name), *counts, *figures))
        lines += ["", *_table(stat_rows)]
    for f in summary["fields"]:
        if f.get("lengths"):
            lines += ["", *_render_lengths(printable(f["name"]), f["lengths"])]
    return "\n".join(lines)


def _part_samples(part: dict[str, Any]) -> str:
    return "0 (empty)" if part["empty"] else f"{part['num_samples']:,}"


def _blob_line(summary: dict[str, Any]) -> str:
    """The blob's path, or for a dataset of parts how many blobs there are (each is in the parts table)."""
    blobs = summary["blobs"]
    where = f"blob     {printable(blobs[0])}" if len(blobs) == 1 else f"blobs    {len(blobs)}, one per part"
    total = human_bytes(summary["blob_nbytes"]) + ("" if len(blobs) == 1 else " in all")
    return f"{where}, {total}, regions aligned to {summary['align']} B"


def _render_lengths(name: str, stats: dict[str, Any]) -> list[str]:
    """A ragged field's length distribution as one line of figures and a text histogram."""
    axis = stats.get("axis", 0)
    which = "first dimension" if axis == 0 else f"axis {axis}, the first that varies"
    head = (
        f"{name} lengths ({which}): min {stats['min']:,}, p50 {_percentile(stats['p50'])}, "
        f"p90 {_percentile(stats['p90'])}, p99 {_percentile(stats['p99'])}, max {stats['max']:,}, "
        f"mean {stats['mean']:,.1f}"
    )
    counts, edges = stats["histogram"]["counts"], stats["histogram"]["edges"]
    widest = max(counts) or 1
    labels = [_bin_label(edges[k], min(edges[k + 1] - 1, stats["max"])) for k in range(len(counts))]
    width = max(len(label) for label in labels)
    bars = [
        f"  {label.rjust(width)}  {'#' * round(30 * count / widest):<30}  {count:,}"
        for label, count in zip(labels, counts, strict=True)
    ]
    return [head, *bars]


def _percentile(value: float) -> str:
    """A percentile as --json gives it, to two decimals: the median of lengths 1, 2, 9, 10 is 5.5, not 6."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}".rstrip("0")


def _bin_label(first: int, last: int) -> str:
    return f"{first:,}" if first == last else f"{first:,}..{last:,}"


def _shape_text(field: dict[str, Any]) -> str:
    if field["kind"] == "fixed":
        return str(tuple(field["shape"]))
    if not field["min_shape"]:  # no sample to measure: the shape recorded, * where samples may differ
        dims = ["*" if length is None else str(length) for length in field["shape"]]
    else:
        dims = [
            str(lo) if lo == hi else f"{lo}..{hi}"
            for lo, hi in zip(field["min_shape"], field["max_shape"], strict=True)
        ]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def render_sample(info: dict[str, Any]) -> str:
    """What `npz2mmap inspect --sample I` prints: one row of figures per field."""
    rows = [("field", "dtype", "shape", "min", "max", "mean", "nan", "inf")]
    for f in info["fields"]:
        stats = [_figure(f[k]) if k in f else "-" for k in ("min", "max", "mean", "nan", "inf")]
        rows.append((printable(f["name"]), f["dtype"], str(tuple(f["shape"])), *stats))
    source = info.get("source")
    named = "" if source is None else f" (from {printable(source)}" + (
        f", row {info['row']:,})" if "row" in info else ")"
    )
    return "\n".join([f"sample {info['sample']}{named}", *_table(rows)])


def _figure(value: float) -> str:
    """An integer exactly (3000000000, not 3e+09), anything else to 6 significant digits."""
    if isinstance(value, np.floating) and not isinstance(value, float):  # a longdouble float64 cannot hold
        if value == 0 or np.finfo(np.float64).tiny <= abs(value) <= np.finfo(np.float64).max:
            return f"{float(value):.6g}"  # only digits past the 6th were beyond float64
        text = np.format_float_scientific(value, precision=5, unique=False, trim="-")
        return text.replace(".e", "e")  # numpy keeps the point when trimming every digit after it
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render_json(document: Any) -> str:
    """Strict JSON for ``--json``: a NaN or infinite figure is ``null`` (the ``nan``/``inf`` counts say why).

    A longdouble figure that a float64 cannot hold (1e4000, 1e-4940) is a
    string of its digits, as numpy prints it.

    Python's ``json`` would write ``NaN`` and ``Infinity``, which JSON does not
    have and ``jq`` or a browser refuse.
    """
    return json.dumps(_finite_or_null(document), indent=1, allow_nan=False)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, np.floating) and not isinstance(value, float):  # a longdouble beyond float64
        return np.format_float_scientific(value, unique=True)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


class PathsAsGiven:
    """Shows the paths a message names as the user typed the inputs, not as made absolute.

    The conversion works on absolute paths (resolved as the system resolves
    them); a message reads best in the user's own terms: ``data/x.npz`` for
    an input typed ``data``. Other paths (OUT's, a list file's lines) are
    shown as they are.
    """

    def __init__(self, inputs: Sequence[str]) -> None:
        given = sorted(
            (_typed_prefix(path) for path in inputs if path[:1] != "@"),
            key=lambda pair: -len(pair[0]),  # the longest first: data/train before data
        )
        alternatives = [re.escape(absolute) + ("" if not typed else _AFTER_PATH) for absolute, typed in given]
        self._typed = [typed for _, typed in given]
        self._pattern = re.compile(_BEFORE_PATH + "(?:" + "|".join(f"({a})" for a in alternatives) + ")")

    def __call__(self, text: str) -> str:
        if not self._typed:
            return text
        return self._pattern.sub(lambda match: self._typed[(match.lastindex or 1) - 1], text)


def _typed_prefix(path: str) -> tuple[str, str]:
    """The absolute path an input's files start with, and how the user typed it: a pattern's
    files start with the directory it starts from ('d' for 'd/**/*.npz'; none for '*.npz',
    whose files are named from the working directory, the separator after it left out too)."""
    if is_pattern(path):
        base = Pattern(path).base
        if base == os.curdir:
            return os.path.join(absolute_path(base), ""), ""
        path = base
    return absolute_path(path), path.rstrip(os.sep) or path


# A path starts after a character no path holds before it, and ends at one no path holds after it.
_BEFORE_PATH = r"(?<![\w./\\~-])"
_AFTER_PATH = r"(?=[/\\\[:;,)'\"\s]|$)"


def _skipped_lines(skipped: dict[str, Any] | None) -> list[str]:
    """A line for the files --skip-bad left out, naming the first, when there are any."""
    if not skipped or not skipped["count"]:
        return []
    first = skipped["first"][0]
    count = skipped["count"]
    files = f"{count:,} file{'s' if count != 1 else ''}"
    return [
        f"skipped  {files} left out by --skip-bad (skipped.jsonl); the first: {printable(first['reason'])}"
    ]
