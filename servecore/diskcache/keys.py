"""Keys that cannot lie: what names a page of cached K/V (and states) on disk.

A page is ``page_size`` tokens of one prompt, at a fixed depth from its start. Its bytes
mean something only for the exact tokens before and in it, and only for the weights, config,
tokenizer, dtype, cache layout, quantization and code that produced them. So a page's key
chains its parent page's key with its own token ids, and the first page's parent is the
*salt*: a digest of everything that gives the bytes their meaning. Change any of it (one
weight, the dtype, the tokenizer, the format version, the MLX version) and every key
changes: a cache written under other conditions is a miss by construction, never a wrong
hit (the bug class SGLang's file tier and vllm-mlx both shipped).

Digests are BLAKE2b (``hashlib``); keys are 32 hex characters (128 bits).

>>> s = salt({"weights": "ab12", "dtype": "bfloat16"})
>>> keys = chain(s, [5, 6, 7, 8, 9], page_size=2)  # two whole pages, the 9 is not one
>>> len(keys), keys[1] == page_key(keys[0], [7, 8]), len(keys[0])
(2, True, 32)
>>> chain(salt({"weights": "ab12", "dtype": "float16"}), [5, 6], 2) == keys[:1]
False
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["FORMAT_VERSION", "chain", "digest_buffers", "page_key", "salt"]

FORMAT_VERSION = 3
"""The on-disk format's version; part of every salt, so a format change is a clean miss."""

_BYTES = 16  # 128-bit digests: 32 hex characters


def salt(parts: Mapping[str, Any]) -> str:
    """The key of the empty prefix: a digest of ``parts`` (JSON-able values: strings,
    numbers, lists, dicts; keys sorted) and ``FORMAT_VERSION``.

    >>> salt({"a": 1}) == salt({"a": 1}), salt({"a": 1}) == salt({"a": 2})
    (True, False)
    """
    text = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=_BYTES, person=b"salt").hexdigest()


def page_key(parent: str, tokens: Sequence[int]) -> str:
    """The key of the page of ``tokens`` after the prefix whose last page's key is ``parent``
    (the salt for the first page).

    >>> k = page_key("00", [1, 2])
    >>> k == page_key("00", [1, 2]), k == page_key("01", [1, 2]), k == page_key("00", [2, 1])
    (True, False, False)
    """
    h = hashlib.blake2b(bytes.fromhex(parent), digest_size=_BYTES, person=b"page")
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.hexdigest()


def chain(salt_key: str, tokens: Sequence[int], page_size: int) -> list[str]:
    """The keys of every whole page of ``tokens`` (page ``i`` holds tokens
    ``[i * page_size, (i + 1) * page_size)``); a partial last page has none.

    >>> ks = chain("00" * 16, [1, 2, 3], page_size=2)
    >>> len(ks), ks[0] == page_key("00" * 16, [1, 2])
    (1, True)
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be at least 1")
    keys, parent = [], salt_key
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_key(parent, tokens[start:start + page_size])
        keys.append(parent)
    return keys


def digest_buffers(buffers: Iterable[Any]) -> str:
    """A digest of byte buffers in order (each anything ``memoryview`` takes: numpy arrays,
    ``bytes``), their lengths included: a weights digest.

    >>> digest_buffers([b"ab", b"c"]) == digest_buffers([b"a", b"bc"])
    False
    """
    h = hashlib.blake2b(digest_size=_BYTES, person=b"weights")
    for buf in buffers:
        view = memoryview(buf).cast("B")
        h.update(len(view).to_bytes(8, "little"))
        h.update(view)
    return h.hexdigest()
