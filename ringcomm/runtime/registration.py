"""``Communicator.register``: a device array registered with the group, so the kernel path's
ops read it (and the two-shot writes it) where it lies (``ringcomm.engines.registered``).

Registering is collective, as NCCL's and torch's symmetric memory's are: every rank registers
its array at the same point of its program, in the same order (a DDP bucket, once, after it
is made). Where the group has no kernel path (another engine, no MPS on a shared GPU) a
registration holds nothing, is not exchanged and says why: ops run as before. Host memory is
refused everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.algorithms import CUDA_KERNEL
from ..core.arrays import HOST, DeviceBuffer, as_buffer
from ..core.device.kinds import export_problem
from ..core.device.runtime import DeviceRuntime
from ..engines.device import DeviceLane
from ..engines.kernel import KernelChannel
from ..engines.peer_memory import AFTER_FAILURE_S
from ..errors import ArgumentError
from ..plan.kernel_path import Verdict


class Registration:
    """One array registered with a communicator: in place (its ops run where it lies, while
    every rank's buffer of an op lies in a registration) or not (``why``). Holds the array
    until ``deregister``, which every rank calls at the same point, or the communicator's
    close. A context manager::

        with comm.register(bucket):
            for step in range(steps):
                comm.allreduce(bucket)
    """

    def __init__(self, nbytes: int, why: str,
                 end: Callable[[], None] | None = None) -> None:
        self.nbytes = nbytes
        self.why = why
        self._end = end

    @property
    def in_place(self) -> bool:
        """Whether this registration maps the array for the group's ops (until it ends)."""
        return self._end is not None

    def deregister(self) -> None:
        """End it on every rank (collective: each calls it at the same point): the peers
        close their mappings, then the array is let go. Once only; a no-op after."""
        end, self._end = self._end, None
        if end is not None:
            end()

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deregister()

    def __repr__(self) -> str:
        state = "in place" if self.in_place else "not in place"
        return f"<Registration of {self.nbytes} B, {state}: {self.why}>"


_HOST_MEMORY = "it is host memory"


def register(x: Any, *, lanes: Mapping[str, DeviceLane], kernel: Verdict | None,
             device: DeviceRuntime | None, between_ops: Callable[[Callable[[], Any]], Any],
             timeout: float) -> Registration:
    """``Communicator.register(x)`` (its docstring), for a group with these device
    ``lanes``, kernel-path verdict and ``device`` runtime, whose ops are ordered by
    ``between_ops`` (``OpRunner.between_ops``) and time out after ``timeout`` seconds."""
    lane = lanes.get(CUDA_KERNEL)
    problem, buffer = _problem(x, device, lane)
    if buffer is not None and lane is not None:
        try:
            problem = export_problem(x)
        except Exception as err:  # noqa: BLE001 - told to the peers as a refusal
            problem = f"its allocator could not be asked about it: {err}"
    if lane is None or kernel is None or not kernel.ok:
        if problem.startswith(_HOST_MEMORY):  # wrong everywhere, kernel path or not
            raise ArgumentError(f"cannot register x: {problem}")
        why = ("the group has no device runtime" if kernel is None else
               f"the group has no kernel path ({kernel.why})")
        return Registration(0 if buffer is None else buffer.nbytes, f"{why}: ops copy it as "
                            "before")
    channel = lane.channel
    assert isinstance(channel, KernelChannel) and channel.registry is not None
    registry = channel.registry
    ptr, nbytes = (0, 0) if buffer is None else (buffer.pointer, buffer.nbytes)
    try:
        keep = _kept(x)
    except Exception as err:  # noqa: BLE001 - told to the peers as a refusal
        keep, problem = x, problem or f"its memory could not be held ({err})"
    registered = between_ops(lambda: registry.register(ptr, nbytes, keep, timeout, problem))

    def end() -> None:
        if registry.closed:  # ended with the communicator
            return
        wait_s = min(timeout, AFTER_FAILURE_S) if channel.ended else timeout
        between_ops(lambda: registry.deregister(registered.index, wait_s))

    return Registration(nbytes, f"registration {registered.index} of the kernel path: "
                        "its ops run where it lies", end)


def _kept(x: Any) -> Any:
    """What holds ``x``'s memory: a torch tensor's storage too (``set_`` or ``resize_``
    could give the tensor other memory and free the registered block)."""
    storage = getattr(x, "untyped_storage", None)
    return (x, storage()) if callable(storage) else x


def _problem(x: Any, device: DeviceRuntime | None,
             lane: DeviceLane | None) -> tuple[str, DeviceBuffer | None]:
    """Why ``x`` cannot be registered here ("" where it can), and its buffer."""
    try:
        buffer = as_buffer(x, name="x", reads=False)
    except ArgumentError as err:
        return err.detail, None
    except Exception as err:  # noqa: BLE001 - a runtime that cannot be used here
        return f"it cannot be read here ({type(err).__name__}: {err})", None
    if buffer.memory is HOST or not isinstance(buffer, DeviceBuffer):
        return (f"{_HOST_MEMORY}: only device memory registers (host arrays take the "
                "shared board or the links as they are)"), None
    if device is None or buffer.memory != device.memory:
        return (f"it is {buffer.memory} memory, and this communicator's device runtime is "
                f"{'none' if device is None else device.memory}"), None
    if lane is not None and buffer.device != lane.device:
        return (f"it is on device {buffer.device}, and this rank's communicator runs on "
                f"device {lane.device}"), None
    if not buffer.nbytes:
        return "it is empty", None
    return "", buffer
