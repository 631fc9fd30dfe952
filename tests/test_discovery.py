"""Discovering sources in INPUT paths: datasets refused, hidden names skipped, one order whatever the listing.

Oracles: the bytes numpy wrote (np.load of each source), the paths the test
itself laid out, and the same tree walked with its directory listings in
other orders (os.scandir patched) or created in another order on tmpfs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_npz
from hypothesis import given, settings
from hypothesis import strategies as st

from npz2mmap.cli import cli
from npz2mmap.converter import convert
from npz2mmap.errors import SourceError
from npz2mmap.inputs import discover_sources
from npz2mmap.reader import DatasetReader
from npz2mmap.verify import verify

WAY_OUT = (
    "not a source: join datasets with npz2mmap merge, or convert its sources again by naming the paths "
    "listed in its "
)


def convert_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["convert", "-q", "--workers", "1", *args])
    return result.exit_code, result.output


def save_npy(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, array)
    return path


def read_sources(dataset: Path) -> list[str]:
    return [json.loads(line) for line in (dataset / "sources.jsonl").read_text().splitlines()]


def stored(dataset: Path, field: str = "x") -> list[bytes]:
    reader = DatasetReader(str(dataset))
    return [reader.view(field, i).tobytes() for i in range(len(reader))]


class _Listing(list):  # type: ignore[type-arg]
    """A directory listing in a chosen order, usable like os.scandir's iterator (also with ``with``)."""

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None


@contextlib.contextmanager
def listing_order(order: Callable[[list[os.DirEntry[str]]], list[os.DirEntry[str]]]) -> Iterator[None]:
    """Every os.scandir in npz2mmap lists its entries in ``order`` (of the file system's order)."""
    real_scandir = os.scandir

    def scandir(path: str = ".") -> _Listing:
        with real_scandir(path) as entries:
            return _Listing(order(list(entries)))

    os.scandir = scandir  # type: ignore[assignment]
    try:
        yield
    finally:
        os.scandir = real_scandir


def reversed_order(entries: list[os.DirEntry[str]]) -> list[os.DirEntry[str]]:
    return entries[::-1]


def by_name(entries: list[os.DirEntry[str]]) -> list[os.DirEntry[str]]:
    return sorted(entries, key=lambda e: e.name)


def by_name_reversed(entries: list[os.DirEntry[str]]) -> list[os.DirEntry[str]]:
    return sorted(entries, key=lambda e: e.name, reverse=True)


def shuffled(seed: int) -> Callable[[list[os.DirEntry[str]]], list[os.DirEntry[str]]]:
    rng = random.Random(seed)

    def order(entries: list[os.DirEntry[str]]) -> list[os.DirEntry[str]]:
        entries = list(entries)
        rng.shuffle(entries)
        return entries

    return order


ORDERS = [by_name, by_name_reversed, reversed_order]


@contextlib.contextmanager
def no_hang(seconds: int = 30) -> Iterator[None]:
    """Fail, rather than wait forever, if something blocks (an open of a pipe without O_NONBLOCK)."""

    def interrupt(*_: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- hidden files and directories are neither sources nor fields -------------------------------------------


APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(4000)


def add_hidden_litter(directory: Path) -> None:
    """What macOS, editors and file managers leave: none of it a sample or a field."""
    (directory / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(100))
    for name in ("._x.npy", "._s0.npz", ".npy", ".npz"):
        (directory / name).write_bytes(APPLE_DOUBLE)
    save_npy(directory / ".Trash-1000" / "files" / "x.npy", np.arange(99.0))
    write_npz(directory / ".Trash-1000" / "files" / "s9.npz", x=np.arange(99.0))


@pytest.mark.parametrize("options", [[], ["--skip-bad"]])
def test_hidden_files_in_sample_dirs_are_not_fields(tmp_path, options) -> None:
    arrays = [np.arange(4.0) + i for i in range(3)]
    for i, array in enumerate(arrays):
        save_npy(tmp_path / "src" / f"s{i}" / "x.npy", array)
        add_hidden_litter(tmp_path / "src" / f"s{i}")
    out = tmp_path / "out"
    code, output = convert_cli(str(tmp_path / "src"), "--sample-dirs", *options, "-o", str(out))
    assert (code, output) == (0, "")
    assert stored(out) == [a.tobytes() for a in arrays]
    assert read_sources(out) == [str(tmp_path / "src" / f"s{i}") for i in range(3)]
    assert not (out / "skipped.jsonl").read_text()
    assert verify(str(out), sources=True).ok


def test_a_hidden_bare_npy_in_a_sample_dir_no_longer_stops_the_conversion(tmp_path) -> None:
    """A file named ``.npy`` would be a field with an empty name."""
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(3.0))
    save_npy(tmp_path / "src" / "s0" / ".npy", np.arange(3.0))
    code, output = convert_cli(str(tmp_path / "src"), "--sample-dirs", "-o", str(tmp_path / "out"))
    assert (code, output) == (0, "")
    assert DatasetReader(str(tmp_path / "out")).field_names == ("x",)


