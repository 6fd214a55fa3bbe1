"""Scratch memory for the schedules that need room of their own (a tree's partial sums, an
all-to-all's staging): one growing buffer per communicator, reused by every op."""

from __future__ import annotations

import numpy as np


class Scratch:
    """Reusable scratch memory: grows to the largest need, never shrinks. Ops run one at a
    time, so one buffer serves them all."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None

    def get(self, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype``, valid until the next ``get``."""
        need = count * dtype.itemsize
        if self._buf is None or self._buf.nbytes < need:
            self._buf = np.empty(need, np.uint8)
        return self._buf[:need].view(dtype)
