"""The end record and central directory of an untrusted zip file, read with bounded reads.

What the scan needs of each entry, with zipfile's meaning exactly (its
``_EndRecData``, ``_RealGetContents`` and ``ZipInfo._decodeExtra``): the end
record found where zipfile finds it, a ZIP64 end record when its locator is
there, zip64 extra fields, and offsets shifted by the bytes prepended to the
archive (a self-extracting stub). Stricter than zipfile where zipfile trusts
the file: the entry count must be the number of entries the directory holds
(at most MAX_ENTRIES), each entry must lie inside the directory, the directory
must be no larger than that many entries can be, and multi-disk archives are
refused whichever record says so. Every number is checked, in Python ints,
against the file's size before anything is read or allocated by it.

A small file is read whole, in one read, and everything is parsed from that
buffer; a larger one is read in bounded windows (``FileView``), its directory
included (DIRECTORY_WINDOW_NBYTES at a time).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple, NoReturn

from .. import fsutil, pagecache
from ..errors import SourceError

# A file up to this size is read whole at once: one read costs less than the hops between its parts.
WHOLE_FILE_MAX_NBYTES = 256 << 10
# A larger file up to this size is asked of the kernel at once (read ahead), not read.
PREFETCH_MAX_NBYTES = 4 << 20
# Bytes read at least at a time from a larger file, so a local header and a .npy header take one read.
MIN_READ_NBYTES = 4096

END_RECORD = struct.Struct("<4s4H2LH")
END_SIGNATURE = b"PK\x05\x06"
ZIP64_LOCATOR = struct.Struct("<4sLQL")
ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
ZIP64_END_RECORD = struct.Struct("<4sQ2H2L4Q")
ZIP64_END_SIGNATURE = b"PK\x06\x06"
CENTRAL_ENTRY = struct.Struct("<4s4B4HL2L5H2L")
CENTRAL_SIGNATURE = b"PK\x01\x02"
LOCAL_SIGNATURE = b"PK\x03\x04"  # each member's local header; a zip starts with one
ZIP64_EXTRA_ID = 0x0001
ZIP64_MARKS = (0xFFFF_FFFF_FFFF_FFFF, 0xFFFF_FFFF)  # a size that zipfile takes from the zip64 extra
ZIP64_MARK = 0xFFFF_FFFF
# Read at once from the end of a larger file: its end records and, mostly, its whole directory.
TAIL_NBYTES = 8192
MAX_EXTRACT_VERSION = 63  # zipfile's
# Entries an NPZ file may hold: far more members than any sample has, few enough to hold in memory.
MAX_ENTRIES = 65_535
# The most one directory entry can occupy: its fixed part and a name, extra and comment of 64 KiB each.
MAX_CENTRAL_ENTRY_NBYTES = CENTRAL_ENTRY.size + 3 * 0xFFFF
# A directory larger than this is parsed in windows of this size (more than any one entry can take).
DIRECTORY_WINDOW_NBYTES = 1 << 20
UTF8_FLAG = 0x800


class ZipEntry(NamedTuple):
    """One central directory entry, as zipfile's ZipInfo holds it."""

    orig_filename: str  # the name as stored, decoded (UTF-8 if flag 0x800, else cp437)
    filename: str  # zipfile's: cut at the first NUL, os.sep turned into "/"
    flag_bits: int
    compress_type: int
    crc32: int
    compress_size: int
    file_size: int
    header_offset: int  # of its local header in the file, prepended bytes counted

    def is_dir(self) -> bool:
        return self.filename.endswith("/")


