"""The wire forms of what only the KV transfer code exchanges: NIXL memory descriptors, NIXL peers and
KV layouts (prefill, decode and kvstore check a peer's layout against their own before any transfer).
The torch-free conversions every service shares (sampling parameters, token deltas, block hashes,
expiries) are in services/rpc/convert.py."""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv.cache import KVCacheSpec
from proto.pdserve.v1 import common_pb2
from services.transfer.nixl_agent import BlockTensor

_DEVICE_KINDS = {"DRAM": common_pb2.DEVICE_KIND_DRAM, "VRAM": common_pb2.DEVICE_KIND_VRAM}
_MEM_TYPES = {v: k for k, v in _DEVICE_KINDS.items()}


def block_tensor_to_proto(t: BlockTensor) -> common_pb2.MemoryDesc:
    return common_pb2.MemoryDesc(name=t.name, base_addr=t.base_addr, block_bytes=t.block_bytes,
                                 num_blocks=t.num_blocks, device_kind=_DEVICE_KINDS[t.mem_type],
                                 device_id=t.device_id)


def block_tensor_from_proto(m: common_pb2.MemoryDesc) -> BlockTensor:
    if m.device_kind not in _MEM_TYPES:
        raise ValueError(f"memory descriptor {m.name!r} has no device kind (DRAM or VRAM)")
    return BlockTensor(name=m.name, base_addr=m.base_addr, block_bytes=m.block_bytes, num_blocks=m.num_blocks,
                       mem_type=_MEM_TYPES[m.device_kind], device_id=m.device_id)


def nixl_peer_to_proto(agent_name: str, metadata: bytes, tensors: Iterable[BlockTensor]) -> common_pb2.NixlPeer:
    return common_pb2.NixlPeer(agent_name=agent_name, agent_metadata=metadata,
                               tensors=[block_tensor_to_proto(t) for t in tensors])


def nixl_peer_from_proto(p: common_pb2.NixlPeer) -> tuple[str, bytes, list[BlockTensor]]:
    if not p.agent_name:
        raise ValueError("NIXL peer without an agent name")
    return p.agent_name, p.agent_metadata, [block_tensor_from_proto(m) for m in p.tensors]


def kv_layout_to_proto(spec: KVCacheSpec) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(block_size=spec.block_size, kv_cache_dtype=spec.kv_cache_dtype,
                               indexer_precision=spec.indexer_precision, mla_block_bytes=spec.mla_block_bytes,
                               index_block_bytes=spec.index_block_bytes, index_key_layout=spec.index_key_layout)


def check_kv_layout(layout: common_pb2.KVLayout, spec: KVCacheSpec, peer: str) -> None:
    """Raise ValueError naming the first field where `peer`'s KV layout differs from ours."""
    ours = kv_layout_to_proto(spec)
    for field in ("block_size", "kv_cache_dtype", "indexer_precision", "mla_block_bytes", "index_block_bytes",
                  "index_key_layout"):
        if getattr(layout, field) != getattr(ours, field):
            raise ValueError(f"KV layout of {peer} differs in {field}: {getattr(layout, field)!r} vs ours "
                             f"{getattr(ours, field)!r}; serve the same model with the same --kv-cache-dtype")
