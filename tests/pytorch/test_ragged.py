"""Ragged fields: lengths from the tables, padded collation, length-grouped batches."""

from __future__ import annotations

import inspect
import re
import textwrap
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_npz, write_samples
from torch.utils.data import DataLoader

import npz2mmap
from npz2mmap import LengthGroupedSampler, MmapDataset, MmapLoader, PaddedCollate, collate
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge

LENGTHS = [5, 1, 9, 3, 0, 7, 2, 8, 4, 6, 3, 5]


@pytest.fixture
def ragged(tmp_path):
    samples = [
        {
            "tokens": np.arange(n, dtype=np.int32) + 100 * i,
            "points": np.ones((n, 3), np.float32) * i,
            "label": np.int64(i),
        }
        for i, n in enumerate(LENGTHS)
    ]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    return tmp_path / "ds", samples


def test_lengths_come_from_the_tables_without_reading_sample_data(ragged, monkeypatch) -> None:
    dataset, _ = ragged
    ds = MmapDataset(dataset)

    def forbidden(*args, **kwargs):
        raise AssertionError("sample data was read")

    monkeypatch.setattr("npz2mmap.read.reader.DatasetReader.view", forbidden)
    monkeypatch.setattr("npz2mmap.read.reader.DatasetReader.gather", forbidden)
    assert ds.lengths("tokens").tolist() == LENGTHS
    assert ds.lengths("points").tolist() == LENGTHS  # (n, 3) points: the count, along the varying axis
    assert ds.shapes("points").tolist() == [[n, 3] for n in LENGTHS]  # every shape whole
    assert ds.shapes("label").shape == (12, 0)  # 0-d: no axes, so no length (it gave zeros to group by)
    with pytest.raises(ValueError, match=r"^field 'label' is 0-d: its samples have no length$"):
        ds.lengths("label")


def test_lengths_of_a_multi_part_dataset(ragged, tmp_path) -> None:
    dataset, _ = ragged
    for i in range(3):
        convert([tmp_path / "src"], tmp_path / "parts", part=(i, 3), workers=1)
    merge(sorted((tmp_path / "parts").iterdir()), tmp_path / "parts")
    assert MmapDataset(tmp_path / "parts").lengths("tokens").tolist() == LENGTHS


def test_padded_collate_pads_reports_lengths_and_masks(ragged) -> None:
    dataset, samples = ragged
    ds = MmapDataset(dataset)
    batch = PaddedCollate(pad_value=-1, mask=True)(ds.__getitems__([2, 1, 4]))
    assert batch["tokens"].tolist() == [
        [200, 201, 202, 203, 204, 205, 206, 207, 208],
        [100] + [-1] * 8,
        [-1] * 9,
    ]
    assert batch["tokens_lengths"].tolist() == [9, 1, 0]
    assert batch["tokens_mask"].sum(dim=1).tolist() == [9, 1, 0]
    assert batch["points"].shape == (3, 9, 3) and batch["points_lengths"].tolist() == [9, 1, 0]
    assert batch["points_shapes"].tolist() == [[9, 3], [1, 3], [0, 3]] and "tokens_shapes" not in batch
    assert batch["label"].tolist() == [2, 1, 4] and "label_lengths" not in batch
    per_item = PaddedCollate(ragged=["tokens", "points"])([ds[2], ds[1]])
    assert per_item["tokens"].shape == (2, 9) and per_item["tokens_lengths"].tolist() == [9, 1]
    assert "points_lengths" not in per_item and per_item["points_shapes"].tolist() == [[9, 3], [1, 3]]


