"""A dataset's schema as Python code reads it: each field's dtype and its shape in every sample."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..format.index import SampleShape


class Feature(NamedTuple):
    """What one field holds in each sample: its dtype and shape, where a ragged field (whose
    samples differ in shape) has None in each dimension in which its samples differ, as
    ``(None, 4)`` for boxes: Hugging Face's ``Array2D(shape=(None, 4))``."""

    dtype: np.dtype
    shape: SampleShape
    ndim: int

    @property
    def ragged(self) -> bool:
        return None in self.shape

    def __repr__(self) -> str:
        return f"Feature(dtype={self.dtype}, shape={self.shape})"
