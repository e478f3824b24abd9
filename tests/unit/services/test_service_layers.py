"""Pure pieces of the shared service layers (rpc, transfer, cluster): error mapping, conversions, metric names,
state records, block descriptors."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from engine.config.presets import preset
from engine.kv.cache import KVCacheSpec
from proto.pdserve.v1 import common_pb2
from services.cluster.redis_state import InstanceInfo, KVEvent
from services.rpc import convert
from services.rpc.grpc_server import FailedPrecondition, NotFound, Overloaded, status_for
from services.rpc.metrics import ServiceMetrics
from services.transfer import convert as transfer_convert
from services.transfer.nixl_descs import BlockDescList, BlockTensor, parse_pulled, pulled_notif


def test_status_codes():
    assert status_for(ValueError("max_tokens must be >= 1")) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                                  "max_tokens must be >= 1")
    assert status_for(Overloaded("queue full"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(NotFound("x"))[0] == grpc.StatusCode.NOT_FOUND
    assert status_for(FailedPrecondition("x"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(TimeoutError())[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_for(KeyError("bug")) == (grpc.StatusCode.INTERNAL, "KeyError: 'bug'")
    # a huge quoted argument must not push the trailer past gRPC's metadata limit (-> RESOURCE_EXHAUSTED)
    code, details = status_for(NotFound(f"no lease {'x' * 20000!r}"))
    assert code == grpc.StatusCode.NOT_FOUND and len(details) <= 1024 and details.endswith("[truncated]")


def test_block_tensor_descriptors():
    t = torch.zeros(5, 3, 8, dtype=torch.float32)
    bt = BlockTensor.of("mla", t)
    assert (bt.block_bytes, bt.num_blocks, bt.mem_type, bt.device_id) == (96, 5, "DRAM", 0)
    d = bt.descs()
    assert d.shape == (5, 3) and d[3, 0] == t[3].data_ptr() and (d[:, 1] == 96).all()
    with pytest.raises(ValueError, match="contiguous"):
        BlockTensor.of("x", t.transpose(0, 1))
    assert transfer_convert.block_tensor_from_proto(transfer_convert.block_tensor_to_proto(bt)) == bt
    with pytest.raises(ValueError, match="device kind"):
        transfer_convert.block_tensor_from_proto(common_pb2.MemoryDesc(name="x", block_bytes=1, num_blocks=1))


def test_descriptor_indices_are_tensor_major():
    a = BlockTensor("mla", 0x1000, 64, 10, "DRAM", 0)
    b = BlockTensor("index", 0x9000, 16, 10, "DRAM", 0)
    dl = BlockDescList("", (a, b))
    assert dl.indices([3, 0, 7]).tolist() == [3, 0, 7, 13, 10, 17]
    assert dl.indices([]).dtype == np.int32 and dl.num_bytes(2) == 160
    with pytest.raises(ValueError, match="out of range"):
        dl.indices([10])
    assert parse_pulled(pulled_notif("l-9")) == "l-9" and parse_pulled(b"other") is None


def test_kv_layout_check():
    spec = KVCacheSpec.from_model(preset("tiny"))
    layout = transfer_convert.kv_layout_to_proto(spec)
    transfer_convert.check_kv_layout(layout, spec, "peer")
    layout.kv_cache_dtype = "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        transfer_convert.check_kv_layout(layout, spec, "peer")
    # a peer that stores fp8 indexer keys as 132-byte rows (it sends no layout name): same sizes, refused
    old = transfer_convert.kv_layout_to_proto(spec)
    old.ClearField("index_key_layout")
    assert spec.index_key_layout == "block-major" and old.index_block_bytes == spec.index_block_bytes
    with pytest.raises(ValueError, match="index_key_layout"):
        transfer_convert.check_kv_layout(old, spec, "peer")


def test_hashes_ttl_and_clocks():
    assert convert.block_hashes_from_proto([bytes(16)]) == [bytes(16)]
    with pytest.raises(ValueError, match=r"block_hashes\[1\] has 15 bytes"):
        convert.block_hashes_from_proto([bytes(16), bytes(15)])
    assert convert.ttl_s(0, 10.0, 60.0) == 10.0 and convert.ttl_s(1500, 10.0, 60.0) == 1.5
    with pytest.raises(ValueError, match="exceeds"):
        convert.ttl_s(61_000, 10.0, 60.0)
    deadline = time.monotonic() + 5
    assert abs(convert.monotonic_from_unix_ms(convert.unix_ms(deadline)) - deadline) < 0.01


def test_metrics_names_and_roles():
    m = ServiceMetrics("decode", instance_id="decode-3")
    m.nixl_bytes_transferred.inc(1024)
    m.time_per_output_token_seconds.observe(0.02)
    text = generate_latest(m.registry).decode()
    assert "pdserve:nixl_bytes_transferred_total 1024.0" in text
    assert "pdserve:time_per_output_token_seconds_bucket" in text
    assert 'pdserve:service_info{instance_id="decode-3",role="decode"} 1.0' in text
    assert not hasattr(m, "kvstore_evictions") and not hasattr(m, "e2e_request_latency_seconds")
    router = ServiceMetrics("router")
    assert hasattr(router, "e2e_request_latency_seconds") and hasattr(router, "time_to_first_token_seconds")
    with pytest.raises(ValueError, match="role"):
        ServiceMetrics("tokenizer")


def test_state_records():
    info = InstanceInfo("prefill", "prefill-0", "h:1", capacity={"num_blocks": 7.0}, extra={"dp": "0"})
    assert InstanceInfo.from_hash(info.to_hash()) == info
    with pytest.raises(ValueError, match="role"):
        InstanceInfo("worker", "w", "h:1")
    with pytest.raises(ValueError, match="instance_id"):
        InstanceInfo("decode", "a:b", "h:1")
    ev = KVEvent("kv0", "stored", (bytes(16), b"\x01" * 16))
    assert KVEvent.from_json(ev.to_json()) == ev
    with pytest.raises(ValueError, match="kind"):
        KVEvent.from_json('{"instance_id": "x", "kind": "moved"}')
