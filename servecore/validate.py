"""Checks at the door, shared by both engines: every value is checked for the type and range it
will have on the device, and a bad one is a ``ValueError`` that names it. Nothing is coerced
silently: ``1.9`` is not a token id, ``"2"`` is not a stop id, ``True`` is not an int.

Device ranges: ids, counts and seeds travel as int32 (``INT32_MAX``); sampling settings as
float32 (``FLOAT32_MAX``).

>>> check_int("top_k", 5, 0, INT32_MAX)
5
>>> check_int("top_k", 2**31, 0, INT32_MAX)
Traceback (most recent call last):
...
ValueError: top_k=2147483648 must be an int in [0, 2147483647]
>>> token_ids("prompt 0", [1, 2], vocab_size=4)
[1, 2]
>>> token_ids("prompt 0", [1.0, 2], vocab_size=4)
Traceback (most recent call last):
...
ValueError: prompt 0: token 0 is 1.0 (float), not an int
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FLOAT32_MAX",
    "INT32_MAX",
    "check_int",
    "check_real",
    "eos_token_ids",
    "is_int",
    "options_of",
    "plain_ints",
    "prompt_list",
    "stop_ids",
    "token_ids",
]

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_int(value: Any) -> bool:
    """A Python or NumPy integer (``bool`` is not an int here).

    >>> is_int(3), is_int(np.int64(3)), is_int(3.0), is_int(True)
    (True, True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def plain_ints(values: Any, hi: int) -> bool:
    """True when ``values`` is a list or tuple of Python ints (``type(x) is int``: no bool,
    no NumPy scalar) in ``[0, hi)``: the common case of the checks below, at C speed (about
    30 us for 500 tokens, against 0.4 us an element for the general check). Anything else
    takes the general check, which also writes the error.

    >>> plain_ints([1, 2], 4), plain_ints([1, True], 4), plain_ints((5,), 4)
    (True, False, False)
    """
    if type(values) is not list and type(values) is not tuple:
        return False
    if not values:
        return True
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) < hi


def check_int(name: str, value: Any, lo: int, hi: int = INT32_MAX) -> int:
    """``value`` as a Python int if it is an int in ``[lo, hi]``, else ``ValueError`` naming it.

    >>> check_int("seed", np.int32(7), 0)
    7
    >>> check_int("seed", -1, 0)
    Traceback (most recent call last):
    ...
    ValueError: seed=-1 must be an int in [0, 2147483647]
    """
    if not is_int(value) or not lo <= int(value) <= hi:
        raise ValueError(f"{name}={value!r} must be an int in [{lo}, {hi}]")
    return int(value)


def options_of(cls: Any, given: dict[str, Any], owner: str) -> Any:
    """``cls(**given)`` for an options dataclass ``cls``, a name that is none of its fields a
    ``TypeError`` that lists them (``owner`` is what was called).

    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Opts:
    ...     size: int = 1
    >>> options_of(Opts, {"size": 2}, "Engine()")
    Opts(size=2)
    >>> options_of(Opts, {"szie": 2}, "Engine()")
    Traceback (most recent call last):
    ...
    TypeError: Engine() has no option 'szie': its options are Opts's fields (size)
    """
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in given if k not in names]
    if unknown:
        listed = ", ".join(repr(k) for k in unknown)
        raise TypeError(f"{owner} has no option {listed}: its options are {cls.__name__}'s "
                        f"fields ({', '.join(names)})")
    return cls(**given)


def check_real(name: str, value: Any) -> float:
    """``value`` as a Python float if it is a finite real number that float32 can hold.

    >>> check_real("temperature", 1)
    1.0
    >>> check_real("temperature", 1e39)
    Traceback (most recent call last):
    ...
    ValueError: temperature=1e+39 must be a finite number (float32 range)
    """
    if (not isinstance(value, numbers.Real) or isinstance(value, bool | np.bool_)
            or not np.isfinite(value) or abs(float(value)) > FLOAT32_MAX):
        raise ValueError(f"{name}={value!r} must be a finite number (float32 range)")
    return float(value)


