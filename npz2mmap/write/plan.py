"""Planning: from the member headers of every source to the blob's layout.

Pure computation, no I/O: the headers arrive in sample order, are checked for
agreement (same keys, dtypes and ndim in every file) and become a Plan that
places every field's data and tables at aligned offsets of the payload. Totals
are bounded, so no sum wraps and every field stays an array numpy can hold.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..errors import KeyAbsentError, MismatchError, SourceError, UnknownKeyError
from ..format.dtypes import dtype_nesting_problem, storage_dtype
from ..format.index import (
    CRC_DTYPE,
    MAX_NDIM,
    MAX_PAYLOAD_NBYTES,
    OFFSET_DTYPE,
    field_name_problem,
)
from ..ingest.npy_header import MemberHeader
from ..text import brief, quoted
from .casts import CLI_HINTS, Hints, can_cast, cast_hint
from .layout import Plan, lay_out

MAX_DTYPES_SEEN = 64  # the source dtypes of a field a cast refusal considers (a bound, not a limit)

# Every sample has an int64 entry in a ragged field's offsets table, which lives in the payload.
MAX_NUM_SAMPLES = MAX_PAYLOAD_NBYTES // OFFSET_DTYPE.itemsize - 1


class Disagreement(MismatchError):
    """A source disagrees with the first: ``problem``, then ``way_out`` (what resolves it).

    For dtypes that differ, ``dtypes`` maps each key to the stored dtype and the
    source's, so that Disagreements can suggest one cast per key that holds every source's.
    """

    def __init__(
        self,
        problem: str,
        way_out: str = "",
        dtypes: Mapping[str, tuple[np.dtype, ...]] | None = None,
        refuses: str = "",
    ) -> None:
        self.problem, self.way_out, self.dtypes = problem, way_out, dict(dtypes or {})
        self.refuses = refuses  # the option the source refuses, rather than the first source
        super().__init__(f"{problem}; {way_out}" if way_out else problem)

    def __reduce__(self) -> tuple[type, tuple[str, str, dict[str, tuple[np.dtype, ...]], str]]:
        return type(self), (self.problem, self.way_out, self.dtypes, self.refuses)


def dtype_disagreement(
    problem: str, key: str, dtypes: tuple[np.dtype, ...], hints: Hints, refuses: str = ""
) -> Disagreement:
    """A Disagreement on ``key``'s dtypes, with the cast that stores them all (or what else to do)."""
    return Disagreement(problem, cast_hint(key, dtypes, hints), {key: dtypes}, refuses)


def joined_disagreements(found: Sequence[Disagreement], hints: Hints) -> Disagreement:
    """One source's disagreements on several keys' dtypes as one, each key's cast suggested."""
    dtypes = {key: pair for exc in found for key, pair in exc.dtypes.items()}
    ways = "; ".join(cast_hint(key, pair, hints) for key, pair in dtypes.items())
    return Disagreement("; ".join(exc.problem for exc in found), ways, dtypes)


