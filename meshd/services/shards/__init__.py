"""Model shard sync, the service ``shards``: tensors as content-addressed chunks
under a signed manifest.

:mod:`.format` defines the stream, the chunking and the manifest (see its
docstring for the wire format) and reads and writes ``.safetensors`` files
byte for byte; :mod:`.store` keeps chunks in the data dir, shared by all
models, with pins and garbage collection; :class:`Shards` (:mod:`.service`)
publishes (streaming) and fetches (over the sealed TCP bulk lane of
:mod:`meshd.lane` where it can), and :mod:`.control` offers that to
``meshctl shards`` and the client library.
"""

from .format import (
    CHUNK_SIZE,
    CONTEXT,
    DTYPE_SIZES,
    FORMAT_VERSION,
    ChunkEntry,
    ChunkError,
    Encoder,
    Layout,
    Manifest,
    ManifestError,
    SafetensorsFile,
    TensorBuffers,
    TensorEntry,
    chunk_ranges,
    chunks_changed,
    decode_manifest,
    decode_tensors,
    encode_tensors,
    iter_tensor_bytes,
    open_encoder,
    parse_header,
    sign_manifest,
    verify_chunk,
    write_safetensors,
)
from .config import ShardsSection
from .errors import FetchError
from .service import Progress, Shards
from .store import ChunkStore, ChunkWriter, StoreFull

__all__ = [
    "CHUNK_SIZE",
    "CONTEXT",
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "ChunkEntry",
    "ChunkError",
    "ChunkStore",
    "ChunkWriter",
    "Encoder",
    "FetchError",
    "Layout",
    "Manifest",
    "ManifestError",
    "Progress",
    "SafetensorsFile",
    "Shards",
    "ShardsSection",
    "StoreFull",
    "TensorBuffers",
    "TensorEntry",
    "chunk_ranges",
    "chunks_changed",
    "decode_manifest",
    "decode_tensors",
    "encode_tensors",
    "iter_tensor_bytes",
    "open_encoder",
    "parse_header",
    "sign_manifest",
    "verify_chunk",
    "write_safetensors",
]
