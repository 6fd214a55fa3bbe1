"""The kinds of device arrays the communicator accepts, each read without a copy.

Every kind here is a ``RuntimeKind``: it says which runtime's memory holds an array, the
device pointer of its first element, its dtype, count and device, and which stream the
caller's work on it is queued on (``DeviceLayout``); ``ringcomm.core.arrays.DeviceBuffer``
does the rest through the runtime. What they all refuse, with the call to make instead:
arrays that are not contiguous, dtypes the core does not know (float16 and bfloat16 are
known), and arrays on a device other than the runtime's current one (a stream of another
device cannot order work on this one).

- ``CupyKind``: ``cupy.ndarray`` (pointer ``a.data.ptr``, the caller's stream CuPy's current
  one).
- ``TorchCUDAKind``: torch CUDA tensors through the CuPy runtime (pointer ``data_ptr()``,
  the caller's stream torch's current stream of the tensor's device, as an external stream).
- ``CudaInterfaceKind``: any object with ``__cuda_array_interface__`` (v3's ``stream`` key is
  the stream the producer event is recorded on and the results are ordered on).
- ``DLPackKind``: any object whose ``__dlpack_device__`` is CUDA, through
  ``cupy.from_dlpack`` (zero copy; the producer synchronizes with CuPy's stream there).

Registered with ``ringcomm.core.arrays.register`` when this module is imported (the
communicator imports it), newest first, so the specific kinds are asked before the
protocols. The fake runtime's arrays are a ``RuntimeKind`` too, registered by
``ringcomm.testing`` when it is imported. Nothing here imports cupy or torch: a type is
recognised through ``sys.modules`` (an array of a library that was never imported cannot
exist), and the CuPy runtime is made only for an array that needs it.
"""

from __future__ import annotations

import abc
import importlib
import math
import sys
from typing import Any

import numpy as np

from ...errors import ArgumentError
from .. import device as _device_package
from ..arrays import DeviceKind, DeviceLayout, as_buffer, register
from ..dtypes import dtype_code
from .runtime import DeviceRuntime, Stream

_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


def _runtime(name: str) -> DeviceRuntime:
    """The process-wide runtime ``name`` (an ``ArgumentError`` where it cannot be had)."""
    return _device_package.runtime(name)


def _cupy() -> Any:
    """CuPy, once its runtime is in use (so it imports)."""
    return importlib.import_module("cupy")


_INTERFACE_RUNTIME: list[DeviceRuntime] = []  # chosen once per process


def _interface_runtime() -> DeviceRuntime:
    """The runtime that reads memory named only by a pointer (the CUDA array interface):
    CuPy's where a GPU can be used, else the fake one where ``ringcomm.testing`` registered
    it (its pointers are the only device pointers a machine without a GPU has). Chosen
    once per process; an ``ArgumentError`` where there is neither."""
    if not _INTERFACE_RUNTIME:
        try:
            cupy = _runtime("cupy")
            chosen = cupy if cupy.available() else None
        except ArgumentError:
            chosen = None
        if chosen is None:
            if "fake" not in _device_package.registered():
                raise ArgumentError("device memory named by __cuda_array_interface__, but no "
                                    "GPU can be used here (CuPy sees none)")
            chosen = _runtime("fake")
        _INTERFACE_RUNTIME.append(chosen)
    return _INTERFACE_RUNTIME[0]


def _known_dtype(dtype: np.dtype, name: str) -> np.dtype:
    try:
        dtype_code(dtype)
    except ArgumentError as err:
        raise ArgumentError(f"{name}: {err}") from None
    return dtype


def _on_current_device(runtime: DeviceRuntime, device: int, name: str, how: str) -> None:
    current = runtime.current_device()
    if device != current:
        raise ArgumentError(
            f"{name} is on device {device} but the current device is {current}: make "
            f"{device} current on this thread first ({how}), or move {name} to device "
            f"{current}")


