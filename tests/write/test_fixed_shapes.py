"""Fields nearly fixed (reported) and fields held fixed (--fixed, Writer(fixed=)).

The oracle of the report is the rule of npz2mmap.write.shapes written again here
with a Counter over each source's shape; the oracle of --fixed with
--skip-bad is a conversion of only the files that keep the first file's
shape, compared byte for byte.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from conftest import blob_bytes, write_npz
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from strategies import shape_mixes

import npz2mmap
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FixedShapeError, RaggedFieldWarning, UnknownKeyError
from npz2mmap.format.index import (
    BLOB_HEADER_NBYTES,
    IDENTITY_NBYTES,
    INDEX_NAME,
    SKIPPED_NAME,
    SOURCES_NAME,
    load_index,
)
from npz2mmap.write.conversion import convert
from npz2mmap.write.layout import lay_out
from npz2mmap.write.shapes import NearlyFixed, find_nearly_fixed

IMAGE = (3, 96, 96)
TRANSPOSED = (96, 96, 3)


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def rule_says(shapes: list[tuple[int, ...]]) -> tuple[tuple[int, ...], int, int, int] | None:
    """The documented rule, counted afresh: (common shape, sources, odd ones, first odd) or None."""
    counts = Counter(shapes)
    if not 2 <= len(counts) <= 4:
        return None
    common, count = counts.most_common(1)[0]
    odd = len(shapes) - count
    if count <= len(shapes) / 2 or (odd > 1 and odd > len(shapes) / 100):
        return None
    return common, len(shapes), odd, next(k for k, s in enumerate(shapes) if s != common)


def reported(items: tuple[NearlyFixed, ...]) -> list[tuple[str, tuple[int, ...], int, int, int]]:
    return [(i.field, i.shape, i.num_sources, i.num_odd, i.first_odd) for i in items]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[Path, Path]:
    """500 images (3, 96, 96) and, sorted among them, one saved (96, 96, 3)."""
    src = tmp_path_factory.mktemp("images") / "src"
    for k in range(500):
        write_npz(src / f"s{k:04d}.npz", image=np.full(IMAGE, k % 251, dtype=np.uint8), label=np.int64(k))
    odd = write_npz(src / "s0250b.npz", image=np.zeros(TRANSPOSED, dtype=np.uint8), label=np.int64(-1))
    return src, odd


def assert_same_dataset(got: Path, expected: Path) -> None:
    """Byte for byte, but for what counts the files left out: num_skipped, skipped.jsonl and
    the blob's identity (the digest of index.json)."""
    got_blob, expected_blob = blob_bytes(got), blob_bytes(expected)
    payload = BLOB_HEADER_NBYTES + IDENTITY_NBYTES
    assert got_blob[:BLOB_HEADER_NBYTES] == expected_blob[:BLOB_HEADER_NBYTES]
    assert got_blob[payload:] == expected_blob[payload:]
    got_index = json.loads((got / INDEX_NAME).read_text())
    expected_index = json.loads((expected / INDEX_NAME).read_text())
    got_index["provenance"]["num_skipped"] = expected_index["provenance"]["num_skipped"]
    assert got_index == expected_index
    assert (got / SOURCES_NAME).read_bytes() == (expected / SOURCES_NAME).read_bytes()


def skipped_records(dataset: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in (dataset / SKIPPED_NAME).read_text().splitlines()]


@pytest.mark.parametrize("workers", [1, 2])
def test_one_transposed_image_among_500_is_reported(tmp_path, images, workers) -> None:
    src, odd = images
    result = run("convert", src, "-o", tmp_path / "out", "--workers", workers, "--progress", "none")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"Converted 501 samples, 2 fields, 13.9 MB into {tmp_path / 'out'} in ")
    assert result.stderr == (
        f"Warning: field image is ragged only because 1 of 501 files differs from shape {IMAGE}: "
        f"the first, {odd}, has {TRANSPOSED}; --fixed image refuses such files (with --skip-bad, "
        "leaves them out)\n"
    )


