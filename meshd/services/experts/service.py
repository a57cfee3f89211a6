"""Expert ensembles, the service ``experts``: serve torch modules, find and call others'.

An expert is a torch module with an id (``"code-small"``), a kind (``lm``,
``flow``, ``router`` or ``module``) and a domain or cluster.  A node that
serves one (:meth:`Experts.serve`) provides ``b"/expert/" + id`` in the DHT
and answers two peer methods:

* ``experts.call`` ``{"expert", "op", "inputs"}`` → ``{"outputs", "batch",
  "max_batch"}``: tensors in and out as ``{"dtype", "shape", "data"}`` maps
  (:mod:`.tensors`), every output with the call's rows first, the call
  batched with others (:mod:`.served`; ``batch``: the rows of the batch it
  ran in, ``max_batch``: the rows a batch holds, so a caller knows how many
  rows of its own calls one request may carry);
* ``experts.info`` ``{"expert"}`` → what the expert is (kind, domain,
  parameters, model id) and how loaded its server is.

With the ``crdt`` service on, every expert served is also written to a
replicated registry document (``experts.registry``: this node's
``experts`` by default, or a shared one whose owner granted this node
``writer``): its kind, domain, model id, parameters and the peers serving
it, so ``meshctl experts ls --all`` lists every expert the registry knows
(a server row counts only if the server it names wrote it: :mod:`.registry`).
A write the registry refuses is logged; the expert is served anyway.

Callers find an expert's servers with :meth:`Experts.servers` and call one
with :meth:`Experts.call`; :class:`~.remote.RemoteExpert` chooses among them,
hedges and retries, and the ensembles (:mod:`.ensembles`) mix experts.
Torch is imported only by the code that touches tensors.
"""

from __future__ import annotations

import logging
import time

import trio

from dht.network import DhtError
from experts.servers import Servers

from ...identity import PeerId
from ...registry import catch_up, open_registry
from ...rpc import InvalidArgument, NotFound, RpcError
from ...rpc.args import field, optional
from ...service import Documents, Host, Providers, Replica, check_name
from .config import ExpertsSection
from .control import control_methods
from .registry import HEARTBEAT_LOAD, read_registry
from .served import Served
from .tensors import from_wire, to_wire

log = logging.getLogger("meshd.experts")

PROVIDER_PREFIX = b"/expert/"
REGISTRY_SYNC_TIMEOUT = 2.0  # seconds a listing waits for one replica of the registry
CUT_OFF_MIN = 1.0  # a call its caller cut off with no answer after at least this many seconds ...
CUT_OFF_FACTOR = 4.0  # ... and this many times the server's latency EWMA counts as failed (as an ensemble's straggler)


def check_expert_id(expert_id: object) -> str:
    """``expert_id`` if it is a usable expert id; ValueError otherwise."""
    return check_name(expert_id, "an expert id")


