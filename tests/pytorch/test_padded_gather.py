"""PaddedCollate over batches from the mapping: padded straight from the blob, exact against np.load.

The oracle pads the sources' own bytes (np.load's raw reading, tests/corpus.py)
with plain numpy here, never with npz2mmap's ``pad``.
"""

from __future__ import annotations

import pickle
import re
import zlib
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import rewrite_blob, rewrite_index, write_samples
from corpus import little_endian_bytes, load_raw
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from strategies import dtypes, padded_record_dtypes
from torch.utils.data import DataLoader

from npz2mmap import MmapDataset, MmapLoader, PaddedCollate
from npz2mmap.errors import FormatError
from npz2mmap.read import ragged
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge


@st.composite
def ragged_fields(draw: st.DrawFn) -> list[np.ndarray]:
    """2..7 samples of one dtype and ndim (1..3) whose shapes differ, sides 0..4, any byte order."""
    dtype = draw(st.one_of(dtypes(), padded_record_dtypes(depth=1)))
    ndim = draw(st.integers(1, 3))
    shapes = draw(
        st.lists(
            hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=0, max_side=4), min_size=2, max_size=7
        )
    )
    if len(set(shapes)) == 1:
        shapes.append(tuple(d + 1 for d in shapes[0]))  # a field whose shapes never differ is not ragged
    return [draw(hnp.arrays(dtype, shape)) for shape in shapes]


def pad_value_for(dtype: np.dtype) -> st.SearchStrategy[Any]:
    if dtype.kind == "b":
        return st.sampled_from([0, 1, True])
    if dtype.kind in "iufc":
        return st.sampled_from([0, 1, 7]) if dtype.kind == "u" else st.sampled_from([0, -1, 7, 7.0])
    return st.just(0)


def expected_padded(sources: list[Path], name: str, indices: list[int], pad_value: Any) -> np.ndarray:
    """The padded batch as bytes (n, *largest, itemsize), built from np.load's raw bytes by plain numpy."""
    arrays = [load_raw(sources[i], name) for i in indices]
    dtype = arrays[0].dtype.newbyteorder("<")
    largest = np.max([a.shape for a in arrays], axis=0)
    pad_element = np.zeros(1, dtype)  # the default 0 of what is no number: zero bytes, or NaT
    if dtype.kind in "biufc" or pad_value != 0:
        pad_element[0] = pad_value
    elif dtype.kind in "Mm":
        pad_element[0] = dtype.type("NaT")
    out = np.empty((len(arrays), *largest, dtype.itemsize), dtype=np.uint8)
    out[...] = pad_element.view(np.uint8)
    for row, array in zip(out, arrays, strict=True):
        sample = np.frombuffer(little_endian_bytes(array), np.uint8).reshape(*array.shape, dtype.itemsize)
        row[tuple(slice(0, d) for d in array.shape)] = sample
    return out


def raw_bytes(value: Any) -> bytes:
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).tobytes()


