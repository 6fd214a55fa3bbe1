"""``ringcomm bench --peers mpi``: MPI's collectives as one more column, in processes of their own.

MPI programs are started by ``mpiexec``, not by torch's spawn, so MPI cannot run inside the
sweep's ranks. Instead rank 0 of the sweep starts ``mpiexec -n N python -m
ringcomm_bench.mpi_peer`` (the ``mpiexec`` next to ``sys.executable``: MPICH's wheel puts it
in the environment's ``bin``) and every MPI rank connects back to rank 0 over a localhost
socket. From then on the MPI ranks only act when told, one *turn* at a time:

    prepare   build the buffers for a collective, dtype, op and count; check one call
    calls     ``n`` calls back to back, timed (the warm-up rounds: their pace sets ``iters``)
    time      one repetition: barrier, one untimed call, ``iters`` timed calls
    check     one more checked call, after the timing
    quit

and answer with their own number (wrong elements, seconds per call); rank 0 takes the slowest
rank's time and the sum of the wrong elements, as for every other backend.

Why turns, and how they keep the comparison fair: on a small machine two jobs measured at
different times, or at the same time, see different machines. So MPI takes part in the
sweep's repetitions as one more backend in the shuffled turn order of every repetition:
while it has its turn, the sweep's ranks wait (rank 0 for the MPI ranks' answers on its
socket, the others in a Gloo barrier), and while the sweep's backends run, the MPI ranks wait
in a blocking socket read. Both kinds of wait sleep in the kernel rather than spin (a Gloo
barrier costs its waiting rank about 0.5% of a core), so each side has the cores to itself
during its turn, and MPI's repetition ``k`` runs between the other backends' repetitions
``k``, under the same conditions. MPI's collectives spin while they wait for a peer (MPICH's
default), which is its own choice and part of its time.

The MPI ranks use the sweep's own ``Buffers`` and ``Reference`` (``buffers``), so MPI moves the same
elements and is checked the same way; MPI gets numpy views of those buffers:
``Allreduce(MPI.IN_PLACE, x, op)``, ``Allgather``, ``Reduce_scatter_block``, ``Bcast`` from
root 0 and ``Alltoall``. MPI has no average and its standard types no bfloat16, so those
reductions are left out (with a note); bfloat16 is moved as 16-bit integers where nothing is
reduced.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringcomm._support import install_hint

from .buffers import Buffers, Reference
from .common import timed

EXTRA = install_hint("mpi")
TOKEN_ENV = "RINGCOMM_BENCH_MPI_TOKEN"  # tells our MPI ranks apart from any other connection
_OPS = ("sum", "prod", "min", "max")


def mpiexec_path() -> Path:
    """The ``mpiexec`` of this Python environment: MPICH's wheel installs it beside Python."""
    return Path(sys.executable).parent / "mpiexec"


def unavailable() -> str | None:
    """None when ``--peers mpi`` can run here, else what is missing and how to install it.

    Looks for mpi4py without importing it: importing ``mpi4py.MPI`` starts MPI."""
    try:
        found = importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (f"--peers mpi needs mpi4py and MPICH, which are not installed; install them "
                f"with: {EXTRA}")
    if not os.access(mpiexec_path(), os.X_OK):
        return (f"--peers mpi needs mpiexec beside Python ({mpiexec_path()}), which is not "
                f"there; install MPICH's wheel with: {EXTRA}")
    return None


def unsupported(collective: str, dtype: str, op: str | None) -> str | None:
    """Why MPI sits out this collective, dtype and op, or None when it takes part."""
    if op is None:  # nothing reduced: bytes move whatever their type
        return None
    if op not in _OPS:
        return f"MPI has no {op} reduction"
    if dtype == "bfloat16":
        return "MPI's standard types have no bfloat16 to reduce"
    return None


# --------------------------------------------------------------------------- messages


def _send(sock: socket.socket, message: Any) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> Any:
    (length,) = struct.unpack("!I", _exactly(sock, 4))
    return json.loads(_exactly(sock, length))


class MpiPeerFailed(RuntimeError):
    """The MPI ranks could not be started, failed, or went silent; carries their output."""


# --------------------------------------------------------------------------- sweep side


