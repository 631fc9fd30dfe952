"""A worker's batch keeps what its collate_fn made: identity, memory shared between leaves, strides.

The oracle is the same loader without workers: its batch is the collate_fn's
own objects. Each leaf is compared with its counterpart by type, dtype,
shape, strides and raw bytes; ``is`` between every pair of leaves; and an
in-place change of each leaf in turn, applied to both batches, must leave
both trees equal (or fail the same way in both).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npz2mmap
from npz2mmap import MmapDataset, MmapLoader
from npz2mmap.pytorch import slots

NUM_SAMPLES = 8
BATCH_SIZE = 4
RECORD = np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"]}, align=True)  # 7 padding bytes


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("aliasing") / "d.mmap"
    rng = np.random.default_rng(20)
    with npz2mmap.Writer(path) as writer:
        for i in range(NUM_SAMPLES):
            writer.append({"x": rng.standard_normal(4).astype(np.float32), "lab": np.int64(i)})
    return path


def piece_makers(samples: Any) -> dict[str, Any]:
    """Ways a collate_fn makes leaves from one stacked batch: views, copies, arrays over a tensor's memory."""
    x = torch.stack([torch.from_numpy(np.array(s["x"])) for s in samples])  # (B, 4) float32
    lab = np.array([int(s["lab"]) for s in samples], dtype=np.int64)
    records = np.zeros(len(lab), RECORD)
    records.view(np.uint8).reshape(len(lab), -1)[:, 1:8] = 0xAB  # padding bytes that must survive
    records["a"], records["b"] = lab, lab / 2
    batch = len(lab)
    return {
        "same": lambda: x,
        "view": lambda: x[:, 1:3],
        "offset": lambda: x.flatten()[3:11],
        "transposed": lambda: x.t(),
        "numpy": lambda: x.numpy(),
        "numpy_strided": lambda: x.numpy()[:, ::2],
        "fortran": lambda: np.asfortranarray(x.numpy() * 2),
        "labels": lambda: lab,
        "reversed": lambda: lab[::-1],
        "expand": lambda: x[:1].expand(batch, 4),
        "broadcast": lambda: np.broadcast_to(lab, (2, batch)),
        "channels_last": lambda: x.reshape(batch, 2, 1, 2).contiguous(memory_format=torch.channels_last),
        "zero_size": lambda: x[:0],
        "empty_array": lambda: lab[:0],
        "records": lambda: records,
        "record_field": lambda: records["b"],
        "bytes": lambda: x.view(torch.uint8).flatten()[1:9],
        "floats_after_bytes": lambda: x.flatten()[1:],
        "strings": lambda: np.array([f"s{v}" for v in lab]),
        "with_attributes": lambda: with_attributes(x * 3, meta={"scale": 3}, step=len(lab)),
        "attribute_view": lambda: with_attributes(x[:, ::2], base=x, labels=lab[::-1]),
        "ordered_dict": lambda: collections.OrderedDict(a=x[:, 1:3], b=lab),
        "defaultdict": lambda: collections.defaultdict(list, {"x": x.t(), "n": x.numpy()}),
        "dataclass": lambda: Pair(x[1:], lab[::-1]),
        "list_subclass": lambda: Rows([x[0], x[1], lab]),
        "tensor_subclass": lambda: x.as_subclass(Tagged)[:, 1:],
        "masked": lambda: np.ma.MaskedArray(x.numpy(), mask=x.numpy() > 0),
        "matrix": lambda: x.numpy()[:, :2].view(np.matrix),
        "recarray": lambda: records.view(np.recarray),
    }


@dataclasses.dataclass
class Pair:
    """A dataclass a collate_fn may return, holding views."""

    first: Any
    second: Any


class Rows(list):
    """A list subclass."""


class Tagged(torch.Tensor):
    """A tensor subclass."""


def with_attributes(tensor: torch.Tensor, **attributes: Any) -> torch.Tensor:
    """A tensor carrying Python attributes, as a collate_fn may set them (``t.meta = ...``)."""
    for name, value in attributes.items():
        setattr(tensor, name, value)
    return tensor


PIECES = list(piece_makers([{"x": np.zeros(4, np.float32), "lab": np.int64(0)}]))