def token_ids(name: str, ids: Any, vocab_size: int, *, allow_empty: bool = False) -> list[int]:
    """``ids`` (a sequence or 1-D array of ints) as a list of ints in ``[0, vocab_size)``.

    >>> token_ids("stop_token_ids", (3,), vocab_size=4)
    [3]
    >>> token_ids("prompt 1", [[1, 2]], vocab_size=4)
    Traceback (most recent call last):
    ...
    ValueError: prompt 1: token 0 is [1, 2] (list), not an int
    """
    if plain_ints(ids, vocab_size) and (ids or allow_empty):
        return list(ids)
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray) and not hasattr(
            ids, "tolist"):
        raise ValueError(f"{name} must be a list of token ids, got {_short(ids)}")
    if hasattr(ids, "tolist") and not isinstance(ids, Sequence):  # numpy / mlx / jax arrays
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D array of int token ids, got shape "
                             f"{arr.shape} dtype {arr.dtype}")
        ids = arr.tolist()
    out = []
    for i, t in enumerate(ids):
        if not is_int(t):
            raise ValueError(f"{name}: token {i} is {_short(t)} ({type(t).__name__}), not an int")
        if not 0 <= int(t) < vocab_size:
            raise ValueError(f"{name}: token {i} is {int(t)}, outside the vocabulary "
                             f"[0, {vocab_size})")
        out.append(int(t))
    if not out and not allow_empty:
        raise ValueError(f"{name} is empty")
    return out


def stop_ids(value: Any, vocab_size: int) -> frozenset[int]:
    """Stop token ids: ``None`` (none), one int, or a sequence of ints in the vocabulary.

    >>> sorted(stop_ids(2, vocab_size=4)), sorted(stop_ids([1, 3], vocab_size=4))
    ([2], [1, 3])
    >>> stop_ids("2", vocab_size=4)
    Traceback (most recent call last):
    ...
    ValueError: stop_token_ids must be a list of token ids, got '2'
    """
    if value is None:
        return frozenset()
    if is_int(value):
        value = [value]
    return frozenset(token_ids("stop_token_ids", value, vocab_size, allow_empty=True))


def prompt_list(prompts: Any) -> list[Any]:
    """``prompts`` read once into a list (so a generator is not read twice), refusing what is
    not a collection of prompts: a string, a flat list of ints or a list of chat messages (one
    prompt: wrap it in a list), ``None`` or an empty collection. What a prompt is:
    ``servecore.prompts``.

    >>> prompt_list(p for p in ([1, 2], [3]))
    [[1, 2], [3]]
    >>> prompt_list([1, 2, 3])
    Traceback (most recent call last):
    ...
    ValueError: prompts must be a list of prompts, got a flat list of token ids [1, 2, 3]: \
wrap one prompt in a list ([prompt])
    """
    if prompts is None or isinstance(prompts, str | bytes | dict) or not isinstance(
            prompts, Iterable):
        raise ValueError(f"prompts must be a non-empty list of prompts, got {_short(prompts)}")
    if hasattr(prompts, "ndim") and getattr(prompts, "ndim", 0) == 1:
        raise ValueError(f"prompts must be a list of prompts, got a 1-D array {_short(prompts)}: "
                         "wrap one prompt in a list ([prompt])")
    out = list(prompts)
    if not out:
        raise ValueError("prompts must be a non-empty list of prompts, got an empty one")
    if all(is_int(p) for p in out):
        raise ValueError(f"prompts must be a list of prompts, got a flat list of token ids "
                         f"{_short(out)}: wrap one prompt in a list ([prompt])")
    if all(isinstance(p, Mapping) for p in out):  # a chat is one prompt, not one per message
        raise ValueError(f"prompts must be a list of prompts, got a list of chat messages "
                         f"{_short(out)}: wrap one chat in a list ([messages])")
    return out


def eos_token_ids(tokenizer: Any) -> frozenset[int]:
    """A tokenizer's end-of-sequence ids, whichever form it keeps them in: mlx-lm's
    ``eos_token_ids`` (a set or list), or Hugging Face's ``eos_token_id`` (an int, a list, or
    ``None``; transformers 5 may also give ``eos_token_ids`` as an int). No tokenizer: none.

    >>> class HF: eos_token_id = 2
    >>> class MLX: eos_token_ids = {2, 7}
    >>> sorted(eos_token_ids(HF())), sorted(eos_token_ids(MLX())), sorted(eos_token_ids(None))
    ([2], [2, 7], [])
    """
    if tokenizer is None:
        return frozenset()
    for attr in ("eos_token_ids", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is None:
            continue
        values = [value] if is_int(value) else list(value)
        bad = [v for v in values if not is_int(v) or int(v) < 0]
        if bad:
            raise ValueError(f"tokenizer.{attr}={value!r}: not token ids")
        return frozenset(int(v) for v in values)
    return frozenset()


def _short(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."
