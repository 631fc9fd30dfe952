"""MmapDataset: indexing, copies safe to edit, pickling, and DataLoader workers."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_same_array, write_samples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import npz2mmap.read.parts
from npz2mmap import MmapDataset, MmapLoader, PaddedCollate
from npz2mmap.errors import FormatError
from npz2mmap.read.indices import normalise_index, normalise_indices
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge


def load_source(path: Path, key: str) -> np.ndarray:
    with np.load(path, allow_pickle=False) as npz:
        return npz[key]


def test_len_items_and_negative_indices(small_dataset) -> None:
    out, sources = small_dataset
    ds = MmapDataset(out)
    assert len(ds) == 6
    assert set(ds[0]) == {"input", "label", "tokens"}
    for i in (0, 3, -1, -6):
        for key, value in ds[i].items():
            assert_same_array(value, load_source(sources[i], key))
    for bad in (6, -7, 100):
        with pytest.raises(IndexError, match="out of range for 6 samples"):
            ds[bad]


def test_single_field_returns_the_bare_array_and_transform_applies(small_dataset) -> None:
    out, sources = small_dataset
    ds = MmapDataset(out, fields="tokens", transform=lambda a: a * 2)
    assert np.array_equal(ds[2], load_source(sources[2], "tokens") * 2)
    with pytest.raises(KeyError, match="no field 'nope'; the dataset has: 'input', 'label', 'tokens'"):
        MmapDataset(out, fields=["input", "nope"])


def test_edits_reach_neither_the_file_nor_later_reads(small_dataset) -> None:
    out, sources = small_dataset
    before = (out / "data.npy").read_bytes()
    ds = MmapDataset(out)
    first = ds[1]
    first["input"][...] = 0
    first["tokens"] += 5
    again = ds[1]
    assert_same_array(again["input"], load_source(sources[1], "input"))
    assert_same_array(again["tokens"], load_source(sources[1], "tokens"))
    assert (out / "data.npy").read_bytes() == before


def test_pickled_dataset_is_small_and_holds_no_mapping(small_dataset) -> None:
    out, _ = small_dataset
    ds = MmapDataset(out)
    ds[0]
    state = pickle.dumps(ds)
    assert len(state) < 4096
    clone = pickle.loads(state)
    assert clone._opened is None and clone._locks == {}
    assert np.array_equal(clone[4]["tokens"], ds[4]["tokens"])


def test_open_refuses_a_directory_that_is_not_a_dataset(tmp_path) -> None:
    with pytest.raises(FormatError, match="index.json: missing; is this an npz2mmap dataset"):
        MmapDataset(tmp_path)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_return_exactly_the_sources(small_dataset, method) -> None:
    out, sources = small_dataset
    loader = DataLoader(
        MmapDataset(out, fields=["input", "label"]),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        multiprocessing_context=method,
        persistent_workers=True,
    )
    for _ in range(2):
        seen = {}
        for batch in loader:
            assert isinstance(batch["input"], torch.Tensor)
            for label, image in zip(batch["label"].tolist(), batch["input"], strict=True):
                seen[label] = image.numpy()
        assert sorted(seen) == list(range(6))
        for label, image in seen.items():
            assert_same_array(image, load_source(sources[label], "input"))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
@pytest.mark.parametrize("workers", [0, 4])
def test_dataloader_with_zero_and_four_workers(small_dataset, workers) -> None:
    out, _ = small_dataset
    loader = DataLoader(MmapDataset(out, fields="label"), batch_size=2, num_workers=workers)
    assert torch.cat(list(loader)).tolist() == list(range(6))


def test_spawn_workers_run_without_any_warning(small_dataset, tmp_path) -> None:
    """Warnings become errors in the main process and, through worker_init_fn, in every worker.

    multiprocessing's resource tracker sometimes reports a semaphore it lost
    track of when spawned workers exit (a race outside npz2mmap, seen without
    it too); its lines are the only stderr output tolerated.
    """
    out, sources = small_dataset
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import warnings
        import numpy as np
        import torch
        from torch.utils.data import DataLoader
        from npz2mmap import MmapDataset, collate

        def keep(items):
            return items

        def warnings_are_errors(worker_id):
            warnings.simplefilter("error")

        class PerItem(torch.utils.data.Dataset):  # no __getitems__: item by item, default collate

            def __init__(self, ds):
                self.ds = ds

            def __len__(self):
                return len(self.ds)

            def __getitem__(self, i):
                return self.ds[i]

        if __name__ == "__main__":
            ds = MmapDataset({str(out)!r})
            loader = DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="spawn",
                                collate_fn=keep, worker_init_fn=warnings_are_errors)
            items = [item for batch in loader for item in batch]
            fixed = DataLoader(MmapDataset({str(out)!r}, fields=["input", "label"]), batch_size=3,
                               num_workers=2, multiprocessing_context="spawn", worker_init_fn=warnings_are_errors)
            labels = [int(x) for batch in fixed for x in batch["label"]]
            assert labels == list(range(6)), labels
            fixed_ds = MmapDataset({str(out)!r}, fields=["input", "label"])
            for dataset, collate_fn in [(PerItem(fixed_ds), None), (fixed_ds, collate)]:
                again = DataLoader(dataset, batch_size=3, num_workers=2, multiprocessing_context="spawn",
                                   worker_init_fn=warnings_are_errors, collate_fn=collate_fn)
                assert [int(x) for batch in again for x in batch["label"]] == labels
            with np.load({str(sources[5])!r}) as npz:
                assert np.array_equal(items[5]["tokens"], npz["tokens"])
            print("ok", len(items))
    """)
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok 6"
    assert without_resource_tracker(result.stderr) == [], result.stderr


