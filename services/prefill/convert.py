"""Prefill service: engine/export objects -> wire messages."""

from __future__ import annotations

from proto.pdserve.v1 import prefill_pb2
from services.transfer.wire import kv_layout_to_proto, nixl_peer_to_proto, unix_ms


def kv_handle(instance_id: str, lease, num_tokens: int, exporter, pages, hashes: list[bytes],
              num_cached: int) -> prefill_pb2.KVHandle:
    return prefill_pb2.KVHandle(
        prefill_instance_id=instance_id, lease_id=lease.lease_id, lease_expires_unix_ms=unix_ms(lease.expires),
        num_tokens=num_tokens, layout=kv_layout_to_proto(exporter.spec), dcp_size=exporter.dcp_size,
        cp_kv_cache_interleave_size=exporter.interleave,
        ranks=[prefill_pb2.RankPages(rank=p.rank, peer=nixl_peer_to_proto(p.agent_name, p.agent_metadata, p.tensors),
                                     block_ids=p.block_ids) for p in pages],
        block_hashes=hashes, num_cached_tokens=num_cached, block_generations=lease.generations)
