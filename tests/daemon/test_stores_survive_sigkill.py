"""Acknowledged writes survive ``kill -9`` of the process that made them: the chunk
store (a writer killed mid-put, mid-stream, or as a fetch's writer acknowledges
groups), the document store (a writer killed while it writes and compacts) and the
DHT's record store.
Each writer is a child process, so these run here and not in the unit layer."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from crdt_helpers import Key, commit, snapshot_of
from crdt.store import Store
from dht.storage import Database, RecordStore
from dht.validators import Validators
from meshd.services.shards.store import ChunkStore, chunk_id

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SUPPORT = TESTS / "support"
FINAL = re.compile(r"[0-9a-f]{64}")
OWNER, W1 = Key("owner"), Key("writer-1")


def files(root: Path) -> dict[str, Path]:
    """Every file in the chunk store's folders, by name."""
    return {p.name: p for p in root.glob("??/*")}


@pytest.fixture
def root(tmp_path):
    return tmp_path / "chunks"


# --- the chunk store ------------------------------------------------------------------------------------------

CRASH_AT = """
import os, sys
from meshd.services.shards.store import ChunkStore, chunk_id
store = ChunkStore(sys.argv[1], max_bytes=1 << 30)
replace = os.replace
def crash(src, dst):
    if sys.argv[2] == "after-rename":
        replace(src, dst)
    os._exit(3)
os.replace = crash
data = b"x" * 5000
store.put(chunk_id(data), data)
"""


@pytest.mark.parametrize("point", ["before-rename", "after-rename"])
def test_crash_inside_put(root, point):
    cid, data = chunk_id(b"x" * 5000), b"x" * 5000
    proc = subprocess.run([sys.executable, "-c", CRASH_AT, str(root), point], cwd=ROOT,
                          capture_output=True)
    assert proc.returncode == 3, proc.stderr.decode()
    assert set(files(root)) == {cid.hex() + (".tmp" if point == "before-rename" else "")}
    with ChunkStore(root, max_bytes=1 << 30) as s:
        assert not any(name.endswith(".tmp") for name in files(root))
        if point == "before-rename":
            assert s.missing([cid]) == [cid] and s.total_bytes() == 0
        else:
            assert s.get(cid) == data and s.total_bytes() == 5000


WRITER = """
import os, stat, sys
from meshd.services.shards.store import ChunkStore, chunk_id
def say(line):
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()
# announce (not change) the file operations inside put, so the test can kill at each
fsync, replace = os.fsync, os.replace
def announced_fsync(fd):
    say("@fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "@fsync-file")
    fsync(fd)
def announced_replace(src, dst):
    say("@replace")
    replace(src, dst)
os.fsync, os.replace = announced_fsync, announced_replace
store = ChunkStore(sys.argv[1], max_bytes=1 << 40)
if sys.argv[2] == "put":
    for i in range(100000):
        data = os.urandom(1 + i * 7919 % (512 * 1024))
        cid = chunk_id(data)
        store.put(cid, data)
        say(cid.hex())
elif sys.argv[2] == "stream":  # put_stream: groups of chunks, acknowledged when the call returns
    for n in range(100000):
        chunks = [os.urandom(1 + (n * 7 + i) * 7919 % (512 * 1024)) for i in range(7)]
        for cid in store.put_stream(iter(chunks), window=1 << 20):
            say(cid.hex())
else:  # a fetch's writer: chunks handed over one by one, acknowledged by on_durable, in groups
    writer = store.writer(window=1 << 20, on_durable=lambda ids: [say(cid.hex()) for cid in ids])
    for i in range(100000):
        data = os.urandom(1 + i * 7919 % (512 * 1024))
        writer.put(chunk_id(data), data)
"""


@pytest.mark.parametrize("how, kill_at", [("put", "ack"), ("put", "@fsync-file"), ("put", "@replace"),
                                          ("put", "@fsync-dir"), ("stream", "@fsync-file"), ("stream", "@replace"),
                                          ("writer", "ack"), ("writer", "@fsync-file"), ("writer", "@replace"),
                                          ("writer", "@fsync-dir")])