def without_resource_tracker(stderr: str) -> list[str]:
    """stderr's lines less what multiprocessing's resource tracker printed: its warnings and,
    as it runs with ``-W error`` too, the tracebacks those warnings become (whole chains)."""
    return [line for chunk in _stderr_chunks(stderr.splitlines()) if not any(
        "resource_tracker" in line for line in chunk) for line in chunk]


def _stderr_chunks(lines: list[str]) -> list[list[str]]:
    """Lines grouped as printed: a traceback with the tracebacks chained to it, a warning with
    its source line, or one line."""
    chunks, i = [], 0
    while i < len(lines):
        end = i + 1
        if lines[i].startswith("Traceback (most recent call last):"):
            end = _end_of_traceback_chain(lines, i)
        elif end < len(lines) and lines[end].startswith("  ") and "Warning: " in lines[i]:
            end += 1
        chunks.append(lines[i:end])
        i = end
    return chunks


def _end_of_traceback_chain(lines: list[str], start: int) -> int:
    end = start + 1
    while end < len(lines):
        if lines[end].startswith((" ", "Traceback (most recent call last):")):
            end += 1
            continue
        end += 1  # the exception's own line; a chained traceback may follow
        after = end
        while after < len(lines) and not lines[after].strip():
            after += 1
        if after < len(lines) and lines[after].startswith(("During handling of", "The above exception")):
            end = after + 1
            continue
        break
    return end


def test_the_resource_tracker_filter_drops_its_chained_traceback_and_nothing_else() -> None:
    tracker = textwrap.dedent("""\
        Traceback (most recent call last):
          File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", line 240, in main
            _CLEANUP_FUNCS[rtype](name)
        FileNotFoundError: [Errno 2] No such file or directory: '/mp-x'

        During handling of the above exception, another exception occurred:

        Traceback (most recent call last):
          File "<string>", line 1, in <module>
          File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", line 242, in main
            warnings.warn('resource_tracker: %r: %s' % (name, e))
        UserWarning: resource_tracker: '/mp-x': [Errno 2] No such file or directory
        /usr/lib/python3.11/multiprocessing/resource_tracker.py:224: UserWarning: resource_tracker: leaked
          warnings.warn('resource_tracker: There appear to be %d '
        """)
    ours = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad\n'
    assert without_resource_tracker(tracker) == []
    assert without_resource_tracker(tracker + ours + "x.py:1: UserWarning: w\n  warn()\n") == [
        *ours.splitlines(), "x.py:1: UserWarning: w", "  warn()"]


def test_a_dataset_replaced_after_opening_is_not_mixed_with_the_old_index(tmp_path, small_dataset) -> None:
    out, _ = small_dataset
    ds = MmapDataset(out)
    write_samples(tmp_path / "new", [{"input": np.zeros((3, 4, 5), np.float32)}] * 6)
    convert([tmp_path / "new"], out, overwrite=True, workers=1)
    with pytest.raises(
        FormatError, match=r"or the dataset was replaced after it was opened\); open it again"
    ):
        ds[0]
    assert MmapDataset(out).fields == ("input",)


