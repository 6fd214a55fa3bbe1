"""No litter, even after a crash: programs that never call ``close()`` or
``destroy_process_group()``, that end in an error, or whose ranks are SIGKILLed or call
``os._exit`` leave no ipc folder in ``<tmp>/ringcomm-<uid>/`` and no shared-memory ring in
/dev/shm. Once set up, a running rank has nothing on the file system at all.

The ranks are real programs (``tests/litter_rank.py``, one subprocess per rank) that end on
their own. Every file of ringcomm's is named for the process that made it (its pid), so the
tests look only at the files of their own processes and stay right while other tests run
beside them. The sweep's own rules (what it may remove, and what never) are checked on
files made up here.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from mp_helpers import files_of, free_port, transport_pair

from ringcomm import CommTimeout
from ringcomm.bootstrap.store import StoreClient, StoreServer
from ringcomm.transport import files, shm_ring
from ringcomm.transport.group import GroupTransport
from ringcomm.transport.header import Header, OpKind
from ringcomm.transport.kinds import Sockets

pytestmark = pytest.mark.skipif(not shm_ring.available(), reason="needs /dev/shm")

HERE = os.path.dirname(os.path.abspath(__file__))


class Ranks:
    """``world`` processes running ``litter_rank.py SCENARIO``; ``wait`` collects each one's
    exit status, JSON lines and stderr (and kills them all if one outlives ``timeout``)."""

    def __init__(self, scenario: str, world: int, **env_vars: str) -> None:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
        env.update(env_vars)
        self.procs = [subprocess.Popen(
            [sys.executable, os.path.join(HERE, "litter_rank.py"), scenario, str(r),
             str(world), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env) for r in range(world)]
        self.pids = [p.pid for p in self.procs]

    def wait(self, timeout: float) -> list[tuple[int, list[dict], str]]:
        deadline = time.monotonic() + timeout
        out = []
        try:
            for p in self.procs:
                stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
                out.append((p.returncode, lines, stderr))
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return out


def _ok(results):
    for r, (code, lines, err) in enumerate(results):
        assert code == 0 and lines, f"rank {r} failed ({code}):\n{err}"
    return [lines[0] for _, lines, _ in results]


# --------------------------------------------------------------------------- whole programs


@pytest.mark.timeout(60)
def test_a_program_that_never_closes_leaves_nothing():
    """Rings are unlinked as soon as their reader maps them and the ipc folders once set-up
    is over: the run is still going, and nothing of it is on the file system."""
    ranks = Ranks("exit", 2)
    seen = _ok(ranks.wait(30))
    for rep in seen:
        assert rep["shm"] > 0, rep  # shared memory was used
        assert rep["files"] == [], rep  # no ring name, no ipc folder
    assert files_of(ranks.pids) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,env,links,board", [
    ("pipes and shared memory", {"RINGCOMM_BOARD": "0"}, ["pipe"], False),
    ("the board", {}, ["pipe"], True),
    ("ipc sockets", {"RINGCOMM_SHM": "0"}, ["socket"], False),
])
def test_ranks_killed_or_exiting_without_exit_hooks_leave_nothing(tmp_path, kind, env, links,
                                                                   board):
    """Set up, a ring allreduce and a barrier, then rank 1 is SIGKILLed and ranks 0 and 2
    call ``os._exit``: no exit hook, finalizer or sweep runs anywhere, and still nothing is
    left in the ipc folders' base, in /dev/shm or in the ranks' temp dir (their own here,
    so that it can be checked whole)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ranks = Ranks("die", 3, TMPDIR=str(tmp), **env)
    results = ranks.wait(30)
    for r, (code, lines, err) in enumerate(results):
        assert code == (-9 if r == 1 else 0) and lines, f"rank {r} ({code}):\n{err}"
        rep = lines[0]
        assert (rep["kinds"], rep["board"]) == (links, board), (kind, rep)
        assert rep["files"] == [], rep  # while it runs
    base = tmp / f"ringcomm-{os.getuid()}"
    assert [p.name for p in tmp.iterdir()] == [base.name]
    assert list(base.iterdir()) == []
    assert files_of(ranks.pids) == []  # /dev/shm (the ipc folders' base is not ipc_base())


