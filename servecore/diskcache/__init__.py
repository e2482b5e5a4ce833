"""The disk tier of a prefix cache, framework-free: pages of K/V (and recurrent states) that
outlive the process, named by keys that cannot lie.

* ``keys``: the salt (everything that gives cached bytes their meaning) and chained page keys;
* ``pagefile``: one page as one file, written crash-safely, read only when whole;
* ``index``: the directory's record of its pages (SQLite);
* ``store``: ``DiskStore``, the directory with its budget, its lock and its threads.
"""

from servecore.diskcache.keys import FORMAT_VERSION, chain, digest_buffers, page_key, salt
from servecore.diskcache.pagefile import CorruptPage, Page
from servecore.diskcache.store import DirectoryInUse, DiskStats, DiskStore

__all__ = ["FORMAT_VERSION", "CorruptPage", "DirectoryInUse", "DiskStats", "DiskStore", "Page",
           "chain", "digest_buffers", "page_key", "salt"]
