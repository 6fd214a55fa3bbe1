"""Every bad input is named: one line on stderr saying what was wrong and what to do, exit
status 2, never a traceback or a hang (issue 37).

Commands that would start ranks or serve for ever when the check is missing (``tune``,
``store``, ``bench``) run in fresh interpreters, as a user types them, under a timeout; the
others run ``ringcomm.cli.main`` in this process, where an uncaught exception fails the test
as a traceback would. ``ringcomm env`` and ``init`` name unknown ``RINGCOMM_*`` variables
and ``env`` flags refused values; a collective's argument error carries one prefix.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mp_helpers import free_port

import ringcomm
from ringcomm import ArgumentError
from ringcomm.bootstrap import rendezvous
from ringcomm.cli import main
from ringcomm.core import variables
from ringcomm.runtime.local import run_group

REPO = Path(__file__).resolve().parents[1]


def one_line(stderr: str) -> str:
    """The single line of ``stderr``, after checking there is one and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def refused_by_a_fresh_ringcomm(*argv: str) -> str:
    """``python -m ringcomm ARGV``'s one line on stderr, after checking it exits 2 within a
    few seconds. It runs in a session of its own, so that a command that hangs instead is
    killed with every rank it started."""
    proc = subprocess.Popen([sys.executable, "-m", "ringcomm", *argv], text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"ringcomm {' '.join(argv)} still ran after 20 s\n{out}\n{err}")
    assert proc.returncode == 2, f"exit {proc.returncode}\n{out}\n{err}"
    return one_line(err)


def refused_in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``ringcomm ARGV``'s one line on stderr, run in this process, after checking it exits
    2 and printed nothing else (so no work ran before the refusal)."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "", out
    return one_line(err)


# --------------------------------------------------------------------------- commands


@pytest.mark.timeout(40)
@pytest.mark.parametrize("sizes", [["0"], ["2", "1"]], ids=["0", "2 1"])
def test_tune_refuses_world_sizes_below_two(sizes):
    line = refused_by_a_fresh_ringcomm("tune", "-n", *sizes)
    assert f"-n {sizes[-1]}: " in line and "must be 2 or more" in line


@pytest.mark.timeout(40)
@pytest.mark.parametrize("port", ["99999", "-1"])
def test_store_refuses_a_port_that_is_not_one(port):
    line = refused_by_a_fresh_ringcomm("store", "--port", port)
    assert f"store port {port} is not a TCP port: use 1 to 65535, or 0 for a free one" in line


def _cupy_imports() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


@pytest.mark.timeout(40)
def test_bench_on_cuda_without_cupy_says_so_before_starting_ranks():
    if _cupy_imports():
        pytest.skip("CuPy imports here")
    line = refused_by_a_fresh_ringcomm("bench", "--device", "cuda", "--quick")
    assert line.startswith("ringcomm bench: --device cuda: ")
    assert "CuPy does not import" in line and "pip install" in line


def _timeline(rank: int) -> dict:
    """A rank file of ringcomm's form with one op, as ``Timeline.write`` leaves it."""
    from ringcomm.observe.timeline import FORMAT

    return {"traceEvents": [{"ph": "X", "pid": rank, "tid": 0, "ts": 10.0, "dur": 5.0,
                             "name": "allreduce", "cat": "op"}],
            "otherData": {"format": FORMAT, "rank": rank,
                          "clock": {"offset_us": 0.0, "error_us": None}}}


def _spoil(case: str, folder: Path) -> Path:
    """The folder to merge for ``case``, made from ``folder``: a good run of two ranks."""
    second = _timeline(1)
    if case == "missing folder":
        return folder / "nowhere"
    if case == "a file":
        return folder / "rank0.json"
    if case == "empty folder":
        (folder / "empty").mkdir()
        return folder / "empty"
    if case == "bad JSON":
        (folder / "rank1.json").write_text("not json")
    elif case == "not a trace":
        (folder / "rank1.json").write_text("[1, 2]")
    elif case == "another format":
        second["otherData"]["format"] = "other"
        (folder / "rank1.json").write_text(json.dumps(second))
    elif case == "damaged clock":
        del second["otherData"]["clock"]["offset_us"]
        (folder / "rank1.json").write_text(json.dumps(second))
    return folder


MERGE_CASES = {
    "missing folder": "does not exist: merge reads the folder RINGCOMM_TRACE named",
    "a file": "is a file, not a folder",
    "empty folder": "no timelines (rank<N>.json) in",
    "bad JSON": "rank1.json is not JSON (Expecting value at line 1, column 1)",
    "not a trace": "rank1.json is JSON but not a trace",
    "another format": "rank1.json is not a ringcomm timeline",
    "damaged clock": "are damaged (KeyError: 'offset_us')",
}


