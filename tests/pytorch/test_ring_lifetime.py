"""What a worker loader hands out lives on its own: kept batches stay intact, every batch is a new object."""

from __future__ import annotations

import gc
import multiprocessing.heap
import os
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_samples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npz2mmap import MmapDataset, MmapLoader
from npz2mmap.write.conversion import convert

NUM_SAMPLES = 24
BATCH_SIZE = 8
TINY_SLOT_NBYTES = 1024  # the batch (384 + 64 bytes) fits, with little to spare


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory) -> Path:
    """24 samples: a float input and the sample's own index as label."""
    root = tmp_path_factory.mktemp("lifetime")
    rng = np.random.default_rng(3)
    samples = [
        {"input": rng.standard_normal((3, 4)).astype(np.float32), "label": np.int64(i)}
        for i in range(NUM_SAMPLES)
    ]
    write_samples(root / "src", samples)
    convert([root / "src"], root / "dataset", workers=1)
    return root / "dataset"


def copied(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in batch.items()}


class LeftTheLoop(Exception):
    pass


def keep_a_batch(ds: MmapDataset, ending: str, stop_at: int, **options: Any) -> tuple[Any, Any]:
    """Iterate a worker loader, keep batch ``stop_at`` (and a copy taken then), end the loader by ``ending``."""
    kept: list[Any] = []

    def run(loader: MmapLoader) -> None:
        for number, batch in enumerate(loader):
            kept[:] = [batch, copied(batch)]
            if number == stop_at:
                if ending == "raise":
                    raise LeftTheLoop
                break

    options = {"num_workers": 1, "multiprocessing_context": "fork", **options}
    if ending == "with":
        with MmapLoader(ds, BATCH_SIZE, **options) as loader:
            run(loader)
    elif ending == "close":
        loader = MmapLoader(ds, BATCH_SIZE, **options)
        run(loader)
        loader.close()
    elif ending == "del":
        loader = MmapLoader(ds, BATCH_SIZE, **options)
        run(loader)
        del loader
        gc.collect()
    else:
        try:
            run(MmapLoader(ds, BATCH_SIZE, **options))
        except LeftTheLoop:
            pass
        gc.collect()
    return kept[0], kept[1]


def use_the_heap_and_another_ring(ds: MmapDataset) -> list[Any]:
    """What may take freed shared memory: multiprocessing's heap, filled, and another loader's ring."""
    blocks = []
    for nbytes in (1024, 1 << 20, 3 << 20):
        block = multiprocessing.heap.BufferWrapper(nbytes)
        memory = block.create_memoryview()
        memory[:] = b"\xff" * nbytes
        blocks.append(block)
    with MmapLoader(ds, BATCH_SIZE, num_workers=1, shuffle=True, seed=1) as other:
        for _ in other:
            pass
    return blocks


def assert_intact(kept: list[tuple[Any, Any]]) -> None:
    for batch, copy in kept:
        for key in copy:
            assert torch.equal(batch[key], copy[key]), (key, batch[key], copy[key])


def test_a_kept_batch_is_not_overwritten_by_the_next_loader(dataset_path) -> None:
    ds = MmapDataset(dataset_path)
    with MmapLoader(ds, BATCH_SIZE, num_workers=1) as loader:
        for batch in loader:
            kept = batch
            break
    for _ in MmapLoader(ds, BATCH_SIZE, num_workers=1, shuffle=True, seed=1):
        pass
    assert kept["label"].tolist() == list(range(BATCH_SIZE))


