"""Integration tests: real ``meshd`` processes on 127.0.0.1, driven with ``meshctl``.

Every daemon is a child process started through :class:`meshd.testing.localmesh.Daemon`
with its data dir under ``tmp_path``; the ``daemons`` fixture kills whatever is
still running when a test ends, pass or fail.  Conditions that only another
process can see (a peer noticing a death) are polled with ``wait_until`` and a
bound; everything else is a synchronous ``meshctl`` command.  No traffic leaves
loopback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import select
import socket
import stat
import struct
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import trio

import meshd
from meshd.config import CONFIG_FILE
from meshd import Config
from meshd.control import SOCKET_FILE
from meshd.identity import KEY_FILE, Identity, PeerId, load_identity
from meshd.testing.localmesh import Daemon, DaemonError, wait_until
from meshd.rpc.framed import Framed
from meshd.rpc.protocol import ERROR
from meshd.wire import pack

REPO = Path(__file__).resolve().parents[2]
PEER_ID_RE = re.compile(r"\b[a-z2-7]{56}\b")
FAST_IDLE = {"transport": {"idle_timeout": 2.0, "keepalive_interval": 0.5}}


# --- helpers --------------------------------------------------------------------


@pytest.fixture
def daemons(tmp_path):
    """A factory ``make(name, **Daemon kwargs)`` that starts a daemon in tmp_path/name.

    Calling it again with the same name starts a new process on the same data
    dir (same identity).  Teardown SIGKILLs every process it started and prints
    the tail of each log, which pytest shows when the test failed.
    """
    started: list[Daemon] = []

    def make(name: str, **kwargs) -> Daemon:
        daemon = Daemon(tmp_path / name, **kwargs)
        started.append(daemon)
        return daemon.start(timeout=20)

    yield make
    for daemon in started:
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()
    for data_dir in dict.fromkeys(d.data_dir for d in started):
        log = data_dir / "meshd.log"
        if log.exists():
            print(f"--- {log} (last lines)")
            print("\n".join(log.read_text().splitlines()[-15:]))


def meshd_cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.meshd_main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def peer_ids(daemon: Daemon) -> set[str]:
    return {row["peer_id"] for row in daemon.meshctl("peers")}


def call(src: Daemon, dst: Daemon | str, method: str, *arg: str) -> object:
    """``meshctl --json call`` from ``src`` to ``dst``; the parsed reply."""
    target = dst if isinstance(dst, str) else dst.peer_id
    return src.meshctl("call", target, method, *arg, timeout=20)


def assert_calls_both_ways(x: Daemon, y: Daemon) -> None:
    for src, dst in ((x, y), (y, x)):
        token = f"from-{src.data_dir.name}-to-{dst.data_dir.name}"
        assert call(src, dst, "ping", json.dumps(token)) == token
        info = call(src, dst, "identify")
        assert info["peer_id"] == dst.peer_id
        assert info["listen"] == [str(dst.address.hostport)]


def one_line_error(out: subprocess.CompletedProcess) -> str:
    """Assert ``out`` is a failed meshctl run with exactly one stderr line; return it."""
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("meshctl: error: "), lines[0]
    assert "Traceback" not in out.stderr
    return lines[0]


# --- 1: meshd init --------------------------------------------------------------


def test_init_creates_private_key_and_full_config_and_is_idempotent(tmp_path):
    data_dir = tmp_path / "node"
    first = meshd_cli("init", "--data-dir", str(data_dir))
    assert first.returncode == 0, first.stderr
    key_path = data_dir / KEY_FILE
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    ids = PEER_ID_RE.findall(first.stdout)
    assert len(ids) == 1, first.stdout
    peer_id = ids[0]
    assert str(load_identity(data_dir).peer_id) == peer_id

    config_text = (data_dir / CONFIG_FILE).read_text()
    raw = tomllib.loads(config_text)
    sections = {f.name for f in dataclasses.fields(Config)}
    assert set(raw) == sections
    for section in sections:
        assert f"[{section}]" in config_text
    defaults = Config()
    assert raw["transport"]["idle_timeout"] == defaults.transport.idle_timeout
    assert raw["rpc"]["max_frame"] == defaults.rpc.max_frame
    assert raw["peers"]["bootstrap_max_backoff"] == defaults.peers.bootstrap_max_backoff
    assert raw["node"]["listen"] == defaults.node.listen
    Config.load(data_dir)  # what init wrote is accepted as-is

    key_bytes = key_path.read_bytes()
    second = meshd_cli("init", "--data-dir", str(data_dir))
    assert second.returncode == 0, second.stderr
    assert PEER_ID_RE.findall(second.stdout) == [peer_id]
    assert key_path.read_bytes() == key_bytes
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert str(load_identity(data_dir).peer_id) == peer_id


# --- 2: unsafe key mode ---------------------------------------------------------


def test_start_refuses_group_or_world_readable_key(tmp_path):
    data_dir = tmp_path / "node"
    assert meshd_cli("init", "--data-dir", str(data_dir)).returncode == 0
    os.chmod(data_dir / KEY_FILE, 0o644)
    out = meshd_cli("start", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0")
    assert out.returncode != 0
    assert "ready" not in out.stdout
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "chmod 600" in lines[0]
    assert "Traceback" not in out.stderr
    assert not (data_dir / SOCKET_FILE).exists()


# --- 3: a three-node mesh ---------------------------------------------------------


def test_three_daemons_bootstrap_call_ping_and_json(daemons):
    a = daemons("a")
    b = daemons("b", bootstrap=[str(a.address)])
    c = daemons("c", bootstrap=[str(a.address)])
    assert len({a.peer_id, b.peer_id, c.peer_id}) == 3

    wait_until(lambda: peer_ids(a) >= {b.peer_id, c.peer_id}, 10, "A to list B and C")
    rows = {row["peer_id"]: row for row in a.meshctl("peers")}
    for other in (b, c):
        assert rows[other.peer_id]["direction"] == "in"
        assert rows[other.peer_id]["address"] == str(other.address.hostport)
    wait_until(lambda: a.peer_id in peer_ids(b) and a.peer_id in peer_ids(c), 10,
               "B and C to list A")

    # B and C only know A; B dials C explicitly.
    connect = b.meshctl_raw("connect", str(c.address))
    assert connect.returncode == 0, connect.stderr
    assert c.peer_id in connect.stdout
    assert c.peer_id in peer_ids(b)

    for x, y in ((a, b), (a, c), (b, c)):
        assert_calls_both_ways(x, y)

    # The human form of `call` prints the JSON reply.
    human = a.meshctl_raw("call", b.peer_id, "ping", '"x"')
    assert human.returncode == 0, human.stderr
    assert json.loads(human.stdout) == "x"

    # ping: human lines with RTTs, and a JSON summary.
    text = a.meshctl_raw("ping", c.peer_id, "-c", "2")
    assert text.returncode == 0, text.stderr
    assert len(re.findall(r"reply from \S+: \d+\.\d+ ms", text.stdout)) == 2, text.stdout
    assert re.search(r"2 pings: min \d+\.\d+ / median \d+\.\d+ / max \d+\.\d+ ms", text.stdout)
    result = b.meshctl("ping", c.peer_id, "-c", "3")
    assert result["peer_id"] == c.peer_id
    assert len(result["rtt_ms"]) == 3
    assert all(isinstance(v, float) and v > 0 for v in result["rtt_ms"])
    assert result["min_ms"] <= result["median_ms"] <= result["max_ms"]

    # --json on every read-only command parses and says the right thing.
    ident = a.meshctl("id")
    assert ident == {"peer_id": a.peer_id, "address": str(a.address)}
    status = a.meshctl("status")
    assert status["peer_id"] == a.peer_id
    assert status["connections"] == 2
    assert {"ping", "identify"} <= set(status["services"])
    for row in b.meshctl("peers"):
        assert row["rtt_ms"] is None or row["rtt_ms"] > 0
    assert peer_ids(b) == {a.peer_id, c.peer_id}

    for node in (a, b, c):
        mode = (node.data_dir / SOCKET_FILE).stat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600


# --- 4: SIGKILL and restart -------------------------------------------------------


def test_sigkill_is_detected_and_restarted_daemons_reconnect(daemons):
    a = daemons("a", config=FAST_IDLE)
    b = daemons("b", bootstrap=[str(a.address)], config=FAST_IDLE)
    wait_until(lambda: b.peer_id in peer_ids(a), 10, "A to list B")
    b_id = b.peer_id

    # kill -9 B: A has to notice through the idle timeout (2 s).
    b.kill()
    wait_until(lambda: b_id not in peer_ids(a), 10, "A to drop the SIGKILLed B")

    # B restarts on the same data dir: same identity, maybe a new port.
    b = daemons("b", bootstrap=[str(a.address)], config=FAST_IDLE)
    assert b.peer_id == b_id
    wait_until(lambda: b_id in peer_ids(a), 10, "A to list the restarted B")
    assert_calls_both_ways(a, b)

    # kill -9 A; B notices, then A comes back on the same port and B redials by itself.
    a_port = a.address.port
    a_id = a.peer_id
    a.kill()
    wait_until(lambda: a_id not in peer_ids(b), 10, "B to drop the SIGKILLed A")
    a = daemons("a", listen=f"127.0.0.1:{a_port}", config=FAST_IDLE)
    assert (a.peer_id, a.address.port) == (a_id, a_port)
    wait_until(lambda: a_id in peer_ids(b), 20, "B to redial the restarted A")
    # The restarted A has no bootstrap list, so B is the one that dialed.
    wait_until(lambda: b_id in peer_ids(a), 10, "the restarted A to list B")
    token = "b-to-restarted-a"
    assert call(b, a, "ping", json.dumps(token)) == token
    assert call(a, b, "identify")["peer_id"] == b_id


# --- 5: clean shutdown ------------------------------------------------------------


def test_sigterm_exits_cleanly_and_peers_notice_at_once(daemons):
    # Default idle timeout (30 s): noticing within 5 s means the close was sent.
    assert Config().transport.idle_timeout >= 30
    a = daemons("a")
    b = daemons("b", bootstrap=[str(a.address)])
    c = daemons("c", bootstrap=[str(a.address)])
    wait_until(lambda: peer_ids(a) == {b.peer_id, c.peer_id}, 10, "A to list B and C")

    started = time.monotonic()
    assert c.stop() == 0
    assert not (c.data_dir / SOCKET_FILE).exists()
    wait_until(lambda: peer_ids(a) == {b.peer_id}, 5, "A to drop the stopped C")
    assert time.monotonic() - started < 8

    started = time.monotonic()
    assert a.stop() == 0
    assert not (a.data_dir / SOCKET_FILE).exists()
    wait_until(lambda: peer_ids(b) == set(), 5, "B to drop the stopped A")
    assert time.monotonic() - started < 8
    assert b.running


# --- 6: meshctl failures ------------------------------------------------------------


def test_meshctl_errors_are_one_line_with_exit_code_1(daemons, tmp_path):
    # No daemon at all, and a stale socket left by a SIGKILLed one.
    empty = tmp_path / "empty"
    empty.mkdir()
    for data_dir in (empty, tmp_path / "missing"):
        line = one_line_error(Daemon(data_dir).meshctl_raw("peers"))
        assert "no meshd is running" in line
        assert str(data_dir) in line
    dead = daemons("dead")
    dead.kill()
    assert (dead.data_dir / SOCKET_FILE).exists()
    assert "no meshd is running" in one_line_error(dead.meshctl_raw("status"))

    a = daemons("a")
    b = daemons("b", bootstrap=[str(a.address)])
    wait_until(lambda: b.peer_id in peer_ids(a), 10, "A to list B")

    line = one_line_error(a.meshctl_raw("connect", "not-an-address"))
    assert "not-an-address" in line and "PEERID@HOST:PORT" in line

    unknown = str(Identity.generate().peer_id)
    line = one_line_error(a.meshctl_raw("ping", unknown))
    assert unknown in line

    line = one_line_error(a.meshctl_raw("call", b.peer_id, "no_such_method"))
    assert "no_such_method" in line

    line = one_line_error(a.meshctl_raw("call", "not-a-peer-id", "ping"))
    assert "PeerId" in line

    # The failures left the daemons serving.
    assert call(a, b, "ping", '"still-up"') == "still-up"


def test_meshctl_prints_brackets_literally_and_watch_runs_without_a_count(daemons):
    a = daemons("a")
    assert "off ([relay] enabled)" in a.meshctl_raw("relay").stdout  # not eaten as rich markup
    a.meshctl("crdt", "create", "run")
    cmd = [sys.executable, "-m", "cli.meshctl", "--data-dir", str(a.data_dir), "crdt", "watch", "run"]
    watch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def printed() -> bool:  # a change made after watch subscribed reaches its output
            a.meshctl("crdt", "inc", "run", "steps", "1")
            ready, _, _ = select.select([watch.stdout], [], [], 1.0)
            return watch.poll() is None and bool(ready) and "steps" in watch.stdout.readline()

        wait_until(printed, 20, "watch to print a change")
    finally:
        watch.kill()
        watch.communicate()


def test_a_daemon_without_documents_and_shards_runs_and_says_they_are_off(daemons):
    # [node] services leaves crdt and shards out: the node starts, its commands
    # say in one line that the service is off, and the rest works as before.
    a = daemons("a", config={"node": {"services": ["nat", "dht"]}})
    b = daemons("b", bootstrap=[str(a.address)])
    wait_until(lambda: b.peer_id in peer_ids(a), 10, "A to list B")
    for command, service in ((["crdt", "ls"], "crdt"), (["shards", "ls"], "shards"),
                             (["shard", "fetch", "gpt"], "shards")):
        line = one_line_error(a.meshctl_raw(*command))
        assert f"the {service} service is off on this node (add it to [node] services)" in line
    status = a.meshctl("status")
    assert status["crdt"] == "off" and status["shards"] == "off"
    assert status["dht"]["mode"] in ("server", "client")
    assert not any(m.startswith(("crdt.", "shards.")) for m in status["services"])
    assert call(a, b, "ping", '"up"') == "up"
    # A peer calling a method of the missing service gets UNKNOWN_METHOD, not a crash.
    line = one_line_error(b.meshctl_raw("call", a.peer_id, "crdt.push", "{}"))
    assert "crdt.push" in line


def test_a_service_list_that_cannot_work_is_one_line_at_start(tmp_path):
    for services, expected in ((["nat", "shards"], "shards needs dht"),
                               (["dht", "gossip"], "unknown service 'gossip'")):
        daemon = Daemon(tmp_path / services[1], config={"node": {"services": services}})
        with pytest.raises(DaemonError) as failed:
            daemon.start(timeout=20)
        assert expected in str(failed.value)


# --- 7: wrong key at an address -----------------------------------------------------


def test_connect_with_wrong_peer_id_fails_and_daemon_keeps_serving(daemons):
    a = daemons("a")
    b = daemons("b")
    impostor = str(Identity.generate().peer_id)
    line = one_line_error(b.meshctl_raw("connect", f"{impostor}@{a.address.hostport}", timeout=30))
    assert impostor in line and a.peer_id in line, line  # expected vs. what answered
    assert impostor not in peer_ids(b)

    good = b.meshctl("connect", str(a.address))
    assert good == {"peer_id": a.peer_id}
    assert_calls_both_ways(b, a)  # B first: A may finish its side of the handshake last
    assert a.meshctl("status")["peer_id"] == a.peer_id


# --- 8: UDP garbage -------------------------------------------------------------------


def _garbage(rng: random.Random, i: int) -> bytes:
    """Datagram ``i``: STUN-range, QUIC-looking long headers, short headers, noise."""
    size = rng.randint(1, 1500)
    data = bytearray(rng.randbytes(size))
    kind = i % 5
    if kind == 0:  # first byte 0-3: the STUN range of RFC 7983
        data[0] = rng.randint(0, 3)
    elif kind == 1:  # long-header bit set, the rest noise
        data[0] = 0xC0 | (data[0] & 0x3F)
    elif kind == 2:  # a well-formed QUIC v1 Initial header over random "ciphertext"
        size = rng.randint(1200, 1500)
        dcid, scid = rng.randbytes(8), rng.randbytes(8)
        header = bytes([0xC0 | rng.randint(0, 3)]) + b"\x00\x00\x00\x01"
        header += bytes([8]) + dcid + bytes([8]) + scid + b"\x00"
        rest = size - len(header) - 2
        header += struct.pack(">H", 0x4000 | rest)
        data = bytearray(header + rng.randbytes(rest))
    elif kind == 3:  # long header with an unknown version (triggers version negotiation)
        data = bytearray(bytes([0xC0 | rng.randint(0, 0x3F)]) + b"\x1a\x2a\x3a\x4a"
                         + bytes([8]) + rng.randbytes(8) + bytes([8]) + rng.randbytes(8)
                         + rng.randbytes(max(0, size - 23)))
    # kind 4: pure noise (often a short header with an unknown connection ID)
    return bytes(data)


def test_random_udp_garbage_does_not_hurt_the_daemon(daemons):
    a = daemons("a")
    b = daemons("b", bootstrap=[str(a.address)])
    wait_until(lambda: b.peer_id in peer_ids(a), 10, "A to list B")
    assert a.address.host == "127.0.0.1"
    target = ("127.0.0.1", a.address.port)

    rng = random.Random(20240521)
    sent_stun = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        for i in range(200):
            data = _garbage(rng, i)
            assert 1 <= len(data) <= 1500
            sent_stun += data[0] < 4
            sock.sendto(data, target)
    assert sent_stun >= 40

    # B's datagrams queue behind the garbage on A's socket, so a reply proves
    # A got through all of it.
    assert call(b, a, "ping", '"after-garbage"') == "after-garbage"
    assert call(a, b, "ping", '"after-garbage"') == "after-garbage"
    assert a.running
    status = json.loads(a.meshctl_raw("status", "--json").stdout)
    assert status["peer_id"] == a.peer_id
    assert status["connections"] == 1
    stats = status["transport"]
    assert stats.get("stun_ignored", 0) > 0, stats  # STUN-looking junk gets no answer
    assert stats.get("garbage", 0) + stats.get("unroutable", 0) > 0, stats
    assert "QUIC state machine failed" not in a.log_path.read_text()

    # Half-open junk connections did not crowd out a new peer.
    c = daemons("c")
    assert c.meshctl("connect", str(a.address)) == {"peer_id": a.peer_id}
    assert call(c, a, "ping", '"new-peer"') == "new-peer"


# --- 9: malformed RPC frames from an authenticated peer -------------------------------


async def test_malformed_rpc_frames_get_error_frames(daemons, tmp_path):
    a = await trio.to_thread.run_sync(daemons, "a")
    a_id = PeerId.from_string(a.peer_id)
    with trio.fail_after(30):
        async with meshd.open_node(tmp_path / "inproc", listen="127.0.0.1:0") as node:
            assert await node.connect(str(a.address)) == a_id
            conn = await node.connection(a_id)

            async def send_raw(payload: bytes, *, finish: bool = False) -> list:
                stream = conn.open_stream()
                await stream.send_all(payload)
                if finish:
                    # FIN our side but keep reading (stream.close() would stop reading).
                    await stream.send_all(b"", eof=True)
                with trio.fail_after(10):
                    ok, frame = await Framed(stream, 16 << 20).read()
                if not finish:
                    await stream.close()
                assert ok, "the daemon ended the stream without an ERROR frame"
                return frame

            def assert_error(frame: object, code: str) -> None:
                assert isinstance(frame, list) and len(frame) == 3, frame
                assert frame[0] == ERROR, frame
                assert frame[1] == code, frame
                assert isinstance(frame[2], str) and frame[2], frame

            # (a) a length prefix announcing 1 GiB
            assert_error(await send_raw(struct.pack(">I", 1 << 30)), "FRAME_TOO_LARGE")
            # (b) a 4-byte length and bytes that are not msgpack (0xc1 is never used)
            body = b"\xc1" * 16
            assert_error(await send_raw(struct.pack(">I", len(body)) + body), "PROTOCOL_ERROR")
            # (c) a valid frame that is not a REQUEST
            body = pack([9, 9])
            assert_error(await send_raw(struct.pack(">I", len(body)) + body), "PROTOCOL_ERROR")
            # (d) a frame cut short by the end of the stream
            assert_error(await send_raw(struct.pack(">I", 100) + b"\x00" * 10, finish=True),
                         "PROTOCOL_ERROR")

            # The connection and the daemon are fine: calls both ways.
            assert await node.rpc.call(a_id, "ping", 1, timeout=10) == 1
            assert (await node.identify(a_id))["peer_id"] == a.peer_id
            reply = await trio.to_thread.run_sync(
                lambda: call(a, str(node.peer_id), "ping", '"back"'))
            assert reply == "back"
            assert conn.close_reason is None


def test_meshctl_doctor_gives_a_verdict_per_check_and_fails_without_peers(daemons):
    a = daemons("a")
    alone = a.meshctl_raw("doctor")
    assert alone.returncode == 1 and "FAIL" in alone.stdout and "no connection" in alone.stdout
    b = daemons("b", bootstrap=[str(a.address)])
    wait_until(lambda: a.peer_id in peer_ids(b), 10, "B to list A")
    checks = {c["name"]: c for c in b.meshctl("doctor")}
    assert set(checks) == {"data folder", "disk", "peers", "bootstrap", "reachability", "port mapping", "ports",
                           "clock"}
    assert checks["bootstrap"] == {"name": "bootstrap", "verdict": "ok", "fix": "",
                                   "detail": f"{a.peer_id[:10]}...@{a.address.hostport} connected (direct)"}
    ports = checks["ports"]  # loopback: bound, but other machines cannot dial in
    assert ports["verdict"] == "warn" and ports["detail"].startswith(f"UDP {b.address.hostport} (QUIC), TCP 127.0.0.1:")
    assert "(shards lane)" in ports["detail"] and "(learning lane)" in ports["detail"]
    assert checks["peers"]["verdict"] == "ok" and checks["peers"]["detail"] == "1 connected: 1 direct"
    assert checks["clock"]["verdict"] == "ok" and "1 asked" in checks["clock"]["detail"]  # identify says its time
    assert checks["data folder"]["verdict"] == "ok" and checks["port mapping"]["verdict"] == "ok"  # loopback