def test_a_part_says_its_count_is_over_its_files_and_how_fixed_holds_a_part(tmp_path) -> None:
    """A part advised --fixed x over its own slice; followed, --fixed held it to the first file of
    the whole list, and the part's three files were all left out."""
    shapes = [3, 3, 3, 4, 4, 2, 5, 4, 4]
    for k, n in enumerate(shapes):
        write_npz(tmp_path / "in" / f"{k}.npz", x=np.arange(float(n)))
    whole = run("convert", tmp_path / "in", "-o", tmp_path / "one", "-q", "--workers", 1)
    assert (whole.exit_code, whole.stderr) == (0, "")
    part = run("convert", tmp_path / "in", "-o", tmp_path / "p", "--part", "1/3", "-q", "--workers", 1)
    assert (part.exit_code, part.stderr) == (
        0,
        f"Warning: field x is ragged only because 1 of 3 files differs from shape (4,): the first, "
        f"{tmp_path / 'in' / '5.npz'}, has (2,); counted over this part's files alone: --fixed x holds "
        "every part to the first file of the whole input list, so look at the shapes of the whole list "
        "before using it\n",
    )


def test_the_result_names_the_nearly_fixed_field(tmp_path, images) -> None:
    src, odd = images
    result = convert([src], tmp_path / "out", workers=2)
    assert result.nearly_fixed == (NearlyFixed("image", IMAGE, 501, 1, 251, str(odd), TRANSPOSED),)
    assert convert([src], tmp_path / "again", keys=["label"]).nearly_fixed == ()


@pytest.mark.parametrize("workers", [1, 2])
def test_fixed_refuses_the_transposed_image(tmp_path, images, workers) -> None:
    src, odd = images
    out = tmp_path / "out"
    result = run("convert", src, "-o", out, "--fixed", "image", "--workers", workers, "--progress", "none")
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: {odd}[image]: shape {TRANSPOSED} differs from {IMAGE} in {src / 's0000.npz'}, and "
        "--fixed image requires one shape; use --skip-bad to leave such files out\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_fixed_with_skip_bad_leaves_it_out_and_lists_it(tmp_path, images, workers) -> None:
    src, odd = images
    out = tmp_path / "out"
    result = run("convert", src, "-o", out, "--fixed", "image", "--skip-bad", "--workers", workers, "-q")
    assert result.exit_code == 0, result.output
    reason = (
        f"{odd}[image]: shape {TRANSPOSED} differs from {IMAGE} in {src / 's0000.npz'}, and "
        "--fixed image requires one shape"
    )
    assert skipped_records(out) == [{"path": str(odd), "reason": reason}]
    assert result.stderr == (
        f"Warning: skipped 1 bad file, listed in {out / SKIPPED_NAME}; the first: {reason}\n"
    )
    conforming = sorted(p for p in src.iterdir() if p != odd)
    convert(conforming, tmp_path / "expected")
    assert_same_dataset(out, tmp_path / "expected")


def test_a_fixed_key_that_is_not_a_field_is_a_usage_error(tmp_path, images) -> None:
    src, _ = images
    first = src / "s0000.npz"
    result = run("convert", src, "-o", tmp_path / "out", "--fixed", "imag", "--workers", 2)
    assert result.exit_code == 2
    assert result.stderr.endswith(
        f"Error: {first}: --fixed imag names no field of the dataset (its fields: 'image', 'label')\n"
    )
    result = run("convert", src, "-o", tmp_path / "out", "--keys", "label", "--fixed", "image")
    assert result.exit_code == 2
    assert result.stderr.endswith(
        f"Error: {first}: --fixed image names no field of the dataset (its fields: 'label')\n"
    )
    assert result.stderr.startswith("Usage: ")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnknownKeyError):
        convert([first], tmp_path / "out", fixed=["imag"])
    with pytest.raises(TypeError, match="fixed must be a list of keys, not 'image'"):
        convert([first], tmp_path / "out", fixed="image")


