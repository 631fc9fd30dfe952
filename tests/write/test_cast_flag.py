"""A field's "cast" is true exactly when some source's dtype differs from the stored one beyond byte order."""

from __future__ import annotations

import json
from pathlib import Path

import hostile
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import convert_part_at, write_npz, write_samples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npz2mmap
from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import SourceError
from npz2mmap.write import conversion
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge

# Same-kind casts between these keep the small values below exactly.
DTYPES = [
    np.dtype(code).newbyteorder(order)
    for code in ("f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2")
    for order in ("<", ">")
]
VALUES = np.array([0, 1, 2, 3])


def stored_casts(dataset: Path) -> dict[str, bool]:
    """Each field's "cast", read from index.json as written."""
    return {f["name"]: f["cast"] for f in json.loads((dataset / "index.json").read_text())["fields"]}


def differs_beyond_byte_order(source: np.dtype, target: np.dtype) -> bool:
    return source.newbyteorder("<") != target.newbyteorder("<")


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_a_cast_that_no_source_needs_is_written_as_false(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"x": VALUES.astype("<f4")}, {"x": VALUES.astype(">f4")}])
    result = run("convert", tmp_path / "src", "-o", tmp_path / "out", "--cast", "x=float32", "-q")
    assert result.exit_code == 0, result.output
    assert stored_casts(tmp_path / "out") == {"x": False}
    write_npz(tmp_path / "src" / "wide.npz", x=VALUES.astype("<f8"))
    result = run("convert", tmp_path / "src", "-o", tmp_path / "mixed", "--cast", "x=float32", "-q")
    assert result.exit_code == 0, result.output
    assert stored_casts(tmp_path / "mixed") == {"x": True}


@st.composite
def sources_and_target(draw: st.DrawFn) -> tuple[list[np.dtype], np.dtype]:
    """A cast target and, for each of a few sources, a dtype that casts to it by the same-kind rule."""
    target = draw(st.sampled_from(DTYPES))
    castable = [d for d in DTYPES if np.can_cast(d, target, casting="same_kind")]
    return draw(st.lists(st.sampled_from(castable), min_size=1, max_size=5)), target


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=sources_and_target(),
    workers=st.sampled_from([1, 2]),
    batch_files=st.integers(1, 3),
    rows=st.booleans(),
)
def test_convert_writes_cast_exactly_when_a_source_dtype_differs(
    tmp_path_factory, case, workers, batch_files, rows
) -> None:
    """One and two workers, scan batches of several files (a differing file need not come first), --rows."""
    dtypes, target = case
    root = tmp_path_factory.mktemp("convert")
    samples = [
        {"x": np.tile(VALUES, (2, 1)).astype(d), "y": np.full(2, k, np.int8)}
        if rows
        else {"x": VALUES.astype(d), "y": np.int8(k)}
        for k, d in enumerate(dtypes)
    ]
    write_samples(root / "src", samples)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversion, "scan_batch_files", lambda num_files, workers: batch_files)
        convert([root / "src"], root / "out", casts={"x": target}, workers=workers, rows=rows)
    expected = any(differs_beyond_byte_order(d, target) for d in dtypes)
    assert stored_casts(root / "out") == {"x": expected, "y": False}
    report = verify(root / "out", sources=True)
    assert report.ok and report.sources_checked, report.problems


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=sources_and_target())
def test_the_writer_writes_cast_exactly_when_a_sample_dtype_differs(tmp_path_factory, case) -> None:
    dtypes, target = case
    out = tmp_path_factory.mktemp("writer") / "out"
    with npz2mmap.Writer(out, casts={"x": target}) as w:
        for d in dtypes:
            w.append({"x": VALUES.astype(d)})
    assert stored_casts(out) == {"x": any(differs_beyond_byte_order(d, target) for d in dtypes)}


