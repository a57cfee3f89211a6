"""The ``experts.*`` control methods: the experts this node serves, and any expert's servers."""

from __future__ import annotations

import time

import trio

from ...rpc import NotFound, RpcError
from ...rpc.args import field, peer_field
from .registry import live_servers


def _num(value: object) -> int:
    """A count a peer's registry entry gave, or 0 if it is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def control_methods(service) -> dict:
    async def ls(arg, ctx) -> dict:
        """Experts served here, with their load; with ``all``, every other expert the
        registry document lists; with ``find`` (a list of ids), also the servers the
        DHT names for each and what they say of it."""
        rows = [{**s.info, "load": s.load(), "servers": [str(service.host.peer_id)]}
                for s in service.served.values()]
        if isinstance(arg, dict) and arg.get("all"):  # every expert the registry lists
            now, heartbeat = time.time(), service.config.heartbeat
            for expert_id, entry in sorted((await service.registry()).items()):
                if expert_id not in service.served:
                    about = entry.get("about") if isinstance(entry.get("about"), dict) else {}
                    servers = entry.get("servers")
                    live, stale = live_servers(servers, now=now, heartbeat=heartbeat)
                    loads = [servers[p]["load"] for p in live if isinstance(servers[p].get("load"), dict)]
                    rows.append({**about, "expert": expert_id, "servers": live, "stale": stale,
                                 "load": {"queued": sum(_num(l.get("queued")) for l in loads),
                                          "calls": sum(_num(l.get("calls")) for l in loads)}})
        for expert_id in (field(arg, "find", list) if isinstance(arg, dict) and "find" in arg else []):
            if not isinstance(expert_id, str) or expert_id in service.served:
                continue
            servers = await service.servers(expert_id)
            row = {"expert": expert_id, "servers": [str(p) for p in servers]}
            for peer in servers[:1]:
                try:
                    with trio.fail_after(5):
                        row |= {k: v for k, v in (await service.info(peer, expert_id)).items() if k != "expert"}
                except (RpcError, trio.TooSlowError, OSError) as exc:
                    row["error"] = str(exc) or f"{type(exc).__name__} (no answer in 5 s)"
            rows.append(row)
        return {"experts": rows}

    async def call(arg, ctx) -> dict:
        """One call to expert ``expert`` on ``peer`` (or its first server) with ``inputs``
        (tensor maps), for debugging: the outputs as shapes and values, and who answered."""
        from .tensors import from_wire, to_wire  # noqa: PLC0415  (torch, only here)

        expert_id, op = field(arg, "expert", str), field(arg, "op", str)
        inputs = from_wire(field(arg, "inputs", list), max_tensors=service.config.max_tensors,
                           max_bytes=service.config.max_request_bytes)
        servers = [peer_field(arg)] if arg.get("peer") else await service.servers(expert_id)
        if not servers:
            raise NotFound(f"nobody serves expert {expert_id!r}")
        started = trio.current_time()
        outputs, batch = await service.call(servers[0], expert_id, op, inputs)
        return {"peer": str(servers[0]), "ms": 1000 * (trio.current_time() - started), "batch": batch,
                "outputs": to_wire(outputs)}

    return {"experts.ls": ls, "experts.call": call}
