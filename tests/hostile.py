"""Builders of hostile and damaged torch files for the safety tests (no DeepSpeed needed)."""
from __future__ import annotations

import zipfile
from pathlib import Path


def marker_payload(marker: Path) -> dict[str, bytes]:
    """Pickles (by name) that would create ``marker`` if anything ran them."""
    cmd = f"touch {marker}"
    pl = {}
    # GLOBAL + REDUCE: os.system(cmd)
    pl["os_system_reduce"] = b"\x80\x02cos\nsystem\nq\x00X" + len(cmd).to_bytes(4, "little") + cmd.encode() + b"\x85R."
    # builtins.eval through GLOBAL
    expr = f"__import__('os').system('{cmd}')"
    pl["builtins_eval"] = b"\x80\x02c__builtin__\neval\nX" + len(expr).to_bytes(4, "little") + expr.encode() + b"\x85R."
    # STACK_GLOBAL (protocol 4) of posix.system
    def s(u):
        b = u.encode()
        return b"\x8c" + bytes([len(b)]) + b
    pl["stack_global"] = (b"\x80\x04" + s("posix") + s("system") + b"\x93" + s(cmd) + b"\x85R.")
    # nested inside a dict like a checkpoint's
    inner = b"cos\nsystem\nX" + len(cmd).to_bytes(4, "little") + cmd.encode() + b"\x85R"
    pl["nested_in_dict"] = b"\x80\x02}X\x06\x00\x00\x00moduleX\x01\x00\x00\x00a" + inner + b"\x86s."
    # an allowed container BUILD with a hostile __setstate__ target: subprocess.Popen via NEWOBJ
    pl["newobj_popen"] = (b"\x80\x02csubprocess\nPopen\n]X\x05\x00\x00\x00touchaX" + len(str(marker)).to_bytes(4, "little")
                          + str(marker).encode() + b"a\x85\x81.")
    return pl


def write_torch_zip(path: Path, data_pkl: bytes, prefix: str = "archive") -> Path:
    """A zip laid out like torch.save's, holding the given data.pkl."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", data_pkl)
        z.writestr(f"{prefix}/byteorder", "little")
        z.writestr(f"{prefix}/version", "3\n")
    return path


def write_consistent(path, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` of the torch zip file ``path`` and update the CRC-32 of the zip member it
    lies in (local header and central directory), as if the file had been saved with these bytes: a value
    training produced (a NaN, a negative moment), not damage after saving."""
    import struct
    import zlib

    from ckptlib.io.torchzip import zipfmt

    raw = bytearray(Path(path).read_bytes())
    raw[offset:offset + len(data)] = data
    n = min(len(raw), zipfmt.END_SEARCH)
    d = zipfmt.find_directory(bytes(raw[-n:]), len(raw) - n)
    pos = d.offset + d.shift
    for _ in range(d.count):
        _, _, _, _, _, size, nlen, xlen, clen, head = zipfmt._CENTRAL_FIELDS.unpack_from(raw, pos)
        head += d.shift
        start = head + 30 + sum(struct.unpack_from("<HH", raw, head + 26))
        if start <= offset < start + size:
            crc = zlib.crc32(bytes(raw[start:start + size]))
            if struct.unpack_from("<H", raw, head + 6)[0] & 0x8:  # the CRC-32 follows the data (a data descriptor)
                struct.pack_into("<I", raw, start + size + (4 if raw[start + size:start + size + 4] == b"PK\x07\x08"
                                                            else 0), crc)
            else:
                struct.pack_into("<I", raw, head + 14, crc)
            struct.pack_into("<I", raw, pos + 16, crc)
            break
        pos += 46 + nlen + xlen + clen
    else:
        raise ValueError(f"offset {offset} lies in no member of {path}")
    Path(path).write_bytes(bytes(raw))