@pytest.mark.parametrize("case", MERGE_CASES)
def test_trace_merge_names_what_is_wrong(case, tmp_path, capsys):
    folder, output = tmp_path / "traces", tmp_path / "trace.json"
    folder.mkdir()
    for rank in (0, 1):
        (folder / f"rank{rank}.json").write_text(json.dumps(_timeline(rank)))
    line = refused_in_process(capsys, "trace", "merge", str(_spoil(case, folder)), "-o",
                              str(output))
    assert line.startswith("ringcomm: error: ") and MERGE_CASES[case] in line, line
    assert not output.exists()


def test_trace_merge_takes_a_good_run(tmp_path, capsys):
    """The cases above spoil this run; unspoiled, it merges."""
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_timeline(rank)))
    main(["trace", "merge", str(tmp_path), "-o", str(tmp_path / "trace.json")])
    assert "wrote" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "trace.json").read_text())["traceEvents"]) == 2


def test_trace_merge_checks_its_output_folder_first(tmp_path, capsys):
    (tmp_path / "rank0.json").write_text(json.dumps(_timeline(0)))
    output = tmp_path / "nowhere" / "trace.json"
    line = refused_in_process(capsys, "trace", "merge", str(tmp_path), "-o", str(output))
    assert f"-o {output}: the folder {output.parent} does not exist; create it" in line


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file; name a timeline"),
    ("{", "is not JSON (Expecting property name"),
    ('{"events": []}', "is JSON but not a trace (no list of traceEvents)"),
    ('{"traceEvents": []}', "holds no events to draw"),
    ('{"traceEvents": [{"ph": "X", "pid": 0, "tid": 0}]}', "holds events that cannot be drawn"),
])
def test_trace_plot_names_what_is_wrong(content, message, tmp_path, capsys):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    line = refused_in_process(capsys, "trace", "plot", str(path), "-o",
                              str(tmp_path / "t.png"))
    assert line.startswith("ringcomm: error: ") and message in line, line


def test_trace_plot_checks_its_output_folder_first(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_timeline(0)))
    line = refused_in_process(capsys, "trace", "plot", str(path), "-o",
                              str(tmp_path / "nowhere" / "t.png"))
    assert f"the folder {tmp_path / 'nowhere'} does not exist; create it" in line


@pytest.mark.parametrize("option", ["--svg", "--html"])
def test_explain_checks_its_output_folder_before_the_run(option, tmp_path, capsys):
    target = tmp_path / "nowhere" / "ring.out"
    line = refused_in_process(capsys, "explain", "-n", "4", option, str(target))
    assert line == (f"ringcomm: error: {option} {target}: the folder {target.parent} does not "
                    "exist; create it or name a file in a folder that does")
    line = refused_in_process(capsys, "explain", option, str(tmp_path))
    assert f"{option} {tmp_path} is a folder: name a file to write" in line


def test_tune_checks_its_output_before_measuring(tmp_path, capsys):
    line = refused_in_process(capsys, "tune", "-n", "2", "-o", str(tmp_path))
    assert f"-o {tmp_path} is a folder" in line
    afile = tmp_path / "afile"
    afile.write_text("")
    line = refused_in_process(capsys, "tune", "-n", "2", "-o", str(afile / "sub" / "p.json"))
    assert f"{afile} is a file, not a folder" in line


# --------------------------------------------------------------------------- the environment


def test_env_flags_refused_values_and_unknown_variables(monkeypatch, capsys):
    monkeypatch.setenv("RINGCOMM_SPIN_US", "abc")
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "udp")
    monkeypatch.setenv("RINGCOMM_ALOG", "ring")
    monkeypatch.setenv("RINGCOMM_ZZZZZZ", "1")
    monkeypatch.setenv("RINGCOMM_TEST_RUNTIME", "fake")  # read by the tests: known
    main(["env"])
    out, err = capsys.readouterr()
    lines = out.splitlines()

    def below(variable: str) -> str:
        """The line after ``variable``'s own: its flag, if it has one."""
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {variable} = "))
        return lines[at + 1]

    assert below("RINGCOMM_SPIN_US") == (
        "    ! invalid: 'abc' is not a number of microseconds from 0 to 1e+06; ringcomm.init "
        "refuses it: unset it for the default (50.0)")
    assert below("RINGCOMM_TRANSPORT").startswith(
        "    ! invalid: 'udp' is not one of auto, ipc, tcp; ringcomm.init refuses it")
    assert below("RINGCOMM_ALOG") == (
        "    ! unknown: RINGCOMM_ALOG is not a ringcomm setting (did you mean RINGCOMM_ALGO?), "
        "so ringcomm ignores it")
    assert below("RINGCOMM_ZZZZZZ") == (
        "    ! unknown: RINGCOMM_ZZZZZZ is not a ringcomm setting, so ringcomm ignores it")
    assert "  RINGCOMM_TEST_RUNTIME = 'fake'  (read by the tests" in out
    assert sum(line.startswith("    ! ") for line in lines) == 4
    assert one_line(err) == ("ringcomm env: 4 RINGCOMM_* variables set here are invalid or "
                             "unknown: see the lines marked ! under settings")


