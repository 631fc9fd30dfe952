"""An OUT that cannot be written is refused in one line that says why, and leaves everything as it was."""

from __future__ import annotations

import difflib  # noqa: F401  (imported before a child drops its privileges: click imports it on errors)
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_npz, write_samples
from hypothesis import given, settings
from hypothesis import strategies as st

import npz2mmap
from npz2mmap.cli.commands import cli
from npz2mmap.errors import OutputError
from npz2mmap.write.merge import merge

NOBODY = 65534


def listing(root: Path) -> dict[str, str]:
    """Every entry below ``root``, with what it is: a link's target, a file's bytes, or a directory."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(root))] = f"link to {os.readlink(path)}"
        elif path.is_file():
            found[str(path.relative_to(root))] = path.read_bytes().hex()
        else:
            found[str(path.relative_to(root))] = "directory"
    return found


def broken_link_parent(root: Path) -> tuple[str, str]:
    (root / "parent").symlink_to(root / "nonexistent")
    target = root / "nonexistent"
    return "parent/out", (
        f"its parent parent is a broken symbolic link (to {target}, which does not exist); "
        f"create {target}, or choose another OUT"
    )


def broken_link_ancestor(root: Path) -> tuple[str, str]:
    (root / "gone").symlink_to("nonexistent")
    target = root / "nonexistent"
    return "gone/a/out", (
        f"its ancestor gone is a broken symbolic link (to {target}, which does not exist); "
        f"create {target}, or choose another OUT"
    )


def file_parent(root: Path) -> tuple[str, str]:
    (root / "notes.txt").write_text("mine\n")
    return "notes.txt/out", "its parent notes.txt is a file, not a directory; choose another OUT"


def file_ancestor(root: Path) -> tuple[str, str]:
    (root / "notes.txt").write_text("mine\n")
    return "notes.txt/a/b/out", "its ancestor notes.txt is a file, not a directory; choose another OUT"


def looping_parent(root: Path) -> tuple[str, str]:
    (root / "loop").symlink_to("loop")
    return "loop/out", "its parent loop is a symbolic link loop; choose another OUT"


def broken_link_out(root: Path) -> tuple[str, str]:
    (root / "out").symlink_to(root / "nonexistent")
    target = root / "nonexistent"
    return (
        "out",
        f"is a broken symbolic link (to {target}, which does not exist); remove it, or choose another OUT",
    )


def link_to_a_dataset(root: Path) -> tuple[str, str]:
    write_samples(root / "old", [{"x": np.arange(2)}])
    npz2mmap.convert([root / "old"], root / "ds", workers=1)
    (root / "out").symlink_to("ds")
    target = root / "ds"
    return "out", (
        f"is a symbolic link to {target}; npz2mmap neither replaces a link nor writes a dataset "
        f"through one: name {target} itself as OUT, or remove the link"
    )


def looping_out(root: Path) -> tuple[str, str]:
    (root / "out").symlink_to("out")
    return "out", "is a symbolic link loop; remove it, or choose another OUT"


CASES: dict[str, Callable[[Path], tuple[str, str]]] = {
    "parent a broken link": broken_link_parent,
    "ancestor a broken link": broken_link_ancestor,
    "parent a file": file_parent,
    "ancestor a file": file_ancestor,
    "parent a link loop": looping_parent,
    "OUT a broken link": broken_link_out,
    "OUT a link to a dataset": link_to_a_dataset,
    "OUT a link loop": looping_out,
}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_convert_says_why_out_cannot_be_written_and_changes_nothing(
    tmp_path, tiny_sources, monkeypatch, case, overwrite
) -> None:
    root = tmp_path / "work"
    root.mkdir()
    out, reason = CASES[case](root)
    before = listing(root)
    monkeypatch.chdir(root)
    arguments = ["convert", str(tiny_sources), "-o", out, "-q"] + (["--overwrite"] if overwrite else [])
    result = CliRunner().invoke(cli, arguments)
    assert (result.exit_code, result.output) == (1, f"Error: {out}: {reason}\n")
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert listing(root) == before


@pytest.mark.parametrize(
    "case",
    ["parent a broken link", "ancestor a file", "parent a link loop", "OUT a broken link", "OUT a link loop"],
)
def test_the_writer_and_merge_say_the_same(tmp_path, tiny_sources, monkeypatch, case) -> None:
    npz2mmap.convert([tiny_sources], tmp_path / "part", workers=1)
    root = tmp_path / "work"
    root.mkdir()
    out, reason = CASES[case](root)
    before = listing(root)
    monkeypatch.chdir(root)
    with pytest.raises(OutputError) as raised:
        npz2mmap.Writer(out)
    assert str(raised.value) == f"{out}: {reason}"
    for copy in (True, False):
        with pytest.raises(OutputError) as raised:
            merge([tmp_path / "part"], out, copy=copy)
        assert str(raised.value) == f"{out}: {reason}"
    assert listing(root) == before


def test_a_missing_parent_is_created(tmp_path, tiny_sources) -> None:
    out = tmp_path / "new" / "deeper" / "out"
    result = CliRunner().invoke(cli, ["convert", str(tiny_sources), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert npz2mmap.DatasetReader(out).field_names == ("x",)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


def run_unprivileged(arguments: list[str], cwd: Path) -> tuple[int, str]:
    """The CLI's exit code and output, run in a forked child as a user that may not write ``cwd``'s
    read-only directories (root may write anywhere: the child becomes nobody)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        try:
            os.chdir(cwd)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            result = CliRunner().invoke(cli, arguments)
            os.write(write_fd, json.dumps([result.exit_code, result.output]).encode())
        except BaseException as exc:
            os.write(write_fd, json.dumps([-1, repr(exc)]).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        exit_code, output = json.loads(pipe.read())
    os.waitpid(pid, 0)
    return exit_code, output


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
@pytest.mark.parametrize("out", ["locked/out", "locked/a/out"])
def test_a_parent_this_user_may_not_write_is_named(tmp_path, tiny_sources, out) -> None:
    tmp_path.chmod(0o755)  # the child must reach what it converts
    for path in [tiny_sources, *tiny_sources.iterdir()]:
        path.chmod(path.stat().st_mode | 0o555)
    (tmp_path / "locked").mkdir(mode=0o555)
    (tmp_path / "locked").chmod(0o555)
    before = listing(tmp_path)
    exit_code, output = run_unprivileged(["convert", "src", "-o", out, "--workers", "1", "-q"], tmp_path)
    assert (exit_code, output) == (
        1,
        f"Error: {out}: cannot create it in locked (Permission denied); "
        "choose an OUT in a directory you can write\n",
    )
    assert listing(tmp_path) == before


ANCESTOR_KINDS = ["directory", "missing", "file", "broken link", "link to a directory", "link loop"]
OUT_KINDS = ["missing", "file", "broken link", "link to a directory", "link loop"]


def make_entry(path: Path, kind: str) -> None:
    if kind == "directory":
        path.mkdir()
    elif kind == "file":
        path.write_text("mine\n")
    elif kind == "broken link":
        path.symlink_to(path.parent / f"{path.name}-target")
    elif kind == "link to a directory":
        (path.parent / f"{path.name}-target").mkdir()
        path.symlink_to(f"{path.name}-target")
    elif kind == "link loop":
        path.symlink_to(path.name)


def first_bad_ancestor(kinds: list[str]) -> int | None:
    """Which ancestor of OUT makes it impossible to create: the first that exists and is no directory."""
    for k, kind in enumerate(kinds):
        if kind == "missing":
            return None
        if kind in ("file", "broken link", "link loop"):
            return k
    return None


@pytest.fixture(scope="module")
def shared_sources(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("shared") / "src"
    write_samples(src, [{"x": np.arange(3) + i} for i in range(2)])
    return src


def build_path(root: Path, kinds: list[str]) -> Path:
    """OUT below ``root``, each entry on the way of the kind drawn; none below one that is no directory."""
    path = root
    for k, kind in enumerate(kinds):
        path = path / ("out" if k == len(kinds) - 1 else f"c{k}")
        if path.parent.is_dir():
            make_entry(path, kind)
    return path


@settings(max_examples=60, deadline=None)
@given(
    ancestors=st.lists(st.sampled_from(ANCESTOR_KINDS), min_size=0, max_size=3),
    out_kind=st.sampled_from(OUT_KINDS),
    overwrite=st.booleans(),
)
def test_any_out_path_converts_or_names_the_entry_in_its_way(
    tmp_path_factory, shared_sources, ancestors, out_kind, overwrite
) -> None:
    """Each entry on the way to OUT drawn from what a file system holds: the conversion succeeds,
    or fails in one line naming the entry that stops it and saying what it is, changing nothing."""
    root = tmp_path_factory.mktemp("paths")
    out = build_path(root, [*ancestors, out_kind])
    before = listing(root)
    arguments = ["convert", str(shared_sources), "-o", str(out), "-q", "--workers", "1"]
    result = CliRunner().invoke(cli, arguments + (["--overwrite"] if overwrite else []))
    bad = first_bad_ancestor(ancestors)
    if bad is None and ("missing" in ancestors or out_kind == "missing"):
        assert result.exit_code == 0, result.output
        assert npz2mmap.DatasetReader(out).field_names == ("x",)
        return
    if bad is None and out_kind == "file":  # refused as a usage error before npz2mmap looks
        assert result.exit_code == 2 and f"Directory '{out}' is a file." in result.output, result.output
        assert listing(root) == before
        return
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith(f"Error: {out}: ") and result.output.count("\n") == 1, result.output
    assert "File exists" not in result.output and "Not a directory" not in result.output
    if bad is not None:
        role = "parent" if bad == len(ancestors) - 1 else "ancestor"
        blocker = root.joinpath(*[f"c{k}" for k in range(bad + 1)])
        what = {"file": "a file, not a directory", "broken link": "a broken symbolic link"}
        assert (
            f"{out}: its {role} {blocker} is {what.get(ancestors[bad], 'a symbolic link loop')}"
            in result.output
        )
        assert result.output.endswith("choose another OUT\n")
    else:
        assert f"{out}: is a " in result.output and "symbolic link" in result.output
    assert listing(root) == before


def test_an_out_inside_a_dataset_is_refused_by_convert_merge_and_the_writer(tmp_path, monkeypatch) -> None:
    """It was written there, exit 0: the dataset then held a fifth entry, and verify and --overwrite
    refused it as no dataset."""
    monkeypatch.chdir(tmp_path)
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    npz2mmap.convert([tmp_path / "src"], "A", workers=1)
    npz2mmap.convert([tmp_path / "src"], "B", workers=1)
    before = sorted(os.listdir("A"))
    refusal = (
        "{out}: inside the npz2mmap dataset {dataset}, which must hold its own files only; "
        "choose an OUT outside it"
    )
    for out in ["A/nested", "A/deeper/still"]:
        expected = "Error: " + refusal.format(out=out, dataset=tmp_path / "A") + "\n"
        result = CliRunner().invoke(cli, ["convert", "-q", str(tmp_path / "src"), "-o", out])
        assert (result.exit_code, result.output) == (1, expected)
        result = CliRunner().invoke(cli, ["merge", "-q", "B", "-o", out])
        assert (result.exit_code, result.output) == (1, expected)
        with pytest.raises(OutputError) as refused:
            npz2mmap.Writer(out)
        assert str(refused.value) == refusal.format(out=out, dataset=tmp_path / "A")
    assert sorted(os.listdir("A")) == before


def test_an_existing_folder_that_is_no_dataset_is_refused_at_once_without_a_hint_of_overwrite(tmp_path) -> None:
    """It said "pass --overwrite", and --overwrite then refused it: two runs to learn it is not a dataset."""
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own")
    for options in [[], ["--overwrite"]]:
        result = CliRunner().invoke(cli, ["convert", "-q", str(tmp_path / "src"), "-o", str(mine), *options])
        assert (result.exit_code, result.output) == (
            1,
            f"Error: {mine}: exists and is not an npz2mmap dataset (it holds neither index.json nor "
            "manifest.json); choose another OUT (--overwrite replaces only a dataset or an empty directory)\n",
        )
    assert os.listdir(mine) == ["notes.txt"]


def test_an_out_a_pattern_takes_is_refused_at_once_as_one_inside_an_input_directory(tmp_path, monkeypatch) -> None:
    """convert '*' -o out --overwrite worked once, then every run said out was a dataset to merge."""
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "a.npz", x=np.arange(3))
    for pattern in ["*", "**", "o*"]:
        with pytest.raises(OutputError) as refused:
            npz2mmap.convert([pattern], "out", workers=1)
        assert str(refused.value) == (
            f"out: the pattern {pattern} takes it (or a directory holding it); narrow the pattern "
            "(such as '*.npz') or write the dataset elsewhere"
        )
        assert not (tmp_path / "out").exists()
    for pattern in ["*.npz", "**/*.npz"]:
        for _ in range(2):  # and again, over the dataset written
            npz2mmap.convert([pattern], "out", workers=1, overwrite=True)
        assert npz2mmap.DatasetReader("out").field_names == ("x",)
