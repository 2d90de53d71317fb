"""Zip records at offsets known in advance: the container format of torch files, written without ``zipfile``.

torch files are uncompressed (stored) zip archives whose members start on 64-byte boundaries. Since
every member's size is known before a byte is written, :func:`layout_records` fixes where each local
header and each member's data go; the data can then be written with ``pwrite`` in any order (or copied
inside the kernel from another file) and the headers, with their CRC-32s, written last
(:func:`local_header`, :func:`central_directory`). ZIP64 fields are used where a size or an offset
needs them, as the zip specification (APPNOTE 4.5.3) says.

:func:`crc32_combine` joins the CRC-32s of consecutive pieces, so that chunks can be checksummed
where their bytes are (e.g. in the thread that read them) and combined in order.

Reading (what :class:`~ckptlib.io.torchzip.reader.TorchFile` needs, faster than ``zipfile`` on archives of
thousands of members): :func:`find_directory` finds the central directory from the archive's last bytes,
:func:`parse_directory` turns it into plain tuples in one pass, :func:`header_runs` and :func:`data_offsets`
find where members' data start from their local headers, read a run at a time.

Pure arithmetic: no I/O here.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

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


@lru_cache(maxsize=2**16)  # a run joins spans of a few lengths again and again (a member's pieces, ranks' slices)
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


@lru_cache(maxsize=256)
def crc32_of_zeros(nbytes: int) -> int:
    """The CRC-32 of ``nbytes`` zero bytes, in O(log n) steps (what an all-zero tensor's member records)."""
    crc, block, size = 0, 0xD202EF8D, 1  # crc32(b"\0")
    while nbytes:
        if nbytes & 1:
            crc = crc32_combine(crc, block, size)
        block = crc32_combine(block, block, size)
        size *= 2
        nbytes >>= 1
    return crc


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


# ================================================================================================ reading
STORED = 0  # compression method "stored" (torch never compresses)
LOCAL_HEADER_SIZE = 30
_END = struct.Struct("<IHHHHIIH")  # end of central directory record, 22 bytes
_END64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_END64 = struct.Struct("<IQHHIIQQQQ")  # ZIP64 end of central directory record, 56 bytes
#: the fields of a central directory entry (46 bytes) that reading needs: signature, flags, method, CRC-32,
#: stored size, size, lengths of name, extra field and comment, local header offset
_CENTRAL_FIELDS = struct.Struct("<I4xHH4xIIIHHH8xI")
#: a local header (30 bytes): signature, flags, method, CRC-32, stored size, size, name and extra field lengths
_LOCAL_FIELDS = struct.Struct("<I2xHH4xIIIHH")
#: the most a data descriptor takes after a member's data (signature, CRC-32, two 8-byte sizes)
DESCRIPTOR_MAX = 24
_DESCRIPTOR_SIG = b"PK\x07\x08"
#: bytes from the end of an archive that hold its end records when it has no (or a short) comment
END_SEARCH = _END.size + _END64_LOCATOR.size + _END64.size + 1024
END_SEARCH_MAX = _END.size + _END64_LOCATOR.size + _END64.size + 0xFFFF


class ZipFormatError(ValueError):
    """The bytes are not a (readable) zip archive; the message says what is wrong."""


@dataclass(frozen=True)
class Directory:
    """Where the central directory is: ``count`` entries, ``size`` bytes at ``offset``; ``shift`` is added to
    every recorded offset (non-zero only when something was prepended to the archive)."""

    count: int
    size: int
    offset: int
    shift: int = 0


def find_directory(tail: bytes, tail_offset: int) -> Optional[Directory]:
    """The central directory's place from ``tail``, the last bytes of the archive (read from ``tail_offset``);
    None if the end record is not in ``tail`` (a longer comment: read more). ZIP64 end records are used
    when present; they must lie in ``tail`` too (they come right before the end record).

    Raises:
        ZipFormatError: the end records are damaged.
    """
    pos = tail.rfind(b"PK\x05\x06")
    while pos >= 0 and pos + _END.size > len(tail):
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    if pos < 0:
        return None
    _, disk, cd_disk, _, count, size, offset, _ = _END.unpack_from(tail, pos)
    end_at = tail_offset + pos
    loc = pos - _END64_LOCATOR.size
    if loc >= 0 and tail[loc:loc + 4] == b"PK\x06\x07":
        _, _, end64_at, disks = _END64_LOCATOR.unpack_from(tail, loc)
        i = end64_at - tail_offset
        if disks > 1:
            raise ZipFormatError("a multi-disk zip archive")
        if i < 0 or i + _END64.size > loc or tail[i:i + 4] != b"PK\x06\x06":
            # the record may follow an extensible data field: it is right before the locator then
            i = loc - _END64.size
            if i < 0 or tail[i:i + 4] != b"PK\x06\x06":
                raise ZipFormatError("the ZIP64 end of central directory record is missing or damaged")
        _, _, _, _, disk, cd_disk, _, count, size, offset = _END64.unpack_from(tail, i)
        end_at = tail_offset + i
    elif disk or cd_disk:
        raise ZipFormatError("a multi-disk zip archive")
    shift = end_at - size - offset
    if shift < 0:
        raise ZipFormatError("the central directory is larger than the archive before it (truncated?)")
    return Directory(count, size, offset, shift)


def parse_directory(buf: bytes, d: Directory) -> dict[str, tuple]:
    """The central directory ``buf`` (``d.size`` bytes) as ``{name: (header offset, stored size, size, CRC-32,
    compression method)}`` (offsets shifted by ``d.shift``; ZIP64 extra fields applied).

    Raises:
        ZipFormatError: an entry is damaged or the directory is shorter than ``d`` says.
    """
    if len(buf) != d.size:
        raise ZipFormatError(f"truncated central directory ({len(buf)} of {d.size} bytes)")
    out: dict[str, tuple] = {}
    unpack, pos, end, shift = _CENTRAL_FIELDS.unpack_from, 0, len(buf), d.shift
    for _ in range(d.count):
        if pos + 46 > end:
            raise ZipFormatError("truncated central directory")
        sig, flags, method, crc, csize, size, nlen, xlen, clen, off = unpack(buf, pos)
        if sig != 0x02014B50:
            raise ZipFormatError("bad magic number for a central directory entry")
        name_end = pos + 46 + nlen
        raw = buf[pos + 46:name_end]
        try:
            name = raw.decode("ascii")  # what torch writes; the same in both encodings zip allows
        except UnicodeDecodeError:
            try:
                name = raw.decode("utf-8" if flags & 0x800 else "cp437")
            except UnicodeDecodeError:  # torch flags every name UTF-8: a damaged byte
                raise ZipFormatError(f"the name of zip entry {len(out)} is not valid UTF-8 "
                                     f"({raw[:60]!r}): a damaged central directory") from None
        if csize == 0xFFFFFFFF or size == 0xFFFFFFFF or off == 0xFFFFFFFF:
            size, csize, off = _zip64_fields(buf[name_end:name_end + xlen], size, csize, off)
        out[name] = (off + shift, csize, size, crc, method)
        pos = name_end + xlen + clen
    if pos > end:
        raise ZipFormatError("truncated central directory")
    return out


def _zip64_fields(extra: bytes, size: int, csize: int, off: int) -> tuple[int, int, int]:
    """Sizes and offset from a ZIP64 extra field (only those recorded as 0xFFFFFFFF are in it, in this order)."""
    i = 0
    while i + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, i)
        if tag == 0x0001:
            data, j = extra[i + 4:i + 4 + n], 0
            values = []
            for v in (size, csize, off):
                if v == 0xFFFFFFFF:
                    if j + 8 > len(data):
                        raise ZipFormatError("a truncated ZIP64 extra field")
                    values.append(struct.unpack_from("<Q", data, j)[0])
                    j += 8
                else:
                    values.append(v)
            return values[0], values[1], values[2]
        i += 4 + n
    raise ZipFormatError("a ZIP64 entry without its ZIP64 extra field")