ENDINGS = ["close", "with", "del", "raise"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    loaders=st.lists(
        st.tuples(
            st.sampled_from([1, 2]),
            st.sampled_from([TINY_SLOT_NBYTES, None]),
            st.sampled_from(ENDINGS),
            st.integers(0, NUM_SAMPLES // BATCH_SIZE - 1),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_batches_kept_past_their_loaders_end_stay_as_yielded(dataset_path, loaders) -> None:
    """However a loader ends, the batch in hand then keeps its values while others use shared memory."""
    ds = MmapDataset(dataset_path)
    kept = []
    for num_workers, slot_nbytes, ending, stop_at in loaders:
        kept.append(keep_a_batch(ds, ending, stop_at, num_workers=num_workers, slot_nbytes=slot_nbytes))
        assert_intact(kept)
    blocks = use_the_heap_and_another_ring(ds)
    assert_intact(kept)
    del blocks


def test_the_ring_is_unmapped_with_the_last_tensor_viewing_it(dataset_path) -> None:
    """Kept batches hold the ring's memory, and only they: dropping them frees it."""
    ds = MmapDataset(dataset_path)
    before = ring_mappings()
    batch, _ = keep_a_batch(ds, "close", 0)
    assert len(ring_mappings() - before) == 1
    del batch
    gc.collect()
    assert ring_mappings() - before == set()


def ring_mappings() -> set[str]:
    """The address ranges of this process's rings (unlinked pym-PID-* files; Linux)."""
    path = Path("/proc/self/maps")
    if not path.exists():
        pytest.skip("reads /proc/self/maps")
    marker = f"/pym-{os.getpid()}-"
    return {line.split()[0] for line in path.read_text().splitlines() if marker in line}


@dataclass
class Pair:
    """A collate_fn's own batch type (such values travel pickled beside the slot)."""

    first: Any
    second: Any


class MarkedTensor(torch.Tensor):
    pass


def build(spec: tuple[Any, ...], labels: np.ndarray) -> Any:
    """The value ``spec`` names, made of the batch's labels: a leaf, or a container of specs."""
    kind = spec[0]
    leaves = {
        "tensor": lambda: torch.from_numpy(labels.copy()),
        "array": lambda: labels.copy(),
        "masked": lambda: np.ma.MaskedArray(labels.copy(), mask=labels % 3 == 0),
        "subclass": lambda: torch.from_numpy(labels.copy()).as_subclass(MarkedTensor),
        "int": lambda: int(labels.sum()),
        "str": lambda: f"first {labels[0]}",
    }
    if kind in leaves:
        return leaves[kind]()
    items = [build(item, labels) for item in spec[1]]
    if kind == "dict":
        return {f"k{i}": item for i, item in enumerate(items)}
    if kind == "tuple":
        return tuple(items)
    if kind == "dataclass":
        return Pair(*items)
    return items


class StructuredCollate:
    """A collate_fn giving the batch ``spec`` describes (module level: workers may import it)."""

    def __init__(self, spec: tuple[Any, ...]) -> None:
        self.spec = spec

    def __call__(self, samples: Any) -> Any:
        return build(self.spec, np.array([int(sample["label"]) for sample in samples], dtype=np.int64))


def change_and_record(value: Any) -> Any:
    """Change every mutable part of ``value`` in place, as a training step might; return what it then holds."""
    if isinstance(value, np.ma.MaskedArray):
        value *= 10
        value[-1] = np.ma.masked
        return ("masked", value.data.tolist(), np.ma.getmaskarray(value).tolist())
    if isinstance(value, torch.Tensor):
        value.mul_(10)
        return (type(value).__name__, value.tolist())
    if isinstance(value, np.ndarray):
        value *= 10
        return ("array", value.tolist())
    if isinstance(value, dict):
        record = {key: change_and_record(item) for key, item in value.items()}
        value["seen"] = value.get("seen", 0) + 1
        return ("dict", record, value["seen"])
    if isinstance(value, list):
        record = [change_and_record(item) for item in value]
        value.append("seen")
        return ("list", record, len(value))
    if isinstance(value, tuple):
        return ("tuple", [change_and_record(item) for item in value])
    if is_dataclass(value):
        record = [change_and_record(getattr(value, field.name)) for field in fields(value)]
        value.seen = getattr(value, "seen", 0) + 1  # type: ignore[attr-defined]
        return ("dataclass", record, value.seen)  # type: ignore[attr-defined]
    return ("atom", value)


NUM_EPOCHS = 4  # with 2 batches an epoch, each batch comes back into the slot it had before


def changed_batches(ds: MmapDataset, spec: tuple[Any, ...], num_workers: int) -> list[Any]:
    """Every batch of a 2-batch set in fixed order, over several epochs, changed in place as it comes."""
    options = (
        {"num_workers": num_workers, "multiprocessing_context": "fork"} if num_workers else {"prefetch": 0}
    )
    records = []
    with MmapLoader(ds, NUM_SAMPLES // 2, collate_fn=StructuredCollate(spec), **options) as loader:
        for _ in range(NUM_EPOCHS):
            records.extend(change_and_record(batch) for batch in loader)
    return records


NAMED_SPECS = {
    "dataclass": ("dataclass", (("tensor",), ("tensor",))),
    "masked_array": ("dict", (("masked",), ("tensor",))),
    "tensor_subclass": ("dict", (("subclass",), ("array",))),
    "nested": (
        "dict",
        (
            ("list", (("int",), ("str",), ("tensor",), ("dataclass", (("int",), ("str",))))),
            ("tuple", (("str",), ("dict", (("int",),)))),
        ),
    ),
}


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("name", list(NAMED_SPECS))
def test_every_batch_is_new_objects_however_the_last_was_changed(dataset_path, name, num_workers) -> None:
    ds = MmapDataset(dataset_path)
    expected = changed_batches(ds, NAMED_SPECS[name], 0)
    assert changed_batches(ds, NAMED_SPECS[name], num_workers) == expected


LEAF_SPECS = st.sampled_from([("tensor",), ("array",), ("masked",), ("subclass",), ("int",), ("str",)])
BATCH_SPECS = st.recursive(
    LEAF_SPECS,
    lambda children: st.one_of(
        st.tuples(
            st.sampled_from(["dict", "list", "tuple"]), st.lists(children, min_size=1, max_size=3).map(tuple)
        ),
        st.tuples(st.just("dataclass"), st.tuples(children, children)),
    ),
    max_leaves=6,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=BATCH_SPECS, num_workers=st.sampled_from([1, 2]))
def test_batches_of_any_shape_changed_in_place_come_as_without_workers(
    dataset_path, spec, num_workers
) -> None:
    """Whatever a collate_fn returns, changing a batch never shows in a later one (workers=0 is the oracle)."""
    ds = MmapDataset(dataset_path)
    assert changed_batches(ds, spec, num_workers) == changed_batches(ds, spec, 0)
