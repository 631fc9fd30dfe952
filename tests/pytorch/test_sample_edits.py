"""A collate_fn's edits of a gathered batch's sample dicts, against numpy's own stacking.

Whatever a collate_fn does to the sample dicts a batch hands out (new values,
numpy scalars of other dtypes, new or deleted keys, a view's ``.shape`` or
``.dtype`` set in place), ``collate`` and ``PaddedCollate`` collate the samples
as edited: each field is what ``np.stack`` makes of the edited values, in its
dtype (record padding kept), or an error; a key some samples lack is refused.
"""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_npz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npz2mmap
from npz2mmap import MmapDataset, PaddedCollate

PADDED_RECORD = np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"], "offsets": [0, 8], "itemsize": 16})
SCALAR_DTYPES = ["int8", "uint8", "int64", "uint64", "float16", "float32", "float64", "bool", "longdouble"]
BATCH = 3


@pytest.fixture(scope="module")
def edit_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("edits")
    for i in range(BATCH):
        record = np.zeros(2, PADDED_RECORD)
        record["a"], record["b"] = i, i / 3
        write_npz(
            root / "src" / f"{i}.npz", x=np.arange(6, dtype=np.int32) * (i + 1), r=record, y=np.int64(i)
        )
    npz2mmap.convert([root / "src"], root / "dataset")
    return root / "dataset"


def apply_edit(sample: dict[str, Any], edit: tuple[Any, ...]) -> None:
    kind = edit[0]
    if kind == "reshape":
        sample["x"].shape = (2, 3)
    elif kind == "view":
        sample["x"].dtype = np.dtype(np.uint32)
    elif kind == "scalar":
        sample["y"] = np.dtype(edit[1]).type(edit[2])
    elif kind == "add":
        sample["extra"] = np.int64(edit[1])
    elif kind == "drop":
        sample.pop("y", None)
    elif kind == "replace":
        sample["r"] = sample["r"].copy()


edits = st.one_of(
    st.tuples(st.just("reshape")),
    st.tuples(st.just("view")),
    st.tuples(st.just("scalar"), st.sampled_from(SCALAR_DTYPES), st.integers(0, 100)),
    st.tuples(st.just("add"), st.integers(-5, 5)),
    st.tuples(st.just("drop")),
    st.tuples(st.just("replace")),
)


def numpy_stacked(values: list[Any]) -> np.ndarray:
    """The oracle: numpy's stack of the values, in their common dtype (theirs when they agree)."""
    arrays = [np.asarray(v) for v in values]
    if all(a.dtype == arrays[0].dtype for a in arrays):
        return np.stack(arrays, dtype=arrays[0].dtype)
    return np.stack(arrays)


def as_numpy(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


@pytest.mark.parametrize("collate_name", ["collate", "PaddedCollate"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(0, BATCH - 1), edits), max_size=6))
def test_collating_edited_samples_is_numpys_stack_of_them(edit_dataset, collate_name, plan) -> None:
    ds = MmapDataset(edit_dataset)
    collate_fn = npz2mmap.collate if collate_name == "collate" else PaddedCollate()
    batch = ds.__getitems__(list(range(BATCH)))
    for j, edit in plan:
        apply_edit(batch[j], edit)
    samples = [dict(batch[j]) for j in range(BATCH)]
    keys = [sorted(s) for s in samples]
    if any(k != keys[0] for k in keys):
        with pytest.raises(ValueError, match=r"^sample \d of a batch has keys .* where sample 0 has"):
            collate_fn(batch)
        return
    expected: dict[str, np.ndarray | None] = {}
    for key in keys[0]:
        try:
            expected[key] = numpy_stacked([s[key] for s in samples])
        except ValueError:  # shapes numpy cannot stack
            expected[key] = None
    if any(v is None for v in expected.values()):
        with pytest.raises((ValueError, RuntimeError)):
            collate_fn(batch)
        return
    out = collate_fn(batch)
    assert sorted(out) == keys[0]
    for key, want in expected.items():
        got = as_numpy(out[key])
        assert want is not None
        assert got.dtype == want.dtype.newbyteorder("="), (key, got.dtype, want.dtype)
        assert got.shape == want.shape, key
        if want.dtype.names or want.dtype == np.longdouble:  # by value: padding bytes are left unset
            assert (got == want).all(), key
        else:
            assert got.tobytes() == want.astype(got.dtype).tobytes(), key


