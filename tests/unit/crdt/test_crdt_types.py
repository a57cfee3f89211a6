"""Lattice laws of the CRDT states in crdt/types.py.

States are built by joining small deltas, one per operation, the way replicas
would.  Then join must be commutative, associative and idempotent (compared on
``encode()``), and joining the states of two op sets must equal applying the
union of the ops in any order (any number of times).

A dot names one event, so in well-formed histories a dot always carries the
same payload.  The register and set histories also give one dot several
values (what an equivocating author does); the ORMap histories derive each
update's path, kind and value from its dot, and are causal: a removal comes
after the updates it names.  An ORMap removal joined before the update it
removes is tested on its own at the end.
"""

from __future__ import annotations

import blake3
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crdt.types import (
    GCOUNTER,
    LWW,
    MAP,
    MV,
    PNCOUNTER,
    SET,
    GCounter,
    LWWRegister,
    MVRegister,
    ORMap,
    ORSet,
    PNCounter,
)

SETTINGS = settings(max_examples=100, derandomize=True, deadline=None, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow])

AUTHORS = [bytes([n]) * 32 for n in (1, 2, 3)]
dots = st.tuples(st.integers(1, 4), st.sampled_from(AUTHORS), st.integers(0, 2))
dot_lists = st.lists(dots, max_size=4)

LWW_VALUES = [None, 0, 1, -5, 2**64 - 1, 1.5, True, "x", "y", b"x", [1, "a"], {"k": [None]}]
ITEMS = [0, 1, -1, "a", "b", b"a"]
MAP_KEYS = ["a", "b"]
LEAF_KINDS = [LWW, MV, SET, GCOUNTER, PNCOUNTER]


def _pick(dot, salt: str, choices: list):
    """A payload that is a fixed function of the dot (one event, one payload)."""
    digest = blake3.blake3(salt.encode() + msgpack.packb(list(dot))).digest()
    return choices[int.from_bytes(digest[:4], "big") % len(choices)]


def copy(state):
    return type(state).decode(state.encode())


def joined(*states):
    out = copy(states[0])
    for state in states[1:]:
        out.join(copy(state))
    return out


def enc(state) -> bytes:
    """The canonical bytes of a state's encoding."""
    return msgpack.packb(state.encode(), use_bin_type=True)


def _plain(value):
    """A value with sets made sorted lists, so that it can be packed and compared."""
    if isinstance(value, set):
        return sorted((_plain(v) for v in value), key=lambda v: msgpack.packb(v, use_bin_type=True))
    if isinstance(value, dict):
        return sorted([k, _plain(v)] for k, v in value.items())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def observable(state) -> bytes:
    """What a reader can observe: the value and the live dots (not the tombstones)."""
    live = sorted(map(list, state.dots()))
    return msgpack.packb([_plain(state.value()), live], use_bin_type=True)


# --- deltas ---------------------------------------------------------------------------

def _map_update(root: ORMap, dot) -> None:
    """Apply the update event ``dot`` to ``root`` in place, as Document does."""
    depth = _pick(dot, "depth", [1, 1, 2, 3])
    path = [_pick(dot, f"key{n}", MAP_KEYS) for n in range(depth)]
    kind = _pick(dot, "kind", LEAF_KINDS)
    node = root
    for key in path[:-1]:
        node = node.child(key, MAP, dot)
    leaf = node.child(path[-1], kind, dot)
    if kind == LWW:
        leaf.assign(dot, _pick(dot, "value", LWW_VALUES))
    elif kind in (MV, SET):
        leaf.put(dot, _pick(dot, "item", ITEMS))
    elif kind == GCOUNTER:
        leaf.raise_to(dot[1], _pick(dot, "total", [1, 2, 3, 7]))
    else:
        leaf.inc.raise_to(dot[1], _pick(dot, "up", [0, 1, 4]))
        leaf.dec.raise_to(dot[1], _pick(dot, "down", [0, 2, 5]))


def map_path(dot) -> list[str]:
    depth = _pick(dot, "depth", [1, 1, 2, 3])
    return [_pick(dot, f"key{n}", MAP_KEYS) for n in range(depth)]


