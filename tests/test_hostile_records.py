"""Nothing read from the store names a file: what a rank does with a link record that someone
other than a rank of its group wrote (whoever answers on the store's port without a token, or
rewrites a key of an unauthenticated store), and with names planted in ``/dev/shm``.

The hostile records are written into a real store by the test, which plays the stranger:
rank 0 is whatever the stranger wrote, rank 1 a real ``GroupTransport`` that reads it. Each
record points somewhere a stranger would like rank 1 to write or map (a file outside the
ringcomm folder, a symbolic link, a FIFO of another user, ``../`` in a shared-memory name);
rank 1 must refuse it with a ``RecordError`` naming the rank and the field, and leave the
target as it was. Also: a rank 0 told to serve the store refuses one it did not start, and
says so when it joins one; closing ranks leave ``/dev/shm`` names they did not make.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import stat
import tempfile
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mp_helpers import free_port, transport_pair

import ringcomm
from ringcomm import PeerLostError, RecordError, StoreError
from ringcomm.bootstrap.store import StoreClient, StoreServer
from ringcomm.transport import files, shm_ring
from ringcomm.transport.board import size as board_size
from ringcomm.transport.group import RECORD_VERSION, GroupTransport
from ringcomm.transport.header import Header, OpKind
from ringcomm.transport.peer_names import Check

pytestmark = pytest.mark.skipif(not shm_ring.available(), reason="needs /dev/shm")

SECRET = b"root's secret, not to be overwritten\n"
QUICK_S = 2.0  # a refusal comes at once: well inside rank 1's timeout
OTHER_UID = 54321


@pytest.fixture
def victim(tmp_path):
    """A folder outside the ringcomm folder holding what a stranger would have rank 1 write
    (``pipe-from-1``, a regular 0600 file) and map (``shm``)."""
    folder = tmp_path / "victim"
    folder.mkdir()
    for name in ("pipe-from-1", "board-bell", "shm"):
        (folder / name).write_bytes(SECRET)
        os.chmod(folder / name, 0o600)
    return folder


def untouched(path) -> bool:
    with open(path, "rb") as f:
        return f.read() == SECRET


class Lookalike(str):
    """The path of a folder of this user's ringcomm folder named as ranks name theirs (so
    every check of its name and of the folder passes), with rank 0's pipe to rank 1 and its
    doorbell in it as FIFOs whose reading ends (``ends``) are open."""

    ends: dict[str, int]


@pytest.fixture
def lookalike():
    base = files.private_folder(files.ipc_base())
    folder = Lookalike(tempfile.mkdtemp(prefix=f"{shm_ring.owner_tag()}-", dir=base))
    folder.ends = {}
    for name in ("pipe-from-1", "board-bell"):
        os.mkfifo(os.path.join(folder, name), 0o600)
        folder.ends[name] = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NONBLOCK)
    yield folder
    for fd in folder.ends.values():
        os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)


def a_writer_came(fd: int) -> bool:
    """Whether anyone opened the FIFO whose reading end is ``fd`` for writing (and closed it)
    since ``fd`` was opened: Linux reports a hang-up to a FIFO's reader only once a writer
    has come."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


def record(folder: str, token: str, **changes) -> dict:
    """Rank 0's record as a rank of this ringcomm writes it, with ``changes`` made (a key
    path such as ``"kinds.local.dir"`` to a new value)."""
    rec = {"record": RECORD_VERSION, "control": [f"ipc://{folder}/0"],
           "kinds": {"local": {"token": token, "ring_bytes": 8 << 20, "dir": folder},
                     "socket": {"endpoints": {"1": f"ipc://{folder}/1"}}},
           "board": {"name": f"ringcomm-{token}-board"}}
    for where, value in changes.items():
        *path, last = where.split(".")
        at = rec
        for key in path:
            at = at[key]
        at[last] = value
    return rec


