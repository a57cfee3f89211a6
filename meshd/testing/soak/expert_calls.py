"""Expert calls in a soak: expert server processes, a caller calling them throughout, one server SIGKILLed.

``servers`` processes (:mod:`meshd.testing.soak.expert_server`, each a node
of its own bootstrapped through the cluster's seed daemon) serve the same
tiny MLP as one expert.  A caller (an in-process node of the driver, as a
script's) makes :class:`meshd.experts.RemoteExpert` calls one after another
until the work's deadline and checks every answer against its own copy of
the MLP.  Once a share ``kill_after`` of the window has passed, the server
that answered last is SIGKILLed (by its PID) and, ``down_time`` s later,
started again on its data dir (the same peer, a new port).  At the end the
caller calls every server directly.

The checks (:func:`expert_checks`): every call was answered correctly or
failed cleanly (``ExpertUnavailable`` or an ``RpcError``) within its bound
(the call timeout, plus a lookup's allowance); every call made while the
killed server was down was answered, by the survivor; no server process
exited but the killed one; and every server answers a direct call at the end.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import trio

import meshd
from .checks import Check
from .mesh import Cluster
from .scripts import Progress, Script, Window, python

BEFORE, DOWN, RESTARTING, AFTER = "before the kill", "while it was down", "while it restarted", "after the restart"


@dataclass
class ExpertPlan:
    """The expert work of a soak: servers, the caller's pace and bounds, when a server dies."""

    servers: int = 2
    expert_id: str = "soak-mlp"
    call_timeout: float = 5.0  # RemoteExpert's timeout for one call
    lookup_grace: float = 10.0  # a call may also look the servers up (DHT, up to 5 s of retries)
    pause: float = 0.05  # between one call's end and the next call
    max_rows: int = 4
    min_window: float = 12.0  # the caller calls this long at least, past the work's deadline if it must
    kill_after: float = 0.3  # the share of the calling window after which a server is SIGKILLed
    down_time: float = 3.0  # seconds before it is started again
    calls_after: int = 10  # calls made once the restarted server serves, past the deadline if need be
    find_timeout: float = 30.0  # bound on finding every server before the calls
    start_timeout: float = 180.0  # bound on one server's start (importing torch took over 60 s at a load of 36)
    max_calls: int = 100_000


@dataclass
class Call:
    phase: str
    seconds: float
    peer: str | None = None  # who answered
    error: str | None = None  # the exception's type, if it failed
    message: str = ""
    correct: bool | None = None  # the answer matched the caller's copy
    clean: bool = True  # failed with an error a caller expects (not a hang, not another exception)


@dataclass
class ExpertLog:
    """What the servers and the caller did."""

    plan: ExpertPlan
    scripts: list[Script] = field(default_factory=list)  # every server process, the restart last
    calls: list[Call] = field(default_factory=list)
    peers: dict[str, str] = field(default_factory=dict)  # server name -> its PeerId
    killed: str | None = None  # the server killed, and after how many calls
    killed_after: int = 0
    survivors: list[str] = field(default_factory=list)  # the PeerIds serving while it was down
    start_failures: list[str] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)  # servers the caller's DHT lookup never found
    final: dict[str, str] = field(default_factory=dict)  # server name -> "ok" or why its direct call failed
    found_after: float | None = None  # seconds from the start until the caller's lookup named every server
    ready_after: list[float] = field(default_factory=list)  # seconds from the start until each first server served
    window: float = 0.0  # seconds the caller called

    def errors(self) -> Counter:
        return Counter(call.error for call in self.calls if call.error)


def server_cmd(plan: ExpertPlan, data_dir: Path, bootstrap: str, config: dict, min_contacts: int) -> list[str]:
    return python("-m", "meshd.testing.soak.expert_server", "--data-dir", str(data_dir), "--bootstrap", bootstrap,
                  "--expert-id", plan.expert_id, "--config", json.dumps(config), "--min-contacts", str(min_contacts))


