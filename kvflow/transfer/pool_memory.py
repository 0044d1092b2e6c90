"""Pool memory: a large zeroed byte region that costs resident memory only as it is written.

The KV page pool and the kvdb DRAM tier are each one such region. It is an anonymous private
mapping, so the kernel maps zero pages on first write, and it asks for small pages
(``MADV_NOHUGEPAGE``): numpy marks large arrays for transparent huge pages, and where the
kernel's THP defrag setting is ``madvise`` (a common default, and this project's CI machine's)
the first write into each 2 MiB page of a marked region compacts memory on the spot, ~5 ms a
page on a busy host. A fresh server's prompt stores and mixed prefill steps paid that on the
request path (docs/performance.md).
"""

from __future__ import annotations

import mmap

import numpy as np


def pool_bytes(nbytes: int) -> np.ndarray:
    """A writable, zeroed uint8 array of ``nbytes`` over its own anonymous mapping (lazily
    mapped, small pages where the platform has ``MADV_NOHUGEPAGE``). The mapping lives as long
    as the array and any view of it."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        region.madvise(advice)
    return np.frombuffer(region, dtype=np.uint8)
