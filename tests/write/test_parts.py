"""Multi-part datasets: --part, merge (manifest and copy), reading parts as one."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_same_array, convert_part_at, write_npz, write_samples
from hypothesis import given, settings
from hypothesis import strategies as st

import npz2mmap
from npz2mmap import MmapDataset, MmapLoader
from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError
from npz2mmap.read.reader import DatasetReader
from npz2mmap.text import human_bytes
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge
from npz2mmap.write.options import MAX_PARTS, part_from_environment, resolve_part, select_part

BIN = Path(sys.executable).parent


@pytest.fixture
def sources(tmp_path) -> Path:
    rng = np.random.default_rng(5)
    write_samples(
        tmp_path / "src",
        [
            {
                "x": rng.random((2, 3), dtype=np.float32),
                "id": np.int64(i),
                "tokens": np.arange(i % 7 + 1, dtype=np.int16),
            }
            for i in range(22)
        ],
    )
    return tmp_path / "src"


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def torchrun_convert(ranks: int, src: Path, out: Path) -> subprocess.CompletedProcess:
    """``convert --part auto`` on ``ranks`` processes started by a real torchrun."""
    command = [BIN / "torchrun", "--standalone", f"--nproc_per_node={ranks}", "--no-python"]
    command += [BIN / "npz2mmap", "convert", src, "-o", out, "--part", "auto", "--workers", "1", "-q"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_parts_converted_by_torchrun_merge_into_the_bytes_of_one_conversion(tmp_path, sources) -> None:
    result = torchrun_convert(4, sources, tmp_path / "parts")
    assert result.returncode == 0, result.stderr[-2000:]
    parts = sorted((tmp_path / "parts").glob("part-*"))
    assert [p.name for p in parts] == ["part-00000", "part-00001", "part-00002", "part-00003"]
    assert [MmapDataset(p)[0]["id"] for p in parts] == [0, 5, 11, 16]
    assert json.loads((parts[1] / "index.json").read_text())["provenance"]["part"] == [1, 4]
    convert([sources], tmp_path / "single", workers=1)
    assert run("merge", *parts, "-o", tmp_path / "merged", "--copy", "-q").exit_code == 0
    for name in ("data.npy", "index.json", "sources.jsonl", "skipped.jsonl"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "single" / name).read_bytes(), name


def test_a_manifest_reads_the_parts_as_one_dataset(tmp_path, sources) -> None:
    for i in range(3):
        convert_part_at([sources], tmp_path / "parts" / f"p{i}", (i, 3), workers=1)
    result = run("merge", *sorted((tmp_path / "parts").iterdir()), "-o", tmp_path / "parts")
    assert result.exit_code == 0, result.output
    assert result.output == f"Merged 3 parts, 22 samples, into {tmp_path / 'parts' / 'manifest.json'}\n"
    assert json.loads((tmp_path / "parts" / "manifest.json").read_text())["parts"] == ["p0", "p1", "p2"]
    convert([sources], tmp_path / "single", workers=1)
    whole, single = MmapDataset(tmp_path / "parts"), MmapDataset(tmp_path / "single")
    assert len(whole) == 22
    for i in range(-22, 22):
        for key in ("x", "id", "tokens"):
            assert_same_array(whole[i][key], single[i][key])
    batch = whole.__getitems__([21, 0, 8, 7, 15])
    assert batch.arrays["id"].tolist() == [21, 0, 8, 7, 15]
    assert [t.tolist() for t in batch.arrays["tokens"]] == [
        single[i]["tokens"].tolist() for i in (21, 0, 8, 7, 15)
    ]
    assert sorted(
        int(i) for b in MmapLoader(MmapDataset(tmp_path / "parts", fields="id"), 5, shuffle=True) for i in b
    ) == list(range(22))
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "parts", moved)
    assert len(MmapDataset(moved)) == 22  # relative paths: the tree moves as a whole
    with pytest.raises(FormatError, match=r": part 1 of 3 is missing \(parts 0, 2 of 3 are listed\)"):
        MmapDataset([moved / "p0", moved / "p2"])  # as a manifest of them is refused
    assert len(MmapDataset(moved / "p2")) == 8  # a part alone is a dataset
    assert DatasetReader(moved / "p2").column("id").tolist() == list(range(14, 22))
    with pytest.raises(FormatError) as refused:
        DatasetReader(moved)
    assert str(refused.value) == (
        f"{moved}: a dataset of parts (manifest.json); a DatasetReader reads one part: "
        f"open one of the parts it lists, or the whole as MmapDataset({str(moved)!r})"
    )


def test_inspect_verify_and_warm_understand_parts(tmp_path, sources) -> None:
    for i in range(2):
        convert_part_at([sources], tmp_path / "ds" / f"part-{i}", (i, 2), workers=1)
    merge(sorted((tmp_path / "ds").iterdir()), tmp_path / "ds")
    summary = json.loads(run("inspect", tmp_path / "ds", "--json").output)
    assert summary["num_samples"] == 22 and [p["num_samples"] for p in summary["parts"]] == [11, 11]
    assert "parts    2, read in order as one dataset" in run("inspect", tmp_path / "ds").output
    assert (
        json.loads(run("inspect", tmp_path / "ds", "--sample", "12", "--json").output)["fields"][0]["min"]
        == 12
    )
    assert run("verify", tmp_path / "ds", "--sources").exit_code == 0
    assert "(2 parts)" in run("warm", tmp_path / "ds", "-q").output
    blob = tmp_path / "ds" / "part-1" / "data.npy"
    data = bytearray(blob.read_bytes())
    data[128 + 64] ^= 1  # the first byte of part 1's first field ('id', sample 11 overall)
    blob.write_bytes(bytes(data))
    report = verify(tmp_path / "ds")
    assert report.bad_samples == {"id": [11]}
    assert report.problems == [
        f"part {tmp_path / 'ds' / 'part-1'}: field 'id': 1 sample does not match its checksum: 0"
    ]


def test_parts_that_disagree_are_refused(tmp_path, sources) -> None:
    convert([sources], tmp_path / "a", workers=1)
    write_samples(
        tmp_path / "other",
        [{"x": np.ones((2, 3)), "id": np.int64(0), "tokens": np.arange(2, dtype=np.int16)}],
    )
    convert([tmp_path / "other"], tmp_path / "b", workers=1)
    with pytest.raises(
        FormatError,
        match="field 'x' is float64 with ndim 2, but float32 with ndim 2 in .*a; parts must agree: convert "
        r"every part again with one --cast x=DTYPE \(a conversion of all their files at once names one that "
        r"holds them\)$",
    ):
        MmapDataset([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(FormatError, match="given twice"):
        MmapDataset([tmp_path / "a", tmp_path / "a"])
    assert run("merge", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "m").exit_code == 1


@pytest.mark.parametrize("second", ["p0", "./p0", "link-to-p0"])
def test_a_manifest_listing_a_part_twice_is_refused_naming_the_manifest(tmp_path, sources, second) -> None:
    """FORMAT.md: no part may appear twice. Read twice, its samples would count double."""
    for i in range(2):
        convert_part_at([sources], tmp_path / "ds" / f"p{i}", (i, 2), workers=1)
    (tmp_path / "ds" / "link-to-p0").symlink_to("p0")
    manifest = tmp_path / "ds" / "manifest.json"
    manifest.write_text(json.dumps({"format": "npz2mmap-parts", "version": 1, "parts": ["p0", "p1", second]}))
    message = f"{manifest}: lists part {os.path.normpath(tmp_path / 'ds' / second)} twice; each part may appear only once"
    with pytest.raises(FormatError, match=f"^{re.escape(message)}$"):
        MmapDataset(tmp_path / "ds")
    assert verify(tmp_path / "ds").problems == [message]
    for command in (("inspect", tmp_path / "ds"), ("merge", tmp_path / "ds", "-o", tmp_path / "m", "--copy")):
        result = run(*command)
        assert (result.exit_code, result.output) == (1, f"Error: {message}\n"), command
    assert not (tmp_path / "m").exists()


def test_a_manifest_listing_a_directory_of_parts_is_refused_with_the_way_out(tmp_path, sources) -> None:
    for i in range(2):
        convert_part_at([sources], tmp_path / "inner" / f"p{i}", (i, 2), workers=1)
    assert (
        run("merge", tmp_path / "inner" / "p0", tmp_path / "inner" / "p1", "-o", tmp_path / "inner").exit_code
        == 0
    )
    (tmp_path / "outer").mkdir()
    manifest = tmp_path / "outer" / "manifest.json"
    manifest.write_text(json.dumps({"format": "npz2mmap-parts", "version": 1, "parts": ["../inner"]}))
    message = (
        f"{manifest}: lists {tmp_path / 'inner'}, itself a directory of parts (it holds manifest.json); "
        "list its parts instead (npz2mmap merge takes both directories and writes one list)"
    )
    with pytest.raises(FormatError, match=f"^{re.escape(message)}$"):
        MmapDataset(tmp_path / "outer")
    assert run("merge", tmp_path / "inner", "-o", tmp_path / "joined").exit_code == 0  # the way out
    assert len(MmapDataset(tmp_path / "joined")) == len(MmapDataset(tmp_path / "inner"))


def test_a_manifest_with_a_key_twice_is_refused(tmp_path, sources) -> None:
    """json keeps the last of two equal keys, another reader may keep the first: neither is taken."""
    for i in range(2):
        convert_part_at([sources], tmp_path / "ds" / f"p{i}", (i, 2), workers=1)
    manifest = tmp_path / "ds" / "manifest.json"
    manifest.write_text('{"format": "npz2mmap-parts", "version": 1, "parts": ["p0"], "parts": ["p0", "p1"]}')
    result = run("inspect", tmp_path / "ds")
    assert (result.exit_code, result.output) == (
        1,
        f"Error: {manifest}: not valid JSON (key 'parts' appears twice in one object)\n",
    )


def test_part_selection_and_its_errors(tmp_path, sources, monkeypatch) -> None:
    files = [f"f{i}" for i in range(10)]
    assert [select_part(files, (i, 4)) for i in range(4)] == [files[0:2], files[2:5], files[5:7], files[7:10]]
    assert [select_part(files[:3], (i, 4)) for i in range(4)] == [[], files[0:1], files[1:2], files[2:3]]
    assert part_from_environment({"RANK": "2", "WORLD_SIZE": "8"}) == (2, 8)
    assert part_from_environment({"SLURM_PROCID": "5", "SLURM_NTASKS": "6"}) == (5, 6)
    for variable in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(variable, raising=False)
    for value, message in [
        ("4/4", "part 4/4 does not exist"),
        ("auto", "--part auto needs RANK and WORLD_SIZE"),
        ("x", "'x' is not I/N (two plain integers) or auto"),
        (" 1/2", "' 1/2' is not I/N (two plain integers) or auto"),
        ("1_0/20", "'1_0/20' is not I/N (two plain integers) or auto"),
        ("-1/2", "'-1/2' is not I/N (two plain integers) or auto"),
        ("0/100001", "part 0/100001: at most 100,000 parts, so that part names sort in order"),
    ]:
        result = run("convert", sources, "-o", tmp_path / "o", "--part", value)
        assert result.exit_code == 2 and message in result.output, result.output
    result = run("convert", sources, "-o", tmp_path / "o-{part}", "--part", "1/2", "-q")
    assert result.exit_code == 0 and len(MmapDataset(tmp_path / "o-00001")) == 11
    assert not os.path.exists(tmp_path / "o")


# --- one meaning of part: CLI, convert() and Writer alike ---------------------------

LAUNCHERS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")
SPELLINGS = {  # each asks for part 1 of 3: (part value, environment)
    "tuple": ((1, 3), {}),
    "list": ([1, 3], {}),
    "I/N": ("1/3", {}),
    "auto, torchrun": ("auto", {"RANK": "1", "WORLD_SIZE": "3"}),
    "auto, Slurm": ("auto", {"SLURM_PROCID": "1", "SLURM_NTASKS": "3"}),
}


def write_part(how: str, sources: Path, out: Path, part: object) -> None:
    """Part ``part`` of ``sources`` written at ``out`` by the CLI, convert() or a Writer."""
    files = sorted(sources.iterdir())
    if how == "CLI":
        result = run("convert", sources, "-o", out, "--part", part, "--workers", "1", "-q")
        assert (result.exit_code, result.output) == (0, "")
    elif how == "convert()":
        convert([sources], out, part=part, workers=1)  # type: ignore[arg-type]
    else:
        with npz2mmap.Writer(out, part=part) as w:  # type: ignore[arg-type]
            for path in files[len(files) // 3 : 2 * len(files) // 3]:  # what part 1 of 3 converts
                with np.load(path) as npz:
                    w.append(dict(npz), source=str(path))


@pytest.mark.parametrize("out_name", ["ds", "ds-{part}"])
@pytest.mark.parametrize(
    ("how", "spelling"),
    [
        (how, spelling)
        for how in ("CLI", "convert()", "Writer")
        for spelling, (part, _) in SPELLINGS.items()
        if how != "CLI" or isinstance(part, str)  # the CLI takes I/N or auto
    ],
)
def test_every_spelling_of_part_writes_the_same_part_in_the_same_place(
    tmp_path, sources, monkeypatch, how, spelling, out_name
) -> None:
    part, environ = SPELLINGS[spelling]
    for variable in LAUNCHERS:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environ.items():
        monkeypatch.setenv(variable, value)
    write_part(how, sources, tmp_path / out_name, part)
    if out_name == "ds":
        written = tmp_path / "ds" / "part-00001"
        assert os.listdir(tmp_path / "ds") == ["part-00001"]
    else:
        written = tmp_path / "ds-00001"
    assert sorted(os.listdir(tmp_path)) == sorted(["src", written.relative_to(tmp_path).parts[0]])
    assert json.loads((written / "index.json").read_text())["provenance"]["part"] == [1, 3]
    reader = DatasetReader(written)
    files = sorted(sources.iterdir())[7:14]  # part 1 of 3 of 22 files
    assert len(reader) == len(files)
    for i, path in enumerate(files):
        with np.load(path) as npz:
            for key in npz.files:
                assert_same_array(reader.view(key, i), npz[key])


@settings(max_examples=200, deadline=None)
@given(
    part=st.integers(1, MAX_PARTS).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
    out=st.sampled_from(["ds", "a/b", "ds-{part}", "{part}/x"]),
)
def test_every_spelling_of_a_part_resolves_to_one_part_and_one_directory(part, out) -> None:
    """(i, n), [i, n], "I/N" and "auto" from torchrun's or Slurm's variables: one answer."""
    i, n = part
    expected_dir = (
        out.replace("{part}", f"{i:05d}") if "{part}" in out else os.path.join(out, f"part-{i:05d}")
    )
    spellings = [(i, n), [i, n], (np.int64(i), np.int32(n)), f"{i}/{n}"]
    for spelling in spellings:
        assert resolve_part(spelling, out) == ((i, n), expected_dir)
    for environ in ({"RANK": str(i), "WORLD_SIZE": str(n)}, {"SLURM_PROCID": str(i), "SLURM_NTASKS": str(n)}):
        with mock.patch.dict(os.environ, environ, clear=True):
            assert resolve_part("auto", Path(out)) == ((i, n), expected_dir)
    if "{part}" in out:
        with pytest.raises(ValueError, match=re.escape(f"'{out}' holds {{part}}")):
            resolve_part(None, Path(out))
    else:
        assert resolve_part(None, Path(out)) == (None, out)


def test_an_out_holding_part_is_refused_without_a_part_on_every_path(tmp_path, sources) -> None:
    """``-o 'ds-{part}'`` with --part forgotten would write one whole dataset at a directory
    literally named ds-{part}: refused, by the CLI, convert() and the Writer alike."""
    out = tmp_path / "ds-{part}"
    message = f"OUT '{out}' holds {{part}}, which only a part fills: give a part (--part, part=) or name OUT without {{part}}"
    result = run("convert", sources, "-o", out)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        convert([sources], out, workers=1)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        npz2mmap.Writer(out)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_the_per_rank_loop_converts_every_part_from_python_then_merges(tmp_path, sources) -> None:
    """Part after part into the same OUT, as ranks do: each goes to OUT/part-RRRRR, and the
    merge of them is byte for byte one conversion."""
    world = 3
    written = [
        convert([sources], tmp_path / "shards", part=(rank, world), workers=1) for rank in range(world)
    ]
    assert [result.out_dir for result in written] == [
        str(tmp_path / "shards" / f"part-{rank:05d}") for rank in range(world)
    ]
    merge([f"{tmp_path / 'shards'}/part-{r:05d}" for r in range(world)], tmp_path / "merged", copy=True)
    convert([sources], tmp_path / "single", workers=1)
    for name in ("data.npy", "index.json", "sources.jsonl"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "single" / name).read_bytes(), name


def test_appending_files_is_adding_a_part_and_rewriting_the_manifest(tmp_path, sources) -> None:
    convert([sources], tmp_path / "ds" / "part-a", workers=1)
    assert run("merge", tmp_path / "ds" / "part-a", "-o", tmp_path / "ds", "-q").exit_code == 0
    reader = MmapDataset(tmp_path / "ds")
    write_samples(
        tmp_path / "new",
        [{"x": np.zeros((2, 3), np.float32), "id": np.int64(99), "tokens": np.arange(3, dtype=np.int16)}],
    )
    convert([tmp_path / "new"], tmp_path / "ds" / "part-b", workers=1)
    refused = run("merge", tmp_path / "ds" / "part-a", tmp_path / "ds" / "part-b", "-o", tmp_path / "ds")
    assert refused.exit_code == 1 and "manifest.json: already exists; pass --overwrite" in refused.output
    assert (
        run(
            "merge",
            tmp_path / "ds" / "part-a",
            tmp_path / "ds" / "part-b",
            "-o",
            tmp_path / "ds",
            "--overwrite",
        ).exit_code
        == 0
    )
    assert len(reader) == 22 and reader[21]["id"] == 21  # opened before: still the old list
    grown = MmapDataset(tmp_path / "ds")
    assert len(grown) == 23 and grown[-1]["id"] == 99
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["manifest.json", "part-a", "part-b"]


def two_files(tmp_path: Path) -> Path:
    rng = np.random.default_rng(9)
    write_samples(
        tmp_path / "two",
        [
            {"x": rng.random((2, 3), dtype=np.float32), "tokens": np.arange(i + 1, dtype=np.int16)}
            for i in range(2)
        ],
    )
    return tmp_path / "two"


def assert_same_files(a: Path, b: Path) -> None:
    for name in ("data.npy", "index.json", "sources.jsonl", "skipped.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_an_empty_part_is_a_valid_dataset_that_merges_into_nothing(tmp_path) -> None:
    src = two_files(tmp_path)
    for i in range(3):
        result = run("convert", src, "-o", tmp_path / "parts", "--part", f"{i}/3", "-q")
        assert result.exit_code == 0, result.output
    empty = tmp_path / "parts" / "part-00000"
    index = json.loads((empty / "index.json").read_text())
    assert (index["num_samples"], index["fields"], index["provenance"]["part"]) == (0, [], [0, 3])
    assert (empty / "sources.jsonl").read_text() == "" and (empty / "skipped.jsonl").read_text() == ""
    assert len(MmapDataset(empty)) == 0 and MmapDataset(empty).fields == ()
    for command in (("inspect", empty), ("verify", empty, "--sources"), ("warm", empty, "-q")):
        assert run(*command).exit_code == 0, command
    parts = sorted((tmp_path / "parts").glob("part-*"))
    assert run("merge", *parts, "-o", tmp_path / "parts", "-q").exit_code == 0
    assert json.loads((tmp_path / "parts" / "manifest.json").read_text())["parts"] == [p.name for p in parts]
    convert([src], tmp_path / "single", workers=1)
    whole, single = MmapDataset(tmp_path / "parts"), MmapDataset(tmp_path / "single")
    assert len(whole) == 2
    for i in range(-2, 2):
        for key in ("x", "tokens"):
            assert_same_array(whole[i][key], single[i][key])
    assert run("verify", tmp_path / "parts", "--sources").exit_code == 0
    assert run("merge", *parts, "-o", tmp_path / "copied", "--copy", "-q").exit_code == 0
    assert_same_files(tmp_path / "copied", tmp_path / "single")
    moved = run("merge", *parts[1:], parts[0], "-o", tmp_path / "moved", "--copy", "-q")
    assert (moved.exit_code, moved.output) == (  # an empty part carries its place in the run too
        1,
        f"Error: parts {parts[1]} to {parts[0]}: listed out of order: {parts[2]}, part 2 of 3, before "
        f"{parts[0]}, part 0 of 3; list the parts in increasing order (as part-* sorts them), then merge\n",
    )
    assert not (tmp_path / "moved").exists()


def test_parts_whose_files_skip_bad_left_out_all_merge_into_the_refusal_of_one_conversion(tmp_path) -> None:
    for name in ("a", "b"):
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / f"{name}.npz").write_bytes(b"not a zip at all")
    first = f"{tmp_path / 'src' / 'a.npz'}: not a valid zip/npz file (File is not a zip file)"
    refusal = f"Error: no usable input: --skip-bad left out all 2; the first: {first}\n"
    single = run("convert", tmp_path / "src", "-o", tmp_path / "one", "--skip-bad", "-q")
    assert (single.exit_code, single.output) == (1, refusal)
    whole = run("convert", tmp_path / "src", "-o", tmp_path / "p1", "--skip-bad", "--part", "0/1", "-q")
    assert (whole.exit_code, whole.output) == (1, refusal)  # one part of one is the whole run
    assert not (tmp_path / "p1").exists()
    for i in range(2):
        assert run("convert", tmp_path / "src", "-o", tmp_path / "p2", "--skip-bad", "--part", f"{i}/2", "-q").exit_code == 0
    parts = sorted((tmp_path / "p2").glob("part-*"))
    for copy in ([], ["--copy"]):
        merged = run("merge", *parts, "-o", tmp_path / "merged", *copy, "-q")
        assert (merged.exit_code, merged.output) == (1, refusal)
        assert not (tmp_path / "merged").exists()


def test_parts_of_files_of_no_rows_beside_a_bad_one_merge_as_they_convert(tmp_path) -> None:
    """One conversion gave a dataset of no samples; its parts were refused: "left out all 1"."""
    (tmp_path / "src").mkdir()
    for name in ("a", "b"):
        np.savez(tmp_path / "src" / f"{name}.npz", x=np.zeros((0, 2), np.float32))
    (tmp_path / "src" / "c.npz").write_bytes(b"PK\x03\x04junk")
    options = ("--rows", "--skip-bad", "-q")
    assert run("convert", tmp_path / "src", "-o", tmp_path / "one", *options).exit_code == 0
    for i in range(3):
        assert run("convert", tmp_path / "src", "-o", tmp_path / "p", "--part", f"{i}/3", *options).exit_code == 0
    parts = sorted((tmp_path / "p").glob("part-*"))
    assert run("merge", *parts, "-o", tmp_path / "merged", "--copy", "-q").exit_code == 0
    for name in ("data.npy", "index.json", "sources.jsonl", "skipped.jsonl"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


def test_an_index_without_fields_is_refused_unless_it_has_no_samples(tmp_path) -> None:
    """Samples without fields would make every batch empty, and a loop over them endless."""
    convert([two_files(tmp_path)], tmp_path / "ds", workers=1)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["fields"] = []
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="no fields for 2 samples; only an empty dataset"):
        MmapDataset(tmp_path / "ds")
    assert not verify(tmp_path / "ds").ok


def test_torchrun_with_fewer_files_than_ranks_makes_an_empty_part(tmp_path) -> None:
    src = two_files(tmp_path)
    result = torchrun_convert(3, src, tmp_path / "parts")
    assert result.returncode == 0, result.stderr[-2000:]
    parts = sorted((tmp_path / "parts").glob("part-*"))
    assert [len(MmapDataset(p)) for p in parts] == [0, 1, 1]
    assert run("merge", *parts, "-o", tmp_path / "merged", "--copy", "-q").exit_code == 0
    convert([src], tmp_path / "single", workers=1)
    assert_same_files(tmp_path / "merged", tmp_path / "single")


def test_inspect_names_the_blob_of_every_part(tmp_path, sources) -> None:
    from npz2mmap.text import human_bytes

    ds = tmp_path / "ds"
    for i in range(2):
        convert_part_at([sources], ds / f"part-{i}", (i, 2), workers=1)
    merge([ds / "part-0", ds / "part-1"], ds)
    blobs = [ds / f"part-{i}" / "data.npy" for i in range(2)]
    sizes = [blob.stat().st_size for blob in blobs]
    lines = run("inspect", ds).output.splitlines()
    assert lines[4] == f"blobs    2, one per part, {human_bytes(sum(sizes))} in all, regions aligned to 64 B"
    assert lines[6].split() == ["part", "samples", "first", "sample", "blob", "blob", "bytes"]
    assert [line.split()[3:] for line in lines[7:9]] == [
        [str(blobs[0]), *human_bytes(sizes[0]).split()],
        [str(blobs[1]), *human_bytes(sizes[1]).split()],
    ]
    assert "data.npy," not in "\n".join(lines)  # no single blob named for the whole
    summary = json.loads(run("inspect", ds, "--json").output)
    assert summary["blobs"] == [str(blob) for blob in blobs] and summary["blob_nbytes"] == sum(sizes)
    assert [(p["blob"], p["blob_nbytes"]) for p in summary["parts"]] == [
        (str(b), n) for b, n in zip(blobs, sizes, strict=True)
    ]
    single = run("inspect", ds / "part-0").output.splitlines()
    assert single[3] == f"blob     {blobs[0]}, {human_bytes(sizes[0])}, regions aligned to 64 B"


def test_inspect_of_a_manifest_of_one_part_shows_the_part(tmp_path, sources) -> None:
    convert([sources], tmp_path / "one", workers=1)
    merge([tmp_path / "one"], tmp_path / "m")
    blob = tmp_path / "one" / "data.npy"
    lines = run("inspect", tmp_path / "m").output.splitlines()
    assert lines[2] == "parts    1, read in order as one dataset"
    assert lines[7].split() == [
        str(tmp_path / "one"),
        "22",
        "0",
        str(blob),
        *human_bytes(blob.stat().st_size).split(),
    ]


def test_inspect_shows_every_part_and_blob_empty_ones_marked(tmp_path, sources) -> None:
    parts = [tmp_path / "p" / f"part-{i}" for i in range(6)]
    for i, part in enumerate(parts):  # one source: parts 0 to 4 are empty, part 5 holds it
        convert_part_at([sorted(sources.iterdir())[0]], part, (i, 6), workers=1)
    merge(parts, tmp_path / "m")
    output = run("inspect", tmp_path / "m").output
    lines = output.splitlines()
    assert lines[2] == "parts    6, read in order as one dataset"
    sizes = [(part / "data.npy").stat().st_size for part in parts]
    assert lines[4] == f"blobs    6, one per part, {human_bytes(sum(sizes))} in all, regions aligned to 64 B"
    assert [line.split()[:4] for line in lines[7:13]] == [
        *[[str(part), "0", "(empty)", "0"] for part in parts[:5]],
        [str(parts[5]), "1", "0", str(parts[5] / "data.npy")],
    ]
    summary = json.loads(run("inspect", tmp_path / "m", "--json").output)
    assert summary["blobs"] == [str(part / "data.npy") for part in parts]
    assert [p["empty"] for p in summary["parts"]] == [True] * 5 + [False]


def test_inspect_of_a_manifest_of_one_empty_part_prints_no_empty_field_table(tmp_path) -> None:
    with npz2mmap.Writer(tmp_path / "w", part=(0, 1)):  # part 0 of 1, empty: a whole run
        pass
    os.rename(tmp_path / "w" / "part-00000", tmp_path / "empty")
    merge([tmp_path / "empty"], tmp_path / "m")
    lines = run("inspect", tmp_path / "m").output.splitlines()
    assert lines[7].split()[:3] == [str(tmp_path / "empty"), "0", "(empty)"]
    assert lines[-1] == "fields   none (no samples)"
    assert not any(line.startswith("field ") for line in lines)


@pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="POSIX links")
def test_a_manifest_written_through_a_linked_path_reads_the_same_parts_by_any_path(tmp_path, monkeypatch) -> None:
    """merge -o link/M wrote "../../A" from the link's spelling; opened by its real path (or from
    inside it) the manifest read another dataset, real/A, and verify passed."""
    monkeypatch.chdir(tmp_path)
    write_npz(tmp_path / "in1" / "0.npz", x=np.array([1]))
    write_npz(tmp_path / "in2" / "0.npz", x=np.array([222]))
    npz2mmap.convert(["in1"], "A", workers=1)
    npz2mmap.convert(["in2"], "real/A", workers=1)  # an unrelated dataset where a lexical ".." lands
    (tmp_path / "real" / "sub").mkdir()
    os.symlink("real/sub", "link")
    merge(["A"], "link/M")
    for path in ["link/M", "real/sub/M", str(tmp_path / "real" / "sub" / "M")]:
        assert MmapDataset(path)[0]["x"].tolist() == [1], path
    monkeypatch.chdir(tmp_path / "link" / "M")
    assert MmapDataset(".")[0]["x"].tolist() == [1]