def test_an_open_reader_keeps_seeing_the_old_dataset_after_overwrite(tmp_path, small_dataset) -> None:
    out, sources = small_dataset
    ds = MmapDataset(out)
    before = ds[2]
    write_samples(tmp_path / "new", [{"input": np.zeros((3, 4, 5), np.float32)}] * 6)
    convert([tmp_path / "new"], out, overwrite=True, workers=1)
    after = ds[2]
    for key in before:
        assert_same_array(after[key], before[key])


def test_tensors_option_and_field_projection(small_dataset, monkeypatch) -> None:
    out, sources = small_dataset
    ds = MmapDataset(out, fields=["input", "label"], tensors=True)
    sample = ds[3]
    assert isinstance(sample["input"], torch.Tensor) and sample["label"].item() == 3
    assert torch.equal(sample["input"], torch.from_numpy(load_source(sources[3], "input")))
    read = []
    real_view = ds.reader.readers[0].view

    def recording_view(name, i):
        read.append(name)
        return real_view(name, i)

    only_label = MmapDataset(out, fields="label")
    monkeypatch.setattr(only_label.reader.readers[0], "view", recording_view)
    assert [int(only_label[i]) for i in range(6)] == list(range(6))
    assert set(read) == {"label"}


@pytest.mark.parametrize("fields", [None, "input", "label"])
@pytest.mark.parametrize("workers", [0, 1])
def test_tensors_option_reaches_a_collate_fn_as_ds_i_gives_it(small_dataset, fields, workers) -> None:
    """DataLoader gathers through __getitems__; with tensors=True its samples are ds[i]'s tensors."""
    out, _ = small_dataset
    ds = MmapDataset(out, fields=fields, tensors=True)
    seen = [sample for batch in DataLoader(ds, 3, collate_fn=list, num_workers=workers) for sample in batch]
    assert len(seen) == len(ds)
    for i, got in enumerate(seen):
        expected = ds[i]
        pairs = [(got, expected)] if fields else [(got[k], expected[k]) for k in expected]
        for value, want in pairs:
            assert type(value) is type(want) is torch.Tensor
            assert torch.equal(value, want)


def test_a_replaced_dataset_is_refused_even_when_its_blob_reuses_the_inode(tmp_path, small_dataset) -> None:
    """Replaced twice, the blob may come back with the old inode number; its identity does not."""
    out, _ = small_dataset
    ds = MmapDataset(out, fields="label")
    for value in (1, 2):
        write_samples(tmp_path / f"v{value}", [{"label": np.int64(value)}] * 6)
        convert([tmp_path / f"v{value}"], out, overwrite=True, workers=1)
    with pytest.raises(FormatError, match="does not belong to the index read"):
        ds[0]


@pytest.fixture(params=["one part", "two parts"])
def labelled(request, small_dataset, tmp_path) -> MmapDataset:
    """The six labels 0..5, read from one dataset or from two parts of it through a manifest."""
    out, _ = small_dataset
    if request.param == "two parts":
        for k in range(2):
            convert([tmp_path / "src"], tmp_path / "parts", part=(k, 2), workers=1)
        merge(sorted((tmp_path / "parts").iterdir()), tmp_path / "parts")
        out = tmp_path / "parts"
    return MmapDataset(out, fields="label")


@pytest.mark.parametrize("index", [2, -4, np.int64(2), np.uint8(2), np.int32(-4), np.array(2)])
def test_integer_indices_of_every_kind_read_the_same_sample(labelled, index) -> None:
    assert int(labelled[index]) == 2
    assert labelled.__getitems__([index, 5]).arrays["label"].tolist() == [2, 5]


@pytest.mark.parametrize(
    ("index", "kind"),
    [
        (2.7, "float"),
        (np.float64(2.0), "float64"),
        ("1", "str"),
        (None, "NoneType"),
        (True, "bool"),
        (np.bool_(False), "bool"),
    ],
)
def test_an_index_that_is_not_an_integer_is_refused_naming_it(labelled, index, kind) -> None:
    """ds[2.7] used to read sample 2 of a multi-part dataset; bools would be masks to numpy."""
    message = f"sample index {index!r} is a {kind}, not an integer"
    with pytest.raises(TypeError, match=re.escape(message)):
        labelled[index]
    with pytest.raises(TypeError, match=re.escape(message)):
        labelled.__getitems__([0, index])
    with pytest.raises(TypeError, match=re.escape(message)):
        MmapDataset(labelled.path, fields="label", transform=lambda x: x).__getitems__([0, index])


