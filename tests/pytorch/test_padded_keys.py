"""PaddedCollate's generated keys (``name_lengths``, ``name_shapes``, ``name_mask``) never silently
replace a field.

The oracle is plain numpy over the arrays the test wrote: the expected keys
are built here from the field names, the expected values from the sources.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import npz2mmap
from npz2mmap import MmapDataset, MmapLoader, PaddedCollate
from npz2mmap.errors import WorkerError

NUM_SAMPLES = 4
BATCH = [0, 1, 2, 3]
COLLISION = re.compile(
    r"PaddedCollate: key '(?P<key>[^']+)' would hold both (?P<first>.+) and (?P<second>.+); "
    r"select the fields to keep with MmapDataset\(path, fields=\[\.\.\.\]\) or rename one of them"
)


# A field's kind: fixed (False), ragged of 1-d samples (True), or ragged of (k, 2) samples (POINTS).
POINTS = 2


def source_array(name: str, ragged: bool | int, i: int) -> np.ndarray:
    """Sample ``i`` of a field: ragged float32 of length 1..3 (POINTS: (1..3, 2)), or a fixed uint8
    (3,) of 7s plus i."""
    if ragged:
        seq = np.arange(i % 3 + 1, dtype=np.float32) + 10 * i + len(name)
        return np.stack([seq, -seq], axis=1) if ragged == POINTS else seq
    return np.full(3, 7 + i, dtype=np.uint8)


def write_dataset(path: Path, fields: dict[str, bool | int]) -> dict[str, list[np.ndarray]]:
    """A dataset of ``fields`` (name -> ragged?); returns every field's source arrays."""
    sources = {name: [source_array(name, ragged, i) for i in range(NUM_SAMPLES)] for name, ragged in fields.items()}
    with npz2mmap.Writer(path) as writer:
        for i in range(NUM_SAMPLES):
            writer.append({name: arrays[i] for name, arrays in sources.items()})
    return sources


def expected_keys(fields: dict[str, bool | int], mask: bool, nested: bool, named: bool = False) -> list[str]:
    """Every key a padded batch makes, in field order, duplicates kept (built here, not by npz2mmap).

    ``named``: the collate was given the ragged fields' names only, so each counts as differing in
    every dimension (no lengths for (k, 2) samples)."""
    keys = []
    for name, ragged in fields.items():
        keys.append(name)
        if ragged and not nested:
            if not (named and ragged == POINTS):  # else both kinds differ in their first dimension only
                keys.append(name + "_lengths")
            if ragged == POINTS:
                keys.append(name + "_shapes")
            if mask:
                keys.append(name + "_mask")
    return keys


def check_batch(
    batch: dict[str, Any],
    sources: dict[str, list[np.ndarray]],
    fields: dict[str, bool | int],
    mask: bool,
    nested: bool,
    named: bool = False,
) -> None:
    """The batch holds exactly the expected keys, each value made from its own source by numpy."""
    assert sorted(batch) == sorted(expected_keys(fields, mask, nested, named))
    for name, ragged in fields.items():
        arrays = [sources[name][i] for i in BATCH]
        if not ragged:
            np.testing.assert_array_equal(batch[name].numpy(), np.stack(arrays))
            assert batch[name].dtype == torch.uint8
            continue
        if nested:
            for got, want in zip(batch[name].unbind(), arrays, strict=True):
                np.testing.assert_array_equal(got.numpy(), want)
            continue
        lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
        width = int(lengths.max())
        padded = np.zeros((len(arrays), width, *arrays[0].shape[1:]), dtype=np.float32)
        for row, array in zip(padded, arrays, strict=True):
            row[: len(array)] = array
        np.testing.assert_array_equal(batch[name].numpy(), padded)
        if not (named and ragged == POINTS):
            assert batch[name + "_lengths"].dtype == torch.int64
            np.testing.assert_array_equal(batch[name + "_lengths"].numpy(), lengths)
        if ragged == POINTS:
            assert batch[name + "_shapes"].dtype == torch.int64
            np.testing.assert_array_equal(batch[name + "_shapes"].numpy(), [a.shape for a in arrays])
        if mask:
            assert batch[name + "_mask"].dtype == torch.bool
            inside = np.arange(width) < lengths[:, None]
            want = inside[:, :, None].repeat(2, axis=2) if ragged == POINTS else inside
            np.testing.assert_array_equal(batch[name + "_mask"].numpy(), want)


