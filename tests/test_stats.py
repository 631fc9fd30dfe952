"""inspect --stats: every figure right for every numeric dtype, checked against exact arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npz2mmap
from npz2mmap.summary import field_statistics

SCRIPT = Path(sys.executable).parent / "npz2mmap"


def write_field(out_dir: Path, samples: list[np.ndarray]) -> Path:
    with npz2mmap.Writer(out_dir) as w:
        for sample in samples:
            w.append({"x": sample})
    return out_dir


def inspect_stats(dataset: Path, *options: str) -> subprocess.CompletedProcess:
    """The real console script, so that a RuntimeWarning would reach its stderr as a user sees it."""
    return subprocess.run(
        [SCRIPT, "inspect", str(dataset), "--stats", *options], capture_output=True, text=True, timeout=120
    )


def stats_rows(text: str) -> list[list[str]]:
    """The stats table's header and first row, each split into its cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["field", "count"])
    return [line.split() for line in lines[start:] if line.strip()][:2]


def test_one_nan_is_counted_and_left_out_of_min_max_mean_and_std(tmp_path) -> None:
    dataset = write_field(
        tmp_path / "ds", [np.array([1.5, np.nan], np.float32), np.array([-2, 4.5, np.inf], np.float32)]
    )
    result = inspect_stats(dataset)
    assert (result.returncode, result.stderr) == (0, "")
    # finite values 1.5, -2, 4.5: mean 4/3, variance 127/18
    assert stats_rows(result.stdout) == [
        ["field", "count", "nan", "inf", "min", "max", "mean", "std"],
        ["x", "5", "1", "1", "-2", "inf", "1.33333", "2.65623"],
    ]
    as_json = json.loads(inspect_stats(dataset, "--json").stdout)["stats"]["x"]
    assert as_json == {
        "count": 5,
        "nan": 1,
        "inf": 1,
        "min": -2.0,
        "max": math.inf,
        "mean": pytest.approx(4 / 3, rel=1e-15),
        "std": pytest.approx(math.sqrt(127 / 18), rel=1e-15),
    }


def test_millisecond_timestamps_have_the_std_of_their_spread_not_of_cancellation(tmp_path) -> None:
    timestamps = 1_700_000_000_000 + np.arange(60_000, dtype=np.int64)
    dataset = write_field(tmp_path / "ds", list(timestamps.reshape(100, 600)))
    result = inspect_stats(dataset)
    assert (result.returncode, result.stderr) == (0, "")
    # n consecutive integers: variance (n**2 - 1) / 12 = 299,999,999.9167, std 17,320.508
    assert stats_rows(result.stdout)[1] == [
        "x",
        "60,000",
        "0",
        "0",
        "1700000000000",
        "1700000059999",
        "1.7e+12",
        "17320.5",
    ]
    as_json = json.loads(inspect_stats(dataset, "--json").stdout)["stats"]["x"]
    assert (as_json["min"], as_json["max"], as_json["mean"]) == (
        1_700_000_000_000,
        1_700_000_059_999,
        1_700_000_029_999.5,
    )
    assert as_json["std"] == pytest.approx(math.sqrt((60_000**2 - 1) / 12), rel=1e-12)


def test_values_near_the_float64_limit_neither_overflow_nor_warn(tmp_path) -> None:
    dataset = write_field(tmp_path / "ds", [np.array([1e308, 1e308, -1e308, 1e308])])
    result = inspect_stats(dataset)
    assert (result.returncode, result.stderr) == (0, "")
    # mean 5e307; deviations 5e307 (three times) and -1.5e308: variance 7.5e615
    assert stats_rows(result.stdout)[1] == ["x", "4", "0", "0", "-1e+308", "1e+308", "5e+307", "8.66025e+307"]


def test_uint64_near_two_to_the_64_and_int64_extremes_are_exact(tmp_path) -> None:
    top = 2**64 - 1
    dataset = write_field(tmp_path / "ds", [np.array([top, top - 1, top - 2], np.uint64)])
    stats = field_statistics(dataset)["x"]
    assert (stats["min"], stats["max"], stats["mean"]) == (top - 2, top, float(top - 1))
    assert stats["std"] == pytest.approx(math.sqrt(2 / 3), rel=1e-12)
    extremes = write_field(tmp_path / "ints", [np.array([-(2**63), 2**63 - 1], np.int64)])
    stats = field_statistics(extremes)["x"]
    assert (stats["min"], stats["max"], stats["mean"]) == (-(2**63), 2**63 - 1, -0.5)
    assert stats["std"] == pytest.approx(2**63 - 0.5, rel=1e-15)


def test_a_field_of_only_nan_or_of_no_values_has_counts_and_no_figures(tmp_path) -> None:
    nan = write_field(tmp_path / "nan", [np.array([np.nan, np.nan], np.float16)])
    assert field_statistics(nan)["x"] == {"count": 2, "nan": 2, "inf": 0}
    empty = write_field(tmp_path / "empty", [np.zeros(0, np.float32), np.zeros(0, np.float32)])
    assert field_statistics(empty)["x"] == {"count": 0, "nan": 0, "inf": 0}
    result = inspect_stats(nan)
    assert (result.returncode, result.stderr) == (0, "")
    assert stats_rows(result.stdout)[1] == ["x", "2", "2", "0", "-", "-", "-", "-"]