def test_a_shape_set_in_place_reaches_the_batch(edit_dataset) -> None:
    ds = MmapDataset(edit_dataset)
    for collate_fn in (npz2mmap.collate, PaddedCollate()):
        batch = ds.__getitems__([0, 1])
        for sample in batch:
            sample["x"].shape = (3, 2)
        assert tuple(collate_fn(batch)["x"].shape) == (2, 3, 2)


def test_padded_collate_keeps_record_padding_of_edited_samples(edit_dataset) -> None:
    ds = MmapDataset(edit_dataset)
    batch = ds.__getitems__([0, 1])
    batch[0]["y"] = np.int64(9)
    assert PaddedCollate()(batch)["r"].dtype == PADDED_RECORD


def test_mixed_numpy_scalars_collate_in_numpys_promotion() -> None:
    """float32 with int64 is float64 in numpy, float32 (losing 2**40 + 1) in torch's promotion."""
    out = npz2mmap.collate([{"y": np.float32(0.5)}, {"y": np.int64(2**40 + 1)}])
    assert out["y"].dtype == torch.float64 and out["y"].tolist() == [0.5, 2**40 + 1]
    assert npz2mmap.collate([np.uint64(2**64 - 1)] * 2).tolist() == [2**64 - 1] * 2
    exact = npz2mmap.collate([np.longdouble(1) / 3] * 2)
    assert exact.dtype == np.longdouble and exact[0] == np.longdouble(1) / 3


@pytest.mark.parametrize("collate_fn", [npz2mmap.collate, PaddedCollate()], ids=["collate", "PaddedCollate"])
def test_samples_of_other_keys_are_refused_not_cut_to_the_first_ones(collate_fn) -> None:
    samples = [{"x": np.zeros(2)}, {"x": np.ones(2), "extra": np.int64(1)}]
    with pytest.raises(
        ValueError, match=r"^sample 1 of a batch has keys \['extra', 'x'\] where sample 0 has \['x'\]"
    ):
        collate_fn(samples)


@pytest.fixture(scope="module")
def string_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("strings")
    for i in range(3):
        write_npz(root / "src" / f"{i}.npz", name=np.array("ab"), y=np.int64(i), t=np.arange(i + 1))
    npz2mmap.convert(root / "src", root / "dataset")
    return root / "dataset"


@pytest.mark.parametrize("wider", [np.array("much longer"), np.str_("much longer")], ids=["array", "scalar"])
def test_an_edited_wider_string_stacks_in_numpys_promotion(string_dataset, wider) -> None:
    batch = MmapDataset(string_dataset).__getitems__([0, 1, 2])
    batch[0]["name"] = wider
    out = npz2mmap.collate(batch)["name"]
    assert out.dtype == np.dtype("<U11") and out.tolist() == ["much longer", "ab", "ab"]


def test_padded_collate_says_why_strings_make_no_nested_tensor(string_dataset) -> None:
    batch = MmapDataset(string_dataset).__getitems__([0, 1])
    with pytest.raises(ValueError, match=r"^field 'name' is of dtype <U2, which torch has no tensor for"):
        PaddedCollate(nested=True, ragged=["name"])(batch)


def test_padded_collate_of_a_0d_field_named_ragged_stacks_it_with_no_lengths(string_dataset) -> None:
    """A 0-d sample differs in no dimension: no one length, and no shape of two dimensions or more."""
    out = PaddedCollate(ragged=["y"])(MmapDataset(string_dataset).__getitems__([0, 1]))
    assert out["y"].tolist() == [0, 1] and "y_lengths" not in out and "y_shapes" not in out


