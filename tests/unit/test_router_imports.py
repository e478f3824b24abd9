"""The router process loads no torch: a router replica is tokenizer, HTTP and gRPC, and importing torch
(with triton, our kernels, xgrammar, NIXL) would cost it seconds at start and hundreds of MB for nothing.
Checked in a fresh interpreter, since this one has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

HEAVY = ("torch", "nixl", "triton", "kernels", "xgrammar", "transformers", "numpy")

_PROBE = f"""
import json, sys
import services.router.main
print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
"""


def test_importing_the_router_loads_no_torch():
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       check=False)
    assert r.returncode == 0, r.stderr
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing services.router.main loads {loaded} (find who with `python -X importtime`)"


def test_the_probe_sees_an_import():
    # the same probe on a module that does import torch: a broken probe would pass the test above
    probe = _PROBE.replace("import services.router.main", "import torch")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "torch" in json.loads(r.stdout.strip().splitlines()[-1])
