"""CRDT types, the signed op log and the sync protocol (issue 5; not built yet).

A library on its own: it never imports meshd, cli, dht or nat.
"""
