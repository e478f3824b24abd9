"""Overload and security pieces without processes: admission bounds, the router's retry over full
instances, API keys -> tenants -> cache salts, the router's ASGI guard (401 / 413), loopback defaults."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from engine.kv.hashing import block_hashes
from services.router.flow import _Busy, _on_any
from services.router.guard import ApiKeys, Guard, tenant_cache_salt
from services.router.routing import NoInstance
from services.rpc.admission import Admission
from services.rpc.grpc_server import Overloaded, Unauthenticated


def test_admission_bounds_inflight_and_queued_and_gives_slots_back():
    gate = Admission("decode", max_inflight=2, max_queued=1, retry_after_s=0.5)
    with gate.inflight():
        with gate.inflight():
            with pytest.raises(Overloaded) as exc:
                with gate.inflight():
                    pass
            assert exc.value.retry_after_s == 0.5 and "decode" in str(exc.value)
    assert gate.num_inflight == 0
    with pytest.raises(Overloaded):
        gate.acquire(3)  # all or nothing
    assert gate.num_inflight == 0
    with pytest.raises(RuntimeError):
        with gate.queued():
            assert gate.num_queued == 1
            with pytest.raises(Overloaded):
                with gate.queued():
                    pass
            raise RuntimeError("the slot is given back on errors too")
    assert gate.num_queued == 0 and gate.num_rejected == 3
    with pytest.raises(Overloaded):
        gate.check_waiting(1)
    gate.check_waiting(0)


class _Inst:
    def __init__(self, instance_id: str):
        self.instance_id = instance_id


def _picker(ids: list[str]):
    seen: list[frozenset] = []

    async def pick(exclude: frozenset):
        seen.append(exclude)
        left = [i for i in ids if i not in exclude]
        if not left:
            raise NoInstance("none")
        return _Inst(left[0])
    return pick, seen


def test_a_full_instance_is_skipped_for_the_next_one():
    pick, seen = _picker(["d0", "d1"])

    async def attempt(inst):
        if inst.instance_id == "d0":
            raise _Busy("d0", 2.0)
        return inst.instance_id

    assert asyncio.run(_on_any("decode", pick, attempt)) == "d1"
    assert seen == [frozenset(), frozenset({"d0"})]


def test_all_instances_full_is_overloaded_with_the_shortest_retry_after():
    pick, _ = _picker(["d0", "d1"])

    async def attempt(inst):
        raise _Busy(inst.instance_id, 3.0 if inst.instance_id == "d0" else 1.5)

    with pytest.raises(Overloaded) as exc:
        asyncio.run(_on_any("decode", pick, attempt))
    assert exc.value.retry_after_s == 1.5 and "2 tried" in str(exc.value)
    empty, _ = _picker([])
    with pytest.raises(NoInstance):  # nothing registered at all is 503, not 429
        asyncio.run(_on_any("decode", empty, attempt))


def test_api_keys_name_tenants_and_reject_wrong_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nk-alpha-2:alpha\n\nk-beta:beta  # trailing comment\n")
    keys = ApiKeys.from_sources(["k-alpha-1:alpha", "k-solo"], str(f))
    assert keys.tenant("Bearer k-alpha-1") == keys.tenant("bearer k-alpha-2") == "alpha"
    assert keys.tenant("Bearer k-beta") == "beta"
    solo = keys.tenant("Bearer k-solo")
    assert solo.startswith("key-") and "k-solo" not in solo
    for bad in (None, "", "Bearer", "Bearer k-alph", "Bearer k-alpha-1x", "Basic k-beta", "k-beta"):
        with pytest.raises(Unauthenticated):
            keys.tenant(bad)
    assert ApiKeys().tenant(None) is None and not ApiKeys().enabled
    with pytest.raises(ValueError):
        ApiKeys([":tenant"])


def test_tenant_salt_separates_tenants_prefix_hashes():
    ids = list(range(300))
    alpha, beta = tenant_cache_salt("alpha", None), tenant_cache_salt("beta", None)
    assert block_hashes(ids, 64, alpha) == block_hashes(ids, 64, tenant_cache_salt("alpha", None))
    assert not set(block_hashes(ids, 64, alpha)) & set(block_hashes(ids, 64, beta))
    # a client cannot pick a salt that lands in another tenant's blocks
    assert tenant_cache_salt("beta", "x") != alpha and tenant_cache_salt("beta", "tenant:alpha") != alpha
    assert tenant_cache_salt(None, "mine") == "mine"


def _guarded_app(keys: ApiKeys, max_body: int) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"tenant": request.state.tenant, "size": len(await request.body())}

    @app.get("/health")
    async def health():
        return {"ok": True}

    app.add_middleware(Guard, keys=keys, max_body_bytes=max_body)
    return app


def test_guard_answers_401_and_413_before_the_endpoint():
    app = _guarded_app(ApiKeys(["sk-1:acme"]), 1000)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            ok = await c.post("/v1/echo", content=b"x" * 10, headers={"authorization": "Bearer sk-1"})
            assert ok.status_code == 200 and ok.json() == {"tenant": "acme", "size": 10}
            for headers in ({}, {"authorization": "Bearer sk-2"}):
                r = await c.post("/v1/echo", content=b"{}", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
            assert (await c.get("/health")).status_code == 200  # probes need no key
            big = await c.post("/v1/echo", content=b"x" * 1001, headers={"authorization": "Bearer sk-1"})
            assert big.status_code == 413 and "1000 bytes" in big.json()["error"]["message"]

            async def chunks():  # no Content-Length: counted as it arrives
                for _ in range(11):
                    yield b"x" * 100
            r = await c.post("/v1/echo", content=chunks(), headers={"authorization": "Bearer sk-1"})
            assert r.status_code == 413

            async def small():
                for _ in range(3):
                    yield b"y" * 100
            r = await c.post("/v1/echo", content=small(), headers={"authorization": "Bearer sk-1"})
            assert r.status_code == 200 and r.json()["size"] == 300
    asyncio.run(run())


def test_internal_services_bind_loopback_unless_asked():
    from services.decode.main import parse_args as decode_args
    from services.kvstore.main import parse_args as kvstore_args
    from services.prefill.main import parse_args as prefill_args
    from services.rpc.net import advertise_host

    for parse in (decode_args, prefill_args):
        a = parse(["--model", "m"])
        assert a.host == "127.0.0.1" and a.max_inflight_requests >= 1 and a.max_queued_requests >= 1
        assert parse(["--model", "m", "--host", "0.0.0.0"]).host == "0.0.0.0"
    assert kvstore_args(["--model", "m", "--pool-gib", "1"]).host == "127.0.0.1"
    assert advertise_host(None, "127.0.0.1") == "127.0.0.1"  # bound to loopback: advertise loopback
    assert advertise_host("10.0.0.5", "0.0.0.0") == "10.0.0.5"


def test_kv_handles_with_too_few_blocks_or_foreign_ranks_are_refused():
    from proto.pdserve.v1 import prefill_pb2
    from services.transfer.pull import check_rank_blocks, rank_num_tokens, token_home

    for n, dcp, inter in ((130, 1, 1), (1000, 2, 64), (1000, 4, 16), (77, 3, 5)):
        for r in range(dcp):
            assert rank_num_tokens(n, r, dcp, inter) == sum(token_home(i, dcp, inter)[0] == r for i in range(n))
    kv = prefill_pb2.KVHandle(num_tokens=130, ranks=[prefill_pb2.RankPages(rank=0, block_ids=[4, 5, 6])])
    check_rank_blocks(kv, 1, 1, 64)  # 130 tokens: 3 blocks
    del kv.ranks[0].block_ids[-1]
    with pytest.raises(ValueError, match="needs 3"):
        check_rank_blocks(kv, 1, 1, 64)
    kv.ranks[0].rank = 2
    with pytest.raises(ValueError, match="outside"):
        check_rank_blocks(kv, 1, 1, 64)


def test_kvstore_index_backlog_is_bounded_while_redis_is_away(monkeypatch):
    from services.kvstore import server
    from services.kvstore.pool import BlockPool

    monkeypatch.setattr(server, "MAX_INDEX_BACKLOG", 8)
    sv = server.KVStoreServicer.__new__(server.KVStoreServicer)  # only the index queue and the pool
    sv.pool, sv.instance_id, sv.block_ttl_s = BlockPool(4), "kv", 60.0

    class _Redis:
        def __init__(self):
            self.calls = []

        async def add_blocks(self, instance_id, hashes, ttl_s):
            self.calls.append(("stored", sorted(hashes)))

        async def remove_blocks(self, instance_id, hashes):
            self.calls.append(("removed", sorted(hashes)))

    async def run():
        sv._index_queue = asyncio.Queue()
        for i in range(100):  # Redis away: updates pile up ...
            res, _, _ = sv.pool.reserve([bytes([i]) * 16], 10.0, 0.0)
            sv._queue_index("stored", sv.pool.commit(res.reservation_id, 0.0).stored)
            assert sv._index_queue.qsize() <= 8  # ... but never beyond the bound
        sv.state = _Redis()
        task = asyncio.create_task(sv._index_loop())
        while not sv._index_queue.empty():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        task.cancel()
        return sv.state.calls

    calls = asyncio.run(run())
    # the backlog collapsed into one re-publish of what the pool holds now (then the later updates)
    assert ("stored", sorted(sv.pool.stored_hashes())) in calls and len(calls) <= 8


def test_decode_graphs_default_to_the_decode_service_only():
    """A prefill engine emits one token per request: it decodes eagerly unless asked; the decode service
    keeps the engine default (CUDA graphs on CUDA)."""
    from services.decode.main import parse_args as decode_args
    from services.prefill.main import parse_args as prefill_args

    assert prefill_args(["--model", "m"]).enforce_eager is True
    assert prefill_args(["--model", "m", "--cuda-graphs"]).enforce_eager is False
    assert decode_args(["--model", "m"]).enforce_eager is None
