"""User memory registered with the kernel path, so an op reads (and the two-shot writes) the
caller's arrays where they lie, without the copy through the rank's region.

Why registration is explicit and collective (NCCL's ``ncclCommRegister``, torch's
symmetric-memory rendezvous): a peer's kernel can reach a rank's array only through a mapping
of the whole allocation that holds it (an IPC handle names an allocation's base, never a
pointer inside it: a caching allocator's block is reached as its segment's base plus an
offset, as torch's ``storage._share_cuda_`` sends it), and that mapping must stay correct for
as long as any peer may use it. A mapping made behind the user's back could not be: torch's
caching allocator gives a segment back to CUDA at any ``empty_cache``, and freeing memory a
peer maps is undefined on a GPU. So ``register`` is a call every rank of the group makes in the
same order (a DDP bucket, once), which

- keeps the caller's array alive until ``deregister`` (its memory cannot be freed or handed
  out again meanwhile: the caller may keep writing it, which is the point),
- exports the allocation holding it once per allocation and communicator (a second array in
  the same segment reuses the handle), and has every peer open it once per allocation (a
  second registration in a segment already open only counts),
- and ends with ``deregister`` (or the communicator's close): every peer closes its mapping,
  says so, and only then is the array let go; a peer that never says so leaves it to the
  process's exit (``peer_memory.close_in_order``).

What it costs: once per registration, one export (where the allocation is new), two
rounds through the group's store (each rank's record, then whether it opened every peer's),
and one IPC open per peer allocation not yet open (unmeasured on a GPU; about 6 ms a
registration through the fake runtime's store between three processes here); per op nothing
but a lookup of the pointer. What is refused, saying why: host memory, another device's,
memory without a CUDA IPC handle (``cuMemCreate``/``cuMemMap``, as torch's expandable
segments map it; a stream-ordered pool). A rank that refuses tells its peers, so every rank raises.

An op runs in place when every rank's buffer lies in a registration (each rank says which,
and where, in the header it swaps with its peers before any kernel starts: agreed, never
assumed) and the kernel can: the two-shot allreduce (each rank reduces its slice from every
rank's array and writes it into every rank's array), the reduce-scatter and the all-gather
(their inputs read where they lie, the output written by its own rank only). The one-shot
writes its result while peers still read the inputs, so it always copies its input first.
An op that fails may leave a registered array half written by a peer's two-shot (as NCCL's
buffers after an abort): its contents are undefined then.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.device.runtime import DeviceRuntime
from ..errors import ArgumentError
from .device import on_device
from .device_channel import Exchange
from .peer_memory import AFTER_FAILURE_S, LEFT_FOR_EXIT, close_in_order

log = logging.getLogger("ringcomm")

_KEY = "kernel-registered/{index}"
_CLOSED_KEY = "kernel-registered/{index}/closed"


@dataclass
class Registered:
    """One registration as this rank sees it: its own range, every rank's range as this
    process reaches it (``views``) and how long each is, and what it holds open."""

    index: int
    ptr: int
    nbytes: int
    keep: Any = field(repr=False)  # the caller's array: alive until deregistered
    base: int  # this rank's allocation holding it
    views: tuple[int, ...]
    sizes: tuple[int, ...]
    opened: list[tuple[int, bytes]]  # the peers' allocations opened for it: (peer, handle)


class Registry:
    """The user memory registered with one kernel channel (module docstring)."""

    def __init__(self, runtime: DeviceRuntime, exchange: Exchange, rank: int, world: int,
                 pids: dict[int, int], device: int) -> None:
        self.runtime = runtime
        self.device = device  # the channel's: current while mappings are opened or closed
        self.exchange = exchange
        self.rank, self.world = rank, world
        self._pids = pids  # the peers, by rank: their processes
        self._lock = threading.Lock()
        self._live: dict[int, Registered] = {}
        self._next = 0
        self._exports: dict[int, list[Any]] = {}  # allocation base -> [handle, registrations]
        self._maps: dict[tuple[int, bytes], list[int]] = {}  # (peer, handle) -> [ptr, uses]
        self.closed = False  # the channel closed: every registration ended with it
        self.exported = 0  # allocations exported so far (one per allocation: the cache)
        self.opens = 0  # peers' allocations opened so far

    # ------------------------------------------------------------------ register
    def register(self, ptr: int, nbytes: int, keep: Any, timeout: float,
                 refused: str = "") -> Registered:
        """Collective: this rank's ``nbytes`` at ``ptr`` (of the caller's array ``keep``)
        registered with every peer's, within ``timeout`` seconds. ``refused``: why this rank
        cannot (its peers hear it and raise too). Two rounds, so that the ranks end alike:
        every rank's record (its handle, or why it refuses) is read before anything is
        opened; then each says whether it opened every peer's. If one did not, or a rank
        fails or times out after its record went out, every rank that gets that far closes
        what it opened, says so, and lets its array go only once its peers said the same
        (else keeps it to the process's exit: a peer may still map it). Every call uses the
        next index, whatever happens, so the ranks' indices never drift apart. Raises
        ``ArgumentError`` naming the rank that refused or failed."""
        index = self._next
        self._next += 1
        deadline = time.monotonic() + timeout
        key = _KEY.format(index=index)
        with contextlib.ExitStack() as on_lane:
            try:  # IPC maps into the current device's address space
                on_lane.enter_context(on_device(self.runtime, self.device))
            except Exception as err:  # noqa: BLE001 - told to the peers, raised below
                refused = refused or f"device {self.device} could not be made current: {err}"
            base, refused = self._publish(key, ptr, nbytes, refused)
            if refused:
                raise ArgumentError(f"cannot register this array: {refused}; leave it "
                                    "unregistered (ops on it copy it through the kernel "
                                    "path's region)", rank=self.rank)
            registered = Registered(index, ptr, nbytes, keep, base, (), (), [])
            try:
                records = {peer: json.loads(self.exchange.read(key, peer, deadline))
                           for peer in range(self.world) if peer != self.rank}
            except BaseException as err:  # a peer lost or late: peers may have opened ours
                self._undo(registered, key, f"rank {self.rank}: {type(err).__name__}")
                raise
            for peer, theirs in records.items():
                if "refused" in theirs:  # every rank sees it before anything is opened
                    self._drop_export(base)
                    raise ArgumentError(f"rank {peer} could not register its array "
                                        f"({theirs['refused']}), so no rank registers it",
                                        rank=self.rank, peer=peer)
            failed = self._open_all(registered, records)
            told = False
            try:
                self.exchange.publish(key + "/opened", failed.encode())
                told = True
                for peer in records:
                    said = self.exchange.read(key + "/opened", peer, deadline).decode()
                    if said and not failed:
                        failed = f"rank {peer} could not open a peer's array: {said}"
            except BaseException as err:
                self._undo(registered, None if told else key,
                           f"rank {self.rank}: {type(err).__name__}")
                raise
            if failed:  # every rank undoes it alike
                self._undo(registered, None, failed)
                raise ArgumentError(f"cannot register this array: {failed}", rank=self.rank)
            with self._lock:
                self._live[index] = registered
            return registered

    def _publish(self, key: str, ptr: int, nbytes: int, refused: str) -> tuple[int, str]:
        """This rank's record of a registration: its allocation's handle, base and the
        array's place in it, or why it refuses (an export that fails is a refusal).
        Returns the base exported (0 if none) and the refusal ("" if none)."""
        record: dict[str, Any] = {"pid": os.getpid()}
        base = 0
        if not refused:
            try:
                handle, base, _ = self._export(ptr)
            except Exception as err:  # noqa: BLE001 - told to the peers, raised after
                refused = str(err) or type(err).__name__
            else:
                record.update(handle=handle.hex(), base=base, offset=ptr - base,
                              nbytes=nbytes)
        if refused:
            record["refused"] = refused
            self._drop_export(base)
            base = 0
        self.exchange.publish(key, json.dumps(record).encode())
        return base, refused

    def _undo(self, registered: Registered, key: str | None, why: str) -> None:
        """A registration that failed after this rank's record went out: say so to the peers
        where it was not said yet (``key``'s second round), close what this rank opened, and
        let its array go once the peers said they closed theirs, waiting a little only (a
        peer that does not say so may still map it: then it is kept to the process's
        exit). Never raises: the failure is the caller's to raise."""
        try:
            if key is not None:
                self.exchange.publish(key + "/opened", why.encode())
            self._close_maps(registered.opened)
            self._let_go(registered, _CLOSED_KEY.format(index=registered.index),
                         AFTER_FAILURE_S)
        except Exception as err:  # noqa: BLE001 - the store or the device is in trouble
            log.warning("rank %d could not undo registration %d cleanly (%s): its array is "
                        "kept to the process's exit", self.rank, registered.index, err)
            if registered.keep is not None:
                LEFT_FOR_EXIT.append(registered.keep)
                registered.keep = None

    def _open_all(self, registered: Registered, records: dict[int, dict[str, Any]]) -> str:
        """Fill in every rank's range as this process reaches it, opening the peers'
        allocations of other processes; why one could not be opened ("" if all were)."""
        views, sizes = [], []
        try:
            for peer in range(self.world):
                if peer == self.rank:
                    views.append(registered.ptr)
                    sizes.append(registered.nbytes)
                    continue
                theirs = records[peer]
                handle = bytes.fromhex(theirs["handle"])
                if int(theirs["pid"]) == os.getpid():  # a peer of this process: its pointer
                    mapped = int(theirs["base"])
                else:
                    mapped = self._open(peer, handle)
                    registered.opened.append((peer, handle))
                views.append(mapped + int(theirs["offset"]))
                sizes.append(int(theirs["nbytes"]))
        except Exception as err:  # noqa: BLE001 - agreed with the peers, then raised
            return f"rank {self.rank}: {err}"
        registered.views, registered.sizes = tuple(views), tuple(sizes)
        return ""

    def _export(self, ptr: int) -> tuple[bytes, int, int]:
        handle, base, size = self.runtime.export_user_memory(ptr)
        held = self._exports.get(base)
        if held is not None:  # the same allocation: its handle again
            held[1] += 1
            return held[0], base, size
        self._exports[base] = [handle, 1]
        self.exported += 1
        return handle, base, size

    def _drop_export(self, base: int) -> None:
        held = self._exports.get(base)
        if held is not None:
            held[1] -= 1
            if not held[1]:
                del self._exports[base]

    def _open(self, peer: int, handle: bytes) -> int:
        held = self._maps.get((peer, handle))
        if held is None:
            held = self._maps[(peer, handle)] = [self.runtime.open_memory(handle), 0]
            self.opens += 1
        held[1] += 1
        return held[0]

    def _close_maps(self, opened: list[tuple[int, bytes]]) -> None:
        for key in opened:
            held = self._maps[key]
            held[1] -= 1
            if not held[1]:
                del self._maps[key]
                self.runtime.close_memory(held[0])

    # ------------------------------------------------------------------ ops
    def find(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """The registration holding ``nbytes`` at ``ptr`` and the offset in it, if any."""
        with self._lock:
            for registered in self._live.values():
                if registered.ptr <= ptr and ptr + nbytes <= registered.ptr + registered.nbytes:
                    return registered.index, ptr - registered.ptr
        return None

    def view(self, index: int, rank: int, offset: int, nbytes: int) -> int:
        """Where rank ``rank``'s ``nbytes`` at ``offset`` in its registration ``index`` lie,
        as this process reaches them (what a peer's header named)."""
        with self._lock:
            registered = self._live.get(index)
        if registered is None or offset < 0 or offset + nbytes > registered.sizes[rank]:
            raise RuntimeError(f"rank {rank} named its registration {index} at offset "
                               f"{offset} for {nbytes} B, which rank {self.rank} does not "
                               "hold: the ranks registered or deregistered in different "
                               "orders")
        return registered.views[rank] + offset

    # ------------------------------------------------------------------ deregister
    def deregister(self, index: int, wait_s: float) -> None:
        """Collective: registration ``index`` ended on every rank. This rank closes its
        mappings of the peers' arrays, says so, and lets its own array go once every peer
        has said the same (or is gone); else keeps it to the process's exit."""
        with self._lock:
            registered = self._live.pop(index, None)
        if registered is None:  # ended with the channel meanwhile
            return
        with on_device(self.runtime, self.device):
            self._close_maps(registered.opened)
        self._let_go(registered, _CLOSED_KEY.format(index=index), wait_s)

    def close_all(self) -> list[Registered]:
        """At the channel's close, before it says its mappings are closed: close every
        mapping of the peers' arrays and hand back the registrations, whose arrays the
        channel lets go (``let_go``) once every peer said the same."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
            self.closed = True
        for registered in live:
            self._close_maps(registered.opened)
        return live

    def abandon(self) -> None:
        """After a failure whose device work may never end: keep every registered array and
        every mapping of a peer's to the process's exit (closing one waits for the device)."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
            self.closed = True
        LEFT_FOR_EXIT.append(list(self._maps.values()))
        self._maps = {}
        self.let_go(live, safe=False)

    def let_go(self, registrations: list[Registered], safe: bool) -> None:
        """The arrays of ``registrations`` let go (``safe``: no peer maps them any more) or
        kept to the process's exit."""
        for registered in registrations:
            self._drop_export(registered.base)
            if not safe:
                LEFT_FOR_EXIT.append(registered.keep)
            registered.keep = None

    def _let_go(self, registered: Registered, key: str, wait_s: float) -> None:
        """Say this rank closed its mappings of registration ``registered`` (``key``), then
        let its array go once every peer said the same, within ``wait_s``."""
        safe = close_in_order(self.exchange, key, self.rank, self._pids, wait_s,
                              "registered memory")
        self.let_go([registered], safe)

    @property
    def live(self) -> int:
        return len(self._live)

