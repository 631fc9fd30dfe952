"""npz2mmap: convert many NPZ files once into one memory-mapped blob for PyTorch.

``MmapDataset`` is imported lazily so that the CLI and the converter never
import torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = [
    "BlockShuffleSampler",
    "DatasetReader",
    "Feature",
    "LengthGroupedSampler",
    "MmapDataset",
    "MmapLoader",
    "Npz2mmapError",
    "PaddedCollate",
    "ShuffleSampler",
    "Writer",
    "collate",
    "convert",
    "merge",
    "__version__",
]

_LAZY = {
    "BlockShuffleSampler": "pytorch.samplers",
    "DatasetReader": "read.reader",
    "Feature": "read.features",
    "LengthGroupedSampler": "pytorch.samplers",
    "MmapDataset": "pytorch.dataset",
    "MmapLoader": "pytorch.loader",
    "Npz2mmapError": "errors",
    "PaddedCollate": "pytorch.padding",
    "ShuffleSampler": "pytorch.samplers",
    "Writer": "write.writer",
    "collate": "pytorch.collate",
    "convert": "write.conversion",
    "merge": "write.merge",
}

if TYPE_CHECKING:
    from .errors import Npz2mmapError
    from .pytorch.collate import collate
    from .pytorch.dataset import MmapDataset
    from .pytorch.loader import MmapLoader
    from .pytorch.padding import PaddedCollate
    from .pytorch.samplers import BlockShuffleSampler, LengthGroupedSampler, ShuffleSampler
    from .read.features import Feature
    from .read.reader import DatasetReader
    from .write.conversion import convert
    from .write.merge import merge
    from .write.writer import Writer


def __getattr__(name: str) -> Any:
    """Import on first use, so that ``import npz2mmap`` never pulls in torch.

    Raises ImportError with the command that installs torch for this very
    Python when a name needs torch and torch is missing (the extra,
    ``npz2mmap[torch]``, installs only from a package index, not a clone).
    """
    if name not in _LAZY:
        raise AttributeError(f"module 'npz2mmap' has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
    except ImportError as exc:
        if exc.name != "torch":
            raise
        raise ImportError(
            f"npz2mmap.{name} needs PyTorch, which is not installed in this Python: "
            f"{sys.executable} -m pip install torch",
            name="torch",
        ) from exc
    return getattr(module, name)


def __dir__() -> list[str]:
    """The public names too, though they are imported only on first use (tab completion)."""
    return sorted(set(globals()) | set(__all__))