def test_padded_lengths_measure_the_one_dimension_in_which_samples_differ(tmp_path) -> None:
    """A (2, n) field's lengths are its n, not its 2; one differing in two dimensions has shapes
    alone; samples from elsewhere say nothing, so a list of names counts every dimension as
    differing and a dict of shapes (as ds.features gives them) says which do."""
    samples = [{"audio": np.zeros((2, n), np.float32), "image": np.zeros((n, n + 1), np.uint8)} for n in (3, 1, 2)]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    ds = MmapDataset(tmp_path / "ds")
    assert ds.features["audio"].shape == (2, None) and ds.features["image"].shape == (None, None)
    for batch in (ds.__getitems__([0, 1, 2]), [ds[0], ds[1], ds[2]]):
        out = PaddedCollate()(batch)
        assert sorted(out) == ["audio", "audio_lengths", "audio_shapes", "image", "image_shapes"]
        assert out["audio_lengths"].tolist() == [3, 1, 2]
        assert out["image_shapes"].tolist() == [[3, 4], [1, 2], [2, 3]]
    plain = [{"audio": s["audio"]} for s in samples]
    assert sorted(PaddedCollate(ragged=["audio"])(plain)) == ["audio", "audio_shapes"]
    shaped = PaddedCollate(ragged={"audio": ds.features["audio"].shape})(plain)
    assert shaped["audio_lengths"].tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match=r"ragged\['audio'\] is \(2, 3\): give the field's shape in every"):
        PaddedCollate(ragged={"audio": (2, 3)})
    with pytest.raises(TypeError, match="ragged names fields by a list of str"):
        PaddedCollate(ragged="audio")
    with pytest.raises(TypeError, match=r"^ragged names fields by a list of str \(or a dict of their shapes\), not 5$"):
        PaddedCollate(ragged=5)  # it said 'int' object is not iterable
    with pytest.raises(TypeError, match=r"^ragged names fields by str, not \[3\]$"):
        PaddedCollate(ragged={3: (None,)})  # it failed at the first batch, adding an int and a str
    with pytest.raises(ValueError, match=r"^ragged names 'audio' twice; name each field once$"):
        PaddedCollate(ragged=["audio", "audio"])  # as fields= refuses it


@pytest.mark.parametrize("transform", [None, lambda sample: sample])
def test_padded_collate_output_depends_on_the_field_never_on_the_batch(ragged, transform) -> None:
    dataset, samples = ragged
    ds = MmapDataset(dataset, transform=transform)
    assert LENGTHS[0] == LENGTHS[11]
    batches = [ds.__getitems__(indices) for indices in ([0, 11], [2, 1])]  # equal lengths, then not
    for batch in batches:
        out = PaddedCollate(mask=True)(batch)
        assert sorted(out) == [
            "label",
            "points",
            "points_lengths",
            "points_mask",
            "points_shapes",
            "tokens",
            "tokens_lengths",
            "tokens_mask",
        ]
    same = PaddedCollate(mask=True)(batches[0])
    assert same["tokens_lengths"].tolist() == [5, 5] and same["tokens_mask"].all()
    assert same["tokens"].tolist() == [samples[0]["tokens"].tolist(), samples[11]["tokens"].tolist()]
    nested = PaddedCollate(nested=True)(batches[0])
    assert nested["tokens"].is_nested and nested["points"].is_nested


def test_padded_collate_single_field_batches_keep_the_field_name(ragged) -> None:
    dataset, _ = ragged
    for transform in (None, lambda sample: sample):
        ds = MmapDataset(dataset, fields="tokens", transform=transform)
        out = PaddedCollate()(ds.__getitems__([0, 11]))
        assert sorted(out) == ["tokens", "tokens_lengths"] and out["tokens_lengths"].tolist() == [5, 5]


def test_padded_collate_refuses_to_guess_for_unknown_samples(ragged) -> None:
    dataset, _ = ragged
    ds = MmapDataset(dataset, fields=["tokens", "label"])
    with pytest.raises(
        ValueError,
        match=r"field 'tokens' has shapes \(1,\) and \(9,\) in one batch; "
        r"pass PaddedCollate\(ragged=\['tokens', \.\.\.\]\)",
    ):
        PaddedCollate()([dict(ds[2]), dict(ds[1])])  # plain dicts, as from elsewhere
    # The dataset's own samples know which fields are ragged, whatever one batch holds.
    for pair in ([ds[2], ds[1]], [ds[1], ds[1]]):
        out = PaddedCollate()(pair)
        assert sorted(out) == ["label", "tokens", "tokens_lengths"]
        assert out["tokens_lengths"].tolist() == [len(sample["tokens"]) for sample in pair]


@pytest.mark.parametrize("fields", [None, "tokens"])
@pytest.mark.parametrize("collate_fn", [None, collate, PaddedCollate()], ids=["default", "collate", "padded"])
def test_tensors_option_batches_ragged_fields_as_without_it(ragged, fields, collate_fn) -> None:
    """tensors=True reads samples one by one; its batches must equal the gathered ones."""
    dataset, _ = ragged
    for plain, as_tensors in zip(
        DataLoader(MmapDataset(dataset, fields=fields), 4, collate_fn=collate_fn),
        DataLoader(MmapDataset(dataset, fields=fields, tensors=True), 4, collate_fn=collate_fn),
        strict=True,
    ):
        assert_same_batch(plain, as_tensors)