def test_init_warns_of_an_unknown_variable_once_and_runs(monkeypatch, caplog):
    monkeypatch.setenv("RINGCOMM_ALOG", "ring")
    monkeypatch.setattr(rendezvous, "_WARNED_OF", set())
    caplog.set_level(logging.WARNING, logger="ringcomm")
    for _ in range(2):
        with ringcomm.init(0, 1, store=f"127.0.0.1:{free_port()}", timeout=30) as comm:
            x = np.ones(2)
            comm.allreduce(x)
    warned = [r.getMessage() for r in caplog.records if "RINGCOMM_ALOG" in r.getMessage()]
    assert warned == ["RINGCOMM_ALOG is not a ringcomm setting (did you mean RINGCOMM_ALGO?), "
                      "so ringcomm ignores it; `ringcomm env` lists the settings"]
    assert [r.levelname for r in caplog.records if "RINGCOMM_ALOG" in r.getMessage()] == \
        ["WARNING"]


def test_every_ringcomm_variable_the_sources_read_is_known():
    """A variable read outside the settings table must be listed in OUTSIDE_THE_TABLE, or
    ``ringcomm env`` and ``init`` would call it unknown."""
    me = Path(__file__).resolve()
    found: set[str] = set()
    for folder in ("ringcomm", "bench", "tests", "ddp", "examples"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path.resolve() != me:
                found |= set(re.findall(r"RINGCOMM_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert found - variables.known() == set()
    assert "RINGCOMM_TEST_RUNTIME" in found  # the scan sees variables outside the table


def test_the_likely_intended_variable():
    assert variables.likely_meant("RINGCOMM_ALOG") == "RINGCOMM_ALGO"
    assert variables.likely_meant("RINGCOMM_SPINUS") == "RINGCOMM_SPIN_US"
    assert variables.likely_meant("RINGCOMM_TRANSPROT") == "RINGCOMM_TRANSPORT"
    assert variables.likely_meant("RINGCOMM_ZZZZZZ") is None
    assert variables.unknown({"RINGCOMM_ALGO": "ring", "RINGCOMM_ALOG": "x", "PATH": "/"}) \
        == {"RINGCOMM_ALOG": "RINGCOMM_ALGO"}


# --------------------------------------------------------------------------- the Python API


@pytest.mark.parametrize("world", [1, 2])
def test_alltoall_with_blocks_of_two_sizes_is_the_same_argument_error(world):
    def rank(comm):
        with pytest.raises(ArgumentError) as info:
            comm.alltoall(np.zeros(3 * world), np.zeros(2 * world))
        return str(info.value)

    for r, message in enumerate(run_group(world, rank)):
        assert message == (
            f"[rank {r}, alltoall] this rank's block to itself has 2 elements in x but 3 in "
            f"out: block {r} of x and of out must be the same size (give in_splits and "
            "out_splits, or x and out of the same size)")


def test_a_collective_argument_error_has_one_prefix():
    def rank(comm):
        x = np.zeros(2)
        calls = {"gather": lambda: comm.gather(None, x),
                 "scatter": lambda: comm.scatter(x, None),
                 "scatter ": lambda: comm.scatter(x, [x, x]),
                 "split": lambda: comm.split(-2)}
        messages = []
        for name, call in calls.items():
            with pytest.raises(ArgumentError) as info:
                call()
            assert str(info.value).startswith(f"[rank 0, {name.strip()}] ")
            messages.append(str(info.value))
        return messages

    (messages,) = run_group(1, rank)
    for message in messages:
        prefix, _, rest = message.partition("] ")
        op = prefix.rpartition(", ")[2]
        assert not rest.startswith((f"{op}:", f"{op} ")), message


def test_no_raise_site_starts_its_message_with_an_op_name():
    """An error of a collective gets ``[rank R, OP]`` from its ``op=`` or from the
    communicator's wrapper, so a message that starts with the op's name says it twice."""
    from ringcomm.plan.collectives import COLLECTIVES

    ops = "|".join(sorted(set(COLLECTIVES) | {"split", "send", "recv", "barrier", "close"}))
    raise_site = re.compile(rf"(Error|Timeout|Aborted)\(\s*f?[\"']({ops})( #\S*)?: ")
    doubled = [f"{path.relative_to(REPO)}: {match.group(0)!r}"
               for path in (REPO / "ringcomm").rglob("*.py")
               for match in raise_site.finditer(path.read_text())]
    assert doubled == []


@pytest.mark.timeout(40)
def test_a_reader_that_leaves_early_is_not_an_error():
    """``ringcomm explain ... | head -1``: the closed pipe ends the command quietly."""
    proc = subprocess.Popen([sys.executable, "-m", "ringcomm", "explain", "-n", "16", "-c",
                             "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as head does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(30) == 0, err
    assert first.startswith(b"allreduce (ring) on 16 ranks"), first
    assert "Traceback" not in err and "BrokenPipe" not in err, err