def test_acknowledged_chunks_survive_sigkill(root, how, kill_at):
    """A writer is killed after 100 acknowledged chunks, at the next ``kill_at`` (right after
    an acknowledgement, or as it fsyncs a temp file, renames one, or fsyncs a folder); it
    stores them one put at a time, seven at a time with put_stream, or as a fetch does:
    handed one by one to a ChunkWriter, which acknowledges them a group at a time."""
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(root), how], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines, acks = [], 0
    try:
        while line := child.stdout.readline().decode().strip():
            lines.append(line)
            acks += FINAL.fullmatch(line) is not None
            if acks >= 100 and (line == kill_at or kill_at == "ack" and line[0] != "@"):
                break
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        lines += child.stdout.read().decode().split()  # printed before the kill
        error = child.stderr.read().decode()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL, error
    acked = [bytes.fromhex(x) for x in lines if FINAL.fullmatch(x)]
    assert len(acked) >= 100, error

    # as the crash left it: whatever is under a final name is a whole chunk
    on_disk = files(root)
    for name, path in on_disk.items():
        if FINAL.fullmatch(name):
            assert chunk_id(path.read_bytes()).hex() == name
        else:
            assert name.endswith(".tmp")
    with ChunkStore(root, max_bytes=1 << 40) as s:
        on_disk = files(root)
        assert all(FINAL.fullmatch(name) for name in on_disk)  # temp files cleaned on open
        assert s.missing(acked) == []
        assert all(s.get(cid) is not None for cid in acked)
        assert s.total_bytes() == sum(p.stat().st_size for p in on_disk.values())
        assert s.missing([bytes.fromhex(name) for name in on_disk]) == []
        more = os.urandom(1000)
        assert s.put(chunk_id(more), more) is True


# --- the document store ---------------------------------------------------------------------------------------

CHILD = r"""
import sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from crdt_helpers import Key
from crdt.document import Document
from crdt.store import Store
from dht.storage import Database, RecordStore
from dht.validators import Validators

owner, writer = Key("owner"), Key("writer-1")
store = Store(sys.argv[1])
doc = store.load(owner.pk, "durable")
store.add_document(doc)

def write(key, fill):
    tx = doc.transaction()
    fill(tx)
    change = doc.prepare(tx, key.pk, key.sign, 0)
    store.save(doc, [change])
    doc.receive(change)
    sys.stdout.write(change.id.hex() + "\n")
    sys.stdout.flush()

write(owner, lambda tx: tx.grant(writer.pk))
n = 0
while True:
    n += 1
    write((owner, writer)[n % 2], lambda tx: (tx.inc(["n"]), tx.set(["last"], n), tx.add(["seen"], n % 17)))
    if n % 50 == 0:
        store.compact(doc)
"""


def test_acknowledged_changes_survive_sigkill(tmp_path):
    path = tmp_path / "durable.db"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(SUPPORT), str(ROOT)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    acknowledged = []
    try:
        while len(acknowledged) < 200:
            line = child.stdout.readline()
            if not line:
                break
            acknowledged.append(bytes.fromhex(line.decode().strip()))
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        error = child.stderr.read().decode()
        child.stdout.close()
        child.stderr.close()
    assert len(acknowledged) == 200, error
    assert child.returncode == -signal.SIGKILL

    store = Store(path)
    doc = store.load(OWNER.pk, "durable")
    missing = [i.hex() for i in acknowledged if i not in doc]
    assert not missing
    assert doc.pending == 0
    assert doc.get(["n"]) == len(doc) - 1  # every change after the grant counted once
    assert doc.acl.members("writer") == {W1.pk}
    # the store is usable: compact, reload, go on writing
    store.compact(doc)
    reloaded = store.load(OWNER.pk, "durable")
    assert snapshot_of(reloaded) == snapshot_of(doc)
    c = commit(reloaded, W1, lambda tx: tx.inc(["n"]))
    store.save(reloaded, [c])
    assert store.load(OWNER.pk, "durable").get(["n"]) == len(doc)


# --- the DHT's record store -----------------------------------------------------------------------------------

NOW = 1_700_000_000


def test_a_stored_record_survives_kill_9(tmp_path):
    path = tmp_path / "dht.sqlite"
    script = f"""
import os, signal
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from dht.records import sign_record
from dht.storage import Database, RecordStore
from dht.validators import Validators
key = Ed25519PrivateKey.generate()
record = sign_record(b"/open/survivor", b"value", public_key=key.public_key().public_bytes_raw(), sign=key.sign,
                     seq=0, expires={NOW + 3600})
RecordStore(Database({str(path)!r}), bytes(32), Validators.default(), now={NOW}).put(record, {NOW})
os.kill(os.getpid(), signal.SIGKILL)
"""
    child = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60)
    assert child.returncode == -signal.SIGKILL
    with Database(path) as db:
        assert RecordStore(db, bytes(32), Validators.default(), now=NOW).get(b"/open/survivor", NOW) is not None
