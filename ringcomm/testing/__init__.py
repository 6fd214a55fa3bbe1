"""Test doubles for ringcomm's device path, for machines without a GPU.

ringcomm's own tests use them, and so may yours: a program that hands ringcomm device
arrays can run its tests on a CPU with ``ringcomm.init(device="fake")`` (or
``RINGCOMM_DEVICE=fake``) and arrays of the fake runtime.

- ``FakeRuntime`` (``fake_device``): a strict fake of the CUDA runtime calls ringcomm makes,
  in numpy: lazy streams, device memory the host cannot read, real interprocess memory and
  events between processes, and a fault wherever a GPU would punish a mistake.
- ``FakeDeviceArray``: an array in that memory (``.to_host()`` reads it back).
- ``FakeCupyNccl`` (``fake_nccl``): a fake of CuPy's ``cupy.cuda.nccl`` module over it.

Each models what the real library was measured or documented to do, and each module lists
what it refuses and the source of every rule. Importing this package registers the
runtime "fake" (and its NCCL and array kind) with ``ringcomm.core.device``.

Example::

    import numpy as np
    import ringcomm
    from ringcomm.testing import FakeDeviceArray

    comm = ringcomm.init(rank, world, store, device="fake")
    x = FakeDeviceArray.from_host(np.arange(4.0))
    comm.allreduce(x)
    print(x.to_host())
"""

from __future__ import annotations

from ..core import arrays
from ..core.device import register_runtime
from ..core.device.cupy_nccl import CupyNccl
from ..core.device.nccl import NcclLibrary
from ..core.device.runtime import DeviceRuntime
from .fake_arrays import FakeArrayKind
from .fake_device import FakeDeviceArray, FakeDeviceFault, FakeRuntime
from .fake_kernels import StreamLauncher
from .fake_nccl import FakeCupyNccl, FakeNcclError

__all__ = ["FakeCupyNccl", "FakeDeviceArray", "FakeDeviceFault", "FakeNcclError",
           "FakeRuntime"]


def _fake_nccl(rt: DeviceRuntime) -> NcclLibrary:
    assert isinstance(rt, FakeRuntime)
    return CupyNccl(FakeCupyNccl.of(rt), name="fake")


register_runtime("fake", FakeRuntime, _fake_nccl)
FakeRuntime.launcher_factory = StreamLauncher  # the kernel path's launch: the kernels' mirror
arrays.register(FakeArrayKind())
