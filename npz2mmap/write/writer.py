"""Writing a dataset straight from Python: samples appended one by one, stored as convert stores them.

Each ``append`` is checked at once by the converter's PlanBuilder (same keys,
dtypes and ndim as the first sample; casts; limits), and each field's stored
bytes (C order, every value little-endian, record padding as in memory, a
cast checked value by value: ``elements.stored_pieces``) stream to a spool
file of that field beside OUT, so memory holds only compact per-sample tables.
``close`` lays the payload out with the converter's planner, copies each spool
into its field's region of a blob made by the converter's writer, writes the
tables, provenance and index the same way and publishes atomically: the
directory is byte-identical to ``convert`` of NPZ files holding the same arrays.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref
from array import array
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

import numpy as np

from .. import fsutil
from ..errors import FixedShapeError, OutputError, RaggedFieldWarning, SourceError, UnclosedWriterWarning
from ..format.index import BLOB_HEADER_NBYTES, BLOB_NAME, MIN_ALIGN
from ..parallel import (
    SIGNAL_MASK_FRAMES,
    interrupts_blocked,
    keeps_signal_mask,
    restore_signal_mask,
    signal_mask,
)
from ..text import brief, printable
from . import blob_writer, publish
from .casts import WRITER_HINTS
from .layout import Plan
from .options import PartOption, WriteOptions, check_flags
from .plan import PendingSource, PlanBuilder, check_field_name
from .shapes import NearlyFixed, describe_nearly_fixed, find_nearly_fixed, unfixed_problem
from .spools import Marks, SourceNames, Spool, array_header


class Writer:
    """Write a dataset at ``out_dir`` from samples appended in Python, like ``convert`` of NPZ files.

    ::

        with npz2mmap.Writer("data.mmap") as w:
            for x, y in items:
                w.append({"x": x, "y": y})

    Each sample is a dict of field name to array (numpy arrays and scalars;
    anything else goes through ``np.asarray``). ``casts``, ``align`` and
    ``overwrite`` are ``convert``'s. Each key in ``fixed`` must keep the first
    sample's shape: ``append`` refuses a sample that differs. At close, a
    ``RaggedFieldWarning`` names each ragged field that only a few samples
    keep from being fixed (see npz2mmap.write.shapes), as ``nearly_fixed`` does
    from then on. With ``part=(i, n)``, ``"I/N"`` or
    ``"auto"`` (from torchrun's or Slurm's environment), the dataset is part i
    of n and goes to OUT/part-IIIII (or OUT with ``{part}`` replaced), as
    ``convert`` writes a part; a part may hold no samples, and ``npz2mmap merge`` joins the parts.

    Nothing appears at OUT before ``close`` succeeds; until then the output
    lock is held, so no other writer or conversion to OUT can run. An
    exception in the ``with`` block, or ``abort()``, removes everything
    written. A Ctrl-C leaves the writer consistent wherever it strikes (see
    ``append``); one in ``close`` leaves OUT the old dataset or the new one.
    Memory stays bounded (a few compact numbers per sample); disk needs
    about twice the dataset's size while closing (the spooled fields and
    the blob they are copied into). A writer never closed is discarded
    like ``abort()`` when it is collected or the interpreter exits, with an
    ``UnclosedWriterWarning`` saying that nothing was written. Not
    thread-safe; in a forked child every call raises ValueError, and the
    child does not hold the output lock.

    Raises OutputError when OUT exists (without ``overwrite``), is being
    written by another process, or cannot be written; ValueError for a bad
    ``align``, ``casts`` or ``part``.
    """

    @keeps_signal_mask  # taking OUT's lock holds Ctrl-C back for a moment: never for longer
    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        casts: Mapping[str, np.dtype | str] | None = None,
        fixed: Iterable[str] | None = (),
        align: int = MIN_ALIGN,
        overwrite: bool = False,
        part: PartOption = None,
    ) -> None:
        options = WriteOptions.checked(out_dir, part=part, align=align, casts=casts, fixed=fixed)
        check_flags(overwrite=overwrite)
        self._fixed = options.fixed
        self.nearly_fixed: tuple[NearlyFixed, ...] = ()  # set by close
        self.part, self.out_dir = options.part, options.out_dir
        self._overwrite = overwrite
        publish.check_output(self.out_dir, overwrite)
        self._owner_pid = os.getpid()
        self._stack = _Cleanups()
        self._finalizer = weakref.finalize(
            self, _discard_in_owner, self._stack, self._owner_pid, self.out_dir
        )
        try:
            locks: list[publish.OutputLock] = []  # filled before the call returns: see take_output_lock
            self._stack.callback(_release_all, locks)
            lock = publish.take_output_lock(self.out_dir, held_in=locks)
            _LOCK_FDS.add(lock.fd)
            self._stack.callback(_LOCK_FDS.discard, lock.fd)
            # The spools' directory and close's staging directory alike go with the lock's release.
            self._spool_dir = publish.make_staging_dir(self.out_dir)
            self._names = SourceNames(os.path.join(self._spool_dir, "sources"))
            self._stack.callback(self._names.spool.close)
            self._builder = PlanBuilder(
                options.align,
                options.casts,
                max_payload_nbytes=publish.free_nbytes(self.out_dir),
                hints=WRITER_HINTS,
                fixed=self._fixed,
            )
            self._spools: dict[str, Spool] = {}
            self._num_spools_made = 0
            self._crc32s: list[array[int]] = []  # per field, one CRC-32 per sample
            self._owed: Marks | None = None  # where an interrupted append must go back to, until it has
            self._closed = False
            self._published = False  # by close, once the dataset is at OUT
            self._close_began = False  # a close that began but did not publish wrote nothing
        except BaseException as exc:  # a Ctrl-C included: nothing is left for the garbage collector
            self._finalizer.detach()
            self._stack.close()
            if fsutil.is_io_error(exc):
                raise self._spool_error(exc) from exc
            raise

    def __repr__(self) -> str:
        state = "written" if self._published else "closed" if self._closed else "open"
        part = f", part={self.part}" if self.part is not None else ""
        return f"Writer({self.out_dir!r}{part}, samples={self.num_samples}, {state})"

    @property
    def num_samples(self) -> int:
        """Samples appended so far (a sample whose undo is still owed is not)."""
        owed = self._owed
        return self._builder.num_samples if owed is None else owed.num_samples

    def append(self, sample: Mapping[str, Any], source: str | os.PathLike[str] | None = None) -> None:
        """Add one sample; ``source`` names where it came from in sources.jsonl (empty when None;
        made absolute where it names a file or directory, as convert records its sources).

        Raises SourceError naming the sample (and its source) when it differs
        from the first sample in keys, dtype or ndim, or in shape for a key of
        ``fixed`` (FixedShapeError), holds objects, or a cast would change a
        value; UnknownKeyError when the first sample lacks a key of ``fixed``;
        TypeError for a sample that is not a dict. All
        or nothing: when append raises (a KeyboardInterrupt included) the
        sample is not in and the writer is as it was, usable; when it
        returns, the sample is in.
        """
        # Not the keeps_signal_mask wrapper: the sample goes in at the last statement, and no
        # call of ours returns after it, where a signal could still raise on the way out.
        mask = signal_mask()
        try:
            self._check_open()
            if not isinstance(sample, Mapping):
                raise TypeError(f"a sample is a dict of field name to array, not {type(sample).__name__}")
            if source is not None and not isinstance(source, (str, os.PathLike)):
                raise TypeError(f"source must be a str or a path, not {type(source).__name__}")
            name = "" if source is None else os.fspath(source)
            if not isinstance(name, str):
                raise TypeError(f"source must be a str or a path, not {type(source).__name__}")
            line = self._names.line(_recorded(name), f"sample {self.num_samples}")
            # Stored as given (sources.jsonl is JSON), shown escaped: a message stays one line.
            label = _sample_label(self.num_samples, name)
            arrays = {
                _field_name(key, label): _as_array(value, f"{label}[{key}]") for key, value in sample.items()
            }
            pending = self._builder.check(label, {key: array_header(key, a) for key, a in arrays.items()})
            self._check_fixed(arrays, label)
            spools = [self._spool(key) for key in pending.collectors]
            # All or nothing, whenever a Ctrl-C strikes: the undo to these marks is owed from here
            # until the last step; the spools are written with Ctrl-C live, the sample is recorded
            # with it held back, and an exception (a Ctrl-C held back included, raised as the
            # recording ends) pays the undo, again with Ctrl-C held back, or leaves it owed for the
            # next call to pay, if a second Ctrl-C comes first.
            self._owed = self._marks(spools)
            try:
                crc32s = self._spool_sample(pending, arrays, line, label, spools)
                with interrupts_blocked():
                    self._record(pending, crc32s)
                self._owed = None
            except BaseException as exc:
                self._settle()
                if fsutil.is_io_error(exc):
                    raise self._spool_error(exc) from exc
                raise
        except BaseException:
            restore_signal_mask(mask)
            raise

    def _check_fixed(self, arrays: dict[str, np.ndarray], label: str) -> None:
        """FixedShapeError if a key of ``fixed`` has a shape other than the first sample's."""
        if not self._builder.num_sources:
            return
        for key in sorted(self._fixed):
            expected = self._builder.first_shape(key)
            if arrays[key].shape != expected:
                option = WRITER_HINTS.fixed.format(key=key)
                first = _sample_label(0, self._names[0])
                raise FixedShapeError(
                    unfixed_problem(f"{label}[{key}]", arrays[key].shape, expected, first, option)
                )

    def _spool_sample(
        self,
        pending: PendingSource,
        arrays: dict[str, np.ndarray],
        line: bytes,
        label: str,
        spools: list[Spool],
    ) -> list[int]:
        """Append one checked sample's stored bytes to its spools; its CRC-32 per field."""
        crc32s = [
            spool.write_stored(arrays[key], pending.stored_dtype(key), f"{label}[{key}]")
            for key, spool in zip(pending.collectors, spools, strict=True)
        ]
        self._names.spool.write(line)
        return crc32s

    def _marks(self, spools: list[Spool]) -> Marks:
        """What the writer holds now, for ``_settle`` to return to."""
        every_spool = (*spools, self._names.spool)
        return Marks(self._builder.num_sources, every_spool, tuple(spool.nbytes for spool in every_spool))

    def _record(self, pending: PendingSource, crc32s: list[int]) -> None:
        """Add a spooled sample to the tables; ``_settle`` takes it out again while the undo is owed."""
        self._crc32s = self._crc32s or [array("I") for _ in crc32s]
        for table, crc in zip(self._crc32s, crc32s, strict=True):
            table.append(crc)
        self._names.record(self._names.spool.nbytes)
        self._builder.record(pending)

    def _settle(self) -> None:
        """Pay an owed undo, with Ctrl-C held back: the spools cut back to the marks, the
        tables without what came after them."""
        with interrupts_blocked():
            marks = self._owed
            if marks is None:
                return
            for spool, nbytes in zip(marks.spools, marks.spool_nbytes, strict=True):
                spool.truncate(nbytes)
            self._builder.forget(marks.num_samples)
            del self._names.ends[marks.num_samples :]
            for table in self._crc32s:
                del table[marks.num_samples :]
            if not marks.num_samples:  # the next first sample may have other fields
                self._crc32s = []
            self._owed = None

    @keeps_signal_mask
    def close(self) -> None:
        """Write the dataset and publish it at ``out_dir``; nothing is left behind on error.

        Raises SourceError when no sample was appended (except for a part,
        which may be empty), OutputError when the dataset cannot be written.
        Warns RaggedFieldWarning for each field in ``nearly_fixed``.
        Closing a closed writer only finishes a removal a Ctrl-C cut short, and
        raises OutputError when that writer's close raised (a Ctrl-C included)
        without writing the dataset, so that a retry is never taken for success.
        """
        self._close(warn_stacklevel=3 + SIGNAL_MASK_FRAMES)  # the caller's line, past the mask's wrapper

    def _close(self, warn_stacklevel: int) -> None:
        """close(); warnings point ``warn_stacklevel`` frames up, at the caller's line."""
        self._check_owner()
        if self._closed:
            self._discard_surely()
            if self._close_began and not self._published:
                raise OutputError(
                    f"{self.out_dir}: not written: the earlier close() raised, and its samples were "
                    "discarded; append them to a new Writer"
                )
            return
        self._close_began = True
        try:
            try:
                self._settle()
                self._write()
            finally:
                self._discard()
        finally:  # a Ctrl-C that cut the discard short, even at its first instruction: again, till done
            self._discard_surely()
        for item in self.nearly_fixed:
            warnings.warn(_describe_nearly_fixed(item), RaggedFieldWarning, stacklevel=warn_stacklevel)

    @keeps_signal_mask
    def abort(self) -> None:
        """Discard everything appended; OUT stays as it was. Also finishes an abort a Ctrl-C cut short."""
        self._check_owner()
        self._discard_surely()

    def _discard_surely(self) -> None:
        """``_discard``, and when a Ctrl-C cuts it short, again until done before that Ctrl-C goes on.

        A Ctrl-C another thread took (a process-wide SIGINT can reach any thread) is raised even
        where this thread holds Ctrl-C back, so a burst of them can cut a discard short time and
        again; each try takes up where the last stopped, so the lock is free once the first
        KeyboardInterrupt is out. Those that cut the tries short are dropped, the signal mask
        put back as they left it (bounded: a storm that outlasts every try leaves the rest to
        the next call, or to garbage collection).
        """
        mask = signal_mask()
        try:
            self._discard()
        except KeyboardInterrupt:
            for _ in range(MAX_DISCARD_TRIES):
                restore_signal_mask(mask)
                try:
                    self._discard()
                    break
                except KeyboardInterrupt:
                    continue
            raise

    def _discard(self) -> None:
        """Close for good: spools removed, lock released, with Ctrl-C held back so that all of it is done.

        A discard cut short leaves the rest to the next call, or to garbage collection.
        """
        with interrupts_blocked():
            self._closed = True
            self._stack.close()
            self._finalizer.detach()

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None and not self._closed:
            self._close(warn_stacklevel=3)  # the with statement's line
        elif exc_type is None:
            self._discard_surely()  # closed inside the block: what it said stands
        else:
            self.abort()

    def _spool_error(self, exc: OSError) -> OutputError:
        return OutputError(f"{self.out_dir}: cannot write the samples beside it ({exc.strerror or exc})")

    def _check_open(self) -> None:
        self._check_owner()
        if self._closed:
            raise ValueError(f"{self.out_dir}: the Writer is closed")
        self._settle()

    def _check_owner(self) -> None:
        """Refuse a forked copy: it shares the spools' descriptors and would corrupt them."""
        if os.getpid() != self._owner_pid:
            raise ValueError(
                f"{self.out_dir}: this Writer belongs to process {self._owner_pid}; "
                "use one Writer per process, e.g. part=(rank, world)"
            )

    def _spool(self, key: str) -> Spool:
        """The spool of field ``key``, made (with Ctrl-C held back, so it is closed in the end) if new."""
        if key not in self._spools:
            with interrupts_blocked():
                # Counted apart from the dict, so an interrupt between the two never reuses a name
                # (another thread may take a Ctrl-C, and this one then raises it anyway).
                path = os.path.join(self._spool_dir, f"field-{self._num_spools_made}")
                self._num_spools_made += 1
                try:
                    spool = Spool(path)
                except OSError as exc:
                    if not fsutil.is_io_error(exc):
                        raise
                    raise self._spool_error(exc) from exc
                self._stack.callback(spool.close)
                self._spools[key] = spool
        return self._spools[key]

    def _write(self) -> None:
        if not self._builder.num_sources and self.part is None:
            raise SourceError(f"{self.out_dir}: no sample was appended; a dataset needs at least one")
        plan = self._builder.finish(self._names, allow_empty=True)
        blob_writer.check_index_nbytes(self.out_dir, plan, 0, self.part)
        found = find_nearly_fixed(plan)
        needed = blob_writer.dataset_nbytes(plan, (), self.part)
        publish.check_free_space(self.out_dir, needed, publish.free_nbytes(self.out_dir))
        # Removed with the spools' directory, however this ends.
        staging = publish.make_staging_dir(self.out_dir)
        try:
            blob_writer.create_blob(staging, plan.payload_nbytes)
            self._copy_spools(plan, os.path.join(staging, BLOB_NAME))
            crc32s = [np.frombuffer(table, dtype=np.uint32) for table in self._crc32s]
            blob_writer.finish_dataset(staging, plan, crc32s, (), self.part)
            with interrupts_blocked():  # OUT is never left between the old dataset and the new
                publish.publish(staging, self.out_dir, self._overwrite)
                self._published = True
        except OSError as exc:
            if not fsutil.is_io_error(exc):
                raise
            raise OutputError(f"{self.out_dir}: cannot write the dataset ({exc.strerror or exc})") from exc
        self.nearly_fixed = found

    def _copy_spools(self, plan: Plan, blob_path: str) -> None:
        """Each field's spool into its data region; a spool goes as soon as it is copied."""
        fd = os.open(blob_path, os.O_WRONLY | fsutil.BINARY)
        try:
            for field in plan.fields:
                spool = self._spools[field.name]
                spool.flush()
                fsutil.copy_range(spool.fd, fd, spool.nbytes, 0, BLOB_HEADER_NBYTES + field.data.offset)
                spool.close()
                os.unlink(spool.path)
        finally:
            os.close(fd)