def assert_same_batch(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_batch(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_batch(x, y)
    else:
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:.*pin_memory.*")
def test_padded_batches_through_workers_and_pin_memory(ragged) -> None:
    dataset, _ = ragged
    loader = DataLoader(
        MmapDataset(dataset), batch_size=5, num_workers=2, collate_fn=PaddedCollate(), pin_memory=True
    )
    seen = {}
    for batch in loader:
        assert isinstance(batch["tokens"], torch.Tensor)
        for label, row, n in zip(
            batch["label"].tolist(), batch["tokens"], batch["tokens_lengths"].tolist(), strict=True
        ):
            seen[label] = row[:n].tolist()
    assert seen == {i: list(range(100 * i, 100 * i + n)) for i, n in enumerate(LENGTHS)}


def test_length_grouped_batches_cover_everything_and_keep_lengths_close(ragged) -> None:
    dataset, _ = ragged
    ds = MmapDataset(dataset)
    sampler = LengthGroupedSampler(ds.lengths("tokens"), batch_size=4, pool_batches=3, seed=2)
    first = list(sampler)
    assert len(sampler) == 3 and sorted(i for b in first for i in b) == list(range(12))
    for batch in first:  # one pool holds all 12 here: each batch is a run of the sorted lengths
        assert max(LENGTHS[i] for i in batch) - min(LENGTHS[i] for i in batch) <= 3
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert len(list(LengthGroupedSampler(ds.lengths("tokens"), batch_size=5, drop_last=True))) == 2
    loader = MmapLoader(ds, batch_size=4, batch_sampler=sampler, collate_fn=PaddedCollate())
    assert sorted(int(x) for b in loader for x in b["label"]) == list(range(12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(DataLoader(ds, batch_sampler=sampler, collate_fn=PaddedCollate()))) == 3


def test_inspect_shows_the_length_distribution_of_ragged_fields(ragged) -> None:
    import json

    from click.testing import CliRunner

    from npz2mmap.cli.commands import cli

    dataset, _ = ragged
    summary = json.loads(CliRunner().invoke(cli, ["inspect", str(dataset), "--json"]).output)
    tokens = next(f for f in summary["fields"] if f["name"] == "tokens")
    assert (tokens["lengths"]["min"], tokens["lengths"]["max"], tokens["lengths"]["p50"]) == (0, 9, 4.5)
    assert sum(tokens["lengths"]["histogram"]["counts"]) == 12
    text = CliRunner().invoke(cli, ["inspect", str(dataset)]).output
    figures = {key: tokens["lengths"][key] for key in ("p50", "p90", "p99")}
    # The text shows --json's percentiles (to two decimals), where it showed a median of 4.5 as 4.
    shown = ", ".join(f"{key} {value:g}" for key, value in figures.items())
    assert f"tokens lengths (first dimension): min 0, {shown}, max 9, mean 4.4" in text
    assert "p50 4.5," in text
    assert "label lengths" not in text


def test_inspect_stats_match_numpy_over_the_sources(ragged) -> None:
    import json

    from click.testing import CliRunner

    from npz2mmap.cli.commands import cli

    dataset, samples = ragged
    result = CliRunner().invoke(cli, ["inspect", str(dataset), "--stats", "--json"])
    stats = json.loads(result.output)["stats"]
    tokens = np.concatenate([s["tokens"] for s in samples]).astype(np.float64)
    assert stats["tokens"]["count"] == len(tokens)
    assert (stats["tokens"]["min"], stats["tokens"]["max"]) == (tokens.min(), tokens.max())
    assert stats["tokens"]["mean"] == pytest.approx(tokens.mean())
    assert stats["tokens"]["std"] == pytest.approx(tokens.std())
    assert stats["label"] == {
        "count": 12,
        "nan": 0,
        "inf": 0,
        "min": 0,
        "max": 11,
        "mean": 5.5,
        "std": pytest.approx(np.arange(12).std()),
    }
    text = CliRunner().invoke(cli, ["inspect", str(dataset), "--stats"]).output
    assert any(line.split() == ["label", "12", "0", "0", "0", "11", "5.5", "3.45205"] for line in text.splitlines()), (
        text
    )


def test_nested_collation_gives_one_jagged_tensor(ragged) -> None:
    dataset, samples = ragged
    ds = MmapDataset(dataset, fields=["tokens", "label"])
    batch = PaddedCollate(nested=True)(ds.__getitems__([2, 0, 1]))
    assert batch["tokens"].is_nested
    assert [t.tolist() for t in batch["tokens"].unbind()] == [
        samples[i]["tokens"].tolist() for i in (2, 0, 1)
    ]
    assert batch["label"].tolist() == [2, 0, 1]
    through_workers = DataLoader(ds, batch_size=6, num_workers=2, collate_fn=PaddedCollate(nested=True))
    assert sum(len(b["tokens"].unbind()) for b in through_workers) == 12


@pytest.mark.parametrize("lengths", [np.zeros(0, np.int64), np.zeros((0, 3), np.int64), np.zeros((0, 0))])
@pytest.mark.parametrize("drop_last", [False, True])
def test_length_grouped_sampler_over_no_samples_gives_no_batches(lengths, drop_last) -> None:
    sampler = LengthGroupedSampler(lengths, batch_size=4, drop_last=drop_last)
    assert len(sampler) == 0 and list(sampler) == []


def test_the_length_grouped_sampler_docstring_example_runs(ragged) -> None:
    """The example is taken from the docstring and run as it is written there."""
    dataset, samples = ragged
    doc = inspect.getdoc(LengthGroupedSampler)
    assert doc is not None and "::\n\n" in doc
    example = textwrap.dedent(doc.split("::\n\n", 1)[1])
    namespace = {"path": dataset}
    exec(example, namespace)
    for name in ("loader", "no_workers"):
        batches = list(namespace[name])
        labels = [int(label) for batch in batches for label in batch["label"]]
        assert sorted(labels) == list(range(len(LENGTHS))), name
        for batch in batches:
            for label, row, n in zip(batch["label"], batch["tokens"], batch["tokens_lengths"], strict=True):
                assert row[:n].tolist() == samples[int(label)]["tokens"].tolist()


def test_length_histogram_bins_are_whole_lengths_that_never_overlap() -> None:
    from npz2mmap.check.summary import length_distribution
    from npz2mmap.cli.render import _render_lengths

    stats = length_distribution(np.array([64, 100, 230, 231, 500, 2048], dtype=np.int64))
    assert sum(stats["histogram"]["counts"]) == 6 and stats["mean"] == 528.833
    labels = [line.split()[0] for line in _render_lengths("t", stats)[1:]]
    assert labels[0] == "64..262" and labels[-1] == "1,855..2,048"
    bounds = [[int(x.replace(",", "")) for x in label.split("..")] for label in labels]
    assert all(b[0] == a[-1] + 1 for a, b in zip(bounds, bounds[1:], strict=False))


def test_inspect_shows_the_lengths_of_the_axis_that_varies(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from npz2mmap.cli.commands import cli

    widths = [1, 3, 2, 3, 1]  # shapes (2, 1..3): axis 0 is always 2
    write_samples(tmp_path / "src", [{"x": np.zeros((2, w), np.float32)} for w in widths])
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    text = CliRunner().invoke(cli, ["inspect", str(tmp_path / "ds")]).output
    mean = np.mean(widths)
    assert (
        f"x lengths (axis 1, the first that varies): min 1, p50 2, p90 3, p99 3, max 3, mean {mean:.1f}"
        in text
    )
    summary = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "ds"), "--json"]).output)
    lengths = summary["fields"][0]["lengths"]
    assert (lengths["axis"], lengths["min"], lengths["max"]) == (1, 1, 3)
    assert summary["fields"][0]["shape"] == [2, None] and summary["version"] == 3
    assert "x      ragged  float32  (2, 1..3)" in text
    assert lengths["histogram"]["counts"] == [np.count_nonzero(np.array(widths) == w) for w in (1, 2, 3)]
    assert MmapDataset(tmp_path / "ds").shapes("x").tolist() == [[2, w] for w in widths]  # unchanged
    assert MmapDataset(tmp_path / "ds").lengths("x").tolist() == widths  # the axis that varies