class RuntimeKind(DeviceKind):
    """Arrays in a ``DeviceRuntime``'s memory (see the module docstring)."""

    #: how the caller makes a device current, for the error that asks for it
    set_device_hint = "ringcomm.core.device.runtime(...).set_device(i)"

    def layout(self, x: Any, name: str, writable: bool) -> DeviceLayout:
        runtime = self.runtime_of(x)
        device = self.device_of(x, runtime)
        if device is not None:
            _on_current_device(runtime, device, name, self.set_device_hint)
        else:
            device = runtime.current_device()
        dtype, count = self.describe(x, name, writable)
        return DeviceLayout(runtime, self.pointer(x), _known_dtype(dtype, name), count, device,
                            self.stream(x, runtime))

    @abc.abstractmethod
    def runtime_of(self, x: Any) -> DeviceRuntime:
        """The runtime whose memory holds ``x``."""

    @abc.abstractmethod
    def device_of(self, x: Any, runtime: DeviceRuntime) -> int | None:
        """The device ``x`` is on (None: unknown, taken to be the current one)."""

    @abc.abstractmethod
    def describe(self, x: Any, name: str, writable: bool) -> tuple[np.dtype, int]:
        """``x``'s element dtype (as numpy names it) and count; an ``ArgumentError`` where it
        is not contiguous or cannot be written though the op writes it."""

    @abc.abstractmethod
    def pointer(self, x: Any) -> int:
        """The device pointer of ``x``'s first element."""

    def stream(self, x: Any, runtime: DeviceRuntime) -> Stream | None:
        """The stream the caller's work on ``x`` is queued on (None: the runtime's current
        stream on the calling thread)."""
        return None


def _contiguity(name: str, call: str) -> ArgumentError:
    return ArgumentError(f"{name} is not contiguous; pass {call} and copy results back")


class CupyKind(RuntimeKind):
    """``cupy.ndarray``: CuPy's current stream is the caller's."""

    noun = "a CuPy array"
    set_device_hint = "cupy.cuda.Device(i).use()"

    def owns(self, x: Any) -> bool:
        cupy = sys.modules.get("cupy")
        return cupy is not None and isinstance(x, cupy.ndarray)

    def runtime_of(self, x: Any) -> DeviceRuntime:
        return _runtime("cupy")

    def device_of(self, x: Any, runtime: DeviceRuntime) -> int | None:
        return int(x.device.id)

    def describe(self, x: Any, name: str, writable: bool) -> tuple[np.dtype, int]:
        if not x.flags.c_contiguous:
            raise _contiguity(name, f"cupy.ascontiguousarray({name})")
        return np.dtype(x.dtype), int(x.size)

    def pointer(self, x: Any) -> int:
        return int(x.data.ptr)


_TORCH_DTYPES: dict[Any, np.dtype] = {}


def torch_numpy_dtype(dtype: Any, name: str = "tensor") -> np.dtype:
    """numpy's name for torch ``dtype`` (``ml_dtypes``' for bfloat16), as the core views
    it; an ``ArgumentError`` naming ``name`` for a dtype the core does not know."""
    host = _TORCH_DTYPES.get(dtype)
    if host is None:
        torch = sys.modules["torch"]  # loaded: a tensor was handed in
        empty = torch.empty(0, dtype=dtype, device="cpu")
        host = _TORCH_DTYPES[dtype] = as_buffer(empty, name=name).dtype
    return host


