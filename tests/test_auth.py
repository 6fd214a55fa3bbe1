"""A locked door: ``RINGCOMM_AUTH_TOKEN`` on the store and on rank links (CURVE keys from the
token, a ZAP handler that admits only the token's client key), loopback-only listening on
one host, and same-host files that are this user's alone.

Multi-process tests run real ranks (``tests/auth_rank.py``) over ``RINGCOMM_TRANSPORT=tcp``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from mp_helpers import free_port
from zmq.utils.monitor import parse_monitor_message

from ringcomm import ArgumentError, AuthError
from ringcomm.bootstrap.store import StoreClient, StoreServer
from ringcomm.transport import auth, files, shm_ring
from ringcomm.transport.group import GroupTransport

HOST = "127.0.0.1"
RANK_SCRIPT = str(Path(__file__).with_name("auth_rank.py"))
TOKEN = "correct horse battery staple, 0f3c9a"
QUICK_S = 5.0  # a refusal must come this fast, with a 60 s timeout


def start_ranks(world: int, store: str, tokens: list[str | None], *, plain_store: bool = False,
                pause: bool = False, rounds: int = 3) -> list[subprocess.Popen]:
    env = {**os.environ, "RINGCOMM_TRANSPORT": "tcp"}
    env.pop("RINGCOMM_AUTH_TOKEN", None)
    procs = []
    for rank in range(world):
        cmd = [sys.executable, RANK_SCRIPT, str(rank), str(world), store, "--rounds",
               str(rounds)]
        if tokens[rank] is not None:
            cmd += ["--token", str(tokens[rank])]
        cmd += ["--plain-store"] * plain_store + ["--pause"] * pause
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    return procs


def read_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The next JSON line a rank prints, within ``timeout`` s."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got or not got[0]:
        proc.kill()
        raise AssertionError(f"no line from a rank within {timeout} s; stderr: "
                             f"{proc.stderr.read()[-3000:]}")
    return json.loads(got[0])


def finish(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()


def handshake(endpoint: str, keys: auth.Keys | None, sock_type: int = zmq.PUSH) -> str:
    """Connect one ZeroMQ socket to ``endpoint`` and say how its handshake ended."""
    ctx = zmq.Context()
    sock = ctx.socket(sock_type)
    sock.linger = 0
    if keys is not None:
        keys.dial(sock)
    monitor = sock.get_monitor_socket(auth.HANDSHAKE_EVENTS)
    sock.connect(endpoint)
    try:
        if not monitor.poll(5000):
            return "nothing"
        event = parse_monitor_message(monitor.recv_multipart())
        return "ok" if event["event"] == auth.HANDSHAKE_SUCCEEDED else "refused"
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
        ctx.term()


# --------------------------------------------------------------------------- keys


def test_keys_come_from_the_token_alone_and_differ_between_tokens():
    a, again, b = auth.keys_for(TOKEN), auth._derive.__wrapped__(TOKEN), auth.keys_for("other")
    assert a == again  # every process derives the same keys
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert TOKEN not in repr(a) and a.server_secret.decode() not in repr(a)
    assert auth.keys_for(None) is None and auth.keys_for("") is None


# --------------------------------------------------------------------------- the store


@pytest.mark.timeout(30)
def test_a_curve_server_whose_gatekeeper_is_gone_refuses_even_the_right_key():
    """Fail closed: with no ZAP handler in its context, a server admits nobody (libzmq's
    default would admit any client that knows the server's public key)."""
    keys = auth.keys_for(TOKEN)
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        keys.serve(pull)
        port = pull.bind_to_random_port(f"tcp://{HOST}")
        push = ctx.socket(zmq.PUSH)
        keys.dial(push)
        push.connect(f"tcp://{HOST}:{port}")
        push.send(b"let me in")
        assert not pull.poll(1000)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_token", ["wrong token", ""], ids=["wrong", "missing"])
def test_store_refuses_a_client_without_its_token_quickly_and_stores_nothing(
        client_token, caplog):
    caplog.set_level(logging.WARNING, logger="ringcomm")
    with StoreServer(HOST, 0, auth_token=TOKEN) as server:
        stranger = StoreClient(server.address, timeout=60, auth_token=client_token)
        started = time.monotonic()
        with pytest.raises(AuthError, match="refused this client during set 'k'.*"
                           "RINGCOMM_AUTH_TOKEN.*this client holds"):
            stranger.set("k", b"from a stranger")
        assert time.monotonic() - started < QUICK_S
        stranger.close()
        with StoreClient(server.address, timeout=10, auth_token=TOKEN) as friend:
            assert friend.num_keys() == 0  # the stranger stored nothing
            friend.set("k", b"v")
            assert friend.get("k") == b"v"
    assert "refused a connection" in caplog.text  # the server said why


@pytest.mark.timeout(60)
def test_a_store_without_a_token_refuses_a_client_with_one():
    with StoreServer(HOST, 0, auth_token="") as server, \
            StoreClient(server.address, timeout=60, auth_token=TOKEN) as client, \
            pytest.raises(AuthError, match="refused this client during ping.*this client holds "
                          "a token"):
        client.ping()


@pytest.mark.timeout(60)
def test_the_stand_alone_store_takes_its_token_from_the_environment():
    port = free_port()
    env = {**os.environ, "RINGCOMM_AUTH_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "ringcomm.bootstrap.store", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert f"serving on {HOST}:{port}" in line and "must hold" in line, line
        assert TOKEN not in line
        with StoreClient(f"{HOST}:{port}", timeout=10, auth_token=TOKEN) as friend:
            friend.set("k", b"v")
        with StoreClient(f"{HOST}:{port}", timeout=60, auth_token="nope") as stranger, \
                pytest.raises(AuthError):
            stranger.get("k")
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


# --------------------------------------------------------------------------- rank links


@pytest.mark.timeout(90)
def test_ranks_with_the_token_link_over_curve_and_strangers_cannot_connect():
    port = free_port()
    procs = start_ranks(3, f"{HOST}:{port}", [TOKEN] * 3, pause=True)
    try:
        ready = [read_line(p, 60) for p in procs]
        assert all("listening" in r for r in ready), ready
        assert all("tcp://" in r["describe"] for r in ready), ready
        endpoints = [e for r in ready for e in r["listening"]]
        assert endpoints and all(e.startswith(f"tcp://{HOST}:") for e in endpoints)
        keys = auth.keys_for(TOKEN)
        wrong = auth.keys_for("not the token")
        for endpoint in endpoints:  # every listening socket: links and control plane
            assert handshake(endpoint, None) == "refused"
            assert handshake(endpoint, wrong) == "refused"
        # the server's key but another client key: only the ZAP handler can tell
        impostor = auth.Keys(keys.server_public, keys.server_secret, wrong.client_public,
                             wrong.client_secret)
        assert handshake(endpoints[0], impostor) == "refused"
        assert handshake(f"tcp://{HOST}:{port}", None, zmq.DEALER) == "refused"  # the store
        assert handshake(endpoints[0], keys) == "ok"  # the token's own key gets through
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        assert [read_line(p, 60) for p in procs] == [{"ok": 3}] * 3
    finally:
        finish(procs)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tokens", [[TOKEN, "another token"], [TOKEN, None]],
                         ids=["wrong", "missing"])
def test_a_rank_with_another_token_or_none_is_refused_quickly_by_its_peers(tokens):
    # the store takes no token here, so that only the rank links can tell
    with StoreServer(HOST, 0, auth_token="") as server:
        procs = start_ranks(2, server.address, tokens, plain_store=True)
        try:
            results = [read_line(p, 60) for p in procs]
        finally:
            finish(procs)
    for rank, result in enumerate(results):
        assert result.get("error") == "AuthError", (rank, results)
        assert result["seconds"] < QUICK_S, results
        assert "RINGCOMM_AUTH_TOKEN" in result["message"], results


@pytest.mark.timeout(90)
def test_a_rank_with_another_token_is_refused_by_the_store_it_hosts():
    port = free_port()
    procs = start_ranks(2, f"{HOST}:{port}", [TOKEN, "another token"])
    try:
        stranger = read_line(procs[1], 60)
        assert stranger["error"] == "AuthError" and stranger["seconds"] < QUICK_S, stranger
        assert "the store at" in stranger["message"]
    finally:
        for p in procs:
            p.kill()
        finish(procs)


# --------------------------------------------------------------------------- the token stays secret


@pytest.mark.timeout(60)
def test_the_token_is_never_published_logged_or_shown(capfd):
    env = {**os.environ, "RINGCOMM_AUTH_TOKEN": TOKEN, "RINGCOMM_DEBUG": "INFO"}
    shown = subprocess.run([sys.executable, "-m", "ringcomm", "env"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert "RINGCOMM_AUTH_TOKEN = set (not shown)" in shown.stdout, shown.stdout
    assert TOKEN not in shown.stdout + shown.stderr
    with StoreServer(HOST, 0, auth_token=TOKEN) as server:
        procs = start_ranks(2, server.address, [TOKEN] * 2)
        try:
            assert [read_line(p, 60) for p in procs][0]["listening"]
            assert [read_line(p, 60) for p in procs] == [{"ok": 3}] * 2
        finally:
            finish(procs)
            logs = "".join(p.stderr.read() if not p.stderr.closed else "" for p in procs)
        values = b"".join(server._data.values()) + b"".join(server._data)
    assert values and TOKEN.encode() not in values
    assert TOKEN not in logs


@pytest.mark.timeout(60)
def test_a_transport_with_a_token_leaves_no_thread_or_socket_behind():
    before = {t.name for t in threading.enumerate()}
    group = _group(2, ["h0", "h1"], HOST, token=TOKEN)
    assert any(t.name == "ringcomm-zap" for t in threading.enumerate())
    for t in group:
        t.close()
    assert not [t for t in threading.enumerate() if t.name == "ringcomm-zap"]
    assert {t.name for t in threading.enumerate()} <= before


# --------------------------------------------------------------------------- loopback


def _an_address_of_this_host() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 9))
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def _group(world: int, hosts: list[str], host: str, mode: str = "tcp",
           token: str = "") -> list[GroupTransport]:
    made: list = [None] * world
    with StoreServer(HOST, 0, auth_token="") as server:
        def make(rank: int) -> None:
            with StoreClient(server.address, timeout=20, auth_token="") as client:
                made[rank] = GroupTransport(rank, world, client, hosts=hosts, host=host,
                                            mode=mode, timeout=20, auth_token=token)
        threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert all(made), made
    return made


@pytest.mark.timeout(60)
def test_ranks_that_share_one_host_listen_on_loopback_only():
    address = _an_address_of_this_host()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    group = _group(2, ["h", "h"], address)
    try:
        listening = [e for t in group for e in t.listening()]
        assert listening and all(e.startswith("tcp://127.0.0.1:") for e in listening)
    finally:
        for t in group:
            t.close()
    apart = _group(2, ["h0", "h1"], address)  # hosts apart: the given address
    try:
        listening = [e for t in apart for e in t.listening()]
        assert listening and all(e.startswith(f"tcp://{address}:") for e in listening)
    finally:
        for t in apart:
            t.close()


def test_a_store_listens_on_loopback_unless_told_otherwise():
    with StoreServer() as server:
        assert server.host == HOST


# --------------------------------------------------------------------------- same-host files


@pytest.mark.timeout(60)
@pytest.mark.skipif(not shm_ring.available(), reason="needs /dev/shm")
def test_same_host_folders_are_0700_and_their_files_0600():
    """Seen while rank 0 waits in its set-up for rank 1 (the folder goes once both have
    opened what is in it)."""
    base = files.ipc_base()
    ours = f"{os.getpid()}-"
    before = {n for n in os.listdir(base) if n.startswith(ours)}
    made: list = [None, None]
    with StoreServer(HOST, 0, auth_token="") as server:
        def make(rank: int) -> None:
            with StoreClient(server.address, timeout=20, auth_token="") as client:
                made[rank] = GroupTransport(rank, 2, client, hosts=["h", "h"], host=HOST,
                                            mode="ipc", timeout=20, auth_token="")
        first = threading.Thread(target=make, args=(0,))
        first.start()
        deadline = time.monotonic() + 20
        folder = None
        while folder is None or not os.listdir(folder):  # its control socket, bound
            assert time.monotonic() < deadline, "rank 0 made no folder"
            time.sleep(0.01)
            new = [n for n in os.listdir(base) if n.startswith(ours) and n not in before]
            folder = os.path.join(base, new[0]) if new else None
        assert stat.S_IMODE(os.lstat(base).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
        for entry in os.scandir(folder):
            info = entry.stat(follow_symlinks=False)
            assert stat.S_IMODE(info.st_mode) == 0o600, (entry.path, oct(info.st_mode))
            assert info.st_uid == os.getuid()
        second = threading.Thread(target=make, args=(1,))
        second.start()
        for t in (first, second):
            t.join(30)
    try:
        assert all(made), made
        assert not os.path.exists(folder)  # gone once both are set up
    finally:
        for t in made:
            if t is not None:
                t.close()


def test_a_folder_of_another_user_or_a_link_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    assert files.private_folder(str(loose)) == str(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700  # tightened
    link = tmp_path / "link"
    link.symlink_to(loose)
    with pytest.raises(ArgumentError, match="not a folder"):
        files.private_folder(str(link))
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 12345, 12345)
        with pytest.raises(ArgumentError, match="owned by uid 12345"):
            files.private_folder(str(theirs))


@pytest.mark.skipif(not shm_ring.available(), reason="needs /dev/shm")
def test_shared_memory_that_others_may_open_is_not_mapped():
    name = shm_ring.ring_name(shm_ring.new_token(), 0, 1)
    path = os.path.join(shm_ring.SHM_DIR, name)
    mine = shm_ring.map_shared(path, 4096, create=True)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        shm_ring.map_shared(path, 4096, create=False).close()  # this user's alone: fine
        os.chmod(path, 0o644)
        with pytest.raises(PermissionError, match="not this user's alone"):
            shm_ring.map_shared(path, 4096, create=False)
    finally:
        mine.close()
        os.unlink(path)


# --------------------------------------------------------------------------- torchrun, the bench


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["same", "differ"])
def test_under_torchrun_the_rank_links_still_authenticate(mode):
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "RINGCOMM_TRANSPORT": "tcp"}
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).with_name("auth_torch_rank.py")), mode],
                          capture_output=True, text=True, timeout=150, env=env)
    # the ranks share torchrun's stdout: each one's JSON object, wherever its line breaks
    results = [json.loads(found) for found in re.findall(r"\{[^{}]*\}", done.stdout)]
    assert len(results) == 2, done.stdout + done.stderr[-3000:]
    if mode == "same":
        assert results == [{"sum_ok": True, "tcp": True}] * 2
    else:
        for result in results:
            assert result["error"] == "AuthError" and result["seconds"] < QUICK_S, results


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_measures_a_curve_link_beside_a_plain_one(tmp_path):
    out = tmp_path / "curve.json"
    env = {**os.environ, "RINGCOMM_TRANSPORT": "tcp"}
    done = subprocess.run([sys.executable, "-m", "ringcomm", "bench", "--backends", "ringcomm",
                           "ringcomm/curve", "--collectives", "allreduce", "-b", "1K", "-e",
                           "1K", "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["backend"] for r in rows} == {"ringcomm", "ringcomm/curve"}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows), rows