def check_refusal(message: str, fields: dict[str, bool | int], mask: bool, nested: bool, named: bool) -> None:
    """The one-line error names a key made twice and both things that would have it."""
    counts = Counter(expected_keys(fields, mask, nested, named))
    found = COLLISION.fullmatch(message)
    assert found is not None, message
    assert counts[found["key"]] > 1
    for what in (found["first"], found["second"]):
        assert re.fullmatch(r"field '[^']+'|the (lengths|shapes|mask) of ragged field '[^']+'", what), what
    assert found["first"] != found["second"]


def last_line(error: BaseException) -> str:
    """The error's own line: DataLoader workers put their traceback before it."""
    lines = str(error).strip().splitlines()
    return lines[-1].removeprefix("ValueError: ")


# Each path makes one padded batch of all samples, as the user would.
def collate_gathered(ds: MmapDataset, pad: Callable[[], PaddedCollate]) -> Any:
    return pad()(ds.__getitems__(BATCH))


def collate_samples(ds: MmapDataset, pad: Callable[[], PaddedCollate]) -> Any:
    return pad()([ds[i] for i in BATCH])


def data_loader(workers: int) -> Callable[[MmapDataset, Callable[[], PaddedCollate]], Any]:
    def run(ds: MmapDataset, pad: Callable[[], PaddedCollate]) -> Any:
        return next(iter(DataLoader(ds, batch_size=len(BATCH), num_workers=workers, collate_fn=pad())))

    return run


def mmap_loader(workers: int, prefetch: int = 2) -> Callable[[MmapDataset, Callable[[], PaddedCollate]], Any]:
    def run(ds: MmapDataset, pad: Callable[[], PaddedCollate]) -> Any:
        with MmapLoader(
            ds, len(BATCH), collate_fn=pad(), num_workers=workers, prefetch=prefetch, multiprocessing_context="fork" if workers else None
        ) as loader:
            return {key: value.clone() for key, value in next(iter(loader)).items()}

    return run


IN_PROCESS = {
    "PaddedCollate(ds.__getitems__)": collate_gathered,
    "PaddedCollate(ragged=)([ds[i]])": collate_samples,
    "DataLoader": data_loader(0),
    "MmapLoader(prefetch=0)": mmap_loader(0, prefetch=0),
    "MmapLoader(thread)": mmap_loader(0),
}
IN_WORKERS = {
    "DataLoader(num_workers=1)": data_loader(1),
    "MmapLoader(num_workers=1)": mmap_loader(1),
    "MmapLoader(num_workers=2)": mmap_loader(2),
}

@st.composite
def field_sets(draw: st.DrawFn) -> dict[str, bool | int]:
    """1..4 fields (name -> kind), each name a base or an earlier name plus a suffix, so collisions abound."""
    names = [draw(st.sampled_from(["x", "pts"]))]
    suffixes = ["_lengths", "_shapes", "_mask"]
    for _ in range(draw(st.integers(0, 3))):
        parent = draw(st.sampled_from(names))
        names.append(draw(st.sampled_from([parent + suffix for suffix in suffixes] + ["pts", "x"])))
    kinds = st.sampled_from([False, True, POINTS])
    return {name: draw(kinds) for name in sorted(set(names))}  # a dataset's fields are sorted


FIELDS = field_sets()
TOLD = st.sampled_from(["shapes", "names", "nothing"])


def check_path(
    path: Callable[[MmapDataset, Callable[[], PaddedCollate]], Any],
    tmp_path: Path,
    fields: dict[str, bool | int],
    mask: bool,
    nested: bool,
    told: str,
) -> None:
    """Either the batch is exactly right, or the documented error is raised: nothing in between.

    ``told``: what the collate is told of the ragged fields: their shapes (as ``ds.features`` gives
    them), their names only, or nothing (the dataset's samples say it)."""
    if mask and nested:  # a mask of nothing padded
        with pytest.raises(ValueError, match="mask=True is an option of padding, and nested=True pads no"):
            PaddedCollate(mask=mask, nested=nested)
        return
    root = Path(tmp_path) / f"d{len(list(tmp_path.iterdir()))}.mmap"
    sources = write_dataset(root, fields)
    ds = MmapDataset(root)
    shapes = {name: (None, 2) if kind == POINTS else (None,) for name, kind in fields.items() if kind}
    ragged = {"shapes": shapes, "names": list(shapes), "nothing": None}[told]
    named = told == "names"

    def pad() -> PaddedCollate:
        return PaddedCollate(mask=mask, nested=nested, ragged=ragged)

    keys = expected_keys(fields, mask, nested, named)
    collides = len(set(keys)) < len(keys)
    try:
        batch = path(ds, pad)
    except ValueError as error:
        assert collides, error
        check_refusal(last_line(error), fields, mask, nested, named)
        return
    assert not collides, sorted(batch)
    check_batch(batch, sources, fields, mask, nested, named)