class TorchCUDAKind(RuntimeKind):
    """torch CUDA tensors, through the CuPy runtime: the caller's stream is torch's current
    stream of the tensor's device (``torch.cuda.current_stream``), taken as an external
    stream."""

    noun = "a torch CUDA tensor"
    set_device_hint = "torch.cuda.set_device(i)"

    def owns(self, x: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(x, torch.Tensor) and x.is_cuda

    def runtime_of(self, x: Any) -> DeviceRuntime:
        return _runtime("cupy")

    def device_of(self, x: Any, runtime: DeviceRuntime) -> int | None:
        return int(x.device.index)

    def describe(self, x: Any, name: str, writable: bool) -> tuple[np.dtype, int]:
        torch = sys.modules["torch"]
        if x.layout != torch.strided:
            raise ArgumentError(f"{name} is a {x.layout} tensor; ringcomm takes dense tensors "
                                "(call .to_dense())")
        if x.is_conj() or x.is_neg():
            raise ArgumentError(f"{name} is a conjugate or negated view; pass "
                                f"{name}.resolve_conj().resolve_neg()")
        if not x.is_contiguous():
            raise _contiguity(name, f"{name}.contiguous()")
        return torch_numpy_dtype(x.dtype, name), int(x.numel())

    def pointer(self, x: Any) -> int:
        return int(x.data_ptr())

    def stream(self, x: Any, runtime: DeviceRuntime) -> Stream | None:
        torch = sys.modules["torch"]
        return runtime.external_stream(torch.cuda.current_stream(x.device).cuda_stream)


def export_problem(x: Any) -> str:
    """Why the memory of device array ``x`` cannot be shared with another process through a
    CUDA IPC handle, where its kind says so before the driver is asked ("" otherwise): torch's
    caching allocator with expandable segments maps memory with ``cuMemCreate``/``cuMemMap``,
    and its ``cudaMallocAsync`` backend takes it from a stream-ordered pool; neither has a
    ``cudaIpcGetMemHandle`` handle."""
    if not TorchCUDAKind().owns(x):
        return ""
    torch = sys.modules["torch"]
    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "")()
    return torch_allocator_problem(str(settings), torch.cuda.get_allocator_backend())


def torch_allocator_problem(settings: str, backend: str) -> str:
    """``export_problem`` for torch's allocator, from its settings (``PYTORCH_ALLOC_CONF``'s
    form, ``expandable_segments:True,...``) and its backend's name."""
    options = dict(part.split(":", 1) for part in settings.replace(" ", "").split(",")
                   if ":" in part)
    if options.get("expandable_segments", "").lower() == "true":
        return ("torch's caching allocator runs with expandable_segments:True, whose memory "
                "(cuMemCreate/cuMemMap) has no CUDA IPC handle; unset it in "
                "PYTORCH_ALLOC_CONF to register tensors")
    if backend == "cudaMallocAsync":
        return ("torch's allocator backend is cudaMallocAsync, whose stream-ordered pool has "
                "no CUDA IPC handles; use the native backend to register tensors")
    return ""


def _c_contiguous(shape: tuple[int, ...], strides: Any, itemsize: int) -> bool:
    """Whether byte ``strides`` lay ``shape`` out in C order without gaps (a dimension of
    length 1 may have any stride)."""
    if strides is None or math.prod(shape) == 0:
        return True
    expected = itemsize
    for length, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
        if length != 1 and stride != expected:
            return False
        expected *= length
    return True


