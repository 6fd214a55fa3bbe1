"""A numpy-backed fake device: arrays that the host reaches only through explicit copies.

It lets a machine without a GPU run the device side of the buffer protocol
(``ringcomm.core.arrays.DeviceBuffer``, staged as ``StagedBuffer``) and check it: a
``FakeDeviceArray`` keeps its values in private memory, refuses implicit host access
(``np.asarray`` raises ``TypeError``, and it offers no buffer protocol), and logs every
explicit copy and every hook in order. Work that writes it is queued on a ``FakeStream`` and
must be waited for before the array is read, and values copied in from the host must be
recorded before anyone reads them, as on a real device; a read that breaks either rule
raises. So a test that forgets nothing passes, and an executor that reads before
``before_op`` or returns results without ``after_op`` fails.

Importing this module registers ``FakeDeviceKind``: every communicator then accepts these
arrays. It is the template for a real device kind (CuPy, torch CUDA).

Example::

    x = FakeDeviceArray(np.arange(4.0))
    comm.allreduce(x)
    x.log             # ["wait", "to_host", "from_host", "record"]
    x.to_host()       # the sum, copied to the host
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import DeviceKind, register
from .dtypes import dtype_code


class FakeStream:
    """An in-order queue of device work, as far as a reader can tell: ``launch`` queues work,
    ``event`` marks how far the queue has got, and ``wait(event)`` returns once the work up
    to that point is done (here: at once, and it counts as done from then on)."""

    def __init__(self, name: str = "stream") -> None:
        self.name = name
        self.launched = 0  # work items queued so far
        self.finished = 0  # of which known to be done (waited for)

    def launch(self) -> None:
        self.launched += 1

    def event(self) -> int:
        return self.launched

    def wait(self, event: int) -> None:
        self.finished = max(self.finished, event)

    @property
    def idle(self) -> bool:
        return self.finished == self.launched

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}: {self.launched - self.finished} unfinished>"


class FakeDeviceArray:
    """An array in fake device memory, filled with a copy of ``values`` by work queued on
    ``stream`` (a fresh one by default).

    ``log`` lists what was done to it since it was made: ``"wait"`` (a reader waited for
    its stream), ``"to_host"``, ``"from_host"``, ``"record"`` (a writer made its values
    visible).
    """

    __slots__ = ("stream", "log", "_memory", "_unrecorded")

    def __init__(self, values: Any, *, dtype: Any = None,
                 stream: FakeStream | None = None) -> None:
        self._memory = np.array(values, dtype=dtype)  # a copy, never shared
        self._memory.flags.writeable = False  # written only by from_host and fill_async
        self.stream = stream if stream is not None else FakeStream()
        self.stream.launch()
        self.log: list[str] = []
        self._unrecorded = False

    @classmethod
    def empty(cls, shape: int | tuple[int, ...], dtype: Any,
              stream: FakeStream | None = None) -> FakeDeviceArray:
        return cls(np.zeros(shape, dtype), stream=stream)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._memory.shape

    @property
    def dtype(self) -> np.dtype:
        return self._memory.dtype

    @property
    def size(self) -> int:
        return self._memory.size

    @property
    def nbytes(self) -> int:
        return self._memory.nbytes

    @property
    def copies_to_host(self) -> int:
        return self.log.count("to_host")

    @property
    def copies_from_host(self) -> int:
        return self.log.count("from_host")

    # -- explicit access
    def to_host(self, out: np.ndarray | None = None) -> np.ndarray:
        """Copy the values to host memory (``out``, 1-D, if given); refused while work that
        writes them is unfinished or values copied in are not recorded yet."""
        if not self.stream.idle:
            raise RuntimeError(
                f"read while work on {self.stream.name} that writes this array is "
                "unfinished: wait for the stream first")
        if self._unrecorded:
            raise RuntimeError("read before the values copied into this array were "
                               "recorded: the writer must record them first")
        self.log.append("to_host")
        if out is None:
            return self._memory.copy()
        np.copyto(out, self._memory.reshape(-1))
        return out

    def from_host(self, src: np.ndarray) -> None:
        """Copy ``src`` (as many elements, any shape) into the array; readers see the new
        values once ``record`` is called."""
        self._write(np.asarray(src).reshape(self.shape))
        self.log.append("from_host")
        self._unrecorded = True

    def fill_async(self, values: Any) -> None:
        """Device work on the array's stream that writes ``values`` into it."""
        self._write(np.broadcast_to(np.asarray(values, self.dtype), self.shape))
        self.stream.launch()

    def wait_stream(self, event: int | None = None) -> None:
        """Wait for the work on the array's stream (up to ``event``, else all of it)."""
        self.stream.wait(self.stream.event() if event is None else event)
        self.log.append("wait")

    def record(self) -> None:
        """Make values copied in visible to later readers."""
        self._unrecorded = False
        self.log.append("record")

    def _write(self, values: np.ndarray) -> None:
        self._memory.flags.writeable = True
        try:
            np.copyto(self._memory, values)
        finally:
            self._memory.flags.writeable = False

    # -- no implicit access
    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("a FakeDeviceArray is in device memory: copy it with .to_host()")

    def __repr__(self) -> str:
        return f"<FakeDeviceArray {self.shape} {self.dtype} on {self.stream.name}>"


class FakeDeviceKind(DeviceKind):
    """The buffer protocol's view of ``FakeDeviceArray``: the pattern a real device kind
    follows."""

    noun = "a ringcomm FakeDeviceArray"
    memory = "fake-device"

    def owns(self, x: Any) -> bool:
        return isinstance(x, FakeDeviceArray)

    def layout(self, x: FakeDeviceArray, name: str) -> tuple[np.dtype, int]:
        dtype_code(x.dtype)
        return x.dtype, x.size

    def producer(self, x: FakeDeviceArray) -> int:
        return x.stream.event()

    def wait_for(self, x: FakeDeviceArray, producer: int) -> None:
        x.wait_stream(producer)

    def to_host(self, x: FakeDeviceArray, out: np.ndarray) -> None:
        x.to_host(out)

    def from_host(self, x: FakeDeviceArray, src: np.ndarray) -> None:
        x.from_host(src)

    def record(self, x: FakeDeviceArray) -> None:
        x.record()


register(FakeDeviceKind())
