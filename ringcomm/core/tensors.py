"""torch tensors as buffers, whatever their memory: the kinds the torch backend stages through.

- A contiguous CPU tensor of a dtype the core knows is host memory, used in place: a view
  of the tensor (``TorchCPUKind`` in ``arrays``), or, for a call that runs on the caller's
  thread from start to end, a view made from its address once per address, size and dtype
  (``HostViews``: viewing a tensor as numpy costs more than a small op's exchange).
- A contiguous CUDA tensor is device memory (``ringcomm.core.device.kinds.TorchCUDAKind``,
  memory ``cuda``): a device engine takes it as it is; every other engine gets it staged
  through host memory, ordered after the work the caller's stream had queued when the op
  was issued, and the caller's stream ordered after the results. That needs CuPy (the
  device runtime); without it a CUDA tensor is copied as below, by torch itself, which the
  communicator says once when it starts (``ringcomm.runtime.devices``).
- Any other tensor the host cannot view in place (strided, a conjugate or negated view, on
  another device; a strided CUDA tensor too) is copied once (``CopiedBuffer``): into a
  contiguous host copy when the op is issued, back into the tensor when the op is done.
- A dtype the core does not reduce moves as its bytes (``as_bytes``), for ops that only move.

``tensor_buffer`` picks among them for the torch backend. torch is never imported here until
a tensor shows that it is loaded.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import numpy as np

from .arrays import Buffer, HostBuffer
from .device.kinds import TorchCUDAKind, torch_numpy_dtype


def _torch() -> Any:
    return sys.modules["torch"]  # loaded: a tensor was handed in


numpy_dtype = torch_numpy_dtype


# dtypes the core reduces and moves as they are (``ringcomm.core.dtypes``), by torch's names
_CORE_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32",
                     "int64", "uint8", "bool", "complex64", "complex128")
_core_dtypes: frozenset[Any] | None = None


def core_dtypes() -> frozenset[Any]:
    """The torch dtypes the core takes as they are (torch is loaded: a tensor showed it)."""
    global _core_dtypes
    if _core_dtypes is None:
        torch = _torch()
        _core_dtypes = frozenset(getattr(torch, name) for name in _CORE_DTYPE_NAMES)
    return _core_dtypes


def viewable(t: Any, core_dtypes: frozenset[Any]) -> bool:
    """Whether the host can work on ``t``'s memory as it is: a dense, contiguous CPU tensor
    of a dtype the core knows, not a conjugate or negated view (an MKL-DNN tensor is on the
    CPU and says it is contiguous, but has no memory of its own to view)."""
    return (t.layout is _torch().strided and t.is_cpu and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and t.dtype in core_dtypes
            and _has_memory(t))


def _has_memory(t: Any) -> bool:
    """Whether ``t`` has memory of its own to view: a subclass that wraps other tensors (as
    DTensor does), or a fake tensor, says it is a dense CPU tensor but lies at address 0
    (or torch refuses to say where)."""
    try:
        return _addressed(t.data_ptr(), t.numel())
    except RuntimeError:
        return False


def _addressed(address: int, count: int) -> bool:
    """Whether ``count`` elements at ``address`` are memory to view (none lie at 0)."""
    return address != 0 or count == 0


class HostViews:
    """Host buffers over CPU tensors' memory, made once per address, size and dtype. A view
    made from an address keeps no tensor alive, so it is only for a call whose ops run on
    the caller's thread from start to end while the caller holds the tensor, and only for a
    tensor the caller checked is ``viewable``: exactly the memory the view covers."""

    _LIMIT = 64  # views kept (the latest made); a program reduces a few tensors over and over

    def __init__(self) -> None:
        self._views: dict[tuple[int, int, Any], HostBuffer] = {}
        self._lock = threading.Lock()  # misses only: threads may share a process group

    def of(self, t: Any) -> HostBuffer:
        key = (t.data_ptr(), t.numel(), t.dtype)
        view = self._views.get(key)
        if view is None:
            view = self._make(key)
        return view

    def tensor(self, x: Any) -> HostBuffer | None:
        """``x``'s view (``of``) where ``x`` is a torch tensor the host works on as it is
        (``viewable``); None for anything else (the caller takes the general way). The
        checks of ``viewable`` run on every call, since the same memory may be viewed
        strided or conjugated, all but the dtype's: a view is only ever made of a dtype the
        core knows. The entry of the smallest calls, so spelled out here."""
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor) or x.layout is not torch.strided \
                or not x.is_cpu or not x.is_contiguous() or x.is_conj() or x.is_neg():
            return None
        try:
            key = (x.data_ptr(), x.numel(), x.dtype)
        except RuntimeError:  # no memory of its own (``_has_memory``)
            return None
        view = self._views.get(key)
        if view is None:
            if key[2] not in core_dtypes() or not _addressed(key[0], key[1]):
                return None  # a dtype the core does not know, or no memory at an address
            view = self._make(key)
        return view

    def _make(self, key: tuple[int, int, Any]) -> HostBuffer:
        address, count, dtype = key
        host = numpy_dtype(dtype)
        if count:
            memory = (ctypes.c_byte * (count * host.itemsize)).from_address(address)
            view = HostBuffer(np.frombuffer(memoryview(memory), host), "tensor")
        else:
            view = HostBuffer(np.empty(0, host), "tensor")
        with self._lock:
            if len(self._views) >= self._LIMIT:
                self._views.pop(next(iter(self._views)), None)
            self._views[key] = view
        return view


def _flat_host(t: Any) -> np.ndarray:
    """A contiguous CPU tensor as a 1-D numpy array over its memory (bytes where the core
    does not know its dtype)."""
    torch = _torch()
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:
        return np.asarray(flat.view(torch.int16).numpy()).view(numpy_dtype(flat.dtype))
    try:
        return np.asarray(flat.numpy())
    except TypeError:  # a dtype numpy has no name for: its bytes
        return np.asarray(flat.view(torch.uint8).numpy())


class CopiedBuffer(HostBuffer):
    """A tensor the host cannot view in place, as a contiguous host copy: made when the op is
    issued (with the tensor's values if the op reads them), copied back into the tensor
    after the op if it writes. ``as_bytes``: the copy holds the tensor's bytes."""

    __slots__ = ("_tensor", "_copy", "_writes")

    def __init__(self, t: Any, name: str, *, reads: bool, writes: bool,
                 as_bytes: bool = False) -> None:
        torch = _torch()
        source = t.detach()
        if reads:
            source = source.resolve_conj().resolve_neg()
            copy = source.to("cpu", memory_format=torch.contiguous_format, copy=True)
        else:
            copy = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        if as_bytes:
            copy = copy.reshape(-1).view(torch.uint8)
        super().__init__(_flat_host(copy), name)
        self._tensor = t
        self._copy = copy
        self._writes = writes

    def after_op(self) -> None:
        if self._writes:
            torch = _torch()
            with torch.no_grad():
                copy = self._copy
                if copy.dtype != self._tensor.dtype:  # its bytes
                    copy = copy.view(self._tensor.dtype)
                self._tensor.copy_(copy.reshape(self._tensor.shape))


CUDA_KIND = TorchCUDAKind()
_USABLE: list[bool] = []  # whether the CuPy runtime can be had here: asked once per process


def device_runtime_usable() -> bool:
    """Whether CUDA tensors can go as device memory (CuPy imports and sees a GPU)."""
    if not _USABLE:
        from .device.cupy_runtime import cupy_problem

        _USABLE.append(not cupy_problem())
    return _USABLE[0]


def tensor_buffer(t: Any, name: str, core_dtypes: frozenset[Any], *, reads: bool = True,
                  writes: bool = False, views: HostViews | None = None) -> Buffer:
    """``t`` as a buffer of the kind its memory calls for (see the module docstring): a view
    (by address where ``views`` is given), a CUDA device buffer, or a copy; a dtype not in
    ``core_dtypes`` moves as its bytes."""
    if viewable(t, core_dtypes):
        if views is not None:
            return views.of(t)
        return HostBuffer(_flat_host(t), name)
    known = t.dtype in core_dtypes
    if t.is_cuda and known and t.is_contiguous() and not (t.is_conj() or t.is_neg()) \
            and device_runtime_usable():
        return CUDA_KIND.buffer(t, name, writes, reads)
    if known or not (t.is_cpu and t.is_contiguous()) or t.is_conj() or t.is_neg():
        return CopiedBuffer(t, name, reads=reads, writes=writes, as_bytes=not known)
    return HostBuffer(_flat_host(t.detach().reshape(-1).view(_torch().uint8)), name)  # bytes
