"""The cast rules of --cast and casts=, and the cast an error suggests.

What --cast allows (numpy's same-kind casts, less those that change a value's kind or place),
which dtype every source of a field casts to, whether it keeps every value of each, and how
messages spell it for the CLI (shell-quoted) or for the Writer's arguments.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..format.dtypes import storage_dtype
from .options import cast_dtype, record_spelling


class Hints(NamedTuple):
    """How messages name the options that resolve a disagreement: the CLI's, or the Writer's arguments."""

    cast: str  # formatted with key= and dtype=; a cast that may not keep every value adds SOME_VALUES
    no_cast: str  # formatted with key=, dtypes=, share= and them=: where no dtype holds them all
    keys: str
    casts_named: str
    fixed: str = "--fixed {key}"  # formatted with key=
    fixed_way_out: str = "; use --skip-bad to leave such files out"
    one_cast_each: str = " (--cast takes one KEY=DTYPE: give it once for each key)"
    cast_given: str = "--cast {key}={dtype}"  # formatted with key= and dtype=: a cast as it was given


SOME_VALUES = ", if every value fits it"

CLI_HINTS = Hints(
    cast="use --cast {cast} to store one dtype",
    no_cast="{dtypes} {share} no dtype --cast could store {them} as (it keeps their kind): "
    "convert such files apart, or leave {key} out with --keys",
    keys="; select common keys with --keys",
    casts_named="--cast names",
)


WRITER_HINTS = Hints(
    cast="pass casts={{{key!r}: {dtype!r}}} to store one dtype",
    no_cast="{dtypes} {share} no dtype casts= could store {them} as (it keeps their kind): "
    "write such samples to another dataset",
    keys="",
    casts_named="casts= names",
    fixed="fixed=[{key!r}]",
    fixed_way_out="",
    one_cast_each="",
    cast_given="casts={{{key!r}: {dtype!r}}}",
)


def cast_hint(key: str, dtypes: Sequence[np.dtype], hints: Hints) -> str:
    """The way to store ``dtypes`` as one: a cast every one of them allows, or what else to do."""
    target = common_cast_target(dtypes)
    if target is None:
        names = list(dict.fromkeys(str(storage_dtype(dtype)) for dtype in dtypes))  # >f8 is float64
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        share, them = ("has", "it") if len(names) == 1 else ("share", "them")
        return hints.no_cast.format(key=key, dtypes=listed, share=share, them=them)
    stored = cast_dtype(target)
    every_value = all(holds_every_value(dtype, stored) for dtype in dtypes)
    shown = shell_word(f"{key}={target}")
    return hints.cast.format(key=key, dtype=target, cast=shown) + ("" if every_value else SOME_VALUES)


def shell_word(text: str) -> str:
    """``text`` as one word a shell takes as it is: bare where it can be, else in double quotes
    (a record's spelling reads best so), else as shlex quotes it."""
    if shlex.quote(text) == text:
        return text
    return f'"{text}"' if not any(char in text for char in '"$`\\!') else shlex.quote(text)


def holds_every_value(source: np.dtype, target: np.dtype) -> bool:
    """Whether ``target`` represents every value of ``source`` exactly, so that a cast of any
    file's values succeeds: not so for int64 to float64 (2**53 + 1), uint64 to int64, bytes to
    text (bytes that are not ASCII), float64 to float32, days to nanoseconds (past 2262)."""
    source, target = storage_dtype(source), storage_dtype(target)
    if source == target:
        return True
    if source.subdtype is not None or target.subdtype is not None:
        return source.shape == target.shape and holds_every_value(source.base, target.base)
    if source.names is not None or target.names is not None:
        if source.names is None or source.names != target.names:
            return False
        return all(holds_every_value(source[name], target[name]) for name in source.names)
    if source.kind in "biu" and target.kind in "fc":
        value_bits = 1 if source.kind == "b" else source.itemsize * 8 - (source.kind == "i")
        return value_bits <= np.finfo(target).nmant + 1
    if source.kind == "S" and target.kind == "U":
        return False
    if source.kind in "mM":  # a finer unit overflows (2300-01-01 in ns), a coarser one truncates
        return False
    return bool(np.can_cast(source, target, casting="safe"))


def common_cast_target(dtypes: Sequence[np.dtype]) -> str | None:
    """How to spell a dtype every one of ``dtypes`` casts to under --cast's rule, if there is one:
    numpy's promotion of them all where they allow it, else the first of them they all allow,
    one that keeps every value of each before one that may not."""
    candidates = list(dtypes)
    try:
        candidates.insert(0, np.result_type(*dtypes))
    except TypeError:  # numpy's DTypePromotionError: no promotion (a string and a number)
        pass
    allowed: list[tuple[str, np.dtype]] = []
    for candidate in candidates:
        spelled = dtype_spelling(storage_dtype(candidate))
        if spelled is None:
            continue
        target = cast_dtype(spelled)
        if all(can_cast(dtype, target) for dtype in dtypes):
            allowed.append((spelled, target))
    # one that keeps every value of every dtype first: numpy promotes no records with subarrays
    exact = [pair for pair in allowed if all(holds_every_value(dtype, pair[1]) for dtype in dtypes)]
    chosen = exact or allowed
    return chosen[0][0] if chosen else None


def dtype_spelling(dtype: np.dtype) -> str | None:
    """The shortest text --cast parses back to ``dtype`` (float32, U8, datetime64[ms], a record
    as numpy's descr spells it), if any."""
    if dtype.names is not None:
        return record_spelling(dtype)
    for text in (dtype.name, dtype.str.lstrip("<|="), dtype.str):
        try:
            if np.dtype(text) == dtype and not dtype.fields and not dtype.subdtype:
                return text
        except TypeError:
            continue
    return None


def can_cast(source: np.dtype, target: np.dtype) -> bool:
    """What --cast allows: numpy's 'same_kind' rule (float64 -> float32, never float -> int),
    less what numpy allows there but changes the values' kind or place: numbers to text (7 to
    '7'), to times (7 to 7 seconds) or to raw bytes, and records other than member by member
    (numpy casts records by position, so another order of names swaps values, and a member of
    another shape broadcasts them)."""
    if source.fields is not None or target.fields is not None:
        return _can_cast_records(source, target)
    if source.subdtype is not None or target.subdtype is not None:
        return source.shape == target.shape and can_cast(source.base, target.base)
    if source.kind in "biufc?" and target.kind in "SUmMV":  # 7 as '7', 7 seconds or raw bytes
        return False
    if target.kind == "V" and source.kind != "V":
        return False
    return bool(np.can_cast(source, target, casting="same_kind"))


def _can_cast_records(source: np.dtype, target: np.dtype) -> bool:
    """Records cast member by member: the same names, in the same order, each member castable."""
    if source.names is None or target.names is None or source.names != target.names:
        return False
    if not np.can_cast(source, target, casting="same_kind"):
        return False
    return all(can_cast(source[name], target[name]) for name in source.names)