@pytest.mark.parametrize(
    "index",
    [torch.tensor([2]), torch.tensor([[2]]), np.array([2]), np.array([[2]])],
    ids=["tensor-1d", "tensor-2d", "array-1d", "array-2d"],
)
def test_an_index_of_one_element_but_with_axes_is_refused(labelled, index) -> None:
    """A one-element tensor of any shape has __index__; as an index it has axes, as numpy says."""
    with pytest.raises(TypeError, match=rf"^sample index .* is an array of {index.ndim} dimensions, not an integer$"):
        labelled[index]
    assert int(labelled[torch.tensor(2)]) == int(labelled[np.int64(2)]) == 2  # 0-d ones are integers


@pytest.mark.parametrize(
    ("indices", "dtype"),
    [
        (np.array([0.9, 1.9]), "float64"),
        (np.array([True, False]), "bool"),
        (np.array(["1"]), "<U1"),
        (np.array([1, 2], dtype=object), "object"),
        (np.array([], dtype=np.float32), "float32"),
    ],
)
def test_index_arrays_must_have_an_integer_dtype(labelled, indices, dtype) -> None:
    with pytest.raises(
        TypeError, match=re.escape(f"sample indices must be integers, not an array of {dtype}")
    ):
        labelled.__getitems__(indices)
    with pytest.raises(TypeError, match=re.escape(f"not an array of {dtype}")):
        labelled.reader.gather("label", indices)


@pytest.mark.parametrize("indices", [[0.9, 1.9], [1, 2.0], [np.float32(1)], [0, [1]]])
def test_lists_holding_a_non_integer_are_refused(labelled, indices) -> None:
    """numpy would truncate [0.9, 1.9] to samples 0 and 1."""
    with pytest.raises(TypeError, match="sample index .* is a .*, not an integer"):
        labelled.__getitems__(indices)


@pytest.mark.parametrize("index", [6, -7, 2**63, -(2**63) - 1, 2**64, -(2**64), 10**100])
def test_huge_indices_are_out_of_range_never_an_overflow(labelled, index) -> None:
    message = f"sample index {index} is out of range for 6 samples"
    with pytest.raises(IndexError, match=re.escape(message)):
        labelled[index]
    with pytest.raises(IndexError, match=re.escape(message)):
        labelled.__getitems__([0, index])
    with pytest.raises(IndexError, match=re.escape(message)):
        labelled.__getitems__([index, -1])  # a list numpy would turn into float64


def test_unsigned_index_arrays_are_checked_before_conversion(labelled) -> None:
    """2**63 as uint64 must not wrap to a negative index that counts from the end."""
    with pytest.raises(IndexError, match=re.escape("sample index 9223372036854775808 is out of range")):
        labelled.__getitems__(np.array([1, 2**63], dtype=np.uint64))
    assert labelled.__getitems__(np.array([5, 0], dtype=np.uint64)).arrays["label"].tolist() == [5, 0]
    assert labelled.__getitems__(np.array([1, -1], dtype=np.int8)).arrays["label"].tolist() == [1, 5]


@pytest.mark.parametrize("empty", [[], (), np.array([], dtype=np.int64), range(0)])
def test_an_empty_batch_of_indices_is_fine(labelled, empty) -> None:
    assert len(labelled.__getitems__(empty)) == 0
    assert labelled.reader.gather("label", empty).shape == (0,)


def test_threads_opening_the_dataset_at_once_share_one_mapping(small_dataset, monkeypatch) -> None:
    """MmapLoader's prefetch thread and the training loop may both touch ds.reader first.

    While the main thread maps the blob, another thread asks for the reader;
    it must wait for that mapping instead of making its own.
    """
    out, _ = small_dataset
    ds = MmapDataset(out)
    constructed: list[str] = []
    others: list[threading.Thread] = []
    seen_by_other: list[object] = []
    real_reader = npz2mmap.read.parts.DatasetReader

    def counting_reader(path, *args, **kwargs):
        constructed.append(str(path))
        if len(constructed) == 1:  # the first mapping is under way: another thread asks meanwhile
            others.append(threading.Thread(target=lambda: seen_by_other.append(ds.reader)))
            others[0].start()
            others[0].join(timeout=1)  # it waits for us, when opening is locked
        return real_reader(path, *args, **kwargs)

    monkeypatch.setattr(npz2mmap.read.parts, "DatasetReader", counting_reader)
    reader = ds.reader
    others[0].join()
    assert seen_by_other == [reader] and seen_by_other[0] is reader
    assert constructed == [str(out)]
    assert ds.reader is reader and int(ds[4]["label"]) == 4