def test_fixed_is_repeatable_and_names_the_first_field_a_file_breaks(tmp_path) -> None:
    src = tmp_path / "src"
    write_npz(src / "0.npz", a=np.zeros(2), b=np.zeros(3))
    write_npz(src / "1.npz", a=np.zeros(2), b=np.zeros(4))
    write_npz(src / "2.npz", a=np.zeros(5), b=np.zeros(4))
    result = run("convert", src, "-o", tmp_path / "out", "--fixed", "b", "--fixed", "a", "--skip-bad", "-q")
    assert result.exit_code == 0, result.output
    assert [r["reason"] for r in skipped_records(tmp_path / "out")] == [
        f"{src / '1.npz'}[b]: shape (4,) differs from (3,) in {src / '0.npz'}, and --fixed b requires one shape",
        f"{src / '2.npz'}[a]: shape (5,) differs from (2,) in {src / '0.npz'}, and --fixed a requires one shape",
    ]
    result = run("convert", src, "-o", tmp_path / "empty-key", "--fixed", "")
    assert result.exit_code == 2
    assert result.stderr.endswith("Error: Invalid value for '--fixed': give a key, e.g. --fixed image\n")


def test_rows_count_files_and_refuse_a_shard(tmp_path) -> None:
    """In rows mode a file's rows share one shape: files are counted, an empty file holds none."""
    src = tmp_path / "src"
    for k in range(3):
        write_npz(src / f"{k}.npz", x=np.zeros((4, 2, 3), dtype=np.float32))
    write_npz(src / "3.npz", x=np.zeros((0, 7, 7), dtype=np.float32))  # no samples, no shape to keep
    odd = write_npz(src / "4.npz", x=np.ones((5, 3, 2), dtype=np.float32))
    result = convert([src], tmp_path / "out", rows=True, workers=2)
    assert result.nearly_fixed == (NearlyFixed("x", (2, 3), 4, 1, 4, str(odd), (3, 2)),)
    with pytest.raises(FixedShapeError) as caught:
        convert([src], tmp_path / "refused", rows=True, fixed=["x"])
    assert str(caught.value) == (
        f"{odd}[x]: rows of shape (3, 2) differ from (2, 3) in {src / '0.npz'}, and --fixed x "
        "requires one shape; use --skip-bad to leave such files out"
    )
    kept = convert([src], tmp_path / "kept", rows=True, fixed=["x"], skip_bad=True)
    assert [path for path, _ in kept.skipped] == [str(odd)]
    assert kept.index.num_samples == 12 and kept.nearly_fixed == ()
    convert(sorted(src.iterdir())[:4], tmp_path / "expected", rows=True)
    assert_same_dataset(tmp_path / "kept", tmp_path / "expected")


def test_npy_files_and_sample_directories(tmp_path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for k in range(4):
        np.save(flat / f"{k}.npy", np.zeros((2, 5)))
    np.save(flat / "4.npy", np.zeros((5, 2)))
    result = run("convert", flat, "-o", tmp_path / "flat.mmap", "--fixed", "arr_0")
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: {flat / '4.npy'}[arr_0]: shape (5, 2) differs from (2, 5) in {flat / '0.npy'}, and "
        "--fixed arr_0 requires one shape; use --skip-bad to leave such files out\n"
    )
    dirs = tmp_path / "dirs"
    for k in range(4):
        (dirs / f"s{k}").mkdir(parents=True)
        np.save(dirs / f"s{k}" / "image.npy", np.zeros((3, 4) if k != 2 else (4, 3), dtype=np.uint8))
        np.save(dirs / f"s{k}" / "label.npy", np.int64(k))
    result = convert([dirs], tmp_path / "dirs.mmap", sample_dirs=True, workers=2)
    assert reported(result.nearly_fixed) == [("image", (3, 4), 4, 1, 2)]
    assert result.nearly_fixed[0].first_odd_source == str(dirs / "s2")
    kept = convert([dirs], tmp_path / "kept.mmap", sample_dirs=True, fixed=["image"], skip_bad=True)
    assert [path for path, _ in kept.skipped] == [str(dirs / "s2")]
    assert kept.index.field("image").shape == (3, 4)


