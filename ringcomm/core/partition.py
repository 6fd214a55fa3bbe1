"""Cutting a range of elements into pieces: ring chunks and pipeline segments."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """``parts`` contiguous pieces of ``count`` elements, sizes differing by at most one.

    Used for ring chunks: piece ``i`` is ``[offset(i), offset(i) + size(i))``. The first
    ``count % parts`` pieces hold one element more, so every count (0, 1, fewer than ``parts``,
    indivisible) works.
    """

    count: int
    parts: int

    def size(self, i: int) -> int:
        q, r = divmod(self.count, self.parts)
        return q + (1 if i < r else 0)

    def offset(self, i: int) -> int:
        q, r = divmod(self.count, self.parts)
        return i * q + min(i, r)


def segments(offset: int, count: int, segment: int) -> list[tuple[int, int]]:
    """Split ``[offset, offset + count)`` into ``(offset, count)`` pieces of at most ``segment``."""
    if count <= 0:
        return []
    return [(o, min(segment, offset + count - o)) for o in range(offset, offset + count, segment)]
