"""Signed changes: the entries of a document's hash-linked op log.

A change is one author's transaction on one document: a list of operations
(each the encoding of a small delta, see ``types``), the ids of the changes
its author had seen (``deps``, the heads of its replica), a Lamport clock one
above the highest of those, and the author's wall-clock time (informational).
Its body is msgpack; the author signs ``CONTEXT + body`` with Ed25519; its id
is blake3(body).  :func:`decode_change` checks everything a stranger could get
wrong and raises :class:`ChangeError`; it never unpickles or evaluates.

Operations, by code (``path`` is a list of str map keys from the root; ``seen``
a list of dots ``[lamport, author, index]`` the operation replaces):

===========  ====================================  ==============================
SET 0        ``[0, path, value]``                  last-writer-wins register
ASSIGN 1     ``[1, path, value, seen]``            multi-value register
GROW 2       ``[2, path, total]``                  grow-only counter: author's total
COUNT 3      ``[3, path, up_total, down_total]``   PN-counter: author's totals
ADD 4        ``[4, path, element, seen]``          add-wins set
REMOVE 5     ``[5, path, element, seen]``          add-wins set
DELETE 6     ``[6, path, seen]``                   remove a map key (and its subtree)
GRANT 7      ``[7, role, key]``                    owner only: role writer/reader
REVOKE 8     ``[8, role, key, seen]``              owner only
===========  ====================================  ==============================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import blake3
import msgpack
from nacl.bindings import crypto_sign_open
from nacl.exceptions import CryptoError

from .types import Dot

CONTEXT = b"meshd-crdt-change/1"
VERSION = 1
ID_SIZE = KEY_SIZE = 32
SIGNATURE_SIZE = 64
MAX_CHANGE = 1 << 20  # bytes of one encoded change (the default: callers may pass another)
MAX_OPS = 10_000  # operations in one change (likewise)
MAX_DEPS = 256
MAX_DEPTH = 16  # map levels in a path, and nesting inside a value
MAX_KEY = 256  # bytes of one map key
MAX_SEEN = 100_000  # dots named by one change
MAX_INT = 1 << 63

SET, ASSIGN, GROW, COUNT, ADD, REMOVE, DELETE, GRANT, REVOKE = range(9)
ROLES = ("writer", "reader")
_ARITY = {SET: 3, ASSIGN: 4, GROW: 3, COUNT: 4, ADD: 4, REMOVE: 4, DELETE: 3, GRANT: 3, REVOKE: 4}


class ChangeError(ValueError):
    """A change that is malformed, over a limit, or wrongly signed."""


@dataclass(frozen=True, slots=True)
class Change:
    """A decoded, signature-checked change (or one we made ourselves)."""

    id: bytes
    doc: bytes
    author: bytes
    lamport: int
    deps: tuple[bytes, ...]
    time_ms: int
    ops: list
    wire: bytes  # msgpack [body, signature]: what is stored and sent

    @property
    def key(self) -> bytes:
        """The change's place in sync order: lamport (8 bytes, big-endian) then id."""
        return self.lamport.to_bytes(8, "big") + self.id


def dot_of(change: Change, index: int) -> Dot:
    """The dot of operation ``index`` of ``change``."""
    return (change.lamport, change.author, index)


def sign_change(doc: bytes, author: bytes, lamport: int, deps: list[bytes], time_ms: int,
                ops: list, sign: Callable[[bytes], bytes], *, max_change: int = MAX_CHANGE,
                max_ops: int = MAX_OPS) -> Change:
    """Encode and sign a change; ``sign`` is the author's Ed25519 signing function.

    Raises ChangeError for a change peers would refuse (too large, a bad field):
    over ``max_change`` bytes or ``max_ops`` operations, the limits replicas
    apply in :func:`decode_change`.
    """
    body = msgpack.packb([VERSION, doc, author, lamport, sorted(deps), time_ms, ops], use_bin_type=True)
    if len(body) + SIGNATURE_SIZE + 16 > max_change:
        raise ChangeError(f"change is {len(body)} bytes, over the {max_change}-byte limit; "
                          "split the transaction")
    wire = msgpack.packb([body, sign(CONTEXT + body)], use_bin_type=True)
    # the same checks as every replica, and its view of ops
    return decode_change(wire, verify=False, max_change=max_change, max_ops=max_ops)