@pytest.mark.timeout(60)
def test_a_program_that_ends_in_a_desync_error_leaves_nothing():
    """The ranks disagree about a 1 MiB allreduce: each created its ring, and no reader
    mapped one (a payload whose header is wrong is never read). The error ends the program."""
    ranks = Ranks("desync", 2)
    results = ranks.wait(30)
    seen = []
    for r, (code, lines, err) in enumerate(results):
        assert code == 1 and "Error" in err, f"rank {r} ({code}):\n{err}"
        assert lines and lines[0]["error"] in ("DesyncError", "RemoteError"), (lines, err)
        seen += lines[0]["files"]
    assert any(f.startswith(shm_ring.SHM_DIR) for f in seen), seen  # rings were left to clean
    assert files_of(ranks.pids) == []


@pytest.mark.timeout(60)
def test_a_rank_killed_mid_op_leaves_nothing():
    """Rank 1 is SIGKILLed in the middle of ring allreduces, with a 1 MiB message to rank 0
    that rank 0 never receives (its ring is never mapped). Once the survivors have failed and
    exited, nothing of rank 1's is left: readers removed the names of the rings they mapped,
    rank 0 the one it never read, and its ipc folder went at the end of set-up."""
    ranks = Ranks("kill", 3)
    results = ranks.wait(40)
    code, lines, err = results[1]
    assert code == -9, (code, err)
    assert [os.path.basename(f).rsplit("-", 1)[1] for f in lines[0]["files"]] == ["1to0"], \
        lines  # the unread ring, and no ipc folder
    for r in (0, 2):
        code, lines, err = results[r]
        assert code == 1 and len(lines) == 2, (r, code, err)
        assert lines[1]["error"] in ("PeerLostError", "RemoteError"), (r, lines, err)
    assert files_of(ranks.pids) == []  # no sweep ran: the survivors removed the ring


@pytest.mark.timeout(60)
def test_a_torch_program_without_destroy_process_group_leaves_nothing():
    ranks = Ranks("torch", 2)
    seen = _ok(ranks.wait(45))
    assert all(rep["shm"] > 0 for rep in seen), seen
    assert all(rep["files"] == [] for rep in seen), seen  # nothing while running
    assert files_of(ranks.pids) == []


# --------------------------------------------------------------------------- in one process


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shm", [True, False], ids=["pipes", "ipc-sockets"])
def test_links_and_control_planes_work_on_once_their_names_are_gone(shm):
    """The folders go at the end of set-up; the pipes, ipc sockets and control sockets in
    them stay connected (each rank connected to its peers' control sockets before)."""
    pair = transport_pair(shm=shm)
    try:
        assert [t.ipc_dir for t in pair if os.path.exists(t.ipc_dir)] == []
        for me, peer in ((0, 1), (1, 0)):
            notice = Header.control(OpKind.ABORT, 7, me)
            pair[me].control.abort(peer, notice, b"test")
            assert pair[peer].control.socket.poll(5000), f"rank {me}'s notice is lost"
            assert Header.unpack(pair[peer].control.socket.recv()) == notice
            assert pair[peer].control.socket.recv() == b"test"
            x = np.arange(1 << 18, dtype=np.uint8)  # through the ring, where there is one
            header = Header(0, x.nbytes, x.size, 1 << 20, me, 0, 0, OpKind.ALLREDUCE, 0, 0, 0)
            pair[me].send(peer, header, x, "allreduce #0")
            got = pair[peer].recv(me, header, time.monotonic() + 10, "allreduce #0")
            assert np.array_equal(np.frombuffer(bytes(got), np.uint8), x)
            pair[peer].release(me)
    finally:
        for t in pair:
            t.close()