def rank_1_reads(rec: dict, keys: dict[str, bytes] | None = None) -> RecordError:
    """Publish ``rec`` as rank 0's record in a real store (and ``keys``, as rank 0 would
    later in its set-up), set up rank 1 there, and return the ``RecordError`` it raises
    (within ``QUICK_S``); rank 1 must have left no folder behind."""
    before = set(os.listdir(files.ipc_base()))
    with StoreServer("127.0.0.1", 0) as server, \
            StoreClient(server.address, timeout=10) as stranger, \
            StoreClient(server.address, timeout=10) as store:
        stranger.set("links/record/0", json.dumps(rec).encode())
        for key, value in (keys or {}).items():
            stranger.set(key, value)
        started = time.monotonic()
        with pytest.raises(RecordError) as info:
            GroupTransport(1, 2, store, hosts=["h", "h"], timeout=3)
        assert time.monotonic() - started < QUICK_S
    err = info.value
    assert (err.rank, err.peer) == (1, 0), err
    assert "rank 0's link record" in str(err), err
    assert set(os.listdir(files.ipc_base())) <= before
    return err


# --------------------------------------------------------------------------- forms


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field,value", [
    ("kinds.local.dir", "VICTIM"),                            # outside the ringcomm folder
    ("kinds.local.dir", "BASE/../../VICTIM"),                  # ``..`` out of it
    ("kinds.local.dir", "BASE/FOLDER/../FOLDER"),              # not written as ringcomm does
    ("kinds.local.dir", "relative/folder"),
    ("kinds.local.dir", 7),
    ("kinds.local.token", "../../../VICTIM"),
    ("kinds.local.token", "1-abc-0123456789ab/x"),
    ("kinds.local.ring_bytes", -1),
    ("kinds.local.ring_bytes", "8388608"),
    ("kinds.local.ring_bytes", True),
    ("board.name", "../../VICTIM/shm"),
    ("board.name", "ringcomm-TOKEN-board/../../VICTIM"),
    ("board.name", "ringcomm-1-abc-0123456789ab-board"),       # a form, of another token
    ("control", ["ipc://VICTIM/0"]),
    ("control", ["ipc:///run/some.sock"]),
    ("control", ["tcp://127.0.0.1:80; rm -rf"]),
    ("control", "ipc://BASE/FOLDER/0"),
    ("kinds.socket.endpoints", {"1": "ipc://VICTIM/1"}),
    ("kinds.socket.endpoints", {"1": "ipc://BASE/FOLDER/../../1"}),
    ("kinds.socket.endpoints", {}),
    ("kinds", []),
])
def test_a_record_naming_anything_ringcomm_never_names_is_refused_before_anything_opens(
        victim, lookalike, field, value):
    token = shm_ring.new_token()
    base = files.ipc_base()

    def fill(v):
        if isinstance(v, str):
            return (v.replace("VICTIM", str(victim)).replace("BASE", base)
                    .replace("FOLDER", os.path.basename(lookalike)).replace("TOKEN", token))
        if isinstance(v, list):
            return [fill(x) for x in v]
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        return v

    err = rank_1_reads(record(lookalike, token, **{field: fill(value)}))
    assert field in str(err), err
    assert all(untouched(victim / name) for name in os.listdir(victim))
    # nothing it names was opened: the pipe's reader never saw a writer come
    assert not a_writer_came(lookalike.ends["pipe-from-1"])


# a record's names, mostly near the forms ringcomm makes: pieces of them joined at random
_PIECES = st.sampled_from(["/", "..", ".", "//", "ringcomm-", str(os.getuid()), "-", "0",
                           "12", "ab", "board", "to", "mbox", "ipc://", "tcp://", ":",
                           files.ipc_base(), shm_ring.SHM_DIR, "\0", "x"])
_TOKEN = shm_ring.new_token()
_FOLDER = os.path.join(files.ipc_base(), f"{shm_ring.owner_tag()}-made_up1")
_VALID = [_FOLDER, f"ipc://{_FOLDER}/0", "tcp://127.0.0.1:5555", f"ringcomm-{_TOKEN}-board",
          shm_ring.ring_name(_TOKEN, 0, 1), f"{shm_ring.ring_name(_TOKEN, 2, 0)}-mbox"]


@st.composite
def _mutated(draw) -> str:
    """One of the names ringcomm makes, with up to three pieces cut out or put in."""
    name = draw(st.sampled_from(_VALID))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(name)))
        cut = draw(st.integers(0, 3))
        name = name[:at] + draw(st.one_of(_PIECES, st.text(max_size=3))) + name[at + cut:]
    return name


_NAMES = st.one_of(_mutated(), st.lists(_PIECES, max_size=12).map("".join),
                   st.text(max_size=40))


