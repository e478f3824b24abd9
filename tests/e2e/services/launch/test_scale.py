"""`pdserve scale` under load: decode scaled 1 -> 3 while streams run (the new replicas register and take
requests), then 3 -> 1 (the removed ones drain their streams before they exit): no client-visible error, every
stream token-exact against the offline engine, the removed replicas gone from Redis."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.launch import launcher
from services.launch.scale import replicas_of, scale
from tests.helpers import ROOT, chaos, system
from tests.helpers.chaos import CLIENT_TIMEOUT_S

pytestmark = [pytest.mark.xdist_group("scale"), pytest.mark.slow]


def _run(addr_url: str, bodies: list[dict], want: list[str], during) -> None:
    load = chaos.Load(addr_url, bodies, CLIENT_TIMEOUT_S * 4).start()
    assert load.wait_started(120), "streams did not start"
    during()
    for r, text in zip(load.join(), want):
        assert r.ok and r.text == text, (r, text)


def test_scale_decode_up_and_down_under_load(tmp_path_factory, offline, corpus):
    run = tmp_path_factory.mktemp("scale")
    dep = system.launch(system.topology(run, decode={"shutdown-timeout": 120}))
    try:
        bodies = chaos.bodies(corpus, 8, 80)
        want = chaos.expected(offline, bodies)
        _run(dep.url, bodies, want, lambda: scale(run, "decode", 3, timeout_s=300))
        dep = launcher.Deployment.load(run)
        assert sorted(replicas_of(dep, "decode")) == [0, 1, 2]
        assert {"decode-1", "decode-2"} <= set(chaos.instances(dep))
        new = {i.instance_id: i.metrics_address for i in chaos.instances(dep).values()
               if i.instance_id in ("decode-1", "decode-2")}
        bodies = chaos.bodies(corpus, 12, 80, start=20000)
        want = chaos.expected(offline, bodies)
        taken = {}

        def admitted() -> float:
            taken.update({n: system.metric(a, "pdserve:dp_rank_requests_total") for n, a in new.items()})
            return sum(v for v in taken.values() if v == v)  # nan (no admission yet): 0

        def scale_in():  # the CLI, as an operator runs it: the two new replicas drain their streams, then leave
            # a stream's first token comes from the prefill: wait until the new replicas admitted some (an event)
            system.wait_for(admitted, timeout=120)
            cli = [sys.executable, "-m", "services.cli", "scale", "decode", "1", "--run-dir", str(run)]
            subprocess.run(cli, cwd=ROOT, check=True, timeout=600)

        _run(dep.url, bodies, want, scale_in)
        assert sum(v for v in taken.values() if v == v) > 0, f"the new replicas took no request: {taken}"
        dep = launcher.Deployment.load(run)
        assert sorted(replicas_of(dep, "decode")) == [0]
        assert system.wait_for(lambda: not {"decode-1", "decode-2"} & set(chaos.instances(dep)), timeout=10)
    finally:
        launcher.down(run)