class _FieldCollector:
    """Accumulates one field's per-sample shapes in compact arrays."""

    def __init__(
        self, header: MemberHeader, path: str, cast: np.dtype | None, rows: bool, hints: Hints = CLI_HINTS
    ) -> None:
        self.cast = cast
        self.hints = hints
        self.rows = rows
        self.dtype = storage_dtype(cast if cast is not None else header.dtype)
        self.ndim = len(header.shape) - (1 if rows else 0)
        self.first_path = path
        self.dims: array[int] = array("q")
        self.accepted_dtype: np.dtype | None = None  # the last source dtype _check_dtype accepted
        self.seen_dtypes: list[np.dtype] = []  # every source dtype met, for the cast a refusal suggests
        self.accepted_is_cast = False  # whether storing accepted_dtype casts its values
        self.cast_files: array[int] = array("q")  # the recorded sources whose values are cast, by number
        if self.ndim + 1 > MAX_NDIM:
            raise SourceError(
                f"{path}[{header.key}]: a {self.ndim}-d array leaves no room for the sample axis "
                f"(numpy allows {MAX_NDIM} dimensions)"
            )
        nesting = dtype_nesting_problem(self.dtype)
        if nesting is not None:
            raise SourceError(f"{path}[{header.key}]: dtype {nesting}, more than a dataset may hold")

    def check(self, header: MemberHeader, path: str) -> tuple[array[int], bool]:
        """The dims this member adds (one sample's shape per row) and whether its values are cast
        (its dtype differs from the stored one beyond byte order); SourceError if it disagrees."""
        if header.dtype is not self.accepted_dtype:  # numpy shares builtin dtypes: checked once
            self._check_dtype(header, path)
            self.accepted_dtype = header.dtype
            self.accepted_is_cast = storage_dtype(header.dtype) != self.dtype
        sample_shape = header.shape[1:] if self.rows else header.shape
        if len(sample_shape) != self.ndim:
            what = "rows" if self.rows else "arrays"
            raise Disagreement(
                f"{path}[{header.key}]: {len(header.shape)}-d array {header.shape} differs from the "
                f"{self.ndim + self.rows}-d {what} in {self.first_path}"
            )
        return array("q", sample_shape) * (header.shape[0] if self.rows else 1), self.accepted_is_cast

    def saw(self, dtypes: Iterable[np.dtype]) -> None:
        """Remember source dtypes met (a bounded number), for the cast a refusal suggests."""
        for dtype in dtypes:
            if dtype not in self.seen_dtypes and len(self.seen_dtypes) < MAX_DTYPES_SEEN:
                self.seen_dtypes.append(dtype)

    def _check_dtype(self, header: MemberHeader, path: str) -> None:
        where = f"{path}[{header.key}]"
        self.saw([header.dtype])
        if self.cast is not None:
            if not can_cast(header.dtype, self.dtype):
                records = header.dtype.names is not None or self.dtype.names is not None
                rule = "member by member (the same names, in order)" if records else "without changing kind"
                raise dtype_disagreement(
                    f"{where}: dtype {header.dtype} cannot be cast to {self.dtype} {rule}",
                    header.key,
                    tuple(self.seen_dtypes),  # the cast suggested must hold the sources' dtypes, not this one
                    self.hints,
                    refuses=self.hints.cast_given.format(key=header.key, dtype=self.dtype),
                )
        elif storage_dtype(header.dtype) != self.dtype:
            raise dtype_disagreement(
                f"{where}: dtype {header.dtype} differs from {self.dtype} in {self.first_path}",
                header.key,
                (self.dtype, header.dtype),
                self.hints,
            )

    def shapes(self, num_samples: int) -> NDArray[np.int64]:
        return np.frombuffer(self.dims, dtype=np.int64).reshape(num_samples, self.ndim)


