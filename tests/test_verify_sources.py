"""verify --sources: a source that changed into anything is a mismatch named per sample, never a crash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_npz
from hostile import crc_mismatch, npy_bytes, truncated_zip, zip_with

from npz2mmap.cli import cli
from npz2mmap.converter import convert
from npz2mmap.verify import verify


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
