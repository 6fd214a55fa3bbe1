"""MPS, seen and said: whether an MPS control daemon serves this process is read from the
machine (its pipe directory and the running daemon), every rank's answer and GPU is agreed
at init, and ranks that share a GPU are told whether their kernels run at once.

The machine is read through a ``/proc`` of the test's own (``proc=``), so that what runs on
the machine (an MPS daemon of its own, a container) does not change the answers."""

from __future__ import annotations

import os
from pathlib import Path

from ringcomm.core.device.mps import (
    CONTROL_COMMAND,
    control_daemons,
    mps_state,
    pipe_directory,
    sees_every_process,
)
from ringcomm.plan.topology import RankFacts, Topology

INIT_NAMESPACE = "pid:[4026531836]"


def machine(tmp_path: Path, *, daemon: int | None = None, namespace: str = INIT_NAMESPACE,
            hidden: bool = False) -> str:
    """A /proc of processes 1, 77 and (where given) an MPS control daemon ``daemon``."""
    proc = tmp_path / "proc"
    for pid, argv in ((1, ["/sbin/init"]), (77, ["python3", "train.py"])) + (
            ((daemon, [f"/usr/bin/{CONTROL_COMMAND}", "-d"]),) if daemon else ()):
        (proc / str(pid)).mkdir(parents=True)
        if not (hidden and pid == 1):
            (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv))
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink(namespace, proc / "self" / "ns" / "pid")
    return str(proc)


def pipes(tmp_path: Path, *, control: bool) -> dict[str, str]:
    folder = tmp_path / "mps"
    folder.mkdir()
    if control:
        os.mkfifo(folder / "control")
    return {"CUDA_MPS_PIPE_DIRECTORY": str(folder)}


def test_no_daemon_and_no_pipe_is_off(tmp_path: Path) -> None:
    state = mps_state(pipes(tmp_path, control=False), machine(tmp_path))
    assert not state.on and "no MPS control daemon runs" in state.why


def test_a_daemon_listening_in_the_pipe_directory_is_on(tmp_path: Path) -> None:
    env = pipes(tmp_path, control=True)
    state = mps_state(env, machine(tmp_path, daemon=4242))
    assert state.on, state
    assert "pid 4242" in state.why and env["CUDA_MPS_PIPE_DIRECTORY"] in state.why


def test_a_stale_pipe_without_a_daemon_is_off(tmp_path: Path) -> None:
    state = mps_state(pipes(tmp_path, control=True), machine(tmp_path))
    assert not state.on and "no nvidia-cuda-mps-control runs" in state.why


def test_a_pipe_without_a_daemon_in_sight_is_unknown(tmp_path: Path) -> None:
    """A container's own PID namespace, or /proc with hidepid: a daemon may serve the pipe
    from where this process cannot see it."""
    env = pipes(tmp_path, control=True)
    for proc in (machine(tmp_path / "ns", namespace="pid:[4026532000]"),
                 machine(tmp_path / "hidepid", hidden=True)):
        assert not sees_every_process(proc)
        state = mps_state(env, proc)
        assert not state.on and state.why.startswith("unknown: "), state
    assert sees_every_process(machine(tmp_path / "host"))


def test_a_daemon_elsewhere_is_off_and_says_where_this_process_looks(tmp_path: Path) -> None:
    state = mps_state(pipes(tmp_path, control=False), machine(tmp_path, daemon=4242))
    assert not state.on and "pid 4242" in state.why
    assert "CUDA_MPS_PIPE_DIRECTORY" in state.why


def test_the_daemon_is_found_by_its_command_in_proc() -> None:
    """On the real /proc: this test's own process is no MPS daemon."""
    assert os.getpid() not in control_daemons()


def test_the_default_pipe_directory_is_nvidias() -> None:
    assert pipe_directory({}) == "/tmp/nvidia-mps"
    assert pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}) == "/run/mps"


def _facts(host: str, gpu: str, mps: bool) -> RankFacts:
    return RankFacts(host, host, (0,), 1, gpu=gpu, mps=mps)


def test_ranks_on_one_gpu_are_told_whether_mps_serves_them() -> None:
    shared = Topology((_facts("a", "0000:65:00.0", False), _facts("a", "0000:65:00.0", False),
                       _facts("a", "0000:66:00.0", False), _facts("b", "0000:65:00.0", False)))
    assert shared.shared_gpus == ((0, 1),)
    said = shared.gpu_sharing()
    assert said.startswith("ranks 0, 1 share GPU 0000:65:00.0 on a; no MPS: their kernels "
                           "take turns")
    served = Topology((_facts("a", "g", True), _facts("a", "g", True)))
    assert served.gpu_sharing().endswith("MPS serves them: their kernels run at once")
    half = Topology((_facts("a", "g", True), _facts("a", "g", False)))
    assert "MPS serves only rank(s) 0" in half.gpu_sharing()
    apart = Topology((_facts("a", "g0", False), _facts("a", "g1", False), _facts("a", "", False)))
    assert apart.shared_gpus == () and apart.gpu_sharing() == ""


def test_facts_travel_through_json() -> None:
    facts = _facts("a", "fake:0", True)
    assert RankFacts.from_json(facts.to_json()) == facts


def test_an_in_process_group_on_a_device_says_its_ranks_share_it() -> None:
    from ringcomm.runtime.local import run_group

    said = run_group(3, lambda comm: comm.describe(), device="fake")
    assert all("gpus: ranks 0, 1, 2 share GPU fake:0" in text for text in said)