def test_lengths_of_a_field_varying_in_several_axes_say_to_take_its_shapes(tmp_path) -> None:
    """Boxes (k, 4) give k; an image (h, w) varying in both has no one length."""
    for i, (k, h, w) in enumerate([(1, 2, 3), (3, 2, 5), (2, 4, 3)]):
        write_npz(tmp_path / "src" / f"{i}.npz", boxes=np.zeros((k, 4)), image=np.zeros((h, w)))
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    ds = MmapDataset(tmp_path / "ds")
    assert ds.lengths("boxes").tolist() == [1, 3, 2] and ds.lengths("boxes").dtype == np.int64
    with pytest.raises(ValueError) as refused:
        ds.lengths("image")
    assert str(refused.value) == (
        "field 'image' differs between samples in dimensions 0, 1, so no one length describes a sample: "
        "ds.shapes('image') gives each sample's shape"
    )
    assert ds.shapes("image").tolist() == [[2, 3], [2, 5], [4, 3]]


def test_a_version_2_dataset_pads_and_describes_its_fields_as_version_3_records_them(tmp_path) -> None:
    """Version 2 records no ragged shape: it is derived from the shapes table, once, and reads the same."""
    import shutil

    from conftest import GOLDEN_DIR

    for version in ("v2", "v3"):
        shutil.copytree(GOLDEN_DIR / version, tmp_path / version)
    v2, v3 = MmapDataset(tmp_path / "v2"), MmapDataset(tmp_path / "v3")
    assert v2.features == v3.features and v3.features["points"].shape == (None, 2)
    assert v2.lengths("points").tolist() == v3.lengths("points").tolist() == [0, 1, 2]
    batches = [PaddedCollate(mask=True)(ds.__getitems__([2, 0, 1])) for ds in (v2, v3)]
    assert list(batches[0]) == list(batches[1]) == [
        "image", "label", "points", "points_lengths", "points_shapes", "points_mask"
    ]
    for key in batches[0]:
        assert batches[0][key].tolist() == batches[1][key].tolist(), key
    merged = merge([tmp_path / "v2", tmp_path / "v3"], tmp_path / "both", copy=True).out_dir
    assert MmapDataset(merged).features["points"].shape == (None, 2)
    assert MmapDataset([tmp_path / "v2", tmp_path / "v3"]).lengths("points").tolist() == [0, 1, 2] * 2