class Pieces:
    """A collate_fn whose batch holds the named pieces (a name repeated is the same object again)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __call__(self, samples: Any) -> dict[str, Any]:
        makers = piece_makers(samples)
        made: dict[str, Any] = {}

        def piece(name: str) -> Any:
            if name not in made:
                made[name] = makers[name]()
            return made[name]

        tree: dict[str, Any] = {f"{k}_{name}": piece(name) for k, name in enumerate(self.names)}
        tree["nested"] = [piece(self.names[0]), (piece(self.names[-1]), "note")]
        return tree


def leaves(tree: Any) -> list[Any]:
    """Tensors and arrays of a tree, in order: in any mapping, sequence, dataclass or tensor attribute
    (a masked array's data and mask both)."""
    if isinstance(tree, np.ma.MaskedArray):
        return [tree, tree.mask] if tree.mask is not np.ma.nomask else [tree]
    if isinstance(tree, torch.Tensor):
        return [tree, *leaves(list(tree.__dict__.values()))]
    if isinstance(tree, np.ndarray):
        return [tree]
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in leaves(value)]
    if dataclasses.is_dataclass(tree):
        return leaves([getattr(tree, field.name) for field in dataclasses.fields(tree)])
    return []


def container_types(tree: Any) -> list[Any]:
    """The type of every container in a tree, in order, and a defaultdict's factory."""
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        return []
    if isinstance(tree, dict):
        factory = [tree.default_factory] if isinstance(tree, collections.defaultdict) else []
        return [type(tree), *factory, *(t for value in tree.values() for t in container_types(value))]
    if isinstance(tree, (list, tuple)):
        return [type(tree), *(t for value in tree for t in container_types(value))]
    if dataclasses.is_dataclass(tree):
        return [type(tree), *container_types(dataclasses.astuple(tree))]
    return []


def raw_bytes(leaf: Any) -> bytes:
    array = leaf.numpy() if isinstance(leaf, torch.Tensor) else leaf
    return np.asarray(array).view(np.dtype((np.void, array.dtype.itemsize))).tobytes()


def layout(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, torch.Tensor):
        attributes = {k: v for k, v in leaf.__dict__.items() if not isinstance(v, (torch.Tensor, np.ndarray))}
        return (type(leaf), leaf.dtype, tuple(leaf.shape), leaf.stride(), sorted(leaf.__dict__), attributes)
    return (type(leaf), leaf.dtype, leaf.shape, leaf.strides, leaf.flags.writeable)


def change(leaf: Any) -> str:
    """An in-place step on one leaf; the name of the error when the leaf refuses it."""
    try:
        if isinstance(leaf, torch.Tensor):
            leaf.add_(1)
        elif leaf.dtype.names:
            leaf["a"] += 1
        elif leaf.dtype.kind in "iuf":
            leaf += 1
    except (RuntimeError, ValueError) as exc:
        return type(exc).__name__
    return "changed"


def assert_same_batch(got: Any, expected: Any) -> None:
    assert container_types(got) == container_types(expected)
    got_leaves, expected_leaves = leaves(got), leaves(expected)
    assert [layout(leaf) for leaf in got_leaves] == [layout(leaf) for leaf in expected_leaves]
    assert [raw_bytes(leaf) for leaf in got_leaves] == [raw_bytes(leaf) for leaf in expected_leaves]
    identity = [[a is b for b in expected_leaves] for a in expected_leaves]
    assert [[a is b for b in got_leaves] for a in got_leaves] == identity
    for k in range(len(expected_leaves)):  # sharing: every change shows where it showed without workers
        assert change(got_leaves[k]) == change(expected_leaves[k])
        assert [raw_bytes(leaf) for leaf in got_leaves] == [raw_bytes(leaf) for leaf in expected_leaves]


# A slot too small for any batch: each goes through the pipe instead, and must come the same.
TINY_SLOT = 64


