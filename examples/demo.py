"""`make demo`: three meshd daemons on 127.0.0.1 with throwaway data dirs.

Starts them, joins the second and third through the first (bootstrap) and
to each other (meshctl connect), shows `meshctl peers` from each, runs a
ping round, has all three write to one replicated document, then trains the
digits MLP with DiLoCo across three training processes (each its own node,
bootstrapped from node1) and shows that every member ends every outer round
with the same parameters, then serves a decentralized diffusion ensemble (4
flow-matching experts and a router, each on its own node, bootstrapped from
node1) and samples from it, shows `meshctl experts ls --find c0` on node2,
and stops the daemons with SIGTERM.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from meshd.testing.localmesh import Daemon


def show(title: str, proc: subprocess.CompletedProcess) -> None:
    print(f"\n$ {title}")
    sys.stdout.write(proc.stdout or proc.stderr)


def shared_document(daemons: list[Daemon]) -> None:
    """node1 creates a document and lets the others write; each adds itself and counts."""
    owner = daemons[0]
    ref = owner.meshctl("crdt", "create", "demo")["doc"]
    for d in daemons[1:]:
        owner.meshctl("crdt", "grant", "demo", d.peer_id)
    for d in daemons:
        d.meshctl("crdt", "add", ref, "members", d.data_dir.name)
        d.meshctl("crdt", "inc", ref, "steps", "10")
    for d in daemons:
        d.meshctl("crdt", "sync", ref)  # pushes are already there; this makes it certain
    show(f"meshctl crdt get {ref}   # on node3", daemons[2].meshctl_raw("crdt", "get", ref))


TRAINER = Path(__file__).resolve().parent / "train_digits.py"
ENSEMBLE = Path(__file__).resolve().parent / "ensemble.py"


def training(daemons: list[Daemon], tmp: str, members: int = 3) -> bool:
    """``members`` DiLoCo processes train the digits MLP (H=50, 300 inner steps, int8
    pseudo-gradients); True if every member reported the same hash for every round."""
    print(f"\nDiLoCo: {members} training processes, digits MLP, H=50, 300 inner steps, int8 pseudo-gradients")
    procs = [subprocess.Popen([sys.executable, str(TRAINER), "--json", "--data-dir", str(Path(tmp, f"trainer{m}")),
                               "--bootstrap", str(daemons[0].address), "--member", str(m), "--members", str(members),
                               "--wait-for", str(members), "--steps", "300", "--compression", "int8"],
                              stdout=subprocess.PIPE, text=True) for m in range(members)]
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        reports.append([json.loads(line) for line in out.splitlines()])
    rounds = [{line["round"]: line for line in lines if "round" in line} for lines in reports]
    agree = True
    for r in sorted(rounds[0]):
        hashes = {member[r]["hash"] for member in rounds if r in member}
        agree &= len(hashes) == 1
        took = rounds[0][r]["contributors"] is None  # member 0 took that round's state from another
        print(f"  round {r}: test acc {rounds[0][r]['acc']:.3f}, "
              f"{'state taken' if took else str(rounds[0][r]['contributors']) + ' contributors'}, "
              f"state hash {'same on every member' if len(hashes) == 1 else 'DIFFERS'}: {rounds[0][r]['hash'][:16]}")
    sent = [next(line for line in lines if "done" in line)["bytes_out"] for lines in reports]
    print(f"  each member sent {sum(sent) / len(sent) / 1e3:.0f} kB (the model is 38 kB of float32)")
    return agree and all(proc.returncode == 0 for proc in procs)


def ensemble(daemons: list[Daemon], tmp: str) -> bool:
    """examples/ensemble.py against node1; while its experts are up, node2 looks c0 up.  True if it ran."""
    print("\nDDM ensemble: 4 flow-matching experts and a router, each on its own node, one sampler")
    proc = subprocess.Popen([sys.executable, str(ENSEMBLE), "--bootstrap", str(daemons[0].address),
                             "--data-dir", str(Path(tmp, "ensemble"))], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        sys.stdout.write(line)
        if line.startswith("floor"):  # the experts are served: ask a daemon about one
            show("meshctl experts ls --find c0   # on node2", daemons[1].meshctl_raw("experts", "ls", "--find", "c0"))
    return proc.wait(timeout=180) == 0


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="meshd-demo-") as tmp:
        daemons: list[Daemon] = []
        try:
            first = Daemon(Path(tmp, "node1")).start()
            daemons.append(first)
            for name in ("node2", "node3"):
                daemons.append(Daemon(Path(tmp, name), bootstrap=[str(first.address)]).start())
            for d in daemons:
                print(f"started {d.data_dir.name}: {d.address}")
            # bootstrap dials in the background; connect makes each link certain and
            # joins node2 and node3 directly.
            for d in daemons[1:]:
                d.meshctl("connect", str(first.address))
            daemons[2].meshctl("connect", str(daemons[1].address))
            for d in daemons:
                show(f"meshctl peers   # on {d.data_dir.name}", d.meshctl_raw("peers"))
            print("\nping round:")
            for a in daemons:
                for b in daemons:
                    if a is not b:
                        r = a.meshctl("ping", b.peer_id, "-c", "3")
                        print(f"  {a.data_dir.name} -> {b.data_dir.name}: median {r['median_ms']:.3f} ms")
            shared_document(daemons)
            trained = training(daemons, tmp) and ensemble(daemons, tmp)
        finally:
            codes = [d.stop() for d in daemons]
            print(f"\nstopped {len(codes)} daemons, exit codes {codes}")
        return 0 if codes and all(c == 0 for c in codes) and trained else 1


if __name__ == "__main__":
    raise SystemExit(main())
