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
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import no_hang, write_npz
from hypothesis import example, given, settings
from hypothesis import strategies as st

from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import Npz2mmapError, SourceError
from npz2mmap.ingest.discover import discover_sources, npy_with_sample_dirs
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write import publish
from npz2mmap.write.conversion import convert

WAY_OUT = (
    "not a source: join datasets with npz2mmap merge, or convert its sources again by naming the paths "
    "listed in its "
)


def convert_cli(*args: str) -> tuple[int, str]:
    workers = [] if "--workers" in args else ["--workers", "1"]
    result = CliRunner().invoke(cli, ["convert", "-q", *workers, *args])
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


@pytest.mark.parametrize("options", [[], ["--skip-bad"]])
def test_other_files_in_a_sample_dir_npz_ones_too_are_not_samples(tmp_path, options) -> None:
    """The docs: a sample directory's files other than NAME.npy are ignored; a backup.npz beside x.npy
    was once converted as a sample of its own, between its directory and the next."""
    arrays = [np.arange(3) + 10 * i for i in range(3)]
    for i, array in enumerate(arrays):
        save_npy(tmp_path / "src" / f"s{i}" / "x.npy", array)
        write_npz(tmp_path / "src" / f"s{i}" / "backup.npz", x=array + 100)
        write_npz(tmp_path / "src" / f"s{i}" / "OLD.NPZ", x=array + 200)
        (tmp_path / "src" / f"s{i}" / "notes.txt").write_text("not a field")
    write_npz(tmp_path / "src" / "loose" / "a.npz", x=np.arange(3) + 30)  # no .npy beside it: an NPZ sample
    out = tmp_path / "out"
    code, output = convert_cli(str(tmp_path / "src"), "--sample-dirs", *options, "-o", str(out))
    assert (code, output) == (0, "")
    assert stored(out) == [(np.arange(3) + 30).tobytes()] + [a.tobytes() for a in arrays]  # sorted by path
    assert read_sources(out) == [str(tmp_path / "src" / "loose" / "a.npz")] + [
        str(tmp_path / "src" / f"s{i}") for i in range(3)
    ]


def test_a_hidden_bare_npy_in_a_sample_dir_no_longer_stops_the_conversion(tmp_path) -> None:
    """A file named ``.npy`` would be a field with an empty name."""
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(3.0))
    save_npy(tmp_path / "src" / "s0" / ".npy", np.arange(3.0))
    code, output = convert_cli(str(tmp_path / "src"), "--sample-dirs", "-o", str(tmp_path / "out"))
    assert (code, output) == (0, "")
    assert DatasetReader(str(tmp_path / "out")).field_names == ("x",)


def test_a_field_in_a_sample_dir_twice_names_both_of_its_files(tmp_path) -> None:
    """x.npy beside x.NPY: the message named only the second."""
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(3.0))
    (tmp_path / "src" / "s0" / "x.NPY").write_bytes((tmp_path / "src" / "s0" / "x.npy").read_bytes())
    code, output = convert_cli(str(tmp_path / "src"), "--sample-dirs", "-o", str(tmp_path / "out"))
    assert code == 1 and output.startswith(
        f"Error: {tmp_path / 'src' / 's0'}: field 'x' appears twice (x.NPY and x.npy)"
    ), output


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


# --- one order whatever the file system lists -------------------------------------------------------------


def versioned_tree(root: Path, creation_order: list[str]) -> None:
    """``m/``, ``v3/`` and ``latest -> v3``, made in ``creation_order``; samples numbered by content."""
    makers = {
        "m": lambda: write_npz(root / "m" / "s0.npz", x=np.array([0])),
        "v3": lambda: [write_npz(root / "v3" / f"s{i}.npz", x=np.array([3, i])) for i in range(2)],
        "latest": lambda: os.symlink("v3", root / "latest"),
    }
    root.mkdir(parents=True)
    for name in creation_order:
        makers[name]()


