"""``meshctl``'s commands, one module per capability: ``node`` (the core), then
one per service, named as the service is (``nat``, ``dht``, ``crdt``, ``shards``).
Each module has ``add_parser(subparsers, common)``."""
