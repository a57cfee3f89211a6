"""Model shard sync: tensors as content-addressed chunks under a signed manifest.

:mod:`meshd.shards.format` defines the stream, the chunking and the manifest;
see its docstring for the wire format.  :mod:`meshd.shards.store` keeps
chunks in the data dir, shared by all models, with pins and garbage collection.
"""

from .format import (
    CHUNK_SIZE,
    CONTEXT,
    DTYPE_SIZES,
    FORMAT_VERSION,
    ChunkEntry,
    ChunkError,
    Layout,
    Manifest,
    ManifestError,
    TensorEntry,
    chunk_ranges,
    chunks_changed,
    decode_manifest,
    decode_tensors,
    encode_tensors,
    iter_tensor_bytes,
    sign_manifest,
    verify_chunk,
    write_safetensors,
)
from .store import ChunkStore, StoreFull

__all__ = [
    "CHUNK_SIZE",
    "CONTEXT",
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "ChunkEntry",
    "ChunkError",
    "ChunkStore",
    "Layout",
    "Manifest",
    "ManifestError",
    "StoreFull",
    "TensorEntry",
    "chunk_ranges",
    "chunks_changed",
    "decode_manifest",
    "decode_tensors",
    "encode_tensors",
    "iter_tensor_bytes",
    "sign_manifest",
    "verify_chunk",
    "write_safetensors",
]
