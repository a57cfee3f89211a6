"""An in-memory network for simulating thousands of DHT nodes in one process.

Every message is encoded and decoded with msgpack, as on the wire, and each
direction of a call waits ``latency`` seconds; run under
``trio.testing.MockClock(autojump_threshold=0)`` those waits cost no real
time, so lookup durations measure round trips.  A dead node never answers:
its callers wait for their own timeout, as they would on a real network.
"""

from __future__ import annotations

import bisect
import random
from collections import Counter

import msgpack
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .ids import Contact
from .network import Refused, Unreachable
from .node import DhtConfig, DhtNode


class SimNetwork:
    """Nodes addressed by public key; ``dead`` ones do not answer, ``slow`` ones answer
    that many seconds late."""

    def __init__(self, latency: float = 0.0):
        self.latency = latency
        self.nodes: dict[bytes, DhtNode] = {}
        self.dead: set[bytes] = set()
        self.slow: dict[bytes, float] = {}
        self.messages = 0
        self.calls: Counter[bytes] = Counter()  # messages sent to each node, dead or alive
        self.methods: Counter[str] = Counter()  # messages sent, by method
        self.in_flight = 0  # calls sent and not answered yet (or hanging on a dead node)
        self._landed = trio.Event()  # set, and replaced, whenever a call ends

    def endpoint(self, public_key: bytes) -> "SimEndpoint":
        """The :class:`~dht.network.Network` one node uses: calls carry its key as the sender."""
        return SimEndpoint(self, public_key)

    async def settle(self) -> None:
        """Return once every task is blocked and no call is in flight: what the nodes
        sent, in the background too, has landed (with no dead nodes, which never answer)."""
        while True:
            landed = self._landed
            await trio.testing.wait_all_tasks_blocked()
            if not self.in_flight:
                return
            await landed.wait()

    async def deliver(self, sender: bytes, contact: Contact, method: str, msg: dict) -> dict:
        self.messages += 1
        self.calls[contact.public_key] += 1
        self.methods[method] += 1
        self.in_flight += 1
        try:
            return await self._answer(sender, contact, method, msg)
        finally:
            self.in_flight -= 1
            self._landed.set()
            self._landed = trio.Event()

    async def _answer(self, sender: bytes, contact: Contact, method: str, msg: dict) -> dict:
        request = msgpack.unpackb(msgpack.packb(msg))
        target = self.nodes.get(contact.public_key)
        if target is None or contact.public_key in self.dead or sender in self.dead:
            await trio.sleep_forever()
        if self.latency or contact.public_key in self.slow:
            await trio.sleep(self.latency + self.slow.get(contact.public_key, 0.0))
        reply = await target.handle(sender, method, request)
        if self.latency:
            await trio.sleep(self.latency)
        return msgpack.unpackb(msgpack.packb(reply))


class SimEndpoint:
    def __init__(self, network: SimNetwork, public_key: bytes):
        self._network = network
        self._key = public_key

    async def call(self, contact: Contact, method: str, msg: dict) -> dict:
        try:
            return await self._network.deliver(self._key, contact, method, msg)
        except (ValueError, TypeError) as exc:  # msgpack refused what was sent
            raise Refused(f"unencodable message: {exc}") from None
        except KeyError:
            raise Unreachable("no such node") from None


def make_nodes(network: SimNetwork, count: int, *, config: DhtConfig | None = None,
               seed: int = 0) -> list[DhtNode]:
    """``count`` nodes with Ed25519 keys drawn from ``seed`` (the same seed
    gives the same network), registered on ``network``."""
    rng = random.Random(seed)
    nodes = []
    for i in range(count):
        key = Ed25519PrivateKey.from_private_bytes(rng.randbytes(32))
        pk = key.public_key().public_bytes_raw()
        node = DhtNode(network.endpoint(pk), pk, key.sign, addrs=lambda i=i: [f"sim:{i}"],
                       config=config, rng=random.Random(rng.getrandbits(64)))
        network.nodes[pk] = node
        nodes.append(node)
    return nodes


def fill_tables(nodes: list[DhtNode], seed: int = 0) -> None:
    """Fill every routing table as a long-running network would have it: for
    each bucket, up to k random nodes from the part of the id space it covers.

    This is how a 10,000-node simulation starts without 10,000 joins; the
    join itself (:meth:`DhtNode.bootstrap`) is tested on smaller networks.
    """
    rng = random.Random(seed)
    by_id = sorted(nodes, key=lambda n: n.contact.num)
    nums = [n.contact.num for n in by_id]
    contacts = [n.own_contact() for n in by_id]
    for node in nodes:
        own, k = node.contact.num, node.config.k
        for index in range(255, -1, -1):
            # Bucket `index` holds the ids that agree with ours above bit `index` and differ at it.
            low = ((own >> index) ^ 1) << index
            lo, hi = bisect.bisect_left(nums, low), bisect.bisect_left(nums, low + (1 << index))
            picks = range(lo, hi) if hi - lo <= k else rng.sample(range(lo, hi), k)
            for i in picks:
                node.table.update(contacts[i])
            mine = (own >> index) << index  # the nearer buckets all lie in our half
            if bisect.bisect_left(nums, mine + (1 << index)) - bisect.bisect_left(nums, mine) <= 1:
                break


def true_closest(nodes: list[DhtNode], target: bytes, k: int, exclude: DhtNode | None = None) -> list[bytes]:
    """The public keys of the ``k`` nodes closest to ``target`` by XOR distance (leaving out
    ``exclude``): what a perfect lookup over ``nodes`` would return."""
    t = int.from_bytes(target, "big")
    ranked = sorted((n for n in nodes if n is not exclude), key=lambda n: n.contact.num ^ t)
    return [n.public_key for n in ranked[:k]]
