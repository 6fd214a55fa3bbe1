"""A fault-injection test of a training script: does the job fail fast and clearly when one
rank dies mid-training, or when a gradient is corrupted on its way?

Copy this file next to your own script and change ``TRAIN`` and the assertions. It starts
the ranks itself (as torchrun would: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and gives every rank the same ``RINGCOMM_FAULTS``; ringcomm injects the
fault where the messages move, so the script needs no change. Run it with

    pytest examples/fault_injection/test_train_faults.py

What a survivor sees through ``torch.distributed``: the collective that DDP started fails,
and the ``RuntimeError`` that ``loss.backward()`` raises carries ringcomm's typed error,
e.g. ``PeerLostError: [rank 0, allreduce #11] the connection from rank 1 closed ...``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TRAIN = Path(__file__).with_name("train.py")
WORLD = 3
OP_TIMEOUT = 5.0  # seconds an op may take (TRAIN_TIMEOUT): a stuck rank is noticed by then
LIMIT = 120.0  # seconds the whole job may take before the test calls it a hang
# ringcomm's errors name their type, the rank that raised them and the op
ERROR = re.compile(r"(\w+Error): \[rank (\d+), (\w+) #\d+\] ([^\n]*)")


@dataclass
class Rank:
    returncode: int
    ended: float  # when its process ended (time.monotonic())
    stdout: str
    stderr: str

    def error(self) -> re.Match[str] | None:
        """The first ringcomm error this rank reported."""
        return ERROR.search(self.stderr)


def run_job(faults: str, **env: str) -> list[Rank]:
    """Run the training script on ``WORLD`` ranks of this host with ``RINGCOMM_FAULTS=faults``
    (and ``env``) on every rank; every rank's exit code, end time and output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                  WORLD_SIZE=str(WORLD), RINGCOMM_FAULTS=faults,
                  TRAIN_TIMEOUT=str(OP_TIMEOUT), TRAIN_STEPS="20", **env)
    procs = [subprocess.Popen([sys.executable, str(TRAIN)],
                              env=dict(common, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + LIMIT
    try:
        while len(ended) < WORLD and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = time.monotonic()
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert len(ended) == WORLD, f"ranks {set(range(WORLD)) - ended.keys()} hung"
    return [Rank(p.returncode, ended[r], *p.communicate()) for r, p in enumerate(procs)]


def test_a_rank_killed_mid_training_stops_every_other_rank_with_a_typed_error():
    # rank 1 dies (SIGKILL) just before its 5th allreduce: DDP's gradients of step 5
    ranks = run_job("kill:rank=1,op=allreduce,call=5")
    assert ranks[1].returncode == -signal.SIGKILL
    for r in (0, 2):
        found = ranks[r].error()
        assert ranks[r].returncode != 0, f"rank {r} finished training: {ranks[r].stdout}"
        assert found is not None, ranks[r].stderr[-2000:]
        kind, rank, op, message = found.groups()
        assert kind in ("PeerLostError", "RemoteError") and int(rank) == r and \
            op == "allreduce", found.group(0)
        assert "rank 1" in message  # the dead rank is named
        # the survivors stop within the op timeout of the death, not after a long hang
        assert ranks[r].ended - ranks[1].ended < OP_TIMEOUT, (r, ranks[r].ended - ranks[1].ended)


def test_a_corrupted_gradient_with_checksums_on_is_caught_not_trained_on():
    # one byte of rank 2's first gradient message of its 3rd allreduce is flipped
    ranks = run_job("corrupt:rank=2,op=allreduce,call=3,msg=0", RINGCOMM_CHECKSUM="1")
    errors = [rank.error() for rank in ranks]
    assert all(rank.returncode != 0 for rank in ranks), [rank.stdout for rank in ranks]
    assert all(found is not None for found in errors), [rank.stderr[-2000:] for rank in ranks]
    kinds = {found.group(1) for found in errors if found is not None}
    assert "ChecksumError" in kinds and kinds <= {"ChecksumError", "RemoteError"}, kinds
    caught = next(found for found in errors if found and found.group(1) == "ChecksumError")
    assert "from rank 2" in caught.group(4), caught.group(0)  # the link it came over