class Disagreements:
    """The sources that disagree with the first, gathered so that one run names them all.

    Keeps the first few problems as they read and, for each key whose dtype
    differs, every dtype met, so that the one cast suggested holds them all.
    Where every source that disagrees refuses one option (a cast it cannot
    take), the error says they refuse it; where no source was taken because
    none holds a key --keys names, the option is at fault: a usage error.
    """

    SHOWN = 3

    def __init__(self, hints: Hints = CLI_HINTS) -> None:
        self.hints = hints
        self.count = 0
        self.first: MismatchError | None = None
        self.problems: list[str] = []
        self.dtypes: dict[str, list[np.dtype]] = {}
        self.other_hints: list[str] = []
        self.refused: set[str] | None = None  # the options every source so far refuses

    def add(self, exc: MismatchError) -> None:
        """Count one source's disagreement."""
        self.count += 1
        self.first = self.first or exc
        refuses = exc.refuses if isinstance(exc, Disagreement) else ""
        if isinstance(exc, KeyAbsentError):
            refuses = f"--keys {exc.key!r}"
        self.refused = {refuses} - {""} if self.refused is None else self.refused & {refuses}
        problem, hint = str(exc), ""
        if isinstance(exc, Disagreement):
            problem, hint = exc.problem, exc.way_out
            for key, pair in exc.dtypes.items():  # a dtype: one cast for all is suggested at the end instead
                known = self.dtypes.setdefault(key, [])
                known.extend(dtype for dtype in pair if dtype not in known)
                hint = ""
        if len(self.problems) < self.SHOWN:
            self.problems.append(problem)
        if hint and hint not in self.other_hints:
            self.other_hints.append(hint)

    def error(
        self, first_source: str, taken: Mapping[str, Sequence[np.dtype]] | None = None
    ) -> SourceError | None:
        """One error naming them all (the first few, and how many more), or None if all agreed.

        ``taken`` has each key's dtypes in the sources taken: the cast suggested must hold those
        too, not only the refused ones (a cast that int64 files refuse and <U1 files take).
        """
        for key, known in self.dtypes.items():
            known.extend(dtype for dtype in (taken or {}).get(key, ()) if dtype not in known)
        refused = sorted(self.refused or ())  # the option every file that disagreed refuses
        if first_source and isinstance(self.first, KeyAbsentError):
            refused = []  # files lacking a key that others hold disagree with those
        if refused and isinstance(self.first, KeyAbsentError):
            first = self.first
            return UnknownKeyError(
                f"--keys names {first.key!r}, which no input file holds ({first.path} has "
                f"{quoted(first.available)}): select keys the files hold"
            )
        if self.first is None:
            return None
        if self.count == 1:
            return self._with_casts_for_all(self.first)
        more = f"; and {self.count - len(self.problems):,} more" if self.count > len(self.problems) else ""
        ways = [cast_hint(key, dtypes, self.hints) for key, dtypes in self.dtypes.items()]
        ways += self.other_hints
        against = f" with the first, {first_source}" if first_source else ""
        what = f"refuse {refused[0]}" if refused else f"disagree{against}"
        return MismatchError(
            f"{self.count:,} files {what}: "
            + "; ".join(self.problems)
            + more
            + "".join(f"; {way}" for way in ways)
        )

    def _with_casts_for_all(self, exc: MismatchError) -> MismatchError:
        """``exc`` with the cast it suggests chosen from every dtype met, not its own alone."""
        if not isinstance(exc, Disagreement) or not exc.dtypes:
            return exc
        ways = "; ".join(cast_hint(key, self.dtypes[key], self.hints) for key in exc.dtypes)
        return Disagreement(exc.problem, ways, exc.dtypes, exc.refuses)


def check_field_name(name: str, where: str) -> None:
    """SourceError naming ``where`` and showing ``name`` escaped, if a dataset may not hold ``name``."""
    problem = field_name_problem(name)
    if problem is not None:
        raise SourceError(f"{where}: field name {brief(name)} {problem}")


def build_plan(
    scanned: Iterable[tuple[str, dict[str, MemberHeader]]],
    align: int,
    casts: Mapping[str, np.dtype] | None = None,
    rows: bool = False,
    max_payload_nbytes: int | None = None,
    allow_empty: bool = False,
) -> Plan:
    """Check that the sources agree and lay out the payload.

    ``scanned`` yields, for each source in order, its path and its members'
    headers (the selected keys only); see PlanBuilder for the rest. With no
    usable source at all, plans an empty dataset if ``allow_empty``, else raises.
    """
    builder = PlanBuilder(align, casts, rows, max_payload_nbytes)
    sources: list[str] = []
    for path, members in scanned:
        builder.add(path, members)
        sources.append(path)
    return builder.finish(sources, allow_empty)


class PendingSource(NamedTuple):
    """A source checked against those before it, not yet recorded."""

    source: str
    collectors: dict[str, _FieldCollector]
    dims: tuple[array[int], ...]  # per field, in the collectors' order
    num_rows: int  # samples the source holds
    cast: tuple[bool, ...]  # per field: whether the source's values are cast to the stored dtype

    def stored_dtype(self, key: str) -> np.dtype:
        return self.collectors[key].dtype