class Experts:
    """The experts a node serves, and its way to others' (service ``experts``, config ``[experts]``)."""

    name = "experts"

    def __init__(self, host: Host, config: ExpertsSection, *, providers: Providers,
                 documents: Documents | None = None):
        self.host = host
        self.config = config
        self._providers = providers
        self._docs = documents
        self.served: dict[str, Served] = {}
        self.measured: dict[str, Servers] = {}  # expert -> latency and failures of each server (peer id text)
        #                                         this node's calls met, whoever made them (for listings)
        self._max_batch: dict[str, int | None] = {}  # expert -> the max_batch the last answer to a call named
        self._scopes: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None
        self._unwritten: str | None = None  # why the last registry write failed (warned once), or None

    # --- the Service shape ---------------------------------------------------------

    def rpc_methods(self) -> dict:
        return {"experts.call": self._serve_call, "experts.info": self._serve_info}

    def control_methods(self) -> dict:
        return control_methods(self)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def status(self) -> dict:
        return {"serving": len(self.served)}

    def close(self) -> None:
        self.served.clear()

    # --- serving -------------------------------------------------------------------------

    async def serve(self, expert_id: str, module, *, kind: str = "module", domain: str | None = None,
                    model: str | None = None, max_batch: int = 32, max_wait_ms: float = 5.0,
                    dim: int | None = None) -> Served:
        """Serve ``module`` as expert ``expert_id`` until :meth:`unserve` or the node stops,
        announced in the DHT (a node without DHT peers still answers calls).  ``dim``: the
        size of the vectors it takes (flow and router experts), said in its info so that an
        ensemble can sample without being told; default the module's ``dim`` attribute."""
        check_expert_id(expert_id)
        if self._nursery is None:
            raise RuntimeError("the experts service is not running")
        if expert_id in self.served:
            raise ValueError(f"expert {expert_id!r} is served here already")
        dim = getattr(module, "dim", None) if dim is None else dim
        params = sum(p.numel() for p in module.parameters()) if hasattr(module, "parameters") else 0
        info = {"expert": expert_id, "kind": kind, "domain": domain, "model": model, "params": params,
                "max_batch": max_batch}
        if type(dim) is int and dim > 0:
            info["dim"] = dim
        served = Served(expert_id, module, kind=kind, info=info, max_batch=max_batch, max_wait=max_wait_ms / 1000,
                        max_queue=self.config.max_queue, max_queue_per_peer=self.config.max_queue_per_peer)
        self.served[expert_id] = served
        scope = self._scopes[expert_id] = trio.CancelScope()

        me, since = str(self.host.peer_id), time.time()

        def beat(tx) -> None:
            load = served.load()
            tx.set([expert_id, "servers", me], {"since": since, "seen": time.time(),
                                               "load": {k: load[k] for k in HEARTBEAT_LOAD}})

        async def heartbeats() -> None:
            while True:
                await trio.sleep(self.config.heartbeat)
                await self._write_registry(beat)

        async def keep() -> None:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(heartbeats)
                    await served.run()

        self._nursery.start_soon(keep)
        try:  # a record few nodes took (a node that just connected) the DHT provides again soon
            await self._providers.provide(PROVIDER_PREFIX + expert_id.encode())
        except DhtError as exc:
            log.info("expert %s: not announced yet (%s); the DHT retries", expert_id, exc)
        about = {k: v for k, v in info.items() if k != "expert" and v is not None}

        def register(tx) -> None:
            tx.set([expert_id, "about"], about)
            beat(tx)

        await self._write_registry(register)
        return served

    def unserve(self, expert_id: str) -> None:
        """Stop serving ``expert_id`` (callers find its other servers)."""
        if self.served.pop(expert_id, None) is not None:
            self._scopes.pop(expert_id).cancel()
            self._providers.unprovide(PROVIDER_PREFIX + expert_id.encode())
            if self._nursery is not None:
                me = str(self.host.peer_id)
                self._nursery.start_soon(self._write_registry, lambda tx: tx.delete([expert_id, "servers", me]))

    # --- the registry ----------------------------------------------------------------------

    async def _registry(self) -> Replica | None:
        """The registry document (created, readable by anyone, if it is ours and new), or None
        without the crdt service."""
        if self._docs is None:
            return None
        return await open_registry(self._docs, self.config.registry or "experts")

    async def _write_registry(self, fill) -> None:
        """Write this node's part of the registry (``fill``); never raises for it.  A write
        refused (the registry's owner did not let this node write, a full disk, the document
        out of reach) is logged, with a warning the first time for each reason, and serving
        goes on: callers still find the experts through the DHT."""
        try:
            replica = await self._registry()
            if replica is not None:
                self._docs.write(replica, fill)
        except Exception as exc:  # noqa: BLE001  (the crdt service's DocError, RPC failures: the registry is advisory)
            reason = str(exc) or type(exc).__name__
            (log.debug if reason == self._unwritten else log.warning)(
                "experts registry %s: not written (%s); experts served here are found through the DHT",
                self.config.registry or "experts", reason)
            self._unwritten = reason
        else:
            self._unwritten = None

    async def registry(self) -> dict:
        """What the registry lists, brought up to date with its replicas once: expert id ->
        {"about": kind, domain, model, params, ..., "servers": {peer: {"since", "seen", "load"}},
        "rejected": [keys]}; ``servers`` holds only the rows their own server wrote, the
        others are ``rejected`` (:func:`.registry.read_registry`); see :func:`live_servers`
        for which servers are still there."""
        replica = await self._registry()
        if replica is None:
            return {}
        await catch_up(self._docs, replica, timeout=REGISTRY_SYNC_TIMEOUT)
        listing = read_registry(replica.doc)
        rejected = sum(len(entry["rejected"]) for entry in listing.values())
        if rejected:
            log.info("experts registry %s: %d server rows ignored (not written by the server they name)",
                     replica.ref, rejected)
        return listing

    def _served(self, arg: object) -> Served:
        expert_id = field(arg, "expert", str)
        served = self.served.get(expert_id)
        if served is None:
            raise NotFound(f"expert {expert_id!r:.60} is not served here")
        return served

    async def _serve_call(self, arg, ctx) -> dict:
        served = self._served(arg)
        op = field(arg, "op", str)
        config = self.config
        inputs = from_wire(field(arg, "inputs", list), max_tensors=config.max_tensors,
                           max_bytes=config.max_request_bytes)
        peer = ctx.peer.key if isinstance(ctx.peer, PeerId) else b""
        outputs, batch = await served.call(peer, op, inputs, timeout=config.call_timeout)
        return {"outputs": to_wire(outputs), "batch": batch, "max_batch": served.max_batch}

    async def _serve_info(self, arg, ctx) -> dict:
        served = self._served(arg)
        return {**served.info, "load": served.load()}

    # --- calling ---------------------------------------------------------------------------

    async def servers(self, expert_id: str, count: int = 20) -> list[PeerId]:
        """The peers that announce ``expert_id`` (this node first if it serves it)."""
        check_expert_id(expert_id)
        found = [PeerId(self.host.peer_id.key)] if expert_id in self.served else []
        try:
            contacts = await self._providers.find_providers(PROVIDER_PREFIX + expert_id.encode(), count)
        except DhtError as exc:
            log.debug("expert %s: provider lookup failed: %s", expert_id, exc)
            contacts = []
        return found + [PeerId(c.public_key) for c in contacts if c.public_key != self.host.peer_id.key]

    async def call(self, peer: PeerId, expert_id: str, op: str, inputs: list, *,
                   timeout: float | None = None) -> tuple[list, int]:
        """``peer``'s answer for ``inputs`` to expert ``expert_id`` (op ``op``):
        the output tensors, each with the inputs' rows first, and the rows of the
        batch they ran in.  Raises the peer's RpcError (NotFound: it does not
        serve that expert; InvalidArgument: a malformed reply, or outputs without
        the inputs' rows), or trio.TooSlowError past ``timeout`` (default
        ``call_timeout``).  What the answer says of the server's ``max_batch`` is
        kept for :meth:`max_batch`.  Each call's latency
        or failure is kept in :attr:`measured` (what ``experts.ls`` shows); one the caller
        cut off counts as failed only past ``CUT_OFF_MIN`` and ``CUT_OFF_FACTOR`` × the
        server's EWMA (a hedge that lost is not the server's fault)."""
        stats = self.measured.setdefault(expert_id, Servers())
        started = trio.current_time()
        try:
            answer = await self._call(peer, expert_id, op, inputs, timeout)
        except (RpcError, trio.TooSlowError, OSError):
            stats.observe(str(peer), trio.current_time() - started, False, trio.current_time())
            raise
        except trio.Cancelled:  # the caller gave up: a hedge another server won, or a straggler cut off
            waited = trio.current_time() - started
            if waited >= max(CUT_OFF_MIN, CUT_OFF_FACTOR * (stats.ewma(str(peer)) or 0.0)):
                stats.observe(str(peer), waited, False, trio.current_time())
            raise
        stats.observe(str(peer), trio.current_time() - started, True, trio.current_time())
        return answer

    def max_batch(self, expert_id: str) -> int | None:
        """The most rows a batch of ``expert_id`` holds, as the server of the last answer
        to a call of it said (None before one did, or if it did not say)."""
        return self._max_batch.get(expert_id)

    async def _call(self, peer: PeerId, expert_id: str, op: str, inputs: list, timeout: float | None):
        timeout = self.config.call_timeout if timeout is None else timeout
        if peer.key == self.host.peer_id.key:
            served = self.served.get(expert_id)
            if served is None:
                raise NotFound(f"expert {expert_id!r} is not served here")
            with trio.fail_after(timeout):
                answer = await served.call(peer.key, op, list(inputs), timeout=timeout)
            self._max_batch[expert_id] = served.max_batch
            return answer
        with trio.fail_after(timeout):
            reply = await self.host.rpc.call(peer, "experts.call",
                                             {"expert": expert_id, "op": op, "inputs": to_wire(inputs)},
                                             timeout=timeout)
        outputs = from_wire(field(reply, "outputs", list), max_tensors=self.config.max_tensors,
                            max_bytes=self.config.max_request_bytes)
        batch, max_batch = reply.get("batch"), optional(reply, "max_batch", int)
        if type(batch) is not int:
            raise InvalidArgument("a reply names the rows of its batch")
        if max_batch is not None and max_batch < 1:
            raise InvalidArgument("a reply's max_batch is at least 1 row")
        rows = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else None
        if rows is not None and any(o.dim() == 0 or o.shape[0] != rows for o in outputs):
            raise InvalidArgument(f"every output of a reply has the call's {rows} rows first")
        self._max_batch[expert_id] = max_batch
        return outputs, batch

    async def info(self, peer: PeerId, expert_id: str, *, timeout: float = 5.0) -> dict:
        """What ``peer`` says of expert ``expert_id`` (kind, domain, params, model, load)."""
        if peer.key == self.host.peer_id.key:
            return await self._serve_info({"expert": expert_id}, None)
        reply = await self.host.rpc.call(peer, "experts.info", {"expert": expert_id}, timeout=timeout)
        if not isinstance(reply, dict):
            raise InvalidArgument("an expert's info is a map")
        return reply

