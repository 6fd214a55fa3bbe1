"""Timelines of real runs: a rank's ops, steps, messages and waits, as Chrome trace events.

``Timeline`` is a ``Wrapper``: put in front of a group's links, board and engines through the
one hook (``ringcomm.engines.wrapping``), it records

- every op as a span on its engine's track (``links`` or ``board``): collective, sequence
  number, engine, algorithm, bytes, dtype, reduce op; the fast entry of the board's
  allreduce included, so a traced run takes the same path as an untraced one;
- inside it every step the engine ran (send, recv, recv+reduce, recv+reduce+send, copy,
  post, take, take+reduce) with its peer and bytes;
- inside a step, the time spent waiting for a peer (for its message, its post, or for a slot
  it has not read yet), drawn as a ``wait`` slice of its own, apart from the work;
- on a track per peer, every message sent to it and received from it (collectives and
  point-to-point alike) with its op, index and bytes; on the board's track, every post and
  take.

Events go into a ring of ``capacity`` (``RINGCOMM_TRACE_EVENTS``): a long run keeps its
latest events, and the file counts what was dropped. ``write`` makes one file per rank in
Chrome's trace-event format (one process per rank, a thread per track), which Perfetto and
``chrome://tracing`` open; ``ringcomm trace merge`` puts several ranks' files on one clock
with the offsets each file carries (``clock``), and ``ringcomm trace plot`` draws them.

Recording costs a few microseconds a step and a message (measured in docs/benchmarks.md); a
group without a timeline has no wrapper at all, so tracing off costs nothing.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np

from ..core.arrays import Buffer
from ..core.dtypes import dtype_name
from ..engines.base import Engine, EngineWrapper
from ..engines.context import OpContext, also
from ..engines.wrapping import Wrapper
from ..schedules.schedule import Kind, Schedule, Step
from ..transport.board_channel import BoardChannel
from ..transport.header import ALGORITHMS, Header, OpKind, reduce_name
from ..transport.link import Link, SendHandle, Wait
from ..transport.wrappers import BoardChannelWrapper, LinkWrapper

FORMAT = "ringcomm-timeline/1"  # what a rank's file says it is, for ``merge``

# tracks (Chrome "threads") of a rank: its engines, its board, then one per peer
ENGINE_TRACKS = {"links": 1, "board": 2}
BOARD_TRACK = 3
PEER_TRACK = 100  # + the peer's rank

_STEP_NAMES = {Kind.SEND: "send", Kind.RECV: "recv", Kind.RECV_REDUCE: "recv+reduce",
               Kind.RECV_REDUCE_SEND: "recv+reduce+send", Kind.COPY: "copy",
               Kind.POST: "post", Kind.TAKE: "take", Kind.TAKE_REDUCE: "take+reduce"}


_OP, _STEP, _WAIT, _MESSAGE, _POST, _TAKE = range(6)  # what an event records


@dataclass(frozen=True)
class Clock:
    """This rank's clock against rank 0's: add ``offset_us`` to a time here to get rank 0's
    time, give or take ``error_us`` (half the round trip it was measured with)."""

    offset_us: float = 0.0
    error_us: float | None = None  # None: not measured (one rank, or nobody to ask)


class Timeline(Wrapper):
    """A rank's timeline (see the module docstring): ``rank`` of ``world_size``, written to
    ``folder`` by ``write``.

    Recording is kept to appending a tuple of what happened (times from
    ``time.perf_counter``, the objects involved, which are not copied); names, arguments
    and microseconds are made when the file is written."""

    name = "trace"

    def __init__(self, rank: int, world_size: int, folder: str | os.PathLike[str],
                 capacity: int, clock: Clock | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a timeline needs room for at least one event, got {capacity}")
        self.rank = rank
        self.world_size = world_size
        self.folder = Path(folder)
        self.capacity = capacity
        self.clock = clock or Clock()
        self.events: deque[tuple[Any, ...]] = deque(maxlen=capacity)
        self.recorded = 0
        self.track: int | None = None  # the engine track of the op running now, if one is
        self.itemsize = 1  # of the op running now: step regions count its elements
        self.op = ""  # the name of the op running now

    # ----------------------------------------------------------------- the hook
    def link(self, link: Link) -> Link:
        return _TracedLink(link, self)

    def board(self, channel: BoardChannel) -> BoardChannel:
        return _TracedBoard(channel, self)

    def engine(self, engine: Engine) -> Engine:
        return _TracedEngine(engine, self)

    # ----------------------------------------------------------------- recording
    def record(self, event: tuple[Any, ...]) -> None:
        self.events.append(event)
        self.recorded += 1

    @property
    def dropped(self) -> int:
        return self.recorded - len(self.events)

    def step(self, index: int, step: Step, start: float, end: float) -> None:
        """A step the engine of the op running now ran (its ``ctx.observe``)."""
        self.events.append((_STEP, self.track or ENGINE_TRACKS["links"], start, end, index,
                            step, self.op, self.itemsize))
        self.recorded += 1

    # ----------------------------------------------------------------- the file
    def _chrome_event(self, event: tuple[Any, ...]) -> dict[str, Any]:
        kind, track, start, end = event[:4]
        if kind == _STEP:
            index, step, op, itemsize = event[4:]
            region = step.src if step.src is not None else step.dst
            args: dict[str, Any] = {"index": index, "op": op}
            if step.peer >= 0 and step.kind not in (Kind.COPY, Kind.POST):
                args["peer"] = step.peer
            if step.kind is Kind.RECV_REDUCE_SEND:
                args["to"] = step.to
            if region is not None:
                args["bytes"] = region.count * itemsize
            name, cat = _STEP_NAMES.get(step.kind, step.kind.name.lower()), "step"
        elif kind == _OP:
            engine, name, desc, seq, dtype, failed = event[4:]
            collective = OpKind(desc.kind).name.lower() \
                if desc.kind in OpKind._value2member_map_ else str(desc.kind)
            nbytes = (desc.count if desc.send_counts is None else sum(desc.send_counts)) \
                * dtype.itemsize
            args = {"collective": collective, "seq": seq, "engine": engine,
                    "algorithm": ALGORITHMS[desc.algorithm], "count": desc.count,
                    "bytes": nbytes, "dtype": dtype_name(dtype),
                    "reduce": reduce_name(desc.reduce)}
            if failed is not None:
                args["error"] = failed
            cat = "op"
        elif kind == _WAIT:
            what, peer, op = event[4:]
            name, cat, args = what, "wait", {"op": op}
            if peer is not None:
                args["peer"] = peer
        elif kind == _MESSAGE:
            direction, header, op, peer = event[4:]
            name, cat = f"{direction} {header.nbytes} B", "message"
            args = {"op": op, "index": header.index, "bytes": header.nbytes, "peer": peer,
                    "direction": direction}
        else:  # a post or a take on the board
            nbytes, op, peer, number = event[4:]
            what = "post" if kind == _POST else "take"
            name, cat = f"{what} {nbytes} B", what
            args = {"op": op, "bytes": nbytes, "number": number}
            if peer is not None:
                args["peer"] = peer
        start_us = start * 1e6
        return {"ph": "X", "name": name, "cat": cat, "pid": self.rank, "tid": track,
                "ts": round(start_us, 3), "dur": round(max(end * 1e6 - start_us, 0.0), 3),
                "args": args}

    def chrome(self) -> dict[str, Any]:
        """The timeline as a Chrome trace-event object (times in microseconds of this
        rank's clock; ``otherData.clock`` says how to bring them to rank 0's)."""
        pid = self.rank
        tracks = {ENGINE_TRACKS["links"]: "links engine", ENGINE_TRACKS["board"]:
                  "board engine", BOARD_TRACK: "board posts and takes"}
        tracks.update({PEER_TRACK + p: f"link to rank {p}" for p in range(self.world_size)
                       if p != self.rank})
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": f"rank {self.rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
             "args": {"sort_index": self.rank}}]
        recorded = list(self.events)  # once: the worker may still be appending
        used = {event[1] for event in recorded}
        for tid, label in sorted(tracks.items()):
            if tid in used:
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": label}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                               "tid": tid, "args": {"sort_index": tid}})
        events += [self._chrome_event(event) for event in recorded]
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {
            "format": FORMAT, "rank": self.rank, "world_size": self.world_size,
            "clock": {"offset_us": self.clock.offset_us, "error_us": self.clock.error_us},
            "events": len(recorded), "dropped": self.recorded - len(recorded),
            "capacity": self.capacity, "pid": os.getpid()}}

    def path(self) -> Path:
        return self.folder / f"rank{self.rank}.json"

    def write(self) -> Path:
        """Write this rank's file (``rank<r>.json`` in ``folder``); returns its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path()
        partial = path.with_suffix(f".json.{os.getpid()}.tmp")
        partial.write_text(json.dumps(self.chrome()))
        partial.replace(path)  # a reader never sees half a file
        return path


