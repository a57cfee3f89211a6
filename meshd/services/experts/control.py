"""The ``experts.*`` control methods: the experts this node serves, and any expert's servers."""

from __future__ import annotations

import logging
import os
import time

import trio

from ...rpc import InvalidArgument, NotFound, RpcError
from ...rpc.args import field, optional, peer_field
from ...service import check_name
from .registry import describe_servers, live_servers
from .served import KINDS

log = logging.getLogger("meshd.experts")


def _num(value: object) -> int:
    """A count a peer's registry entry gave, or 0 if it is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


PROBE_TIMEOUT = 5.0  # seconds ``ls --find`` waits for a server's experts.info
PROBE_MAX = 8  # servers of one expert ``ls --find`` asks (the first ones the DHT names)


def control_methods(service) -> dict:
    def health(expert_id: str, live: list[str], stale: list[str], probes: dict | None = None) -> dict:
        return describe_servers(live, stale, measured=service.measured.get(expert_id), now=trio.current_time(),
                                probes=probes)

    async def probe(peer, expert_id: str, probes: dict, infos: dict) -> None:
        started = trio.current_time()
        try:
            with trio.fail_after(PROBE_TIMEOUT):
                infos[str(peer)] = await service.info(peer, expert_id, timeout=PROBE_TIMEOUT)
            probes[str(peer)] = trio.current_time() - started
        except (RpcError, trio.TooSlowError, OSError) as exc:
            probes[str(peer)] = str(exc) or f"{type(exc).__name__} (no answer in {PROBE_TIMEOUT:g} s)"

    async def ls(arg, ctx) -> dict:
        """Experts served here, with their load; with ``all``, every other expert the
        registry document lists; with ``find`` (a list of ids), also the servers the
        DHT names for each and what they say of it.  Every row says how each server
        is (``peers``: health, and the latency this node measured calling it, or of
        an ``experts.info`` it asked just now for ``find``) and sums it up (``health``,
        ``latency_ms``); a registry row also counts the server rows it ignored
        (``rejected``: written by another peer than the server they name), if any."""
        me = str(service.host.peer_id)
        rows = [{**s.info, "load": s.load(), "servers": [me], **health(s.expert_id, [me], [])}
                for s in service.served.values()]
        if isinstance(arg, dict) and arg.get("all"):  # every expert the registry lists
            now, heartbeat = time.time(), service.config.heartbeat
            for expert_id, entry in sorted((await service.registry()).items()):
                if expert_id not in service.served:
                    about = entry.get("about") if isinstance(entry.get("about"), dict) else {}
                    servers = entry.get("servers")
                    live, stale = live_servers(servers, now=now, heartbeat=heartbeat)
                    loads = [servers[p]["load"] for p in live if isinstance(servers[p].get("load"), dict)]
                    row = {**about, "expert": expert_id, "servers": live, "stale": stale,
                           "load": {"queued": sum(_num(l.get("queued")) for l in loads),
                                    "calls": sum(_num(l.get("calls")) for l in loads)},
                           **health(expert_id, live, stale)}
                    if entry.get("rejected"):  # rows filed under a server that it did not write
                        row["rejected"] = len(entry["rejected"])
                    rows.append(row)
        for expert_id in (field(arg, "find", list) if isinstance(arg, dict) and "find" in arg else []):
            if not isinstance(expert_id, str) or expert_id in service.served:
                continue
            servers = await service.servers(expert_id)
            row = {"expert": expert_id, "servers": [str(p) for p in servers]}
            probes: dict = {}
            infos: dict = {}
            async with trio.open_nursery() as nursery:  # at once: a dead server costs one timeout
                for peer in servers[:PROBE_MAX]:
                    nursery.start_soon(probe, peer, expert_id, probes, infos)
            answered = [infos[str(p)] for p in servers if str(p) in infos]
            if answered:  # what the first server that answered says of it
                row |= {k: v for k, v in answered[0].items() if k not in ("expert", "servers")}
            elif servers:
                row["error"] = probes[str(servers[0])]
            rows.append(row | health(expert_id, row["servers"], [], probes))
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

    async def serve(arg, ctx) -> dict:
        """Serve expert ``expert`` from files, here, until ``experts.unserve`` or the daemon
        stops: the module ``factory`` (``MODULE:NAME``) makes from ``kwargs``, with the
        state_dict in ``weights`` (``.safetensors``, or a torch.save file read weights-only),
        if given; ``search``: directories to import a dotted MODULE from (meshctl's working
        directory).  Torch is imported here, on first use (:mod:`.loading`)."""
        from .loading import LoadError, load_module  # noqa: PLC0415  (torch, only here)

        expert_id = field(arg, "expert", str)
        try:
            check_name(expert_id, "an expert id")
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        factory, weights = field(arg, "factory", str), optional(arg, "weights", str)
        kwargs, search = optional(arg, "kwargs", dict) or {}, optional(arg, "search", list) or []
        kind, domain = optional(arg, "kind", str) or "module", optional(arg, "domain", str)
        max_batch, dim = optional(arg, "max_batch", int), optional(arg, "dim", int)
        max_batch = 32 if max_batch is None else max_batch
        max_wait_ms = optional(arg, "max_wait_ms", (int, float))
        if kind not in KINDS:
            raise InvalidArgument(f"kind is one of {', '.join(KINDS)}, not {kind!r:.40}")
        if not all(isinstance(k, str) for k in kwargs) or not all(isinstance(d, str) for d in search):
            raise InvalidArgument("kwargs maps names to values; search is a list of directories")
        if max_batch < 1 or (dim is not None and dim < 1) or (max_wait_ms is not None and not max_wait_ms >= 0):
            raise InvalidArgument("max_batch and dim are positive, max_wait_ms not negative")
        if weights is not None and not os.path.isabs(weights):
            raise InvalidArgument(f"weights is an absolute path, not {weights!r:.200}")
        if expert_id in service.served:
            raise InvalidArgument(f"expert {expert_id!r} is served here already (experts unserve it first)")
        try:
            module = await trio.to_thread.run_sync(
                lambda: load_module(factory, weights, kwargs=kwargs, search=search))
        except LoadError as exc:
            raise InvalidArgument(str(exc)) from None
        if expert_id in service.served:  # served meanwhile, by another call
            raise InvalidArgument(f"expert {expert_id!r} is served here already (experts unserve it first)")
        served = await service.serve(expert_id, module, kind=kind, domain=domain, dim=dim, max_batch=max_batch,
                                     max_wait_ms=5.0 if max_wait_ms is None else float(max_wait_ms))
        log.info("expert %s served from %s (%s)", expert_id, weights or "its factory", factory)
        return {**served.info, "servers": [str(service.host.peer_id)], "factory": factory, "weights": weights}

    async def unserve(arg, ctx) -> dict:
        """Stop serving expert ``expert`` here (callers go to its other servers)."""
        expert_id = field(arg, "expert", str)
        if expert_id not in service.served:
            raise NotFound(f"expert {expert_id!r:.60} is not served here")
        service.unserve(expert_id)
        return {"expert": expert_id, "served": False}

    return {"experts.ls": ls, "experts.call": call, "experts.serve": serve, "experts.unserve": unserve}
