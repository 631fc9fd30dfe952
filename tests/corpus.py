"""Random NPZ and .npy corpora and conversion options for the oracle test, and the oracle itself.

A corpus is a few sources holding the same fields, laid out as NPZ files, as
``.npy`` files (one field, ``arr_0``) or as sample directories of ``NAME.npy``
files: any dtype family (records
with padding in both byte orders included), 0-d to 3-d, fixed or ragged, C or
Fortran order, stored or compressed, and bad files placed so that some are
found while scanning and others only while copying. Array bytes are drawn raw,
so padding bytes, NaN payloads and odd booleans all occur.

The oracle knows nothing of npz2mmap: it reads each source member with
``zipfile`` (or ``open`` for a ``.npy`` file) and numpy's own header reader (``np.load`` itself drops record
padding) and computes the bytes a sample must have (C order, every primitive
little-endian, padding kept) with its own byte permutation.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

LEAF_CODES = ["?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16"]
LEAF_CODES += ["M8[s]", "m8[ms]", "S3", "U2", "V3"]
# Casts every value survives (numpy's same-kind rule, and exact): source code -> stored dtype.
LOSSLESS_CASTS = {"i1": "i4", "u1": "u2", "i2": "i8", "u2": "u4", "f2": "f4", "f4": "f8", "i4": "i8"}
COPY_BAD_NBYTES = 64 << 10  # a member this large is read to its end (and CRC-checked) only when copied
LAYOUTS = ("npz", "npy-files", "sample-dirs")
NPY_FILE_KEY = "arr_0"  # the key np.savez gives a lone array, and npz2mmap a .npy file


@st.composite
def leaf_dtypes(draw: st.DrawFn) -> np.dtype:
    code = draw(st.sampled_from(LEAF_CODES))
    dtype = np.dtype(code)
    return dtype.newbyteorder(draw(st.sampled_from("<>"))) if dtype.byteorder not in "|" else dtype


@st.composite
def record_dtypes(draw: st.DrawFn, depth: int = 0) -> np.dtype:
    """Records with gaps: aligned layouts, explicit offsets, nesting and subarrays."""
    count = draw(st.integers(1, 3))
    names = [f"f{i}" for i in range(count)]
    formats: list[Any] = []
    for _ in names:
        if depth < 1 and draw(st.integers(0, 4)) == 0:
            formats.append(draw(record_dtypes(depth=depth + 1)))
        elif draw(st.integers(0, 3)) == 0:
            formats.append((draw(leaf_dtypes()), (draw(st.integers(1, 3)),)))
        else:
            formats.append(draw(leaf_dtypes()))
    if draw(st.booleans()):
        return np.dtype({"names": names, "formats": formats}, align=True)
    offsets, cursor = [], 0
    for fmt in formats:
        cursor += draw(st.integers(0, 3))  # a gap of padding before the field
        offsets.append(cursor)
        cursor += np.dtype(fmt).itemsize
    return np.dtype(
        {"names": names, "formats": formats, "offsets": offsets, "itemsize": cursor + draw(st.integers(0, 3))}
    )


def any_dtypes() -> st.SearchStrategy[np.dtype]:
    return st.one_of(leaf_dtypes(), leaf_dtypes(), record_dtypes())


@dataclass
class FieldSpec:
    name: str
    dtype: np.dtype
    sample_shapes: list[tuple[int, ...]]  # per file: the array's shape (rows mode: including axis 0)
    fortran: list[bool]


@dataclass
class Corpus:
    fields: list[FieldSpec]
    compressed: list[bool]
    rows: bool
    num_files: int
    scan_bad: list[int] = field(default_factory=list)  # positions of zero-byte files
    copy_bad: list[int] = field(default_factory=list)  # positions of files corrupt past their header
    seed: int = 0
    layout: str = "npz"  # or "npy-files" (one field, arr_0), "sample-dirs" (one NAME.npy per field)


@st.composite
def corpora(draw: st.DrawFn) -> Corpus:
    rows = draw(st.booleans())
    layout = draw(st.sampled_from(LAYOUTS))
    num_files = draw(st.integers(1, 5))
    row_counts = [draw(st.integers(0, 3)) for _ in range(num_files)]
    fields = []
    for k in range(1 if layout == "npy-files" else draw(st.integers(1, 3))):
        ndim = draw(st.integers(0, 2))
        ragged = ndim > 0 and draw(st.booleans())
        fixed = tuple(draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim)))
        shapes = []
        for n in range(num_files):
            shape = (
                tuple(draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim))) if ragged else fixed
            )
            shapes.append((row_counts[n], *shape) if rows else shape)
        fortran = [draw(st.booleans()) for _ in range(num_files)]
        name = NPY_FILE_KEY if layout == "npy-files" else f"k{k}"
        fields.append(FieldSpec(name, draw(any_dtypes()), shapes, fortran))
    compressed = [draw(st.booleans()) for _ in range(num_files)]
    corpus = Corpus(fields, compressed, rows, num_files, seed=draw(st.integers(0, 2**32 - 1)), layout=layout)
    if draw(st.booleans()):
        corpus.scan_bad = sorted(draw(st.sets(st.integers(0, num_files), max_size=2)))
        # A .npy file has no checksum: what is wrong with it is found by the scan.
        if layout == "npz" and (any(f.sample_shapes[0] for f in fields) or rows):
            corpus.copy_bad = sorted(draw(st.sets(st.integers(0, num_files), max_size=2)))
    return corpus


@dataclass
class Options:
    workers: int
    keys: list[str] | None
    casts: dict[str, str]
    align: int
    parts: int


@st.composite
def options_for(draw: st.DrawFn, corpus: Corpus) -> Options:
    names = [f.name for f in corpus.fields]
    keys = sorted(draw(st.sets(st.sampled_from(names), min_size=1))) if draw(st.booleans()) else None
    casts = {}
    for f in corpus.fields:
        code = f.dtype.newbyteorder("=").str[1:] if f.dtype.fields is None else None
        if code in LOSSLESS_CASTS and (keys is None or f.name in keys) and draw(st.booleans()):
            casts[f.name] = LOSSLESS_CASTS[code]
    return Options(
        workers=draw(st.integers(1, 3)),
        keys=keys,
        casts=casts,
        align=draw(st.sampled_from([64, 128, 4096])),
        parts=draw(st.integers(1, 3)),
    )


# --- writing the corpus ------------------------------------------------------


@dataclass
class Written:
    """The files of a corpus in input order, each with the keys whose members are corrupt."""

    files: list[tuple[Path, frozenset[str] | None]]  # None: the whole file is unreadable

    def good(self, keys: list[str]) -> list[Path]:
        """The files a conversion of ``keys`` must keep: no selected member is corrupt."""
        return [path for path, bad in self.files if bad is not None and not bad & set(keys)]

    def any_bad(self, keys: list[str]) -> bool:
        return len(self.good(keys)) < len(self.files)


def write_corpus(corpus: Corpus, src: Path) -> Written:
    """Write every source; names sort in corpus order."""
    rng = np.random.default_rng(corpus.seed)
    src.mkdir(parents=True)
    files: list[tuple[Path, frozenset[str] | None]] = []
    for n in range(corpus.num_files + 1):
        if n in corpus.scan_bad:
            path = source_path(corpus, src / f"{len(files):03d}-scan-bad")
            write_arrays(corpus, path, {f.name: b"" for f in corpus.fields}, False)
            files.append((path, None))
        if n in corpus.copy_bad:
            path = src / f"{len(files):03d}-copy-bad.npz"
            files.append((path, write_copy_bad(corpus, path, rng)))
        if n < corpus.num_files:
            path = source_path(corpus, src / f"{len(files):03d}")
            arrays = {
                f.name: raw_array(f.dtype, f.sample_shapes[n], f.fortran[n], rng) for f in corpus.fields
            }
            write_arrays(corpus, path, arrays, corpus.compressed[n])
            files.append((path, frozenset()))
    return Written(files)


def source_path(corpus: Corpus, stem: Path) -> Path:
    return (
        stem
        if corpus.layout == "sample-dirs"
        else stem.with_suffix(".npy" if corpus.layout == "npy-files" else ".npz")
    )


def write_arrays(corpus: Corpus, path: Path, arrays: dict[str, Any], compressed: bool) -> None:
    """One source holding ``arrays`` (bytes: a file of exactly those bytes), as the layout says."""
    if corpus.layout == "npz":
        if any(isinstance(a, bytes) for a in arrays.values()):
            path.write_bytes(b"")
        else:
            (np.savez_compressed if compressed else np.savez)(path, **arrays)
        return
    if corpus.layout == "sample-dirs":
        path.mkdir()
    for name, array in arrays.items():
        target = path / f"{name}.npy" if corpus.layout == "sample-dirs" else path
        if isinstance(array, bytes):
            target.write_bytes(array)
        else:
            np.save(target, array)


def raw_array(dtype: np.dtype, shape: tuple[int, ...], fortran: bool, rng: np.random.Generator) -> np.ndarray:
    """An array of arbitrary bytes: every bit pattern, padding included."""
    count = int(np.prod(shape, dtype=np.int64))
    data = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8).tobytes()
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    if fortran and array.ndim > 1:
        return np.frombuffer(data, dtype=dtype).reshape(shape[::-1]).T  # Fortran order, bytes untouched
    return array


def write_copy_bad(corpus: Corpus, path: Path, rng: np.random.Generator) -> frozenset[str]:
    """A file that agrees with the others on keys, dtypes and ndim, whose large members
    are corrupt only far past their headers: found when copied, not when scanned.
    Returns the keys of the corrupt members."""
    arrays = {}
    for f in corpus.fields:
        shape = f.sample_shapes[0]
        if corpus.rows or shape:
            first = -(-COPY_BAD_NBYTES // max(1, f.dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))))
            shape = (first, *shape[1:]) if all(shape[1:]) else (first, *(1 for _ in shape[1:]))
        arrays[f.name] = raw_array(f.dtype, shape, False, rng)
    if corpus.rows:
        first_rows = {a.shape[0] for a in arrays.values()}
        arrays = {k: v[: min(first_rows)] for k, v in arrays.items()}
    np.savez(path, **arrays)
    corrupt = frozenset(key for key, array in arrays.items() if array.nbytes >= COPY_BAD_NBYTES // 2)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        for key in corrupt:
            info = zf.getinfo(f"{key}.npy")
            name_nbytes = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
            extra_nbytes = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
            data[info.header_offset + 30 + name_nbytes + extra_nbytes + info.compress_size - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    return corrupt


# --- the oracle -----------------------------------------------------------------


def expected_samples(path: Path, name: str, rows: bool, cast: str | None) -> list[bytes]:
    """The bytes each sample of ``name`` from ``path`` must be stored as."""
    array = load_raw(path, name)
    samples = [array[i, ...] for i in range(len(array))] if rows else [array]  # arrays, never scalars
    if cast is not None:
        target = np.dtype(cast).newbyteorder("<")
        with np.errstate(invalid="ignore"):  # NaN stays NaN
            return [np.ascontiguousarray(np.asarray(s).astype(target)).tobytes() for s in samples]
    return [little_endian_bytes(np.asarray(s)) for s in samples]


def load_raw(path: Path | str, name: str) -> np.ndarray:
    """What ``np.load(path)[name]`` returns, but over the member's raw bytes.

    np.load copies a zip member's records field by field into a new array,
    which leaves their padding undefined; numpy's own header reader and
    ``frombuffer`` keep every byte of the file. A ``.npy`` file is read the
    same way, and a sample directory's field from its ``name.npy``.
    """
    path = Path(path)
    if path.is_dir():
        return read_npy(open(path / f"{name}.npy", "rb"))
    if path.suffix == ".npy":
        return read_npy(open(path, "rb"))
    with zipfile.ZipFile(path) as zf:
        return read_npy(zf.open(f"{name}.npy"))


def read_npy(stream: Any) -> np.ndarray:
    with stream as fp:
        version = np.lib.format.read_magic(fp)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0}.get(
            version, np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(fp)
        count = int(np.prod(shape, dtype=np.int64))
        flat = np.frombuffer(fp.read(), dtype=dtype, count=count)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def little_endian_bytes(array: np.ndarray) -> bytes:
    """C-order bytes with every primitive little-endian; padding bytes exactly as loaded."""
    raw = np.ascontiguousarray(array.view(np.dtype((np.void, array.dtype.itemsize)))).view(np.uint8)
    permutation = np.arange(array.dtype.itemsize)
    for offset, size, unit in swapped_leaves(array.dtype, 0):
        for start in range(offset, offset + size, unit):
            permutation[start : start + unit] = permutation[start : start + unit][::-1]
    return raw.reshape(-1, array.dtype.itemsize)[:, permutation].tobytes() if array.size else b""


def swapped_leaves(dtype: np.dtype, base: int) -> list[tuple[int, int, int]]:
    """(offset, nbytes, unit) of every big-endian primitive run in one item of ``dtype``."""
    if dtype.subdtype is not None:
        inner, shape = dtype.subdtype
        count = int(np.prod(shape))
        return [
            (base + k * inner.itemsize + offset, size, unit)
            for k in range(count)
            for offset, size, unit in swapped_leaves(inner, 0)
        ]
    if dtype.fields is not None:
        return [
            leaf
            for name in dtype.names or ()
            for leaf in swapped_leaves(dtype.fields[name][0], base + dtype.fields[name][1])
        ]
    if dtype.byteorder != ">" or dtype.itemsize == 1:
        return []
    unit = {"c": dtype.itemsize // 2, "U": 4}.get(dtype.kind, dtype.itemsize)
    return [(base, dtype.itemsize, unit)]
