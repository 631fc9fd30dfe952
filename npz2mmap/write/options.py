"""The options a dataset is written with, each with its one meaning and its one check.

``convert()`` and ``Writer`` take the same options (which part, the alignment, casts, fields
held fixed) and check them with ``WriteOptions.checked``, before anything starts. The CLI
parses its own syntax (``KEY=DTYPE``, ``A,B``) into those values, checking them with the same
rules (``cast_dtype``, ``resolve_part``, ``format.index.is_valid_align``) so that a bad value
is a usage error naming its option.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
from numpy.lib.format import descr_to_dtype

from ..format.index import ALIGN_RULE, MIN_ALIGN, is_valid_align
from ..format.manifest import is_unordered
from ..text import brief

PathOrPaths = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]
PartOption = tuple[int, int] | str | None  # None, (i, n), "I/N" or "auto"
MAX_PARTS = 100_000


@dataclass(frozen=True)
class WriteOptions:
    """What convert() and the Writer share, checked: where the dataset goes (OUT, or its
    part's directory), which part it is, its alignment, casts and the fields held fixed."""

    out_dir: str
    part: tuple[int, int] | None
    align: int
    casts: dict[str, np.dtype]
    fixed: tuple[str, ...]

    @classmethod
    def checked(
        cls,
        out_dir: str | os.PathLike[str],
        *,
        part: PartOption = None,
        align: int = MIN_ALIGN,
        casts: Mapping[str, np.dtype | str] | None = None,
        fixed: Iterable[str] | None = (),
    ) -> WriteOptions:
        """The options, each checked; TypeError or ValueError naming the first that is wrong."""
        chosen, out = resolve_part(part, out_dir)
        return cls(out, chosen, check_align(align), parse_casts(casts), parse_fixed(fixed))


def select_part(sources: list[str], part: tuple[int, int] | None) -> list[str]:
    """The i-th of n contiguous slices of the sources; empty when there are fewer sources than parts."""
    return sources if part is None else sources[part_slice(len(sources), part)]


def sources_before_part(sources: list[str], part: tuple[int, int] | None) -> list[str]:
    """The sources of the parts before ``part`` (none without a part)."""
    return [] if part is None else sources[: part_slice(len(sources), part).start]


def part_slice(num_sources: int, part: tuple[int, int]) -> slice:
    """Where the i-th of n contiguous slices of ``num_sources`` sources lies."""
    i, n = check_part(part)
    return slice(num_sources * i // n, num_sources * (i + 1) // n)


def check_part(part: object) -> tuple[int, int]:
    """``part`` as (i, n); TypeError unless it is a pair of integers, ValueError unless
    0 <= i < n <= MAX_PARTS (so that every part-IIIII name has 5 digits and they sort in order)."""
    if not isinstance(part, (tuple, list)) or len(part) != 2:
        raise TypeError(f"part must be a pair (i, n) of integers, not {brief(part, 80)}")
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in part):
        raise TypeError(f"part must be a pair (i, n) of integers, not {brief(part, 80)}")
    i, n = int(part[0]), int(part[1])
    if n < 1:
        raise ValueError(f"part {i}/{n} does not exist: n, the number of parts, must be at least 1")
    if not 0 <= i < n:
        raise ValueError(f"part {i}/{n} does not exist: i must be from 0 to {n - 1}")
    if n > MAX_PARTS:
        raise ValueError(f"part {i}/{n}: at most {MAX_PARTS:,} parts, so that part names sort in order")
    return i, n


def parse_part(text: str) -> tuple[int, int]:
    """``I/N`` as (i, n), by check_part's rules; ValueError naming what is wrong."""
    i, sep, n = text.partition("/")
    if not sep or not (_is_small_ascii_number(i) and _is_small_ascii_number(n)):
        raise ValueError(f"{brief(text, 80)} is not I/N (two plain integers) or auto")
    return check_part((int(i), int(n)))


def part_from_environment(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(i, n) from the launcher: torchrun's RANK/WORLD_SIZE or Slurm's SLURM_PROCID/SLURM_NTASKS.

    Only plain ASCII digits count: int() would also take " 1", "1_0" and
    other scripts' digits, which no launcher writes.
    """
    environ = os.environ if environ is None else environ
    for rank, size in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in environ and size in environ:
            values = environ[rank], environ[size]
            if not all(_is_small_ascii_number(v) for v in values):
                raise ValueError(
                    f"{rank}={brief(values[0], 80)} and {size}={brief(values[1], 80)} are not integers"
                )
            i, n = int(values[0]), int(values[1])
            if not 0 <= i < n:
                raise ValueError(f"{rank}={i} and {size}={n}: {rank} must be from 0 to {size} - 1")
            return check_part((i, n))
    raise ValueError(
        "--part auto needs RANK and WORLD_SIZE (torchrun) or SLURM_PROCID and SLURM_NTASKS (Slurm)"
    )


def _is_small_ascii_number(text: str) -> bool:
    """Digits 0-9 only, at most 18 of them (no launcher runs more processes)."""
    return 0 < len(text) <= 18 and text.isascii() and text.isdigit()


def resolve_part(part: PartOption, out_dir: str | os.PathLike[str]) -> tuple[tuple[int, int] | None, str]:
    """The part asked for, as (i, n), and the directory it is written to: the one meaning of
    ``part`` for ``convert --part``, ``convert(part=)`` and ``Writer(part=)``.

    ``part`` is None (no part: OUT itself), (i, n), ``"I/N"``, or ``"auto"`` (from torchrun's
    or Slurm's environment); part i goes to OUT/part-IIIII, or to OUT with {part} replaced.
    TypeError or ValueError naming what is wrong (see check_part); ValueError for an OUT holding
    {part} without a part.
    """
    out = check_out_dir(out_dir)
    if part is None:
        if "{part}" in out:  # a forgotten --part would write the whole at a literal '{part}'
            raise ValueError(
                f"OUT {out!r} holds {{part}}, which only a part fills: "
                "give a part (--part, part=) or name OUT without {part}"
            )
        return None, out
    if isinstance(part, str):
        chosen = part_from_environment() if part == "auto" else parse_part(part)
    else:
        chosen = check_part(part)
    return chosen, part_directory(out, chosen)


def check_out_dir(out_dir: object) -> str:
    """OUT as a str; TypeError unless a str or os.PathLike of one (bytes, say), ValueError for an
    empty path, as ``-o ""`` is a usage error: nothing would be written, after all the work."""
    if not isinstance(out_dir, (str, os.PathLike)) or not isinstance(os.fspath(out_dir), str):
        raise TypeError(f"out_dir must be a path (str or os.PathLike), not {brief(out_dir, 80)}")
    out = str(os.fspath(out_dir))
    if not out:
        raise ValueError("out_dir is an empty path (an unset shell variable?): name a directory")
    return out


def part_directory(out_dir: str, part: tuple[int, int]) -> str:
    """Where part I goes: OUT with {part} replaced, else OUT/part-IIIII."""
    label = f"{part[0]:05d}"
    return out_dir.replace("{part}", label) if "{part}" in out_dir else os.path.join(out_dir, f"part-{label}")


def check_align(align: int) -> int:
    """``align`` as an int; TypeError unless an integer, ValueError unless one a dataset may have
    (index.ALIGN_RULE)."""
    value = check_integer("align", align)
    if not is_valid_align(value):
        raise ValueError(f"align must be {ALIGN_RULE}, got {value}")
    return value


MAX_RECORD_SPELLING = 65_536  # characters: far more than any record a dataset may hold


def is_record_spelling(value: object) -> TypeGuard[str]:
    """Whether ``value`` spells a record as numpy's ``descr`` does: "[('a', '<i8'), ('b', '<f8')]",
    the one text that names record members (numpy's "i8,f8" names them f0, f1)."""
    return isinstance(value, str) and value.lstrip().startswith("[")


def record_dtype(text: str) -> np.dtype:
    """The record ``text`` spells, read as a .npy header's descr is (a Python literal, never
    code); ValueError for anything else."""
    if len(text) > MAX_RECORD_SPELLING:
        raise ValueError("too long")
    try:
        descr = ast.literal_eval(text.strip())
        dtype = descr_to_dtype(descr)
    except (ValueError, TypeError, SyntaxError, KeyError, IndexError, MemoryError, RecursionError):
        raise ValueError("not a record") from None
    if not isinstance(descr, list) or dtype.names is None:
        raise ValueError("not a record")
    return dtype


def record_spelling(dtype: np.dtype) -> str | None:
    """How to spell record ``dtype`` for --cast, if it reads back as the same dtype."""
    text = str(dtype.descr)
    try:
        return text if record_dtype(text) == dtype else None
    except ValueError:
        return None


def check_integer(option: str, value: object) -> int:
    """``value`` as an int (numpy's integers too); TypeError naming ``option`` for a bool, a float,
    a string or anything else that is no integer."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{option} must be an integer, not {brief(value, 80)}")
    return int(value)


def check_flags(**flags: object) -> None:
    """TypeError naming the first of ``flags`` that is not True or False: a string 'false' would
    be taken as true."""
    for option, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{option} must be True or False, not {brief(value, 80)}")


def parse_inputs(inputs: PathOrPaths) -> list[str | os.PathLike[str]]:
    """``inputs`` as a list: one path is a list of one, never the characters of its name; an
    iterator is read once. TypeError for a set, whose order (the samples') changes from run to run."""
    if is_unordered(inputs):
        raise TypeError(
            "inputs is a set, whose order changes from run to run, and the samples' order with it: "
            "give a list, such as sorted(inputs)"
        )
    listed = listed_paths("inputs", inputs)
    if not listed:
        raise ValueError("inputs is empty: give at least one path")
    return listed


def listed_paths(option: str, given: object) -> list[str | os.PathLike[str]]:
    """Paths given as one path (a list of one, never the characters of its name) or any iterable
    of them (read once), as a list of str (numpy's str_ made plain) or os.PathLike; TypeError
    naming ``option`` for anything else."""
    if isinstance(given, (str, os.PathLike)):
        return [_plain(given)]
    listed = None
    if isinstance(given, Iterable) and not isinstance(given, (bytes, bytearray)):
        listed = list(given)
    if listed is None or not all(isinstance(path, (str, os.PathLike)) for path in listed):
        raise TypeError(
            f"{option} must be a path or a list of paths (str or os.PathLike), not {brief(given, 80)}"
        )
    return [_plain(path) for path in listed]


def _plain(path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """A path as a plain str where it is a str of a subclass (numpy's str_), as os functions take it."""
    return str(path) if isinstance(path, str) else path



def parse_keys(keys: Iterable[str] | None) -> tuple[str, ...] | None:
    """``keys`` as a tuple (None: every key; an iterator is read once); TypeError for one string,
    which would name its characters, ValueError for no key or an empty one (as ``--keys`` refuses
    them)."""
    if keys is None:
        return None
    keys = _names("keys", keys)
    if not keys:
        raise ValueError("keys is empty: name at least one key, or leave it None for every key")
    if not all(keys):
        raise ValueError(f"keys {brief(list(keys), 80)} names an empty key, which no file holds")
    twice = repeated(keys)
    if twice is not None:
        raise ValueError(f"keys {brief(list(keys), 80)} names {twice!r} twice: name each key once")
    return tuple(keys)


def repeated(names: Sequence[str]) -> str | None:
    """The first name given a second time, if any: a key is selected once."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def check_workers(workers: int | None) -> int | None:
    """``workers`` as an int, or None (one per core); TypeError or ValueError unless a count of
    at least 1."""
    if workers is None:
        return None
    if isinstance(workers, (bool, np.bool_)) or not isinstance(workers, (int, np.integer)):
        raise TypeError(f"workers must be an integer (or None for one per core), not {brief(workers, 80)}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1 (or None for one per core), got {workers}")
    return int(workers)


def parse_fixed(fixed: Iterable[str] | None) -> tuple[str, ...]:
    """``fixed`` as a tuple of keys (None: none; an iterator is read once); TypeError for one
    string, which would name its characters."""
    return () if fixed is None else _names("fixed", fixed)


def _names(option: str, given: Iterable[str]) -> tuple[str, ...]:
    """Keys given as any iterable of str, read once; TypeError naming ``option`` otherwise."""
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise TypeError(f"{option} must be a list of keys, not {brief(given, 80)}")
    listed = tuple(given)
    if not all(isinstance(key, str) for key in listed):
        raise TypeError(f"{option} must be a list of keys, not {brief(list(listed), 80)}")
    return listed


def parse_casts(casts: Mapping[str, np.dtype | str] | None) -> dict[str, np.dtype]:
    """``casts`` with every value a dtype (see cast_dtype); TypeError for anything but a mapping
    of keys to dtypes."""
    if casts is None:
        return {}
    if not isinstance(casts, Mapping) or not all(isinstance(key, str) for key in casts):
        raise TypeError(
            f"casts must map keys to dtypes, as {{'input': 'float32'}}, not {brief(casts, 80)}"
        )
    return {key: cast_dtype(value) for key, value in casts.items()}


def cast_dtype(value: np.dtype | str) -> np.dtype:
    """The dtype a --cast names; ValueError unless it is a fixed-size, pickle-free numpy dtype
    (None too, which numpy would take as float64)."""
    if value is None:
        raise ValueError("None is not a numpy dtype: name one, as 'float32'")
    try:
        dtype = record_dtype(value) if is_record_spelling(value) else np.dtype(value)
    except (TypeError, ValueError, SyntaxError):  # numpy's messages for '0.1=f4', '(2' differ
        raise ValueError(f"{value!r} is not a numpy dtype") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise ValueError(f"{value!r} is not a fixed-size, pickle-free dtype")
    if dtype.subdtype is not None:  # numpy would store (2,)i8 as raw V16 bytes, each value twice
        raise ValueError(
            f"{value!r} is a subarray dtype, a shape with a dtype: name the element dtype, "
            f"{str(dtype.subdtype[0])!r}; the shape comes from the files"
        )
    return dtype
