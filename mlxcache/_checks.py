"""A fast path for the door checks: plain lists of plain ints.

``servecore.validate`` checks every element with ``isinstance(x, numbers.Integral)``, an ABC
check of about 0.4 us; mlxcache checks a prompt at the door and its tokens or slots again in the
radix tree and the pool (a 528-token prompt is checked about five times on its way), which cost
a third of the host time of a shared-prefix prefill on the bench model. A list or tuple of
``int`` (``type(x) is int``: no bool, no NumPy scalar) in range passes here at C speed;
anything else takes the full check, which also writes the error.
"""

from __future__ import annotations

from typing import Any


def plain_ints(values: Any, hi: int) -> bool:
    """True when ``values`` is a list or tuple of Python ints in ``[0, hi)``."""
    if type(values) is not list and type(values) is not tuple:
        return False
    if not values:
        return True
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) < hi
