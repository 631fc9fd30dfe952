"""A dataset's schema as Python code reads it: each field's dtype and shape, or ragged ndim."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol

import numpy as np


class Feature(NamedTuple):
    """What one field holds in each sample: its dtype and shape, or, for a ragged field (whose
    samples differ in shape), None and the number of dimensions they share."""

    dtype: np.dtype
    shape: tuple[int, ...] | None
    ndim: int

    @property
    def ragged(self) -> bool:
        return self.shape is None

    def __repr__(self) -> str:
        if self.shape is None:
            return f"Feature(dtype={self.dtype}, ragged, ndim={self.ndim})"
        return f"Feature(dtype={self.dtype}, shape={self.shape})"


class _Described(Protocol):
    """A field as an index (Field) or a dataset of parts (FieldInfo) describes it."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def ndim(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...] | None: ...


def features_of(fields: Iterable[_Described]) -> dict[str, Feature]:
    """Each field's Feature, by name, in the order given."""
    return {f.name: Feature(f.dtype, f.shape, f.ndim) for f in fields}