class PlanBuilder:
    """Checks sources one at a time, in sample order, and plans the layout at the end.

    The one home of the agreement rules (the same keys, dtypes and ndim in
    every source; casts; sample and size limits) for the converter, which
    adds scanned headers, and the Python Writer, which adds appended arrays.
    ``casts`` maps keys to the dtype they are stored as. With ``rows``, every
    array of a source shares its first dimension, which indexes samples.
    ``max_payload_nbytes`` (the space free for the output) bounds the
    per-sample tables. Only compact per-sample arrays are kept, no names.
    """

    def __init__(
        self,
        align: int,
        casts: Mapping[str, np.dtype] | None = None,
        rows: bool = False,
        max_payload_nbytes: int | None = None,
        hints: Hints = CLI_HINTS,
        fixed: Collection[str] = (),
    ) -> None:
        self.align = align
        self.hints = hints
        self.casts = dict(casts or {})
        self.fixed = frozenset(fixed)  # only checked to name fields here; see shapes.find_unfixed
        self.rows = rows
        self.max_payload_nbytes = max_payload_nbytes
        self.collectors: dict[str, _FieldCollector] = {}
        self.counts: array[int] = array("q")
        self.num_samples = 0
        self.first_source = ""
        self.first_members: dict[str, MemberHeader] = {}  # the first source's, for merge

    @property
    def num_sources(self) -> int:
        return len(self.counts)

    def source_dtypes(self) -> dict[str, list[np.dtype]]:
        """Each key's source dtypes met so far, those of the sources taken among them."""
        return {key: list(collector.seen_dtypes) for key, collector in self.collectors.items()}

    def first_shape(self, key: str) -> tuple[int, ...]:
        """The sample shape ``key`` has in the first sample recorded (files mode)."""
        collector = self.collectors[key]
        return tuple(collector.dims[: collector.ndim])

    def add(self, source: str, members: Mapping[str, MemberHeader]) -> None:
        """Check one source (``source`` names it in messages) and record it."""
        pending = self.check(source, members)
        if not self.counts:
            self.first_members = dict(members)
        self.record(pending)

    def merge(self, other: PlanBuilder, sources: Sequence[str]) -> None:
        """Record the sources ``other`` accepted, named ``sources``, as ``add`` would one by one.

        ``other`` (built with the same casts and rows) checked each of its
        sources against its own first; here that first one is checked against
        this builder's sources and the limits against the totals, so the
        same sources pass, and the first one past a limit raises the same
        error. (A source that disagreed within ``other`` is for the caller
        to add again one by one: only then does its message name this
        builder's first source.)
        """
        if not other.counts:
            return
        pending = self.check(sources[0], other.first_members)
        counts = np.frombuffer(other.counts, dtype=np.int64)
        totals = self.num_samples + np.cumsum(counts)
        past = np.flatnonzero(self._past_limits(totals, len(other.collectors)))
        if past.size:
            k = int(past[0])
            self._check_limits(sources[k], int(counts[k]), int(totals[k]), len(other.collectors))
        if not self.counts:
            self.collectors = pending.collectors
            self.first_source, self.first_members = sources[0], other.first_members
        for mine, theirs in zip(self.collectors.values(), other.collectors.values(), strict=True):
            mine.dims.extend(theirs.dims)
            mine.saw(theirs.seen_dtypes)
            mine.cast_files.extend(array("q", [self.num_sources + k for k in theirs.cast_files]))
        self.counts.extend(other.counts)
        self.num_samples += other.num_samples

    def _past_limits(self, num_samples: NDArray[np.int64], num_fields: int) -> NDArray[np.bool_]:
        """Where running sample totals break a limit _check_limits enforces."""
        past = num_samples > MAX_NUM_SAMPLES
        if self.max_payload_nbytes is not None and num_fields:  # a*b > m exactly when a > m // b
            past |= num_samples > self.max_payload_nbytes // (num_fields * CRC_DTYPE.itemsize)
        return past

    def _check_limits(self, source: str, count: int, num_samples: int, num_fields: int) -> None:
        """SourceError naming ``source`` if its ``count`` samples bring the dataset to too many."""
        if num_samples > MAX_NUM_SAMPLES:
            raise SourceError(f"{source}: brings the dataset past {MAX_NUM_SAMPLES} samples")
        _check_table_space(source, count, num_samples, num_fields, self.max_payload_nbytes)

    def check(self, source: str, members: Mapping[str, MemberHeader]) -> PendingSource:
        """Check one source against those before it without recording it.

        Raises SourceError naming ``source`` (and the key) when it differs
        from the first source, has a field name a dataset may not hold, or
        would take the dataset past its limits.
        """
        if not self.counts or members.keys() != self.collectors.keys():  # else checked in the first
            for key in members:
                check_field_name(key, source)
        count = _count_rows(source, members) if self.rows else 1
        num_samples = self.num_samples + count
        self._check_limits(source, count, num_samples, len(members))
        if not self.counts and not members:
            raise SourceError(f"{source}: holds no arrays")
        collectors = self.collectors if self.counts else self._first_collectors(source, members)
        if members.keys() != collectors.keys():
            raise Disagreement(
                _describe_key_mismatch(source, sorted(members), sorted(collectors), self.first_source),
                self.hints.keys.removeprefix("; "),
            )
        checked, dtype_problems = [], []
        for key, collector in collectors.items():
            try:
                checked.append(collector.check(members[key], source))
            except Disagreement as exc:
                if not exc.dtypes:
                    raise
                dtype_problems.append(exc)  # every key whose dtype differs, named at once
        if len(dtype_problems) == 1:
            raise dtype_problems[0]
        if dtype_problems:
            raise joined_disagreements(dtype_problems, self.hints)
        dims = tuple(member_dims for member_dims, _ in checked)
        return PendingSource(source, collectors, dims, count, tuple(cast for _, cast in checked))

    def _first_collectors(
        self, source: str, members: Mapping[str, MemberHeader]
    ) -> dict[str, _FieldCollector]:
        collectors = {
            key: _FieldCollector(members[key], source, self.casts.get(key), self.rows, self.hints)
            for key in sorted(members)
        }
        unknown = sorted(set(self.casts) - set(collectors))
        if unknown:
            repeat = self.hints.one_cast_each if any("=" in key for key in unknown) else ""
            raise UnknownKeyError(
                f"{source}: {self.hints.casts_named} key(s) {quoted(unknown)} that are not converted{repeat}"
            )
        unknown = sorted(self.fixed - set(collectors))
        if unknown:
            option = self.hints.fixed.format(key=unknown[0])
            raise UnknownKeyError(
                f"{source}: {option} names no field of the dataset (its fields: {quoted(collectors)})"
            )
        return collectors

    def record(self, pending: PendingSource) -> None:
        """Record a source ``check`` accepted; nothing here can fail."""
        if not self.counts:
            self.collectors = pending.collectors
            self.first_source = pending.source
        for collector, dims, cast in zip(self.collectors.values(), pending.dims, pending.cast, strict=True):
            collector.dims.extend(dims)
            if cast:
                collector.cast_files.append(self.num_sources)
        self.counts.append(pending.num_rows)
        self.num_samples += pending.num_rows

    def forget(self, num_sources: int) -> None:
        """Forget every source recorded after the first ``num_sources``, as if never recorded;
        also the traces of a ``record`` cut short (by an interrupt)."""
        del self.counts[num_sources:]
        self.num_samples = sum(self.counts)
        for collector in self.collectors.values():
            del collector.dims[self.num_samples * collector.ndim :]
        if not self.counts:
            self.collectors, self.first_source = {}, ""

    def finish(self, sources: Sequence[str], allow_empty: bool = False) -> Plan:
        """Lay out the sources recorded, named in ``sources`` (what sources.jsonl lists).

        With none recorded, plans an empty dataset if ``allow_empty``, else raises SourceError.
        """
        mode = "rows" if self.rows else "files"
        if not self.counts:
            return _nothing_usable(self.align, mode, allow_empty)
        starts = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(self.counts, dtype=np.int64), out=starts[1:])
        fields = [
            (name, c.dtype, c.shapes(self.num_samples), bool(c.cast_files))
            for name, c in self.collectors.items()
        ]
        cast_files = {
            name: np.frombuffer(c.cast_files, dtype=np.int64)
            for name, c in self.collectors.items()
            if c.cast is not None
        }
        return dataclasses.replace(lay_out(sources, fields, self.align, starts, mode), cast_files=cast_files)


