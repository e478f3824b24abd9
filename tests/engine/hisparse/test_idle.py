"""An idle HiSparse engine holds nothing: once its last request finished, the AsyncEngine loop hands
the runner the finished ids (one more step) so the request's device pages and hot rows are dropped,
not kept until the next request arrives."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from engine.config.arg_utils import EngineArgs
from engine.frontend.async_engine import AsyncEngine
from tests.helpers.pace import until


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_idle_async_engine_holds_no_hisparse_pages(tiny_code, async_scheduling):
    async def run():
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), kv_cache_dtype="fp8_ds_mla", num_blocks=256,
                                        device="cpu", hisparse={"host_pool_blocks": 48},
                                        async_scheduling=async_scheduling))
        engine.start()
        try:
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            outs = await asyncio.gather(*[_collect(engine.generate(list(range(20 + i, 150 + 7 * i)), params))
                                          for i in range(3)])
            # no request comes after: whatever frees the pages is the idle loop's own last step
            return outs, await until(lambda: _placed_nothing(engine), "the idle engine to drop its pages", period=0.05)
        finally:
            await engine.shutdown()

    outs, hs = asyncio.run(run())
    assert all(len(ids) == 6 for ids in outs)
    assert (hs.num_resident, hs.num_mixed, hs.num_host) == (0, 0, 0)
    assert hs.num_free_device_blocks == hs.num_device_blocks


async def _placed_nothing(engine):
    """The engine's HiSparse figures once no request holds pages or rows; None before."""
    hs = await engine.call(lambda core: core.stats().hisparse)
    idle = (hs.num_resident, hs.num_mixed, hs.num_host) == (0, 0, 0) \
        and hs.num_free_device_blocks == hs.num_device_blocks
    return hs if idle else None


async def _collect(stream) -> list[int]:
    ids: list[int] = []
    async for out in stream:
        ids = list(out.token_ids)
    return ids
