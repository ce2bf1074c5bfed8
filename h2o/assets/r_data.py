"""R data objects from a lazy-load database (``data/Rdata.rdb`` with its index ``Rdata.rdx``), read with ``rdata``.

The index is an ``.rds`` file (a gzipped serialization) whose ``variables`` map each object name to its
(offset, length) in the ``.rdb``; each record there is a 4-byte big-endian length followed by a zlib stream of
R's serialization format, which ``rdata``'s parser reads. The novels come out byte-identical to the hand-written
parser this replaced (tests/test_data.py checks the text's digest).
"""
from __future__ import annotations

import struct
import warnings
import zlib
from pathlib import Path


def read_rdb(rdb: str | Path) -> dict[str, list[str | None]]:
    """Every object of an R lazy-load database as a plain list (``None`` for NA), ``{name: [...]}``."""
    from rdata.conversion import convert
    from rdata.parser import parse_data, parse_file

    rdb = Path(rdb)
    with warnings.catch_warnings():  # rdata warns about the .rdx / .rdb extensions, which it does not know
        warnings.simplefilter("ignore", UserWarning)
        index = convert(parse_file(rdb.with_suffix(".rdx")))
        if list(index.get("compressed", [True])) not in ([True], [1]):
            raise ValueError(f"{rdb.name}: compression {index['compressed']} is not zlib (the only one read here)")
        raw = rdb.read_bytes()
        out = {}
        for name, (offset, length) in index["variables"].items():
            record = raw[int(offset) : int(offset) + int(length)]
            (size,) = struct.unpack(">I", record[:4])
            payload = zlib.decompress(record[4:])
            if len(payload) != size:
                raise ValueError(f"{rdb.name}: object {name!r} is {len(payload)} bytes, its header says {size}")
            out[str(name)] = [None if x is None else str(x) for x in convert(parse_data(payload)).tolist()]
    return out
