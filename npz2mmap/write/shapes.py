"""The sample shapes a field's sources take: fields nearly fixed, and fields held fixed.

A field is stored ragged as soon as one source differs from the others, so
one image saved (96, 96, 3) among (3, 96, 96) ones converts without a word
and fails far away, in training. Counted over the sources that hold samples
(files, sample directories, a Writer's samples; in rows mode every row of a
file has the same shape, so files count, not rows), a ragged field is
*nearly fixed* when

- its sources take at most MAX_SHAPES distinct sample shapes,
- the most common of them is held by more than half of the sources, and
- the sources of other shapes number at most 1% of them, or just one.

Variable-length data (sequences, point clouds, boxes) takes many distinct
shapes, or has many sources off its most common one, so is not reported: a
corpus of sequences whose lengths are all distinct fails the first
condition, one where 1% of the sources take lengths of their own fails it
too once those are more than MAX_SHAPES - 1. The counting stops as soon as
MAX_SHAPES shapes are passed, so the work is a few vectorised passes over the
plan's shape table, with no per-sample Python objects.

A field held fixed (``--fixed KEY``) must have the first source's sample shape
in every source that holds samples; find_unfixed finds those that differ. The
first, not the most common: a Writer must decide at each append, and convert
decides the same, so that both write the same bytes for the same samples. A
part of a conversion (``--part``) holds its sources to the first source of the
whole input list, so that its parts refuse what one conversion would.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..errors import FixedShapeError
from ..text import plural
from .casts import CLI_HINTS, Hints
from .layout import FieldPlan, Plan
from .plan import drop_files

MAX_SHAPES = 4
MAX_ODD_PERCENT = 1


@dataclass(frozen=True)
class NearlyFixed:
    """A ragged field whose sources nearly all share one sample shape: the others are likely mistakes."""

    field: str
    shape: tuple[int, ...]  # the most common sample shape
    num_sources: int  # sources holding samples of the field
    num_odd: int  # those of another shape
    first_odd: int  # the first of them, as an index into the plan's sources
    first_odd_source: str  # its name in sources.jsonl
    first_odd_shape: tuple[int, ...]
    first_is_odd: bool = False  # the first source holding samples is one of those that differ

    def held_fixed_keeps_an_odd_shape(self) -> bool:
        """Whether holding the field fixed would keep the odd shape: it keeps the first source's."""
        return self.first_is_odd


def find_nearly_fixed(plan: Plan) -> tuple[NearlyFixed, ...]:
    """The fields of ``plan`` that the module's rule reports, in field order."""
    found = (_nearly_fixed_field(plan, field) for field in plan.fields if field.fixed_shape is None)
    return tuple(item for item in found if item is not None)


def _nearly_fixed_field(plan: Plan, field: FieldPlan) -> NearlyFixed | None:
    holders, shapes = source_shapes(plan, field)
    counts = count_distinct_shapes(shapes, MAX_SHAPES)
    if counts is None or len(counts) < 2:
        return None
    num_sources = len(shapes)
    common_row, common_count = max(counts, key=lambda item: item[1])  # the first seen of equal counts
    num_odd = num_sources - common_count
    if 2 * common_count <= num_sources or (num_odd > 1 and 100 * num_odd > MAX_ODD_PERCENT * num_sources):
        return None
    odd_row = min(row for row, _ in counts if row != common_row)
    first_odd = int(holders[odd_row])
    return NearlyFixed(
        field=field.name,
        shape=_shape(shapes[common_row]),
        num_sources=num_sources,
        num_odd=num_odd,
        first_odd=first_odd,
        first_odd_source=plan.sources[first_odd],
        first_odd_shape=_shape(shapes[odd_row]),
        first_is_odd=odd_row == 0,
    )


def source_shapes(plan: Plan, field: FieldPlan) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The sources holding samples (indices into ``plan.sources``) and the sample shape of each.

    In files mode that is every source and the field's own shape table (no copy).
    """
    if plan.mode == "files":
        return np.arange(len(plan.sources), dtype=np.int64), field.shapes
    counts = np.diff(plan.file_starts)
    holders = np.flatnonzero(counts > 0)
    return holders, field.shapes[plan.file_starts[holders]]


def count_distinct_shapes(shapes: NDArray[np.int64], limit: int) -> list[tuple[int, int]] | None:
    """(first row, count) of each distinct row of ``shapes``, in order of first appearance;
    None once there are more than ``limit`` (one vectorised pass per distinct row)."""
    matched = np.zeros(len(shapes), dtype=bool)
    found: list[tuple[int, int]] = []
    while not matched.all():
        if len(found) == limit:
            return None
        row = int(np.argmin(matched))  # the first row not matched yet
        same = (shapes == shapes[row]).all(axis=1)
        found.append((row, int(same.sum())))
        matched |= same
    return found


def describe_nearly_fixed(item: NearlyFixed, unit: str, first_odd: str, advice: str) -> str:
    """One line on ``item``: ``unit`` names a source ("file"), ``first_odd`` the first that differs."""
    differ = "differs" if item.num_odd == 1 else "differ"
    return (
        f"field {item.field} is ragged only because {item.num_odd:,} of {plural(item.num_sources, unit)} "
        f"{differ} from shape {item.shape}: the first, {first_odd}, has {item.first_odd_shape}; {advice}"
    )


@dataclass(frozen=True)
class HeldShape:
    """The sample shape a field held fixed must keep, and the source that set it."""

    shape: tuple[int, ...]
    source: str


def find_unfixed(
    plan: Plan, fixed: Collection[str], earlier: Mapping[str, HeldShape] | None = None
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The sources, in order, whose sample shape differs from the held one for a key in
    ``fixed`` (``earlier``'s, else the first source's), and for each the index in
    ``plan.fields`` of the first such field. Vectorised: a field held fixed that is ragged
    throughout costs no Python work per source."""
    breaks = np.full(len(plan.sources), -1, dtype=np.int64)
    for j, field in enumerate(plan.fields):
        held = (earlier or {}).get(field.name)
        if field.name not in fixed or (field.fixed_shape is not None and held is None):
            continue
        holders, shapes = source_shapes(plan, field)
        if not len(holders):  # rows mode, every file empty
            continue
        if held is None:
            differing = holders[(shapes != shapes[0]).any(axis=1)]
        elif len(held.shape) != shapes.shape[1]:
            differing = holders
        else:
            differing = holders[(shapes != np.array(held.shape, dtype=np.int64)).any(axis=1)]
        breaks[differing[breaks[differing] < 0]] = j
    sources = np.flatnonzero(breaks >= 0)
    return sources, breaks[sources]