def transposed(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "points": sample["points"].T}


def areas(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "points": sample["points"].sum(axis=1)}


def test_a_transform_that_moves_the_varying_dimension_is_refused_until_its_shape_is_given(ragged) -> None:
    """points are (k, 3): a transform giving (3, k) made points_lengths 3 for every sample, the
    recorded shape's dimension 0, where the samples differ in dimension 1."""
    dataset, samples = ragged
    indices = [2, 1, 4]
    ds = MmapDataset(dataset, transform=transposed)
    for batch in (ds.__getitems__(indices), [ds[i] for i in indices]):
        with pytest.raises(ValueError, match=re.escape(
            "field 'points' has a sample of shape (3, 9), not of the shape (None, 3) its samples are said "
            "to have (None where they differ; a transform changed them?): pass "
            "PaddedCollate(ragged={'points': ...}) with the shape they have"
        )):
            PaddedCollate()(batch)
        out = PaddedCollate(ragged={"points": (3, None)})(batch)
        assert out["points_lengths"].tolist() == [len(samples[i]["points"]) for i in indices]
        assert out["points_shapes"].tolist() == [[3, len(samples[i]["points"])] for i in indices]
    loader = DataLoader(ds, batch_size=3, collate_fn=PaddedCollate(ragged={"points": (3, None)}))
    assert next(iter(loader))["points_lengths"].tolist() == [len(samples[i]["points"]) for i in range(3)]
    fewer = MmapDataset(dataset, transform=areas)  # another ndim: its own dimensions, which differ
    out = PaddedCollate()(fewer.__getitems__(indices))
    assert out["points_lengths"].tolist() == [len(samples[i]["points"]) for i in indices]
    assert "points_shapes" not in out


def write_field(path: Any, arrays: list[np.ndarray], name: str = "seg") -> MmapDataset:
    with npz2mmap.Writer(path) as writer:
        for array in arrays:
            writer.append({name: array})
    return MmapDataset(path)


