"""`pdserve serve MODEL` as a user runs it: one command brings the whole deployment up on this host, serves
completions at --port, and on SIGTERM stops every process it started (each drained first)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

from engine.parallel.dist import free_port
from services.launch.launcher import Deployment, status
from tests.helpers import ROOT, chaos, system

LLM_D_READS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
               "vllm:cache_config_info", "vllm:lora_requests_info")


def _healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(url + "/health", timeout=2).status == 200
    except OSError:
        return False


def test_serve_runs_a_deployment_until_sigterm(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "checkpoints/tiny-code", "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", str(free_port()), "--run-dir", str(tmp_path),
           "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--kvstore-pool-gib", "0.25",
           "--kv-cache-dtype", "fp8_ds_mla", "--max-num-seqs", "8"]
    log = open(tmp_path / "serve.out", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        up = system.wait_for(lambda: _healthy(url) or proc.poll() is not None, timeout=300, period=0.5)
        assert up and proc.poll() is None, (tmp_path / "serve.out").read_text()[-3000:]
        status_code, out = system.post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 8, "temperature": 0})
        assert status_code == 200 and out["usage"]["completion_tokens"] == 8, out
        dep = Deployment.load(tmp_path)
        assert {p.kind for p in dep.processes} == {"router", "prefill", "decode", "kvstore"}
        # what llm-d's model-server protocol and vLLM's dashboards read, on every engine
        for inst in chaos.instances(dep).values():
            if inst.role in ("prefill", "decode"):
                text = urllib.request.urlopen(f"http://{inst.metrics_address}/metrics", timeout=5).read().decode()
                for name in LLM_D_READS:
                    assert f"{name}{{" in text, (inst.instance_id, name)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        assert not any(status(dep).values()), status(dep)
    finally:
        if proc.poll() is None:
            proc.kill()
            time.sleep(1)
            subprocess.run([sys.executable, "-m", "services.cli", "down", "--run-dir", str(tmp_path)], cwd=ROOT)
        log.close()