def held_shapes(plan: Plan, fixed: Collection[str]) -> dict[str, HeldShape]:
    """For each field in ``fixed``, the sample shape of the first source holding samples."""
    held = {}
    for field in plan.fields:
        holders, shapes = source_shapes(plan, field)
        if field.name in fixed and len(holders):
            held[field.name] = HeldShape(_shape(shapes[0]), plan.sources[int(holders[0])])
    return held


def describe_unfixed(plan: Plan, k: int, field: FieldPlan, hints: Hints, held: HeldShape) -> str:
    """Why source ``k`` breaks ``--fixed`` for ``field``: its shape and the held one, both named."""
    return unfixed_problem(
        f"{plan.sources[k]}[{field.name}]",
        _shape(field.shapes[int(plan.file_starts[k])]),
        held.shape,
        held.source,
        hints.fixed.format(key=field.name),
        rows=plan.mode == "rows",
    )


def unfixed_problem(
    where: str, found: tuple[int, ...], expected: tuple[int, ...], first: str, option: str, rows: bool = False
) -> str:
    """The message for a sample shape ``found`` at ``where`` that ``option`` holds to ``expected``."""
    what = f"rows of shape {found} differ" if rows else f"shape {found} differs"
    return f"{where}: {what} from {expected} in {first}, and {option} requires one shape"


def _shape(row: NDArray[np.int64]) -> tuple[int, ...]:
    return tuple(int(d) for d in row)


def hold_fixed(
    plan: Plan,
    locations: np.ndarray,
    fixed: Sequence[str],
    skip_bad: bool,
    skipped: list[tuple[str, str]],
    part: tuple[int, int] | None,
    earlier: dict[str, HeldShape] | None = None,
) -> tuple[Plan, np.ndarray]:
    """The plan and member locations without the files whose sample shape breaks ``fixed``
    (the shape ``earlier`` holds, else the first file's), each listed in ``skipped``; without
    ``skip_bad``, FixedShapeError naming the first of them instead."""
    differing, fields = find_unfixed(plan, fixed, earlier)
    if not len(differing):
        return plan, locations
    held = {**held_shapes(plan, fixed), **(earlier or {})}

    def reason(k: int, j: int) -> str:
        return describe_unfixed(plan, k, plan.fields[j], CLI_HINTS, held[plan.fields[j].name])

    if not skip_bad:
        raise FixedShapeError(reason(int(differing[0]), int(fields[0])) + CLI_HINTS.fixed_way_out)
    skipped.extend(
        (plan.sources[k], reason(k, j)) for k, j in zip(differing.tolist(), fields.tolist(), strict=True)
    )
    kept = np.ones(len(plan.sources), dtype=bool)
    kept[differing] = False
    return drop_files(plan, differing.tolist(), allow_empty=part is not None), locations[kept]


class Replan:
    """The plan held to ``--fixed`` shapes, from the scan's plan without given files: a file
    the copy finds bad may be the first, whose shape the others were held to."""

    def __init__(
        self,
        scanned: Plan,
        locations: np.ndarray,
        fixed: Sequence[str],
        skip_bad: bool,
        skipped: list[tuple[str, str]],
        part: tuple[int, int] | None,
        earlier: dict[str, HeldShape],
    ) -> None:
        self.scanned, self.locations, self.fixed, self.skip_bad = scanned, locations, fixed, skip_bad
        self.skipped, self.part, self.earlier = skipped, part, earlier
        self.held_out: list[tuple[str, str]] = []

    def without(self, bad: Collection[str]) -> tuple[Plan, np.ndarray]:
        """The plan of the scanned files but ``bad``, held to --fixed (its own files left out
        listed in ``skipped`` in place of those of the plan before)."""
        dropped = set(self.held_out)
        self.skipped[:] = [entry for entry in self.skipped if entry not in dropped]
        kept = np.array([path not in bad for path in self.scanned.sources], dtype=bool)
        plan = drop_files(self.scanned, np.flatnonzero(~kept).tolist(), allow_empty=self.part is not None)
        self.held_out = []
        held = hold_fixed(
            plan, self.locations[kept], self.fixed, self.skip_bad, self.held_out, self.part, self.earlier
        )
        self.skipped.extend(self.held_out)
        return held
