"""``ringcomm explain``: what it shows is what a real collective does.

Its final buffers must equal a real collective's on the same data (run here through the
communicator without the recorder) and numpy's, for every collective and algorithm at world
sizes 1 to 9 and ``hier`` on several hosts; every message of the schedules must be one
transfer in its rounds and one arrow in its SVG; the text, the terminal frames and the
command line must say what a reader checks by eye.
"""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ringcomm.cli import main
from ringcomm.errors import ArgumentError
from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.runtime.local import run_group
from ringcomm.teach import explain, hosts_layout
from ringcomm.teach.animate import animate
from ringcomm.teach.svg import draw
from ringcomm.teach.text import render

LINK_ALGORITHMS = [(c, a) for c, spec in COLLECTIVES.items() for a in spec.algorithms
                   if a not in ("board", "twoshot", "hier")]
WORLDS = range(1, 10)
SVG = "{http://www.w3.org/2000/svg}"

# A real collective on the same data, called as a user calls it: (comm, buffers, root, algo)
REAL: dict[str, Callable[[Any, dict[str, np.ndarray], int, str], None]] = {
    "allreduce": lambda c, b, root, a: c.allreduce(b["data"], algorithm=a),
    "reduce_scatter": lambda c, b, root, a: c.reduce_scatter(b["output"], b["input"]),
    "allgather": lambda c, b, root, a: c.allgather(b["output"], b["input"]),
    "broadcast": lambda c, b, root, a: c.broadcast(b["data"], root, algorithm=a),
    "reduce": lambda c, b, root, a: c.reduce(b["data"], root),
    "gather": lambda c, b, root, a: c.gather(b.get("output"), b["input"], root),
    "scatter": lambda c, b, root, a: c.scatter(b["output"], b.get("input"), root),
    "alltoall": lambda c, b, root, a: c.alltoall(b["output"], b["input"]),
    "barrier": lambda c, b, root, a: c.barrier(),
}


def real_results(collective: str, algorithm: str, world: int, block: int, root: int,
                 hosts: tuple[tuple[int, ...], ...] | None = None) -> list[Any]:
    """Every rank's result buffer after the collective, run without explain's recorder,
    on inputs built here the way explain documents them: (r + 1) * (i + 1)."""
    spec = COLLECTIVES[collective]

    def rank(comm: Any) -> Any:
        sizes = spec.sizes(block, world, rank=comm.rank, root=root)
        feeds = collective not in ("broadcast", "scatter") or comm.rank == root
        buffers = {role: (comm.rank + 1) * np.arange(1, n + 1, dtype=np.int64)
                   if role == spec.source and feeds else np.zeros(n, np.int64)
                   for role, n in sizes.items()}
        REAL[collective](comm, buffers, root, algorithm)
        return buffers.get(spec.result)

    return run_group(world, rank, timeout=20, hosts=[list(h) for h in hosts] if hosts else None)


def same(a: list[Any], b: list[Any]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and
                                             np.array_equal(x, y)) for x, y in zip(a, b,
                                                                                    strict=True))


@pytest.mark.parametrize(("collective", "algorithm"), LINK_ALGORITHMS)
def test_the_final_buffers_are_a_real_collectives_at_every_world_size(
        collective: str, algorithm: str) -> None:
    for world in WORLDS:
        root = world // 2
        ex = explain(collective, algorithm, world, root=root)
        assert ex.call.algorithm == algorithm
        assert ex.correct, f"{collective}/{algorithm} at {world}: explain differs from numpy"
        real = real_results(collective, algorithm, world, ex.call.block, root)
        assert same(ex.results, real), f"{collective}/{algorithm} at {world}"
        assert same(ex.results, ex.expected)
        # a rank takes in its messages in rounds that never go back, and sends only what
        # it had by the round before the message's
        for run in ex.runs:
            taken = [k for k, e in zip(run.rounds, run.steps, strict=True)
                     if e.step.kind.value != "send"]
            assert taken == sorted(taken), f"{collective}/{algorithm} at {world}"
        assert all(t.round >= 1 for r in ex.rounds for t in r.transfers)
        # the last round's buffers are the results: the rounds lose no step
        last = ex.rounds[-1]
        role = ex.call.spec.result
        shown = [s.get(role) for s in last.buffers]
        assert same(shown, ex.results)


@pytest.mark.parametrize("layout", ["2x2", "3x2", "2x3", "1x3"])
@pytest.mark.parametrize("algorithm", ["hier", "ring", "tree"])
def test_several_hosts(layout: str, algorithm: str) -> None:
    hosts = hosts_layout(layout)
    ex = explain("allreduce", algorithm, hosts=hosts, count=5)
    assert ex.call.world_size == sum(len(h) for h in hosts)
    assert ex.correct
    assert same(ex.results, real_results("allreduce", algorithm, ex.call.world_size, 5, 0,
                                         hosts))


@pytest.mark.parametrize(("collective", "algorithm", "world", "segment"), [
    ("allreduce", "ring", 4, 0), ("allreduce", "ring", 3, 1), ("allreduce", "tree", 7, 2),
    ("allreduce", "dbtree", 6, 0), ("allreduce", "hd", 5, 0), ("allreduce", "rd", 8, 0),
    ("broadcast", "binomial", 6, 0), ("alltoall", "pairwise", 4, 0),
    ("reduce_scatter", "ring", 5, 0), ("barrier", "dissemination", 5, 0)])
