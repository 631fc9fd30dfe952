"""inspect --stats: every figure right for every numeric dtype, checked against exact arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import warnings
from decimal import Decimal, localcontext
from fractions import Fraction
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import extreme_arrays, numeric_dtypes

import npz2mmap
from npz2mmap.check import summary
from npz2mmap.check.summary import field_statistics
from npz2mmap.cli.render import render_json

SCRIPT = Path(sys.executable).parent / "npz2mmap"
SMALLEST_SUBNORMAL = 5e-324


def write_field(out_dir: Path, samples: list[np.ndarray]) -> Path:
    """One field ``x`` of these samples; random sizes may look nearly fixed, which is not under test here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", npz2mmap.errors.RaggedFieldWarning)
        with npz2mmap.Writer(out_dir) as w:
            for sample in samples:
                w.append({"x": sample})
    return out_dir


def inspect_stats(dataset: Path, *options: str) -> subprocess.CompletedProcess:
    """The real console script, so that a RuntimeWarning would reach its stderr as a user sees it."""
    return subprocess.run(
        [SCRIPT, "inspect", str(dataset), "--stats", *options], capture_output=True, text=True, timeout=120
    )


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses ``NaN`` and ``Infinity``, which are not JSON (jq refuses them too)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


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
    as_json = strict_json(inspect_stats(dataset, "--json").stdout)["stats"]["x"]
    assert as_json == {
        "count": 5,
        "nan": 1,
        "inf": 1,
        "min": -2.0,
        "max": None,  # infinite: strict JSON has no Infinity
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


def exact_figures(values: np.ndarray) -> dict[str, Any]:
    """What the statistics must be, from Python ints and exact rationals (never numpy's sums)."""
    if values.dtype.kind in "biu":
        present = [int(v) for v in values.tolist()]
        finite = [Fraction(v) for v in present]
        nan = inf = 0
    else:
        nan = int(np.isnan(values).sum())
        inf = int(np.isinf(values).sum())
        present = [float(v) for v in values if not np.isnan(v)]
        finite = [Fraction(*v.as_integer_ratio()) for v in values if np.isfinite(v)]
    out: dict[str, Any] = {"count": values.size, "nan": nan, "inf": inf}
    if present:
        out.update(min=min(present), max=max(present))
    if finite:
        mean = sum(finite) / len(finite)
        variance = sum((v - mean) ** 2 for v in finite) / len(finite)
        with localcontext() as context:
            context.prec = 40
            std = float((Decimal(variance.numerator) / Decimal(variance.denominator)).sqrt())
        out.update(mean=float(mean), std=std, peak=float(max(abs(v) for v in finite)))
    return out


def assert_matches_exact(got: dict[str, Any], values: np.ndarray) -> None:
    """Counts, min and max exactly; mean and std within rounding of the data's own size.

    A formula that cancels (E[x^2] - mean^2 on 1.7e12 + noise) is off by about
    sqrt(2**-52) * 1.7e12 = 25,000, far beyond 1e-13 of the largest value.
    """
    exact = exact_figures(values)
    assert {k: got.get(k) for k in ("count", "nan", "inf", "min", "max")} == {
        k: exact.get(k) for k in ("count", "nan", "inf", "min", "max")
    }
    assert ("mean" in got, "std" in got) == ("mean" in exact, "std" in exact)
    if "mean" in exact:
        slack = 1e-13 * exact["peak"] + 2 * SMALLEST_SUBNORMAL
        assert abs(got["mean"] - exact["mean"]) <= slack, (got, exact)
        assert abs(got["std"] - exact["std"]) <= 1e-9 * exact["std"] + slack, (got, exact)


@settings(max_examples=150, deadline=None)
@given(dtype=numeric_dtypes(), data=st.data())
def test_statistics_match_exact_arithmetic_over_extremes(dtype, data) -> None:
    values = data.draw(extreme_arrays(dtype), label="values")
    cuts = sorted(data.draw(st.lists(st.integers(0, values.size), max_size=4), label="cuts"))
    chunk_nbytes = data.draw(st.sampled_from([1, 24, 80, 64 << 20]), label="chunk_nbytes")
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_field(Path(tmp) / "ds", np.split(values, cuts))
        with (
            mock.patch.object(summary, "STATS_CHUNK_NBYTES", chunk_nbytes),
            warnings.catch_warnings(),
            np.errstate(over="raise", invalid="raise", divide="raise"),
        ):
            warnings.simplefilter("error")
            got = field_statistics(dataset)["x"]
    assert_matches_exact(got, values)


def inspect_sample(dataset: Path, i: int, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SCRIPT, "inspect", str(dataset), "--sample", str(i), *options],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_sample_with_nan_shows_its_counts_and_the_figures_of_the_rest(tmp_path) -> None:
    dataset = write_field(tmp_path / "ds", [np.array([1.5, np.nan, -2.0, np.inf], np.float64)])
    result = inspect_sample(dataset, 0)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:] == [
        "field  dtype    shape  min  max  mean   nan  inf",
        "x      float64  (4,)   -2   inf  -0.25  1    1",
    ]
    figures = strict_json(inspect_sample(dataset, 0, "--json").stdout)["fields"][0]
    assert figures == {
        "name": "x",
        "shape": [4],
        "dtype": "float64",
        "min": -2.0,
        "max": None,
        "mean": -0.25,
        "nan": 1,
        "inf": 1,
    }