class MpiPeer:
    """Rank 0's handle on the MPI ranks: starts them, and gives them their turns.

    ``start`` returns at once (MPI starts while the sweep's ranks set up their own
    backends); ``connect`` waits for every MPI rank to call back."""

    def __init__(self, world: int, timeout: float) -> None:
        self.world, self.timeout = world, timeout
        self.token = os.urandom(16).hex()
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        self.command = [str(mpiexec_path()), "-n", str(world), sys.executable, "-m",
                        "ringcomm_bench.mpi_peer", "--connect", f"127.0.0.1:{port}"]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(self.command, env={**os.environ, TOKEN_ENV: self.token},
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._ranks: list[socket.socket] = []
        self.library = ""

    def output(self, limit: int = 3000) -> str:
        """The end of what ``mpiexec`` and the MPI ranks printed."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-limit:]

    def _failed(self, what: str) -> MpiPeerFailed:
        code = self.proc.poll()
        status = "still running" if code is None else f"exit code {code}"
        return MpiPeerFailed(f"MPI peer ({' '.join(self.command)}; {status}): {what}\n"
                             f"its output:\n{self.output()}")

    def connect(self) -> None:
        """Accept every MPI rank's connection, in rank order; fail early if mpiexec exits."""
        ranks: dict[int, socket.socket] = {}
        deadline = time.monotonic() + self.timeout
        self._listener.settimeout(0.5)
        while len(ranks) < self.world:
            if self.proc.poll() is not None:
                raise self._failed("it exited before every rank connected")
            if time.monotonic() > deadline:
                raise self._failed(f"only {len(ranks)} of {self.world} ranks connected "
                                   f"within {self.timeout:.0f} s")
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                hello = _recv(sock)
            except (OSError, ValueError):
                sock.close()
                continue
            if not isinstance(hello, dict) or hello.get("token") != self.token:
                sock.close()  # not one of ours (another run that reused the port number)
                continue
            if hello.get("world") != self.world:
                raise self._failed(f"MPI started {hello.get('world')} ranks, not {self.world}")
            ranks[hello["rank"]] = sock
            self.library = hello.get("library", "")
        self._listener.close()
        self._ranks = [ranks[r] for r in range(self.world)]

    def turn(self, *instruction: Any) -> list[Any]:
        """Send ``instruction`` to every MPI rank and wait for every answer (in rank order)."""
        what = instruction[0]
        try:
            for sock in self._ranks:
                _send(sock, list(instruction))
        except OSError as err:
            raise self._failed(f"could not send {what!r}: {err}") from None
        answers, lost = [], []
        for r, sock in enumerate(self._ranks):  # every rank's, so a traceback is never lost
            try:
                answers.append(_recv(sock))
            except (OSError, ValueError) as err:  # to a rank that failed, its peers are lost
                answers.append(None)
                lost.append(f"rank {r}: {err}")
        for r, answer in enumerate(answers):
            if answer is not None and answer[0] == "error":
                raise self._failed(f"rank {r} failed in {what!r}:\n{answer[1]}")
        if lost:
            raise self._failed(f"no answer to {what!r} from {'; '.join(lost)}")
        return [answer[1] for answer in answers]

    def close(self) -> None:
        """Tell the MPI ranks to finish; stop them if they do not within seconds."""
        for sock in self._ranks:
            try:
                _send(sock, ["quit"])
                sock.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10 if self._ranks else 0)  # not connected: nothing to wait for
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        finally:
            self._listener.close()
            self._log.close()


# --------------------------------------------------------------------------- MPI side


def calls(mpi: Any, collective: str, bufs: Buffers, op: str | None,
          algorithm: str | None = None) -> Callable[[], object]:
    """A no-argument function that runs one call of ``collective`` on ``mpi.COMM_WORLD``
    (``mpi``: mpi4py's ``MPI``); MPI picks its own algorithm, so ``algorithm`` is unused."""
    import torch

    comm = mpi.COMM_WORLD

    def host(t: Any) -> Any:
        # numpy has no bfloat16: move its bits as 16-bit integers (nothing is reduced then)
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()

    x, out = host(bufs.inp), host(bufs.out)
    rop = {"sum": mpi.SUM, "prod": mpi.PROD, "min": mpi.MIN, "max": mpi.MAX}.get(op or "sum")
    return {
        "allreduce": lambda: comm.Allreduce(mpi.IN_PLACE, x, op=rop),
        "allgather": lambda: comm.Allgather(x, out),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(x, out, op=rop),
        "broadcast": lambda: comm.Bcast(x, root=0),
        "alltoall": lambda: comm.Alltoall(x, out),
    }[collective]


def serve(address: str) -> None:
    """One MPI rank: connect to the sweep's rank 0, then do as told until ``quit``."""
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.settimeout(None)  # waits for turns as long as the sweep takes; EOF if it ends
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send(sock, {"token": os.environ.get(TOKEN_ENV), "rank": comm.rank, "world": comm.size,
                 "library": MPI.Get_library_version().splitlines()[0].strip()})
    prepared: tuple[Buffers, Callable[[], object]] | None = None
    while True:
        try:
            kind, *args = _recv(sock)
        except ConnectionError:
            return  # the sweep is gone: nothing left to do
        if kind == "quit":
            return
        try:
            if kind == "prepare":
                collective, dtype_name, op, count = args
                dtype = getattr(torch, dtype_name)
                ref = Reference(collective, comm.size, count, dtype, op)
                bufs = Buffers(collective, comm.rank, comm.size, count, dtype, ref)
                prepared = bufs, calls(MPI, collective, bufs, op)
                answer: Any = _checked(*prepared, comm)
                bufs.steady(op)
            else:
                answer = _answer(kind, args, prepared, comm)
        except Exception:
            _send(sock, ["error", traceback.format_exc()])
            raise
        _send(sock, ["ok", answer])


def _nothing() -> None:
    return None


def _answer(kind: str, args: list[Any], prepared: tuple[Buffers, Callable[[], object]] | None,
            comm: Any) -> Any:
    """An MPI rank's answer to any instruction but ``prepare``, on what it prepared."""
    if kind not in ("calls", "time", "check"):
        raise ValueError(f"unknown instruction {kind!r}")
    if prepared is None:
        raise ValueError(f"{kind!r} before any 'prepare'")
    bufs, run = prepared
    if kind == "calls":
        (n,) = args
        return timed(run, n, _nothing)
    if kind == "time":
        (iters,) = args
        comm.Barrier()
        run()  # lines the ranks up, as the sweep's backends do
        return timed(run, iters, _nothing)
    return _checked(bufs, run, comm)


def _checked(bufs: Buffers, run: Callable[[], object], comm: Any) -> int:
    """One checked call: inputs reset, the collective run, this rank's wrong elements."""
    bufs.reset()
    comm.Barrier()
    run()
    return bufs.wrong()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="One MPI rank of `ringcomm bench --peers mpi` "
                                "(started by the sweep under mpiexec, not by hand).")
    p.add_argument("--connect", required=True, help="HOST:PORT of the sweep's rank 0")
    serve(p.parse_args(argv).connect)


if __name__ == "__main__":
    main()
