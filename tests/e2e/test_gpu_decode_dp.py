"""A DP2 x EP2 decode group on two GPUs behind `pdserve up` (configs/topology.gpu-1.yaml with the decode as one
group, rank r on GPU r, NCCL between them, HiSparse + MTP3, fp8 KV and async scheduling on both ranks; the
prefill on GPU 0): streamed chat tokens through the router equal the offline engine's, both ranks serve, each pulls
its KV into its own pages (VRAM indexer rows, host-pool MLA rows), and afterwards no KV block and no HiSparse
page is held."""

from __future__ import annotations

import pytest
import torch

from services.launch import launcher
from tests.e2e.test_gpu_system import CHATS, NO_THINKING, gpu_topology, stream_chat
from tests.helpers import ROOT, chaos, system

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
              pytest.mark.timeout(1200), pytest.mark.xdist_group("system")]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    topo = gpu_topology(tmp_path_factory.mktemp("gpu-dp"))
    del topo["services"]["kvstore"]
    decode = topo["services"]["decode"]
    decode.update(data_parallel_size=2, gpus=[0, 1])
    decode["args"]["enable-expert-parallel"] = True
    decode["args"]["async-scheduling"] = True  # every rank launches step N + 1 before it reads step N back
    dep = launcher.up(topo, timeout_s=900, die_with_parent=True)
    yield dep
    launcher.down(dep)


@pytest.fixture(scope="module")
def offline(tiny_code):
    from engine import LLM

    return LLM(str(tiny_code), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", num_blocks=512)


def test_dp_group_on_two_gpus_streams_the_offline_tokens(deployment, offline):
    from concurrent.futures import ThreadPoolExecutor

    from engine import SamplingParams
    from services.router.chat_template import ChatTemplate

    template = ChatTemplate.load(ROOT / "checkpoints" / "tiny-code")
    texts = [template.render(m, add_generation_prompt=True, template_kwargs=NO_THINKING["chat_template_kwargs"])
             for m in CHATS]
    want = offline.generate([offline.tokenizer.encode(t) for t in texts],
                            SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    infos = chaos.instances(deployment)
    dec = infos["decode-0-dp0"]
    assert infos["decode-0-dp1"].grpc_address == dec.grpc_address
    with ThreadPoolExecutor(len(CHATS)) as pool:  # concurrent: the router spreads them over both ranks
        got = list(pool.map(lambda m: stream_chat(deployment.url, m, 48), CHATS))
    for (ids, usage), expected in zip(got, want):
        first = next((i for i, (a, b) in enumerate(zip(ids, expected.token_ids)) if a != b), None)
        assert ids == list(expected.token_ids), f"first difference at token {first}"
        assert usage["completion_tokens"] == 48
    admitted = system.admitted_per_rank(dec.metrics_address, 2)
    assert sum(admitted) == len(CHATS) and min(admitted) >= 1, admitted
    # decode steps ran planned: fixed shapes, the static dispatch inside the captured step (docs/dp_ep.md)
    steps = system.dp_steps(dec.metrics_address)
    assert steps["planned"] >= 40 and steps["planned"] > steps["dynamic"], steps
    chaos.assert_blocks_freed([dec.metrics_address, infos["prefill-0"].metrics_address], timeout=30)
    for gauge in ("pdserve:hisparse_requests_placed", "pdserve:hisparse_device_blocks_in_use"):
        assert system.wait_for(lambda g=gauge: system.metric(dec.metrics_address, g) == 0, timeout=30), gauge
