"""``pytree_dataclass``: the one way hybridattn declares an immutable state pytree.

A frozen dataclass registered with JAX. Fields listed in ``static`` go to the treedef (they
must be hashable: ints, tuples, strings); every other field is a child. Unflattening bypasses
``__init__`` so ``jax.tree.map`` to non-array leaves (``None``, ``ShapeDtypeStruct``, specs)
works even when ``__init__`` is type-checked. ``x.replace(field=value)`` returns a new value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import jax

T = TypeVar("T")


def pytree_dataclass(static: tuple[str, ...] = ()) -> Callable[[type[T]], type[T]]:
    """Class decorator: frozen dataclass + pytree registration with ``static`` aux fields.

    >>> @pytree_dataclass(static=("n",))
    ... class Box:
    ...     x: jax.Array
    ...     n: int
    >>> b = Box(jax.numpy.zeros(2), 3)
    >>> jax.tree.leaves(b), b.replace(n=4).n
    ([Array([0., 0.], dtype=float32)], 4)
    """

    def wrap(cls: type[T]) -> type[T]:
        cls = dataclasses.dataclass(frozen=True)(cls)
        names = tuple(f.name for f in dataclasses.fields(cls))
        unknown = set(static) - set(names)
        if unknown:
            raise TypeError(f"{cls.__name__}: static fields {sorted(unknown)} are not fields")
        children = tuple(n for n in names if n not in static)

        def flatten_with_keys(obj):
            kids = tuple((jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in children)
            return kids, tuple(getattr(obj, n) for n in static)

        def flatten(obj):
            return tuple(getattr(obj, n) for n in children), tuple(getattr(obj, n) for n in static)

        def unflatten(aux, kids):
            obj = object.__new__(cls)
            for n, v in zip(children, kids, strict=True):
                object.__setattr__(obj, n, v)
            for n, v in zip(static, aux, strict=True):
                object.__setattr__(obj, n, v)
            return obj

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)

        def replace(self, **changes):
            """A copy with the given fields changed (the original is left as it was)."""
            bad = set(changes) - set(names)
            if bad:
                raise TypeError(f"{cls.__name__} has no fields {sorted(bad)}")
            obj = object.__new__(cls)
            for n in names:
                object.__setattr__(obj, n, changes.get(n, getattr(self, n)))
            return obj

        replace.__qualname__ = f"{cls.__qualname__}.replace"
        cls.replace = replace
        return cls

    return wrap