def test_samples_of_datasets_that_hold_a_field_differently_are_refused_until_its_shape_is_given(tmp_path) -> None:
    """A ConcatDataset of a dataset of (2, n) and one of (m, 5): the last sample's dataset decided
    which dimension seg_lengths measured, so [a, b] and [b, a] gave lengths of other dimensions."""
    a = write_field(tmp_path / "a", [np.zeros((2, n), np.int16) for n in (1, 3)])
    b = write_field(tmp_path / "b", [np.zeros((m, 5), np.int16) for m in (4, 1)])
    fixed = write_field(tmp_path / "f", [np.zeros((3, 5), np.int16)] * 2)
    for other, held in ((b, "ragged, (None, 5)"), (fixed, "fixed")):
        both = torch.utils.data.ConcatDataset([a, other])
        for order in ([0, 2], [2, 0]):
            first, second = ("ragged, (2, None)", held) if order[0] == 0 else (held, "ragged, (2, None)")
            with pytest.raises(ValueError, match=re.escape(
                f"field 'seg': the samples of one batch come from datasets that hold it differently ({first} "
                f"and {second}; a ConcatDataset?), so no one set of keys follows from them: pass "
                "PaddedCollate(ragged={'seg': ...}) with the shape of all its samples, None where they differ"
            )):
                PaddedCollate()([both[i] for i in order])
            out = PaddedCollate(ragged={"seg": (None, None)})([both[i] for i in order])
            assert sorted(out) == ["seg", "seg_shapes"]
            assert out["seg_shapes"].tolist() == [list(both[i]["seg"].shape) for i in order]


def test_a_declared_shape_the_samples_do_not_have_is_refused(tmp_path) -> None:
    samples = [{"boxes": np.zeros((4, k), np.float32)} for k in (2, 3)]
    for declared in ((None, 4), (None,), (4, None, None)):
        with pytest.raises(ValueError, match=re.escape(
            f"field 'boxes' has a sample of shape (4, 2), not of the shape {declared} its samples are said"
        )):
            PaddedCollate(ragged={"boxes": declared})(samples)
    assert PaddedCollate(ragged={"boxes": (4, None)})(samples)["boxes_lengths"].tolist() == [2, 3]


def test_a_single_ragged_field_taken_one_by_one_pads_as_its_batch(tmp_path) -> None:
    """ds[i] of fields="tokens" was a bare array that said nothing: [ds[i]] padded it as 'data', or
    stacked it without lengths when the batch's samples shared a shape."""
    ds = write_field(tmp_path / "t", [np.arange(n, dtype=np.int32) for n in (1, 3, 2, 2)], "tokens")
    ds = MmapDataset(tmp_path / "t", fields="tokens")
    for indices in ([0, 1], [2, 3]):
        batch, one_by_one = PaddedCollate()(ds.__getitems__(indices)), PaddedCollate()([ds[i] for i in indices])
        assert list(batch) == list(one_by_one) == ["tokens", "tokens_lengths"]
        assert all(batch[k].tolist() == one_by_one[k].tolist() for k in batch)
        subset = torch.utils.data.Subset(ds, indices)
        listed = next(iter(DataLoader(subset, batch_size=2)))
        assert [t.tolist() for t in listed] == [ds[i].tolist() for i in indices]


def test_a_transform_that_drops_a_dimension_pads_its_samples_as_they_are(ragged) -> None:
    """(k, 3) points summed to (k,): its own one dimension, where it raised numpy's IndexError."""
    dataset, samples = ragged
    out = PaddedCollate()(MmapDataset(dataset, transform=areas).__getitems__([2, 1]))
    sums = [samples[i]["points"].sum(axis=1) for i in (2, 1)]
    assert out["points"].tolist() == [np.pad(s, (0, 9 - len(s))).tolist() for s in sums]
    assert out["points_lengths"].tolist() == [9, 1] and "points_shapes" not in out


def test_a_nested_batch_of_datasets_that_hold_a_field_differently_needs_no_shape(tmp_path) -> None:
    """A nested batch adds no key, so samples of a field one dataset holds fixed and another ragged
    make one nested tensor, as that field's samples are."""
    a = write_field(tmp_path / "a", [np.full((n, 5), n, np.int16) for n in (1, 2)])
    fixed = write_field(tmp_path / "f", [np.full((3, 5), 3, np.int16)] * 2)
    both = torch.utils.data.ConcatDataset([a, fixed])
    out = PaddedCollate(nested=True)([both[i] for i in (0, 2, 1)])
    assert [t.tolist() for t in out["seg"].unbind()] == [both[i]["seg"].tolist() for i in (0, 2, 1)]
    named = PaddedCollate(ragged={"seg": None})([both[i] for i in (0, 2)])  # as a list of names
    assert sorted(named) == ["seg", "seg_shapes"] and named["seg_shapes"].tolist() == [[1, 5], [3, 5]]


