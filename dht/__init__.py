"""Kademlia DHT: ids, routing table, lookups, records, providers (issue 4; not built yet).

A library on its own: it never imports meshd, cli, crdt or nat.
"""
