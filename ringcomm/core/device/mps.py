"""Whether an MPS daemon serves this process's GPU work, read from the machine.

Why it matters: processes that share one GPU without MPS take turns on it (time-slicing),
and each switch costs about 250 us (measured on an H100: an 8 B allreduce staged through
pinned memory took 560 us between 2 processes on one GPU, 57 us with MPS). With an MPS
daemon their kernels run at once. ringcomm says which holds (``ringcomm env``,
``Communicator.describe``), and a device path that needs kernels of several processes to
run at once can check it.

How it is read, without asking CUDA (there is no CUDA call for it): a CUDA process becomes
an MPS client when an MPS control daemon (``nvidia-cuda-mps-control -d``) listens in the
pipe directory the process looks in, ``CUDA_MPS_PIPE_DIRECTORY`` (default
``/tmp/nvidia-mps``), through a named pipe ``control`` there. Both must hold: the pipe (a
daemon that quit leaves none; a crashed one may leave a stale one) and a running control
daemon (a process whose command is ``nvidia-cuda-mps-control``). Where this process cannot
see other processes (a container's PID namespace, ``hidepid``), the answer is "unknown".
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
CONTROL_COMMAND = "nvidia-cuda-mps-control"
# the machine's own PID namespace, as /proc/self/ns/pid names it (PROC_PID_INIT_INO,
# include/linux/proc_ns.h)
_INIT_PID_NAMESPACE = "pid:[4026531836]"


@dataclass(frozen=True)
class MpsState:
    """Whether MPS serves this process (``on``), and what was seen, in words (``why``)."""

    on: bool
    why: str

    def __str__(self) -> str:
        return f"{'on' if self.on else 'off'} ({self.why})"


def pipe_directory(environ: Mapping[str, str] | None = None) -> str:
    """Where this process's CUDA looks for an MPS daemon."""
    env = os.environ if environ is None else environ
    return env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY


def sees_every_process(proc: str = "/proc") -> bool:
    """Whether this process can see every process of the machine in ``proc``: it runs in
    the machine's own PID namespace (not a container's) and can read pid 1's command line
    (``hidepid`` hides other users' processes)."""
    try:
        if os.readlink(f"{proc}/self/ns/pid") != _INIT_PID_NAMESPACE:
            return False
        with open(f"{proc}/1/cmdline", "rb"):
            return True
    except OSError:
        return False


def control_daemons(proc: str = "/proc") -> list[int]:
    """The pids of the running processes whose command is the MPS control daemon."""
    found = []
    try:
        pids = [int(name) for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:  # gone meanwhile, or hidden from us
            continue
        if os.path.basename(argv0) == CONTROL_COMMAND:
            found.append(pid)
    return sorted(found)


def mps_state(environ: Mapping[str, str] | None = None, proc: str = "/proc") -> MpsState:
    """Whether an MPS control daemon serves this process's pipe directory (module
    docstring)."""
    folder = pipe_directory(environ)
    control = os.path.join(folder, "control")
    try:
        mode = os.stat(control).st_mode
        pipe = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
    except OSError:
        pipe = False
    daemons = control_daemons(proc)
    running = f"pid {', '.join(map(str, daemons))}"
    if pipe and daemons:
        return MpsState(True, f"an MPS control daemon ({running}) listens in {folder}")
    if pipe and not sees_every_process(proc):
        return MpsState(False, f"unknown: {control} is there, but this process cannot see "
                               "other processes (a container's own PID namespace, or /proc "
                               "mounted with hidepid) to tell whether a daemon still serves it")
    if pipe:
        return MpsState(False, f"{control} is there, but no {CONTROL_COMMAND} runs (left by "
                               "a daemon that is gone?)")
    if daemons:
        return MpsState(False, f"an MPS control daemon runs ({running}), but not in {folder}, "
                               "where this process looks: set CUDA_MPS_PIPE_DIRECTORY to its "
                               "pipe directory")
    return MpsState(False, f"no MPS control daemon runs ({CONTROL_COMMAND} -d starts one)")