def _check_table_space(
    path: str, count: int, num_samples: int, num_fields: int, max_payload_nbytes: int | None
) -> None:
    """Refuse, before planning them in memory, rows whose checksum tables alone cannot be written."""
    table_nbytes = num_samples * num_fields * CRC_DTYPE.itemsize
    if max_payload_nbytes is not None and table_nbytes > max_payload_nbytes:
        raise SourceError(
            f"{path}: its {count:,} rows bring the dataset to {num_samples:,} samples, whose "
            f"checksum tables alone need {table_nbytes:,} bytes, more than the {max_payload_nbytes:,} "
            "bytes free for the output"
        )


def _count_rows(path: str, members: Mapping[str, MemberHeader]) -> int:
    """The number of samples a file holds in rows mode: the first dimension all its arrays share."""
    firsts = {}
    for key, header in members.items():
        if not header.shape:
            raise SourceError(
                f"{path}[{key}]: a 0-d array has no rows; --rows needs every array to have axis 0"
            )
        firsts[key] = header.shape[0]
    if len(set(firsts.values())) > 1:
        detail = ", ".join(f"{key} has {n}" for key, n in sorted(firsts.items()))
        raise SourceError(f"{path}: keys disagree on the number of rows (first dimension): {detail}")
    return next(iter(firsts.values()), 0)