# Lock descriptors of this process's open writers (fds, not writers: nothing here keeps one alive).
_LOCK_FDS: set[int] = set()


def _drop_locks_in_child() -> None:
    """Close, in a forked child, the output lock descriptor of every open writer.

    flock belongs to the open file, which a child shares: a child that lived
    on (a DataLoader worker, say) would otherwise keep OUT locked after the
    writer's process died.
    """
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere no process is forked
    os.register_at_fork(after_in_child=_drop_locks_in_child)


class _Cleanups:
    """Steps that undo a writer, run last first; a step stays listed until it has returned, so
    a run a Ctrl-C cut short is finished by the next. Every step may therefore run twice."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], object]] = []

    def callback(self, fn: Callable[..., object], *args: object) -> None:
        self._steps.append(functools.partial(fn, *args))

    def close(self) -> None:
        while self._steps:
            self._steps[-1]()
            self._steps.pop()


# A discard cut short by Ctrl-C is tried again this many times (each try takes up where the last
# stopped); only a storm of interrupts that outlasts them all leaves the rest to the next call.
MAX_DISCARD_TRIES = 1000


def _release_all(locks: list[publish.OutputLock]) -> None:
    for lock in locks:
        lock.release()


def _recorded(source: str) -> str:
    """What sources.jsonl holds for ``source=``: a path naming a file or directory made absolute,
    as convert records its sources (so verify finds it from anywhere, and misses it once gone);
    anything else as given, a label that verify never takes for a file."""
    if source and not os.path.isabs(source) and os.path.lexists(source):
        return fsutil.absolute_path(source)
    return source


def _discard_in_owner(stack: _Cleanups, owner_pid: int, out_dir: str) -> None:
    """A writer collected open: remove the spools, release the lock, and say that nothing was
    written, unless this is a forked copy of the writer's process."""
    if os.getpid() == owner_pid:
        stack.close()
        # No caller's line to point at (the collector or the interpreter's exit runs this).
        warnings.warn_explicit(
            f"a Writer of {out_dir} was never closed, so nothing was written there and its samples "
            "are discarded: call close() (or write in a `with Writer(...) as w:` block)",
            UnclosedWriterWarning,
            "npz2mmap.Writer",
            0,
            module=__name__,
        )