@pytest.fixture
def mixed(tmp_path) -> MmapDataset:
    rng = np.random.default_rng(0)
    with npz2mmap.Writer(tmp_path / "mixed") as writer:
        for k, n in [(2, 5), (3, 7), (1, 4), (3, 7), (2, 7)]:
            writer.append({
                "boxes": rng.standard_normal((k, 4)).astype(np.float32),
                "audio": rng.standard_normal((2, n)),
                "tokens": np.arange(n, dtype=np.int32),
            })
    return MmapDataset(tmp_path / "mixed")


def padded_paths(ds: MmapDataset, pad: PaddedCollate, indices: list[int]) -> dict[str, Any]:
    """The same batch through every path a user takes to PaddedCollate, each giving keys or an error."""
    def attempt(make: Callable[[], Any]) -> Any:
        try:
            return {key: value.tolist() for key, value in make().items()}
        except (ValueError, npz2mmap.errors.WorkerError) as error:
            cause = error.__cause__ if isinstance(error, npz2mmap.errors.WorkerError) else error
            return str(cause)

    def loader(workers: int) -> Any:
        with MmapLoader(ds, len(indices), collate_fn=pad, num_workers=workers, sampler=indices) as it:
            return next(iter(it))

    return {
        "gathered": attempt(lambda: pad(ds.__getitems__(indices))),
        "listed": attempt(lambda: pad(list(ds.__getitems__(indices)))),
        "one by one": attempt(lambda: pad([ds[i] for i in indices])),
        "DataLoader": attempt(lambda: next(iter(DataLoader(ds, batch_size=len(indices), sampler=indices, collate_fn=pad)))),
        "MmapLoader": attempt(lambda: loader(0)),
        "MmapLoader workers": attempt(lambda: loader(1)),
    }


@pytest.mark.parametrize("declared", [{"boxes": (4, None)}, {"audio": (None, None)}, {"audio": (2, None)}])
def test_a_declared_shape_is_taken_and_checked_on_every_path(mixed, declared) -> None:
    """A shape given in ragged= was ignored for the dataset's own batches: boxes (4, None) gave
    boxes_lengths along dimension 0 there, and audio (None, None) kept audio_lengths, where the
    other paths refused or dropped them."""
    results = padded_paths(mixed, PaddedCollate(ragged=declared), [0, 1, 2])
    assert all(result == results["gathered"] for result in results.values()), results
    if declared == {"boxes": (4, None)}:
        assert results["gathered"].startswith("field 'boxes' has a sample of shape (2, 4), not of the shape")
    elif declared == {"audio": (None, None)}:
        assert "audio_lengths" not in results["gathered"] and "audio_shapes" in results["gathered"]
    else:
        assert results["gathered"]["audio_lengths"] == [5, 7, 4]


def test_a_field_named_without_a_shape_differs_in_every_dimension_on_every_path(mixed) -> None:
    """ragged=["audio"] gave audio_lengths on the dataset's own batches, from the shape the dataset
    records, and none on dicts built elsewhere: one collate, two sets of keys."""
    pad = PaddedCollate(ragged=["audio", "boxes", "tokens"])
    results = padded_paths(mixed, pad, [0, 1, 2])
    results["dicts"] = {k: v.tolist() for k, v in pad([dict(mixed[i]) for i in (0, 1, 2)]).items()}
    assert all(result == results["gathered"] for result in results.values()), results
    assert sorted(results["gathered"]) == [
        "audio", "audio_shapes", "boxes", "boxes_shapes", "tokens", "tokens_lengths"
    ]
    assert results["gathered"]["audio_shapes"] == [[2, 5], [2, 7], [2, 4]]