def _map_remove_delta(path: tuple, named) -> ORMap:
    """The delta that removes ``named`` dots at and below ``path``."""
    delta = node = ORMap()
    for key in path[:-1]:
        node = node.children.setdefault(key, {}).setdefault(MAP, ORMap())
    node.remove_key(path[-1], named)
    return delta


def delta_of(cls, op):
    """A fresh state holding only the effect of ``op``."""
    delta = cls()
    apply_in_place(delta, op)
    return delta


def apply_in_place(state, op) -> None:
    """Apply ``op`` directly to ``state`` (op-based, the way Document applies changes)."""
    name = op[0]
    if name == "assign":
        state.assign(op[1], op[2])
    elif name == "put":
        state.put(op[1], op[2])
    elif name == "discard":
        state.discard(op[1])
    elif name == "raise":
        state.raise_to(op[1], op[2])
    elif name in ("inc", "dec"):
        getattr(state, name).raise_to(op[1], op[2])
    elif name == "update":
        _map_update(state, op[1])
    elif name == "remove":
        path, named = op[1], op[2]
        node = state
        for key in path[:-1]:
            node = node.children.get(key, {}).get(MAP)
            if node is None:
                return
        node.remove_key(path[-1], named)
    else:  # pragma: no cover
        raise AssertionError(op)


def apply_delta(state, op) -> None:
    """Apply ``op`` by joining its delta (the state-based way)."""
    if op[0] == "remove":
        state.join(_map_remove_delta(op[1], op[2]))
    else:
        state.join(delta_of(type(state), op))


def build(cls, ops):
    state = cls()
    for op in ops:
        apply_delta(state, op)
    return state


# --- op strategies ----------------------------------------------------------------------

lww_ops = st.one_of(
    st.tuples(st.just("assign"), dots, st.sampled_from(LWW_VALUES)),
    st.tuples(st.just("discard"), dot_lists),
)
dotted_ops = st.one_of(  # a dot may carry two items here (an equivocating author)
    st.tuples(st.just("put"), dots, st.sampled_from(ITEMS)),
    st.tuples(st.just("discard"), dot_lists),
)
gcounter_ops = st.tuples(st.just("raise"), st.sampled_from(AUTHORS), st.integers(0, 20))
pncounter_ops = st.tuples(st.sampled_from(["inc", "dec"]), st.sampled_from(AUTHORS), st.integers(0, 20))


@st.composite
def map_histories(draw, max_ops: int = 10):
    """A causal ORMap history: each removal names only dots of earlier updates
    at or below the removed key (what a replica can have observed)."""
    ops, updates = [], []
    for _ in range(draw(st.integers(0, max_ops))):
        if updates and draw(st.integers(0, 3)) == 0:
            target = map_path(draw(st.sampled_from(updates)))
            path = tuple(target[:draw(st.integers(1, len(target)))])
            below = [d for d in updates if tuple(map_path(d)[:len(path)]) == path]
            named = draw(st.lists(st.sampled_from(below), min_size=1, max_size=4, unique=True))
            ops.append(("remove", path, tuple(named)))
        else:
            dot = draw(dots)
            ops.append(("update", dot))
            updates.append(dot)
    return ops


def causal_order(ops: list, order: list[int]) -> list:
    """``ops`` in the order of ``order``, except that each removal waits for
    the updates it names (so the result is a causal order)."""
    out, done, waiting = [], set(), []
    for index in order:
        waiting.append(ops[index])
        progress = True
        while progress:
            progress = False
            for op in list(waiting):
                if op[0] != "remove" or set(op[2]) <= done:
                    waiting.remove(op)
                    out.append(op)
                    if op[0] == "update":
                        done.add(op[1])
                    progress = True
    assert not waiting
    return out


TYPES = {
    "lww": (LWWRegister, lww_ops),
    "mv": (MVRegister, dotted_ops),
    "orset": (ORSet, dotted_ops),
    "gcounter": (GCounter, gcounter_ops),
    "pncounter": (PNCounter, pncounter_ops),
}


def histories(name: str):
    if name == "ormap":
        return map_histories()
    return st.lists(TYPES[name][1], max_size=10)


def cls_of(name: str):
    return ORMap if name == "ormap" else TYPES[name][0]


ALL = list(TYPES) + ["ormap"]


