"""``meshctl doctor``: checks to run when something is wrong, a verdict per line.

Like ``tailscale netcheck``: each check says ok, warn or FAIL, what it saw,
and what to do.  The checks are plain functions of what the daemon reports
(status, peers, NAT, dials to the bootstrap peers, the peers' clocks) and of
the data folder, so they are tested without a daemon; the command gathers
those facts and prints.  It exits 1 if any check failed.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import meshd

from ..common import console, rich_table

CLOCK_SKEW_FAIL = 60.0  # seconds: DHT records and document changes further off are refused
CLOCK_SKEW_WARN = 5.0
DISK_WARN = 1 << 30  # bytes free in the data folder's file system
CLOCK_PEERS = 5  # peers asked for their time


@dataclass
class Check:
    name: str
    verdict: str  # "ok", "warn" or "fail"
    detail: str
    fix: str = ""


def check_peers(status: dict, peers: list[dict]) -> Check:
    """Connected to anyone, and how (direct, punched, relayed)?"""
    if not peers:
        known = status.get("known_peers", 0)
        fix = ("meshctl connect PEERID@HOST:PORT, or meshd start --bootstrap ..." if not known
               else "the known peers did not answer: are they running, and is UDP to them open?")
        return Check("peers", "fail", f"no connection ({known} peers known)", fix)
    paths: dict[str, int] = {}
    for row in peers:
        paths[row.get("path", "?")] = paths.get(row.get("path", "?"), 0) + 1
    detail = f"{len(peers)} connected: " + ", ".join(f"{n} {p}" for p, n in sorted(paths.items()))
    if set(paths) == {"relayed"}:
        return Check("peers", "warn", detail, "every path is relayed: meshctl punch PEERID, or open a UDP port")
    return Check("peers", "ok", detail)


def check_bootstrap(dials: dict[str, str | None], paths: dict[str, str]) -> list[Check]:
    """A line per configured bootstrap peer: connected (and by which path), or why
    the daemon could not dial it.  ``dials`` maps each ``PEERID@HOST:PORT`` to its
    dial's error (None: connected); ``paths`` maps connected peer ids to their path.
    One that cannot be reached fails if none can, and warns if another one can."""
    if not dials:
        return [Check("bootstrap", "ok", "none configured")]
    any_reached = None in dials.values()
    checks = []
    for addr, error in dials.items():
        peer, _, hostport = addr.partition("@")
        shown = f"{peer[:10]}...@{hostport}"
        if error is None:
            checks.append(Check("bootstrap", "ok", f"{shown} connected ({paths.get(peer, '?')})"))
        else:
            checks.append(Check("bootstrap", "warn" if any_reached else "fail", f"{shown} unreachable: {error}",
                                f"is meshd running at {hostport} with that peer id, and does UDP reach it from here?"))
    return checks


def check_reachability(nat: dict) -> Check:
    """Can strangers dial us: public, through a relay, or not at all?"""
    reach, mapping = nat.get("reachability", "unknown"), nat.get("mapping")
    seen = f"mapping {mapping}" if mapping else "mapping not classified"
    if reach == "public":
        return Check("reachability", "ok", f"public at {nat.get('reachability_address')} ({seen})")
    reservations = nat.get("relay_reservations") or {}
    if reach == "private" and reservations:
        return Check("reachability", "ok", f"behind a NAT ({seen}), reachable through {len(reservations)} relay(s)")
    if reach == "private":
        return Check("reachability", "warn", f"behind a NAT ({seen}) with no relay reservation",
                     "peers cannot dial us: connect to a public node that relays ([relay] enabled there)")
    return Check("reachability", "warn", f"unknown ({seen}): no peer has dialed us back yet",
                 "connect to at least two other nodes, then meshctl nat --autonat")


def check_port_mapping(nat: dict) -> Check:
    mapped = nat.get("port_mapping")
    if mapped:
        return Check("port mapping", "ok", f"{mapped['external']} via {mapped['gateway']}")
    if nat.get("reachability") == "public":
        return Check("port mapping", "ok", "none needed: public")
    if _loopback(nat.get("listen", "")):
        return Check("port mapping", "ok", "none needed: listening on loopback only")
    return Check("port mapping", "warn", "the router mapped no port",
                 "enable NAT-PMP/PCP/UPnP on the router, or forward the UDP listen port by hand")


def check_ports(status: dict) -> Check:
    """The sockets peers dial are bound: the UDP listen port (QUIC) and each service's
    TCP bulk lane (its status's ``lane``: the port, None until it listens, or "off")."""
    listen = status["listen"]
    host = listen.rpartition(":")[0]
    bound, unbound = [f"UDP {listen} (QUIC)"], []
    for name, value in status.items():
        lane = value.get("lane", "off") if isinstance(value, dict) else "off"
        if lane is None:
            unbound.append(f"{name} lane")
        elif lane != "off":
            bound.append(f"TCP {host}:{lane} ({name} lane)")
    detail = ", ".join(bound)
    if unbound:
        return Check("ports", "fail", f"not listening: {', '.join(unbound)} (bound: {detail})",
                     "run doctor again once meshd has finished starting; if this stays, see its log (meshd.lane)")
    if _loopback(listen):
        return Check("ports", "warn", f"{detail}: loopback only",
                     'other machines cannot dial in: [node] listen = "0.0.0.0:4100" (or --listen) and restart')
    return Check("ports", "ok", detail)


def _loopback(listen: str) -> bool:
    return listen.startswith(("127.", "[::1]"))


def check_clock(skews: dict[str, float]) -> Check:
    """Our clock against the peers': records and changes more than a minute off are refused."""
    if not skews:
        return Check("clock", "warn", "no peer to compare with", "connect to a peer first")
    worst_peer, worst = max(skews.items(), key=lambda item: abs(item[1]))
    detail = f"largest difference {worst:+.1f} s (peer {worst_peer[:10]}..., {len(skews)} asked)"
    if abs(worst) > CLOCK_SKEW_FAIL:
        return Check("clock", "fail", detail, "sync the clock (NTP): the DHT and documents refuse records this far off")
    if abs(worst) > CLOCK_SKEW_WARN:
        return Check("clock", "warn", detail, "sync the clock (NTP)")
    return Check("clock", "ok", detail)


def check_disk(data_dir: Path) -> Check:
    free = shutil.disk_usage(data_dir).free
    detail = f"{free / 2**30:,.1f} GiB free under {data_dir}"
    if free < DISK_WARN:
        return Check("disk", "warn", detail, "model fetches and document stores need room: free some space")
    return Check("disk", "ok", detail)


def check_private(data_dir: Path) -> Check:
    """The data folder (identity key, control socket, stores) readable by this user only."""
    mode = stat.S_IMODE(os.stat(data_dir).st_mode)
    if mode & 0o077:
        return Check("data folder", "fail", f"{data_dir} has mode {mode:o}: other users can look inside",
                     f"chmod 700 {data_dir}")
    return Check("data folder", "ok", f"{data_dir} is private ({mode:o})")


async def _dial_bootstrap(client: meshd.Client, addrs: list[str]) -> dict[str, str | None]:
    """Have the daemon dial each bootstrap address (a live connection is reused):
    None for each it is connected to afterwards, else the dial's error."""
    dials: dict[str, str | None] = {}
    for addr in addrs:
        try:
            await client.connect(addr)
            dials[addr] = None
        except meshd.RpcError as exc:
            dials[addr] = str(exc)
    return dials


async def _clock_skews(client: meshd.Client, peers: list[dict]) -> dict[str, float]:
    skews = {}
    for row in peers[:CLOCK_PEERS]:
        before = time.time()
        try:
            info = await client.call(row["peer_id"], "identify", timeout=5)
        except meshd.RpcError:
            continue
        theirs = info.get("time") if isinstance(info, dict) else None
        if isinstance(theirs, (int, float)):
            skews[row["peer_id"]] = theirs - (before + time.time()) / 2
    return skews


async def cmd_doctor(client: meshd.Client, args) -> object:
    status = await client.status()
    dials = await _dial_bootstrap(client, status["bootstrap"])
    peers = await client.peers()  # after the dials: with the bootstrap peers they reached
    nat = await client.nat(discover=bool(peers), autonat=bool(peers))
    data_dir = Path(status.get("data_dir") or args.data_dir)
    paths = {row["peer_id"]: row.get("path", "?") for row in peers}
    checks = [check_private(data_dir), check_disk(data_dir), check_peers(status, peers),
              *check_bootstrap(dials, paths), check_reachability(nat), check_port_mapping(nat),
              check_ports(status), check_clock(await _clock_skews(client, peers))]
    args.exit_code = 1 if any(c.verdict == "fail" for c in checks) else 0
    result = [asdict(c) for c in checks]

    def show() -> None:
        from rich.markup import escape

        table = rich_table(show_header=False, box=None)
        style = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
        for c in checks:
            table.add_row(c.name, style[c.verdict],
                          escape(c.detail) + (f"\n[dim]-> {escape(c.fix)}[/]" if c.fix else ""))
        console().print(table)

    return result, show


def add_parser(sub, common) -> None:
    parser = sub.add_parser("doctor", parents=[common],
                            help="check the data folder, disk, peers, bootstrap peers, reachability, "
                                 "port mapping, ports and clock")
    parser.set_defaults(func=cmd_doctor)