@settings(max_examples=150, deadline=None)
@given(value=st.one_of(_NAMES, st.integers(), st.none(), st.lists(_NAMES, max_size=3)))
def test_whatever_a_record_holds_a_checked_name_stays_in_ringcomm_s_own_places(value):
    """A name passes only in a form ringcomm makes; what passes stays in ringcomm's own
    places, whatever else the record holds (hypothesis)."""
    check = Check(1, 0)
    try:
        folder = check.folder("f", value)
    except RecordError:
        pass
    else:
        parent, name = os.path.split(folder)
        assert os.path.normpath(folder) == folder and ".." not in folder.split("/")
        assert os.path.basename(parent) == f"ringcomm-{os.getuid()}" and "/" not in name
    try:
        path = shm_ring.shm_path(value)
    except ValueError:
        pass
    else:
        assert os.path.dirname(path) == shm_ring.SHM_DIR
        assert os.path.realpath(path) == path or os.path.islink(shm_ring.SHM_DIR)
    try:
        endpoint = check.endpoint("f", value)
    except RecordError:
        pass
    else:
        assert endpoint.startswith(("ipc://", "tcp://")) and "\0" not in endpoint
        if endpoint.startswith("ipc://"):
            assert check.folder("f", os.path.dirname(endpoint[len("ipc://"):]))
    try:
        check.size("f", value)
    except RecordError:
        pass
    else:
        assert type(value) is int and value > 0


# --------------------------------------------------------------------------- on disk


@pytest.mark.timeout(30)
def test_a_symlinked_folder_is_refused(victim, lookalike):
    token = shm_ring.new_token()
    link = os.path.join(files.ipc_base(), f"{shm_ring.owner_tag()}-planted_link")
    os.symlink(victim, link)
    try:
        err = rank_1_reads(record(link, token, **{"control": [f"ipc://{lookalike}/0"],
                                                  "kinds.socket.endpoints": {
                                                      "1": f"ipc://{lookalike}/1"}}))
    finally:
        os.unlink(link)
    assert "kinds.local.dir" in str(err) and "symbolic link" in str(err), err
    assert all(untouched(victim / name) for name in os.listdir(victim))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [0o755, 0o770])
def test_a_folder_others_may_enter_is_refused(lookalike, mode):
    os.chmod(lookalike, mode)
    err = rank_1_reads(record(lookalike, shm_ring.new_token()))
    assert "control" in str(err) and f"mode {mode:o}" in str(err), err


@pytest.mark.timeout(30)
@pytest.mark.skipif(os.getuid() != 0, reason="making a folder of another user needs root")
def test_a_folder_of_another_user_is_refused(lookalike):
    os.chown(lookalike, OTHER_UID, OTHER_UID)
    err = rank_1_reads(record(lookalike, shm_ring.new_token()))
    assert f"owned by uid {OTHER_UID}" in str(err), err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["symlink", "file", "folder", "other user's fifo"])
@pytest.mark.parametrize("name", ["pipe-from-1", "board-bell"])
def test_a_pipe_that_is_not_a_fifo_of_this_user_is_neither_followed_nor_written(
        victim, lookalike, what, name):
    if what == "other user's fifo" and os.getuid() != 0:
        pytest.skip("making a FIFO of another user needs root")
    token = shm_ring.new_token()
    path = os.path.join(lookalike, name)
    os.unlink(path)  # its reading end stays open: nothing can tell that from the name
    reader = None
    if what == "symlink":
        os.symlink(victim / name, path)
    elif what == "file":
        shutil.copy(victim / name, path)
    elif what == "folder":
        os.mkdir(path, 0o700)
    else:
        os.mkfifo(path, 0o600)
        os.chown(path, OTHER_UID, OTHER_UID)
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    # the doorbell is opened last, once rank 0 has said its pipes are open and the board
    # (which the stranger made too) is mapped
    board = shm_ring.map_shared(shm_ring.shm_path(f"ringcomm-{token}-board"),
                                board_size(2), create=True)
    try:
        err = rank_1_reads(record(lookalike, token), keys={"links/pipes/0": b"open",
                                                          "links/board/0": b"1"})
    finally:
        board.close()
        os.unlink(shm_ring.shm_path(f"ringcomm-{token}-board"))
        if reader is not None:
            came = a_writer_came(reader)
            os.close(reader)
    assert "kinds.local.dir" in str(err) and name in str(err), err
    assert all(untouched(victim / n) for n in os.listdir(victim))
    if what == "file":
        assert untouched(path)
    if reader is not None:
        assert not came