def decode_change(wire: object, *, verify: bool = True, max_change: int = MAX_CHANGE,
                  max_ops: int = MAX_OPS) -> Change:
    """Parse and check a change from a peer (or from disk, with ``verify=False``).

    Raises ChangeError for anything malformed: wrong types, limits (at most
    ``max_change`` bytes and ``max_ops`` operations, dots naming operation
    indexes below ``max_ops``), an unknown operation, a bad path or value, or a
    signature that does not verify.
    """
    if not isinstance(wire, bytes) or len(wire) > max_change:
        raise ChangeError(f"a change is a byte string of at most {max_change} bytes")
    try:
        outer = msgpack.unpackb(wire, raw=False, strict_map_key=True, max_bin_len=max_change)
        _require(isinstance(outer, list) and len(outer) == 2, "expected [body, signature]")
        body, sig = outer
        _require(isinstance(body, bytes) and isinstance(sig, bytes) and len(sig) == SIGNATURE_SIZE,
                 "expected a bytes body and a 64-byte signature")
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        if isinstance(exc, ChangeError):
            raise
        raise ChangeError(f"undecodable change: {exc}") from None
    _require(isinstance(fields, list) and len(fields) == 7 and fields[0] == VERSION,
             f"expected a version-{VERSION} change body of 7 fields")
    _, doc, author, lamport, deps, time_ms, ops = fields
    _require(_is_bytes(doc, ID_SIZE) and _is_bytes(author, KEY_SIZE), "bad doc id or author key")
    _require(_is_int(lamport) and lamport >= 1 and _is_int(time_ms), "bad lamport or time")
    _require(isinstance(deps, list) and len(deps) <= MAX_DEPS
             and all(_is_bytes(d, ID_SIZE) for d in deps) and deps == sorted(set(deps)),
             f"deps must be at most {MAX_DEPS} sorted distinct 32-byte ids")
    _require(isinstance(ops, list) and 0 < len(ops) <= max_ops, f"a change has 1 to {max_ops} operations")
    seen = 0
    for op in ops:
        seen += check_op(op, max_ops)
    _require(seen <= MAX_SEEN, f"a change names at most {MAX_SEEN} dots")
    if verify:
        _verify(author, sig, body)
    return Change(blake3.blake3(body).digest(), doc, author, lamport, tuple(deps), time_ms, ops, wire)


def verify_signature(change: Change) -> None:
    """Raise ChangeError unless its author signed ``change`` (one decoded with ``verify=False``)."""
    body, sig = msgpack.unpackb(change.wire, raw=False)
    _verify(change.author, sig, body)


def _verify(author: bytes, sig: bytes, body: bytes) -> None:
    """Raise ChangeError unless ``sig`` is ``author``'s Ed25519 signature of the body.

    libsodium (PyNaCl) verifies in about half the time OpenSSL takes (72
    against 159 µs here), and every replica verifies every change.
    """
    if len(sig) != SIGNATURE_SIZE:  # libsodium takes signature and message as one string
        raise ChangeError("signature does not verify")
    try:
        crypto_sign_open(sig + CONTEXT + body, author)
    except CryptoError:
        raise ChangeError("signature does not verify") from None


def check_op(op: object, max_ops: int = MAX_OPS) -> int:
    """Raise ChangeError unless ``op`` is a well-formed operation (its dots naming
    operation indexes below ``max_ops``); return how many dots it names."""
    if not (isinstance(op, list) and op and type(op[0]) is int and _ARITY.get(op[0]) == len(op)):
        raise ChangeError("unknown or malformed operation: expected [code, ...] with a known code "
                          "and its number of fields")
    code = op[0]
    if code in (GRANT, REVOKE):
        _require(op[1] in ROLES and _is_bytes(op[2], KEY_SIZE), "grant/revoke takes a role and a 32-byte key")
    else:
        check_path(op[1])
    if code in (SET, ASSIGN):
        check_value(op[2])
    elif code == GROW:
        _require(_is_int(op[2]) and op[2] > 0, "a grow-only total is a positive integer")
    elif code == COUNT:
        _require(_is_int(op[2]) and _is_int(op[3]) and op[2] >= 0 and op[3] >= 0,
                 "counter totals are non-negative integers")
    elif code in (ADD, REMOVE):
        check_element(op[2])
    seen = op[-1] if code in (ASSIGN, ADD, REMOVE, DELETE, REVOKE) else []
    _require(isinstance(seen, list) and all(_is_dot(d, max_ops) for d in seen), "seen must be a list of dots")
    return len(seen)


def check_path(path: object) -> None:
    _require(isinstance(path, list) and 0 < len(path) <= MAX_DEPTH
             and all(isinstance(k, str) and 0 < len(k.encode()) <= MAX_KEY for k in path),
             f"a path is 1 to {MAX_DEPTH} non-empty str keys of at most {MAX_KEY} bytes")


def check_element(element: object) -> None:
    _require((type(element) is int and -MAX_INT <= element < MAX_INT) or isinstance(element, (str, bytes)),
             "a set element is an int, str or bytes")


def check_value(value: object, depth: int = 0) -> None:
    """A register value: msgpack scalars, lists and str-keyed dicts, nested at most 16 deep."""
    _require(depth <= MAX_DEPTH, "value nested too deep")
    if value is None or isinstance(value, (bool, str, bytes)):
        return
    if isinstance(value, int):
        _require(-MAX_INT <= value < 1 << 64, "integer out of range")
    elif isinstance(value, float):
        _require(math.isfinite(value), "floats must be finite")
    elif isinstance(value, list):
        for item in value:
            check_value(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _require(isinstance(key, str), "dict keys in values must be str")
            check_value(item, depth + 1)
    else:
        raise ChangeError(f"unsupported value type {type(value).__name__}")


def _is_dot(dot: object, max_ops: int = MAX_OPS) -> bool:
    return (isinstance(dot, list) and len(dot) == 3 and _is_int(dot[0]) and dot[0] >= 1
            and _is_bytes(dot[1], KEY_SIZE) and _is_int(dot[2]) and 0 <= dot[2] < max_ops)


def _is_int(value: object) -> bool:
    return type(value) is int and 0 <= value < MAX_INT


def _is_bytes(value: object, size: int) -> bool:
    return isinstance(value, bytes) and len(value) == size


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ChangeError(message)
