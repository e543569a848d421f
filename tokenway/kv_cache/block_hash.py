"""Content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, so equal hashes mean equal whole prefixes, not
just equal blocks. The namespace (the model) is part of every hash, so two models never
share a block. Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

from tokenway.kv_cache.interface import CacheRequest


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], namespace: str) -> bytes:
    """16-byte blake2b of (namespace, parent hash, token ids), each part framed unambiguously."""
    hasher = hashlib.blake2b(digest_size=16)
    namespace_bytes = namespace.encode("utf-8")
    hasher.update(struct.pack("<Q", len(namespace_bytes)))
    hasher.update(namespace_bytes)
    # A flag byte keeps "no parent" distinct from any 16-byte parent.
    hasher.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash)
    hasher.update(array("q", token_ids).tobytes())
    return hasher.digest()


def update_block_hashes(request: CacheRequest, block_size: int, namespace: str) -> None:
    """Append the hashes of the full blocks of request.all_token_ids not hashed yet.

    Incremental: a decoded token that fills a block adds that block's hash on the next call.
    """
    assert block_size > 0
    block_hashes = request.block_hashes
    num_full_blocks = len(request.all_token_ids) // block_size
    for block_index in range(len(block_hashes), num_full_blocks):
        start = block_index * block_size
        parent_hash = block_hashes[-1] if block_hashes else None
        token_ids = request.all_token_ids[start : start + block_size]
        block_hashes.append(hash_block_tokens(parent_hash, token_ids, namespace))