def convert_in_parts(src: Path, out: Path, num_parts: int) -> Path:
    if num_parts == 1:
        convert([src], out, workers=1)
        return out
    parts = [convert([src], out, part=(k, num_parts), workers=1).out_dir for k in range(num_parts)]
    merge(parts, out)
    return out


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), arrays=ragged_fields())
def test_padded_batches_from_the_mapping_are_the_sources_padded_by_numpy(
    tmp_path_factory, data, arrays
) -> None:
    root = tmp_path_factory.mktemp("padded")
    sources = write_samples(root / "src", [{"x": a, "label": np.int64(i)} for i, a in enumerate(arrays)])
    num_parts = data.draw(st.integers(1, 3), label="parts")
    dataset = convert_in_parts(root / "src", root / "ds", num_parts)
    ds = MmapDataset(dataset)
    indices = data.draw(st.lists(st.integers(0, len(arrays) - 1), min_size=1, max_size=8), label="indices")
    pad_value = data.draw(pad_value_for(arrays[0].dtype), label="pad_value")
    loop_min = data.draw(st.sampled_from([0, 10**9]), label="loop_min")  # memcpy per row, or element index
    event(f"{num_parts} part(s), ndim {arrays[0].ndim}, dtype kind {arrays[0].dtype.kind}")
    with mock.patch.object(ragged, "LOOP_MIN_ELEMENTS", loop_min):
        batch = PaddedCollate(pad_value=pad_value, mask=True)(ds.__getitems__(indices))
    expected = expected_padded(sources, "x", indices, pad_value)
    assert tuple(batch["x"].shape) == expected.shape[:-1]
    assert raw_bytes(batch["x"]) == expected.tobytes()
    shapes = np.array([arrays[i].shape for i in indices])
    # The sources' own shapes tell: lengths along the one dimension in which they differ, if one does.
    varying = [axis for axis in range(arrays[0].ndim) if len({a.shape[axis] for a in arrays}) > 1]
    if len(varying) == 1:
        assert batch["x_lengths"].tolist() == shapes[:, varying[0]].tolist()
    else:
        assert "x_lengths" not in batch
    if arrays[0].ndim > 1:
        assert batch["x_shapes"].tolist() == shapes.tolist()
    else:
        assert "x_shapes" not in batch
    mask = np.zeros(expected.shape[:-1], dtype=bool)
    for row, shape in zip(mask, shapes, strict=True):
        row[tuple(slice(0, d) for d in shape)] = True
    assert np.array_equal(batch["x_mask"].numpy(), mask)
    assert batch["label"].tolist() == indices
    copies = ds.__getitems__(indices).arrays["x"]  # the per-sample path reads the same bytes
    assert [raw_bytes(a) for a in copies] == [little_endian_bytes(load_raw(sources[i], "x")) for i in indices]


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    """A 1-d int32 field long enough that a whole row moves in one copy, and a short uint8 one."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-(2**31), 2**31, n, dtype=np.int32) for n in (40, 0, 300, 41, 40, 7)]
    samples = [{"tokens": a, "mask": (a % 2 == 0).astype(np.uint8)} for a in arrays]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    return tmp_path / "ds", arrays


def padded_by_numpy(arrays: list[np.ndarray], pad_value: int) -> np.ndarray:
    out = np.full((len(arrays), max(len(a) for a in arrays)), pad_value, dtype=arrays[0].dtype)
    for row, array in zip(out, arrays, strict=True):
        row[: len(array)] = array
    return out


@pytest.mark.parametrize("loop_min", [0, 10**9])
@pytest.mark.parametrize(
    "indices",
    [[2], [0, 4], [4, 0, 4, 1], [1, 1], [5, 3, 2, 1, 0, 4]],
    ids=["one", "equal", "dup", "empty", "all"],
)
def test_mmap_loader_and_dataloader_pad_exactly(tokens, indices, loop_min) -> None:
    dataset, arrays = tokens
    ds = MmapDataset(dataset, fields=["tokens", "mask"])
    expected = padded_by_numpy([arrays[i] for i in indices], 9)
    with mock.patch.object(ragged, "LOOP_MIN_ELEMENTS", loop_min):
        collate = PaddedCollate(pad_value=9, mask=True)
        (through_loader,) = list(MmapLoader(ds, len(indices), batch_sampler=[indices], collate_fn=collate))
        (through_dataloader,) = list(DataLoader(ds, batch_sampler=[indices], collate_fn=collate))
    for batch in (through_loader, through_dataloader):
        assert batch["tokens"].dtype == torch.int32 and np.array_equal(batch["tokens"].numpy(), expected)
        assert batch["tokens_lengths"].tolist() == [len(arrays[i]) for i in indices]
        assert batch["tokens_mask"].sum(dim=1).tolist() == [len(arrays[i]) for i in indices]


def test_the_padded_batch_is_written_into_a_buffer_the_caller_gives(tokens) -> None:
    dataset, arrays = tokens
    rows = MmapDataset(dataset).reader.ragged_rows("tokens", [3, 1, 0])
    assert rows.padded_shape() == (3, 41)
    buffer = np.full(3 * 41 * 4 + 8, 0xAB, dtype=np.uint8)
    out = buffer[:-8].view(np.int32).reshape(3, 41)
    assert rows.fill_padded(out, pad_value=9) is out
    assert np.array_equal(out, padded_by_numpy([arrays[3], arrays[1], arrays[0]], 9))
    assert (buffer[-8:] == 0xAB).all()  # nothing written past the batch
    expected = "field 'tokens': out must be a writable C-contiguous numpy array of shape (3, 41) and dtype int32; "
    refused = [
        (np.empty((3, 40), np.int32), ValueError, "got shape (3, 40) and dtype int32"),
        (np.empty((3, 41), np.int64), ValueError, "got shape (3, 41) and dtype int64"),
        (np.empty((3, 41), np.int32, order="F"), ValueError, "it is not C-contiguous"),
        (np.empty((3, 41), np.int32)[:, ::-1], ValueError, "it is not C-contiguous"),
        (np.lib.stride_tricks.as_strided(np.empty((3, 41), np.int32), writeable=False), ValueError, "it is read-only"),
        (torch.empty((3, 41), dtype=torch.int32), TypeError, "got a Tensor (a tensor's .numpy() views its memory)"),
        ([[0] * 41] * 3, TypeError, "got a list"),
    ]
    for bad, kind, problem in refused:
        with pytest.raises(kind) as raised:
            rows.fill_padded(bad)  # type: ignore[arg-type]
        assert str(raised.value) == expected + problem


def test_a_batch_too_large_to_pad_is_refused_before_allocating(tmp_path) -> None:
    samples = [{"x": np.empty((2**40, 0), np.float32)}, {"x": np.empty((0, 2**40), np.float32)}]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    ds = MmapDataset(tmp_path / "ds")
    message = re.escape(f"field 'x': a batch padded to (2, {2**40}, {2**40}) is too large for numpy")
    with pytest.raises(ValueError, match=message):
        PaddedCollate()(ds.__getitems__([0, 1]))
    with pytest.raises(ValueError, match=message):
        PaddedCollate(ragged=["x"])([ds[0], ds[1]])
    assert PaddedCollate()(ds.__getitems__([0, 0]))["x"].shape == (2, 2**40, 0)


@pytest.mark.parametrize("pad_value", [0, 7])
def test_a_batch_padded_past_any_memory_is_a_memory_error_naming_the_field(tmp_path, pad_value) -> None:
    """Valid empty samples whose padded batch numpy could describe, at 2 PiB, but no machine holds."""
    samples = [{"x": np.empty((2**24, 0), np.float32)}, {"x": np.empty((0, 2**24), np.float32)}]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    ds = MmapDataset(tmp_path / "ds")
    shape = (2, 2**24, 2**24)
    message = re.escape(f"field 'x': a batch padded to {shape} needs {2 * 2**48 * 4:,} bytes")
    with pytest.raises(MemoryError, match=message):
        PaddedCollate(pad_value=pad_value)(ds.__getitems__([0, 1]))


def test_a_sample_between_elements_is_padded_from_its_own_bytes(tmp_path) -> None:
    """An offsets table edited so a sample starts mid-element: the batch reads the bytes it names, as ``ds[i]`` does."""
    write_samples(tmp_path / "src", [{"x": np.array([1], np.int32)}, {"x": np.array([2, 3], np.int32)}])
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    region = DatasetReader(tmp_path / "ds").index.field("x").offsets
    assert region is not None
    offsets = np.array([0, 2, 10], dtype="<i8").tobytes()  # sample 1: bytes 2..10, still 2 elements
    rewrite_blob(tmp_path / "ds", region.offset, offsets)

    def record_crc(document: dict[str, Any]) -> None:
        next(f for f in document["fields"] if f["name"] == "x")["offsets"]["crc32"] = zlib.crc32(offsets)

    rewrite_index(tmp_path / "ds", record_crc)
    ds = MmapDataset(tmp_path / "ds")
    assert ds[1]["x"].tobytes() == np.array([1, 2, 3], "<i4").tobytes()[2:10]
    for loop_min in (0, 10**9):
        with mock.patch.object(ragged, "LOOP_MIN_ELEMENTS", loop_min):
            batch = PaddedCollate()(ds.__getitems__([1, 1]))
        assert raw_bytes(batch["x"]) == 2 * np.array([1, 2, 3], "<i4").tobytes()[2:10]
    with pytest.raises(FormatError, match=re.escape("field 'x' sample 0: tables are corrupt (bytes 0..2")):
        PaddedCollate()(ds.__getitems__([1, 0]))


def as_it_is(batch: Any) -> Any:
    return batch


def test_a_batch_pickles_its_copies_never_the_mapping(tokens) -> None:
    dataset, arrays = tokens
    ds = MmapDataset(dataset, fields="tokens")
    batch = ds.__getitems__([1, 3])
    with pytest.raises(TypeError, match="pickle its copies"):
        pickle.dumps(batch.ragged_rows("tokens"))
    restored = pickle.loads(pickle.dumps(batch))
    assert len(pickle.dumps(batch)) < 1000  # 41 int32 and the recipe, not the data region
    assert [a.tolist() for a in restored.arrays["tokens"]] == [arrays[1].tolist(), arrays[3].tolist()]
    through_workers = DataLoader(ds, batch_size=3, num_workers=1, collate_fn=as_it_is)
    assert [a.tolist() for b in through_workers for a in b.arrays["tokens"]] == [a.tolist() for a in arrays]


def test_padding_a_batch_from_the_mapping_makes_no_per_sample_arrays(tokens, monkeypatch) -> None:
    """Each sample is copied once, from the mapping into the padded batch: no view, no copy of its own."""
    dataset, arrays = tokens
    ds = MmapDataset(dataset, fields=["tokens", "mask"])
    assert ds.reader is not None  # opened before the per-sample readers are taken away

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a sample was read on its own")

    monkeypatch.setattr("npz2mmap.read.reader._FieldView.sample", forbidden)
    monkeypatch.setattr("npz2mmap.read.ragged.RaggedRows.copies", forbidden, raising=False)
    batch = PaddedCollate(mask=True)(ds.__getitems__([2, 0, 5]))
    assert np.array_equal(batch["tokens"].numpy(), padded_by_numpy([arrays[2], arrays[0], arrays[5]], 0))


@pytest.mark.parametrize("from_mapping", [True, False])
@pytest.mark.parametrize("pad_value", [-1, 256, "x", None])
def test_a_pad_value_the_field_cannot_hold_is_an_error_naming_the_field(
    tmp_path, from_mapping, pad_value
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i, length in enumerate([2, 5]):
        np.savez(src / f"{i}.npz", mask=np.ones(length, dtype=np.uint8))
    convert([src], tmp_path / "ds")
    ds = MmapDataset(tmp_path / "ds")
    batch = ds.__getitems__([0, 1]) if from_mapping else [ds[0], ds[1]]
    collate_fn = PaddedCollate(pad_value=pad_value, ragged=None if from_mapping else ["mask"])
    with pytest.raises(
        ValueError, match=rf"^field 'mask': pad_value {re.escape(repr(pad_value))} is not a uint8"
    ):
        collate_fn(batch)


@pytest.fixture(scope="module")
def forgeable(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("forgeable")
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 100, n, dtype=np.int32) for n in (3, 0, 5, 1, 4, 2)]
    samples = [
        {"tokens": a, "mask": a.astype(np.uint8), "points": np.ones((len(a), 2), np.float32)} for a in arrays
    ]
    write_samples(root / "src", samples)
    convert([root / "src"], root / "ds", workers=1)
    return root / "ds"


def forged_entries(size: int, itemsize: int) -> st.SearchStrategy[int]:
    """Table entries at and past every bound: the data's size, negatives, and lengths whose
    byte count wraps int64 to a small number."""
    edges = [0, 1, 4, size - 1, size, size + 1, -1, -4, 2**63 - 1, -(2**63), size // itemsize + 1]
    return st.sampled_from(edges + [as_int64(2**64 // itemsize + k) for k in (0, 1, 4)])


def as_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def forge(view: Any, data: st.DataObject, sample: int) -> None:
    """Overwrite one entry of the tables, or a whole sample so that its end is its start plus
    its length in bytes (wrapped as int64 arithmetic wraps): caught only by the bounds."""
    itemsize, size = view.field.dtype.itemsize, len(view.data)
    entries = forged_entries(size, itemsize)
    if data.draw(st.booleans(), label="whole sample"):
        start = data.draw(
            st.sampled_from([-8, -4, -1, 0, 4, size - 4, size, size + 4, 2**63 - 4]), label="start"
        )
        length = data.draw(st.sampled_from([0, 1, size // itemsize + 1, 2**63 - 1, *wrapping(itemsize)]))
        nbytes = data.draw(st.sampled_from([as_int64(length * itemsize), -1]), label="bytes")
        view.offsets[sample], view.offsets[sample + 1] = start, as_int64(start + nbytes)
        view.shapes[sample] = (length,) + (1,) * (view.shapes.shape[1] - 1)
        return
    table = data.draw(st.sampled_from([view.offsets, view.shapes.reshape(-1)]), label="table")
    table[data.draw(st.integers(0, len(table) - 1), label="entry")] = data.draw(entries, label="value")


def wrapping(itemsize: int) -> list[int]:
    """Lengths whose byte count wraps int64 to 0 or a few bytes."""
    return [2**64 // itemsize + k for k in (0, 1) if 2**64 // itemsize + k < 2**63]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), name=st.sampled_from(["tokens", "mask", "points"]))
def test_locating_a_batch_refuses_exactly_what_reading_each_sample_refuses(forgeable, data, name) -> None:
    """The batch check (a few reductions) against the per-sample one, in Python ints, as the oracle."""
    reader = DatasetReader(forgeable)
    view = reader._field(name)
    view.offsets, view.shapes = np.array(view.offsets), np.array(view.shapes)  # writable copies
    idx = np.array(data.draw(st.lists(st.integers(0, len(reader) - 1), max_size=6), label="idx"), np.int64)
    for _ in range(data.draw(st.integers(0, 3), label="edits")):
        forge(view, data, data.draw(st.sampled_from(idx.tolist() or [0]), label="sample"))
    refused = []
    for i in idx.tolist():
        try:
            view.sample(i)
        except FormatError as exc:
            refused.append(str(exc))
    event("refused" if refused else "read")
    if refused:
        with pytest.raises(FormatError) as raised:
            reader.locate(name, idx)
        assert str(raised.value) == refused[0]
    else:
        starts, shapes = reader.locate(name, idx)
        assert starts.tolist() == view.offsets[idx].tolist()
        assert shapes.tolist() == view.shapes[idx].tolist()


@pytest.mark.parametrize(
    ("dtype", "pad_value", "pads_with"),
    [
        ("u1", 0.5, "np.uint8(0)"),
        ("u1", float("nan"), None),
        ("?", 0.5, "np.True_"),
        ("?", 7, "np.True_"),
        ("i4", 2.5, "np.int32(2)"),
        ("f2", 1e10, "np.float16(inf)"),
        ("<U3", 5, "np.str_('5')"),
        ("<M8[s]", 5, None),
        ("f4", 1j, None),
    ],
)
def test_a_pad_value_the_field_cannot_hold_exactly_is_refused(dtype, pad_value, pads_with) -> None:
    """numpy would cast it (0.5 to 0 in uint8, 0.5 to True): padding with what the user did not give."""
    arrays = [np.zeros(n, dtype=dtype) for n in (1, 3)]
    with pytest.raises(
        ValueError, match=f"^field 'x': pad_value {re.escape(repr(pad_value))} is not a "
    ) as refused:
        PaddedCollate(pad_value=pad_value, ragged=["x"])([{"x": a} for a in arrays])
    if pads_with is not None:
        assert str(refused.value).endswith(f": it would pad with {pads_with}")


def test_the_default_pad_of_what_is_no_number_is_its_empty_value() -> None:
    """'' for strings, b'' for bytes, zero bytes for records, NaT for datetimes, not the text '0'."""
    record = np.dtype([("a", "<i2"), ("b", "S2")])
    fields = {
        "u": [np.array(["w"], "<U6"), np.array(["x", "y", "z"], "<U6")],
        "s": [np.array([b"w"], "S2"), np.array([b"x", b"y"], "S2")],
        "r": [np.array([(3, b"w")], record), np.array([(1, b"a"), (2, b"b")], record)],
        "t": [np.array(["2020-01-01"], "M8[s]"), np.array(["2020-01-01", "2020-01-02"], "M8[s]")],
        "d": [np.array([1], "m8[ms]"), np.array([1, 2], "m8[ms]")],
    }
    samples = [{name: pair[k] for name, pair in fields.items()} for k in range(2)]
    batch = PaddedCollate(ragged=list(fields))(samples)
    assert batch["u"][0].tolist() == ["w", "", ""]
    assert batch["s"][0].tolist() == [b"w", b""]
    assert batch["r"][0][1].tobytes() == bytes(record.itemsize)
    assert np.isnat(batch["t"][0][1]) and np.isnat(batch["d"][0][1])


@settings(max_examples=60, deadline=None)
@given(
    dtypes=st.sampled_from(
        [
            ("<U1", "<U3"),
            ("<M8[D]", "<M8[s]"),
            ("i1", "u1"),
            ("i8", "f4"),
            ("f2", "f8"),
            (">i4", "<i2"),
            ("S1", "S4"),
        ]
    ),
    data=st.data(),
)
def test_a_users_samples_of_other_dtypes_pad_in_numpys_promotion(dtypes, data) -> None:
    """Own samples (not a dataset's) may mix dtypes: the padded batch holds every value as
    numpy's promotion of them does, never cast to the first sample's dtype."""
    arrays = [
        data.draw(hnp.arrays(np.dtype(data.draw(st.sampled_from(dtypes))), st.integers(1, 4)))
        for _ in range(data.draw(st.integers(1, 4)))
    ]
    batch = PaddedCollate(ragged=["t"])([{"t": a} for a in arrays])
    got = batch["t"].numpy() if isinstance(batch["t"], torch.Tensor) else batch["t"]
    common = np.result_type(*arrays)
    assert got.dtype == common.newbyteorder("=")
    for row, array in zip(got, arrays, strict=True):
        assert row[: len(array)].tobytes() == array.astype(got.dtype).tobytes()
    assert batch["t_lengths"].tolist() == [len(a) for a in arrays]


def test_samples_of_dtypes_numpy_cannot_promote_or_of_other_ndim_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^field 't' mixes dtypes datetime64\[s\], int64, which numpy cannot"):
        PaddedCollate(ragged=["t"])([{"t": np.array(["2020-01-01"], "M8[s]")}, {"t": np.arange(2)}])
    with pytest.raises(ValueError, match="^field 't' has samples of 1 and 2 dimensions; padding needs one$"):
        PaddedCollate(ragged=["t"])([{"t": np.arange(2)}, {"t": np.zeros((2, 2))}])