def _exit_with_label_two(ds: MmapDataset) -> None:
    sys.exit(0 if int(ds[2]["label"]) == 2 else 1)


def test_a_process_forked_while_the_dataset_is_being_opened_opens_it_too(small_dataset) -> None:
    """The lock was copied held by a thread the child does not have: the child needs its own."""
    out, _ = small_dataset
    ds = MmapDataset(out)
    with ds._opening_lock(os.getpid()):  # as if another thread were opening it at the fork
        child = multiprocessing.get_context("fork").Process(target=_exit_with_label_two, args=(ds,))
        child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0


@settings(max_examples=400, deadline=None)
@given(
    dtype=st.sampled_from(["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"]),
    n=st.one_of(st.integers(1, 300), st.integers(1, 2**40)),
    data=st.data(),
)
def test_index_arrays_of_every_width_normalise_as_each_index_alone(dtype, n, data) -> None:
    """A batch of indices against normalise_index, one Python int at a time, as the oracle:
    negative int8 indices with 300 samples too (read as unsigned, -1 is 255)."""
    info = np.iinfo(dtype)
    values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1, max_size=6))
    indices = np.array(values, dtype=dtype)
    try:
        expected = [normalise_index(v, n) for v in values]
    except IndexError as exc:
        with pytest.raises(IndexError, match=re.escape(str(exc))):
            normalise_indices(indices, n)
        return
    assert normalise_indices(indices, n).tolist() == expected


@pytest.mark.parametrize("fields", [b"label", [b"label"], [1], ["label", None], 3, 2.5])
def test_fields_that_are_not_names_are_a_type_error_naming_them(small_dataset, fields) -> None:
    """bytes iterate as numbers ("no field 120" was the message): fields are named by str only."""
    out, _ = small_dataset
    with pytest.raises(TypeError, match=r"^fields names fields by str \(one, or a list of them\), not "):
        MmapDataset(out, fields=fields)


def test_fields_given_as_a_set_are_refused_as_parts_are(small_dataset) -> None:
    """A set's order, the order of a sample's keys with it, changes from run to run."""
    out, _ = small_dataset
    message = "fields is a set, whose order changes from run to run: give a list (or a tuple)"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        MmapDataset(out, fields={"label"})


def test_the_loader_writer_and_dataset_show_what_they_are_and_the_dataset_its_schema(tmp_path) -> None:
    from npz2mmap import MmapLoader, PaddedCollate, ShuffleSampler, Writer

    out = str(tmp_path / "ds")
    writer = Writer(out)
    assert repr(writer) == f"Writer({out!r}, samples=0, open)"
    for k in range(3):
        writer.append({"x": np.zeros(2, np.float32), "tokens": np.arange(k + 1)})
    assert repr(writer) == f"Writer({out!r}, samples=3, open)"
    writer.close()
    assert repr(writer) == f"Writer({out!r}, samples=3, written)"
    ds = MmapDataset(out, fields=["x"])
    assert repr(ds) == f"MmapDataset({out!r}, samples=3, fields=['x'])"
    assert {name: (f.dtype, f.shape) for name, f in ds.features.items()} == {"x": (np.dtype(np.float32), (2,))}
    assert MmapDataset(out).features["tokens"].ragged
    assert repr(MmapLoader(ds, 4, shuffle=True, seed=3)) == (
        f"MmapLoader({ds!r}, batch_size=4, shuffle=True, seed=3, num_workers=0)"
    )
    loader = MmapLoader(ds, 4, sampler=ShuffleSampler(ds), collate_fn=PaddedCollate(), num_workers=2)
    assert repr(loader) == (
        f"MmapLoader({ds!r}, batch_size=4, sampler=ShuffleSampler, num_workers=2, collate_fn=PaddedCollate)"
    )


