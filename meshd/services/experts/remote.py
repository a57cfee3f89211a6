"""A remote expert that behaves like a module call: chosen server, hedged, retried.

:class:`RemoteExpert` looks up the peers serving an expert (the DHT, again
every ``refresh_interval``), orders them by measured latency
(:class:`experts.servers.Servers`: EWMA per server; one that failed is not
asked again until its back-off ends, so a dead expert costs an ensemble one
failed call, not one per request), and calls the first.  If it has not answered within the hedge delay (1.5×
the 95th percentile of recent calls) the next one is asked too, and the
first answer wins; a server that fails is dropped from this call and the
next is asked at once.  Every answer and failure is measured, so the next
call starts from the fastest server.  It raises :class:`ExpertUnavailable`
(saying what each server did) when none answered.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import trio

from experts.servers import Servers

from ...identity import PeerId
from ...rpc import RpcError
from .service import Experts, check_expert_id

log = logging.getLogger("meshd.experts")

FIND_WAIT = 5.0  # seconds a caller keeps looking for an expert nobody is known to serve


class ExpertUnavailable(Exception):
    """No server of the expert answered (each one's failure is in the message)."""


@dataclass
class Answer:
    """One call's outcome: the outputs, who answered, after how long, how many servers were asked."""

    outputs: list
    peer: PeerId
    seconds: float
    asked: int
    batch: int


class RemoteExpert:
    """Expert ``expert_id`` as the mesh serves it: ``await expert(*tensors)``."""

    def __init__(self, node, expert_id: str, *, op: str = "forward", timeout: float | None = None,
                 hedge: bool = True):
        self._service: Experts = node.service("experts")
        self.expert_id = check_expert_id(expert_id)
        self.op, self.hedge = op, hedge
        self.timeout = self._service.config.call_timeout if timeout is None else timeout
        self.stats = Servers()
        self._servers: list[PeerId] = []
        self._found_at = -math.inf
        self._lookup = trio.Lock()  # concurrent calls share one lookup

    async def servers(self) -> list[PeerId]:
        """The peers serving the expert, looked up again every ``refresh_interval``
        (or when none are known).  A lookup that finds nobody is repeated, with
        a growing pause, for up to :data:`FIND_WAIT` seconds (or the call
        timeout): an expert announced a moment ago may not be in the DHT yet."""
        async with self._lookup:
            if self._servers and trio.current_time() - self._found_at <= self._service.config.refresh_interval:
                return self._servers
            pause, deadline = 0.05, trio.current_time() + min(FIND_WAIT, self.timeout)
            while True:
                self._servers = await self._service.servers(self.expert_id)
                if self._servers or trio.current_time() + pause > deadline:
                    break
                await trio.sleep(pause)
                pause *= 2
            self._found_at = trio.current_time()
            return self._servers

    async def __call__(self, *inputs):
        """The expert's output for ``inputs`` (a tensor, or a list if it gives several)."""
        outputs = (await self.call(*inputs)).outputs
        return outputs[0] if len(outputs) == 1 else outputs

    async def call(self, *inputs, op: str | None = None) -> Answer:
        """Ask the servers in order of measured latency, hedged and retried (see the module)."""
        servers = await self.servers()
        now = trio.current_time()
        order = [s for s in self.stats.order(servers, now) if not self.stats.backing_off(s, now)]
        if not order:  # none, or each failed just now: do not wait on them again until the back-off ends
            why = "every server failed lately" if servers else "nobody serves it"
            raise ExpertUnavailable(f"expert {self.expert_id!r}: {why}")
        failures: dict[PeerId, str] = {}
        won: list[Answer] = []
        next_server = trio.Event()  # set: ask the next server now (one failed, or the hedge delay passed)

        async def attempt(peer: PeerId, asked: int, cancel: trio.CancelScope) -> None:
            started, ended = trio.current_time(), False
            try:
                outputs, batch = await self._service.call(peer, self.expert_id, op or self.op, list(inputs),
                                                          timeout=self.timeout)
                ended = True
            except (RpcError, trio.TooSlowError, OSError) as exc:
                ended = True
                self.stats.observe(peer, trio.current_time() - started, False, trio.current_time())
                failures[peer] = str(exc) or type(exc).__name__
                next_server.set()
                return
            finally:
                if not ended and not won:  # cut off with no answer (the deadline, or the caller gave up):
                    self.stats.observe(peer, trio.current_time() - started, False, trio.current_time())  # failed
            seconds = trio.current_time() - started
            self.stats.observe(peer, seconds, True, trio.current_time())
            if not won:
                won.append(Answer(outputs, peer, seconds, asked, batch))
                cancel.cancel()

        with trio.move_on_after(self.timeout):
            async with trio.open_nursery() as nursery:
                for asked, peer in enumerate(order, start=1):
                    next_server = trio.Event()
                    nursery.start_soon(attempt, peer, asked, nursery.cancel_scope)
                    with trio.move_on_after(self.stats.hedge_delay() if self.hedge else math.inf):
                        await next_server.wait()
                    if won:
                        break
        if won:
            return won[0]
        self._servers = []  # they all failed: look again next time
        detail = "; ".join(f"{p.short()}: {why}" for p, why in failures.items()) or f"none within {self.timeout} s"
        raise ExpertUnavailable(f"expert {self.expert_id!r}: no server answered ({detail})")
