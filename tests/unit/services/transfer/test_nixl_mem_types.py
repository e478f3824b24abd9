"""NIXL registrations and transfers by memory type, against a fake nixl_agent that records its calls:
a HiSparse decode cache (host MLA pool + GPU indexer cache) is two registrations, two prepared lists,
and a pull from a GPU prefill is two transfers, one landing in DRAM and one in VRAM."""

from __future__ import annotations

import asyncio
import sys
import types

import numpy as np
import pytest
import torch

from services.transfer import nixl_agent as nixl_agent_mod
from services.transfer.nixl_descs import BlockDescList, BlockTensor, DescGroup, by_mem_type, transfer_parts


class FakeCuda:
    """A CPU tensor that reports itself on cuda:<device> (what BlockTensor.of reads)."""

    def __init__(self, t: torch.Tensor, device: int = 0):
        self.t, self.device = t, device

    def get_device(self) -> int:
        return self.device

    def __getattr__(self, name):
        return getattr(self.t, name)


class FakeHandle:
    def __init__(self, log, what):
        self.log, self.what = log, what

    def release(self):
        self.log.append(("release", self.what))


class FakeNixl:
    """Records every call; refuses (as NIXL does) a registration or list that is not one memory type."""

    def __init__(self, name, conf):
        self.name, self.calls, self.backends = name, [], {"UCX": object()}

    def register_memory(self, descs, mem_type=None):
        assert isinstance(descs, np.ndarray) and descs.shape[1] == 3 and mem_type in ("DRAM", "VRAM")
        self.calls.append(("register", mem_type, descs.copy()))
        return ("reg", mem_type)

    def deregister_memory(self, reg):
        self.calls.append(("deregister", reg[1]))

    def prep_xfer_dlist(self, peer, descs, mem_type):
        self.calls.append(("prep", peer, mem_type, len(descs)))
        return FakeHandle(self.calls, ("dlist", peer, mem_type))

    def make_prepped_xfer(self, op, local, local_idx, remote, remote_idx, notif):
        self.calls.append(("xfer", op, local.what[2], remote.what[2], list(local_idx), list(remote_idx), notif))
        return FakeHandle(self.calls, ("xfer", local.what[2], remote.what[2]))

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return "DONE"

    def send_notif(self, peer, msg):
        self.calls.append(("notif", peer, msg))

    def add_remote_agent(self, metadata):
        return metadata.decode()

    def remove_remote_agent(self, name):
        pass

    def get_new_notifs(self):
        return {}


@pytest.fixture
def fake_nixl(monkeypatch):
    api = types.ModuleType("nixl._api")
    api.nixl_agent = FakeNixl
    api.nixl_agent_config = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    agent = nixl_agent_mod.NixlAgent("decode-test", backends=["UCX"])
    yield agent, agent._agent.calls


def _hisparse_cache():
    mla = torch.zeros((8, 2, 64, 10), dtype=torch.uint8)  # host pool (DRAM)
    index = FakeCuda(torch.zeros((8, 1, 64, 4), dtype=torch.uint8))  # GPU indexer cache (VRAM)
    return {"mla": mla, "index": index}


def test_cuda_tensor_is_vram_and_registrations_are_split(fake_nixl):
    agent, calls = fake_nixl
    cache = _hisparse_cache()
    described = agent.register(cache)
    assert [(t.name, t.mem_type) for t in described] == [("mla", "DRAM"), ("index", "VRAM")]
    regs = [c for c in calls if c[0] == "register"]
    assert [r[1] for r in regs] == ["DRAM", "VRAM"]  # one registration per memory type, never mixed
    assert regs[0][2].tolist() == [[cache["mla"].data_ptr(), cache["mla"].numel(), 0]]
    assert regs[1][2].tolist() == [[cache["index"].data_ptr(), cache["index"].t.numel(), 0]]
    local = agent.prep_local(described)
    assert [(g.mem_type, g.names) for g in local.groups] == [("DRAM", ("mla",)), ("VRAM", ("index",))]
    assert [c[1:] for c in calls if c[0] == "prep"] == [("NIXL_INIT_AGENT", "DRAM", 8),
                                                        ("NIXL_INIT_AGENT", "VRAM", 8)]
    agent.close()
    assert [c[1] for c in calls if c[0] == "deregister"] == ["DRAM", "VRAM"]


