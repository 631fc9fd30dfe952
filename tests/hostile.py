"""Broken and hostile NPZ files, built byte by byte."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def zip_with(path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def npy_with_header(header: str, data: bytes = b"", version: tuple[int, int] = (1, 0)) -> bytes:
    """A .npy member (version 1.0 unless told) with the given header text, unchecked."""
    text = header.encode("utf-8" if version == (3, 0) else "latin1") + b"\n"
    length = len(text).to_bytes(2 if version == (1, 0) else 4, "little")
    return b"\x93NUMPY" + bytes(version) + length + text + data


ZIP64_LIMIT = 0xFFFFFFFF


def zip_declaring(
    path: Path,
    name: str,
    stored: bytes,
    file_size: int,
    compress_size: int | None = None,
    method: int = zipfile.ZIP_STORED,
) -> Path:
    """A one-member zip holding ``stored`` whose directory declares the given sizes (zip64 if needed)."""
    compress_size = len(stored) if compress_size is None else compress_size
    zip64 = max(file_size, compress_size) >= ZIP64_LIMIT
    extra = struct.pack("<HHQQ", 1, 16, file_size, compress_size) if zip64 else b""
    sizes = (ZIP64_LIMIT, ZIP64_LIMIT) if zip64 else (compress_size, file_size)
    version = 45 if zip64 else 20
    encoded = name.encode()
    crc = zlib.crc32(zlib.decompress(stored, -15) if method == zipfile.ZIP_DEFLATED else stored)
    common = (0, method, 0, 0x21, crc, *sizes, len(encoded), len(extra))  # flags .. extra length
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", version, *common) + encoded + extra
    central = (
        struct.pack("<4sHH", b"PK\x01\x02", version, version)
        + struct.pack("<HHHHIIIHH", *common)
        + struct.pack("<HHHII", 0, 0, 0, 0, 0)  # comment, disk, attributes, local header at 0
        + encoded
        + extra
    )
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(central), len(local) + len(stored), 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(local + stored + central + end)
    return path


def zero_byte(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def text_file(path: Path) -> Path:
    path.write_text("x,y\n1,2\n")
    return path


def npy_renamed(path: Path) -> Path:
    path.write_bytes(npy_bytes(np.arange(10)))
    return path


def truncated_zip(path: Path) -> Path:
    zip_with(path, {"x.npy": npy_bytes(np.arange(1000))})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def crc_mismatch(path: Path) -> Path:
    """A stored member whose data byte was flipped after the CRC was computed."""
    payload = npy_bytes(np.arange(100, dtype=np.int64))
    zip_with(path, {"x.npy": payload})
    data = bytearray(path.read_bytes())
    where = data.index(payload[-16:])
    data[where] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def not_npy_member(path: Path) -> Path:
    return zip_with(path, {"x.npy": b"just some text, not an array"})


def npy_before_a_zip(path: Path) -> Path:
    """A .npy file with a zip after it: np.load reads the .npy array, zipfile the zip's."""
    zip_with(path, {"x.npy": npy_bytes(np.full(3, 666))})
    path.write_bytes(npy_bytes(np.arange(3)) + path.read_bytes())
    return path


def short_text_member(path: Path) -> Path:
    """A zip tool's readme beside the arrays, shorter than numpy's magic and version."""
    return zip_with(path, {"x.npy": npy_bytes(np.arange(3)), "readme.txt": b"hi"})


def empty_member(path: Path) -> Path:
    return zip_with(path, {"x.npy": b""})


def malformed_header(path: Path) -> Path:
    return zip_with(path, {"x.npy": npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (3,")})


def header_claims_too_much(path: Path) -> Path:
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }"
    return zip_with(path, {"x.npy": npy_with_header(header, b"\0" * 64)})


def header_with_code(path: Path) -> Path:
    header = "{'descr': __import__('os').system('touch pwned'), 'fortran_order': False, 'shape': (1,), }"
    return zip_with(path, {"x.npy": npy_with_header(header, b"\0" * 8)})


def corrupt_far_past_the_header(path: Path, key: str) -> None:
    """Flip a byte near the end of a stored member: only reading it to its end finds the bad CRC."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(f"{key}.npy")
    data = bytearray(path.read_bytes())
    name_nbytes, extra_nbytes = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data_end = info.header_offset + 30 + name_nbytes + extra_nbytes + info.compress_size
    data[data_end - 10] ^= 0xFF
    path.write_bytes(bytes(data))
