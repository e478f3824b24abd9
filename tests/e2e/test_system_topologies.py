"""Other topologies end to end: a PCP=DCP=2 prefill engine feeding decode over NIXL (token re-layout of
DCP shards), and two prefill instances (single-rank, or PCP=2) + a kvstore (prefix-aware routing; the
kvstore tier after the prefill instances evicted a session's prefix)."""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import LLM, SamplingParams
from engine.kv.hashing import block_hashes
from services.launch import launcher
from tests.helpers import system

pytestmark = pytest.mark.xdist_group("topologies")  # its own unit of work: the longest e2e module


def _text(tok, start: int, n: int) -> list[int]:
    import argparse
    import difflib
    import typing
    ids = tok.encode("".join(inspect.getsource(m) for m in (difflib, argparse, typing)))
    assert len(ids) >= start + n, "the corpus is too short for this slice"
    return ids[start:start + n]


@pytest.fixture(scope="module")
def offline(tiny_code) -> LLM:
    return LLM(str(tiny_code), kv_cache_dtype="fp8_ds_mla", num_blocks=256)


def _instances(dep) -> dict[str, list]:
    out: dict[str, list] = {}
    for i in system.with_state(dep.redis_url, lambda s: s.instances()):
        out.setdefault(i.role, []).append(i)
    return out


def _indexed(dep, ids: list[int]) -> int:
    """Blocks of `ids`' longest prefix that some prefill instance holds, per the Redis block index."""
    held = system.with_state(dep.redis_url, lambda s: s.lookup_prefix(block_hashes(ids), role="prefill"))
    return max(held.values(), default=0)


def _two_prefills(tmp_path_factory, pcp: int, dcp: int) -> launcher.Deployment:
    """Two prefill instances of 24 KV blocks each (PCP x DCP ranks), a kvstore, a decode and a router."""
    topo = system.topology(tmp_path_factory.mktemp("cache"), prefill={"num-blocks": 24})
    topo["services"]["prefill"]["replicas"] = 2
    if pcp > 1:
        topo["services"]["prefill"].update(prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp)
    return system.launch(topo)


@pytest.fixture(scope="module")
def pcp2_dcp2(tmp_path_factory):
    """The PCP=DCP=2 deployment, shared by the last eviction case and the DCP re-layout test after it."""
    dep = _two_prefills(tmp_path_factory, 2, 2)
    yield dep
    launcher.down(dep)


@pytest.mark.parametrize("pcp,dcp", [(1, 1), (2, 1), (2, 2)], ids=["single-rank", "pcp2", "pcp2-dcp2"])
def test_prefix_routing_and_kvstore_after_eviction(request, tmp_path_factory, offline, pcp, dcp):
    """pcp2: the prefill instances are PCP=2 engines; a prefix loaded from the kvstore lands in rank 0's
    cache and is replicated to rank 1 before the prompt's remainder is computed. pcp2-dcp2: blocks are
    sharded; offload and load go through rank 0's staging cache (gathered / scattered over the ranks)."""
    shared = (pcp, dcp) == (2, 2)
    dep = request.getfixturevalue("pcp2_dcp2") if shared else _two_prefills(tmp_path_factory, pcp, dcp)
    try:
        url = dep.endpoints()["router"][0]
        body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        session = _text(offline.tokenizer, 1000, 10 * 64 + 5)
        assert system.post(url, "/v1/completions", {**body, "prompt": session})[0] == 200
        prefills = _instances(dep)["prefill"]

        def hits() -> list[float]:
            return [system.metric(p.metrics_address, "pdserve:prefix_cache_hits_total") for p in prefills]

        before = hits()
        # the prefill publishes its blocks to the index a moment after answering: route turn 2 once it has
        assert system.wait_for(lambda: _indexed(dep, session) >= 10), "the prefix never reached the index"
        turn2 = session + _text(offline.tokenizer, 5000, 40)
        status, warm = system.post(url, "/v1/completions", {**body, "prompt": turn2})
        assert status == 200 and warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * 64
        gained = system.wait_for(lambda: [h - b for h, b in zip(hits(), before)] if max(hits()) > max(before) else None)
        assert sorted(gained)[0] == 0 and sorted(gained)[1] >= 10 * 64, "turn 2 must go to the instance with the prefix"

        # push the session out of both prefill instances (24 blocks each, of 64·DCP tokens); the kvstore keeps it.
        # Fillers go two at a time (the router counts one in flight and sends the other elsewhere; sequential
        # fillers tie on cost and split at random, which once left one instance holding the session) until
        # the block index says no prefill instance holds any of the session's prefix.
        def evicted() -> bool:
            return _indexed(dep, session) == 0

        def send(i: int) -> int:
            filler = _text(offline.tokenizer, 20000 + 900 * i, 15 * 64)
            return system.post(url, "/v1/completions", {**body, "prompt": filler})[0]

        sent = 0
        with ThreadPoolExecutor(max_workers=2) as pool:
            while sent < 24 * dcp and not evicted():
                assert list(pool.map(send, (sent, sent + 1))) == [200, 200]
                sent += 2
        assert system.wait_for(evicted), f"{sent} fillers left the session on a prefill instance"
        store = _instances(dep)["kvstore"][0].metrics_address
        served = system.metric(store, "pdserve:prefix_cache_hits_total")
        turn3 = session + _text(offline.tokenizer, 9000, 30)
        status, again = system.post(url, "/v1/completions", {**body, "prompt": turn3})
        assert status == 200
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * 64, "not loaded from the kvstore"
        assert system.metric(store, "pdserve:prefix_cache_hits_total") - served >= 10 * 64, "the kvstore served nothing"
        (cold,) = offline.generate([turn3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert again["choices"][0]["text"] == cold.text
    finally:
        if not shared:
            launcher.down(dep)


def test_pcp2_dcp2_prefill_to_decode_equals_offline(pcp2_dcp2, offline):
    """Decode pulls KV from PCP=DCP=2 prefill instances (each rank's shard over NIXL, DCP shards re-laid
    out token by token) and streams what the offline engine generates."""
    url = pcp2_dcp2.endpoints()["router"][0]
    prompts = [_text(offline.tokenizer, 300 * i, 30 + 41 * i) for i in range(8)]
    expected = offline.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for ids, want in zip(prompts, expected):
        status, body = system.post(url, "/v1/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0,
                                                            "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == want.text, f"prompt of {len(ids)} tokens"