def test_a_ragged_field_of_plain_samples_names_the_field_and_the_way_out(string_dataset) -> None:
    ds = MmapDataset(string_dataset)
    concat = torch.utils.data.ConcatDataset([ds, ds])
    loader = torch.utils.data.DataLoader(concat, batch_size=4, collate_fn=npz2mmap.collate)
    listed = next(iter(loader))  # the dataset's samples know 't' is ragged: listed, as in its batches
    assert [t.tolist() for t in listed["t"]] == [concat[i]["t"].tolist() for i in range(4)]
    plain = torch.utils.data.DataLoader([dict(concat[i]) for i in range(4)], batch_size=4, collate_fn=npz2mmap.collate)
    with pytest.raises(ValueError, match=r"^field 't' has samples of shapes \(1,\) and \(3,\) in one batch"):
        next(iter(plain))
    same = npz2mmap.collate([dict(ds[0]), dict(ds[0])])
    assert same["t"].tolist() == [[0], [0]] and same["name"].tolist() == ["ab", "ab"]


@pytest.fixture(scope="module")
def ragged_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ragged")
    for i in range(4):
        write_npz(
            root / "src" / f"{i}.npz", idx=np.int64(i), tok=np.arange(2 if i < 2 else i + 3, dtype=np.int32)
        )
    npz2mmap.convert(root / "src", root / "dataset")
    return root / "dataset"


@pytest.mark.parametrize(
    "rearrange",
    [
        lambda b: sorted(b, key=lambda s: len(s["tok"])),
        lambda b: list(b)[::-1],
        lambda b: b[0:2],
        lambda b: [dict(s) for s in b],
        lambda b: [b[0], b[0]],
    ],
    ids=["sorted", "reversed", "sliced", "copied", "repeated"],
)
@pytest.mark.parametrize("indices", [[0, 1], [0, 3]], ids=["equal lengths", "other lengths"])
def test_padded_collate_keeps_the_datasets_ragged_fields_in_a_list_made_of_its_samples(
    ragged_dataset, rearrange, indices
) -> None:
    """A collate_fn that sorts, slices or copies the batch's samples first: the keys stay the
    dataset's (lengths and mask for its ragged fields), whatever the batch's shapes."""
    batch = MmapDataset(ragged_dataset).__getitems__(indices)
    out = PaddedCollate(mask=True)(rearrange(batch))
    assert sorted(out) == ["idx", "tok", "tok_lengths", "tok_mask"]


@pytest.mark.parametrize("order", [">", "<"])
def test_values_in_either_byte_order_become_native_tensors(ragged_dataset, order) -> None:
    batch = MmapDataset(ragged_dataset).__getitems__([0, 3])
    for sample in batch:
        sample["idx"] = sample["idx"].astype(f"{order}i8")
        sample["tok"] = sample["tok"].astype(f"{order}i4")
    padded = PaddedCollate()(batch)
    assert padded["idx"].dtype == torch.int64 and padded["idx"].tolist() == [0, 3]
    assert padded["tok"].dtype == torch.int32 and padded["tok"][1].tolist() == list(range(6))
    listed = npz2mmap.collate(batch)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 for t in listed["tok"])
    assert listed["tok"][1].tolist() == list(range(6)) and listed["idx"].tolist() == [0, 3]


def test_numpy_string_scalars_stack_as_numpy_as_in_padded_collate() -> None:
    samples = [{"s": np.str_("a")}, {"s": np.str_("bb")}, {"s": np.str_("ccc")}]
    for out in (npz2mmap.collate(samples), PaddedCollate()(samples)):
        assert out["s"].dtype == np.dtype("<U3") and out["s"].tolist() == ["a", "bb", "ccc"]
    assert npz2mmap.collate([np.bytes_(b"a"), np.bytes_(b"bbb")]).tolist() == [b"a", b"bbb"]
    assert npz2mmap.collate(["a", "b"]) == ["a", "b"]  # Python strings stay torch's list


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "field 'idx' holds NoneType values, which make no array but one of Python objects"),
        ({"a": 1}, "field 'idx' holds dict values, which make no array but one of Python objects"),
        (torch.zeros(2, requires_grad=True), "field 'idx' is a tensor that requires grad"),
    ],
    ids=["None", "dict", "requires grad"],
)
def test_padded_collate_names_the_field_it_cannot_collate(ragged_dataset, value, message) -> None:
    batch = MmapDataset(ragged_dataset).__getitems__([0, 1])
    for sample in batch:
        sample["idx"] = value
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        PaddedCollate()(batch)


# --- a collated batch is the user's: edits of it never reach the samples ----------------------