class FileView:
    """Bytes of an open file of ``file_nbytes``, from a buffer held or by one bounded read.

    Holds the whole file when it is small (read at once), else the last
    window read (at least MIN_READ_NBYTES), so neighbouring small reads cost
    one system call. Never reads past the file's end.
    """

    def __init__(self, fd: int, file_nbytes: int, where: str) -> None:
        self.fd = fd
        self.file_nbytes = file_nbytes
        self.where = where
        self.held = memoryview(b"")
        self.held_offset = 0
        if file_nbytes <= WHOLE_FILE_MAX_NBYTES:
            self._hold(0, file_nbytes)
        elif file_nbytes <= PREFETCH_MAX_NBYTES:
            # On a cold cache each window would cost a disk read; the copy reads the whole file anyway.
            pagecache.advise(fd, file_nbytes, "willneed")

    def read(self, offset: int, nbytes: int) -> memoryview:
        """Up to ``nbytes`` from ``offset`` (fewer only at the file's end; none before its start)."""
        nbytes = min(nbytes, self.file_nbytes - offset)
        if nbytes <= 0 or offset < 0:
            return memoryview(b"")
        start = offset - self.held_offset
        if not (0 <= start and start + nbytes <= len(self.held)):
            self._hold(offset, max(nbytes, MIN_READ_NBYTES))
            start = 0
        return self.held[start : start + nbytes]

    def _hold(self, offset: int, nbytes: int) -> None:
        nbytes = max(0, min(nbytes, self.file_nbytes - offset))
        try:
            data = fsutil.read_at(self.fd, nbytes, offset)
        except OSError as exc:
            fsutil.reraise_if_from_a_handler(exc)
            raise SourceError(f"{self.where}: cannot read ({exc.strerror or exc})") from None
        if len(data) != nbytes:
            raise SourceError(f"{self.where}: ends early (changed while it was read?)")
        self.held, self.held_offset = memoryview(data), offset

    def hold_tail(self, nbytes: int) -> None:
        """Read the file's last ``nbytes`` at once, unless it is held already."""
        offset = max(0, self.file_nbytes - nbytes)
        if offset < self.held_offset or self.held_offset + len(self.held) < self.file_nbytes:
            self._hold(offset, self.file_nbytes - offset)


def read_entries(view: FileView) -> list[ZipEntry]:
    """Every entry of the central directory, in directory order; SourceError naming the file."""
    return read_directory(view)[0]


def read_directory(view: FileView) -> tuple[list[ZipEntry], int]:
    """read_entries' entries and where the central directory starts in the file (no member's
    bytes may reach it)."""
    entries, dir_start = directory_entries(view)
    return list(entries), dir_start


def directory_entries(view: FileView) -> tuple[Iterator[ZipEntry], int]:
    """read_directory's entries, parsed as they are taken (so a caller can refuse a bad file at
    its first bad entry), and where the directory starts.

    The end records are checked now: the count against MAX_ENTRIES and the
    directory's size against what that many entries can occupy, so no read or
    allocation is ever larger than a checked claim; the iterator checks the
    count as it goes and refuses a directory holding more or fewer entries.
    """
    end_offset, fields = _end_record(view)
    disk, dir_disk, count_here, count, dir_nbytes, dir_offset = fields
    if disk != 0 or dir_disk != 0 or count_here != count:
        _refuse(view, "zipfiles that span multiple disks are not supported")
    # The directory ends where the end records begin; its recorded offset tells how many bytes
    # were prepended to the archive ("concat", as zipfile calls it), which shift every offset.
    dir_start = end_offset - dir_nbytes
    if dir_start < 0:
        _refuse(view, "Bad offset for central directory")
    if count * CENTRAL_ENTRY.size > dir_nbytes:
        _refuse(view, f"{count} entries cannot fit in a central directory of {dir_nbytes} bytes")
    if count > MAX_ENTRIES:
        raise SourceError(
            f"{view.where}: holds {count:,} zip entries, more than the {MAX_ENTRIES:,} an NPZ file may have"
        )
    if dir_nbytes > count * MAX_CENTRAL_ENTRY_NBYTES:
        _refuse(view, f"a central directory of {dir_nbytes} bytes is larger than {count} entries can be")
    if dir_nbytes and view.read(dir_start, len(CENTRAL_SIGNATURE)) != CENTRAL_SIGNATURE:
        _refuse(view, "Bad magic number for central directory")
    return _central_entries(view, dir_start, dir_nbytes, count, dir_start - dir_offset), dir_start