def _describe_nearly_fixed(item: NearlyFixed) -> str:
    first = _sample_label(item.first_odd, item.first_odd_source)
    option = f"fixed=[{item.field!r}]"
    if item.held_fixed_keeps_an_odd_shape():
        advice = (
            f"{option} keeps the first sample's shape, and that sample is one that differs: "
            f"append a sample of shape {item.shape} first, then write with {option}"
        )
    else:
        advice = f"{option} refuses such samples"
    return describe_nearly_fixed(item, "sample", first, advice)


def _sample_label(k: int, source: str) -> str:
    """How messages name sample ``k``: with its source name, escaped, when it has one."""
    return f"sample {k}" + (f" ({printable(source)})" if source else "")


def _field_name(key: object, label: str) -> str:
    """``key`` if it may name a field (as convert requires of NPZ keys); TypeError or SourceError if not."""
    if not isinstance(key, str):
        raise TypeError(f"field names are str, not {type(key).__name__} ({brief(key)})")
    check_field_name(key, label)
    return key


def _as_array(value: object, where: str) -> np.ndarray:
    """``value`` as an ndarray; SourceError for what a dataset cannot store (objects, no size)."""
    if getattr(value, "requires_grad", False) is True:  # torch refuses it with a bare RuntimeError
        raise SourceError(f"{where}: a tensor that requires grad; append tensor.detach() to store its values")
    try:
        result = np.asarray(value)
    except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: from a tensor's __array__
        raise SourceError(f"{where}: not an array: {exc}") from None
    if result.dtype.hasobject:
        raise SourceError(
            f"{where}: dtype {result.dtype} holds Python objects, which a dataset cannot store; "
            "make it a numeric or fixed-width string array"
        )
    if result.dtype.itemsize == 0:
        raise SourceError(f"{where}: dtype {result.dtype} has no size")
    return result.view(_saved_dtype(result.dtype, where))


def _saved_dtype(dtype: np.dtype, where: str) -> np.dtype:
    """The dtype np.load gives back for ``dtype`` after np.save (metadata dropped), as convert sees it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # np.save's warning that it drops metadata
            return np.lib.format.descr_to_dtype(np.lib.format.dtype_to_descr(dtype))
    except (TypeError, ValueError, KeyError) as exc:
        raise SourceError(f"{where}: dtype {dtype} cannot be saved as .npy ({exc})") from None
