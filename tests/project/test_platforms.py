"""macOS and Windows, played on Linux: every command with the Linux-only facilities taken away.

The fixture removes fcntl (the lock then goes through msvcrt, played here by
flock), pread, pwrite, preadv, posix_fadvise, fallocate, renameat2 and
sync_file_range, and makes the
worker pool spawn; spawned workers inherit the removal through the
environment. Each test checks the outcome against the same work done with
every facility present, or against numpy's reading of the sources.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import convert_part_at, write_samples

from npz2mmap import MmapDataset, MmapLoader, fsutil, parallel
from npz2mmap.cli.commands import cli
from npz2mmap.errors import OutputError
from npz2mmap.write import publish
from npz2mmap.write.conversion import convert

FACILITIES = (
    "fcntl",
    "pread",
    "pwrite",
    "preadv",
    "posix_fadvise",
    "fallocate",
    "renameat2",
    "sync_file_range",
)
NUM_SAMPLES = 12


class FlockAsMsvcrt:
    """Windows' msvcrt lock, played by flock: held per open file, refused at once when taken."""

    LK_NBLCK = 2

    @staticmethod
    def locking(fd: int, mode: int, nbytes: int) -> None:
        assert (mode, nbytes) == (FlockAsMsvcrt.LK_NBLCK, 1)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError, an OSError, like msvcrt


@pytest.fixture
def take_facilities_away(monkeypatch) -> Callable[[], None]:
    """A function that makes this process and the workers it spawns behave as on a laptop."""

    def take_away() -> None:
        monkeypatch.setenv(fsutil.WITHOUT_ENV, ",".join(FACILITIES))
        for name in FACILITIES:
            monkeypatch.setattr(fsutil, name, None)
        monkeypatch.setattr(fsutil, "msvcrt", FlockAsMsvcrt)
        for name in ("pread", "pwrite", "posix_fadvise"):  # so that no code can still reach them
            monkeypatch.delattr(os, name)
        monkeypatch.setattr(parallel, "START_METHOD", "spawn")

    return take_away


@pytest.fixture
def sources(tmp_path) -> Path:
    """C- and Fortran-order members (the latter written through a mapping), ragged and scalar fields."""
    rng = np.random.default_rng(11)
    write_samples(
        tmp_path / "src",
        [
            {
                "image": np.asfortranarray(rng.random((3, 5), dtype=np.float32)),
                "tokens": np.arange(i % 4 + 1, dtype=np.int32) * (i + 1),
                "label": np.int64(i),
            }
            for i in range(NUM_SAMPLES)
        ],
    )
    return tmp_path / "src"


def dataset_files(path: Path) -> dict[str, bytes]:
    return {entry.name: entry.read_bytes() for entry in sorted(path.iterdir())}


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def source_arrays(sources: Path) -> list[dict[str, np.ndarray]]:
    arrays = []
    for path in sorted(sources.glob("*.npz")):
        with np.load(path) as npz:
            arrays.append({key: npz[key] for key in npz.files})
    return arrays


@pytest.mark.parametrize("workers", [1, 2])
def test_convert_and_overwrite_write_the_same_bytes_without_linux_facilities(
    tmp_path, sources, take_facilities_away, workers
) -> None:
    convert([sources], tmp_path / "linux", workers=workers)
    take_facilities_away()
    convert([sources], tmp_path / "laptop", workers=workers)
    assert dataset_files(tmp_path / "laptop") == dataset_files(tmp_path / "linux")

    (tmp_path / "laptop" / "data.npy").write_bytes(b"old")  # replaced by rename, not by an atomic swap
    convert([sources], tmp_path / "laptop", workers=workers, overwrite=True)
    assert dataset_files(tmp_path / "laptop") == dataset_files(tmp_path / "linux")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["laptop", "linux", "src"]


def _facilities_missing(_: int) -> tuple[str, ...]:
    return tuple(name for name in FACILITIES if getattr(fsutil, name) is None)


def test_spawned_workers_inherit_the_missing_facilities(take_facilities_away) -> None:
    take_facilities_away()
    with parallel.worker_map(2, 2) as imap:
        assert list(imap(_facilities_missing, [0, 1])) == [FACILITIES, FACILITIES]


