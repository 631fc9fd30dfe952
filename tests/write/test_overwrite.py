"""--overwrite replaces only what npz2mmap wrote: a dataset whose index parses, or merge's manifest."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_samples

from npz2mmap import MmapDataset
from npz2mmap.cli.commands import cli
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def tree_digest(directory: Path) -> dict[str, str]:
    """Every file below ``directory`` and the SHA-256 of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def web_app_config(out: Path) -> None:
    out.mkdir()
    (out / "index.json").write_text('{"title": "my web app", "routes": ["/"]}\n')


def own_files_with_our_names(out: Path) -> None:
    out.mkdir()
    np.save(out / "data.npy", np.arange(10, dtype=np.uint8))
    (out / "index.json").write_text(json.dumps({"format": "my-own", "version": 1}))
    (out / "sources.jsonl").write_text('"/home/me/a.npz"\n')


def directory_named_index_json(out: Path) -> None:
    (out / "index.json").mkdir(parents=True)
    (out / "index.json" / "README").write_text("my notes\n")


def dataset_with_a_foreign_file(out: Path) -> None:
    write_samples(out.parent / "other", [{"y": np.arange(2)}])
    convert([out.parent / "other"], out, workers=1)
    (out / "notes.txt").write_text("mine\n")


def manifest_beside_foreign_files(out: Path) -> None:
    write_samples(out.parent / "other", [{"y": np.arange(2)}])
    convert([out.parent / "other"], out / "part-a", workers=1)
    merge([out / "part-a"], out)
    (out / "thesis").mkdir()
    (out / "thesis" / "main.tex").write_text("do not delete\n")


USERS_DIRECTORIES = {
    "web-app-index": (web_app_config, r"index\.json: missing key\(s\) format"),
    "own-data-index-sources": (
        own_files_with_our_names,
        r"index\.json: format is 'my-own', expected 'npz2mmap'",
    ),
    "directory-named-index-json": (
        directory_named_index_json,
        r"index\.json: a directory, not a regular file",
    ),
    "dataset-plus-foreign-file": (dataset_with_a_foreign_file, r"it also holds 'notes\.txt'"),
    "manifest-plus-foreign-dir": (
        manifest_beside_foreign_files,
        r"it also holds 'thesis', which its manifest\.json does not list as a part",
    ),
}


@pytest.mark.parametrize("case", list(USERS_DIRECTORIES))
def test_overwrite_refuses_a_directory_that_is_not_ours(tmp_path, tiny_sources, case) -> None:
    build, reason = USERS_DIRECTORIES[case]
    out = tmp_path / "out"
    build(out)
    before = tree_digest(out)
    result = run("convert", tiny_sources, "-o", out, "--overwrite", "-q")
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"Error: {out}: exists and is not an npz2mmap dataset (")
    assert lines[0].endswith("); choose another OUT (--overwrite replaces only a dataset or an empty directory)")
    assert re.search(reason, lines[0]), lines[0]
    assert tree_digest(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_overwrite_refuses_a_manifest_directory_whose_parts_are_links_saying_so(tmp_path, tiny_sources) -> None:
    """It said the manifest did not list the part, which it does: the part is a link to a dataset
    elsewhere, perhaps another's, which replacing OUT must not touch."""
    write_samples(tmp_path / "other", [{"y": np.arange(2)}])
    convert([tmp_path / "other"], tmp_path / "elsewhere", workers=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "p0").symlink_to(tmp_path / "elsewhere")
    (out / "manifest.json").write_text(json.dumps({"format": "npz2mmap-parts", "version": 1, "parts": ["p0"]}))
    assert len(MmapDataset(out)) == 1  # a dataset that reads
    before = tree_digest(tmp_path / "elsewhere")
    result = run("convert", tiny_sources, "-o", out, "--overwrite", "-q")
    assert (result.exit_code, result.output) == (
        1,
        f"Error: {out}: exists and its part 'p0' is a symbolic link, which --overwrite does not follow; "
        "choose another OUT (--overwrite replaces only a dataset or an empty directory)\n",
    )
    assert tree_digest(tmp_path / "elsewhere") == before and (out / "p0").is_symlink()


def test_overwrite_still_replaces_a_dataset_a_manifest_directory_and_an_empty_directory(
    tmp_path, tiny_sources
) -> None:
    convert([tiny_sources], tmp_path / "ds", workers=1)
    write_samples(tmp_path / "new", [{"w": np.ones(2)}])
    assert run("convert", tmp_path / "new", "-o", tmp_path / "ds", "--overwrite", "-q").exit_code == 0
    assert DatasetReader(tmp_path / "ds").field_names == ("w",)
    for i in range(2):
        convert([tiny_sources], tmp_path / "parts", part=(i, 2), workers=1)
    merge(sorted((tmp_path / "parts").iterdir()), tmp_path / "parts")
    assert run("convert", tmp_path / "new", "-o", tmp_path / "parts", "--overwrite", "-q").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [
        "data.npy",
        "index.json",
        "skipped.jsonl",
        "sources.jsonl",
    ]
    (tmp_path / "empty").mkdir()
    assert run("convert", tmp_path / "new", "-o", tmp_path / "empty", "--overwrite", "-q").exit_code == 0
    assert DatasetReader(tmp_path / "empty").field_names == ("w",)


def test_merge_overwrite_refuses_a_manifest_json_that_is_not_ours(tmp_path, tiny_sources) -> None:
    convert([tiny_sources], tmp_path / "ds" / "part-a", workers=1)
    manifest = tmp_path / "ds" / "manifest.json"
    manifest.write_text('{"name": "my-package", "version": "1.0"}\n')
    result = run("merge", tmp_path / "ds" / "part-a", "-o", tmp_path / "ds", "--overwrite", "-q")
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {manifest}: exists and is not ours (")
    assert result.output.endswith("); refusing to replace it\n")
    assert manifest.read_text() == '{"name": "my-package", "version": "1.0"}\n'
    merge([tmp_path / "ds" / "part-a"], tmp_path / "ds2")
    assert (
        run("merge", tmp_path / "ds" / "part-a", "-o", tmp_path / "ds2", "--overwrite", "-q").exit_code == 0
    )
