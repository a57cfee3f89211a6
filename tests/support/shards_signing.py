"""What the shards format tests share: a fixed signing key, and torch when installed."""

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

try:
    import torch
except ImportError:  # torch is an optional extra
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
PUB = KEY.public_key().public_bytes_raw()
