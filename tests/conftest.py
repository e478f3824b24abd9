"""Shared fixtures: checkpoints built once per session (random tiny ones, HF oracle ones, tiny-code)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT

TINY_CODE = ROOT / "checkpoints" / "tiny-code"

# Tests run two pytest workers on two cores: one thread each (tiny ops lose to OpenMP wake-ups).
torch.set_num_threads(1)
os.environ.setdefault("PDSERVE_CPU_THREADS", "1")



def _worker_port_range() -> None:
    """Two pytest workers each launch deployments whose ports are picked before any process binds them: each
    worker draws from its own slice of the range below the ephemeral ports (PDSERVE_PORT_RANGE, inherited
    by the processes it starts), so the two never promise the same port."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if "PDSERVE_PORT_RANGE" in os.environ or not worker.startswith("gw") or not count.isdigit():
        return
    from engine.parallel.dist import default_port_range

    lo, hi = default_port_range()
    width = (hi + 1 - lo) // int(count)
    start = lo + int(worker[2:]) * width
    os.environ["PDSERVE_PORT_RANGE"] = f"{start}-{start + width - 1}"


_worker_port_range()

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="session")
def tiny_code() -> Path:
    return TINY_CODE


@pytest.fixture(scope="session")
def code16(tmp_path_factory, tiny_code) -> Path:
    """tiny-code with index_topk 16: past 16 tokens the indexer really selects, and a device pool of a few
    blocks holds HiSparse's hot buffers (misses every step). Weights and tokenizer are tiny-code's (links)."""
    out = tmp_path_factory.mktemp("code16")
    for f in tiny_code.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((tiny_code / "config.json").read_text())
    cfg["index_topk"] = 16
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random-weight `tiny` preset checkpoint (top-k 16: sparse selection is active past 16 tokens)."""
    from engine.loading.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_dense(tmp_path_factory) -> Path:
    """Same shape, top-k 4096: attention is dense, so results depend on nothing the indexer picks."""
    from engine.loading.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tinyd") / "ckpt", preset="tiny", seed=0, index_topk=4096)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep `--dist loadgroup` grouping: pytest-xdist 3.8 tags a grouped test by rewriting `item._nodeid`
    ("<id>@<group>"), which pytest 9.2 no longer reads (node ids live in `item._id`). Without this every
    grouped module would start its expensive deployment once per worker."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # older pytest reads `_nodeid` itself
        return
    for item in items:
        tagged = item.__dict__.get("_nodeid")
        if isinstance(tagged, str) and tagged != item.nodeid and hasattr(item, "_id"):
            item._id = coerce_node_id(tagged)