@pytest.mark.parametrize("path", IN_PROCESS.values(), ids=IN_PROCESS.keys())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=FIELDS, mask=st.booleans(), nested=st.booleans(), told=TOLD)
def test_a_padded_batch_has_each_key_once_or_is_refused(path, tmp_path, fields, mask, nested, told) -> None:
    check_path(path, tmp_path, fields, mask, nested, told)


@pytest.mark.parametrize("path", IN_WORKERS.values(), ids=IN_WORKERS.keys())
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=FIELDS, mask=st.booleans(), nested=st.booleans(), told=TOLD)
def test_a_padded_batch_from_workers_has_each_key_once_or_is_refused(path, tmp_path, fields, mask, nested, told) -> None:
    check_path(path, tmp_path, fields, mask, nested, told)


POINTS_MASK = (
    "PaddedCollate: key 'points_mask' would hold both the mask of ragged field 'points' and field "
    "'points_mask'; select the fields to keep with MmapDataset(path, fields=[...]) or rename one of them"
)


@pytest.mark.parametrize("path", {**IN_PROCESS, **IN_WORKERS}.values(), ids={**IN_PROCESS, **IN_WORKERS}.keys())
def test_a_stored_field_named_like_the_mask_is_refused_on_every_path(tmp_path, path) -> None:
    fields = {"points": True, "points_mask": False}
    write_dataset(tmp_path / "d.mmap", fields)
    ds = MmapDataset(tmp_path / "d.mmap")
    with pytest.raises(ValueError) as caught:
        path(ds, lambda: PaddedCollate(mask=True, ragged=["points"]))
    assert last_line(caught.value) == POINTS_MASK


def test_without_a_mask_the_same_fields_pad_with_the_stored_field_kept(tmp_path) -> None:
    fields = {"points": True, "points_mask": False}
    sources = write_dataset(tmp_path / "d.mmap", fields)
    batch = PaddedCollate()(MmapDataset(tmp_path / "d.mmap").__getitems__(BATCH))
    check_batch(batch, sources, fields, mask=False, nested=False)


def test_a_stored_field_named_like_the_lengths_is_refused_from_the_dataset_alone(tmp_path) -> None:
    write_dataset(tmp_path / "d.mmap", {"points": True, "points_lengths": False})
    ds = MmapDataset(tmp_path / "d.mmap")
    with pytest.raises(ValueError, match=r"^PaddedCollate: key 'points_lengths' would hold both the lengths "):
        PaddedCollate()(ds.__getitems__(BATCH))
    with pytest.raises(ValueError, match=r"^PaddedCollate: key 'points_lengths' would hold both the lengths "):
        MmapLoader(ds, 2, collate_fn=PaddedCollate())  # refused before any batch: the fields are known


def test_ragged_names_that_collide_are_refused_at_construction() -> None:
    with pytest.raises(ValueError) as caught:
        PaddedCollate(mask=True, ragged=["x", "x_mask"])
    assert str(caught.value) == (
        "PaddedCollate: key 'x_mask' would hold both the mask of ragged field 'x' and field 'x_mask'; "
        "select the fields to keep with MmapDataset(path, fields=[...]) or rename one of them"
    )
    PaddedCollate(ragged=["x", "x_mask"])  # without a mask, x_mask is no generated key
    PaddedCollate(nested=True, ragged=["x", "x_lengths"])  # nested batches add no keys


@pytest.mark.parametrize(
    ("options", "given"), [({"mask": True}, "mask=True"), ({"pad_value": -1}, "pad_value=-1")]
)
def test_a_padding_option_with_nested_is_refused_at_construction(options, given) -> None:
    """nested=True pads nothing: mask=True gave no mask (a KeyError far away), pad_value was unused."""
    with pytest.raises(ValueError) as caught:
        PaddedCollate(nested=True, **options)
    assert str(caught.value) == (
        f"PaddedCollate: {given} is an option of padding, and nested=True pads no field (a nested "
        "tensor holds each sample's own shape): give one or the other"
    )
    PaddedCollate(nested=True, pad_value=0.0)  # the default, said again


