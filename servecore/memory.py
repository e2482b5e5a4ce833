"""The memory probe both engines size their default pools from.

Available memory is the least of what the OS reports as available (``MemAvailable`` on Linux,
physical pages elsewhere) and what every cgroup the process lives in still allows (``memory.max
- memory.current`` in cgroup v2, ``memory.limit_in_bytes - memory.usage_in_bytes`` in v1), so a
container with a 4 GiB limit on a 512 GiB host sizes its pools from 4 GiB.

>>> budget, source = memory_budget()
>>> budget > 0, isinstance(source, str)
(True, True)
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_memory_bytes", "cgroup_available_bytes", "memory_budget"]

_UNLIMITED = 1 << 62  # cgroup v1 writes a huge number for "no limit"


def available_memory_bytes() -> int:
    """Bytes of memory available to this process (see the module docstring).

    >>> available_memory_bytes() > 0
    True
    """
    return memory_budget()[0]


def memory_budget(proc: str | os.PathLike = "/proc",
                  cgroup: str | os.PathLike = "/sys/fs/cgroup") -> tuple[int, str]:
    """``(bytes available, where the figure came from)``; ``proc`` and ``cgroup`` are the
    roots read (tests point them at fake trees).

    >>> budget, source = memory_budget()
    >>> budget > 0 and source in ("MemAvailable", "physical memory", "cgroup memory limit")
    True
    """
    host, source = _host_available(Path(proc))
    limited = cgroup_available_bytes(Path(proc), Path(cgroup))
    if limited is not None and limited < host:
        return limited, "cgroup memory limit"
    return host, source


def _host_available(proc: Path) -> tuple[int, str]:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def cgroup_available_bytes(proc: Path = Path("/proc"),
                           cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What the process's cgroups still allow, the least over the group and its ancestors
    (a limit may sit on any of them); ``None`` when no limit is set or none can be read.

    >>> left = cgroup_available_bytes()
    >>> left is None or left >= 0
    True
    """
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 unified hierarchy
            files, base = ("memory.max", "memory.current"), cgroup
        elif "memory" in controllers.split(","):  # v1 memory controller
            files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), cgroup / "memory"
        else:
            continue
        node = base / path.lstrip("/")
        while True:
            left = _left(node, *files)
            if left is not None:
                best = left if best is None else min(best, left)
            if node == base or base not in node.parents:
                break
            node = node.parent
    return best


def _left(node: Path, limit_file: str, usage_file: str) -> int | None:
    try:
        limit = (node / limit_file).read_text().strip()
        usage = int((node / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= _UNLIMITED:
        return None
    return max(int(limit) - usage, 0)