# --------------------------------------------------------------------------- shared memory


@pytest.mark.timeout(30)
def test_shared_memory_is_opened_only_under_a_checked_name(tmp_path):
    outside = tmp_path / "shm"
    outside.write_bytes(SECRET)
    for name in ("../../" + str(outside), "ringcomm-x/../../etc", "ringcomm-1-abc-board"):
        with pytest.raises(ValueError, match="not a name ringcomm makes"):
            shm_ring.shm_path(name)
        with pytest.raises(ValueError):
            shm_ring.RingReader(name, 4096)
    assert untouched(outside)


@pytest.mark.timeout(30)
def test_a_planted_symlink_or_misfit_in_dev_shm_is_not_mapped(tmp_path):
    outside = tmp_path / "target"
    outside.write_bytes(SECRET + bytes(4096 + 64 - len(SECRET)))
    name = shm_ring.ring_name(shm_ring.new_token(), 0, 1)
    path = shm_ring.shm_path(name)
    os.symlink(outside, path)
    try:
        with pytest.raises(OSError):
            shm_ring.RingReader(name, 4096)
    finally:
        os.unlink(path)
    assert outside.read_bytes()[:len(SECRET)] == SECRET
    made = shm_ring.RingWriter(name, 8192)  # the right owner and mode, another size
    try:
        with pytest.raises(PermissionError, match="size"):
            shm_ring.RingReader(name, 4096)
    finally:
        made.close()


# --------------------------------------------------------------------------- what close removes


@pytest.mark.timeout(30)
def test_a_writer_leaves_a_name_planted_after_its_reader_removed_its_own():
    name = shm_ring.ring_name(shm_ring.new_token(), 0, 1)
    writer = shm_ring.RingWriter(name, 4096)
    reader = shm_ring.RingReader(name, 4096)  # maps it and removes the name
    assert not os.path.exists(writer.path)
    with open(writer.path, "xb") as planted:  # the name, taken by someone else since
        planted.write(SECRET)
    try:
        writer.close()
        reader.close()
        assert untouched(writer.path)
    finally:
        os.unlink(writer.path)


def _names_of(transport) -> list[str]:
    return list(transport.setup.files.shm_paths)


@pytest.mark.timeout(30)
@pytest.mark.skipif(os.getuid() != 0, reason="planting a file of another user needs root")
def test_closing_ranks_leave_dev_shm_names_of_another_user():
    """Ranks 0 and 1 set up and close without a large message: none of the rings (or
    mailboxes) their names were kept for was made. A stranger planted files of its own under
    those names (it read them from the store); closing must leave them, as a rank that is
    not root could not remove them anyway."""
    a, b = transport_pair()
    planted = sorted(set(_names_of(a) + _names_of(b)))
    assert planted
    try:
        for path in planted:
            with open(path, "xb") as f:
                f.write(SECRET)
            os.chown(path, OTHER_UID, OTHER_UID)
        a.close()
        b.close()
        assert [p for p in planted if not (os.path.exists(p) and untouched(p))] == []
    finally:
        a.close()
        b.close()
        for path in planted:
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.timeout(30)
def test_closing_ranks_leave_a_name_that_replaced_a_ring_they_made():
    a, b = transport_pair()
    ring = None
    try:
        x = np.arange(1 << 18, dtype=np.uint8)  # through the shared-memory ring
        header = Header(0, x.nbytes, x.size, 1 << 20, 0, 0, 0, OpKind.ALLREDUCE, 0, 0, 0)
        a.send(1, header, x, "allreduce #0")
        got = b.recv(0, header, time.monotonic() + 10, "allreduce #0")
        assert np.array_equal(np.frombuffer(bytes(got), np.uint8), x)
        b.release(0)
        ring = a.links[1].ring_out.path
        assert not os.path.exists(ring)  # mapped by rank 1, so its name went
        with open(ring, "xb") as f:  # the same name, another file of this user's since
            f.write(SECRET)
        a.close()
        b.close()
        assert untouched(ring)
    finally:
        a.close()
        b.close()
        if ring is not None and os.path.exists(ring):
            os.unlink(ring)