def test_samples_listed_and_edited_keep_their_fields_raggedness(mixed) -> None:
    """After samples = list(batch), a ragged value replaced by a plain array made the field fixed:
    tokens_lengths went missing from a batch whose samples share a length."""
    def edited(batch: Any) -> Any:
        samples = list(batch)
        for sample in samples:
            sample["tokens"] = np.array(sample["tokens"]) % 5
        return PaddedCollate()(samples)

    for collate_fn in (torch.utils.data.default_collate, collate):  # torch's stacked them into one tensor
        samples = list(mixed.__getitems__([1, 3, 4]))
        for sample in samples:
            sample["tokens"] = np.zeros(3, np.int32)
        listed = collate_fn(samples)["tokens"]
        assert isinstance(listed, list) and [t.tolist() for t in listed] == [[0, 0, 0]] * 3
    out = edited(mixed.__getitems__([1, 3, 4]))
    assert sorted(out) == ["audio", "audio_lengths", "audio_shapes", "boxes", "boxes_lengths", "boxes_shapes",
                           "tokens", "tokens_lengths"]
    assert out["tokens_lengths"].tolist() == [7, 7, 7]
    single = MmapDataset(mixed.path, fields="tokens")
    assert sorted(PaddedCollate()(list(single.__getitems__([1, 3, 4])))) == ["tokens", "tokens_lengths"]
    with pytest.raises(ValueError, match=re.escape(
        "bare samples, of no field (key 'data'), have shapes (5,) and (7,) in one batch; "
        "pass PaddedCollate(ragged=['data', ...]) to pad it"
    )):
        PaddedCollate()([np.arange(5), np.arange(7)])


def test_a_declared_shape_may_hold_numpy_integers(mixed) -> None:
    """A shape built from ds.shapes() holds numpy integers: it was refused as no shape at all."""
    width = mixed.shapes("boxes")[0, 1]
    out = PaddedCollate(ragged={"boxes": (None, width)})(list(mixed.__getitems__([0, 1])))
    assert out["boxes_lengths"].tolist() == [2, 3]


def test_opening_a_version_2_dataset_reads_no_table(tmp_path, monkeypatch) -> None:
    """A version 2 dataset's (k, 2) field had its whole shapes table read (and checked) by
    MmapDataset() itself: opening cost grew with the samples, and a damaged table stopped it."""
    import shutil

    from conftest import GOLDEN_DIR

    import npz2mmap.read.reader

    shutil.copytree(GOLDEN_DIR / "v2", tmp_path / "v2")

    def no_table(*args: Any) -> None:
        raise AssertionError("a table was read on opening")

    with monkeypatch.context() as patched:
        patched.setattr(npz2mmap.read.reader.DatasetReader, "shapes", no_table)
        ds = MmapDataset(tmp_path / "v2")
    assert ds.ragged_fields == {"points": (None, 2)}  # derived on first use, from the table
    assert PaddedCollate()(ds.__getitems__([1, 2]))["points_lengths"].tolist() == [1, 2]


@pytest.mark.parametrize(
    "transform", [None, lambda a: a, lambda a: np.stack([a, a])], ids=["none", "identity", "new array"]
)
def test_a_single_fixed_fields_listed_samples_keep_its_name(mixed, transform) -> None:
    """list(batch) of a single fixed field was padded under the key 'data', its batch under its
    name; with a transform, a bare array the transform gave too."""
    with npz2mmap.Writer(mixed.path + "-x") as writer:
        for i in range(4):
            writer.append({"x": np.full(3, i, np.float32), "s": np.array(f"s{i}")})
    for field in ("x", "s"):  # s: a dtype torch lacks
        ds = MmapDataset(mixed.path + "-x", fields=field, transform=transform)
        batch = ds.__getitems__([0, 1, 2])
        assert list(PaddedCollate()(batch)) == list(PaddedCollate()(list(batch))) == [field]
        expected = [np.asarray(ds[i]).tolist() for i in range(3)]
        assert np.asarray(PaddedCollate()(list(batch))[field]).tolist() == expected
    listed = list(MmapDataset(mixed.path + "-x", fields="x").__getitems__([0, 1]))
    assert torch.utils.data.default_collate(listed).tolist() == [[0.0] * 3, [1.0] * 3]


def test_inspect_shows_a_ragged_field_of_no_samples_by_its_recorded_shape(tmp_path) -> None:
    """A --rows file of zero rows: the field's 1-d samples showed as the shape ()."""
    from click.testing import CliRunner

    from npz2mmap.cli.commands import cli

    np.savez(tmp_path / "a.npz", a=np.zeros((0, 7), np.float32))
    convert([tmp_path / "a.npz"], tmp_path / "ds", rows=True, workers=1)
    text = CliRunner().invoke(cli, ["inspect", str(tmp_path / "ds")]).output
    assert "a      ragged  float32  (*,)" in text, text
