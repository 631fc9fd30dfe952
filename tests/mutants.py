"""Damaged copies of a real dataset: blob, index and file-system mutants.

Each mutant is a dataset directory changed in one way. ``forged`` mutants
also rewrite the blob's identity to match an edited index, as a forger
could: for those a reader may return other data, but must still fail only
with FormatError, never hang or crash. For every other mutant, a reader must
return exactly the original data or raise FormatError.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from conftest import write_samples

from npz2mmap.format import index
from npz2mmap.write.conversion import convert


@dataclass(frozen=True)
class Mutant:
    name: str
    mutate: Callable[[Path], None]
    forged: bool = False


def make_base(root: Path) -> Path:
    """A small dataset with a fixed, a ragged, a record (with padding) and a 0-d field."""
    rng = np.random.default_rng(11)
    record = np.dtype({"names": ["a", "b"], "formats": ["<i2", "<f8"], "offsets": [0, 8], "itemsize": 24})
    samples = [
        {
            "image": rng.standard_normal((2, 3)).astype(np.float32),
            "tokens": rng.integers(0, 1000, size=int(n)).astype(np.int32),
            "record": np.frombuffer(rng.bytes(record.itemsize * 2), record),
            "label": np.int64(i),
        }
        for i, n in enumerate(rng.integers(0, 6, size=8))
    ]
    write_samples(root / "src", samples)
    convert([root / "src"], root / "base", workers=1)
    return root / "base"


def all_mutants(base: Path, seed: int = 0, index_edits: int = 60) -> list[Mutant]:
    rng = random.Random(seed)
    return [*blob_mutants(base, rng), *index_mutants(base, rng, index_edits), *file_mutants()]


# --- the blob ------------------------------------------------------------------


def blob_mutants(base: Path, rng: random.Random) -> Iterator[Mutant]:
    size = (base / index.BLOB_NAME).stat().st_size
    offsets = sorted({*range(0, 200, 7), *rng.sample(range(size), min(size, 120))})
    for offset in offsets:
        yield Mutant(f"blob-flip-{offset}", _flip_blob_byte(offset))
    for new_size in (0, 10, 127, 128, 191, 192, size - 1, size + 1, size + 4096):
        yield Mutant(f"blob-size-{new_size}", _resize_blob(new_size))


def _flip_blob_byte(offset: int) -> Callable[[Path], None]:
    def mutate(dataset: Path) -> None:
        with open(dataset / index.BLOB_NAME, "r+b") as fp:
            fp.seek(offset)
            byte = fp.read(1)
            fp.seek(offset)
            fp.write(bytes([byte[0] ^ 0x5A]))

    return mutate


def _resize_blob(new_size: int) -> Callable[[Path], None]:
    return lambda dataset: os.truncate(dataset / index.BLOB_NAME, new_size)


# --- the index -----------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    1,
    7,
    63,
    2**31,
    2**32,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    10**300,
    1.5,
    "x",
    "<f4",
    "<i4",
    "|V4",
    "|S4",
    "<M8[s]",
    "|O",
    ">i8",
    "(2,)<f4",
    [],
    {},
    [[0, 1]],
    [2**32, 2**32],
    [0, 2**62],
    [1] * 64,
    [1] * 63,
    [["a", "<f4"], ["a", "<f4"]],
    [["a", "<f4", [2]]],
]


def _deep_record(depth: int) -> Any:
    descr: Any = "<f4"
    for _ in range(depth):
        descr = [["a", descr]]
    return descr


def index_mutants(base: Path, rng: random.Random, edits: int) -> Iterator[Mutant]:
    document = json.loads((base / index.INDEX_NAME).read_text())
    paths = list(_value_paths(document))
    values = [*HOSTILE_VALUES, _deep_record(40), _deep_record(200), "9" * 5000]
    for k in range(edits):
        path = rng.choice(paths)
        value = rng.choice(values)
        for forged in (False, True):
            yield Mutant(
                f"index-{k}-{'/'.join(map(str, path))}={_label(value)}",
                _edit_index(path, value, forged),
                forged,
            )
    for forged in (False, True):
        yield Mutant(f"index-swap-names-{forged}", _rewrite_index(_swap_names, forged), forged)
        yield Mutant(f"index-transpose-{forged}", _edit_index(("fields", 0, "shape"), [3, 2], forged), forged)
        yield Mutant(f"index-rename-{forged}", _edit_index(("fields", 0, "name"), "other", forged), forged)
        yield Mutant(f"index-i4-for-f4-{forged}", _edit_index(("fields", 0, "dtype"), "<i4", forged), forged)
    yield Mutant("index-whitespace", _rewrite_index_text(lambda text: text.replace(": ", ":  ", 1)))
    yield Mutant("index-empty", _rewrite_index_text(lambda text: ""))
    yield Mutant("index-not-json", _rewrite_index_text(lambda text: text[: len(text) // 2]))
    yield Mutant("index-deep-json", _rewrite_index_text(lambda text: "[" * 100_000 + "]" * 100_000))
    yield Mutant(
        "index-5000-digits",
        _rewrite_index_text(lambda text: text.replace('"align": 64', '"align": ' + "9" * 5000)),
    )


def _label(value: Any) -> str:
    return json.dumps(value)[:20] if not isinstance(value, list) or len(json.dumps(value)) < 40 else "[...]"


def _value_paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    if prefix:
        yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _value_paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _value_paths(child, (*prefix, i))


def _edit_index(path: tuple, value: Any, forged: bool) -> Callable[[Path], None]:
    def edit(document: Any) -> None:
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value

    return _rewrite_index(edit, forged)


def _swap_names(document: Any) -> None:
    a, b = document["fields"][0], document["fields"][2]
    a["name"], b["name"] = b["name"], a["name"]


def _rewrite_index(edit: Callable[[Any], None], forged: bool) -> Callable[[Path], None]:
    def mutate(dataset: Path) -> None:
        document = json.loads((dataset / index.INDEX_NAME).read_text())
        edit(document)
        text = json.dumps(document, sort_keys=True, indent=1) + "\n"
        (dataset / index.INDEX_NAME).write_text(text)
        if forged:
            forge_identity(dataset)

    return mutate


def _rewrite_index_text(change: Callable[[str], str]) -> Callable[[Path], None]:
    def mutate(dataset: Path) -> None:
        path = dataset / index.INDEX_NAME
        path.write_text(change(path.read_text()))

    return mutate


def forge_identity(dataset: Path) -> None:
    """Make the blob name the index as it is now, as a forger would."""
    digest = index.index_digest((dataset / index.INDEX_NAME).read_bytes())
    with open(dataset / index.BLOB_NAME, "r+b") as fp:
        fp.seek(index.BLOB_HEADER_NBYTES)
        fp.write(index.blob_identity(digest))


# --- the file system ---------------------------------------------------------


def file_mutants() -> Iterator[Mutant]:
    for name in index.DATASET_FILES:
        yield Mutant(f"{name}-fifo", _replace(name, lambda p: os.mkfifo(p)))
        yield Mutant(f"{name}-dev-zero", _replace(name, lambda p: os.symlink("/dev/zero", p)))
        yield Mutant(f"{name}-directory", _replace(name, lambda p: p.mkdir()))
        yield Mutant(f"{name}-missing", _replace(name, lambda p: None))
        yield Mutant(f"{name}-empty", _replace(name, lambda p: p.write_bytes(b"")))
        yield Mutant(f"{name}-loop", _replace(name, lambda p: os.symlink(p.name, p)))


def _replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(dataset: Path) -> None:
        path = dataset / name
        os.unlink(path)
        make(path)

    return mutate


def materialise(base: Path, mutant: Mutant, target: Path) -> Path:
    shutil.copytree(base, target)
    mutant.mutate(target)
    return target