# --- the laws ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_join_laws(name):
    """Join is commutative, associative and idempotent, a ⊔ b bounds both, and
    the join of the states of ops A and ops B is the state of A ∪ B applied in
    any order, some ops twice (for ORMap: any causal order).

    The ORMap case fails today: ORMap.join discards ``other.removed`` only into
    the children that exist at that moment (and only when ``other`` brings new
    tombstones), so where a tombstone ends up depends on the join order.
    """
    cls = cls_of(name)

    @SETTINGS
    @given(histories(name), histories(name), histories(name), st.data())
    def check(ops_a, ops_b, ops_c, data):
        a, b, c = build(cls, ops_a), build(cls, ops_b), build(cls, ops_c)
        ab = joined(a, b)
        assert enc(ab) == enc(joined(b, a))
        assert enc(joined(ab, c)) == enc(joined(a, joined(b, c)))
        assert enc(joined(a, a)) == enc(a)
        assert enc(joined(ab, a)) == enc(ab) == enc(joined(ab, b))
        union = ops_a + ops_b + ops_a[: len(ops_a) // 2]
        order = data.draw(st.permutations(range(len(union))))
        shuffled = causal_order(union, order) if name == "ormap" else [union[i] for i in order]
        assert enc(build(cls, shuffled)) == enc(ab)

    check()


@pytest.mark.parametrize("name", ALL)
def test_op_based_application_and_encoding(name):
    """Applying ops in place (what Document does) gives the state that joining
    their deltas gives, and states survive encode -> msgpack -> decode."""
    cls = cls_of(name)

    @SETTINGS
    @given(histories(name))
    def check(ops):
        joined_state = build(cls, ops)
        in_place = cls()
        for op in ops:
            apply_in_place(in_place, op)
        if name == "ormap":
            # In place, a removal records its tombstones under the removed key only;
            # a joined removal delta spreads them into every child.  Readers see no
            # difference (the encodings are compared in test_join_laws).
            assert observable(in_place) == observable(joined_state)
        else:
            assert enc(in_place) == enc(joined_state)
        data = msgpack.packb(joined_state.encode(), use_bin_type=True)
        back = cls.decode(msgpack.unpackb(data, raw=False))
        assert enc(back) == data
        assert back.value() == joined_state.value()

    check()


def test_ormap_laws_on_observable_state():
    """The ORMap laws on what readers see (value and live dots), tombstones aside:
    in causal histories these hold even where the encodings differ (the ORMap
    case of test_join_laws)."""
    compare = observable

    @SETTINGS
    @given(map_histories(), map_histories(), map_histories(), st.data())
    def check(ops_a, ops_b, ops_c, data):
        a, b, c = build(ORMap, ops_a), build(ORMap, ops_b), build(ORMap, ops_c)
        assert compare(joined(a, b)) == compare(joined(b, a))
        assert compare(joined(joined(a, b), c)) == compare(joined(a, joined(b, c)))
        assert compare(joined(a, a)) == compare(a)
        union = ops_a + ops_b
        order = data.draw(st.permutations(range(len(union))))
        assert compare(build(ORMap, causal_order(union, order))) == compare(joined(a, b))

    check()


# --- plain semantics of each type ---------------------------------------------------------------

A, B = AUTHORS[0], AUTHORS[1]


def test_lww_greatest_dot_wins_and_removal_hides_it():
    reg = LWWRegister()
    reg.assign((1, A, 0), "old")
    reg.assign((2, A, 0), "new")
    reg.assign((1, B, 0), "stale")
    assert reg.value() == "new"
    reg.discard([(2, A, 0)])
    assert reg.value() is None and not reg.live()
    reg.assign((3, B, 0), "newer")
    assert reg.value() == "newer"


def test_lww_same_dot_ties_break_on_value_alike_in_any_order():
    one, two = LWWRegister(), LWWRegister()
    one.assign((1, A, 0), "x")
    one.assign((1, A, 0), "y")
    two.assign((1, A, 0), "y")
    two.assign((1, A, 0), "x")
    assert enc(one) == enc(two)


def test_orset_adds_win_over_unobserved_removes():
    s = ORSet()
    s.put((1, A, 0), "x")
    s.discard(s.dots_of("x"))
    s.put((2, B, 0), "x")  # a concurrent add the remover did not see
    assert s.value() == {"x"}
    s.discard([(1, A, 0)])
    assert s.value() == {"x"}
    assert s.dots_of("x") == [(2, B, 0)]


def test_orset_elements_of_different_types_stay_apart():
    s = ORSet()
    s.put((1, A, 0), 1)
    s.put((1, A, 1), "1")
    s.put((1, A, 2), b"1")
    assert s.value() == {1, "1", b"1"}
    assert s.dots_of(1) == [(1, A, 0)]


def test_mv_register_keeps_concurrent_values_in_dot_order():
    r = MVRegister()
    r.put((2, B, 0), "b")
    r.put((2, A, 0), "a")
    assert r.value() == ["a", "b"]
    r.discard([(2, A, 0), (2, B, 0)])
    r.put((3, A, 0), "c")
    assert r.value() == ["c"]


def test_counters_join_by_maximum_per_author():
    g = GCounter()
    g.raise_to(A, 3)
    g.raise_to(A, 2)
    g.raise_to(B, 4)
    assert g.value() == 7
    p = PNCounter()
    p.inc.raise_to(A, 10)
    p.dec.raise_to(B, 4)
    assert p.value() == 6
    p.discard([(1, A, 0)])  # a removed counter keeps its totals
    assert p.value() == 6


def test_ormap_update_concurrent_with_remove_keeps_the_key():
    m = ORMap()
    m.child("k", LWW, (1, A, 0)).assign((1, A, 0), 1)
    seen = m.subtree_dots("k")
    m.child("k", LWW, (2, B, 0)).assign((2, B, 0), 2)  # concurrent, not in seen
    m.remove_key("k", seen)
    assert m.value() == {"k": 2}
    m.remove_key("k", m.subtree_dots("k"))
    assert m.value() == {}


def test_ormap_nested_remove_resets_the_subtree():
    m = ORMap()
    d1, d2 = (1, A, 0), (1, A, 1)
    m.child("cfg", MAP, d1).child("lr", LWW, d1).assign(d1, 0.1)
    m.child("cfg", MAP, d2).child("tags", SET, d2).put(d2, "x")
    assert m.value() == {"cfg": {"lr": 0.1, "tags": {"x"}}}
    m.remove_key("cfg", m.subtree_dots("cfg"))
    assert m.value() == {}
    d3 = (2, B, 0)
    m.child("cfg", MAP, d3).child("tags", SET, d3).put(d3, "y")
    assert m.value() == {"cfg": {"tags": {"y"}}}


# --- equivocation and out-of-order removals ---------------------------------------------------

def _both_orders(x, y):
    return enc(joined(x, y)), enc(joined(y, x))


@pytest.mark.parametrize("cls", [ORSet, MVRegister], ids=["orset", "mv"])
def test_dotted_entries_join_commutes_for_one_dot_with_two_items(cls):
    """An equivocating author can give one dot two different items (two changes
    at the same lamport).  The join must still commute."""
    x, y = cls(), cls()
    x.put((1, A, 0), "x")
    y.put((1, A, 0), "y")
    xy, yx = _both_orders(x, y)
    assert xy == yx


def test_ormap_join_commutes_for_one_dot_with_two_kinds():
    """The same dot marking a key with two kinds (equivocation): the visible
    kind must not depend on the order."""
    x, y = ORMap(), ORMap()
    x.child("k", LWW, (1, A, 0)).assign((1, A, 0), 1)
    y.child("k", SET, (1, A, 0)).put((1, A, 0), "e")
    xy, yx = _both_orders(x, y)
    assert xy == yx


def test_ormap_join_commutes_when_the_removal_is_joined_first():
    """types.py promises equal states for the same deltas in any order, but a
    removal joined before the update it removes is lost in the child state:
    ORMap.join only discards ``other.removed`` into existing children, and
    children joined in later never see ``self.removed``."""
    dot = (1, A, 0)
    removal = ORMap()
    removal.remove_key("k", [dot])
    update = ORMap()
    update.child("k", SET, dot).put(dot, "x")
    other = ORMap()  # another author's live update keeps the key visible
    other.child("k", SET, (2, B, 0)).put((2, B, 0), "y")
    first = joined(removal, update, other)
    second = joined(update, removal, other)
    assert enc(first) == enc(second)
    assert first.value() == second.value() == {"k": {"y"}}