def header_runs(headers: list[tuple[int, str]], near: int) -> list[tuple[int, int, list]]:
    """How to read the local headers ``(header offset, name)`` (sorted by offset) in few reads: runs of
    headers at most ``near`` bytes apart, each as ``(start, length, its headers)``. A run also holds the
    :data:`DESCRIPTOR_MAX` bytes before its first header (where the member before it ends, with its data
    descriptor) and the name after its last header."""
    runs, i = [], 0
    while i < len(headers):
        j = i + 1
        while j < len(headers) and headers[j][0] - headers[j - 1][0] <= near:
            j += 1
        start = max(0, headers[i][0] - DESCRIPTOR_MAX)
        last, name = headers[j - 1]
        runs.append((start, last + LOCAL_HEADER_SIZE + len(name.encode("utf-8")) - start, headers[i:j]))
        i = j
    return runs


def data_offsets(buf: bytes, start: int, headers: list[tuple[int, str]], out: dict[str, int],
                 members: Optional[dict] = None, flags: Optional[dict] = None) -> None:
    """Where each member's data begins (``out[name]``), from its local header in ``buf`` (the file's bytes
    from ``start``, one of :func:`header_runs`). With ``members`` (:func:`parse_directory`'s) each local header
    must agree with the central directory: its name, compression method and, unless the sizes follow the data
    (flag bit 3, whose flags go to ``flags[name]`` for :func:`prove_extents`), its CRC-32 and sizes.

    Raises:
        ZipFormatError: a header is not there ("bad zip local header for NAME"), ``buf`` ends before it
        ("truncated zip local header"), or it disagrees with the central directory (naming the field).
    """
    unpack, n = _LOCAL_FIELDS.unpack_from, len(buf)
    for header, name in headers:
        pos = header - start
        if pos + LOCAL_HEADER_SIZE > n:
            raise ZipFormatError("truncated zip local header")
        sig, lflags, method, crc, csize, size, nlen, xlen = unpack(buf, pos)
        if sig != 0x04034B50:
            raise ZipFormatError(f"bad zip local header for {name}")
        if members is not None:
            _agrees(name, buf[pos + LOCAL_HEADER_SIZE:pos + LOCAL_HEADER_SIZE + nlen], lflags, method, crc, csize,
                    size, members[name])
            if flags is not None:
                flags[name] = lflags
        out[name] = header + LOCAL_HEADER_SIZE + nlen + xlen