def test_parts_hold_the_first_file_of_the_whole_list(tmp_path) -> None:
    """Each part of a conversion holds --fixed keys to the first file of all the inputs, so a
    part whose own files agree among themselves is refused as one conversion would be."""
    src = tmp_path / "src"
    for k in range(8):
        write_npz(src / f"{k}.npz", x=np.zeros((2, 2) if k < 4 else (1, 4)))
    first = convert([src], tmp_path / "p0", part=(0, 2), fixed=["x"])
    assert first.index.field("x").shape == (2, 2)
    with pytest.raises(
        FixedShapeError, match=r"4\.npz\[x\]: shape \(1, 4\) differs from \(2, 2\) in .*[/\\]0\.npz, and"
    ):
        convert([src], tmp_path / "p1", part=(1, 2), fixed=["x"])
    assert not (tmp_path / "p1").exists()
    kept = convert([src], tmp_path / "p1-kept", part=(1, 2), fixed=["x"], skip_bad=True)
    assert kept.index.num_samples == 0
    assert [Path(path).name for path, _ in kept.skipped] == ["4.npz", "5.npz", "6.npz", "7.npz"]
    result = run("convert", str(src), "-o", str(tmp_path / "cli"), "--part", "1/2", "--fixed", "x", "-q")
    assert result.exit_code == 1
    assert "4.npz[x]: shape (1, 4) differs from (2, 2) in " in result.output
    unreadable = tmp_path / "unreadable"
    (unreadable / "0.npz").parent.mkdir()
    (unreadable / "0.npz").write_bytes(b"not a zip")
    for k in range(1, 4):
        write_npz(unreadable / f"{k}.npz", x=np.zeros((2, 2) if k == 1 else (1, 4)))
    with pytest.raises(FixedShapeError, match=r"2\.npz\[x\]: .* in .*[/\\]1\.npz"):
        convert([unreadable], tmp_path / "u1", part=(1, 2), fixed=["x"])  # the bad 0.npz is part 0's to report
    empty = convert([src / "0.npz"], tmp_path / "empty", part=(0, 2), fixed=["x"])
    assert empty.index.num_samples == 0