class _TracedEngine(EngineWrapper):
    """Op spans on the engine's track, and the engine's steps through ``ctx.observe``."""

    def __init__(self, inner: Engine, timeline: Timeline) -> None:
        super().__init__(inner)
        self.timeline = timeline
        self._track = ENGINE_TRACKS.get(inner.name, 1)

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        timeline = self.timeline
        timeline.track, timeline.itemsize, timeline.op = \
            self._track, ctx.dtype.itemsize, ctx.name
        ctx.observe = also(ctx.observe, timeline.step)
        start, failed = perf_counter(), None
        try:
            self.inner.run(schedule, buffers, ctx)
        except Exception as err:
            failed = f"{type(err).__name__}: {err}"
            raise
        finally:
            timeline.record((_OP, self._track, start, perf_counter(), self.name, ctx.name,
                             ctx.desc, ctx.desc.seq, ctx.dtype, failed))
            timeline.track = None

    def allreduce_now(self, plan: Any, data: Buffer, seq: int, deadline: float, name: str,
                      observe: Any = None) -> None:
        timeline = self.timeline
        timeline.track, timeline.itemsize, timeline.op = \
            self._track, data.dtype.itemsize, name
        start, failed = perf_counter(), None
        try:
            self.inner.allreduce_now(plan, data, seq, deadline, name,
                                     also(observe, timeline.step))
        except Exception as err:
            failed = f"{type(err).__name__}: {err}"
            raise
        finally:
            timeline.record((_OP, self._track, start, perf_counter(), self.name, name,
                             plan.desc, seq, data.dtype, failed))
            timeline.track = None


