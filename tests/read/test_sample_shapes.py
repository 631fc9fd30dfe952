"""A field's shape in every sample (None where samples differ), as the index records it and as
readers of parts combine it: checked against the samples' own shapes, whatever made the parts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npz2mmap
from npz2mmap.read.parts import Parts, PartsReader
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.merge import merge


def oracle(shapes: list[tuple[int, ...]]) -> tuple[int | None, ...]:
    """Each dimension's length where every sample has the same one, else None."""
    return tuple(dims[0] if len(set(dims)) == 1 else None for dims in zip(*shapes, strict=True))


@st.composite
def split_shapes(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], list[int]]:
    """Sample shapes of one ndim (dimensions often equal) and a split of them into parts."""
    ndim = draw(st.integers(1, 3))
    lengths = st.sampled_from([0, 1, 2, 3])
    shapes = draw(st.lists(st.tuples(*[lengths] * ndim), min_size=1, max_size=7))
    cuts = sorted(draw(st.lists(st.integers(0, len(shapes)), max_size=3)))
    return shapes, cuts


@pytest.mark.filterwarnings("ignore::npz2mmap.errors.RaggedFieldWarning")  # shapes that differ rarely
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=split_shapes())
def test_parts_read_as_one_record_and_combine_the_shape_every_sample_has(tmp_path_factory, case) -> None:
    shapes, cuts = case
    root = tmp_path_factory.mktemp("shapes")
    bounds = [0, *cuts, len(shapes)]
    slices = list(zip(bounds, bounds[1:], strict=False))
    parts = []
    for k, (first, end) in enumerate(slices):  # empty parts too, which contribute nothing
        with npz2mmap.Writer(root / "p{part}", part=(k, len(slices))) as writer:
            for shape in shapes[first:end]:
                writer.append({"x": np.ones(shape, np.int16)})
        parts.append(writer.out_dir)
        if end > first:  # each part records its own samples' shape
            assert DatasetReader(writer.out_dir).sample_shape("x") == oracle(shapes[first:end])
    want = oracle(shapes)
    assert PartsReader(Parts(parts)).sample_shape("x") == want
    copied = merge(parts, root / "copy", copy=True).out_dir
    assert DatasetReader(copied).sample_shape("x") == want
    assert Parts(parts).field("x").shape == (want if None not in want else None)