async def run_expert_calls(cluster: Cluster, plan: ExpertPlan, folder: Path, window: Window, log: ExpertLog,
                           rng: random.Random, config: dict) -> None:
    """Start the servers and the caller and find the servers; once the work has begun, call until
    its deadline (killing and restarting one server on the way), then call each server directly.
    Every server process is killed by its PID when this returns."""
    import torch

    from ...services.experts.remote import ExpertUnavailable, RemoteExpert  # meshd.experts re-exports them
    from .expert_server import IN, expert_module

    progress = Progress()
    bootstrap = cluster.seed.daemon.dial_address
    folder = Path(folder)
    began = trio.current_time()
    reference = expert_module()
    generator = torch.Generator().manual_seed(rng.randrange(2**32))
    live: dict[str, Script] = {}

    async def start(nursery: trio.Nursery, name: str) -> Script | None:
        cmd = server_cmd(plan, folder / name, bootstrap, config, min(len(cluster.slots) - 1, 16))
        script = Script(name + ("'" if name in log.peers else ""), cmd, folder / f"{name}.log", progress)
        log.scripts.append(script)
        if not await script.start(nursery, timeout=plan.start_timeout):
            log.start_failures.append(f"{script.name}: {script.tail_log(3)}")
            return None
        log.peers[name] = script.ready["peer"]
        live[name] = script
        return script

    def sample():
        x = torch.randn(rng.randint(1, plan.max_rows), IN, generator=generator)
        with torch.no_grad():
            return x, reference(x)

    async with trio.open_nursery() as nursery:
        try:
            async with trio.open_nursery() as starts:
                for i in range(plan.servers):
                    starts.start_soon(start, nursery, f"e{i}")
            if log.start_failures:
                return
            log.ready_after = [round(script.ready_at - began, 1) for script in log.scripts]
            caller_config = meshd.Config()
            caller_config.update(config)
            async with meshd.open_node(folder / "caller", listen="127.0.0.1:0", bootstrap=[bootstrap],
                                       config=caller_config) as node:
                await node.connect(bootstrap)
                service = node.service("experts")
                wanted = {meshd.PeerId.from_string(peer): name for name, peer in log.peers.items()}
                found: set = set()
                with trio.move_on_after(plan.find_timeout):
                    while len(found) < len(wanted):  # polls the DHT, as a caller would, until it names them all
                        found |= set(await service.servers(plan.expert_id)) & set(wanted)
                        if len(found) < len(wanted):
                            await trio.sleep(0.2)
                log.not_found = sorted(name for peer, name in wanted.items() if peer not in found)
                log.found_after = trio.current_time() - began
                deadline = await window.wait()
                calling = trio.current_time()
                deadline = max(deadline, calling + plan.min_window)  # a loaded machine started the servers late
                expert = RemoteExpert(node, plan.expert_id, timeout=plan.call_timeout)
                phase = [BEFORE]
                answered_last = [""]  # the PeerId that answered the latest call
                chaos_over = trio.Event()  # the kill and the restart are done (or never happen)

                async def chaos() -> None:
                    try:
                        await kill_and_restart()
                    finally:
                        chaos_over.set()

                async def kill_and_restart() -> None:
                    if len(live) < 2:
                        return  # one server: nobody would answer while it is down
                    await trio.sleep(max(0.0, (deadline - trio.current_time()) * plan.kill_after))
                    name = next((n for n in sorted(live) if log.peers[n] == answered_last[0]), sorted(live)[-1])
                    victim = live.pop(name)
                    log.killed, log.killed_after = name, len(log.calls)
                    log.survivors = [log.peers[n] for n in live]
                    phase[0] = DOWN
                    victim.kill()
                    await victim.reap()
                    await trio.sleep(plan.down_time)  # how long it stays down: chaos timing
                    phase[0] = RESTARTING  # it may serve a little before it says so
                    if await start(nursery, name) is not None:
                        phase[0] = AFTER

                async with trio.open_nursery() as work:
                    work.start_soon(chaos)
                    stop_chaos = work.cancel_scope
                    after = 0
                    for _ in range(plan.max_calls):
                        if trio.current_time() >= deadline and (  # and the restart's calls were made
                                log.killed is None or (chaos_over.is_set() and (phase[0] != AFTER
                                                                                or after >= plan.calls_after))):
                            break
                        x, want = sample()
                        call = Call(phase[0], 0.0)
                        after += call.phase == AFTER
                        t0 = trio.current_time()
                        with trio.move_on_after(plan.call_timeout + plan.lookup_grace) as bound:
                            try:
                                answer = await expert.call(x)
                            except (ExpertUnavailable, meshd.RpcError) as exc:
                                call.error, call.message = type(exc).__name__, str(exc)[:200]
                            except Exception as exc:  # noqa: BLE001 - anything else is a bug: reported, not raised
                                call.error, call.message, call.clean = type(exc).__name__, repr(exc)[:200], False
                            else:
                                call.peer = str(answer.peer)
                                answered_last[0] = call.peer
                                [out] = answer.outputs
                                call.correct = out.shape == want.shape and bool(torch.allclose(out, want, atol=1e-5))
                        if bound.cancelled_caught:
                            call.error, call.clean = "hang", False
                            call.message = f"no answer and no error after {plan.call_timeout + plan.lookup_grace} s"
                        call.seconds = trio.current_time() - t0
                        log.calls.append(call)
                        await trio.sleep(plan.pause)
                    log.window = trio.current_time() - calling
                    if log.killed is None:
                        stop_chaos.cancel()  # the calls ended before the kill: none now
                    # else: a restart under way ends (bounded by its start's timeout) before the final calls
                for name, script in sorted(live.items()):  # each server, directly: does it answer?
                    x, want = sample()
                    try:
                        with trio.fail_after(plan.call_timeout + plan.lookup_grace):
                            outputs, _ = await service.call(meshd.PeerId.from_string(log.peers[name]),
                                                            plan.expert_id, "forward", [x],
                                                            timeout=plan.call_timeout)
                        ok = torch.allclose(outputs[0], want, atol=1e-5)
                        log.final[script.name] = "ok" if ok else "a wrong answer"
                    except (meshd.RpcError, trio.TooSlowError, OSError) as exc:
                        log.final[script.name] = f"{type(exc).__name__}: {str(exc)[:120]}"
        finally:
            with trio.CancelScope(shield=True):
                for script in log.scripts:
                    script.stop()
                    await script.reap()
            nursery.cancel_scope.cancel()


