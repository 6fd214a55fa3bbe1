"""Both sides of device IPC, for ``test_device_runtime``: steps that the test process runs
itself and a spawned peer runs when told (``Peer``), so one test body covers every runtime.

A step takes the process's runtime and a dict of what earlier steps made. The exporter
``export``s a fresh allocation and an interprocess event and ``produce``s values into it
(queued, not run); the importer ``open``s both, then ``consume``s: its stream waits on the
event (or, to show what goes wrong, does not) and copies the peer's memory out.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from typing import Any

import numpy as np

import ringcomm.testing  # noqa: F401 - registers the fake runtime
from ringcomm.core.device import runtime
from ringcomm.core.device.runtime import DeviceRuntime

State = dict[str, Any]


def export(rt: DeviceRuntime, st: State, nbytes: int) -> tuple[bytes, bytes]:
    st["alloc"] = rt.malloc(nbytes)
    st["stream"] = rt.new_stream()
    st["ready"] = rt.new_event(interprocess=True)
    zeros = np.zeros(nbytes, np.uint8)
    rt.from_host(st["alloc"].ptr, zeros, st["stream"])
    rt.synchronize(st["stream"])
    return rt.export_memory(st["alloc"]), rt.export_event(st["ready"])


def produce(rt: DeviceRuntime, st: State, values: np.ndarray) -> None:
    """Queue ``values`` into the exported memory and record the event after them; nothing
    here waits for the copy."""
    st.setdefault("keep", []).append(values)
    rt.from_host(st["alloc"].ptr, values, st["stream"])
    rt.record(st["ready"], st["stream"])


def open_(rt: DeviceRuntime, st: State, memory: bytes, event: bytes) -> None:
    st["peer"] = rt.open_memory(memory)
    st["peer_ready"] = rt.open_event(event)
    st["stream"] = rt.new_stream()


def consume(rt: DeviceRuntime, st: State, like: np.ndarray, wait: bool) -> np.ndarray:
    stream = st["stream"]
    if wait:
        rt.wait_event(stream, st["peer_ready"])
    local = rt.malloc(like.nbytes)
    try:
        rt.copy(local.ptr, st["peer"], like.nbytes, stream)
        out = np.zeros_like(like)
        rt.to_host(out, local.ptr, stream)
        rt.synchronize(stream)
        return out
    finally:
        rt.free(local)


def relay(rt: DeviceRuntime, st: State, memory: bytes, event: bytes,
          nbytes: int) -> tuple[bytes, bytes]:
    """Open the peer's memory and event, export memory and an event of this process, and
    queue: wait for the peer's event, copy its memory into ours, record ours. A consumer of
    ours then waits through this process on the peer (a chain of waits)."""
    open_(rt, st, memory, event)
    handles = export(rt, st, nbytes)
    rt.wait_event(st["stream"], st["peer_ready"])
    rt.copy(st["alloc"].ptr, st["peer"], nbytes, st["stream"])
    rt.record(st["ready"], st["stream"])
    return handles


def close(rt: DeviceRuntime, st: State) -> None:
    """The importer's side of the end: close the peer's memory and event."""
    rt.close_memory(st.pop("peer"))
    rt.close_event(st.pop("peer_ready"))


def free(rt: DeviceRuntime, st: State) -> None:
    rt.synchronize(st["stream"])
    rt.free(st["alloc"])
    del st["alloc"]


def destroy(rt: DeviceRuntime, st: State) -> None:
    """The exporter's last step: destroy its event (once every importer closed it)."""
    rt.close_event(st["ready"])
    del st["ready"]


def renew(rt: DeviceRuntime, st: State) -> bytes:
    """Destroy the exported event and make the next one: its handle (CUDA gives the
    destroyed one's bytes again)."""
    rt.close_event(st["ready"])
    st["ready"] = rt.new_event(interprocess=True)
    return rt.export_event(st["ready"])


def live(rt: DeviceRuntime, st: State) -> int:
    return rt.live_allocations()


def maps(rt: DeviceRuntime, st: State) -> list[str]:
    with open(f"/proc/{os.getpid()}/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if len(line.split()) > 5]


STEPS = {f.__name__.rstrip("_"): f for f in (export, produce, open_, relay, consume, close,
                                              free, destroy, renew, live, maps)}


def serve(conn: Any, name: str) -> None:
    """The peer's loop: run each step it is sent, answer ("ok", result) or ("error", text)."""
    rt = runtime(name)
    st: State = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        step, kwargs = msg
        try:
            conn.send(("ok", STEPS[step](rt, st, **kwargs)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Peer:
    """A spawned process running ``serve`` over runtime ``name``; every answer is awaited at
    most ``timeout`` seconds (then the peer is killed and the step fails)."""

    def __init__(self, name: str, timeout: float = 20.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(theirs, name), daemon=True)
        self.proc.start()
        theirs.close()
        self.timeout = timeout

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def ask(self, step: str, **kwargs: Any) -> tuple[str, Any]:
        self.conn.send((step, kwargs))
        if not self.conn.poll(self.timeout):
            self.kill()
            raise TimeoutError(f"the peer did not answer {step!r} within {self.timeout} s")
        answer: tuple[str, Any] = self.conn.recv()
        return answer

    def __call__(self, step: str, **kwargs: Any) -> Any:
        status, result = self.ask(step, **kwargs)
        if status != "ok":
            raise AssertionError(f"the peer's {step!r} failed: {result}")
        return result

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.proc.join(10)
        self.kill()
        self.proc.join(5)
        self.conn.close()
