"""The vLLM-named metrics every service exports once it describes its model: what vLLM's dashboards, llm-d's
model-server scrapers and autoscaling rules read (`vllm:num_requests_waiting{model_name=...}` and friends)."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from services.rpc.metrics import VLLM_NAMES, ServiceMetrics


def _samples(m: ServiceMetrics) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_vllm_names_carry_the_same_figures_with_the_model_name():
    m = ServiceMetrics("decode", "decode-0")
    m.describe_model("GLM-5.3", {"block_size": 64, "cache_dtype": "fp8_ds_mla", "num_gpu_blocks": 4096})
    m.num_requests_waiting.set(3)
    m.num_requests_running.set(7)
    m.kv_cache_usage_perc.set(0.25)
    m.prefix_cache_hits.inc(640)
    m.time_per_output_token_seconds.observe(0.02)
    s = _samples(m)
    assert s['vllm:num_requests_waiting{engine="0",model_name="GLM-5.3"}'] == 3 == s["pdserve:num_requests_waiting"]
    assert s['vllm:num_requests_running{engine="0",model_name="GLM-5.3"}'] == 7
    assert s['vllm:kv_cache_usage_perc{engine="0",model_name="GLM-5.3"}'] == 0.25
    assert s['vllm:prefix_cache_hits_total{engine="0",model_name="GLM-5.3"}'] == 640
    assert s['vllm:time_per_output_token_seconds_count{engine="0",model_name="GLM-5.3"}'] == 1
    assert s['vllm:cache_config_info{block_size="64",cache_dtype="fp8_ds_mla",num_gpu_blocks="4096"}'] == 1
    lora = [k for k in s if k.startswith("vllm:lora_requests_info")]
    assert lora == ['vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}']


def test_only_the_roles_figures_and_nothing_before_the_model_is_described():
    m = ServiceMetrics("kvstore", "kvstore-0")
    assert not any(k.startswith("vllm:") for k in _samples(m))
    m.describe_model("tiny-code", {"block_size": 64})
    names = {re.sub(r"(_total|_created|_count|_sum|_bucket)?\{.*", "", k) for k in _samples(m) if k.startswith("vllm:")}
    have = {f"vllm:{n}" for n in VLLM_NAMES if hasattr(m, n)}
    assert names == have | {"vllm:cache_config_info", "vllm:lora_requests_info"}
    assert "vllm:num_requests_waiting" not in names  # the kvstore has no request queue
