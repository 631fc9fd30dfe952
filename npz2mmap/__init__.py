"""npz2mmap: convert many NPZ files once into one memory-mapped blob for PyTorch.

``MmapDataset`` is imported lazily so that the CLI and the converter never
import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["DatasetReader", "MmapDataset", "Npz2mmapError", "convert", "__version__"]

if TYPE_CHECKING:
    from .converter import convert
    from .dataset import MmapDataset
    from .errors import Npz2mmapError
    from .reader import DatasetReader


def __getattr__(name: str) -> Any:
    if name == "MmapDataset":
        from .dataset import MmapDataset

        return MmapDataset
    if name == "DatasetReader":
        from .reader import DatasetReader

        return DatasetReader
    if name == "convert":
        from .converter import convert

        return convert
    if name == "Npz2mmapError":
        from .errors import Npz2mmapError

        return Npz2mmapError
    raise AttributeError(f"module 'npz2mmap' has no attribute {name!r}")