def test_genuinely_ragged_fields_are_not_reported(tmp_path) -> None:
    """Of 400 files, 1% off the common shape is reported when they take few shapes, not many."""
    src = tmp_path / "src"
    for k in range(400):
        odd = k % 100 == 50
        write_npz(
            src / f"a{k:03d}.npz",
            tokens=np.arange(k + 1),  # every length distinct
            window=np.arange(k // 100 + 1 if odd else 8),  # the odd four take four lengths of their own
            image=np.zeros((3, 2) if odd else (2, 3)),  # the odd four share one shape
        )
    result = convert([src], tmp_path / "out")
    assert reported(result.nearly_fixed) == [("image", (2, 3), 400, 4, 50)]


def test_writer_fixed_refuses_a_sample_and_stays_usable(tmp_path) -> None:
    with npz2mmap.Writer(tmp_path / "w", fixed=["image"]) as w:
        w.append({"image": np.zeros((3, 4), dtype=np.uint8), "label": np.int64(0)}, source="a")
        with pytest.raises(FixedShapeError) as caught:
            w.append({"image": np.zeros((4, 3), dtype=np.uint8), "label": np.int64(1)}, source="b")
        w.append({"image": np.ones((3, 4), dtype=np.uint8), "label": np.int64(2)}, source="c")
    assert str(caught.value) == (
        "sample 1 (b)[image]: shape (4, 3) differs from (3, 4) in sample 0 (a), and fixed=['image'] "
        "requires one shape"
    )
    assert w.nearly_fixed == ()
    with npz2mmap.Writer(tmp_path / "expected") as e:
        e.append({"image": np.zeros((3, 4), dtype=np.uint8), "label": np.int64(0)}, source="a")
        e.append({"image": np.ones((3, 4), dtype=np.uint8), "label": np.int64(2)}, source="c")
    for name in (INDEX_NAME, SOURCES_NAME, "data.npy"):
        assert (tmp_path / "w" / name).read_bytes() == (tmp_path / "expected" / name).read_bytes()


def test_merge_warns_of_a_field_each_part_holds_fixed_in_another_shape(tmp_path) -> None:
    """A Writer's parts each hold fixed= keys to their own first sample; merge is the first to
    see them all, and says the merged field is ragged (Python: a warning; CLI: a line on stderr)."""
    shapes = [(3, 4), (3, 4), (4, 3)]
    for rank, shape in enumerate(shapes):
        with npz2mmap.Writer(tmp_path / "w", part=(rank, len(shapes)), fixed=["image"]) as w:
            for _ in range(2):
                w.append({"image": np.zeros(shape, dtype=np.uint8), "label": np.int64(rank)})
    parts = sorted(str(p) for p in (tmp_path / "w").glob("part-*"))
    line = (
        f"field image is ragged only because the parts differ in shape: {parts[0]} has (3, 4), "
        f"{parts[2]} has (4, 3); convert the parts again with one shape if it should be fixed"
    )
    with pytest.warns(RaggedFieldWarning) as caught:
        result = npz2mmap.write.merge.merge(parts, tmp_path / "m", copy=True)
    assert [str(w.message) for w in caught] == [line]
    assert result.ragged_across_parts == (line,)
    assert load_index(tmp_path / "m").field("image").ragged
    cli_result = CliRunner().invoke(cli, ["merge", *parts, "-o", str(tmp_path / "listed"), "-q"])
    assert cli_result.exit_code == 0
    assert cli_result.stderr == f"Warning: {line}\n"
    for rank in range(2):
        with npz2mmap.Writer(tmp_path / "agree", part=(rank, 2), fixed=["image"]) as w:
            w.append({"image": np.zeros((3, 4), dtype=np.uint8), "label": np.int64(rank)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agreeing = npz2mmap.write.merge.merge(sorted((tmp_path / "agree").glob("part-*")), tmp_path / "a", copy=True)
    assert agreeing.ragged_across_parts == ()


def test_merge_of_one_sample_parts_says_nothing_of_their_shapes(tmp_path) -> None:
    """A part of one sample holds every field fixed, whatever the data: variable-length data
    converted one file a part is not reported, as a single conversion of it is not."""
    for rank in range(4):
        with npz2mmap.Writer(tmp_path / "w", part=(rank, 4)) as w:
            w.append({"tokens": np.arange(rank + 1), "label": np.int64(rank)})
    parts = sorted(str(p) for p in (tmp_path / "w").glob("part-*"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = npz2mmap.write.merge.merge(parts, tmp_path / "m", copy=True)
    assert result.ragged_across_parts == ()


def test_writer_fixed_names_fields(tmp_path) -> None:
    w = npz2mmap.Writer(tmp_path / "w", fixed=["imag"])
    with pytest.raises(UnknownKeyError) as caught:
        w.append({"image": np.zeros(3), "label": np.int64(0)})
    assert (
        str(caught.value)
        == "sample 0: fixed=['imag'] names no field of the dataset (its fields: 'image', 'label')"
    )
    assert w.num_samples == 0
    w.abort()
    with pytest.raises(TypeError):
        npz2mmap.Writer(tmp_path / "w", fixed="image")


def test_writer_warns_once_at_close(tmp_path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with npz2mmap.Writer(tmp_path / "w") as w:
            for k in range(200):
                w.append({"x": np.zeros((2, 3) if k != 7 else (3, 2))}, source=f"gen/{k}")
            assert caught == []
    assert [(c.category, str(c.message), Path(c.filename).name) for c in caught] == [
        (
            RaggedFieldWarning,
            "field x is ragged only because 1 of 200 samples differs from shape (2, 3): the first, "
            "sample 7 (gen/7), has (3, 2); fixed=['x'] refuses such samples",
            Path(__file__).name,
        )
    ]
    assert w.nearly_fixed == (NearlyFixed("x", (2, 3), 200, 1, 7, "gen/7", (3, 2)),)


@settings(max_examples=200, deadline=None)
@given(shape_mixes(max_sources=600), st.booleans())
@example([(1, 1), (1, 2)], False)  # an even split: no shape holds more than half
@example([(1, 1)] * 197 + [(1, 2)] * 2, False)  # two odd sources, fewer than 1% of 199
@example([(1, 1)] * 198 + [(1, 2)] * 2, True)  # two odd sources, 1% of 200
@example([(1, 1)] * 396 + [(1, 2), (2, 1), (2, 2), (1, 3)], False)  # five shapes, 1% odd
@example([(1, 1)] * 297 + [(1, 2), (2, 1), (2, 2)], False)  # four shapes, 1% odd
def test_the_rule_over_shape_tables(shapes, rows) -> None:
    """find_nearly_fixed on a plan reports exactly what the rule says (files, or rows with empty files)."""
    if rows:  # each file holds two rows, and an empty file follows each
        sources = [name for k in range(len(shapes)) for name in (f"f{k}", f"empty{k}")]
        starts = np.concatenate([[0], np.cumsum([2, 0] * len(shapes))]).astype(np.int64)
        table = np.repeat(np.array(shapes, dtype=np.int64), 2, axis=0)
        plan = lay_out(sources, [("x", np.dtype("u1"), table, False)], 64, starts, "rows")
    else:
        sources = [f"f{k}" for k in range(len(shapes))]
        plan = lay_out(sources, [("x", np.dtype("u1"), np.array(shapes, dtype=np.int64), False)], 64)
    expected = rule_says(shapes)
    got = reported(find_nearly_fixed(plan))
    if expected is None:
        assert got == []
    else:
        common, num_sources, num_odd, first_odd = expected
        assert got == [("x", common, num_sources, num_odd, first_odd * 2 if rows else first_odd)]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shapes=shape_mixes(max_sources=12),
    workers=st.sampled_from([1, 2]),
    rows=st.booleans(),
    num_parts=st.integers(1, 4),
)
def test_reported_and_held_fixed_over_shape_mixes(tmp_path_factory, shapes, workers, rows, num_parts) -> None:
    """Converted files: the report is the rule's, and --fixed --skip-bad converts exactly the files
    that keep the first file's shape, in one conversion or in parts merged by copy."""
    root = tmp_path_factory.mktemp("mix")
    paths = []
    for k, shape in enumerate(shapes):
        x = np.full(((2, *shape) if rows else shape), k, dtype=np.int16)
        paths.append(write_npz(root / "src" / f"{k:03d}.npz", x=x, y=np.arange(2 if rows else 1) + k))
    result = convert([root / "src"], root / "all", workers=workers, rows=rows)
    expected = rule_says(shapes)
    assert reported(result.nearly_fixed) == ([] if expected is None else [("x", *expected)])
    held = convert([root / "src"], root / "held", workers=workers, rows=rows, fixed=["x"], skip_bad=True)
    conforming = [p for p, shape in zip(paths, shapes, strict=True) if shape == shapes[0]]
    assert [path for path, _ in held.skipped] == [str(p) for p in paths if p not in conforming]
    assert held.nearly_fixed == ()
    convert(conforming, root / "expected", rows=rows)
    assert_same_dataset(root / "held", root / "expected")
    parts = [
        convert([root / "src"], root / "parts", part=(i, num_parts), rows=rows, fixed=["x"], skip_bad=True).out_dir
        for i in range(num_parts)
    ]
    npz2mmap.write.merge.merge(parts, root / "merged", copy=True)
    assert_same_dataset(root / "merged", root / "expected")
    if len(conforming) < len(paths):
        with pytest.raises(FixedShapeError) as caught:
            convert([root / "src"], root / "refused", workers=workers, rows=rows, fixed=["x"])
        first_odd = next(p for p in paths if p not in conforming)
        assert str(caught.value).startswith(f"{first_odd}[x]: ")
        assert not (root / "refused").exists()


def test_when_the_first_file_is_the_odd_one_the_advice_is_to_move_it_not_to_skip_the_rest(tmp_path) -> None:
    """--fixed keeps the first file's shape: advising it with --skip-bad would leave out every good file."""
    src = tmp_path / "src"
    for k in range(30):
        write_npz(src / f"{k:03d}.npz", img=np.zeros((4, 3) if k == 0 else (4, 4), dtype=np.uint8))
    result = run("convert", src, "-o", tmp_path / "out", "--progress", "none")
    assert result.exit_code == 0, result.output
    odd = src / "000.npz"
    assert result.stderr == (
        f"Warning: field img is ragged only because 1 of 30 files differs from shape (4, 4): the first, {odd}, "
        "has (4, 3); --fixed img keeps the first file's shape, and that file is one that differs: move it out "
        "of the inputs (or save it as (4, 4)), then convert with --fixed img\n"
    )
    odd.rename(tmp_path / "000.npz")  # the advice, followed
    again = run("convert", src, "-o", tmp_path / "fixed", "--fixed", "img", "--progress", "none")
    assert again.exit_code == 0 and again.stderr == ""
    assert json.loads((tmp_path / "fixed" / INDEX_NAME).read_text())["fields"][0]["shape"] == [4, 4]


def test_when_the_first_sample_is_the_odd_one_the_writer_says_to_append_a_good_one_first(tmp_path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with npz2mmap.Writer(tmp_path / "w") as w:
            for k in range(20):
                w.append({"x": np.zeros((3, 2) if k == 0 else (2, 3))})
    assert [str(c.message) for c in caught] == [
        "field x is ragged only because 1 of 20 samples differs from shape (2, 3): the first, sample 0, has "
        "(3, 2); fixed=['x'] keeps the first sample's shape, and that sample is one that differs: append a "
        "sample of shape (2, 3) first, then write with fixed=['x']"
    ]


def test_a_writer_closed_by_hand_warns_at_the_callers_line(tmp_path) -> None:
    w = npz2mmap.Writer(tmp_path / "w")
    for k in range(20):
        w.append({"x": np.zeros((3, 2) if k == 5 else (2, 3))})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w.close()
    assert [(c.category, Path(c.filename).name) for c in caught] == [(RaggedFieldWarning, Path(__file__).name)]


@pytest.mark.parametrize("fixed", [False, True])
def test_the_reported_source_size_is_that_of_the_files_converted_after_a_bad_first_file(
    tmp_path, fixed
) -> None:
    """--fixed --skip-bad with a first file found bad only in the copy reported the size of that
    file alone (its shape held the others out until it was dropped), and a false Note."""
    import hostile

    src = tmp_path / "src"
    write_npz(src / "00.npz", x=np.zeros((1, 100), np.int64))
    hostile.corrupt_far_past_the_header(src / "00.npz", "x")
    good = [write_npz(src / f"0{k}.npz", x=np.zeros((100, 100), np.int64)) for k in range(1, 5)]
    options = {"fixed": ["x"]} if fixed else {}
    result = convert([src], tmp_path / "out", skip_bad=True, workers=1, **options)
    assert [path for path, _ in result.skipped] == [str(src / "00.npz")]
    assert result.sources_nbytes == sum(path.stat().st_size for path in good)
