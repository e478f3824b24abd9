"""Prompt synthesis: token ids whose 64-token blocks are identical exactly where `hash_ids` agree.

    prompt = block(h_0) | block(h_1) | ... | block(h_{n-1}) | tail          (len = input_len exactly)
             └──── n = input_len // 64 full blocks ─────┘   └ input_len % 64 tokens, unique ┘

Every token is a pure function of a 64-bit key, so nothing is stored and any process regenerates
the same prompt:

    block(h)[j] = token(mix(seed(trace, session copy, h) + j·φ))
    tail[j]     = token(mix(seed(trace, session copy, turn) ^ TAIL + j·φ))

The *session copy* (one replay of one trace, an int unique within a run) keys every block. Turns and
subagents of one copy therefore share their prefixes exactly as recorded, while two copies of the
same trace differ from their very first block on, so no chained prefix hash of one copy can match
the other's: copies never share cache (the "per-session marker"). Ids avoid the first
`min_token_id` ids of the vocabulary (special tokens).
"""

from __future__ import annotations

import zlib

import numpy as np

from bench.serving.traces import BLOCK_SIZE, Turn

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TAIL_TAG = np.uint64(0x7A11_7A11_7A11_7A11)
DEFAULT_MIN_TOKEN_ID = 16


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic is the point)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def trace_seed(trace_id: str) -> int:
    return zlib.crc32(trace_id.encode("utf-8"))


class PromptSynth:
    """Makes the prompt of any turn of one session copy. Cheap: one vectorised pass per prompt."""

    def __init__(self, trace_id: str, session_copy: int, *, vocab_size: int,
                 min_token_id: int = DEFAULT_MIN_TOKEN_ID):
        if vocab_size <= min_token_id:
            raise ValueError(f"vocab_size {vocab_size} must exceed min_token_id {min_token_id}")
        if session_copy < 0:
            raise ValueError(f"session_copy must be >= 0, got {session_copy}")
        self.vocab_size = vocab_size
        self.min_token_id = min_token_id
        base = _mix(np.array([trace_seed(trace_id) << 32 | (session_copy & 0xFFFFFFFF)], dtype=np.uint64))
        self._base = _mix(base ^ np.uint64(session_copy >> 32))[0]

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        return _mix(ids.astype(np.uint64) ^ self._base)

    def _tokens(self, keys: np.ndarray, width: int) -> np.ndarray:
        """[n] keys -> [n, width] token ids in [min_token_id, vocab_size)."""
        offsets = np.arange(width, dtype=np.uint64) * _GOLDEN
        raw = _mix(keys[:, None] + offsets[None, :])
        span = np.uint64(self.vocab_size - self.min_token_id)
        return (raw % span).astype(np.int64) + self.min_token_id

    def block(self, hash_id: int) -> list[int]:
        return self._tokens(self._keys(np.array([hash_id], dtype=np.int64)), BLOCK_SIZE)[0].tolist()

    def prompt(self, turn: Turn) -> list[int]:
        """Exactly `turn.input_len` ids: one block per hash id, then a tail unique to this turn."""
        n_blocks = len(turn.hash_ids)
        if n_blocks * BLOCK_SIZE > turn.input_len:
            raise ValueError(f"turn {turn.turn_id}: {n_blocks} blocks do not fit in {turn.input_len} tokens")
        ids = np.asarray(turn.hash_ids, dtype=np.int64)
        blocks = self._tokens(self._keys(ids), BLOCK_SIZE).reshape(-1)
        tail_len = turn.input_len - n_blocks * BLOCK_SIZE
        tail_key = self._keys(np.array([turn.turn_id], dtype=np.int64)) ^ _TAIL_TAG
        tail = self._tokens(_mix(tail_key), tail_len).reshape(-1)
        return np.concatenate([blocks, tail]).tolist()