@pytest.mark.timeout(30)
def test_an_ipc_socket_file_may_go_only_once_its_peer_has_connected(tmp_path):
    """``check_handshakes`` returns only once every watched ipc push has shaken hands; then
    the file's name may go, and the connection works on without it."""
    sockets = Sockets(1)
    try:
        path = tmp_path / "socket"
        sockets.push(f"ipc://{path}", peer=1)  # nobody listens there yet
        with pytest.raises(CommTimeout, match="no handshake with rank"):
            sockets.check_handshakes(time.monotonic() + 0.3)
        pull = sockets.pull()
        pull.bind(f"ipc://{path}")
        push = sockets.push(f"ipc://{path}", peer=1)
        sockets.check_handshakes(time.monotonic() + 10)
        path.unlink()
        push.send(b"after")
        assert pull.poll(5000) and pull.recv() == b"after"
    finally:
        sockets.close(abandon=True)


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_a_transport_that_is_garbage_collected_removes_its_files():
    """A ring its reader never mapped keeps its name until then. Also shows that the
    finalizer does not keep the transport alive."""
    pair = transport_pair()
    dirs = [t.ipc_dir for t in pair]
    assert all(d and os.path.basename(d).startswith(f"{os.getpid()}-") for d in dirs), dirs
    assert [d for d in dirs if os.path.exists(d)] == []  # gone once set up
    assert pair[0].reserve(1, 1 << 20) is not None  # a ring to rank 1, never read
    ring = next(p for p in pair[0].setup.files.shm_paths if p.endswith("-0to1"))
    assert os.path.exists(ring), ring
    del pair
    gc.collect()
    assert not os.path.exists(ring)


@pytest.mark.timeout(30)
def test_close_and_the_finalizer_remove_once_and_close_tolerates_names_already_gone():
    a, b = transport_pair()
    try:
        # rank 0 made the board and removed its name once b had mapped it
        boards = [p for p in a.setup.files.shm_paths if p.endswith("-board")]
        assert len(boards) == 1 and not os.path.exists(boards[0]), boards
        assert a.board is not None and b.board is not None
        paths = [p for p in a.setup.files.shm_paths if p not in boards]
        assert len(paths) == 3, paths  # its ring to b, b's to it, its mailbox from b
        assert not os.path.exists(paths[2]), "b maps a's mailbox at set-up and removes its name"
        assert os.path.basename(paths[0]).startswith(f"ringcomm-{os.getpid()}-"), paths
        assert a.reserve(1, 1 << 20) is not None  # a creates its ring to b; b never maps it
        assert os.path.exists(paths[0]), paths
        os.unlink(paths[0])  # as the reader would have, or a sweep after a crash
        a.close()
        a.close()
        assert not a._remove_files.alive and not os.path.exists(a.ipc_dir)
    finally:  # an unclosed transport left to the garbage collector can hang pytest's exit
        a.close()
        b.close()
    assert [p for p in paths + [a.ipc_dir, b.ipc_dir] if os.path.exists(p)] == []


def test_names_are_built_only_from_tokens_of_our_own_form():
    token = shm_ring.new_token()
    assert shm_ring.valid_token(token)
    assert token.startswith(f"{os.getpid()}-")
    for bad in ("../../etc/passwd", f"{token}/x", token.upper(), "123-abc", ""):
        assert not shm_ring.valid_token(bad), bad


def test_a_ring_that_cannot_be_made_leaves_no_name(monkeypatch):
    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = shm_ring.ring_name(shm_ring.new_token(), 0, 1)
    with pytest.raises(OSError, match="No space"):
        shm_ring.RingWriter(name, 1 << 20)
    assert not os.path.exists(os.path.join(shm_ring.SHM_DIR, name))


