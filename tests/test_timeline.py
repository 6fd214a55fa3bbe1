"""Timelines of real runs (``ringcomm.observe``): what each rank's file holds, checked
against the table of collectives; the ring that bounds it; a traced torchrun job merged onto
one clock and drawn.

Every file is Chrome trace-event JSON whose spans nest on each track, whose op spans say
what ran, and whose steps' bytes add up, op by op, to what the schedule the table builds
for that rank, collective, algorithm and size sends (``what_runs``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from what_runs import Call, contribution, sent_bytes

from ringcomm import cli
from ringcomm.observe.timeline import BOARD_TRACK, ENGINE_TRACKS, FORMAT, PEER_TRACK, Clock
from ringcomm.plan.settings import Settings
from ringcomm.runtime.communicator import Communicator
from ringcomm.runtime.local import run_group
from ringcomm.schedules.schedule import Kind

OP_ARGS = {"collective", "seq", "engine", "algorithm", "count", "bytes", "dtype", "reduce"}
SENDING = {Kind.SEND.value, Kind.RECV_REDUCE_SEND.value, Kind.POST.value}  # step names
EPS_US = 0.002  # times are written to the nanosecond, each rounded on its own


def read_timelines(folder: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's file, parsed: exactly ``rank0.json`` .. ``rank<world-1>.json``."""
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(f"rank{r}.json" for r in range(world)), names
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def spans(trace: dict[str, Any], cat: str | None = None) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"]
            if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


def check_nesting(events: list[dict[str, Any]]) -> None:
    """On each (pid, tid) every two spans are disjoint or one holds the other."""
    tracks = defaultdict(list)
    for e in events:
        tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, items in tracks.items():
        items.sort(key=lambda s: (s[0], -s[1]))
        open_: list[tuple[float, float, str]] = []
        for start, end, name in items:
            while open_ and open_[-1][1] <= start + EPS_US:
                open_.pop()
            assert not open_ or end <= open_[-1][1] + EPS_US, \
                f"{track}: {name} [{start}, {end}] overlaps {open_[-1]} in part"
            open_.append((start, end, name))


def check_file(trace: dict[str, Any], rank: int, world: int) -> None:
    """The shape of a rank's file: its format, Chrome's fields, spans that nest, op spans
    that say what ran on which engine's track."""
    other = trace["otherData"]
    assert other["format"] == FORMAT
    assert (other["rank"], other["world_size"]) == (rank, world)
    assert other["events"] == len(spans(trace))
    events = spans(trace)
    assert events, f"rank {rank} recorded nothing"
    for e in events:
        assert e["pid"] == rank
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["dur"] >= 0, e
    check_nesting(events)
    for e in spans(trace, "op"):
        args = e["args"]
        assert set(args) >= OP_ARGS, e
        assert e["name"] == f"{args['collective']} #{args['seq']}", e
        assert e["tid"] == ENGINE_TRACKS[args["engine"]], e
        if args["collective"] != "alltoall":
            assert args["bytes"] == args["count"] * np.dtype(args["dtype"]).itemsize, e
    named = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["tid"] for e in events} <= set(named), named


