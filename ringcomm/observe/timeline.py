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

Recording costs a few microseconds a step and a message (measured in the README); a group
without a timeline has no wrapper at all, so tracing off costs nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.arrays import Buffer
from ..core.dtypes import dtype_name
from ..engines.base import Engine, EngineWrapper
from ..engines.context import OpContext, TraceEvent
from ..engines.wrapping import Wrapper
from ..schedules.schedule import Kind, Schedule
from ..transport.board_channel import BoardChannel
from ..transport.header import Header, OpDescriptor, OpKind
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
_REDUCE_NAMES = {0: None, 1: "sum", 2: "prod", 3: "min", 4: "max", 5: "avg", 6: "band",
                 7: "bor", 8: "bxor"}


def _now_us() -> float:
    return time.perf_counter() * 1e6


@dataclass(frozen=True)
class Clock:
    """This rank's clock against rank 0's: add ``offset_us`` to a time here to get rank 0's
    time, give or take ``error_us`` (half the round trip it was measured with)."""

    offset_us: float = 0.0
    error_us: float | None = None  # None: not measured (one rank, or nobody to ask)


class Timeline(Wrapper):
    """A rank's timeline (see the module docstring): ``rank`` of ``world_size``, written to
    ``folder`` by ``write``."""

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
        self.started_us = _now_us()
        self.track = ENGINE_TRACKS["links"]  # the engine track of the op running now
        self.itemsize = 1  # of the op running now: step regions count its elements

    # ----------------------------------------------------------------- the hook
    def link(self, link: Link) -> Link:
        return _TracedLink(link, self)

    def board(self, channel: BoardChannel) -> BoardChannel:
        return _TracedBoard(channel, self)

    def engine(self, engine: Engine) -> Engine:
        return _TracedEngine(engine, self)

    # ----------------------------------------------------------------- recording
    def span(self, name: str, track: int, start_us: float, end_us: float,
             cat: str, args: dict[str, Any] | None = None) -> None:
        """One complete event (``ph: X``) on ``track``."""
        self.events.append((name, cat, track, start_us, end_us - start_us, args))
        self.recorded += 1

    @property
    def dropped(self) -> int:
        return self.recorded - len(self.events)

    def step(self, event: TraceEvent) -> None:
        """A step an engine ran (its ``ctx.observe``)."""
        step = event.step
        region = step.src if step.src is not None else step.dst
        args: dict[str, Any] = {"index": event.index, "op": event.op}
        if step.peer >= 0 and step.kind not in (Kind.COPY, Kind.POST):
            args["peer"] = step.peer
        if step.kind is Kind.RECV_REDUCE_SEND:
            args["to"] = step.to
        if region is not None:
            args["bytes"] = region.count * self.itemsize
        self.span(_STEP_NAMES.get(step.kind, step.kind.name.lower()),
                  ENGINE_TRACKS.get(event.engine, 1), event.start * 1e6, event.end * 1e6,
                  "step", args)

    def op(self, engine: str, name: str, desc: OpDescriptor, dtype: np.dtype,
           start_us: float, end_us: float, failed: str | None = None) -> None:
        kind = OpKind(desc.kind).name.lower() if desc.kind in OpKind._value2member_map_ \
            else str(desc.kind)
        from ..transport.header import ALGORITHMS

        args = {"collective": kind, "seq": desc.seq, "engine": engine,
                "algorithm": ALGORITHMS[desc.algorithm], "count": desc.count,
                "bytes": desc.count * dtype.itemsize, "dtype": dtype_name(dtype),
                "reduce": _REDUCE_NAMES.get(desc.reduce)}
        if desc.send_counts is not None:
            args["bytes"] = sum(desc.send_counts) * dtype.itemsize
        if failed is not None:
            args["error"] = failed
        self.span(name, ENGINE_TRACKS.get(engine, 1), start_us, end_us, "op", args)

    # ----------------------------------------------------------------- the file
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
        used = {event[2] for event in self.events}
        for tid, label in sorted(tracks.items()):
            if tid in used:
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": label}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                               "tid": tid, "args": {"sort_index": tid}})
        for name, cat, tid, ts, dur, args in self.events:
            event = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
                     "ts": round(ts, 3), "dur": round(max(dur, 0.0), 3)}
            if args:
                event["args"] = args
            events.append(event)
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {
            "format": FORMAT, "rank": self.rank, "world_size": self.world_size,
            "clock": {"offset_us": self.clock.offset_us, "error_us": self.clock.error_us},
            "events": len(self.events), "dropped": self.dropped,
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
        timeline.track, timeline.itemsize = self._track, ctx.dtype.itemsize
        ctx.observe = timeline.step
        start, failed = _now_us(), None
        try:
            self.inner.run(schedule, buffers, ctx)
        except Exception as err:
            failed = f"{type(err).__name__}: {err}"
            raise
        finally:
            timeline.op(self.name, ctx.name, ctx.desc, ctx.dtype, start, _now_us(), failed)

    def allreduce_now(self, plan: Any, data: Buffer, seq: int, deadline: float, name: str,
                      observe: Any = None) -> None:
        timeline = self.timeline
        timeline.track, timeline.itemsize = self._track, data.dtype.itemsize
        start, failed = _now_us(), None
        try:
            self.inner.allreduce_now(plan, data, seq, deadline, name, timeline.step)
        except Exception as err:
            failed = f"{type(err).__name__}: {err}"
            raise
        finally:
            desc = plan.desc
            timeline.op(self.name, name, OpDescriptor(
                desc.kind, seq, desc.dtype, desc.algorithm, desc.reduce, desc.arg,
                desc.segment, desc.count), data.dtype, start, _now_us(), failed)


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
        start = _now_us()
        handle = self.inner.send(header, payload, op)
        self._message("send", header, op, start)
        return handle

    def send_reserved(self, header: Header, op: str) -> SendHandle | None:
        start = _now_us()
        handle = self.inner.send_reserved(header, op)
        self._message("send", header, op, start)
        return handle

    def recv_header(self, wait: Wait) -> Header:
        start = _now_us()
        header = self.inner.recv_header(wait)
        now = _now_us()
        if now - start >= 1.0:
            self.timeline.span(f"wait for rank {self.peer}", self.timeline.track, start, now,
                               "wait", {"peer": self.peer, "op": wait.op})
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
            self._message("recv", header, op, self._arrived)

    def _message(self, what: str, header: Header, op: str, start: float) -> None:
        self.timeline.span(f"{what} {header.nbytes} B", self._track, start, _now_us(),
                           "message", {"op": op, "index": header.index,
                                       "bytes": header.nbytes, "peer": self.peer,
                                       "direction": what})


class _TracedBoard(BoardChannelWrapper):
    """Every post and take on the board's track; a post that had to wait for a slot, or a
    take that had to wait for its post, as a ``wait`` slice on the engine's track."""

    def __init__(self, inner: BoardChannel, timeline: Timeline) -> None:
        super().__init__(inner)
        self.timeline = timeline

    def post(self, header: bytes, payload: np.ndarray | None, deadline: float,
             op: str, at: int = 0) -> None:
        board = self.inner.board
        waits = bool(board.behind())
        start = _now_us()
        self.inner.post(header, payload, deadline, op, at)
        end = _now_us()
        nbytes = 0 if payload is None else payload.nbytes
        if waits:
            self.timeline.span("wait for a slot", self.timeline.track, start, end, "wait",
                               {"op": op})
        self.timeline.span(f"post {nbytes} B", BOARD_TRACK, start, end, "post",
                           {"op": op, "bytes": nbytes, "number": board.number})

    def take(self, peer: int, header: bytes, dtype: np.dtype, count: int, deadline: float,
             op: str, at: int = 0) -> np.ndarray:
        board = self.inner.board
        waits = board.posted(peer) < board.number
        start = _now_us()
        payload = self.inner.take(peer, header, dtype, count, deadline, op, at)
        end = _now_us()
        if waits:
            self.timeline.span(f"wait for rank {peer}'s post", self.timeline.track, start,
                               end, "wait", {"peer": peer, "op": op})
        nbytes = count * dtype.itemsize
        self.timeline.span(f"take {nbytes} B", BOARD_TRACK, start, end, "take",
                           {"op": op, "bytes": nbytes, "peer": peer,
                            "number": board.number})
        return payload
