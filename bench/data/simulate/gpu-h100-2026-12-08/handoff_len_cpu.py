"""The handoff (the second token's delay less the decode's step seconds) against the prompt's length, CPU topology.

    python bench/data/simulate/gpu-h100-2026-12-08/handoff_len_cpu.py 128,1024,3072 configs/topology.cpu.yaml OUT

Per length: five fresh prompts, then one prompt sent once and five requests that extend it by 16 tokens (its
prefix cached); each a 2-token request, the engines' step counters read around it.
"""

import asyncio
import json
import statistics
import sys

from bench.serving.client import make_session, server_info, stream_completion
from bench.serving.engine_counters import STEP_COUNTERS, engine_counters
from bench.serving.target import FreshServer, wait_ready
from bench.simulate.calibrate import _ids


async def main(url: str, redis_url: str, lengths: list[int]) -> dict:
    out = {}
    async with make_session() as http:
        info = await server_info(http, url)
        model, vocab = info["model"], info.get("vocab_size") or 4096
        await stream_completion(http, url, model, _ids(64, 1, vocab), 4)

        async def probe(ids: list[int]) -> dict:
            await asyncio.sleep(1.1)  # the engines publish their counters every 0.5 s
            b = await asyncio.to_thread(engine_counters, redis_url, STEP_COUNTERS)
            rec = await stream_completion(http, url, model, ids, 2)
            await asyncio.sleep(1.1)
            a = await asyncio.to_thread(engine_counters, redis_url, STEP_COUNTERS)
            dec = a["decode"][STEP_COUNTERS[1]] - b["decode"][STEP_COUNTERS[1]]
            pre = a["prefill"][STEP_COUNTERS[1]] - b["prefill"][STEP_COUNTERS[1]]
            second = rec.t_end - rec.t_first
            return {"second": second, "dec": dec, "pre": pre, "ttft": rec.ttft_s, "handoff": second - dec}

        for n in lengths:
            out[f"fresh-{n}"] = [await probe(_ids(n, 1000 * n + i, vocab)) for i in range(5)]
            base = _ids(n, 77 * n, vocab)
            await stream_completion(http, url, model, base, 2)
            out[f"hit-{n}"] = [await probe(base + _ids(16, 5000 + 17 * n + i, vocab)) for i in range(5)]
            for k in (f"fresh-{n}", f"hit-{n}"):
                med = {f: 1e3 * statistics.median(g[f] for g in out[k]) for f in ("handoff", "second", "dec", "pre")}
                print(k, " ".join(f"{f} {v:.1f} ms" for f, v in med.items()), flush=True)
    return out


if __name__ == "__main__":
    with FreshServer(sys.argv[2]) as ep:
        asyncio.run(wait_ready(ep.url))
        res = asyncio.run(main(ep.url, ep.handle.redis_url, [int(x) for x in sys.argv[1].split(",")]))
    json.dump(res, open(sys.argv[3], "w"))