def test_inspect_verify_merge_and_warm_without_linux_facilities(
    tmp_path, sources, take_facilities_away
) -> None:
    whole, parts = tmp_path / "whole", [tmp_path / "part0", tmp_path / "part1"]
    convert([sources], whole, workers=1)
    for i, part in enumerate(parts):
        convert_part_at([sources], part, (i, 2), workers=1)
    reading = [("inspect", whole), ("inspect", whole, "--sample", 3), ("verify", whole, "--sources")]
    on_linux = [run(*command) for command in reading]
    take_facilities_away()

    assert [run(*command) for command in reading] == on_linux
    assert all(code == 0 for code, _ in on_linux)
    assert run("merge", *parts, "-o", tmp_path / "copy", "--copy", "-q")[0] == 0
    assert dataset_files(tmp_path / "copy") == dataset_files(whole)
    assert run("merge", *parts, "-o", tmp_path / "manifest", "-q")[0] == 0
    assert run("verify", tmp_path / "manifest", "--sources", "-q")[0] == 0
    code, output = run("warm", tmp_path / "manifest", "-q")
    assert code == 0, output
    assert output.startswith(f"{tmp_path / 'manifest'} (2 parts): ")
    assert output.endswith(" resident in the page cache (100%)\n")


def test_datasets_and_loaders_read_the_sources_without_linux_facilities(
    tmp_path, sources, take_facilities_away
) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    take_facilities_away()
    convert([sources], tmp_path / "ds", workers=2)
    expected = source_arrays(sources)
    dataset = MmapDataset(tmp_path / "ds")
    for i, arrays in enumerate(expected):
        for key, array in arrays.items():
            assert np.asarray(dataset[i][key]).tobytes() == np.ascontiguousarray(array).tobytes()

    fixed = MmapDataset(tmp_path / "ds", fields=("image", "label"))
    batches = list(DataLoader(fixed, batch_size=5, num_workers=0)) + list(MmapLoader(fixed, 5, prefetch=1))
    starts = [0, 5, 10] * 2
    for start, batch in zip(starts, batches, strict=True):
        chosen = expected[start : start + 5]
        assert torch.equal(batch["image"], torch.from_numpy(np.stack([a["image"] for a in chosen])))
        assert batch["label"].tolist() == [int(a["label"]) for a in chosen]


def test_the_output_lock_without_fcntl_keeps_a_second_conversion_out(
    tmp_path, sources, take_facilities_away
) -> None:
    take_facilities_away()
    with publish.output_lock(str(tmp_path / "out")):
        with pytest.raises(OutputError, match="another npz2mmap conversion or Writer is writing it"):
            convert([sources], tmp_path / "out", workers=1)
    convert([sources], tmp_path / "out", workers=1)
    assert (tmp_path / "out" / "index.json").exists()


def _refusing_fallocate(fd: int, mode: int, offset: int, nbytes: int) -> int:
    ctypes.set_errno(errno.EOPNOTSUPP)
    return -1


@pytest.mark.parametrize("fallocate", [None, _refusing_fallocate], ids=["missing", "refused"])
def test_reserve_without_fallocate_allocates_every_block(tmp_path, monkeypatch, fallocate) -> None:
    """macOS has no fallocate and some file systems refuse it: zeros are written instead."""
    monkeypatch.setattr(fsutil, "fallocate", fallocate)
    nbytes = 3 * fsutil.ZEROS_CHUNK_NBYTES // 2 + 5
    fd = os.open(tmp_path / "blob", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        fsutil.reserve(fd, nbytes)
        allocated = os.fstat(fd).st_blocks * 512
    finally:
        os.close(fd)
    assert (tmp_path / "blob").read_bytes() == bytes(nbytes)
    assert allocated >= nbytes


def test_reserve_without_fallocate_reports_a_full_disk(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(fsutil, "fallocate", None)

    def disk_full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil, "pwrite", disk_full)
    fd = os.open(tmp_path / "blob", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            fsutil.reserve(fd, 100)
    finally:
        os.close(fd)


class Killed(BaseException):
    """The converter dies here, as by SIGKILL: no handler of the project's runs."""


def test_a_converter_killed_between_the_two_renames_loses_no_dataset(
    tmp_path, sources, take_facilities_away, monkeypatch
) -> None:
    """Without renameat2 OUT is moved aside, then replaced; a kill in between leaves it aside, restorable."""
    out = tmp_path / "out"
    convert_part_at([sources], out, (0, 2), workers=1)
    old = dataset_files(out)
    take_facilities_away()
    real_rename = os.rename

    def rename(source: str, target: str) -> None:
        if publish.STAGING_MARK in os.fspath(source) and os.fspath(target) == os.fspath(out):
            raise Killed
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Killed):
        convert([sources], out, workers=1, overwrite=True)
    assert not out.exists()
    monkeypatch.setattr(os, "rename", real_rename)

    with pytest.raises(OutputError, match="out: already exists"):
        convert([sources], out, workers=1)
    assert dataset_files(out) == old
    convert([sources], out, workers=1, overwrite=True)
    assert json.loads((out / "index.json").read_text())["num_samples"] == NUM_SAMPLES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
