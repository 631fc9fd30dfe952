"""The on-disk format (docs/FORMAT.md): the index and its checks, manifest.json, the provenance files.

Pure: it neither imports torch nor writes a dataset; it reads a dataset's
small files with bounds, and says what is valid.
"""
