"""One page on disk: a file that is whole or is not read.

Layout: the magic ``b"SCPAGE1\\n"``, an 8-byte little-endian header length, a JSON header
(the page's key and parent key, its token count, the caller's ``meta``, and for each array
its name, dtype, shape and byte range in the payload, the payload's length and digest), then
the payload: the arrays' bytes, back to back.

Writing is crash-safe (``write_page`` of an ``encode_page``): a unique temporary file in the
same directory, written, flushed and ``fsync``-ed, then renamed over the final name (atomic
on POSIX), and the directory synced. A reader therefore sees a whole file or none; a process
killed part-way leaves only a temporary file, which start-up sets aside. ``read_page``
checks everything it can (magic, header, key, lengths, the payload's digest) and raises
``CorruptPage`` naming what failed: a truncated or altered file is a miss, never wrong data.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> arrays = {"k": np.arange(6, dtype=np.float16).reshape(2, 3)}
>>> encoded = encode_page("ab" * 16, "cd" * 16, 2, arrays, {"state": False})
>>> path = write_page(d, encoded)
>>> path.stat().st_size == encoded.size
True
>>> page = read_page(path, "ab" * 16)
>>> page.parent == "cd" * 16, page.num_tokens, page.arrays["k"].tolist(), page.meta
(True, 2, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], {'state': False})
>>> _ = path.write_bytes(path.read_bytes()[:-1])  # truncated
>>> read_page(path, "ab" * 16)
Traceback (most recent call last):
...
servecore.diskcache.pagefile.CorruptPage: ...: the payload has 11 bytes, the header says 12
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["MAGIC", "TMP_SUFFIX", "CorruptPage", "Encoded", "Page", "encode_page", "read_page",
           "write_page"]

MAGIC = b"SCPAGE1\n"
TMP_SUFFIX = ".tmp"  # a file being written; never read, set aside at start-up


class CorruptPage(Exception):
    """A page file that cannot be trusted (truncated, altered, not a page, another key).

    >>> issubclass(CorruptPage, Exception)
    True
    """


@dataclasses.dataclass(frozen=True)
class Page:
    """A page read back: its key, its parent's key, its token count, its arrays by name and
    the writer's ``meta``.

    >>> Page("k", "p", 2, {}, {}).num_tokens
    2
    """

    key: str
    parent: str
    num_tokens: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A page ready to write: its key, header and payload chunks, and its size on disk.

    >>> encode_page("ab", "cd", 1, {"x": np.zeros(4, np.uint8)}, {}).size > 4
    True
    """

    key: str
    header: bytes
    chunks: tuple[memoryview, ...]

    @property
    def size(self) -> int:
        """Bytes of the file: magic, header length, header, payload."""
        return len(MAGIC) + 8 + len(self.header) + sum(c.nbytes for c in self.chunks)


def encode_page(key: str, parent: str, num_tokens: int, arrays: Mapping[str, np.ndarray],
                meta: Mapping[str, Any]) -> Encoded:
    """The header and payload of a page (nothing written yet).

    >>> encode_page("ab", "cd", 1, {"x": np.zeros(2, np.float32)}, {}).chunks[0].nbytes
    8
    """
    entries, chunks, offset = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                        "offset": offset, "nbytes": a.nbytes})
        chunks.append(memoryview(a).cast("B"))
        offset += a.nbytes
    digest = hashlib.blake2b(digest_size=16)
    for c in chunks:
        digest.update(c)
    header = json.dumps({"key": key, "parent": parent, "tokens": num_tokens, "meta": dict(meta),
                         "arrays": entries, "payload": offset,
                         "digest": digest.hexdigest()}).encode()
    return Encoded(key, header, tuple(chunks))


def write_page(directory: pathlib.Path, page: Encoded) -> pathlib.Path:
    """Write ``page`` to ``directory / page.key`` crash-safely (see the module docstring).

    >>> import tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> write_page(d, encode_page("ab", "cd", 1, {}, {})).name, [p.name for p in d.iterdir()]
    ('ab', ['ab'])
    """
    final = directory / page.key
    tmp = directory / f".{page.key}.{uuid.uuid4().hex}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(len(page.header).to_bytes(8, "little"))
            f.write(page.header)
            for c in page.chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(directory)
    return final


def read_page(path: pathlib.Path, key: str) -> Page:
    """The page in ``path``, which must be ``key``'s; ``CorruptPage`` if any check fails.

    >>> import tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> path = write_page(d, encode_page("ab", "cd", 3, {"x": np.arange(3)}, {"m": 1}))
    >>> page = read_page(path, "ab")
    >>> page.arrays["x"].tolist(), page.meta, read_page(path, "ef")
    Traceback (most recent call last):
    ...
    servecore.diskcache.pagefile.CorruptPage: ...: holds key ab, not ef
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorruptPage(f"{path}: {e}") from e
    head = len(MAGIC) + 8
    if len(data) < head or data[:len(MAGIC)] != MAGIC:
        raise CorruptPage(f"{path}: not a page file")
    n = int.from_bytes(data[len(MAGIC):head], "little")
    try:
        header = json.loads(data[head:head + n])
        if header["key"] != key:
            raise CorruptPage(f"{path}: holds key {header['key']}, not {key}")
        payload = memoryview(data)[head + n:]
        if len(payload) != header["payload"]:
            raise CorruptPage(f"{path}: the payload has {len(payload)} bytes, the header says "
                              f"{header['payload']}")
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["digest"]:
            raise CorruptPage(f"{path}: the payload's digest does not match")
        arrays = {e["name"]: np.frombuffer(payload, dtype=np.dtype(e["dtype"]),
                                           count=math.prod(e["shape"]),
                                           offset=e["offset"]).reshape(e["shape"])
                  for e in header["arrays"]}
        return Page(key, header["parent"], int(header["tokens"]), arrays, header["meta"])
    except CorruptPage:
        raise
    except (ValueError, KeyError, TypeError) as e:  # a header that parses to nonsense
        raise CorruptPage(f"{path}: a bad header ({e})") from e


def _sync_dir(directory: pathlib.Path) -> None:
    """Make a rename in ``directory`` durable (where the platform allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