@pytest.mark.parametrize("order", ORDERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("sample_dirs", [False, True])
def test_a_directory_reached_twice_is_walked_under_its_sorted_first_path(
    tmp_path, order, sample_dirs
) -> None:
    """``latest`` sorts before ``v3``: its files are named through the link, whatever readdir says first."""
    versioned_tree(tmp_path / "src", ["v3", "m", "latest"])
    with listing_order(order):
        found = discover_sources([tmp_path / "src"], sample_dirs=sample_dirs)
    assert found == [str(tmp_path / "src" / p) for p in ("latest/s0.npz", "latest/s1.npz", "m/s0.npz")]


@pytest.mark.parametrize("order", ORDERS, ids=lambda f: f.__name__)
def test_a_sample_dir_reached_twice_is_the_sample_at_its_sorted_first_path(tmp_path, order) -> None:
    save_npy(tmp_path / "src" / "v3" / "x.npy", np.arange(3.0))
    save_npy(tmp_path / "src" / "m" / "x.npy", np.arange(2.0))
    os.symlink("v3", tmp_path / "src" / "latest")
    with listing_order(order):
        found = discover_sources([tmp_path / "src"], sample_dirs=True)
    assert found == [str(tmp_path / "src" / "latest"), str(tmp_path / "src" / "m")]


@pytest.mark.parametrize("order", ORDERS, ids=lambda f: f.__name__)
def test_a_file_reached_twice_is_named_by_the_same_two_paths_in_any_listing_order(tmp_path, order) -> None:
    versioned_tree(tmp_path / "src", ["v3", "m", "latest"])
    os.symlink(tmp_path / "src" / "v3" / "s1.npz", tmp_path / "src" / "m" / "s1.npz")
    with listing_order(order), pytest.raises(SourceError) as caught:
        discover_sources([tmp_path / "src"])
    assert str(caught.value) == (
        f"{tmp_path / 'src' / 'm' / 's1.npz'}: is the same file as {tmp_path / 'src' / 'latest' / 's1.npz'}; "
        "each sample file may appear only once"
    )


def tmpfs_dir() -> str | None:
    """A directory on tmpfs, whose listings follow creation order (unlike ext4's hashed order)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.mark.skipif(tmpfs_dir() is None, reason="needs /dev/shm (tmpfs)")
def test_trees_created_in_other_orders_convert_to_the_same_bytes() -> None:
    with tempfile.TemporaryDirectory(dir=tmpfs_dir()) as scratch:
        roots = [Path(scratch) / "one", Path(scratch) / "two"]
        versioned_tree(roots[0], ["m", "v3", "latest"])
        versioned_tree(roots[1], ["latest", "v3", "m"])
        listings = [os.listdir(root) for root in roots]
        if listings[0] == listings[1]:
            pytest.skip("this file system lists entries in one order whatever the creation order")
        for root in roots:
            convert([root], root.with_suffix(".mmap"), workers=1)
        outs = [root.with_suffix(".mmap") for root in roots]
        expected = [np.array([3, 0]).tobytes(), np.array([3, 1]).tobytes(), np.array([0]).tobytes()]
        assert stored(outs[0]) == stored(outs[1]) == expected
        for root, out in zip(roots, outs, strict=True):
            relative = [os.path.relpath(p, root) for p in read_sources(out)]
            assert relative == ["latest/s0.npz", "latest/s1.npz", "m/s0.npz"]
        assert (outs[0] / "data.npy").read_bytes() == (outs[1] / "data.npy").read_bytes()


NAMES = ["a", "a-b", "a.b", "b", "latest", "m", "v3", "z"]


@st.composite
def linked_trees(draw: st.DrawFn) -> dict[str, list[tuple[str, ...]]]:
    """Directories (one or two levels) of NPZ files, with symlinks at the root or in them to
    directories (loops included) and files; names chosen so that '-' and '.' sort before '/'."""
    tops = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    dirs = list(tops)
    for top in tops:
        inner = draw(st.none() | st.sampled_from(NAMES))
        if inner is not None:
            dirs.append(f"{top}/{inner}")
    files = [(d, f"s{k}.npz") for d in dirs for k in range(draw(st.integers(0, 2)))]
    places = ["", *dirs]
    targets = dirs + [f"{d}/{name}" for d, name in files]
    links = draw(
        st.lists(
            st.tuples(st.sampled_from(places), st.sampled_from(NAMES), st.sampled_from(targets)), max_size=3
        )
    )
    taken = set(dirs) | {f"{d}/{n}" for d, n in files}
    kept = []
    for place, name, target in links:
        path = f"{place}/{name}" if place else name
        if path not in taken and not any(t.startswith(path + "/") for t in taken):
            taken.add(path)
            kept.append((path, target))
    return {"dirs": [(d,) for d in dirs], "files": files, "links": kept}


def build_tree(root: Path, spec: dict[str, list[tuple[str, ...]]], creation_seed: int) -> None:
    """Make the tree, its entries created in an order drawn from ``creation_seed``; file k holds [k]."""
    steps: list[Callable[[], object]] = []
    for k, (directory, name) in enumerate(spec["files"]):
        steps.append(lambda d=directory, n=name, k=k: write_npz(root / d / n, x=np.array([k])))
    for path, target in spec["links"]:
        steps.append(lambda p=path, t=target: os.symlink(root / t, root / p))
    random.Random(creation_seed).shuffle(steps)
    root.mkdir()
    for (directory,) in spec["dirs"]:
        (root / directory).mkdir(parents=True, exist_ok=True)
    for step in steps:
        with contextlib.suppress(FileExistsError):
            step()


def outcome(run: Callable[[], list[str]], root: Path) -> list[str] | str:
    """What discovery gives: the paths relative to ``root``, or the error with ``root`` taken out."""
    try:
        return [os.path.relpath(p, root) for p in run()]
    except Npz2mmapError as exc:
        return str(exc).replace(str(root), "ROOT")


VERSIONED = {
    "dirs": [("m",), ("v3",)],
    "files": [("m", "s0.npz"), ("v3", "s0.npz"), ("v3", "s1.npz")],
    "links": [("latest", "v3")],
}


@settings(max_examples=60, deadline=None)
@given(linked_trees(), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
@example(VERSIONED, 0, 1)
def test_discovery_and_converted_bytes_do_not_depend_on_listing_or_creation_order(
    spec, seed, creation_seed
) -> None:
    with tempfile.TemporaryDirectory(dir=tmpfs_dir()) as scratch:
        roots = [Path(scratch) / "one", Path(scratch) / "two"]
        build_tree(roots[0], spec, creation_seed)
        build_tree(roots[1], spec, creation_seed + 1)
        outcomes = []
        for root in roots:
            for order in (*ORDERS, shuffled(seed)):
                with listing_order(order):
                    outcomes.append(outcome(lambda r=root: discover_sources([r]), root))
        assert all(o == outcomes[0] for o in outcomes), outcomes
        if isinstance(outcomes[0], str):
            return
        assert outcomes[0] == sorted(outcomes[0])
        converted = []
        for root, order in zip(roots, (by_name, by_name_reversed), strict=True):
            with listing_order(order):
                convert([root], root.with_suffix(".mmap"), workers=1)
            out = root.with_suffix(".mmap")
            sources = [os.path.relpath(p, root) for p in read_sources(out)]
            converted.append(((out / "data.npy").read_bytes(), (out / "index.json").read_bytes(), sources))
        assert converted[0] == converted[1]


# --- a dataset is never a source ------------------------------------------------------------------


def make_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """A converted dataset of three samples, and the directory of its sources."""
    sources = tmp_path / "src"
    for i in range(3):
        write_npz(sources / f"s{i}.npz", x=np.arange(3) + i)
    convert([sources], tmp_path / "images.mmap", workers=1)
    return tmp_path / "images.mmap", sources


def dataset_case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """INPUT arguments naming a dataset one way, and the error they must give."""
    dataset, sources = make_dataset(tmp_path)
    index_held = f"is an npz2mmap dataset (it holds index.json), {WAY_OUT}sources.jsonl"
    if case == "dataset":
        return [str(dataset)], f"{dataset}: {index_held}"
    if case == "blob named directly":
        blob = dataset / "data.npy"
        lies_in = f"lies in an npz2mmap dataset (its directory holds index.json), {WAY_OUT}sources.jsonl"
        return [str(blob)], f"{blob}: {lies_in}"
    if case == "manifest":
        result = CliRunner().invoke(cli, ["merge", "-q", str(dataset), "-o", str(tmp_path / "parts")])
        assert result.exit_code == 0, result.output
        manifest_held = f"is an npz2mmap dataset (it holds manifest.json), {WAY_OUT}parts' sources.jsonl"
        return [str(tmp_path / "parts")], f"{tmp_path / 'parts'}: {manifest_held}"
    tree = tmp_path / "tree"
    shutil.copytree(sources, tree / "raw")
    shutil.copytree(dataset, tree / "deep" / "old.mmap")
    if case == "dataset in a tree":
        return [str(tree)], f"{tree / 'deep' / 'old.mmap'}: {index_held}"
    (tmp_path / "list.txt").write_text("tree\n")
    listed = f"{tmp_path / 'list.txt'}, line 1: {tree / 'deep' / 'old.mmap'}: {index_held}"
    return [f"@{tmp_path / 'list.txt'}"], listed


@pytest.mark.parametrize(
    "case", ["dataset", "blob named directly", "manifest", "dataset in a tree", "listed tree"]
)
@pytest.mark.parametrize("options", [[], ["--skip-bad"], ["--sample-dirs"], ["--sample-dirs", "--skip-bad"]])
def test_a_dataset_named_as_input_is_refused_with_the_way_out(tmp_path, case, options) -> None:
    """--skip-bad does not skip it: a dataset among the inputs is a mistake, not a bad file."""
    inputs, message = dataset_case(tmp_path, case)
    expected_code = 1
    if case == "blob named directly" and "--sample-dirs" in options:  # refused before any look at it
        message = npy_with_sample_dirs(inputs[0])
        expected_code = 2
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, output = convert_cli(*inputs, *options, "-o", str(tmp_path / "again.mmap"))
    assert code == expected_code
    assert output.splitlines()[-1] == f"Error: {message}"
    assert not (tmp_path / "again.mmap").exists()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_the_way_out_given_works(tmp_path) -> None:
    """merge joins the dataset; its sources.jsonl names files that convert to the very same bytes."""
    dataset, _ = make_dataset(tmp_path)
    result = CliRunner().invoke(cli, ["merge", "-q", "--copy", str(dataset), "-o", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    convert(read_sources(dataset), tmp_path / "again.mmap", workers=1)
    for copy in ("merged", "again.mmap"):
        assert (tmp_path / copy / "data.npy").read_bytes() == (dataset / "data.npy").read_bytes()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("name", ["index.json", "manifest.json"])
def test_a_pipe_named_like_an_index_is_not_opened_and_makes_no_dataset(tmp_path, name) -> None:
    write_npz(tmp_path / "src" / "a" / "s0.npz", x=np.arange(3))
    blob = save_npy(tmp_path / "src" / "a" / "data.npy", np.arange(3))
    os.mkfifo(tmp_path / "src" / "a" / name)
    with no_hang():
        assert discover_sources([tmp_path / "src"]) == [str(blob), str(tmp_path / "src" / "a" / "s0.npz")]
        assert discover_sources([blob]) == [str(blob)]


def test_looking_for_datasets_opens_only_files_named_like_an_index(tmp_path, monkeypatch) -> None:
    """One stat and one listing per directory, as before; only a regular index.json is opened."""
    for directory in ("a", "b", "c"):
        for i in range(20):
            write_npz(tmp_path / "src" / directory / f"s{i:02d}.npz", x=np.arange(3))
    (tmp_path / "src" / "b" / "index.json").write_text('{"format": "other-tool"}')
    (tmp_path / "src" / "c" / "manifest.json").mkdir()
    opened: list[str] = []
    stats: list[str] = []
    real_open, real_stat = os.open, os.stat
    monkeypatch.setattr(
        os, "open", lambda path, *a, **k: opened.append(os.fspath(path)) or real_open(path, *a, **k)
    )
    monkeypatch.setattr(
        os, "stat", lambda path, *a, **k: stats.append(os.fspath(path)) or real_stat(path, *a, **k)
    )
    found = discover_sources([tmp_path / "src"])
    assert len(found) == 60
    assert opened == [str(tmp_path / "src" / "b" / "index.json")]
    src = str(tmp_path / "src")
    walked = [src, *(os.path.join(src, d) for d in ("a", "b", "c", "c/manifest.json"))]
    assert sorted(stats) == sorted([src, *walked])  # the input's isdir, then one per directory walked


@pytest.mark.parametrize(
    "text",
    ['{"format": "other-tool", "files": ["s0.npz"]}', "not json", '{"format": "npz2mmap"', "[" * 100000],
)
@pytest.mark.parametrize("name", ["index.json", "manifest.json"])
def test_another_tools_index_beside_sources_makes_no_dataset(tmp_path, name, text) -> None:
    """Only npz2mmap's own index.json or manifest.json marks a dataset; sources often come with others."""
    write_npz(tmp_path / "src" / "s0.npz", x=np.arange(3))
    save_npy(tmp_path / "src" / "data.npy", np.arange(3))
    (tmp_path / "src" / name).write_text(text)
    found = discover_sources([tmp_path / "src"])
    assert found == [str(tmp_path / "src" / "data.npy"), str(tmp_path / "src" / "s0.npz")]
    assert discover_sources([tmp_path / "src" / "data.npy"]) == [str(tmp_path / "src" / "data.npy")]


@pytest.mark.parametrize("mark", [publish.STAGING_MARK, publish.RETIRED_MARK])
@pytest.mark.parametrize("complete", [False, True])
def test_a_conversions_hidden_directories_in_a_tree_are_not_sources(tmp_path, mark, complete) -> None:
    """A conversion in progress, killed or replacing a dataset leaves .OUT.npz2mmap-tmp-*/-old-* beside OUT."""
    dataset, sources = make_dataset(tmp_path)
    tree = tmp_path / "tree"
    shutil.copytree(sources, tree)
    leftover = tree / f".images.mmap{mark}1a2b3c4d"
    shutil.copytree(dataset, leftover)
    if not complete:  # the index is written last
        (leftover / "index.json").unlink()
    code, output = convert_cli(str(tree), "-o", str(tmp_path / "again.mmap"))
    assert (code, output) == (0, "")
    assert read_sources(tmp_path / "again.mmap") == [str(tree / f"s{i}.npz") for i in range(3)]


@settings(max_examples=40, deadline=None)
@given(linked_trees(), st.data())
def test_a_dataset_anywhere_in_a_tree_is_refused_unless_hidden(spec, data) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "root"
        build_tree(root, {**spec, "links": []}, 0)
        place = data.draw(st.sampled_from(["", *(d for (d,) in spec["dirs"])]))
        name = data.draw(st.sampled_from(["out.mmap", ".out.mmap.npz2mmap-tmp-0a1b2c3d", "parts"]))
        marker = data.draw(st.sampled_from(["index.json", "manifest.json"]))
        dataset = root / place / name
        dataset.mkdir()
        document = {"format": "npz2mmap" if marker == "index.json" else "npz2mmap-parts", "version": 2}
        (dataset / marker).write_text(json.dumps(document))
        save_npy(dataset / "data.npy", np.zeros(3, np.uint8))
        sample_dirs = data.draw(st.booleans())
        with listing_order(data.draw(st.sampled_from(ORDERS))):
            try:
                found = discover_sources([root], sample_dirs=sample_dirs, skip_bad=data.draw(st.booleans()))
            except SourceError as exc:
                found = str(exc)
        if name.startswith("."):
            assert isinstance(found, list) or found.startswith("no .npz or .npy files found in: "), found
            assert not [p for p in found if p.startswith(str(dataset))]
        else:
            listed_in = "sources.jsonl" if marker == "index.json" else "parts' sources.jsonl"
            assert found == f"{dataset}: is an npz2mmap dataset (it holds {marker}), {WAY_OUT}{listed_in}"


@pytest.mark.parametrize("damage", ["truncated", "not json", "removed", "another tool's"])
@pytest.mark.parametrize("named", ["tree", "blob"])
def test_a_dataset_whose_index_is_damaged_is_still_refused_by_its_blob(tmp_path, damage, named) -> None:
    """Every npz2mmap blob starts with its identity: a lost index.json does not make data.npy a sample."""
    dataset, sources = make_dataset(tmp_path)
    tree = tmp_path / "tree"
    shutil.copytree(sources, tree / "raw")
    old = tree / "old.mmap"
    shutil.copytree(dataset, old)
    index = old / "index.json"
    if damage == "truncated":
        index.write_bytes(index.read_bytes()[:20])
    elif damage == "not json":
        index.write_bytes(b"\xff" * 10)
    elif damage == "removed":
        index.unlink()
    else:
        index.write_text('{"format": "other"}')
    inputs = [str(tree)] if named == "tree" else [str(old / "data.npy")]
    code, output = convert_cli(*inputs, "-o", str(tmp_path / "again.mmap"))
    tail = (
        "without a valid index.json: a dataset, damaged or incomplete, not a source; convert its sources "
        "again by naming the paths listed in its sources.jsonl"
    )
    subject = f"{old}: holds an npz2mmap blob (data.npy)" if named == "tree" else (
        f"{old / 'data.npy'}: is the blob of an npz2mmap dataset"
    )
    assert (code, output.splitlines()[-1]) == (1, f"Error: {subject} {tail}")
    assert not (tmp_path / "again.mmap").exists()


def test_a_field_named_data_is_a_source_not_a_blob(tmp_path) -> None:
    """A sample directory's data.npy that numpy wrote is a field, whatever its name."""
    for i in range(2):
        sample = tmp_path / "samples" / f"s{i}"
        sample.mkdir(parents=True)
        np.save(sample / "data.npy", np.arange(40, dtype=np.uint8) + i)  # past byte 128, like a blob
        np.save(sample / "label.npy", np.int64(i))
    result = convert([tmp_path / "samples"], tmp_path / "out", sample_dirs=True, workers=1)
    assert result.index.num_samples == 2
    assert DatasetReader(tmp_path / "out").view("data", 1).tolist() == list(range(1, 41))


@pytest.mark.parametrize(
    "how",
    [
        "copy",
        "symlink",
        "renamed in its dataset",
        "saved as uint32",
        "saved as big-endian uint16",
        "saved as big-endian records",
        "saved in Fortran order",
        "savez in Fortran order",
        "zipped",
        "zipped deflated",
        "savez",
    ],
)
@pytest.mark.parametrize("options", [[], ["--skip-bad"], ["--workers", "2"]])
def test_a_blob_under_another_name_is_refused_by_its_bytes(tmp_path, how, options) -> None:
    """A dataset's blob is no source, however it was copied, packed or saved again."""
    dataset, _ = make_dataset(tmp_path)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    where = None
    if how.startswith("saved as"):
        blob = inputs / "again.npy"
        raw = np.load(dataset / "data.npy")
        dtype = {
            "saved as uint32": np.dtype("<u4"),
            "saved as big-endian uint16": np.dtype(">u2"),
            "saved as big-endian records": np.dtype([("a", ">u4"), ("b", ">u8"), ("c", "u1")]),
        }[how]
        # stored little-endian, these are the blob's bytes: the array as numpy reads it, saved again
        values = raw[: len(raw) // dtype.itemsize * dtype.itemsize].view(dtype.newbyteorder("<"))
        np.save(blob, values.astype(dtype))
    elif how.endswith("in Fortran order"):
        raw = np.load(dataset / "data.npy")
        transposed = np.asfortranarray(raw[: len(raw) // 64 * 64].reshape(-1, 64))
        if how.startswith("savez"):
            blob = inputs / "blob.npz"
            np.savez(blob, payload=transposed)
            where = f"{blob}[payload]"
        else:
            blob = inputs / "again.npy"
            np.save(blob, transposed)
    elif how.startswith("zipped"):
        blob = inputs / "blob.npz"
        method = zipfile.ZIP_DEFLATED if how == "zipped deflated" else zipfile.ZIP_STORED
        with zipfile.ZipFile(blob, "w", method) as z:
            z.write(dataset / "data.npy", "data.npy")
        where = f"{blob}[data]"
    elif how == "savez":
        blob = inputs / "blob.npz"
        np.savez(blob, payload=np.load(dataset / "data.npy"), label=np.int64(0))
        where = f"{blob}[payload]"
    elif how == "copy":
        blob = inputs / "blob.npy"
        shutil.copyfile(dataset / "data.npy", blob)
    elif how == "symlink":
        blob = inputs / "z.npy"
        blob.symlink_to(dataset / "data.npy")
    else:
        inputs = tmp_path / "images.mmap"
        (inputs / "index.json").rename(inputs / "index.json.bak")
        blob = inputs / "data_x.npy"
        (inputs / "data.npy").rename(blob)
    code, output = convert_cli(str(inputs), *options, "-o", str(tmp_path / "again.mmap"))
    assert (code, output.splitlines()[-1]) == (
        1,
        f"Error: {where or blob}: holds the blob of an npz2mmap dataset (its data starts with the blob identity), "
        "not a source; "
        "convert its sources again by naming the paths listed in its dataset's sources.jsonl, or join "
        "datasets with npz2mmap merge",
    )
    assert not (tmp_path / "again.mmap").exists()


@pytest.mark.skipif(os.name == "nt", reason="Windows resolves .. lexically itself")
def test_dot_dot_after_a_directory_link_goes_up_from_its_target_as_the_system_does(tmp_path, monkeypatch) -> None:
    """link/../a.npz is deep/a.npz to open(), np.load and the shell, not ./a.npz."""
    write_npz(tmp_path / "deep" / "real" / "inner.npz", x=np.int64(0))
    write_npz(tmp_path / "deep" / "a.npz", x=np.int64(3))  # what the system opens
    write_npz(tmp_path / "a.npz", x=np.int64(4))  # what dropping "link/.." as text names
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "real", target_is_directory=True)
    (tmp_path / "deep" / "real" / "list.txt").write_text("../a.npz\n")
    monkeypatch.chdir(tmp_path)
    with np.load("link/../a.npz") as oracle:
        assert int(oracle["x"]) == 3
    opened = str(tmp_path / "deep" / "a.npz")
    assert discover_sources(["link/../a.npz"]) == [opened]
    assert discover_sources(["@link/list.txt"]) == [opened]
    assert discover_sources(["link/.."]) == [opened, str(tmp_path / "deep" / "real" / "inner.npz")]


def test_a_quoted_glob_pattern_converts_its_matches_in_sorted_order_and_one_matching_nothing_says_so(
    tmp_path, monkeypatch
) -> None:
    """'images/**/*.npz' and an unmatched 'images/*.npzz' both said "no such file or directory"."""
    monkeypatch.chdir(tmp_path)
    for name in ["img/b.npz", "img/a.npz", "img/deep/er/c.npz", "img/.hidden.npz", "img/notes.txt"]:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".npz"):
            write_npz(path, x=np.array([len(name)]))
        else:
            path.write_text("not a source")
    code, output = convert_cli("img/**/*.npz", "-o", "out")
    assert (code, output) == (0, "")
    assert read_sources(tmp_path / "out") == [str(tmp_path / p) for p in ["img/a.npz", "img/b.npz", "img/deep/er/c.npz"]]
    code, output = convert_cli("img/*", "-o", "out2")  # a directory matched is walked; other files left out
    assert code == 0
    assert read_sources(tmp_path / "out2") == [str(tmp_path / p) for p in ["img/a.npz", "img/b.npz", "img/deep/er/c.npz"]]
    (tmp_path / "img" / "empty").mkdir()
    code, output = convert_cli("img/e*", "-o", "out4")  # an empty directory matched: still nothing
    assert code == 2 and output.splitlines()[-1] == (
        "Error: img/e*: the pattern matches no .npz or .npy file, nor a directory holding one"
    )
    code, output = convert_cli("img/*.npzz", "-o", "out3")
    assert code == 2 and output.splitlines()[-1] == (
        "Error: img/*.npzz: the pattern matches no .npz or .npy file, nor a directory holding one"
    )


def test_a_pattern_sorts_its_files_as_a_walk_does_once_each_and_a_list_line_is_never_a_pattern(
    tmp_path, monkeypatch
) -> None:
    """'d/*' put d/a/x.npz before d/a-1/x.npz where d sorts the other way; 'd/**' refused its own
    matches as "given twice"; a link in the tree was "the same file as"; list lines were expanded."""
    monkeypatch.chdir(tmp_path)
    for name in ["d/a/x.npz", "d/a-1/x.npz", "d/b.npz"]:
        write_npz(tmp_path / name, x=np.array([len(name)]))
    os.symlink("a", tmp_path / "d" / "link")
    assert convert_cli("d", "-o", "walked") == (0, "")
    for pattern in ["d/*", "d/**", "d/**/*.npz"]:
        out = f"out-{len(pattern)}"
        assert convert_cli(pattern, "-o", out) == (0, ""), pattern
        assert read_sources(tmp_path / out) == read_sources(tmp_path / "walked"), pattern
    (tmp_path / "list.txt").write_text("d/*.npz\n")
    code, output = convert_cli("@list.txt", "-o", "listed")
    assert code == 2 and output.splitlines()[-1] == (
        f"Error: list.txt, line 1: {tmp_path / 'd' / '*.npz'}: no such file or directory"
    )


@pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="symlinks")
def test_a_pattern_takes_what_the_walk_of_its_directory_takes_through_links_and_loops(tmp_path, monkeypatch) -> None:
    """glob's own walk followed links to the system's limit: two loops hung 'd/**' (no output, memory
    growing), one loop named every file 40 links deep, 'd/*' took d/x.npz as d/s/up/x.npz in the
    walk's other order, and a file and a link to it were silently one sample."""
    monkeypatch.chdir(tmp_path)
    write_npz(tmp_path / "d" / "x.npz", x=np.int64(0))
    write_npz(tmp_path / "d" / "s" / "y.npz", x=np.int64(1))
    os.symlink(".", tmp_path / "d" / "self")
    os.symlink("..", tmp_path / "d" / "s" / "up")
    walked = discover_sources(["d"])
    assert walked == [str(tmp_path / "d" / "s" / "y.npz"), str(tmp_path / "d" / "x.npz")]
    with no_hang(20):
        for pattern in ["d/*", "d/**", "d/**/*.npz", "d/**/"]:
            assert discover_sources([pattern]) == walked, pattern
        # d/self/ is d again: a loop, not walked twice, so 'd/*/' takes the directories in d that are not d
        assert discover_sources(["d/*/"]) == [str(tmp_path / "d" / "s" / "y.npz")]
        assert discover_sources(["d/*.npz"]) == [str(tmp_path / "d" / "x.npz")]
        assert discover_sources(["d/s/*.npz"]) == [str(tmp_path / "d" / "s" / "y.npz")]
    os.symlink("x.npz", tmp_path / "d" / "l.npz")
    for inputs in (["d"], ["d/*.npz"], ["d/**"]):
        with pytest.raises(SourceError, match="d/x.npz: is the same file as .*d/l.npz; each sample file"):
            discover_sources(inputs)


def test_a_pattern_with_sample_dirs_refuses_the_npy_files_it_names_as_a_path_would(tmp_path) -> None:
    """'d/**/*.npy' said it matched no .npy file; 'd/*' silently left out d/x.npy and d/y.npy, where
    d itself holds .npy files: a .npy named with --sample-dirs is refused, by a pattern too."""
    for sample in ["d", "d/s0", "d/s1"]:
        save_npy(tmp_path / sample / "x.npy", np.arange(2))
        save_npy(tmp_path / sample / "y.npy", np.arange(3))
    d = tmp_path / "d"
    for pattern in ["*", "**/*.npy", "**/x.npy"]:
        with pytest.raises(SourceError) as caught:
            discover_sources([f"{d}/{pattern}"], sample_dirs=True)
        assert str(caught.value) == npy_with_sample_dirs(str(d / "x.npy")), pattern
    assert discover_sources([f"{d}/*/"], sample_dirs=True) == [str(d / "s0"), str(d / "s1")]
    assert discover_sources([f"{d}/**"], sample_dirs=True) == [str(d), str(d / "s0"), str(d / "s1")]  # d too
    assert discover_sources([str(d)], sample_dirs=True) == [str(d), str(d / "s0"), str(d / "s1")]


def test_files_of_a_pattern_are_named_in_messages_as_the_pattern_spells_them(tmp_path, monkeypatch) -> None:
    """Typed 'd/*.npz', messages named /abs/.../d/b.npz where typed 'd' they name d/b.npz."""
    write_npz(tmp_path / "d" / "a.npz", v=np.arange(3))
    write_npz(tmp_path / "d" / "b.npz", v=np.arange(3.0))
    expected = "Error: {0}b.npz[v]: dtype float64 differs from int64 in {0}a.npz; use --cast v=float64 to store one dtype, if every value fits it"
    monkeypatch.chdir(tmp_path)
    for typed, prefix in [("d", "d/"), ("d/*.npz", "d/"), ("./d/**", "./d/")]:
        code, output = convert_cli(typed, "-o", "out")
        assert (code, output.splitlines()[-1]) == (1, expected.format(prefix)), typed
    monkeypatch.chdir(tmp_path / "d")
    code, output = convert_cli("*.npz", "-o", "out")
    assert (code, output.splitlines()[-1]) == (1, expected.format("")), output


TREE_NAMES = ["a", "b", ".h", "a.npz", "b.npz", ".c.npz", "x.txt", "d.NPZ"]
PATTERN_PARTS = ["*", "**", "a*", "?.npz", "*.npz", ".*", "[ab]*", "a", "b", "*.[nN][pP][zZ]"]


@settings(max_examples=100, deadline=None)
@given(
    tree=st.lists(st.lists(st.sampled_from(TREE_NAMES), min_size=1, max_size=3), min_size=1, max_size=8),
    pattern=st.lists(st.sampled_from(PATTERN_PARTS), min_size=1, max_size=3),
)
def test_a_pattern_takes_what_glob_matches_in_a_tree_without_links(tree, pattern) -> None:
    """The oracle is glob itself, in a tree of no links: its matching files a walk would take, and
    the walks of its matching directories, sorted and each once."""
    import glob

    with tempfile.TemporaryDirectory() as top:
        for names in tree:
            path = Path(top, *names)
            with contextlib.suppress(OSError):  # a name already a file, or a file already a directory
                if path.suffix.lower() == ".npz":
                    write_npz(path, x=np.int64(0))
                else:
                    path.mkdir(parents=True, exist_ok=True)
        text = os.path.join(top, *pattern)
        if not glob.has_magic(text) or os.path.lexists(text):
            return  # a path, not a pattern
        expected: set[str] = set()
        for match in glob.glob(text, recursive=True):
            if os.path.isdir(match):
                with contextlib.suppress(SourceError):  # a directory of no sources
                    expected.update(discover_sources([match]))
            elif match.lower().endswith(".npz"):
                expected.add(os.path.abspath(match))
        if not expected:
            with pytest.raises(SourceError, match="the pattern matches no .npz or .npy file, nor a directory holding one"):
                discover_sources([text])
        else:
            assert discover_sources([text]) == sorted(expected)


def test_a_pattern_lists_no_directory_where_it_can_match_nothing(tmp_path, monkeypatch) -> None:
    """'**/*.npz' from a project's top listed .git and .venv, every file of them, to match none."""
    for name in ["data/a.npz", "data/deep/b.npz", ".venv/lib/c.npz", "other/d.npz"]:
        write_npz(tmp_path / name, x=np.int64(0))
    listed: list[str] = []
    scandir = os.scandir

    def recording_scandir(path: str) -> Iterator[os.DirEntry[str]]:
        listed.append(os.path.relpath(path, tmp_path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", recording_scandir)
    found = discover_sources([f"{tmp_path}/**/*.npz"])
    assert found == [str(tmp_path / p) for p in ["data/a.npz", "data/deep/b.npz", "other/d.npz"]]
    assert ".venv" not in listed and not any(p.startswith(".venv") for p in listed)
    listed.clear()
    assert discover_sources([f"{tmp_path}/data/*.npz"]) == [str(tmp_path / "data" / "a.npz")]
    assert listed == ["data"]  # from where it starts; neither data/deep nor other


def test_a_pattern_going_up_after_a_wildcard_is_refused_saying_so(tmp_path, monkeypatch) -> None:
    """'d/**/../*.npz' said it matched no file, where glob matches several."""
    monkeypatch.chdir(tmp_path)
    write_npz(tmp_path / "d" / "e" / "a.npz", x=np.int64(0))
    code, output = convert_cli("d/**/../*.npz", "-o", "out")
    assert (code, output.splitlines()[-1]) == (
        2,
        "Error: d/**/../*.npz: '..' after a wildcard is not supported (the search goes down from d): "
        "put it before the first wildcard, or name the directories to search",
    )
    assert discover_sources(["d/e/../e/*.npz"]) == [str(tmp_path / "d" / "e" / "a.npz")]
    for same in ("d/*//a.npz", "d/*/./a.npz", "d/**/./*.npz"):  # what 'd/*/a.npz' names, as glob takes it
        assert discover_sources([same]) == [str(tmp_path / "d" / "e" / "a.npz")], same