def _refuse(view: FileView, problem: str) -> NoReturn:
    raise SourceError(f"{view.where}: not a valid zip/npz file ({problem})")


def _refuse_endless(view: FileView) -> NoReturn:
    """No end record: a file cut short if it starts as a zip does (a copy or download stopped)."""
    if view.file_nbytes >= len(LOCAL_SIGNATURE) and view.read(0, len(LOCAL_SIGNATURE)) == LOCAL_SIGNATURE:
        raise SourceError(
            f"{view.where}: not a valid zip/npz file: truncated (it starts as a zip does, "
            f"but its end, the zip's directory, is missing; {view.file_nbytes:,} bytes)"
        )
    _refuse(view, "File is not a zip file")


def _end_record(view: FileView) -> tuple[int, tuple[int, ...]]:
    """Where the end records begin and the directory fields (disk, directory disk, entries on this
    disk, entries, directory size, directory offset) of the one in effect: the ZIP64 end record if
    its locator precedes the end record, as zipfile decides."""
    size = view.file_nbytes
    if size < END_RECORD.size:
        _refuse_endless(view)
    view.hold_tail(TAIL_NBYTES)
    record = view.read(size - END_RECORD.size, END_RECORD.size)
    if record[:4] == END_SIGNATURE and record[-2:] == b"\0\0":
        end_offset = size - END_RECORD.size
    else:
        # Not at the very end: a comment (at most 64 KiB) follows the record; zipfile takes the last
        # signature found in the file's last 64 KiB + 22 bytes.
        search_start = max(size - (1 << 16) - END_RECORD.size, 0)
        found = bytes(view.read(search_start, size - search_start)).rfind(END_SIGNATURE)
        if found < 0 or search_start + found + END_RECORD.size > size:
            _refuse_endless(view)
        end_offset = search_start + found
        record = view.read(end_offset, END_RECORD.size)
    zip64 = _zip64_end_record(view, end_offset)
    if zip64 is None:
        return end_offset, END_RECORD.unpack(record)[1:7]
    return end_offset - ZIP64_LOCATOR.size - ZIP64_END_RECORD.size, zip64


def _zip64_end_record(view: FileView, end_offset: int) -> tuple[int, ...] | None:
    """The ZIP64 end record's directory fields, or None where zipfile would use the plain record."""
    locator_offset = end_offset - ZIP64_LOCATOR.size
    if locator_offset < 0:
        return None
    signature, disk, _, disks = ZIP64_LOCATOR.unpack(view.read(locator_offset, ZIP64_LOCATOR.size))
    if signature != ZIP64_LOCATOR_SIGNATURE:
        return None
    if disk != 0 or disks > 1:
        _refuse(view, "zipfiles that span multiple disks are not supported")
    # zipfile assumes the record lies just before its locator (no "extensible data"), as we do.
    record_offset = locator_offset - ZIP64_END_RECORD.size
    if record_offset < 0:
        _refuse(view, "File is not a zip file")
    record = ZIP64_END_RECORD.unpack(view.read(record_offset, ZIP64_END_RECORD.size))
    if record[0] != ZIP64_END_SIGNATURE:
        return None
    return record[4:10]


def _central_entries(view: FileView, start: int, nbytes: int, count: int, concat: int) -> Iterator[ZipEntry]:
    """Parse the ``nbytes`` of entries at ``start``, a window at a time; each entry must lie
    wholly inside the directory, and there must be ``count`` of them (refused at the first extra)."""
    end = start + nbytes
    taken = 0
    while start < end:
        window = view.read(start, min(end - start, DIRECTORY_WINDOW_NBYTES))
        last = start + len(window) == end
        position = 0
        # A window holds at least one whole entry, unless the directory ends in it cut short.
        while position < len(window) and (last or _entry_in(window, position)):
            taken += 1
            if taken > count:
                _refuse(view, f"the central directory holds more than the {count} entries recorded")
            entry, position = _central_entry(view, window, position, concat)
            yield entry
        if position == 0:  # never so: a window is larger than any entry (unless the file shrank)
            _refuse(view, "Truncated central directory")
        start += position
    if taken != count:
        _refuse(view, f"the central directory holds {taken} entries, not the {count} recorded")