def test_parts_given_as_a_set_are_refused_as_their_order_would_change_from_run_to_run(tmp_path) -> None:
    """MmapDataset({a, b}) read its parts, and merge wrote them, in the order of their hashes."""
    parts = []
    for k in range(2):
        write_samples(tmp_path / f"src{k}", [{"x": np.full(2, k)}])
        parts.append(convert([tmp_path / f"src{k}"], tmp_path / f"p{k}", workers=1).out_dir)
    message = (
        r"^the parts are a set, whose order changes from run to run, and the samples' order with it: "
        r"give a list, in the order the parts are read$"
    )
    with pytest.raises(TypeError, match=message):
        MmapDataset(set(parts))
    with pytest.raises(TypeError, match=message):
        merge(set(parts), tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    assert [int(s["x"][0]) for s in MmapDataset(parts)] == [0, 1]
    # A generator was used up by the check of each part, then merged as no part at all; one path
    # was taken as a list of its characters.
    merge((p for p in parts), tmp_path / "generated", copy=True)
    assert [int(s["x"][0]) for s in MmapDataset(tmp_path / "generated")] == [0, 1]
    merge(parts[1], tmp_path / "one", copy=True)
    assert [int(s["x"][0]) for s in MmapDataset(tmp_path / "one")] == [1]


def test_merge_refuses_parts_and_options_of_another_type_with_a_message_naming_them(tmp_path) -> None:
    """bytes parts gave "'int' object is not iterable", and copy='no' merged by copying."""
    write_samples(tmp_path / "src", [{"x": np.zeros(2)}])
    part = convert([tmp_path / "src"], tmp_path / "p0", workers=1).out_dir
    for parts, message in [
        ([str(part).encode()], "parts must be a path or a list of paths (str or os.PathLike), not [b'"),
        (None, "parts must be a path or a list of paths (str or os.PathLike), not None"),
    ]:
        with pytest.raises(TypeError) as caught:
            merge(parts, tmp_path / "merged")
        assert str(caught.value).startswith(message)
    with pytest.raises(TypeError, match=r"^copy must be True or False, not 'no'$"):
        merge([part], tmp_path / "merged", copy="no")
    assert not (tmp_path / "merged").exists()
    merge({str(part): 0}.keys(), tmp_path / "merged")  # a dict's keys keep their order
    assert len(MmapDataset(tmp_path / "merged")) == 1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda ds: MmapLoader(ds, 2, shuffle="false"), "shuffle must be True or False, not 'false'"),
        (lambda ds: MmapLoader(ds, 2, drop_last=1), "drop_last must be True or False, not 1"),
        (lambda ds: MmapLoader(ds, 2, num_workers=1, slot_nbytes=1000.5), "slot_nbytes must be an integer, not 1000.5"),
        (lambda ds: MmapDataset(ds.path, tensors="no"), "tensors must be True or False, not 'no'"),
        (lambda ds: PaddedCollate(mask="false"), "mask must be True or False, not 'false'"),
    ],
)
def test_a_switch_given_a_string_is_a_type_error_not_taken_as_true(small_dataset, make, message) -> None:
    """shuffle='false' shuffled, and PaddedCollate(mask='false') added masks: any string is true."""
    out, _ = small_dataset
    with pytest.raises(TypeError) as caught:
        make(MmapDataset(out))
    assert str(caught.value) == message


def test_merge_takes_progress_as_convert_does(tmp_path) -> None:
    """merge(copy=True, progress='bar') raised AttributeError, and without copy any value passed."""
    parts = [convert([write_samples(tmp_path / "src", [{"x": np.zeros(2)}])[0]], tmp_path / "p", part=(k, 2),
                     workers=1).out_dir for k in range(2)]
    for k, mode in enumerate(["log", "none", None]):
        merge(parts, tmp_path / f"m{k}", copy=True, progress=mode)
        assert (tmp_path / f"m{k}" / "data.npy").read_bytes() == (tmp_path / "m0" / "data.npy").read_bytes()
    for copy in (True, False):
        with pytest.raises(TypeError, match=r"^progress must be None, one of 'auto', 'bar', 'log', 'none'"):
            merge(parts, tmp_path / f"bad{copy}", copy=copy, progress="xyz")
        assert not (tmp_path / f"bad{copy}").exists()
