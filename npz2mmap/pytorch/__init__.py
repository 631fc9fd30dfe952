"""PyTorch: the only modules that import torch. ``MmapDataset``, the batch plan and its
assembler, collate and padding, samplers, ``MmapLoader`` and its worker ring."""