class _TracedLink(LinkWrapper):
    """Every message to and from one peer on its track; the wait for a message as a
    ``wait`` slice inside the step that waited, on the engine's track."""

    def __init__(self, inner: Link, timeline: Timeline) -> None:
        super().__init__(inner)
        self.timeline = timeline
        self._track = PEER_TRACK + inner.peer
        self._header: Header | None = None
        self._arrived = 0.0

    def send(self, header: Header, payload: np.ndarray | None, op: str) -> SendHandle | None:
        start = perf_counter()
        handle = self.inner.send(header, payload, op)
        self.timeline.record((_MESSAGE, self._track, start, perf_counter(), "send", header,
                              op, self.peer))
        return handle

    def send_reserved(self, header: Header, op: str) -> SendHandle | None:
        start = perf_counter()
        handle = self.inner.send_reserved(header, op)
        self.timeline.record((_MESSAGE, self._track, start, perf_counter(), "send", header,
                              op, self.peer))
        return handle

    def recv_header(self, wait: Wait) -> Header:
        start = perf_counter()
        header = self.inner.recv_header(wait)
        now = perf_counter()
        if now - start >= 1e-6:  # inside the step that waited; a point-to-point receive,
            timeline = self.timeline  # which is no op's, on the peer's track
            track = self._track if timeline.track is None else timeline.track
            timeline.record((_WAIT, track, start, now, f"wait for rank {self.peer}",
                             self.peer, wait.op))
        self._header, self._arrived = header, now
        return header

    def recv_payload(self, op: str) -> Any:
        payload = self.inner.recv_payload(op)
        self._received(op)
        return payload

    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        nbytes = self.inner.recv_payload_into(out, op)
        self._received(op)
        return nbytes

    def _received(self, op: str) -> None:
        header = self._header
        if header is not None:
            self._header = None
            self.timeline.record((_MESSAGE, self._track, self._arrived, perf_counter(),
                                  "recv", header, op, self.peer))


class _TracedBoard(BoardChannelWrapper):
    """Every post and take on the board's track; a post that had to wait for a slot, or a
    take that had to wait for its post, as a ``wait`` slice on the engine's track."""

    def __init__(self, inner: BoardChannel, timeline: Timeline) -> None:
        super().__init__(inner)
        self.timeline = timeline

    def post(self, header: bytes, payload: np.ndarray | None, deadline: float,
             op: str, at: int = 0) -> None:
        board, timeline = self.inner.board, self.timeline
        waits = bool(board.behind())
        start = perf_counter()
        self.inner.post(header, payload, deadline, op, at)
        end = perf_counter()
        if waits:
            timeline.record((_WAIT, timeline.track or BOARD_TRACK, start, end,
                             "wait for a slot", None, op))
        timeline.record((_POST, BOARD_TRACK, start, end,
                         0 if payload is None else payload.nbytes, op, None, board.number))

    def take(self, peer: int, header: bytes, dtype: np.dtype, count: int, deadline: float,
             op: str, at: int = 0) -> np.ndarray:
        board, timeline = self.inner.board, self.timeline
        waits = board.posted(peer) < board.number
        start = perf_counter()
        payload = self.inner.take(peer, header, dtype, count, deadline, op, at)
        end = perf_counter()
        if waits:
            timeline.record((_WAIT, timeline.track or BOARD_TRACK, start, end,
                             f"wait for rank {peer}'s post", peer, op))
        timeline.record((_TAKE, BOARD_TRACK, start, end, count * dtype.itemsize, op, peer,
                         board.number))
        return payload