def test_a_directory_holding_only_hidden_npy_files_is_not_a_sample(tmp_path) -> None:
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(3.0))
    (tmp_path / "src" / "litter").mkdir()
    (tmp_path / "src" / "litter" / "._x.npy").write_bytes(APPLE_DOUBLE)
    assert discover_sources([tmp_path / "src"], sample_dirs=True) == [str(tmp_path / "src" / "s0")]


@pytest.mark.parametrize("options", [[], ["--skip-bad"]])
def test_hidden_files_and_directories_in_an_input_tree_are_not_sources(tmp_path, options) -> None:
    arrays = [np.arange(4.0) + i for i in range(3)]
    for i, array in enumerate(arrays):
        write_npz(tmp_path / "src" / f"d{i}" / "s0.npz", x=array)
        add_hidden_litter(tmp_path / "src" / f"d{i}")
    add_hidden_litter(tmp_path / "src")
    out = tmp_path / "out"
    code, output = convert_cli(str(tmp_path / "src"), *options, "-o", str(out))
    assert (code, output) == (0, "")
    assert stored(out) == [a.tobytes() for a in arrays]
    assert not (out / "skipped.jsonl").read_text()


def test_a_hidden_path_named_directly_is_a_source(tmp_path) -> None:
    """Only what a walk finds is skipped when hidden: a path given is converted."""
    hidden = write_npz(tmp_path / ".cache" / ".s0.npz", x=np.arange(3))
    assert discover_sources([hidden]) == [str(hidden)]
    with pytest.raises(SourceError, match=r"^no \.npz or \.npy files found in: "):
        discover_sources([tmp_path / ".cache"])
    write_npz(tmp_path / ".cache" / "s1.npz", x=np.arange(3))
    assert discover_sources([tmp_path / ".cache"]) == [str(tmp_path / ".cache" / "s1.npz")]


HIDDEN_NAMES = (
    st.tuples(st.text("abx._-", max_size=4), st.sampled_from(["", ".npy", ".npz", ".json"]))
    .map(lambda parts: "." + parts[0] + parts[1])
    .filter(lambda name: name not in (".", ".."))
)
LITTER = st.sampled_from([b"", APPLE_DOUBLE, b"PK\x05\x06" + bytes(18), b"\x93NUMPY garbage"])


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.lists(st.tuples(st.integers(0, 3), HIDDEN_NAMES, LITTER, st.booleans()), max_size=6),
    st.booleans(),
    st.booleans(),
)
def test_hidden_names_anywhere_change_nothing_converted(num_samples, litter, sample_dirs, skip_bad) -> None:
    """Hidden files (and directories holding sources) in a tree or a sample directory are never read."""
    with tempfile.TemporaryDirectory() as scratch:
        src = Path(scratch) / "src"
        arrays = [np.arange(3.0) + i for i in range(num_samples)]
        for i, array in enumerate(arrays):
            if sample_dirs:
                save_npy(src / f"s{i}" / "x.npy", array)
            else:
                write_npz(src / f"s{i}" / "s.npz", x=array)
        for where, name, data, as_dir in litter:
            place = src / f"s{where}" if where < num_samples else src
            target = place / name / ("x.npy" if sample_dirs else "s.npz") if as_dir else place / name
            with contextlib.suppress(FileExistsError, NotADirectoryError):  # a name drawn twice
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    target.write_bytes(data)
        out = Path(scratch) / "out"
        convert([src], out, workers=1, sample_dirs=sample_dirs, skip_bad=skip_bad)
        assert stored(out) == [a.tobytes() for a in arrays]
        assert not (out / "skipped.jsonl").read_text()
