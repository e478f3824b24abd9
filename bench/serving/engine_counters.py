"""Counters of the running engines (prefill and decode instances), read from their metrics endpoints.

A benchmark that started the services (`--fresh-server`, `bench.serving.cold_start`) knows the deployment's Redis,
whose instance registry names every engine's metrics address; a level's figure is the difference of two reads.
"""

from __future__ import annotations

import re
import urllib.request

STEP_COUNTERS = ("pdserve:engine_steps_total", "pdserve:engine_step_seconds_total")
MTP_COUNTERS = ("pdserve:spec_decode_num_full_rounds_total", "pdserve:spec_decode_num_full_round_tokens_total")


def engine_counters(redis_url: str, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """{role: {counter: value summed over that role's instances}} for the registered prefill and decode engines
    (a counter an instance does not export counts 0)."""
    from services.cluster.redis_state import registered_instances  # the services' registry: only when asked

    out: dict[str, dict[str, float]] = {}
    for inst in registered_instances(redis_url):
        if inst.role not in ("prefill", "decode"):
            continue
        a = inst.metrics_address
        text = urllib.request.urlopen(a if a.startswith("http") else f"http://{a}/metrics", timeout=5).read().decode()
        got = out.setdefault(inst.role, dict.fromkeys(names, 0.0))
        for name in names:
            m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
            got[name] += float(m.group(1)) if m else 0.0
    return out


def mtp_acceptance(before: dict, after: dict) -> dict | None:
    """The decode engines' MTP acceptance length between two reads of MTP_COUNTERS (None without full rounds)."""
    b, a = before.get("decode", {}), after.get("decode", {})
    rounds = a.get(MTP_COUNTERS[0], 0.0) - b.get(MTP_COUNTERS[0], 0.0)
    tokens = a.get(MTP_COUNTERS[1], 0.0) - b.get(MTP_COUNTERS[1], 0.0)
    if rounds <= 0:
        return None
    return {"full_rounds": rounds, "tokens": tokens, "acceptance_length": tokens / rounds}