def check_loader(
    dataset_path: Path,
    collate_fn: Any,
    num_workers: int,
    context: str = "fork",
    slot_nbytes: int | None = None,
) -> None:
    ds = MmapDataset(dataset_path)
    expected = list(MmapLoader(ds, BATCH_SIZE, collate_fn=collate_fn, prefetch=0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "MmapLoader: batch .* more than a ring slot's", RuntimeWarning)
        with MmapLoader(
            ds,
            BATCH_SIZE,
            collate_fn=collate_fn,
            num_workers=num_workers,
            multiprocessing_context=context,
            slot_nbytes=slot_nbytes,
        ) as loader:
            count = 0
            for got, want in zip(loader, expected, strict=True):
                assert_same_batch(got, want)
                count += 1
    assert count == NUM_SAMPLES // BATCH_SIZE


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    names=st.lists(st.sampled_from(PIECES), min_size=1, max_size=6),
    num_workers=st.sampled_from([1, 2]),
    slot_nbytes=st.sampled_from([None, TINY_SLOT]),
)
def test_batches_of_views_copies_and_aliases_come_as_without_workers(
    dataset_path, names, num_workers, slot_nbytes
) -> None:
    check_loader(dataset_path, Pieces(names), num_workers, slot_nbytes=slot_nbytes)


@pytest.mark.parametrize("slot_nbytes", [None, TINY_SLOT], ids=["in-slot", "larger-than-slot"])
def test_every_piece_at_once_comes_as_without_workers(dataset_path, slot_nbytes) -> None:
    check_loader(dataset_path, Pieces(PIECES + PIECES[::-1]), 2, slot_nbytes=slot_nbytes)


def alias_collate(samples: Any) -> dict[str, Any]:
    x = torch.stack([torch.from_numpy(np.array(s["x"])) for s in samples])
    return {"a": x, "b": x, "v": x[:, :2], "n": x.numpy()}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_tensor_twice_its_view_and_its_numpy_array_share_memory_as_without_workers(
    dataset_path, context
) -> None:
    ds = MmapDataset(dataset_path, fields=["x"])
    expected = MmapLoader(ds, BATCH_SIZE, collate_fn=alias_collate, prefetch=0).load(np.arange(BATCH_SIZE))
    first = expected["a"][0, 0].item()
    with MmapLoader(
        ds, BATCH_SIZE, collate_fn=alias_collate, num_workers=1, multiprocessing_context=context
    ) as loader:
        batch = next(iter(loader))
        batch["a"].add_(100)
        assert batch["a"] is batch["b"]
        assert batch["b"][0, 0].item() == batch["v"][0, 0].item() == batch["n"][0, 0] == first + 100
        assert batch["v"].stride() == (4, 1) and batch["n"].strides == (16, 4)
        # One storage of just the region's bytes: torch.save keeps the sharing, and writes no more.
        assert batch["v"].untyped_storage().data_ptr() == batch["a"].untyped_storage().data_ptr()
        assert batch["a"].untyped_storage().nbytes() == batch["a"].nbytes
        buffer = io.BytesIO()
        torch.save({"a": batch["a"], "v": batch["v"]}, buffer)
        buffer.seek(0)
        restored = torch.load(buffer)
        restored["a"].add_(1)
        assert torch.equal(restored["v"], restored["a"][:, :2])
        assert restored["a"].untyped_storage().nbytes() == batch["a"].nbytes
        assert pickle.loads(pickle.dumps(batch["v"])).untyped_storage().nbytes() == batch["a"].nbytes


def layout_collate(samples: Any) -> dict[str, Any]:
    x = torch.stack([torch.from_numpy(np.array(s["x"])) for s in samples])
    lab = np.array([int(s["lab"]) for s in samples])
    return {
        "fortran": np.asfortranarray(x.numpy()),
        "reversed": lab[::-1],
        "channels_last": torch.ones(2, 3, 4, 5)
        .add(float(lab[0]))
        .contiguous(memory_format=torch.channels_last),
        "expand": x[:1].expand(8, 4),
        "offset": x.flatten()[3:11],
    }


def test_fortran_reversed_channels_last_and_expanded_leaves_keep_their_strides(dataset_path) -> None:
    ds = MmapDataset(dataset_path)
    expected = MmapLoader(ds, BATCH_SIZE, collate_fn=layout_collate, prefetch=0).load(np.arange(BATCH_SIZE))
    with MmapLoader(ds, BATCH_SIZE, collate_fn=layout_collate, num_workers=1) as loader:
        batch = next(iter(loader))
        assert batch["fortran"].flags.f_contiguous and batch["fortran"].strides == expected["fortran"].strides
        assert (
            batch["reversed"].strides == (-8,) and batch["reversed"].tolist() == expected["reversed"].tolist()
        )
        assert batch["channels_last"].is_contiguous(memory_format=torch.channels_last)
        assert batch["expand"].stride() == (0, 1) and batch["offset"].storage_offset() == 3
        assert_same_batch(batch, expected)