def test_a_refused_sample_that_needed_a_cast_leaves_cast_false(tmp_path) -> None:
    """Only samples the writer took count: one refused (a value float16 cannot hold) is not cast."""
    with npz2mmap.Writer(tmp_path / "out", casts={"x": "float16"}) as w:
        w.append({"x": VALUES.astype(np.float16)})
        with pytest.raises(SourceError, match="represents exactly"):
            w.append({"x": np.array([0.1], dtype=np.float64)})
        w.append({"x": VALUES.astype(np.float16)})
    assert stored_casts(tmp_path / "out") == {"x": False}


@pytest.mark.parametrize(("part_dtypes", "expected"), [(("<f4", "<f8"), True), (("<f4", ">f4"), False)])
def test_merge_copy_casts_when_any_part_cast_and_matches_one_conversion(
    tmp_path, part_dtypes, expected
) -> None:
    """Part 0 needs no cast; part 1 needs one or not: the merge's cast is any part's, as one conversion writes."""
    write_samples(tmp_path / "src", [{"x": VALUES.astype(d)} for d in part_dtypes])
    casts = {"x": "float32"}
    for i in range(2):
        convert_part_at([tmp_path / "src"], tmp_path / f"p{i}", (i, 2), casts=casts, workers=1)
    assert [stored_casts(tmp_path / f"p{i}") for i in range(2)] == [{"x": False}, {"x": expected}]
    merge([tmp_path / "p0", tmp_path / "p1"], tmp_path / "merged", copy=True)
    assert stored_casts(tmp_path / "merged") == {"x": expected}
    convert([tmp_path / "src"], tmp_path / "whole", casts=casts, workers=1)
    assert (tmp_path / "merged" / "index.json").read_bytes() == (
        tmp_path / "whole" / "index.json"
    ).read_bytes()
    assert (tmp_path / "merged" / "data.npy").read_bytes() == (tmp_path / "whole" / "data.npy").read_bytes()


def test_verify_sources_compares_exactly_with_and_without_a_cast(tmp_path) -> None:
    """A field stored uncast accepts only its own dtype back; a cast one, the cast of every value."""
    write_samples(tmp_path / "same", [{"x": VALUES.astype("<f4")}, {"x": VALUES.astype(">f4")}])
    write_samples(tmp_path / "mixed", [{"x": VALUES.astype("<f4")}, {"x": VALUES.astype("<f8")}])
    for name in ("same", "mixed"):
        convert([tmp_path / name], tmp_path / f"{name}.mmap", casts={"x": "float32"}, workers=1)
        assert verify(tmp_path / f"{name}.mmap", sources=True).ok
    source = tmp_path / "same" / "s00001.npz"
    write_npz(source, x=VALUES.astype("<f8"))  # the same values, now in a dtype the dataset never cast
    assert verify(tmp_path / "same.mmap", sources=True).problems == [
        f"sample 1 ({source}): field 'x': dtype float32 differs from the source's float64"
    ]
    changed = tmp_path / "mixed" / "s00001.npz"
    write_npz(changed, x=(VALUES + 0.5).astype("<f8"))
    assert verify(tmp_path / "mixed.mmap", sources=True).problems == [
        f"sample 1 ({changed}): field 'x': values differ from the source"
    ]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(("corrupt", "expected"), [("s00002.npz", False), ("s00001.npz", True)])
def test_a_file_left_out_while_copying_takes_its_cast_with_it(tmp_path, workers, corrupt, expected) -> None:
    """--skip-bad drops a file found corrupt only while copying: cast is what the kept files need."""
    values = np.random.default_rng(5).random(20_000).astype(np.float32)  # float64 holds each exactly
    dtypes = ["<f4", "<f4", "<f8", "<f4"]  # the only file that needs the cast is s00002
    write_samples(tmp_path / "src", [{"x": values.astype(d)} for d in dtypes])
    hostile.corrupt_far_past_the_header(tmp_path / "src" / corrupt, "x")
    result = convert(
        [tmp_path / "src"], tmp_path / "out", casts={"x": "float32"}, skip_bad=True, workers=workers
    )
    assert [Path(path).name for path, _ in result.skipped] == [corrupt]
    assert stored_casts(tmp_path / "out") == {"x": expected}
    assert verify(tmp_path / "out", sources=True).ok