def _entry_in(window: memoryview, offset: int) -> bool:
    """Whether the entry at ``offset`` lies wholly in ``window``."""
    if offset + CENTRAL_ENTRY.size > len(window):
        return False
    lengths = struct.unpack_from("<3H", window, offset + CENTRAL_ENTRY.size - 18)
    return offset + CENTRAL_ENTRY.size + sum(lengths) <= len(window)


def _central_entry(view: FileView, window: memoryview, position: int, concat: int) -> tuple[ZipEntry, int]:
    """The entry at ``position`` in ``window`` and where the next one starts in it; a window
    always reaches the directory's end or holds the whole entry, so one cut short is truncated."""
    end = len(window)
    if position + CENTRAL_ENTRY.size > end:
        _refuse(view, "Truncated central directory")
    fields = CENTRAL_ENTRY.unpack_from(window, position)
    if fields[0] != CENTRAL_SIGNATURE:
        _refuse(view, "Bad magic number for central directory")
    name_nbytes, extra_nbytes, comment_nbytes = fields[12:15]
    name_start = position + CENTRAL_ENTRY.size
    extra_start = name_start + name_nbytes
    position = extra_start + extra_nbytes + comment_nbytes
    if position > end:
        _refuse(view, "Truncated central directory")
    if fields[3] > MAX_EXTRACT_VERSION:
        raise SourceError(f"{view.where}: zip file version {fields[3] / 10:.1f} is not supported")
    name = _decoded_name(view, window[name_start:extra_start], fields[5])
    return _entry(view, name, fields, window[extra_start : extra_start + extra_nbytes], concat), position


def _decoded_name(view: FileView, raw: memoryview, flags: int) -> str:
    """As zipfile decodes it: UTF-8 if flagged, else cp437 (which reads ASCII as ASCII, faster)."""
    try:
        if flags & UTF8_FLAG:
            return str(raw, "utf-8")
        name = bytes(raw)
        return name.decode("ascii") if name.isascii() else name.decode("cp437")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{view.where}: not a valid zip/npz file (entry name: {exc})") from None


def _entry(view: FileView, name: str, fields: tuple[Any, ...], extra: memoryview, concat: int) -> ZipEntry:
    crc32, compress_size, file_size = fields[9:12]
    header_offset = fields[18]
    if extra:
        file_size, compress_size, header_offset = _zip64_sizes(
            view, extra, file_size, compress_size, header_offset
        )
    filename = name.partition("\0")[0] if "\0" in name else name
    if os.sep != "/":
        filename = filename.replace(os.sep, "/")
    return ZipEntry(
        name, filename, fields[5], fields[6], crc32, compress_size, file_size, header_offset + concat
    )


def _zip64_sizes(
    view: FileView, extra: memoryview, file_size: int, compress_size: int, header_offset: int
) -> tuple[int, int, int]:
    """zipfile's ``_decodeExtra``: each zip64 field (id 1) gives, in order, the values marked 0xFFFFFFFF."""
    position = 0
    while len(extra) - position >= 4:
        kind, nbytes = struct.unpack_from("<HH", extra, position)
        data_start = position + 4
        position = data_start + nbytes
        if position > len(extra):
            _refuse(view, f"Corrupt extra field {kind:04x} (size={nbytes})")
        if kind != ZIP64_EXTRA_ID:
            continue
        values = iter(struct.unpack_from(f"<{nbytes // 8}Q", extra, data_start))
        field = "File size"
        try:
            if file_size in ZIP64_MARKS:
                file_size = next(values)
            field = "Compress size"
            if compress_size == ZIP64_MARK:
                compress_size = next(values)
            field = "Header offset"
            if header_offset == ZIP64_MARK:
                header_offset = next(values)
        except StopIteration:
            _refuse(view, f"Corrupt zip64 extra field. {field} not found.")
    return file_size, compress_size, header_offset
