"""verify --sources: a source that changed into anything is a mismatch named per sample, never a crash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_npz
from hostile import crc_mismatch, npy_bytes, truncated_zip, zip_with
from hypothesis import given, settings
from strategies import nested_dtypes

import npz2mmap
from npz2mmap.check.verify import value_byte_mask, verify
from npz2mmap.cli.commands import cli
from npz2mmap.write.conversion import convert


def plain_npy(path: Path) -> None:
    """What np.save writes: a .npy file, no zip around it (np.load reads it as an array, not an NpzFile)."""
    with open(path, "wb") as fp:
        np.save(fp, np.arange(12, dtype=np.float32).reshape(3, 4))


def rows(count: int, offset: float = 0.0) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        x = np.arange(count * 4, dtype=np.float32).reshape(count, 4) + offset
        write_npz(path, x=x, t=np.arange(count, dtype=np.int32))

    return write


REPLACEMENTS: dict[str, Callable[[Path], object]] = {
    "plain .npy": plain_npy,
    "truncated zip": truncated_zip,
    "corrupt member": crc_mismatch,
    "empty zip": lambda p: zip_with(p, {}),
    "a key missing": lambda p: write_npz(p, x=np.zeros((3, 4), np.float32)),
    "0-d arrays": lambda p: write_npz(p, x=np.float32(1), t=np.int32(1)),
    "another dtype": lambda p: write_npz(p, x=np.zeros((3, 4), np.int32), t=np.zeros(3, np.int32)),
    "one dimension more": lambda p: write_npz(p, x=np.zeros((3, 4, 1), np.float32), t=np.zeros(3, np.int32)),
    "fewer rows": rows(2),
    "more rows": rows(5),
    "no rows": rows(0),
    "other values": rows(3, offset=0.5),
    "a member shorter than its header": lambda p: zip_with(
        p, {"x.npy": npy_bytes(np.zeros((3, 4), np.float32))[:-8], "t.npy": npy_bytes(np.zeros(3, np.int32))}
    ),
}


@pytest.fixture(params=["files", "rows"])
def converted(request, tmp_path) -> tuple[Path, Path, list[int]]:
    """A dataset of three sources; the middle one's samples (in rows mode, three rows) are returned."""
    src = tmp_path / "src"
    for k in range(3):
        rows(3, offset=10.0 * k)(src / f"s{k}.npz")
    convert([src], tmp_path / "ds", workers=1, rows=request.param == "rows")
    return tmp_path / "ds", src / "s1.npz", [1] if request.param == "files" else [3, 4, 5]


@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_a_changed_source_is_a_mismatch_of_its_own_samples_only(converted, replacement) -> None:
    dataset, source, samples = converted
    source.unlink()
    REPLACEMENTS[replacement](source)
    report = verify(dataset, sources=True)
    assert not report.ok and report.sources_checked
    assert report.bad_samples["sources"] and set(report.bad_samples["sources"]) <= set(samples)
    assert all(f"({source}" in problem and "\n" not in problem for problem in report.problems)


def test_verify_sources_of_a_plain_npy_file_is_one_line_per_sample_and_exit_1(converted) -> None:
    dataset, source, samples = converted
    plain_npy(source)
    result = CliRunner().invoke(cli, ["verify", str(dataset), "--sources", "-q"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    where = [f"({source})"] if len(samples) == 1 else [f"({source} row {row})" for row in range(3)]
    assert result.output.splitlines() == [
        f"sample {i} {w}: {source}: not a valid zip/npz file (File is not a zip file)"
        for i, w in zip(samples, where, strict=True)
    ] + [f"Error: {dataset}: {'1 problem' if len(samples) == 1 else '3 problems'} found"]


def test_verify_sources_of_a_shard_that_shrank_names_its_rows(tmp_path) -> None:
    rows(3)(tmp_path / "src" / "a.npz")
    rows(2)(tmp_path / "src" / "b.npz")
    convert([tmp_path / "src"], tmp_path / "ds", workers=1, rows=True)
    rows(1)(tmp_path / "src" / "a.npz")
    report = verify(tmp_path / "ds", sources=True)
    source = tmp_path / "src" / "a.npz"
    assert report.bad_samples == {"sources": [0, 1, 2] * 2}
    assert report.problems == [
        f"sample {row} ({source} row {row}): field '{key}': the source holds 1 row, not the 3 sources.jsonl names"
        for key in ("t", "x")
        for row in range(3)
    ]


@settings(max_examples=60, deadline=None)
@given(nested_dtypes())
def test_the_value_bytes_of_any_dtype_are_those_numpy_copies_field_by_field(dtype) -> None:
    """Oracle: numpy's structured assignment copies values, never padding, into a zeroed element."""
    zeroed = np.zeros(1, dtype)
    zeroed[...] = np.frombuffer(b"\xff" * dtype.itemsize, dtype)
    copied = np.frombuffer(zeroed.tobytes(), np.uint8) != 0
    assert value_byte_mask(dtype).tolist() == copied.tolist()


def test_a_writer_dataset_of_np_load_arrays_differs_from_its_source_in_record_padding_only(tmp_path) -> None:
    """np.load leaves a record's padding as its fresh array holds it: verify says so, not that values differ."""
    dtype = np.dtype([("a", "u1"), ("b", "<f8")], align=True)  # 7 padding bytes per record
    source = np.frombuffer(np.arange(2 * dtype.itemsize, dtype=np.uint8).tobytes(), dtype)
    np.savez(tmp_path / "s0.npz", x=source, y=np.arange(3))
    with npz2mmap.Writer(tmp_path / "w") as w, np.load(tmp_path / "s0.npz") as z:
        loaded = {key: z[key] for key in z.files}
        loaded["x"] = np.zeros_like(loaded["x"])  # its padding made zero, the source's is not
        loaded["x"][...] = z["x"]
        w.append(loaded, source=tmp_path / "s0.npz")
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "w"), "--sources"])
    assert result.exit_code == 1
    assert result.output == (
        f"sample 0 ({tmp_path / 's0.npz'}): field 'x': the values equal the source's, but record padding bytes "
        "differ\n"
        f"Error: {tmp_path / 'w'}: 1 problem found\n"
    )