COLLATES = {"default_collate": torch.utils.data.default_collate, "collate": npz2mmap.collate}


def sources_of(ragged_dataset: Path, indices: list[int]) -> dict[str, list[np.ndarray]]:
    """The oracle: each field of the samples as np.load reads their source files."""
    loaded = [np.load(ragged_dataset.parent / "src" / f"{i}.npz") for i in indices]
    return {name: [file[name] for file in loaded] for name in ("idx", "tok")}


def scaled_in_place(batch: dict[str, Any]) -> None:
    """What a training step does to its batch: normalise, mixup, augment, in place."""
    for value in batch.values():
        for tensor in value if isinstance(value, list) else [value]:
            tensor.mul_(10)


def assert_is_the_sources(batch: dict[str, Any], expected: dict[str, list[np.ndarray]]) -> None:
    assert batch["idx"].tolist() == [int(v) for v in expected["idx"]]
    assert [t.tolist() for t in batch["tok"]] == [v.tolist() for v in expected["tok"]]


@pytest.mark.parametrize(
    "collate_name, again",
    [
        (name, again)
        for name in sorted(COLLATES)
        for again in ["the batch", "its samples rearranged", "a deep copy", "a pickled copy"]
        # collate takes a list of one's own as plain samples, whose ragged fields it refuses
        if (name, again) != ("collate", "its samples rearranged")
    ],
)
def test_a_collated_batch_edited_in_place_leaves_the_samples_as_read(
    ragged_dataset, collate_name, again
) -> None:
    """As with any Dataset: the batch a collate makes is new to its user, so scaling it in place
    changes neither the samples nor anything collated from them afterwards."""
    collate_fn = COLLATES[collate_name]
    indices = [3, 0, 2, 1]
    samples = MmapDataset(ragged_dataset).__getitems__(indices)
    first = collate_fn(samples)
    scaled_in_place(first)
    perm = [2, 0, 3, 1]
    if again == "the batch":
        second, expected_order = collate_fn(samples), indices
    elif again == "its samples rearranged":
        second, expected_order = collate_fn([samples[k] for k in perm]), [indices[k] for k in perm]
    else:
        copied = copy.deepcopy(samples) if again == "a deep copy" else pickle.loads(pickle.dumps(samples))
        second, expected_order = collate_fn(copied), indices
    assert_is_the_sources(second, sources_of(ragged_dataset, expected_order))
    assert first["idx"].tolist() == [10 * i for i in indices]  # the first batch keeps its own edit


@pytest.mark.parametrize("collate_name", sorted(COLLATES))
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_an_edit_of_a_copied_batchs_sample_is_collated(ragged_dataset, collate_name, how) -> None:
    """A batch collated once, then copied (as DataLoader workers send what a collate_fn returns):
    an edit of the copy's samples reaches the copy's collate."""
    collate_fn = COLLATES[collate_name]
    samples = MmapDataset(ragged_dataset).__getitems__([1, 2, 3])
    collate_fn(samples)
    copied = copy.deepcopy(samples) if how == "deepcopy" else pickle.loads(pickle.dumps(samples))
    copied[0]["idx"][...] = 7
    copied[1]["tok"][...] = 9
    out = collate_fn(copied)
    assert out["idx"].tolist() == [7, 2, 3]
    assert out["tok"][1].tolist() == [9] * 5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_samples_sent_back_by_workers_collate_as_edited(ragged_dataset, num_workers) -> None:
    def batch_and_samples(samples: Any) -> Any:
        return torch.utils.data.default_collate(samples), samples

    ds = MmapDataset(ragged_dataset)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=2,
        num_workers=num_workers,
        collate_fn=batch_and_samples,
        multiprocessing_context="fork" if num_workers else None,
    )
    for batch, samples in loader:
        scaled_in_place(batch)
        samples[0]["idx"][...] = 7
        again = torch.utils.data.default_collate(samples)
        assert again["idx"][0] == 7 and again["idx"][1] == int(samples[1]["idx"])
        assert int(samples[1]["idx"]) < 4  # the batch's edit did not reach the samples


