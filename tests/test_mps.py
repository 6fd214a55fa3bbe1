"""MPS, seen and said: whether an MPS control daemon serves this process is read from the
machine (its pipe directory and the running daemon), every rank's answer and GPU is agreed
at init, and ranks that share a GPU are told whether their kernels run at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ringcomm.core.device.mps import (
    CONTROL_COMMAND,
    control_daemons,
    mps_state,
    pipe_directory,
)
from ringcomm.plan.topology import RankFacts, Topology


@pytest.fixture
def daemon(tmp_path: Path):
    """A running process whose command is the MPS control daemon's (``sleep`` under that
    name): what ``mps_state`` looks for in /proc."""
    fake = tmp_path / "bin" / CONTROL_COMMAND
    fake.parent.mkdir()
    shutil.copy(shutil.which("sleep") or "/bin/sleep", fake)
    proc = subprocess.Popen([str(fake), "60"])
    try:
        for _ in range(500):  # until it has exec'd (a forked child shows its parent's argv)
            if proc.pid in control_daemons():
                break
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(10)


def pipes(tmp_path: Path, *, control: bool) -> dict[str, str]:
    folder = tmp_path / "mps"
    folder.mkdir()
    if control:
        os.mkfifo(folder / "control")
    return {"CUDA_MPS_PIPE_DIRECTORY": str(folder)}


def test_no_daemon_and_no_pipe_is_off(tmp_path: Path) -> None:
    state = mps_state(pipes(tmp_path, control=False))
    assert not state.on and "no MPS control daemon runs" in state.why


def test_a_daemon_listening_in_the_pipe_directory_is_on(tmp_path: Path, daemon: int) -> None:
    env = pipes(tmp_path, control=True)
    state = mps_state(env)
    assert state.on, state
    assert f"pid {daemon}" in state.why and env["CUDA_MPS_PIPE_DIRECTORY"] in state.why


def test_a_stale_pipe_without_a_daemon_is_off(tmp_path: Path) -> None:
    state = mps_state(pipes(tmp_path, control=True))
    assert not state.on and "no nvidia-cuda-mps-control runs" in state.why


def test_a_daemon_elsewhere_is_off_and_says_where_this_process_looks(
        tmp_path: Path, daemon: int) -> None:
    env = pipes(tmp_path, control=False)
    state = mps_state(env)
    assert not state.on and f"pid {daemon}" in state.why
    assert "CUDA_MPS_PIPE_DIRECTORY" in state.why


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