@pytest.mark.parametrize(
    "names",
    [
        ["bytes", "floats_after_bytes"],  # the floats lie 3 bytes into their region: a storage of their own
        ["records", "record_field", "reversed", "labels"],
        ["expand", "view", "zero_size", "empty_array", "broadcast"],
    ],
    ids=["misaligned", "records", "zero-strides"],
)
@pytest.mark.parametrize("slot_nbytes", [None, TINY_SLOT], ids=["in-slot", "larger-than-slot"])
def test_named_combinations_come_as_without_workers(dataset_path, names, slot_nbytes) -> None:
    check_loader(dataset_path, Pieces(names), 1, slot_nbytes=slot_nbytes)


def ring_mappings() -> set[str]:
    """The address ranges of this process's rings (unlinked pym-PID-* files; Linux)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("reads /proc/self/maps")
    marker = f"/pym-{os.getpid()}-"
    return {line.split()[0] for line in maps.read_text().splitlines() if marker in line}


def test_a_kept_batch_of_aliases_outlives_its_loader_and_holds_the_ring_until_dropped(dataset_path) -> None:
    ds = MmapDataset(dataset_path)
    collate_fn = Pieces(PIECES)
    expected = MmapLoader(ds, BATCH_SIZE, collate_fn=collate_fn, prefetch=0).load(np.arange(BATCH_SIZE))
    before = ring_mappings()
    with MmapLoader(ds, BATCH_SIZE, collate_fn=collate_fn, num_workers=1) as loader:
        kept = next(iter(loader))
    other = MmapLoader(ds, BATCH_SIZE, collate_fn=collate_fn, num_workers=1, shuffle=True, seed=1)
    assert sum(1 for _ in other) == NUM_SAMPLES // BATCH_SIZE  # its batches are dropped as they come
    del other
    gc.collect()
    assert len(ring_mappings() - before) == 1
    assert_same_batch(kept, expected)
    del kept
    gc.collect()
    assert ring_mappings() - before == set()


def derive(value: Any, data: st.DataObject) -> Any:
    """A new leaf made from ``value`` as user code might: a slice, a transpose, a cross-library view, a copy."""
    is_tensor = isinstance(value, torch.Tensor)
    op = data.draw(st.sampled_from(["slice", "transpose", "cross", "copy"]))
    if op == "slice" and value.ndim:
        axis = data.draw(st.integers(0, value.ndim - 1))
        steps = st.integers(1, 3) if is_tensor else st.sampled_from([-3, -2, -1, 1, 2, 3])
        index: list[Any] = [slice(None)] * value.ndim
        index[axis] = slice(data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6)), data.draw(steps))
        if is_tensor and index[axis].start > index[axis].stop:  # torch refuses an empty backwards slice
            index[axis] = slice(0, 0)
        return value[tuple(index)]
    if op == "transpose":
        return value.permute(*reversed(range(value.ndim))) if is_tensor else value.T
    if op == "cross":
        if is_tensor:
            return value.numpy()
        if min(value.strides, default=0) >= 0:
            return torch.from_numpy(value)
    return value.clone() if is_tensor else np.asfortranarray(value.copy())


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    dtype=st.sampled_from([np.int64, np.float32, np.uint8, np.int16]),
    start_as_tensor=st.booleans(),
    data=st.data(),
)
def test_any_views_of_one_buffer_rebuilt_from_a_slot_share_and_lay_out_as_the_originals(
    shape, dtype, start_as_tensor, data
) -> None:
    """In one process, no workers: SlotWriter.write, the pickled descriptor, materialise."""
    base = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    made: list[Any] = [torch.from_numpy(base) if start_as_tensor else base]
    for _ in range(data.draw(st.integers(1, 6))):
        made.append(derive(made[data.draw(st.integers(0, len(made) - 1))], data))
    tree = {
        "leaves": [
            made[data.draw(st.integers(0, len(made) - 1))] for _ in range(data.draw(st.integers(1, 8)))
        ]
    }
    slot_ring = slots.Ring.allocate(2, 1 << 16)
    descriptor = slots.SlotWriter(slot_ring, 1).write(tree)
    rebuilt = slot_ring.materialise(1, pickle.loads(pickle.dumps(descriptor)))
    assert_same_batch(rebuilt, tree)
