"""Zip records at offsets known in advance: the container format of torch files, written without ``zipfile``.

torch files are uncompressed (stored) zip archives whose members start on 64-byte boundaries. Since
every member's size is known before a byte is written, :func:`layout_records` fixes where each local
header and each member's data go; the data can then be written with ``pwrite`` in any order (or copied
inside the kernel from another file) and the headers, with their CRC-32s, written last
(:func:`local_header`, :func:`central_directory`). ZIP64 fields are used where a size or an offset
needs them, as the zip specification (APPNOTE 4.5.3) says.

:func:`crc32_combine` joins the CRC-32s of consecutive pieces, so that chunks can be checksummed
where their bytes are (e.g. in the thread that read them) and combined in order.

Pure arithmetic: no I/O here.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

ALIGN = 64
ZIP64_LIMIT = 0xFFFFFFFF  # a size or offset at least this large needs a ZIP64 field
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the date torch writes too
_PAD_ID = 0x4246  # torch's padding extra field ("FB")
_POLY = 0xEDB88320  # CRC-32 (reflected)


# ================================================================================================ CRC-32
def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial, both in CRC-32's reflected bit order."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


@lru_cache(maxsize=None)
def _x_pow_2n(n: int) -> int:
    """x^(2^n) modulo the polynomial."""
    return 1 << 30 if n == 0 else _multmodp(_x_pow_2n(n - 1), _x_pow_2n(n - 1))


@lru_cache(maxsize=256)
def _x_pow_8bits(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what appending ``nbytes`` zero bytes multiplies a CRC by."""
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_x_pow_2n(k), p)
        nbytes >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    if len2 <= 0:
        return crc1
    return _multmodp(_x_pow_8bits(len2), crc1) ^ crc2


# ================================================================================================ layout
@dataclass
class Record:
    """One member of the archive: where its local header and its data go."""

    name: str
    size: int
    header_offset: int
    data_offset: int
    zip64: bool  # sizes in a ZIP64 extra field of the local header
    crc: int = 0

    @property
    def header_size(self) -> int:
        return self.data_offset - self.header_offset


def _local_extra_zip64(size: int) -> bytes:
    return struct.pack("<HHQQ", 0x0001, 16, size, size)


def layout_records(names_and_sizes: list[tuple[str, int]], zip64_limit: int = ZIP64_LIMIT) -> tuple[list[Record], int]:
    """Place the members one after the other, each member's data on a 64-byte boundary.

    Returns the records and the offset where the central directory starts.
    """
    records, pos = [], 0
    for name, size in names_and_sizes:
        zip64 = size >= zip64_limit
        fixed = 30 + len(name.encode("utf-8")) + (20 if zip64 else 0) + 4
        pad = -(pos + fixed) % ALIGN
        data = pos + fixed + pad
        records.append(Record(name, size, pos, data, zip64))
        pos = data + size
    return records, pos


def local_header(rec: Record) -> bytes:
    """The local file header of ``rec`` (its ``crc`` must be final)."""
    name = rec.name.encode("utf-8")
    extra = _local_extra_zip64(rec.size) if rec.zip64 else b""
    pad = rec.header_size - 30 - len(name) - len(extra) - 4
    extra += struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
    size32 = 0xFFFFFFFF if rec.zip64 else rec.size
    head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if rec.zip64 else 20, 0, 0, 0, _DOS_DATE, rec.crc,
                       size32, size32, len(name), len(extra))
    return head + name + extra


def central_directory(records: list[Record], cd_offset: int, zip64_limit: int = ZIP64_LIMIT,
                      force_zip64_end: bool = False) -> bytes:
    """The central directory and the end records, to be written at ``cd_offset`` (the end of the data)."""
    out = bytearray()
    for rec in records:
        name = rec.name.encode("utf-8")
        big_size, big_offset = rec.size >= zip64_limit, rec.header_offset >= zip64_limit
        fields = ([rec.size, rec.size] if big_size else []) + ([rec.header_offset] if big_offset else [])
        extra = struct.pack(f"<HH{len(fields)}Q", 0x0001, 8 * len(fields), *fields) if fields else b""
        version = 45 if fields else 20
        out += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, (3 << 8) | version, version, 0, 0, 0, _DOS_DATE,
                           rec.crc, 0xFFFFFFFF if big_size else rec.size, 0xFFFFFFFF if big_size else rec.size,
                           len(name), len(extra), 0, 0, 0, 0o600 << 16,
                           0xFFFFFFFF if big_offset else rec.header_offset)
        out += name + extra
    cd_size, n = len(out), len(records)
    if force_zip64_end or n >= 0xFFFF or cd_offset >= zip64_limit or cd_size >= zip64_limit:
        end64 = cd_offset + cd_size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, (3 << 8) | 45, 45, 0, 0, n, n, cd_size, cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                           min(cd_size, 0xFFFFFFFF), min(cd_offset, 0xFFFFFFFF), 0)
    else:
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_offset, 0)
    return bytes(out)