# --------------------------------------------------------------------------- the sweep's rules


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_sweep_removes_only_ringcomm_files_of_ended_processes(tmp_path):
    """On made-up files in folders of its own (other tests count /dev/shm's ringcomm files)."""
    ns = shm_ring.owner_tag().split("-")[1]
    dead, alive = _dead_pid(), os.getppid()
    hexes = uuid.uuid4().hex[:12]
    rings = {  # name: kept
        f"ringcomm-{dead}-{ns}-{hexes}-0to1": False,  # ours, and its owner has ended
        f"ringcomm-{dead}-{ns}-{hexes}-1to0-mbox": False,  # a mailbox of its
        f"ringcomm-{alive}-{ns}-{hexes}-1to0-mbox": True,
        f"ringcomm-{dead}-{ns}-{hexes}-1to0-mboxes": True,
        f"ringcomm-{alive}-{ns}-{hexes}-0to1": True,  # owner alive
        f"ringcomm-{dead}-{ns}1-{hexes}-0to1": True,  # another pid namespace
        f"ringcomm-{dead}-{ns}-{hexes}-0to1.bak": True,  # not our pattern
        f"ringcomm-{dead}-{hexes}-0to1": True,  # no namespace: not ours
        f"ringcomm-test-{hexes}": True,
        f"torch_{dead}_{hexes}": True,
    }
    folders = {
        f"{dead}-{ns}-ab_c1234": False,
        f"{alive}-{ns}-ab_c1234": True,
        f"{dead}-{ns}1-ab_c1234": True,
        f"{dead}-{ns}-AB": True,  # not what mkdtemp makes
        f"x{dead}-{ns}-abc": True,
    }
    shm, base = tmp_path / "shm", tmp_path / "base"
    shm.mkdir()
    base.mkdir()
    for name in rings:
        (shm / name).touch()
        (shm / f"{name}-dir").mkdir()  # not a file: kept whatever its name
    for name in folders:
        (base / name).mkdir()
        (base / name / "0").touch()
        (base / f"{name}0").touch()  # not a folder: kept whatever its name

    assert sorted(shm_ring.sweep(str(shm))) == sorted(n for n, kept in rings.items()
                                                       if not kept)
    assert files.sweep_ipc_dirs(str(base)) == [str(base / n) for n, kept
                                                      in folders.items() if not kept]
    assert sorted(os.listdir(shm)) == sorted(
        [n for n, kept in rings.items() if kept] + [f"{n}-dir" for n in rings])
    assert sorted(os.listdir(base)) == sorted(
        [n for n, kept in folders.items() if kept] + [f"{n}0" for n in folders])


def test_the_sweep_leaves_a_base_folder_that_is_not_this_users_own(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / f"{_dead_pid()}-{shm_ring.owner_tag().split('-')[1]}-abc").mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    assert files.sweep_ipc_dirs(str(link)) == []
    assert len(os.listdir(real)) == 1


def test_owners_alive_zombie_and_gone():
    ns = shm_ring.owner_tag().split("-")[1]
    assert not shm_ring.owner_gone(os.getpid(), ns)
    assert not shm_ring.owner_gone(1, ns)  # init: alive (PermissionError if not root)
    assert not shm_ring.owner_gone(0, ns) and not shm_ring.owner_gone(1 << 40, ns)
    assert shm_ring.owner_gone(_dead_pid(), ns)
    assert not shm_ring.owner_gone(_dead_pid(), ns + "1")
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert not shm_ring.owner_gone(p.pid, ns)
        p.kill()
        for _ in range(100):  # killed, not reaped yet: a zombie, whose files are litter
            if shm_ring.owner_gone(p.pid, ns):
                break
            time.sleep(0.01)
        assert shm_ring.owner_gone(p.pid, ns)
    finally:
        p.kill()
        p.wait()


_FORK = """
import os, sys
from ringcomm.transport.files import TransportFiles
files = TransportFiles()
files.ipc_dir = sys.argv[1]
os.makedirs(files.ipc_dir)
if os.fork() == 0:  # the child runs the parent's finalizer, as its atexit would
    files.remove()
    os._exit(0)
os.wait()
kept = os.path.isdir(files.ipc_dir)
files.remove()
print(kept, os.path.exists(files.ipc_dir))
"""


@pytest.mark.timeout(30)
def test_a_forked_child_that_exits_leaves_its_parents_files_alone(tmp_path):
    folder = str(tmp_path / "ipc")
    out = subprocess.run([sys.executable, "-c", _FORK, folder], capture_output=True, text=True,
                         timeout=20)
    assert out.stdout.split() == ["True", "False"], out


@pytest.mark.timeout(30)
def test_a_transport_whose_set_up_fails_closes_without_hanging():
    """Binding to an address this host does not have fails half-way through the set-up;
    the error must come back, not a close() that waits forever for the half-made socket."""

    with StoreServer("127.0.0.1", 0) as server:
        store = StoreClient(server.address, timeout=5)
        try:
            with pytest.raises(Exception) as info:  # zmq's error: the address is not ours
                GroupTransport(0, 2, store, hosts=["a", "b"], host="198.51.100.7", timeout=3)
            assert "198.51.100.7" in str(info.value) or "ssign" in str(info.value), info.value
        finally:
            store.close()
