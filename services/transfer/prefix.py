"""A prefill engine's KV prefix to and from a kvstore, for any CP layout (the services stay CP-agnostic).

    load     blocks [first, n) of a prompt from the kvstore into the request's blocks on every rank
    offload  the prompt's whole blocks the kvstore lacks

One rank: straight between its cache and the kvstore. DCP = 1 (PCP ranks holding full replicas): a
load lands in rank 0's cache and is copied to the other ranks' replicas; an offload reads rank 0's.
DCP > 1: through rank 0's staging cache of whole blocks, chunk by chunk, gathered from / scattered to
the ranks holding each token (services/transfer/staging.py). An engine whose ranks are not all DCP
ranks has no staging cache: it recomputes (`ready` is False).
"""

from __future__ import annotations

import logging

from engine.frontend.async_engine import AsyncEngine
from engine.kv.export import kv_regions
from services.transfer import staging
from services.transfer.kvstore_link import KVStoreLink
from services.transfer.nixl_agent import NixlAgent

log = logging.getLogger(__name__)


class PrefixTransfer:
    def __init__(self, engine: AsyncEngine, link: KVStoreLink):
        self.engine, self.link = engine, link
        pc = engine.config.parallel
        self.dcp, self.world = pc.decode_context_parallel_size, pc.world_size
        self.block_size = engine.config.cache.block_size

    @property
    def ready(self) -> bool:
        """Whether this engine can move its prefixes (DCP > 1 needs the staging cache)."""
        return self.dcp == 1 or self.link.staging is not None

    async def setup(self, agent: NixlAgent, num_blocks: int) -> None:
        """DCP engines: a staging cache of `num_blocks` whole blocks on rank 0, registered with `agent`."""
        if self.dcp == 1 or self.world != self.dcp:
            return
        if num_blocks < 1:
            raise ValueError(f"--kvstore-staging-blocks must be >= 1, got {num_blocks}")
        await self.engine.call(lambda core: core.collective_rpc(staging.ensure, num_blocks))
        self.link.set_staging(agent.register(kv_regions(self.engine.core.runner.kv_staging)), num_blocks)

    async def load(self, address: str, hashes: list[bytes], block_ids: list[int], first: int, n: int) -> int:
        """Blocks [first, n) of the prompt into the request's `block_ids` -> how many leading ones arrived."""
        if self.dcp == 1:
            loaded = await self.link.load(address, hashes[first:n], block_ids[first:n])
            if loaded > 0 and self.world > 1:
                landed = block_ids[first:first + loaded]
                await self.engine.call(lambda core: core.collective_rpc("replicate_blocks", landed))
            return loaded
        loaded, size, bs = 0, self.link.staging_blocks, self.block_size
        async with self.link.staging_lock:
            for c0 in range(first, n, size):
                chunk = hashes[c0:min(n, c0 + size)]
                got = await self.link.load(address, chunk, list(range(len(chunk))), staged=True)
                if got:
                    await self.engine.call(lambda core, c0=c0, got=got: core.collective_rpc(
                        staging.scatter, block_ids, c0 * bs, got * bs))
                loaded += got
                if got < len(chunk):
                    break
        return loaded

    async def offload(self, hashes: list[bytes], block_ids: list[int]) -> int:
        """The prompt's whole blocks (`hashes`, at `block_ids`) the kvstore lacks -> how many were stored."""
        if self.dcp == 1:
            return await self.link.offload(hashes, block_ids[: len(hashes)])
        bs, size, stored = self.block_size, self.link.staging_blocks, 0
        try:
            start = await self.link.stored_prefix(hashes)
            async with self.link.staging_lock:
                for c0 in range(start, len(hashes), size):
                    n = min(size, len(hashes) - c0)
                    await self.engine.call(lambda core, c0=c0, n=n: core.collective_rpc(
                        staging.gather, block_ids, c0 * bs, n * bs))
                    stored += await self.link.offload(hashes[c0:c0 + n], list(range(n)), staged=True)
        except Exception as exc:  # noqa: BLE001 - the tier is an optimisation; never fail a request for it
            log.warning("kvstore offload through the staging cache failed (%s: %s)", type(exc).__name__, exc)
        return stored