def test_a_ragged_field_named_like_another_ones_lengths_is_refused(tmp_path) -> None:
    write_dataset(tmp_path / "d.mmap", {"x": True, "x_lengths": True})
    ds = MmapDataset(tmp_path / "d.mmap")
    with pytest.raises(ValueError, match=r"key 'x_lengths' would hold both the lengths of ragged field 'x' and"):
        PaddedCollate()(ds.__getitems__(BATCH))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_padded_collate_changed_after_the_loader_was_made_is_checked_at_the_first_batch(
    tmp_path, workers
) -> None:
    write_dataset(tmp_path / "d.mmap", {"points": True, "points_mask": False})
    pad = PaddedCollate()
    with MmapLoader(MmapDataset(tmp_path / "d.mmap"), 4, collate_fn=pad, num_workers=workers) as loader:
        pad.mask = True
        with pytest.raises(ValueError) as caught:
            next(iter(loader))
    assert str(caught.value) == POINTS_MASK


def add_a_mask_field(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**sample, "points_mask": np.zeros(3, dtype=np.uint8)}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_key_a_transform_adds_is_checked_at_the_first_batch(tmp_path, workers) -> None:
    write_dataset(tmp_path / "d.mmap", {"points": True})
    ds = MmapDataset(tmp_path / "d.mmap", transform=add_a_mask_field)
    loader = MmapLoader(ds, 4, collate_fn=PaddedCollate(mask=True), num_workers=workers, prefetch=0)
    with loader, pytest.raises((ValueError, WorkerError)) as caught:
        next(iter(loader))
    error = caught.value.__cause__ if workers else caught.value
    assert type(error) is ValueError and str(error) == POINTS_MASK
    with pytest.raises(ValueError) as caught:
        next(iter(DataLoader(ds, batch_size=4, collate_fn=PaddedCollate(mask=True))))
    assert str(caught.value) == POINTS_MASK


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("wrap", ["ConcatDataset", "Subset"])
def test_samples_taken_one_by_one_collate_as_a_batch_of_the_dataset(tmp_path, wrap, num_workers) -> None:
    # Lengths 1, 1, 2, 3: the first batch of two shares a shape, the second does not.
    sources = {"seq": [np.arange(n, dtype=np.float32) for n in (1, 1, 2, 3)], "lab": list(np.arange(4))}
    with npz2mmap.Writer(tmp_path / "ds") as writer:
        for i in range(NUM_SAMPLES):
            writer.append({name: arrays[i] for name, arrays in sources.items()})
    ds = MmapDataset(tmp_path / "ds")
    wrapped = torch.utils.data.ConcatDataset([ds]) if wrap == "ConcatDataset" else torch.utils.data.Subset(ds, BATCH)
    padded = list(DataLoader(wrapped, batch_size=2, collate_fn=PaddedCollate(), num_workers=num_workers))
    listed = list(DataLoader(wrapped, batch_size=2, num_workers=num_workers))
    ours = list(DataLoader(wrapped, batch_size=2, collate_fn=npz2mmap.collate, num_workers=num_workers))
    for d, o in zip(listed, ours, strict=True):
        assert type(d) is dict and type(o) is dict and list(o) == ["lab", "seq"]
        assert [t.tolist() for t in o["seq"]] == [t.tolist() for t in d["seq"]]
        assert o["lab"].tolist() == d["lab"].tolist()
    for k, (p, d) in enumerate(zip(padded, listed, strict=True)):
        rows = sources["seq"][2 * k : 2 * k + 2]
        width = max(len(r) for r in rows)
        assert list(p) == ["lab", "seq", "seq_lengths"]
        assert p["seq"].tolist() == [np.pad(r, (0, width - len(r))).tolist() for r in rows]
        assert p["seq_lengths"].tolist() == [len(r) for r in rows]
        assert isinstance(d["seq"], list) and [t.tolist() for t in d["seq"]] == [r.tolist() for r in rows]
        assert d["lab"].tolist() == [2 * k, 2 * k + 1]


def test_a_transforms_own_mapping_type_is_given_back_by_ds_i(tmp_path) -> None:
    class Sample(dict):  # a user's mapping, with its own behaviour
        def total(self) -> float:
            return float(sum(v.sum() for v in self.values()))

    with npz2mmap.Writer(tmp_path / "ds") as writer:
        writer.append({"x": np.arange(3)})
    ds = MmapDataset(tmp_path / "ds", transform=Sample)
    assert type(ds[0]) is Sample and ds[0].total() == 3.0
    assert type(MmapDataset(tmp_path / "ds")[0]) is not Sample and isinstance(MmapDataset(tmp_path / "ds")[0], dict)
