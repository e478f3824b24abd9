"""Prefix-block hashes: the one definition shared by router, engines and kvstore.

    hash_0 = H(ROOT, tokens[0:64], extra keys of block 0)        (extra keys: the optional cache salt)
    hash_i = H(hash_{i-1}, tokens[64i:64(i+1)], ())
Only full blocks are hashed. H is xxh3-128 (seed 0) over a canonical byte encoding, so every process,
language or machine computes the same 16 bytes:

    parent (16 B) | n_tokens (u32 LE) | tokens (i32 LE each) | n_extra (u32 LE) | per extra: len (u32 LE) + utf-8
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

BLOCK_SIZE = 64
ROOT = xxhash.xxh3_128_digest(b"pdserve/v1/prefix-root")


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: Sequence[str] = ()) -> bytes:
    """16-byte digest of one full block chained to its parent (None = the fixed root)."""
    buf = bytearray(parent if parent is not None else ROOT)
    buf += struct.pack(f"<I{len(tokens)}i", len(tokens), *tokens)  # struct, not numpy: the router loads no numpy
    buf += struct.pack("<I", len(extra))
    for e in extra:
        raw = e.encode("utf-8")
        buf += struct.pack("<I", len(raw)) + raw
    return xxhash.xxh3_128_digest(bytes(buf))


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE, cache_salt: str | None = None,
                 parent: bytes | None = None, start_block: int = 0) -> list[bytes]:
    """Hashes of every full block of `token_ids` (from `start_block`, chained on `parent`)."""
    out: list[bytes] = []
    n_full = len(token_ids) // block_size
    for i in range(start_block, n_full):
        extra = (cache_salt,) if (i == 0 and cache_salt) else ()
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out


def hex_hashes(hashes: Sequence[bytes]) -> list[str]:
    return [h.hex() for h in hashes]
