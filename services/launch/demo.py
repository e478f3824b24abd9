"""`make demo`: start the whole system as local processes (`pdserve up` with configs/topology.cpu.yaml:
Redis if none answers, kvstore, prefill, decode with HiSparse + MTP3, router), stream one completion of
the tiny code model through the router's OpenAI API, print the text as it arrives and the timings, stop."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from services.launch import launcher
from services.launch.schema import ROOT

TOPOLOGY = ROOT / "configs" / "topology.cpu.yaml"


def stream(url: str, prompt: str, max_tokens: int, chat: bool) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    first, n_chunks, usage = None, 0, {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content", "") if chat else choice.get("text", "")
                if text:
                    first = first or time.perf_counter()
                    n_chunks += 1
                    print(text, end="", flush=True)
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "total_s": end - t0, "chunks": n_chunks, "usage": usage,
            "decode_s": end - (first or end)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.launch.demo", description=__doc__)
    p.add_argument("--config", default=str(TOPOLOGY))
    p.add_argument("--prompt", default='class Stack:\n    """A LIFO stack."""\n\n    def __init__(self):\n')
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message instead")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--keep", action="store_true", help="leave the services running")
    a = p.parse_args(argv)
    print(f"starting the services of {Path(a.config).name} (logs in .run/) ...", flush=True)
    t0 = time.perf_counter()
    dep = launcher.up(a.config, echo=lambda s: print("  " + s, flush=True))
    print(f"all healthy in {time.perf_counter() - t0:.1f} s\n")
    try:
        url = dep.endpoints()["router"][0]
        if a.chat:
            print(f"POST {url}/v1/chat/completions (stream)\nuser: {a.prompt}\nassistant:", flush=True)
        else:
            print(f"POST {url}/v1/completions (stream), greedy; the prompt, then the model's text:\n", flush=True)
            print(a.prompt, end="", flush=True)
        r = stream(url, a.prompt, a.max_tokens, a.chat)
        u = r["usage"]
        n = u.get("completion_tokens", 0)
        print("\n\n--- timings ---")
        print(f"prompt tokens {u.get('prompt_tokens')}, completion tokens {n}, "
              f"cached prompt tokens {u.get('prompt_tokens_details', {}).get('cached_tokens')}")
        print(f"time to first token {r['ttft_s'] * 1e3:.0f} ms; total {r['total_s']:.2f} s; "
              f"decode {max(n - 1, 0) / max(r['decode_s'], 1e-9):.1f} tokens/s")
    finally:
        if not a.keep:
            launcher.down(dep)
            print("services stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