class CudaInterfaceKind(RuntimeKind):
    """Objects with ``__cuda_array_interface__`` (numba, CuPy, PyTorch and others export it):
    ``data`` is (pointer, read-only), ``strides`` must be None or C-contiguous, ``mask``
    None; v3's ``stream`` key, where given, is the stream the producer event is recorded on
    (the protocol obliges the consumer to order its work after that stream's)."""

    noun = "an object with __cuda_array_interface__"

    def owns(self, x: Any) -> bool:
        return hasattr(x, "__cuda_array_interface__")

    @staticmethod
    def _interface(x: Any) -> dict[str, Any]:
        interface: dict[str, Any] = x.__cuda_array_interface__
        return interface

    def runtime_of(self, x: Any) -> DeviceRuntime:
        return _interface_runtime()

    def device_of(self, x: Any, runtime: DeviceRuntime) -> int | None:
        if runtime.name != "cupy":
            return None
        ptr = self._interface(x)["data"][0]
        return int(_cupy().cuda.runtime.pointerGetAttributes(ptr).device) if ptr else None

    def describe(self, x: Any, name: str, writable: bool) -> tuple[np.dtype, int]:
        cai = self._interface(x)
        try:
            shape = tuple(int(n) for n in cai["shape"])
            dtype = np.dtype(cai["typestr"])
            _, readonly = cai["data"]
        except (KeyError, TypeError, ValueError) as err:
            raise ArgumentError(f"{name}'s __cuda_array_interface__ cannot be read ({err!r}); "
                                "it needs shape, typestr and data (version 3)") from None
        if dtype.kind == "V":
            raise ArgumentError(
                f"{name}'s __cuda_array_interface__ says {cai['typestr']!r}, raw bytes: the "
                "interface has no name for bfloat16 or other such types; pass the array "
                "through DLPack (it names bfloat16), as a CuPy array or as a torch tensor")
        if cai.get("mask") is not None:
            raise ArgumentError(f"{name} is a masked array; ringcomm takes unmasked ones")
        if not _c_contiguous(shape, cai.get("strides"), dtype.itemsize):
            raise ArgumentError(f"{name} is not C-contiguous (strides {cai['strides']}); pass "
                                "a contiguous copy and copy results back")
        if writable and readonly:
            raise ArgumentError(f"{name} is read-only but the op writes its result into it")
        return dtype, math.prod(shape)

    def pointer(self, x: Any) -> int:
        return int(self._interface(x)["data"][0])

    def stream(self, x: Any, runtime: DeviceRuntime) -> Stream | None:
        handle = self._interface(x).get("stream")
        if handle is None:
            return None
        if handle == 0:
            raise ArgumentError("__cuda_array_interface__'s stream 0 is ambiguous and "
                                "disallowed by the protocol: export 1 (legacy default), 2 "
                                "(per-thread default) or the stream's handle")
        return runtime.external_stream(int(handle))


class DLPackKind(RuntimeKind):
    """Objects with ``__dlpack__`` whose ``__dlpack_device__`` is CUDA: imported with
    ``cupy.from_dlpack`` (zero copy), which asks the producer to order its work before
    CuPy's current stream; the buffer holds the CuPy array, so it is read as one."""

    noun = "a CUDA DLPack array"
    set_device_hint = "cupy.cuda.Device(i).use()"
    _cupy_kind = CupyKind()

    def owns(self, x: Any) -> bool:
        probe = getattr(x, "__dlpack_device__", None)
        if probe is None or not hasattr(x, "__dlpack__") or isinstance(x, np.ndarray):
            return False
        try:
            return int(probe()[0]) in _DLPACK_CUDA
        except Exception:  # noqa: BLE001 - a broken probe is not ours to take
            return False

    def buffer(self, x: Any, name: str, writable: bool, reads: bool) -> Any:
        _, device = x.__dlpack_device__()
        runtime = _runtime("cupy")
        if not runtime.available():
            raise ArgumentError(f"{name} is CUDA memory (DLPack) but no GPU can be used here")
        _on_current_device(runtime, int(device), name, self.set_device_hint)
        return self._cupy_kind.buffer(_cupy().from_dlpack(x), name, writable, reads)

    # the CuPy array made in ``buffer`` is what is described
    def runtime_of(self, x: Any) -> DeviceRuntime:
        return self._cupy_kind.runtime_of(x)

    def device_of(self, x: Any, runtime: DeviceRuntime) -> int | None:
        return self._cupy_kind.device_of(x, runtime)

    def describe(self, x: Any, name: str, writable: bool) -> tuple[np.dtype, int]:
        return self._cupy_kind.describe(x, name, writable)

    def pointer(self, x: Any) -> int:
        return self._cupy_kind.pointer(x)


# The kinds of their own go in front (oldest first: ``register`` puts each there); the two
# protocols are fallbacks, asked after the host kinds, so that a numpy array or a torch CPU
# tensor (which speak DLPack too) costs nothing more to take.
KINDS: tuple[RuntimeKind, ...] = (CupyKind(), TorchCUDAKind())
PROTOCOL_KINDS: tuple[RuntimeKind, ...] = (CudaInterfaceKind(), DLPackKind())
for _kind in KINDS:
    register(_kind)
for _kind in PROTOCOL_KINDS:
    register(_kind, fallback=True)