def drop_files(plan: Plan, files: Iterable[int], allow_empty: bool = False) -> Plan:
    """The same plan without some files (that turned out bad while copying) and their samples."""
    dropped = set(files)
    keep = np.ones(plan.num_samples, dtype=bool)
    for k in dropped:
        first, count = plan.file_rows(k)
        keep[first : first + count] = False
    kept_files = [k for k in range(len(plan.sources)) if k not in dropped]
    if not kept_files:
        return _nothing_usable(plan.align, plan.mode, allow_empty)
    counts = np.diff(plan.file_starts)[kept_files]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    kept = np.array(kept_files, dtype=np.int64)
    cast_files = {
        name: np.searchsorted(kept, files[np.isin(files, kept)]) for name, files in plan.cast_files.items()
    }
    fields = [
        (f.name, f.dtype, f.shapes[keep], bool(len(cast_files[f.name])) if f.name in cast_files else f.cast)
        for f in plan.fields
    ]
    laid_out = lay_out([plan.sources[k] for k in kept_files], fields, plan.align, starts, plan.mode)
    return dataclasses.replace(laid_out, cast_files=cast_files)


def _nothing_usable(align: int, mode: str, allow_empty: bool) -> Plan:
    if not allow_empty:
        raise SourceError("no usable input: --skip-bad left out every one")
    return empty_plan(align, mode)


def empty_plan(align: int, mode: str = "files") -> Plan:
    """A dataset of no samples and, with no file to learn them from, no fields."""
    return lay_out([], [], align, np.zeros(1, dtype=np.int64), mode)


def _describe_key_mismatch(path: str, found: list[str], expected: list[str], first: str) -> str:
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    parts = [f"missing {quoted(missing)}" if missing else "", f"extra {quoted(extra)}" if extra else ""]
    detail = "; ".join(p for p in parts if p)
    return f"{path}: keys differ from {first} ({detail})"


