"""The exceptions npz2mmap raises; the CLI turns them into one-line errors."""


class Npz2mmapError(Exception):
    """Base class of every error npz2mmap raises on purpose."""


class SourceError(Npz2mmapError):
    """An input NPZ file is unusable; the message names the file and member."""


class MismatchError(SourceError):
    """Sources disagree on keys, dtype or number of dimensions; the message names the one that differs."""


class KeyAbsentError(MismatchError):
    """A source lacks a key the conversion selects (--keys): ``key``, beside the keys it has."""

    def __init__(self, message: str, path: str, key: str, available: tuple[str, ...]) -> None:
        self.path, self.key, self.available = path, key, available
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[str, str, str, tuple[str, ...]]]:
        return type(self), (str(self), self.path, self.key, self.available)


class FormatError(Npz2mmapError):
    """A converted dataset is missing, malformed or from an unsupported version."""


class OutputError(Npz2mmapError):
    """The output location cannot be written as asked (exists, inside an input, ...)."""


class WorkerError(Npz2mmapError, RuntimeError):
    """A loader's worker process failed or died; the message names the worker and the batch."""


class DatasetInputError(SourceError):
    """An input is an npz2mmap dataset (or its blob), not a source: refused even with --skip-bad."""


class FixedShapeError(SourceError):
    """A source's sample shape differs, for a field held fixed (--fixed), from the first source's."""


class MissingInputError(SourceError):
    """An input path names nothing; the CLI reports it as a usage error (exit 2)."""


class NamedNpyError(SourceError):
    """A .npy file named (or matched by a pattern) with --sample-dirs, where a sample is a
    directory; the CLI reports it as a usage error (exit 2)."""


class UnknownKeyError(SourceError):
    """An option names a key the sources do not hold; the CLI reports it as a usage error (exit 2)."""


class RaggedFieldWarning(UserWarning):
    """A field is stored ragged only because a few samples differ from a shape nearly all share."""


class LargerThanMemoryWarning(UserWarning):
    """A dataset's blobs do not fit in the memory this process may use: the page cache cannot keep them."""


class UnclosedWriterWarning(UserWarning):
    """A Writer was collected (or the interpreter ended) before close(): nothing was written at OUT."""


class SameEpochWarning(UserWarning):
    """A sampler runs over an epoch it has run to its end, in the same order: set_epoch was not called."""