def test_every_message_is_one_transfer_and_one_arrow(collective: str, algorithm: str,
                                                     world: int, segment: int) -> None:
    ex = explain(collective, algorithm, world, segment=segment)
    sent = sum(s.messages()[0] for s in ex.schedules)
    assert ex.messages == sent
    pairs = sorted((t.sender, t.receiver) for r in ex.rounds for t in r.transfers)
    scheduled = sorted((s.rank, st.to if st.to >= 0 else st.peer) for s in ex.schedules
                       for st in s.steps if st.kind.value in ("send", "recv+reduce+send"))
    assert pairs == scheduled
    root = ET.fromstring(draw(ex))  # well-formed
    arrows = root.findall(f".//{SVG}g[@class='transfer']")
    assert len(arrows) == sent
    by_round = sorted(int(a.get("data-round", "-1")) for a in arrows)
    assert by_round == sorted(t.round for r in ex.rounds for t in r.transfers)
    assert len(root.findall(f".//{SVG}g[@class='round']")) == len(ex.rounds)


def test_ring_allreduce_reads_as_the_textbook_says() -> None:
    """2 (p - 1) rounds of p messages, reduce-scatter then all-gather; the sums by eye."""
    ex = explain("allreduce", "ring", 4)
    rounds = [r for r in ex.rounds if r.number]
    assert [r.phases for r in rounds] == [("reduce-scatter",)] * 3 + [("all-gather",)] * 3
    assert all(len(r.transfers) == 4 for r in rounds)
    assert all(t.receiver == (t.sender + 1) % 4 for r in rounds for t in r.transfers)
    # after the reduce-scatter, rank r holds chunk (r + 1) % 4 fully reduced
    after = rounds[2].buffers
    for rank in range(4):
        chunk = (rank + 1) % 4
        assert after[rank]["data"][chunk] == 10 * (chunk + 1)
    text = render(ex)
    assert "round 6 of 6 (all-gather): 4 messages" in text
    assert "rank 0 -> rank 1: chunk 0 (data[0:1]), added into data[0:1], sum sent on to " \
        "rank 2" in text
    assert text.count("10 20 30 40") == 4
    assert "they equal numpy's allreduce" in text
    costs = {line.name: line for line in ex.costs.lines}
    assert set(costs) == {"ring", "everyone to everyone", "parameter server (rank 0)"}
    assert costs["ring"].messages == 6 and costs["ring"].sent_bytes == 6 * 8
    # the parameter server's busiest rank moves (p - 1) N; the ring's far less at 64 MiB
    assert costs["parameter server (rank 0)"].sent_bytes == 3 * 4 * 8
    assert costs["ring"].large_time < costs["everyone to everyone"].large_time
    assert costs["ring"].large_time < costs["parameter server (rank 0)"].large_time


def test_tree_and_hd_name_their_phases() -> None:
    tree = explain("allreduce", "tree", 4)
    assert [p for r in tree.rounds for p in r.phases] == \
        ["tree reduce", "tree reduce", "tree broadcast", "tree broadcast"]
    hd = explain("allreduce", "hd", 4)
    assert [r.phases for r in hd.rounds if r.number] == \
        [("halving",), ("halving",), ("doubling",), ("doubling",)]


def test_the_terminal_animation_shows_every_round_and_the_result() -> None:
    from rich.console import Console

    ex = explain("allreduce", "ring", 3)
    out = io.StringIO()
    animate(ex, delay=0, console=Console(file=out, width=100, color_system=None))
    text = out.getvalue()
    for rnd in ex.rounds[1:]:
        assert f"round {rnd.number} of 4" in text
    assert text.count("6 12 18") >= 3


def test_command_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    svg, html = tmp_path / "hd.svg", tmp_path / "hd.html"
    main(["explain", "--algo", "hd", "-n", "5", "--svg", str(svg), "--html", str(html)])
    out = capsys.readouterr().out
    assert "allreduce (hd) on 5 ranks" in out and "(unfold): 1 message" in out
    assert ET.parse(svg).getroot().tag == f"{SVG}svg"
    assert html.read_text().lstrip().lower().startswith("<!doctype html>")
    main(["explain", "--collective", "broadcast", "--algo", "binomial", "-n", "4", "--root",
          "2"])
    assert "broadcast (binomial) on 4 ranks" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--algo", "hier", "-n", "4"], "hier runs on several hosts"),
    (["--algo", "nope"], "allreduce has no algorithm 'nope' over links"),
    (["--collective", "broadcast", "--algo", "ring"], "broadcast has no algorithm 'ring'"),
    (["--hosts", "2by2"], "is not HOSTSxRANKS"),
    (["-n", "0"], "--world-size must be at least 1"),
    (["--root", "7"], "root 7 is out of range"),
    (["-c", "-1"], "must not be negative"),
])
def test_bad_input_is_named(argv: list[str], message: str,
                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["explain", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_forced_algorithm_of_another_collective_is_checked() -> None:
    def rank(comm: Any) -> Any:
        with pytest.raises(ArgumentError, match="broadcast has no algorithm 'ring'"):
            comm.broadcast(np.zeros(2), algorithm="ring")
        with pytest.raises(ArgumentError, match="needs the shared board"):
            comm.broadcast(np.zeros(2), algorithm="board")
        x = np.full(3, comm.rank, np.int64)
        comm.broadcast(x, root=1, algorithm="chain")
        return comm.choose("broadcast", 8, algorithm="chain").algorithm, x
    for algorithm, x in run_group(3, rank):
        assert algorithm == "chain" and x.tolist() == [1, 1, 1]


def test_the_animation_without_rich_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "rich.console", None)  # as if rich were not installed
    with pytest.raises(ArgumentError, match=r"pip install -e '\.\[teach\]' in ringcomm's checkout"):
        animate(explain("allreduce", "ring", 2), delay=0)
