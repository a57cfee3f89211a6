"""DiLoCo across in-process meshd nodes: the member that fixes the rosters (the lowest key)
dies without a goodbye, and the survivors go on as one group.

The chaos soak (docs/soak.md) SIGKILLed that member with H=10: the survivors split (one
trained alone, the other took its state every round).  Here the dying node's connections
are not closed (no "node shutting down" to its peers): its socket just goes away, as a
SIGKILLed process's does.  Real QUIC on loopback, tiny models, bounded waits.
"""

from __future__ import annotations

import functools

import pytest
import trio

from learning_members import Progress, fast_config, run_member


@pytest.mark.parametrize("inner_steps,count", [(5, 3), (10, 3), (2, 4)])
async def test_survivors_of_the_roster_fixers_death_train_together(tmp_path, inner_steps, count):
    """Kill (no goodbye) the lowest-key member after round 2: from the first round after its
    death that every survivor contributed to, every survivor contributes to every round
    and they all publish the same hash; and no round after the death takes longer than
    3 x the round clock's floor, or than the round clock's timeout at the death and one
    floor more (a round whose roster still names the dead member waits out the timeout,
    3 x the slowest measured rounds: slow first rounds on a busy machine raise it)."""
    config = fast_config()
    floor = config.learning.round_timeout_min
    progress = Progress()
    async with trio.open_nursery() as nursery:
        member = functools.partial(run_member, inner_steps=inner_steps, count=count)
        first = await nursery.start(member, tmp_path / "n0", None, config, progress, 0)
        members = [first] + [await nursery.start(member, tmp_path / f"n{i}", first.node.address, config,
                                                 progress, i) for i in range(1, count)]
        members.sort(key=lambda m: m.node.peer_id.key)
        gone, survivors = members[0], members[1:]
        await progress.until(lambda: all(m.trainer.last_round() >= 2 for m in members), timeout=60)

        timeout = max(m.trainer.group.clock.timeout() for m in survivors)
        gone.node.close_connections = lambda: None  # die without telling anyone: nothing more leaves
        gone.node.endpoint.send_datagram = lambda data, addr: True  # its socket (no CONNECTION_CLOSE)
        gone.scope.cancel()
        with trio.fail_after(10):
            await gone.stopped.wait()
        killed_at = trio.current_time()
        stopped_at = max(m.trainer.last_round() for m in survivors)
        target = stopped_at + 8
        await progress.until(lambda: all(m.trainer.last_round() >= target for m in survivors), timeout=120)
        nursery.cancel_scope.cancel()

    want = count - 1
    table = {r: [m.rounds.get(r, (None, None, None))[:2] for m in survivors]
             for r in range(0, target + 1)}
    report = "\n".join(f"round {r}: " + ", ".join(f"{d.hex()[:8] if d else None}/{c}" for d, c in row)
                       for r, row in table.items())
    report += f"\nkilled after round {stopped_at}; resyncs {[m.trainer.opt.resyncs for m in survivors]}"
    report += f" taken {[[(t['round'], t['peer'].hex()[:6]) for t in m.trainer.opt.taken_states] for m in survivors]}"
    complete = [r for r, row in table.items() if r > stopped_at and all(c == want for _, c in row)]
    assert complete, f"no round after the death had every survivor contributing\n{report}"
    for r in range(complete[0], target + 1):
        hashes = {m.rounds[r][0] for m in survivors if r in m.rounds}
        contributors = [m.rounds[r][1] for m in survivors if r in m.rounds]
        assert len(hashes) == 1 and contributors == [want] * len(survivors), f"round {r}\n{report}"
    for m in survivors:
        times = [killed_at] + [m.rounds[r][2] for r in sorted(m.rounds) if r > stopped_at]
        worst = max(b - a for a, b in zip(times, times[1:]))
        bound = max(3 * floor, timeout + floor)
        assert worst <= bound, f"a round took {worst:.1f} s after the death (bound {bound:.1f} s)\n{report}"