def test_pull_from_a_gpu_prefill_is_split_by_memory_type(fake_nixl):
    agent, calls = fake_nixl
    local = agent.prep_local(agent.register(_hisparse_cache()))
    peer = agent.add_peer(b"prefill-0")
    remote_tensors = [BlockTensor("mla", 1 << 40, 1280, 20, "VRAM", 3),
                      BlockTensor("index", 1 << 41, 256, 20, "VRAM", 3)]
    remote = agent.prep_remote(peer, remote_tensors)
    assert [g.mem_type for g in remote.groups] == ["VRAM"]
    xfer = agent.read(local, [1, 2], remote, [7, 9], notif=b"pulled l-1")
    parts = [c for c in calls if c[0] == "xfer"]
    # MLA rows: remote VRAM -> local DRAM (host pool); indexer rows: remote VRAM -> local VRAM
    assert parts == [("xfer", "READ", "DRAM", "VRAM", [1, 2], [7, 9], b""),
                     ("xfer", "READ", "VRAM", "VRAM", [1, 2], [27, 29], b"")]
    asyncio.run(agent.wait(xfer, nixl_agent_mod.deadline_in(1)))
    assert calls[-1] == ("notif", peer, b"pulled l-1")  # a split transfer's notification follows its parts
    assert agent.stats.bytes_transferred == 2 * (2 * 64 * 10 + 64 * 4)


def test_single_type_transfer_keeps_nixls_own_notification(fake_nixl):
    agent, calls = fake_nixl
    local = agent.prep_local(agent.register({"mla": torch.zeros((4, 1, 64, 2), dtype=torch.uint8),
                                             "index": torch.zeros((4, 1, 64, 1), dtype=torch.uint8)}))
    remote = agent.prep_remote(agent.add_peer(b"kvstore-0"), [BlockTensor("mla", 4096, 128, 9, "DRAM", 0),
                                                             BlockTensor("index", 1 << 20, 64, 9, "DRAM", 0)])
    agent.write(local, [3], remote, [8], notif=b"stored")
    assert [c for c in calls if c[0] == "xfer"] == [("xfer", "WRITE", "DRAM", "DRAM", [3, 7], [8, 17], b"stored")]


def test_transfer_parts_pair_every_type_combination():
    loc = BlockDescList("", (), (DescGroup("DRAM", (BlockTensor("mla", 0, 8, 4, "DRAM", 0),), "h1"),
                                 DescGroup("VRAM", (BlockTensor("index", 0, 4, 4, "VRAM", 0),), "h2")))
    loc.tensors = loc.groups[0].tensors + loc.groups[1].tensors
    rem_tensors = (BlockTensor("mla", 0, 8, 6, "DRAM", 0), BlockTensor("index", 0, 4, 6, "DRAM", 0))
    rem = BlockDescList("p", rem_tensors, (DescGroup("DRAM", rem_tensors, "r"),))
    parts = transfer_parts(loc, [0, 3], rem, [5, 1])
    assert [(p.local.mem_type, p.remote.mem_type, p.names) for p in parts] == [("DRAM", "DRAM", ("mla",)),
                                                                               ("VRAM", "DRAM", ("index",))]
    assert parts[1].local_idx.tolist() == [0, 3] and parts[1].remote_idx.tolist() == [11, 7]
    with pytest.raises(ValueError, match="out of range"):
        transfer_parts(loc, [4], rem, [0])
    assert [m for m, _ in by_mem_type(rem_tensors + loc.groups[1].tensors)] == ["DRAM", "VRAM"]