@pytest.mark.parametrize("collate_name", sorted(COLLATES))
@pytest.mark.parametrize("fields", [None, "idx", "tok"], ids=["dicts", "bare fixed", "bare ragged"])
def test_a_collate_fns_edits_of_its_samples_stay_theirs_after_a_collate(
    ragged_dataset, collate_name, fields
) -> None:
    """Edited in place before collating, the samples hold their edits after it too, and so does
    every later collate of them; the batch's own edits reach neither."""
    collate_fn = COLLATES[collate_name]
    indices = [2, 0, 3]
    samples = MmapDataset(ragged_dataset, fields=fields).__getitems__(indices)
    expected = sources_of(ragged_dataset, indices)
    first = samples[0]
    if fields is None:
        first["idx"] += 1000
        first["tok"][...] = 5
        expected["idx"][0] = expected["idx"][0] + 1000
        expected["tok"][0] = np.full_like(expected["tok"][0], 5)
    else:
        first[...] = 7
        expected[fields][0] = np.full_like(expected[fields][0], 7)
    batch = collate_fn(samples)
    scaled_in_place(batch if isinstance(batch, dict) else {"x": batch})
    again = collate_fn(samples)
    if fields is None:
        assert samples[0] is first
        assert int(samples[0]["idx"]) == int(expected["idx"][0])
        assert_is_the_sources(again, expected)
    elif fields == "idx":
        assert again.tolist() == [int(v) for v in expected["idx"]]
    else:
        assert [t.tolist() for t in again] == [v.tolist() for v in expected["tok"]]


def reversed_values_dataset(tmp_path: Path) -> MmapDataset:
    with npz2mmap.Writer(tmp_path / "ds") as writer:
        for i in range(4):
            writer.append({"v": np.arange(3) + i, "r": np.arange(i + 1)})
    return MmapDataset(tmp_path / "ds")


@pytest.mark.parametrize(
    "collate_fn", [torch.utils.data.default_collate, npz2mmap.collate, PaddedCollate()], ids=["torch", "ours", "padded"]
)
def test_samples_edited_into_reversed_views_collate_as_numpy_stacks_them(tmp_path, collate_fn) -> None:
    samples = reversed_values_dataset(tmp_path).__getitems__([0, 1])
    samples[0]["v"] = samples[0]["v"][::-1]  # negative strides, which torch cannot view
    samples[1]["r"] = samples[1]["r"][::-1]
    batch = collate_fn(samples)
    assert batch["v"].tolist() == np.stack([np.arange(3)[::-1], np.arange(3) + 1]).tolist()
    if isinstance(batch["r"], list):
        rows = [row.tolist() for row in batch["r"]]
    else:  # padded, with each row's length
        rows = [row[:n].tolist() for row, n in zip(batch["r"], batch["r_lengths"], strict=True)]
    assert rows == [[0], [1, 0]]


@pytest.mark.parametrize(
    "collate_fn",
    [torch.utils.data.default_collate, npz2mmap.collate, PaddedCollate(), PaddedCollate(nested=True)],
    ids=["torch", "ours", "padded", "nested"],
)
def test_reversed_views_of_one_row_collate_as_numpy_gives_them(tmp_path, collate_fn) -> None:
    # r[::-2] of 1 or 2 rows is one row with a negative stride, which numpy calls contiguous.
    samples = reversed_values_dataset(tmp_path).__getitems__([0, 1, 2])
    for sample in samples:
        sample["r"] = sample["r"][::-2]
    batch = collate_fn(samples)
    if isinstance(batch["r"], list):
        rows = [row.tolist() for row in batch["r"]]
    elif batch["r"].is_nested:
        rows = [row.tolist() for row in batch["r"].unbind()]
    else:
        rows = [row[:n].tolist() for row, n in zip(batch["r"], batch["r_lengths"], strict=True)]
    assert rows == [np.arange(n)[::-2].tolist() for n in (1, 2, 3)]


@pytest.mark.parametrize("single", [False, True])
def test_a_plain_list_with_a_reversed_array_is_collated_as_numpy_stacks_it(single) -> None:
    arrays = [np.arange(3)[::-1], np.arange(3)]
    batch = npz2mmap.collate(arrays if single else [{"v": a} for a in arrays])
    assert (batch if single else batch["v"]).tolist() == np.stack(arrays).tolist()


