"""The prefill engine's side of the host KV tier: load cached prefixes, offload computed blocks.

Any failure (kvstore gone, transfer error, timeout) degrades to recomputation: a load that fails
reports 0 blocks, an offload that fails is dropped (the blocks are simply not in the tier). Every call
is bounded by `timeout_s`, and a kvstore that failed is skipped for `backoff_s` (a paused kvstore
would otherwise cost every request the full deadline)."""

from __future__ import annotations

import logging
import time
from typing import Sequence

from engine.kv.cache import KVCacheSpec
from services.common.nixl_agent import NixlAgent
from services.common.redis_state import RedisState
from services.kvstore.client import KVStoreClient

log = logging.getLogger(__name__)


class KVStoreLink:
    def __init__(self, agent: NixlAgent, local_tensors, spec: KVCacheSpec, state: RedisState | None,
                 static_address: str | None = None, timeout_s: float = 2.0, backoff_s: float = 5.0, metrics=None):
        self.agent, self.spec, self.state = agent, spec, state
        self.local = agent.prep_local(local_tensors)
        self.static_address = static_address
        self.timeout_s, self.backoff_s = timeout_s, backoff_s
        self.metrics = metrics
        self._down_until: dict[str, float] = {}
        self.clients: dict[str, KVStoreClient] = {}
        self.num_loaded_blocks = 0
        self.num_offloaded_blocks = 0
        self.num_failures = 0

    async def _client(self, address: str) -> KVStoreClient:
        c = self.clients.get(address)
        if c is None:
            c = KVStoreClient(address, self.agent, self.local, self.spec, timeout_s=self.timeout_s)
            await c.connect()
            self.clients[address] = c
        return c

    async def _target(self) -> str | None:
        if self.static_address:
            return self.static_address
        if self.state is None:
            return None
        stores = await self.state.instances("kvstore")
        return stores[0].grpc_address if stores else None

    async def load(self, address: str, hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        if not hashes or self._skipped(address):
            return 0
        try:
            n = await (await self._client(address)).load(list(hashes), list(block_ids))
        except Exception as exc:  # noqa: BLE001 - any failure means: compute these tokens instead
            self._forget(address, exc, "load")
            return 0
        self.num_loaded_blocks += n
        return n

    async def offload(self, hashes: Sequence[bytes], block_ids: Sequence[int] | None) -> int:
        if not hashes or block_ids is None:
            return 0
        address = None
        try:
            address = await self._target()
            if address is None or self._skipped(address):
                return 0
            n = await (await self._client(address)).store(list(hashes), list(block_ids))
        except Exception as exc:  # noqa: BLE001 - the tier is an optimisation; never fail a request for it
            self._forget(address, exc, "offload")
            return 0
        self.num_offloaded_blocks += n
        return n

    def _skipped(self, address: str) -> bool:
        return self._down_until.get(address, 0.0) > time.monotonic()

    def _forget(self, address: str | None, exc: BaseException, what: str) -> None:
        self.num_failures += 1
        if self.metrics is not None:
            self.metrics.kvstore_failures.inc()
        log.warning("kvstore %s at %s failed (%s: %s); recomputing instead, skipping it for %.0fs",
                    what, address, type(exc).__name__, exc, self.backoff_s)
        if address is not None:
            self.clients.pop(address, None)
            self._down_until[address] = time.monotonic() + self.backoff_s