def call_of(args: dict[str, Any], world: int) -> Call:
    """The call an op span describes, for a job whose rooted calls all have root 0 and whose
    all-to-alls are even."""
    if args["collective"] == "alltoall":
        itemsize = np.dtype(args["dtype"]).itemsize
        return Call("alltoall", args["bytes"] // itemsize // world, dtype=args["dtype"])
    return Call(args["collective"], args["count"], dtype=args["dtype"])


def check_bytes(trace: dict[str, Any], rank: int, world: int, segment_bytes: int,
                calls: dict[int, Call] | None = None) -> int:
    """Each op span's steps are its schedule's (one span per step, each index once, inside
    the op's span on its track) and the bytes of its sending steps (send, recv+reduce+send,
    post) add up to what that schedule sends. ``calls``: the call of each op by sequence
    number (default: read from the span, see ``call_of``). Returns how many ops were
    checked."""
    steps = defaultdict(list)
    for e in spans(trace, "step"):
        steps[e["args"]["op"]].append(e)
    ops = spans(trace, "op")
    for op in ops:
        args = op["args"]
        call = calls[args["seq"]] if calls is not None else call_of(args, world)
        assert call.collective == args["collective"], (op, call)
        schedule = call.schedule(rank, world, args["algorithm"], segment_bytes)
        mine = steps.pop(op["name"], [])
        assert sorted(e["args"]["index"] for e in mine) == list(range(len(schedule.steps))), \
            (rank, op["name"], len(mine), len(schedule.steps))
        for e in mine:
            assert e["name"] == schedule.steps[e["args"]["index"]].kind.value, e
            assert e["tid"] == op["tid"], e
            assert op["ts"] - EPS_US <= e["ts"], (op, e)
            assert e["ts"] + e["dur"] <= op["ts"] + op["dur"] + EPS_US, (op, e)
        sent = sum(e["args"]["bytes"] for e in mine if e["name"] in SENDING)
        assert sent == sent_bytes(schedule, call.itemsize), (rank, op["name"], sent)
    assert not steps, f"steps of no op: {sorted(steps)}"
    return len(ops)


# --------------------------------------------------------------------------- in process

SMALL, LARGE, BIG = 3, 20 << 10, 320 << 10  # elements: on the board, above it, two-shot
NAP = 0.05  # seconds rank 0 sleeps before an op, so that the others wait for it


def mixed_calls(world: int) -> list[Call]:
    """A mix of both engines: the board's fast entry (one-shot and two-shot), its general
    way (async), a forced allreduce over links, rooted ops at roots other than 0, an uneven
    all-to-all; the last two (an all-gather over links and a barrier on the board) are
    the ones rank 0 comes late to."""
    return [
        Call("allreduce", SMALL), Call("allreduce", BIG), Call("allreduce", LARGE, op="max",
                                                               async_op=True),
        Call("allreduce", LARGE, algorithm="ring"), Call("broadcast", SMALL, root=1),
        Call("broadcast", LARGE, root=2), Call("reduce", SMALL, root=1),
        Call("reduce_scatter", LARGE), Call("gather", SMALL, root=2),
        Call("scatter", SMALL, root=1),
        Call("alltoall", splits=tuple(tuple((s + 2 * d) % 3 * 5 for d in range(world))
                                      for s in range(world))),
        Call("allgather", LARGE), Call("barrier"),
    ]


def _traced_ops(comm: Communicator, folder: Path, calls: list[Call]) -> float:
    """``calls`` and a send from rank 0 to rank 1 under ``comm.tracing``; rank 0 naps before
    each of the last two calls. Returns the timeline's dropped count."""
    with comm.tracing(folder) as timeline:
        for i, call in enumerate(calls):
            if comm.rank == 0 and i >= len(calls) - 2:
                time.sleep(NAP)
            done = call.issue(comm, call.buffers(comm.rank, comm.world_size))
            if call.async_op:
                done.wait()
        if comm.rank == 0:
            comm.send(contribution(0, SMALL, "float32"), 1)
        elif comm.rank == 1:
            comm.recv(np.empty(SMALL, np.float32), 0)
    return timeline.dropped


@pytest.mark.timeout(60)
def test_every_rank_writes_a_timeline_whose_steps_add_up_to_the_schedules(tmp_path):
    """Three ranks of one host (the board), every rank in ``comm.tracing`` together: each
    file valid and nested; each op span the call it was (collective, sequence number,
    size) with its steps adding up to its schedule; the point-to-point message on the
    link tracks at both ends; and where rank 0 came late, the others' op spans hold a wait
    about as long as its nap, on the links and on the board."""
    world = 3
    calls = mixed_calls(world)
    dropped = run_group(world, lambda comm: _traced_ops(comm, tmp_path, calls), board=True)
    assert dropped == [0] * world
    files = read_timelines(tmp_path, world)
    engines = set()
    for rank, trace in enumerate(files):
        check_file(trace, rank, world)
        assert check_bytes(trace, rank, world, Settings.local().segment_bytes,
                           dict(enumerate(calls))) == len(calls)
        for op in spans(trace, "op"):
            call = calls[op["args"]["seq"]]
            assert op["args"]["count"] == (call.block if call.collective != "alltoall" else 0)
            engines.add(op["args"]["engine"])
        assert any(e["tid"] == BOARD_TRACK for e in spans(trace, "post")), rank
    assert engines == {"links", "board"}

    sends = [e for e in spans(files[0], "message") if e["tid"] == PEER_TRACK + 1
             and re.fullmatch(r"send #\d+ to rank 1", e["args"]["op"])]
    recvs = [e for e in spans(files[1], "message") if e["tid"] == PEER_TRACK
             and re.fullmatch(r"recv #\d+ from rank 0", e["args"]["op"])]
    for found, direction in ((sends, "send"), (recvs, "recv")):
        assert [(e["args"]["direction"], e["args"]["bytes"]) for e in found] == \
            [(direction, SMALL * 4)], found

    late = {"allgather": "links", "barrier": "board"}
    for rank, trace in enumerate(files[1:], 1):
        for op in spans(trace, "op"):
            if op["args"]["seq"] < len(calls) - 2:
                continue
            assert late[op["args"]["collective"]] == op["args"]["engine"], op
            waits = [w for w in spans(trace, "wait") if w["tid"] == op["tid"] and
                     op["ts"] <= w["ts"] and w["ts"] + w["dur"] <= op["ts"] + op["dur"]]
            assert max((w["dur"] for w in waits), default=0) >= NAP * 1e6 / 2, (rank, op)


@pytest.mark.timeout(60)
def test_a_timeline_keeps_its_latest_events_and_counts_the_rest(tmp_path, monkeypatch):
    """``RINGCOMM_TRACE_EVENTS=10``: each file holds ten events, the last op's among them
    and none of the first's, and counts every other event recorded as dropped."""
    monkeypatch.setenv("RINGCOMM_TRACE_EVENTS", "10")
    calls = [Call("allreduce", LARGE)] * 4 + [Call("barrier")]

    def fn(comm: Communicator) -> tuple[int, int]:
        with comm.tracing(tmp_path) as timeline:
            for call in calls:
                call.issue(comm, call.buffers(comm.rank, comm.world_size))
        return timeline.recorded, timeline.dropped

    counts = run_group(2, fn)
    for rank, trace in enumerate(read_timelines(tmp_path, 2)):
        recorded, dropped = counts[rank]
        kept = spans(trace, None)
        assert len(kept) == 10 and trace["otherData"]["capacity"] == 10
        assert trace["otherData"]["events"] == 10
        assert trace["otherData"]["dropped"] == dropped == recorded - 10 > 0
        assert recorded >= 4 * 3  # four allreduces' op spans, steps and messages at least
        assert f"barrier #{len(calls) - 1}" in {e["name"] for e in kept}
        assert not any(e.get("args", {}).get("op") == "allreduce #0" or
                       e["name"] == "allreduce #0" for e in kept)


@pytest.mark.timeout(60)
def test_two_watchers_of_one_op_each_see_every_step(tmp_path):
    """A step log (``run_group(trace=)``) and a timeline (``comm.tracing``) in front of the
    same engines: each sees every step, the fast entry's included."""
    steps: list = []

    def fn(comm: Communicator) -> int:
        with comm.tracing(tmp_path):
            comm.allreduce(np.ones(4, np.float32))  # the board engine's fast entry
            comm.broadcast(np.ones(4, np.float32))  # the board engine's run
            comm.allgather(np.empty(2 << 17), np.ones(1 << 17))  # the link engine's
        return comm.rank

    run_group(2, fn, board=True, trace=steps)
    for rank, trace in enumerate(read_timelines(tmp_path, 2)):
        logged = [e for e in steps if e.rank == rank]
        engines = {e.engine for e in logged}
        assert engines == {"board", "links"}, engines
        assert len(spans(trace, "step")) == len(logged) > 2, (rank, len(logged))


@pytest.mark.timeout(60)
def test_a_timeline_that_cannot_be_written_loses_itself_only(tmp_path, caplog):
    """Closing writes the timeline last: a folder it cannot write costs the timeline (a
    warning says so), never the links, the store or the files of the group."""
    where = tmp_path / "a-file"
    where.write_text("not a folder")

    def fn(comm: Communicator) -> bool:
        comm.keep_timeline(where, Clock())
        comm.allreduce(np.ones(4))
        comm.close()
        return comm.transport._closed

    with caplog.at_level("WARNING", logger="ringcomm"):
        assert run_group(2, fn) == [True, True]
    assert "could not write its timeline" in caplog.text


@pytest.mark.timeout(60)
def test_a_point_to_point_wait_is_drawn_on_its_peers_track(tmp_path):
    """A receive is no op of an engine: the time it waits goes on the link's track."""
    def fn(comm: Communicator) -> None:
        with comm.tracing(tmp_path):
            comm.allreduce(np.ones(4))  # an engine ran last
            if comm.rank == 1:
                time.sleep(NAP)
                comm.send(np.ones(2), 0)
            else:
                comm.recv(np.empty(2), 1)

    run_group(2, fn, board=True)
    waits = spans(read_timelines(tmp_path, 2)[0], "wait")
    peer = [w for w in waits if w["args"].get("op", "").startswith("recv")]
    assert peer and all(w["tid"] == PEER_TRACK + 1 for w in peer), waits


# --------------------------------------------------------------------------- torchrun

JOB = Path(__file__).with_name("traced_torch_job.py")
_OFFSET = re.compile(r"rank (\d+): clock offset ([+-]\d+\.\d) us \+/- (\d+\.\d) us")


@pytest.mark.timeout(120)
def test_a_traced_torchrun_job_merges_onto_one_clock_and_plots(tmp_path, capsys):
    """``RINGCOMM_TRACE`` on a torchrun job of three ranks: three files, valid and nested,
    their steps adding up op by op; ``ringcomm trace merge`` puts every event on rank 0's
    clock (its time plus its rank's offset), and every offset it prints is within the error
    it prints (one host, one clock: the true offset is 0); ``ringcomm trace plot`` draws a
    PNG that opens."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this python")
    folder = tmp_path / "traces"
    env = dict(os.environ, RINGCOMM_TRACE=str(folder), OMP_NUM_THREADS="1")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "3", str(JOB)],
                          env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the ranks share torchrun's stdout: look for each one's line, whatever the order
    assert all(f"rank {r} done" in proc.stdout for r in range(3)), proc.stdout
    files = read_timelines(folder, 3)
    engines = set()
    for rank, trace in enumerate(files):
        check_file(trace, rank, 3)
        assert check_bytes(trace, rank, 3, Settings.local().segment_bytes) == 6
        assert [e["args"]["collective"] for e in spans(trace, "op")] == [
            "allreduce", "allreduce", "broadcast", "allgather", "allreduce", "barrier"]
        engines |= {e["args"]["engine"] for e in spans(trace, "op")}
        assert trace["otherData"]["clock"]["error_us"] is not None  # measured at init
    assert engines == {"links", "board"}
    assert any(e["args"]["direction"] == "send" for e in spans(files[0], "message"))

    merged_path = tmp_path / "trace.json"
    cli.main(["trace", "merge", str(folder), "-o", str(merged_path)])
    report = capsys.readouterr().out
    offsets = {int(r): (float(o), float(e)) for r, o, e in _OFFSET.findall(report)}
    assert sorted(offsets) == [0, 1, 2], report
    for rank, (offset, error) in offsets.items():
        assert abs(offset) <= error, (rank, report)
        clock = files[rank]["otherData"]["clock"]
        assert offset == pytest.approx(clock["offset_us"], abs=0.051)
    merged = json.loads(merged_path.read_text())
    timed = [e for e in merged["traceEvents"] if "ts" in e]
    assert len(timed) == sum(len(spans(t)) for t in files)
    by_rank = defaultdict(list)
    for e in timed:
        by_rank[e["pid"]].append(e["ts"])
    for rank, trace in enumerate(files):
        offset = trace["otherData"]["clock"]["offset_us"]
        assert by_rank[rank] == [round(e["ts"] + offset, 3) for e in spans(trace)], rank

    png = tmp_path / "timeline.png"
    cli.main(["trace", "plot", str(merged_path), "-o", str(png)])
    assert f"wrote {png}" in capsys.readouterr().out
    from matplotlib import image

    height, width, _ = image.imread(png).shape
    assert height > 100 and width > 100