def _agrees(name: str, raw: bytes, lflags: int, method: int, crc: int, csize: int, size: int, central: tuple) -> None:
    """A local header's name, method, CRC-32 and sizes against the member's central directory entry."""
    try:
        local = raw.decode("ascii")
    except UnicodeDecodeError:
        local = raw.decode("utf-8" if lflags & 0x800 else "cp437", errors="replace")
    if local != name:
        raise ZipFormatError(f"the local header of zip entry {name} names {local!r}: a damaged local header")
    _, ccsize, csize_all, ccrc, cmethod = central
    if method != cmethod:
        raise ZipFormatError(f"the local header of zip entry {name} says compression method {method}, the central "
                             f"directory {cmethod}: a damaged local header")
    if lflags & 0x8:
        return  # CRC-32 and sizes follow the data (a data descriptor, checked by prove_extents)
    want = (ccrc, min(ccsize, 0xFFFFFFFF), min(csize_all, 0xFFFFFFFF))
    if (csize, size) == (0xFFFFFFFF, 0xFFFFFFFF):  # ZIP64: the sizes are in its extra field
        want, crc = (ccrc, csize, size), crc
    if (crc, csize, size) != want:
        raise ZipFormatError(f"the local header of zip entry {name} records CRC-32 {crc:#x} and sizes {csize}/{size}, "
                             f"the central directory {want[0]:#x} and {want[1]}/{want[2]}: a damaged local header")


def prove_extents(members: dict, offsets: dict, flags: dict, end: int, read) -> None:
    """Each member's data, where its local header puts it, must end exactly where the next member's local
    header begins (the last one: the central directory at ``end``), after its data descriptor when its sizes
    follow the data (flag bit 3: 12 to 24 bytes holding its CRC-32, compared with the central directory's).
    ``read(offset, n)`` gives ``n`` bytes of the file. Cheap: only the descriptors are read.

    Raises:
        ZipFormatError: naming the member whose data would be read from another place than it was written to.
    """
    order = sorted((v[0], name) for name, v in members.items())
    for i, (_, name) in enumerate(order):
        data_end = offsets[name] + members[name][1]
        nxt = order[i + 1][0] if i + 1 < len(order) else end
        gap = nxt - data_end
        if flags.get(name, 0) & 0x8:
            desc = read(data_end, gap) if 12 <= gap <= DESCRIPTOR_MAX else b""
            at = 4 if desc[:4] == _DESCRIPTOR_SIG else 0
            if len(desc) < at + 4 or struct.unpack_from("<I", desc, at)[0] != members[name][3]:
                raise ZipFormatError(f"zip entry {name}: its data, where its local header puts it, is not followed by "
                                     "its data descriptor: a damaged local header (its data would be read from "
                                     "another place)")
        elif gap != 0:
            raise ZipFormatError(f"zip entry {name}: its data, where its local header puts it, ends {abs(gap)} bytes "
                                 f"{'before' if gap > 0 else 'after'} where the next entry begins: a damaged local "
                                 "header (its data would be read from another place)")