@pytest.mark.parametrize(
    "collate_fn", [torch.utils.data.default_collate, npz2mmap.collate, PaddedCollate()], ids=["torch", "ours", "padded"]
)
def test_a_list_of_a_batch_sorted_collates_as_the_batch_would_in_that_order(ragged_dataset, collate_fn) -> None:
    ds = MmapDataset(ragged_dataset)
    samples = list(ds.__getitems__([3, 0, 2, 1]))
    samples.sort(key=lambda sample: len(sample["tok"]))
    order = [int(sample["idx"]) for sample in samples]
    got = collate_fn(samples)
    want = collate_fn(ds.__getitems__(order))
    assert type(got) is type(want) and list(got) == list(want)
    for key in want:
        if isinstance(want[key], list):
            assert [t.tolist() for t in got[key]] == [t.tolist() for t in want[key]]
        else:
            assert got[key].tolist() == want[key].tolist()


def renamed(sample: dict[str, Any]) -> dict[str, Any]:
    return {"ids": sample["tok"], "idx": sample["idx"]}


@pytest.mark.parametrize("loader", ["DataLoader", "DataLoader+collate", "MmapLoader", "MmapLoader+collate"])
def test_a_ragged_field_a_transform_renamed_is_named_with_the_way_out(ragged_dataset, loader) -> None:
    """torch's own error said only "stack expects each tensor to be equal size", naming no key."""
    from torch.utils.data import DataLoader

    from npz2mmap import MmapLoader

    ds = MmapDataset(ragged_dataset, transform=renamed)
    collate_fn = {"collate_fn": npz2mmap.collate} if loader.endswith("+collate") else {}
    make = DataLoader if loader.startswith("DataLoader") else MmapLoader
    with pytest.raises(ValueError) as refused:
        next(iter(make(ds, 4, **collate_fn)))
    assert str(refused.value) == (
        "'ids' has samples of shapes (2,) and (6,) in one batch, and is no ragged field of the dataset "
        "(a transform renamed or reshaped one?): pass collate_fn=npz2mmap.PaddedCollate(ragged=['ids']) to "
        "pad it, or have the transform keep one shape, or a ragged field's own name"
    )
    batch = next(iter(make(ds, 4, collate_fn=PaddedCollate(ragged=["ids"]))))  # the way out works
    assert batch["ids"].shape == (4, 6) and batch["ids_lengths"].tolist() == [2, 2, 5, 6]


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_a_pass_that_ended_at_a_transforms_error_says_so_when_asked_for_more(tmp_path, num_workers) -> None:
    """A loop that caught the error to skip the batch got StopIteration from the next next(): its
    epoch ended at batch 3 of 10 without a word, where torch's DataLoader goes on."""
    from npz2mmap import MmapDataset, MmapLoader, Writer

    with Writer(tmp_path / "ds") as writer:
        for i in range(40):
            writer.append({"i": np.int64(i)})

    def fails_on_13(sample: dict[str, Any]) -> dict[str, Any]:
        if int(sample["i"]) == 13:
            raise ValueError("sample 13 is bad")
        return sample

    ds = MmapDataset(tmp_path / "ds", transform=fails_on_13)
    with MmapLoader(ds, 4, num_workers=num_workers) as loader:
        batches = iter(loader)
        assert [next(batches)["i"].tolist() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        with pytest.raises(Exception, match="sample 13 is bad"):
            next(batches)
        with pytest.raises(RuntimeError) as ended:
            next(batches)
        assert str(ended.value).startswith("MmapLoader: this pass ended at an error (")
        assert str(ended.value).endswith(
            "and does not go on after one: catch the error inside the transform or collate_fn, or begin a new pass"
        )
        del batches
        assert next(iter(loader))["i"].tolist() == [0, 1, 2, 3]  # a new pass begins as ever


class CachedTokens:
    """A transform that hands out arrays of its own (a cache), as a user's may."""

    def __init__(self) -> None:
        self.cache = {i: np.arange(i + 2, dtype=np.int32) * 7 for i in range(4)}

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return {"idx": sample["idx"], "tok": self.cache[int(sample["idx"])]}


def held_samples(ragged_dataset: Path, how: str) -> list[Any]:
    """Samples a user holds, made one way or another, and collated as a batch afterwards."""
    if how == "list of a gathered batch":
        return list(MmapDataset(ragged_dataset).__getitems__([3, 0, 2]))
    if how == "ds[i] one by one":
        ds = MmapDataset(ragged_dataset)
        return [ds[i] for i in (3, 0, 2)]
    if how == "bare ragged field":
        ds = MmapDataset(ragged_dataset, fields="tok")
        return [ds[i] for i in (3, 0, 2)]
    ds = MmapDataset(ragged_dataset, transform=lambda s: {"idx": s["idx"], "tok": s["tok"] + 0})
    return [ds[i] for i in (3, 0, 2)]


@pytest.mark.parametrize(
    ("collate_name", "how"),
    [
        (collate_name, how)
        for collate_name in ("collate", "default_collate")
        for how in ("list of a gathered batch", "ds[i] one by one", "bare ragged field", "transformed")
        if (collate_name, how) != ("default_collate", "transformed")  # a transform's ragged: refused
    ],
)
def test_a_batch_collated_from_samples_one_holds_is_memory_of_its_own(ragged_dataset, collate_name, how) -> None:
    """collate(list(batch)) and collate([ds[i], ...]) gave ragged fields as tensors viewing the
    samples: scaling the batch in place changed the samples (and a transform's cached arrays)."""
    collate_fn = npz2mmap.collate if collate_name == "collate" else torch.utils.data.default_collate
    samples = held_samples(ragged_dataset, how)
    before = copy.deepcopy(samples)
    batch = collate_fn(samples)
    for tensor in batch["tok"] if isinstance(batch, dict) else batch:
        tensor.mul_(10)
    for sample, kept in zip(samples, before, strict=True):
        for got, expected in [(sample["tok"], kept["tok"])] if isinstance(sample, dict) else [(sample, kept)]:
            assert np.array_equal(got, expected)


@pytest.mark.parametrize(
    "loader", ["MmapLoader", "MmapLoader with collate", "DataLoader with collate", "DataLoader"]
)
def test_a_transforms_cached_arrays_are_not_changed_by_editing_a_batch(ragged_dataset, loader) -> None:
    """A batch of a transform's cached ragged arrays, scaled in place, changed the cache: every
    later epoch read the scaled values."""
    transform = CachedTokens()
    ds = MmapDataset(ragged_dataset, transform=transform)
    expected = {i: tokens.copy() for i, tokens in transform.cache.items()}
    collate_fn = npz2mmap.collate if "with collate" in loader else None
    if loader.startswith("MmapLoader"):
        made: Any = npz2mmap.MmapLoader(ds, 2, prefetch=0, collate_fn=collate_fn)
    else:
        made = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=collate_fn or npz2mmap.collate)
    for batch in made:
        for tensor in batch["tok"]:
            tensor.sub_(1000)
    assert all(np.array_equal(transform.cache[i], expected[i]) for i in expected)


