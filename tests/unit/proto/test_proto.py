"""The wire API: stubs import as proto.pdserve.v1.*, messages round-trip, stale stubs regenerate."""

from __future__ import annotations

import os

from proto import build
from proto.pdserve.v1 import common_pb2, decode_pb2, kvstore_pb2_grpc, prefill_pb2, router_pb2_grpc


def test_generated_imports_are_package_relative():
    for path in build.PACKAGE_DIR.glob("*_pb2*.py"):
        text = path.read_text()
        assert "from pdserve.v1" not in text and "import pdserve.v1" not in text, path.name
    assert prefill_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert {s for s in router_pb2_grpc.__dict__ if s.startswith("add_")} == {"add_RouterServicer_to_server"}
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub")


def test_kv_handle_round_trip():
    handle = prefill_pb2.KVHandle(
        prefill_instance_id="prefill-0", lease_id="l-1", lease_expires_unix_ms=1_700_000_000_000, num_tokens=130,
        layout=common_pb2.KVLayout(block_size=64, kv_cache_dtype="fp8_ds_mla", mla_block_bytes=3_280_000),
        dcp_size=2, cp_kv_cache_interleave_size=1, block_hashes=[bytes(16), bytes(range(16))],
        ranks=[prefill_pb2.RankPages(rank=r, block_ids=[3, 9], peer=common_pb2.NixlPeer(
            agent_name=f"a{r}", agent_metadata=b"\x00md", tensors=[common_pb2.MemoryDesc(
                name="mla", base_addr=2**47 + 4096, block_bytes=3_280_000, num_blocks=10,
                device_kind=common_pb2.DEVICE_KIND_VRAM, device_id=r)])) for r in range(2)])
    req = decode_pb2.DecodeRequest(kv=handle, first=common_pb2.TokenDelta(token_ids=[42]))
    back = decode_pb2.DecodeRequest.FromString(req.SerializeToString())
    assert back == req and back.kv.ranks[1].peer.tensors[0].base_addr == 2**47 + 4096


def test_optional_sampling_fields_distinguish_unset_from_zero():
    sp = common_pb2.SamplingParams(temperature=0.0)
    assert sp.HasField("temperature") and not sp.HasField("top_p") and not sp.HasField("max_tokens")


def test_stale_stubs_are_regenerated():
    stub = build.PACKAGE_DIR / "common_pb2.py"
    proto = build.PACKAGE_DIR / "common.proto"
    old = stub.stat().st_mtime
    os.utime(stub, (old, proto.stat().st_mtime - 10))  # older than its .proto
    assert build.is_stale()
    build.ensure_built()
    assert not build.is_stale() and stub.stat().st_mtime >= proto.stat().st_mtime
    assert "from proto.pdserve.v1 import common_pb2" in (build.PACKAGE_DIR / "decode_pb2.py").read_text()
