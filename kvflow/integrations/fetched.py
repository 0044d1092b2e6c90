"""Fetched: the outcome of one key of a read into a buffer that may be larger than the value
(Mooncake's ``get_into`` contract), shared by the member and its peer readers."""

from __future__ import annotations

from typing import NamedTuple


class Fetched(NamedTuple):
    """``source`` "dram" / "ssd" / "remote": the value's ``nbytes`` are in the buffer's head.
    ``source`` None: a miss (``nbytes`` 0), or a buffer too small for the value (``nbytes``
    is the value's size; nothing was read)."""

    source: str | None
    nbytes: int

    @property
    def too_small(self) -> bool:
        return self.source is None and self.nbytes > 0


MISS = Fetched(None, 0)

__all__ = ["MISS", "Fetched"]
