"""The host half of the prefix cache for hybrid models (see ``servecore.snapshots``, where it
lives: ``mlxcache`` plans its snapshots with the same code).

>>> snapshot_points(prompt_len=300, kv_len=140, state_len=128, interval=64)
[140, 192, 256, 299]
"""

from servecore.snapshots import SnapshotSlots, snapshot_points

__all__ = ["SnapshotSlots", "snapshot_points"]
