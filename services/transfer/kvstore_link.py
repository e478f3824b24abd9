"""The prefill engine's client of the host KV tier: load cached prefixes, offload computed blocks.

A kvstore block is one 64-token block, whole. Single-rank and DCP = 1 engines move it to / from rank 0's
cache directly; DCP engines go through rank 0's staging cache (services/transfer/staging.py), which these
calls address with `staged=True`. The multi-rank sequence around these calls: services/transfer/prefix.py.

Any failure (kvstore gone, transfer error, timeout) degrades to recomputation: a load that fails
reports 0 blocks, an offload that fails is dropped (the blocks are simply not in the tier). Every call
is bounded by `timeout_s`, and a kvstore that failed is skipped for `backoff_s` (a paused kvstore
would otherwise cost every request the full deadline)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from engine.kv.cache import KVCacheSpec
from services.cluster.redis_state import RedisState
from services.transfer.kvstore_client import KVStoreClient
from services.transfer.nixl_agent import NixlAgent

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
        self.clients: dict[tuple[str, bool], KVStoreClient] = {}
        self.num_loaded_blocks = 0
        self.num_offloaded_blocks = 0
        self.num_failures = 0
        self.staging = None  # DCP engines: rank 0's staging cache of whole blocks (services/transfer/staging.py)
        self.staging_blocks = 0
        self.staging_lock = asyncio.Lock()  # one load or offload uses the staging cache at a time

    def set_staging(self, staging_tensors, num_blocks: int) -> None:
        self.staging = self.agent.prep_local(staging_tensors)
        self.staging_blocks = num_blocks

    async def _client(self, address: str, staged: bool = False) -> KVStoreClient:
        c = self.clients.get((address, staged))
        if c is None:
            local = self.staging if staged else self.local
            c = KVStoreClient(address, self.agent, local, self.spec, timeout_s=self.timeout_s)
            await c.connect()
            self.clients[(address, staged)] = c
        return c

    async def _target(self) -> str | None:
        if self.static_address:
            return self.static_address
        if self.state is None:
            return None
        stores = await self.state.instances("kvstore")
        return stores[0].grpc_address if stores else None

    async def load(self, address: str, hashes: Sequence[bytes], block_ids: Sequence[int], staged: bool = False) -> int:
        """The leading stored blocks of `hashes` into `block_ids` (of the staging cache if `staged`)."""
        if not hashes or self._skipped(address):
            return 0
        try:
            n = await (await self._client(address, staged)).load(list(hashes), list(block_ids))
        except Exception as exc:  # noqa: BLE001 - any failure means: compute these tokens instead
            self._forget(address, exc, "load")
            return 0
        self.num_loaded_blocks += n
        return n

    async def stored_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the kvstore holds already (0 when it cannot be asked)."""
        address = None
        try:
            address = await self._target()
            if address is None or self._skipped(address) or not hashes:
                return 0
            return await (await self._client(address)).lookup(list(hashes))
        except Exception as exc:  # noqa: BLE001 - the tier is an optimisation
            self._forget(address, exc, "lookup")
            return 0

    async def offload(self, hashes: Sequence[bytes], block_ids: Sequence[int] | None, staged: bool = False) -> int:
        """Blocks the kvstore lacks, from `block_ids` (of the staging cache if `staged`)."""
        if not hashes or block_ids is None:
            return 0
        address = None
        try:
            address = await self._target()
            if address is None or self._skipped(address):
                return 0
            n = await (await self._client(address, staged)).store(list(hashes), list(block_ids))
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