# --------------------------------------------------------------------------- the store


@pytest.fixture
def squatter():
    """A store that rank 0 did not start, answering on a port of its own."""
    server = StoreServer("127.0.0.1", free_port())
    yield server
    server.close()


@pytest.mark.timeout(30)
def test_rank_0_says_when_it_joins_a_store_it_did_not_start(squatter, caplog, monkeypatch):
    monkeypatch.delenv("RINGCOMM_STORE", raising=False)
    with caplog.at_level(logging.WARNING, logger="ringcomm"), \
            ringcomm.init(rank=0, world_size=1, store=squatter.address, timeout=10) as comm:
        comm.barrier()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("did not start" in line and squatter.address in line
               and "RINGCOMM_STORE=serve" in line for line in said), said


@pytest.mark.timeout(30)
def test_rank_0_told_to_serve_refuses_a_store_it_did_not_start(squatter, monkeypatch):
    monkeypatch.setenv("RINGCOMM_STORE", "serve")
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"RINGCOMM_STORE=serve.*did not start"):
        ringcomm.init(rank=0, world_size=1, store=squatter.address, timeout=10)
    assert time.monotonic() - started < QUICK_S
    with StoreClient(squatter.address, timeout=2) as peek:  # nothing was written there
        assert peek.num_keys() == 0


@pytest.mark.timeout(30)
def test_rank_0_told_to_serve_serves(monkeypatch):
    monkeypatch.setenv("RINGCOMM_STORE", "serve")
    with ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}",
                       timeout=10) as comm:
        comm.barrier()


@pytest.mark.timeout(30)
def test_rank_0_told_to_join_joins_quietly(squatter, caplog, monkeypatch):
    monkeypatch.setenv("RINGCOMM_STORE", "join")
    with caplog.at_level(logging.WARNING, logger="ringcomm"), \
            ringcomm.init(rank=0, world_size=1, store=squatter.address, timeout=10) as comm:
        comm.barrier()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.timeout(30)
def test_an_unknown_store_role_is_an_argument_error(monkeypatch):
    monkeypatch.setenv("RINGCOMM_STORE", "maybe")
    with pytest.raises(ringcomm.ArgumentError, match="RINGCOMM_STORE='maybe' is not one of"):
        ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}", timeout=5)


def test_the_symlinked_ringcomm_folder_is_called_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "ringcomm-link"
    link.symlink_to(real)
    with pytest.raises(ringcomm.ArgumentError, match="is a symbolic link"):
        files.private_folder(str(link))
    assert stat.S_ISLNK(os.lstat(link).st_mode)  # refused, not replaced


@pytest.mark.timeout(30)
def test_a_peer_whose_folder_is_gone_is_a_peer_that_left_not_a_stranger(lookalike):
    """A rank removes its folder as it fails: its peers, reading its record afterwards, say
    it left the set-up (``PeerLostError``), not that a stranger wrote the record."""
    rec = record(str(lookalike), shm_ring.new_token())
    shutil.rmtree(lookalike)
    with StoreServer("127.0.0.1", 0) as server, \
            StoreClient(server.address, timeout=10) as writer, \
            StoreClient(server.address, timeout=10) as store:
        writer.set("links/record/0", json.dumps(rec).encode())
        with pytest.raises(PeerLostError) as info:
            GroupTransport(1, 2, store, hosts=["h", "h"], timeout=3)
    err = info.value
    assert (err.rank, err.peer) == (1, 0), err
    assert "left the set-up" in str(err) and "stranger" not in str(err), err


@pytest.mark.timeout(30)
def test_a_folder_under_no_ringcomm_folder_is_refused_as_a_record_no_rank_writes(lookalike):
    """A rank's own folder goes as it fails, but the user's ringcomm-<uid> folder above it
    stays: a record naming one that does not exist is a stranger's (RecordError)."""
    parent = os.path.basename(os.path.dirname(lookalike))
    folder = f"/nonexistent-{os.getpid()}/{parent}/{os.path.basename(lookalike)}"
    err = rank_1_reads(record(folder, shm_ring.new_token()))
    assert "does not exist" in str(err), err