@pytest.mark.parametrize("collate_fn", [None, npz2mmap.collate], ids=["own collate", "collate"])
@pytest.mark.parametrize("loader", ["MmapLoader", "DataLoader"])
def test_batches_from_workers_edited_in_place_leave_the_next_epoch_as_read(
    ragged_dataset, loader, collate_fn
) -> None:
    """Workers keep the transform (and its cache) across epochs: a batch scaled in place in the
    trainer must not reach what they hand out next, whether they copy a batch or share it."""
    ds = MmapDataset(ragged_dataset, transform=CachedTokens())
    expected = {i: tokens.tolist() for i, tokens in CachedTokens().cache.items()}
    if loader == "MmapLoader":
        made: Any = npz2mmap.MmapLoader(ds, 2, num_workers=2, collate_fn=collate_fn, multiprocessing_context="fork")
    else:
        made = torch.utils.data.DataLoader(
            ds, batch_size=2, num_workers=2, persistent_workers=True, collate_fn=collate_fn or npz2mmap.collate,
            multiprocessing_context="fork",
        )
    for _ in range(2):
        for batch in made:
            assert [t.tolist() for t in batch["tok"]] == [expected[int(i)] for i in batch["idx"]]
            for tensor in batch["tok"]:
                tensor.sub_(1000)
    if loader == "MmapLoader":
        made.close()
