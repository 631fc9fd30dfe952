"""Rows mode: NPZ shards holding many samples along axis 0."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_same_array, write_npz

from npz2mmap import MmapDataset
from npz2mmap.check.verify import verify
from npz2mmap.errors import SourceError
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(4)
    shard_rows = [3, 0, 5, 2]
    for k, rows in enumerate(shard_rows):
        write_npz(
            tmp_path / "src" / f"shard{k}.npz",
            x=rng.random((rows, 2, 3), dtype=np.float32),
            y=np.arange(rows, dtype=">i8") + 100 * k,
            points=np.asfortranarray(
                rng.random((rows, k + 1, 2))
            ),  # rows of (k + 1, 2): ragged across shards
        )
    return tmp_path / "src", shard_rows


def rows_of(src, name):
    out = []
    for path in sorted(src.glob("*.npz")):
        with np.load(path) as npz:
            out += list(npz[name])
    return out


def test_rows_become_samples_in_order_fixed_and_ragged(tmp_path, shards) -> None:
    src, shard_rows = shards
    convert([src], tmp_path / "out", rows=True, workers=1)
    ds = MmapDataset(tmp_path / "out")
    assert len(ds) == sum(shard_rows) == 10
    fields = {f.name: f for f in ds.parts.indexes[0].fields}
    assert fields["x"].shape == (2, 3) and fields["y"].shape == () and fields["points"].shape is None
    for name in ("x", "y", "points"):
        for i, source in enumerate(rows_of(src, name)):
            assert_same_array(ds[i][name], source)
    assert ds.shapes("points").tolist() == [[1, 2]] * 3 + [[3, 2]] * 5 + [[4, 2]] * 2
    assert ds.lengths("points").tolist() == [1] * 3 + [3] * 5 + [4] * 2
    lines = [json.loads(line) for line in (tmp_path / "out" / "sources.jsonl").read_text().splitlines()]
    assert lines == [[str(src / f"shard{k}.npz"), rows] for k, rows in enumerate(shard_rows)]
    assert json.loads((tmp_path / "out" / "index.json").read_text())["provenance"]["mode"] == "rows"
    assert verify(tmp_path / "out", sources=True).ok


def test_rows_mode_is_byte_identical_for_any_workers_and_merges_like_a_single_conversion(
    tmp_path, shards
) -> None:
    src, _ = shards
    convert([src], tmp_path / "w1", rows=True, workers=1)
    convert([src], tmp_path / "w2", rows=True, workers=2)
    assert (tmp_path / "w1" / "data.npy").read_bytes() == (tmp_path / "w2" / "data.npy").read_bytes()
    for i in range(2):
        convert([src], tmp_path / "parts", rows=True, part=(i, 2), workers=1)
    merge(sorted((tmp_path / "parts").iterdir()), tmp_path / "merged", copy=True)
    for name in ("data.npy", "index.json", "sources.jsonl"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "w1" / name).read_bytes(), name


def test_verify_sources_names_the_changed_row(tmp_path, shards) -> None:
    src, _ = shards
    convert([src], tmp_path / "out", rows=True, workers=1)
    with np.load(src / "shard2.npz") as npz:
        arrays = dict(npz)
    arrays["y"] = arrays["y"].copy()
    arrays["y"][4] += 1
    write_npz(src / "shard2.npz", **arrays)
    report = verify(tmp_path / "out", sources=True)
    assert report.bad_samples == {"sources": [7]}
    assert report.problems == [
        f"sample 7 ({src / 'shard2.npz'} row 4): field 'y': values differ from the source"
    ]


def test_disagreeing_first_dimensions_and_scalars_are_refused(tmp_path) -> None:
    write_npz(tmp_path / "bad" / "a.npz", x=np.zeros((4, 2)), y=np.zeros(3))
    with pytest.raises(
        SourceError,
        match=r"a\.npz: keys disagree on the number of rows \(first dimension\): x has 4, y has 3",
    ):
        convert([tmp_path / "bad"], tmp_path / "out", rows=True, workers=1)
    write_npz(tmp_path / "scalar" / "a.npz", x=np.zeros((4, 2)), y=np.int64(3))
    with pytest.raises(SourceError, match=r"a\.npz\[y\]: a 0-d array has no rows"):
        convert([tmp_path / "scalar"], tmp_path / "out", rows=True, workers=1)
    assert not (tmp_path / "out").exists()


def test_a_dataset_of_zero_rows_is_valid_and_empty(tmp_path) -> None:
    write_npz(tmp_path / "src" / "empty.npz", x=np.zeros((0, 4), np.float32), y=np.zeros(0, np.int64))
    convert([tmp_path / "src"], tmp_path / "out", rows=True, workers=1)
    ds = MmapDataset(tmp_path / "out")
    assert len(ds) == 0 and ds.lengths("x").shape == (0,)
    assert verify(tmp_path / "out", sources=True).ok
    with pytest.raises(IndexError, match="out of range for 0 samples"):
        ds[0]


def test_merging_two_datasets_of_the_same_shard_keeps_each_ones_row_numbers(tmp_path, shards) -> None:
    src, shard_rows = shards
    convert([src / "shard2.npz"], tmp_path / "a", rows=True, workers=1)
    convert([src / "shard2.npz"], tmp_path / "b", rows=True, workers=1)
    merge([tmp_path / "a", tmp_path / "b"], tmp_path / "ab", copy=True)
    lines = [json.loads(line) for line in (tmp_path / "ab" / "sources.jsonl").read_text().splitlines()]
    assert lines == [[str(src / "shard2.npz"), 5], [str(src / "shard2.npz"), 5]]
    ds = MmapDataset(tmp_path / "ab")
    for i, source in enumerate(rows_of_file(src / "shard2.npz", "y") * 2):
        assert_same_array(ds[i]["y"], source)
    assert verify(tmp_path / "ab", sources=True).ok
    with np.load(src / "shard2.npz") as npz:
        arrays = dict(npz)
    arrays["y"] = arrays["y"] + 1
    write_npz(src / "shard2.npz", **arrays)
    problems = verify(tmp_path / "ab", sources=True).problems
    assert [p.split(": ")[0] for p in problems if "'y'" in p] == [
        f"sample {i} ({src / 'shard2.npz'} row {i % 5})" for i in range(10)
    ]


def rows_of_file(path, name):
    with np.load(path) as npz:
        return list(npz[name])


def test_provenance_of_many_rows_is_one_line_per_file(tmp_path) -> None:
    """A (2**20, 0) shard of a few hundred bytes must not become megabytes of provenance."""
    path = write_npz(tmp_path / "src" / "wide.npz", x=np.zeros((2**20, 0), np.float32))
    assert path.stat().st_size < 400
    convert([path], tmp_path / "out", rows=True, workers=1)
    assert (tmp_path / "out" / "sources.jsonl").read_text() == json.dumps([str(path), 2**20]) + "\n"
    assert len(MmapDataset(tmp_path / "out")) == 2**20
    assert verify(tmp_path / "out", sources=True).ok


def test_rows_whose_tables_cannot_fit_are_refused_naming_the_file(tmp_path) -> None:
    """(2**50, 0): 2**50 samples need 4 PiB of checksum tables; planned in memory it was a MemoryError."""
    from click.testing import CliRunner

    from npz2mmap.cli.commands import cli

    path = write_npz(tmp_path / "src" / "huge.npz", x=np.zeros((2**50, 0), np.float32))
    result = CliRunner().invoke(cli, ["convert", str(path), "-o", str(tmp_path / "out"), "--rows", "-q"])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {path}: its 1,125,899,906,842,624 rows bring the dataset to ")
    assert "checksum tables alone need 4,503,599,627,370,496 bytes, more than the" in result.output
    assert len(result.output.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_verify_sources_reports_a_shard_of_zero_rows_that_gained_rows(tmp_path) -> None:
    path = write_npz(tmp_path / "src" / "a.npz", x=np.zeros((0, 2), np.float32))
    write_npz(tmp_path / "src" / "b.npz", x=np.ones((1, 2), np.float32))
    convert([tmp_path / "src"], tmp_path / "out", rows=True, workers=1)
    assert verify(tmp_path / "out", sources=True).ok
    write_npz(path, x=np.zeros((2, 2), np.float32))
    report = verify(tmp_path / "out", sources=True)
    assert report.problems == [f"{path}: field 'x': the source holds 2 rows, not the 0 sources.jsonl names"]


@pytest.mark.parametrize("copy", [False, True])
def test_a_part_of_only_an_empty_shard_merges_as_one_conversion_reads(tmp_path, copy) -> None:
    """A part whose one file has no rows has no shape to give its fields: merged (listed or
    copied), the field is fixed as in one conversion of all the files, and every sample reads alike."""
    src = tmp_path / "src"
    write_npz(src / "f0.npz", x=np.arange(6, dtype=np.float32).reshape(2, 3))
    write_npz(src / "f1.npz", x=np.zeros((0, 3), dtype=np.float32))
    write_npz(src / "f2.npz", x=np.arange(6, 12, dtype=np.float32).reshape(2, 3))
    single = MmapDataset(convert([src], tmp_path / "single", rows=True, workers=1).out_dir)
    parts = [convert([src], tmp_path / "p", rows=True, part=(i, 3), workers=1).out_dir for i in range(3)]
    result = merge(parts, tmp_path / "m", copy=copy)
    assert result.ragged_across_parts == ()
    merged = MmapDataset(tmp_path / "m")
    assert merged.parts.field("x").shape == single.parts.field("x").shape == (3,)
    assert len(merged) == len(single) == 4
    for i in range(4):
        assert merged[i]["x"].tobytes() == single[i]["x"].tobytes()
    assert (
        merged.__getitems__([3, 0, 2]).field("x").tobytes()
        == single.__getitems__([3, 0, 2]).field("x").tobytes()
    )
