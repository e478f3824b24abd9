"""The whole system on one GPU (configs/topology.gpu-1.yaml: kvstore, prefill and a HiSparse + MTP3
decode sharing GPU 0, fp8 KV): streamed chat tokens through the router equal the offline engine's on
the same GPU, a second turn hits the prefix cache, and a 60 s load at concurrency 32 leaves no KV
block and no HiSparse page held."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from engine.parallel.dist import free_port
from services.launch import launcher
from tests.helpers import ROOT, system

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(1200), pytest.mark.xdist_group("system")]
TOPOLOGY = ROOT / "configs" / "topology.gpu-1.yaml"
CHATS = [[{"role": "user", "content": "def fibonacci(n):"}],
         [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os\nimport sys\n"}],
         [{"role": "user", "content": "class Stack:\n    def push(self, x):"}],
         [{"role": "user", "content": "# sort a list of dicts by key\n"}]]


def gpu_topology(run_dir: Path) -> dict:
    topo = yaml.safe_load(TOPOLOGY.read_text())
    topo["run_dir"], topo["redis_url"] = str(run_dir), f"redis://127.0.0.1:{free_port()}/0"
    for kind, spec in topo["services"].items():
        spec["port"] = spec["metrics_port"] = 0
        if kind == "router":
            spec["grpc_port"] = 0
    return topo


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = launcher.up(gpu_topology(tmp_path_factory.mktemp("gpu-system")), timeout_s=600, die_with_parent=True)
    yield dep
    launcher.down(dep)


@pytest.fixture(scope="module")
def offline(tiny_code):
    from engine import LLM

    return LLM(str(tiny_code), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", num_blocks=512)


# tiny-code never closes <think>: the chats are asked without thinking, as the router renders them.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def stream_chat(url: str, messages: list[dict], max_tokens: int) -> tuple[list[int], dict]:
    """Token ids streamed by /v1/chat/completions (return_token_ids), and the final usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, **NO_THINKING}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    ids, usage = [], {}
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    return ids, usage


def test_streamed_chat_equals_the_offline_engine(deployment, offline):
    from engine import SamplingParams
    from services.router.chat_template import ChatTemplate

    template = ChatTemplate.load(ROOT / "checkpoints" / "tiny-code")
    texts = [template.render(m, add_generation_prompt=True, template_kwargs=NO_THINKING["chat_template_kwargs"])
             for m in CHATS]
    prompts = [offline.tokenizer.encode(t) for t in texts]
    want = offline.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    for messages, expected in zip(CHATS, want):
        got, usage = stream_chat(deployment.url, messages, 48)
        assert usage["completion_tokens"] == 48
        first = next((i for i, (a, b) in enumerate(zip(got, expected.token_ids)) if a != b), None)
        assert got == list(expected.token_ids), f"first difference at token {first}"


def test_second_turn_hits_the_prefix_cache(deployment, offline):
    import inspect
    import json.decoder

    source = inspect.getsource(json.decoder)[:3000]
    first = [{"role": "user", "content": source}]
    _, cold = stream_chat(deployment.url, first, 8)
    second = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and now?"}]
    _, warm = stream_chat(deployment.url, second, 8)
    assert warm["prompt_tokens_details"]["cached_tokens"] > 0, warm
    assert warm["prompt_tokens_details"]["cached_tokens"] >= (cold["prompt_tokens"] // 64 - 1) * 64


def test_load_at_concurrency_32_leaves_nothing_held(deployment):
    from bench.serving import loadcheck
    from bench.serving.loadtest import LoadConfig, run_load

    out = run_load(deployment, LoadConfig(concurrency=32, duration_s=60, min_tokens=16, max_tokens=64, check=False))
    print(f"\n60 s load at concurrency 32: {out['requests_sent']} requests, errors {out['errors']}, "
          f"leaked blocks {out['leaked_blocks']}, output tok/s {out.get('output_throughput')}")
    assert out["requests_sent"] > 32 and not out["errors"]
    assert out["leaked_blocks"] == 0, out["blocks_in_use_after_drain"]
    decode = next(p for p in deployment.processes if p.kind == "decode")
    metrics = _metrics_address(deployment, "decode")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pages = loadcheck._gauge(metrics, "pdserve:hisparse_device_blocks_in_use")
        placed = loadcheck._gauge(metrics, "pdserve:hisparse_requests_placed")
        if pages == 0 and placed == 0:
            break
        time.sleep(0.5)
    assert (pages, placed) == (0, 0), f"{decode.name}: {pages} HiSparse pages held by {placed} requests"


def _metrics_address(dep, role: str) -> str:
    (inst,) = [i for i in system.with_state(dep.redis_url, lambda s: s.instances()) if i.role == role]
    return inst.metrics_address
