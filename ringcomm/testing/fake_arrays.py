"""The fake runtime's arrays as a kind of device array the communicator accepts: a
``FakeDeviceArray`` is read without a copy, as a CuPy array is on a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.device import runtime
from ..core.device.kinds import RuntimeKind
from ..core.device.runtime import DeviceRuntime
from .fake_device import FakeDeviceArray


class FakeArrayKind(RuntimeKind):
    """``FakeDeviceArray``: the caller's stream is the fake runtime's current one."""

    noun = "a ringcomm FakeDeviceArray"

    def owns(self, x: Any) -> bool:
        return isinstance(x, FakeDeviceArray)

    def runtime_of(self, x: Any) -> DeviceRuntime:
        own = getattr(x, "runtime", None)
        return own if own is not None else runtime("fake")

    def device_of(self, x: Any, runtime: DeviceRuntime) -> int | None:
        return int(x.allocation.device)

    def describe(self, x: Any, name: str, writable: bool) -> tuple[np.dtype, int]:
        return np.dtype(x.dtype), int(x.size)

    def pointer(self, x: Any) -> int:
        return int(x.ptr)
