"""warm: reads exactly the blobs every reader checks, through the checked descriptor, on any platform."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import convert_part_at, write_samples

from npz2mmap import fsutil, pagecache
from npz2mmap.check import warm
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError
from npz2mmap.text import human_bytes
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge


class RecordingProgress:
    def __init__(self) -> None:
        self.nbytes = 0

    def stage(self, name: str, total_files: int, total_nbytes: int, unit: str = "files") -> None:
        pass

    def advance(self, files: int, nbytes: int) -> None:
        self.nbytes += nbytes


@pytest.fixture
def dataset(tmp_path) -> Path:
    write_samples(tmp_path / "src", [{"x": np.full(1000, i, dtype=np.float64)} for i in range(8)])
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    return tmp_path / "ds"


def test_warm_reads_every_part_exactly_once_and_reports_it_resident(tmp_path, dataset) -> None:
    for part in range(2):
        convert_part_at([tmp_path / "src"], tmp_path / "parts" / f"p{part}", (part, 2), workers=1)
    merge([tmp_path / "parts" / "p0", tmp_path / "parts" / "p1"], tmp_path / "parts")
    progress = RecordingProgress()
    result = warm.warm(tmp_path / "parts", progress)
    blobs = [tmp_path / "parts" / f"p{part}" / "data.npy" for part in range(2)]
    assert result.blob_paths == tuple(str(blob) for blob in blobs)
    assert progress.nbytes == result.blob_nbytes == sum(blob.stat().st_size for blob in blobs)
    assert result.resident_nbytes == result.blob_nbytes


def test_warm_reads_only_the_blob_it_checked_never_what_replaced_it(monkeypatch, dataset) -> None:
    """A blob replaced after the dataset was opened is checked again, not read blindly to its end."""
    blob = dataset / "data.npy"
    real_parts = warm.Parts

    def parts_then_replace_the_blob(path):
        parts = real_parts(path)
        if not blob.is_symlink():
            bigger = dataset.parent / "bigger.npy"
            bigger.write_bytes(blob.read_bytes())
            os.truncate(bigger, bigger.stat().st_size + (32 << 20))
            blob.unlink()
            blob.symlink_to(bigger)
        return parts

    monkeypatch.setattr(warm, "Parts", parts_then_replace_the_blob)
    progress = RecordingProgress()
    with pytest.raises(FormatError, match="bytes, but the index expects"):
        warm.warm(dataset, progress)
    assert progress.nbytes == 0


def test_warm_where_mincore_is_missing_reports_residency_as_unknown(monkeypatch, dataset) -> None:
    monkeypatch.setattr(fsutil, "mincore", None)
    result = CliRunner().invoke(cli, ["warm", str(dataset), "-q"])
    size = (dataset / "data.npy").stat().st_size
    assert result.exit_code == 0, result.output
    assert result.output == (
        f"{dataset / 'data.npy'}: {human_bytes(size)} read; how much stays resident is unknown on this platform\n"
    )


def test_warm_where_posix_fadvise_is_missing_still_reads_the_whole_blob(monkeypatch, dataset) -> None:
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    monkeypatch.setattr(fsutil, "posix_fadvise", None)
    progress = RecordingProgress()
    result = warm.warm(dataset, progress)
    assert progress.nbytes == result.blob_nbytes == (dataset / "data.npy").stat().st_size
    assert result.resident_nbytes == result.blob_nbytes


def test_load_into_page_cache_reads_through_the_descriptor_and_never_past_the_size(tmp_path) -> None:
    path = tmp_path / "file"
    path.write_bytes(bytes(range(256)) * 100)
    fd = fsutil.open_regular(str(path))
    try:
        os.lseek(fd, 1000, os.SEEK_SET)
        path.unlink()  # whatever the path now names, the descriptor's file is read
        counts: list[int] = []
        assert pagecache.load_into_page_cache(fd, 20_000, counts.append) == 20_000
        assert sum(counts) == 20_000
        assert pagecache.load_into_page_cache(fd, 50_000) == 25_600  # stops at the end of a shorter file
    finally:
        os.close(fd)