def expert_checks(log: ExpertLog) -> list[Check]:
    """Each call answered correctly or failed cleanly; answered while a server was down; no server crashed."""
    plan = log.plan
    answered = [c for c in log.calls if c.peer is not None]
    wrong = [c for c in answered if not c.correct]
    unclean = [c for c in log.calls if not c.clean]
    slowest = max((c.seconds for c in log.calls), default=0.0)
    failed = Counter(c.error for c in log.calls if c.error)
    ok = bool(answered) and not wrong and not unclean
    detail = (f"{len(answered)} of {len(log.calls)} calls answered, all correct" if not wrong
              else f"{len(wrong)} wrong answers of {len(answered)}")
    detail += (f"; failed cleanly: {dict(failed)}" if failed and not unclean else "")
    detail += f"; slowest {slowest:.2f} s (bound {plan.call_timeout + plan.lookup_grace:.0f} s)"
    if unclean:
        detail += f"; not clean: {[(c.error, c.message) for c in unclean[:3]]}"
    down = [c for c in log.calls if c.phase in (DOWN, RESTARTING)]  # from the kill until it served again
    by_survivor = [c for c in down if c.peer in log.survivors]
    by_restarted = [c for c in down if c.peer is not None and c.phase == RESTARTING and c.peer not in log.survivors]
    unanswered = [c for c in down if c.peer is None]
    while_down = Check("expert calls while a server was down answered by the survivor",
                       log.killed is not None and bool(by_survivor) and not unanswered
                       and all(c.peer in log.survivors for c in down if c.phase == DOWN),
                       f"{log.killed} killed after {log.killed_after} calls; {len(by_survivor)} of {len(down)} calls "
                       f"until it served again answered by the survivor"
                       + (f", {len(by_restarted)} by it once it was back" if by_restarted else "")
                       + (f"; unanswered: {dict(Counter(c.error for c in unanswered))}" if unanswered else "")
                       if log.killed is not None else "no server was killed (the calls ended first)")
    if plan.servers < 2:
        while_down = Check("expert calls while a server was down answered by the survivor", True,
                           "one server: none killed")
    running = [s for s in log.scripts if not s.killed]
    crashed = {s.name: s.crash() for s in log.scripts if s.crash()}
    silent = {name: why for name, why in log.final.items() if why != "ok"}
    return [
        Check("every expert call answered correctly or failed cleanly", ok, detail),
        while_down,
        Check("no expert server exited but the killed one", not crashed,
              f"{len(log.scripts)} server processes, {len(log.scripts) - len(running)} killed" if not crashed
              else f"crashed: {crashed}"),
        Check("every expert server answers at the end", not silent and len(log.final) == len(running)
              and not log.not_found and not log.start_failures,
              (f"{', '.join(sorted(log.final))} answered a direct call" if not silent else f"not answering: {silent}")
              + (f"; never found in the DHT: {log.not_found}" if log.not_found else "")
              + (f"; did not start: {log.start_failures}" if log.start_failures else "")),
    ]