def test_a_sample_near_the_float64_limit_has_its_mean_without_a_warning(tmp_path) -> None:
    dataset = write_field(tmp_path / "ds", [np.full(4, 1e308)])
    result = inspect_sample(dataset, 0, "--json")
    assert (result.returncode, result.stderr) == (0, "")
    assert strict_json(result.stdout)["fields"][0]["mean"] == 1e308


def test_a_sample_of_timestamps_has_its_exact_extremes_and_mean(tmp_path) -> None:
    stamps = 1_700_000_000_000 + np.arange(3, dtype=np.int64)
    dataset = write_field(tmp_path / "ds", [stamps])
    figures = strict_json(inspect_sample(dataset, 0, "--json").stdout)["fields"][0]
    assert (figures["min"], figures["max"], figures["mean"]) == (
        1_700_000_000_000,
        1_700_000_000_002,
        1.700000000001e12,
    )


@given(
    values=st.lists(
        st.sampled_from([0.0, 1.0, -1e308, 1e308, math.nan, math.inf, -math.inf]), min_size=1, max_size=8
    )
)
@settings(max_examples=40, deadline=None)
def test_json_output_of_any_sample_is_strict_json(values: list[float]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_field(Path(tmp) / "ds", [np.array(values)])
        info = summary.describe_sample(dataset, 0)
        strict_json(render_json(info))


LONGDOUBLE_WIDER = np.finfo(np.longdouble).max > np.finfo(np.float64).max


@pytest.mark.skipif(not LONGDOUBLE_WIDER, reason="longdouble is float64 on this platform")
def test_longdouble_figures_beyond_float64_keep_their_value(tmp_path) -> None:
    """float128's max and tiny are no inf and no 0: the figures stay longdouble, text and JSON alike."""
    info = np.finfo(np.longdouble)
    values = np.array([info.max, info.tiny, 1], dtype=np.longdouble)
    dataset = write_field(tmp_path / "ds", [values[:1], values[1:]])
    result = inspect_stats(dataset, "--json")
    assert (result.returncode, result.stderr) == (0, "")
    figures = strict_json(result.stdout)["stats"]["x"]
    assert (figures["count"], figures["nan"], figures["inf"]) == (3, 0, 0)
    assert np.longdouble(figures["min"]) == info.tiny and np.longdouble(figures["max"]) == info.max
    mean, std = np.longdouble(figures["mean"]), np.longdouble(figures["std"])
    assert abs(mean - info.max / 3) <= info.max / 3 * 1e-15  # pytest.approx would compare as float: inf
    assert abs(std - info.max / 3 * np.sqrt(np.longdouble(2))) <= info.max * 1e-12
    rows = stats_rows(inspect_stats(dataset).stdout)
    assert rows[1][4:6] == ["3.3621e-4932", "1.18973e+4932"]
    sample = strict_json(inspect_sample(dataset, 1, "--json").stdout)["fields"][0]
    assert np.longdouble(sample["min"]) == info.tiny and sample["max"] == 1.0


@pytest.mark.skipif(not LONGDOUBLE_WIDER, reason="longdouble is float64 on this platform")
def test_longdouble_extremes_whose_spread_overflows_print_no_warning(tmp_path) -> None:
    """max - min of -max and max overflows longdouble: the bound is taken otherwise, and nothing is said."""
    info = np.finfo(np.longdouble)
    dataset = write_field(tmp_path / "ds", [np.array([-info.max, info.max, 1], np.longdouble)])
    for run in (inspect_stats(dataset, "--json"), inspect_sample(dataset, 0, "--json")):
        assert (run.returncode, run.stderr) == (0, "")
    figures = strict_json(inspect_stats(dataset, "--json").stdout)["stats"]["x"]
    assert np.longdouble(figures["max"]) == info.max and np.longdouble(figures["min"]) == -info.max


def exact_longdouble(values: np.ndarray) -> tuple[Fraction, Fraction]:
    """Mean and variance of longdouble values from their exact rationals."""
    exact = [Fraction(*v.as_integer_ratio()) for v in values]
    mean = sum(exact) / len(exact)
    return mean, sum((v - mean) ** 2 for v in exact) / len(exact)


@pytest.mark.skipif(not LONGDOUBLE_WIDER, reason="longdouble is float64 on this platform")
@settings(max_examples=60, deadline=None)
@given(
    exponent=st.integers(-60, 60),
    steps=st.lists(st.integers(0, 1000), min_size=2, max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=3),
)
def test_longdouble_digits_beyond_float64_count_in_mean_and_std(exponent, steps, cuts) -> None:
    """Values that differ only past float64's digits (2**e * (1 + k * eps)) have their own mean
    and spread, within a few longdouble ulps, not float64's rounding of them (spread 0)."""
    eps = np.finfo(np.longdouble).eps
    values = np.ldexp(np.longdouble(1) + np.array(steps, dtype=np.longdouble) * eps, exponent)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_field(Path(tmp) / "ds", np.split(values, sorted(c % (len(values) + 1) for c in cuts)))
        got = field_statistics(dataset)["x"]
    mean, variance = exact_longdouble(values)
    ulp = Fraction(*np.ldexp(eps, exponent + 1).as_integer_ratio())
    assert abs(Fraction(*np.longdouble(got["mean"]).as_integer_ratio()) - mean) <= 2 * ulp
    std = Fraction(*np.longdouble(got["std"]).as_integer_ratio())
    assert abs(std * std - variance) <= variance * Fraction(1, 10**6) + 4 * ulp * ulp
    assert np.longdouble(got["min"]) == values.min() and np.longdouble(got["max"]) == values.max()


@pytest.mark.skipif(not LONGDOUBLE_WIDER, reason="longdouble is float64 on this platform")
def test_longdouble_figures_beyond_float64_precision_in_text_and_json(tmp_path) -> None:
    """2**64 and 2**64 + 4: JSON keeps the digits float64 lacks; text shows 6 digits, as for floats."""
    values = np.array([2**64, 2**64 + 4], dtype=np.longdouble)
    dataset = write_field(tmp_path / "ds", [values])
    figures = strict_json(inspect_stats(dataset, "--json").stdout)["stats"]["x"]
    assert (figures["min"], figures["max"]) == (2.0**64, "1.844674407370955162e+19")
    assert np.longdouble(figures["mean"]) == np.longdouble(2**64 + 2) and figures["std"] == 2.0
    assert stats_rows(inspect_stats(dataset).stdout)[1] == [
        "x",
        "2",
        "0",
        "0",
        "1.84467e+19",
        "1.84467e+19",
        "1.84467e+19",
        "2",
    ]
    sample = strict_json(inspect_sample(dataset, 0, "--json").stdout)["fields"][0]
    assert sample["max"] == "1.844674407370955162e+19"
    assert np.longdouble(sample["mean"]) == np.longdouble(2**64 + 2)
