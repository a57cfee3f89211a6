"""The namespace validators a node applies to records, and the built-in set."""

from __future__ import annotations

from typing import Mapping, Protocol

from .names import NameValidator
from .records import OpenValidator, OwnedValidator, Record, RecordError, namespace_of


class Validator(Protocol):
    """The rules of one namespace."""

    def validate(self, record: Record, now: float) -> None:
        """Raise RecordError unless the namespace admits ``record`` at ``now``."""

    def better(self, a: Record, b: Record) -> bool:
        """Whether ``a`` should replace ``b``; both are valid and share a key.
        A strict total order, so that every replica keeps the same one (except
        between the owners of a ``/name/``, where the one held stays)."""


class Validators:
    """The registry of namespace validators a node applies to records."""

    def __init__(self, validators: Mapping[bytes, Validator] | None = None) -> None:
        self._by_namespace: dict[bytes, Validator] = {}
        for namespace, validator in (validators or {}).items():
            self.register(namespace, validator)

    @classmethod
    def default(cls) -> Validators:
        """The built-in namespaces: ``open``, ``owned`` and ``name`` (:mod:`dht.names`)."""
        return cls({b"open": OpenValidator(), b"owned": OwnedValidator(), b"name": NameValidator()})

    def register(self, namespace: bytes, validator: Validator) -> None:
        """Add ``validator`` for ``namespace`` (e.g. ``b"models"``); raises
        ValueError for a malformed or already registered namespace."""
        if not namespace or b"/" in namespace:
            raise ValueError(f"a namespace is a non-empty name without '/', not {namespace!r}")
        if namespace in self._by_namespace:
            raise ValueError(f"namespace {namespace!r} already has a validator")
        self._by_namespace[namespace] = validator

    def _validator_for(self, key: bytes) -> Validator:
        namespace = namespace_of(key)
        try:
            return self._by_namespace[namespace]
        except KeyError:
            known = ", ".join(f"/{ns.decode(errors='replace')}/" for ns in sorted(self._by_namespace))
            raise RecordError(f"unknown namespace {namespace!r}; known: {known or 'none'}") from None

    def validate(self, record: Record, now: float) -> None:
        """Raise RecordError unless the record's namespace admits it at ``now``."""
        self._validator_for(record.key).validate(record, now)

    def better(self, a: Record, b: Record) -> bool:
        """Whether valid ``a`` should replace valid ``b`` (same key)."""
        if a.key != b.key:
            raise ValueError("only records for the same key can be compared")
        return self._validator_for(a.key).better(a, b)

    def best(self, records: list[Record]) -> Record:
        """The record that beats all others (valid, same key) whatever their
        order, or the namespace's own choice if it has one (``/name/``)."""
        if not records:
            raise ValueError("best() needs at least one record")
        choose = getattr(self._validator_for(records[0].key), "best", None)
        if choose is not None:
            return choose(records)
        best = records[0]
        for record in records[1:]:
            if self.better(record, best):
                best = record
        return best
