"""Conversions between proto messages shared by several services and their Python forms:
KV memory descriptors, NIXL peers, KV layouts, block hashes and wall-clock expiries."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from engine.kv.cache import KVCacheSpec
from proto.pdserve.v1 import common_pb2
from services.transfer.nixl_agent import BlockTensor

HASH_BYTES = 16  # xxh3-128 (engine/kv/hashing.py)
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


def block_hashes_from_proto(hashes: Sequence[bytes]) -> list[bytes]:
    out = list(hashes)
    for i, h in enumerate(out):
        if len(h) != HASH_BYTES:
            raise ValueError(f"block_hashes[{i}] has {len(h)} bytes; expected {HASH_BYTES} (xxh3-128)")
    return out


def unix_ms(monotonic_deadline: float) -> int:
    """A deadline on this process's monotonic clock as wall-clock unix milliseconds (for the wire)."""
    return int((time.time() + monotonic_deadline - time.monotonic()) * 1000)


def monotonic_from_unix_ms(ms: int) -> float:
    """A wire expiry as a deadline on this process's monotonic clock."""
    return time.monotonic() + ms / 1000.0 - time.time()


def ttl_s(ttl_ms: int, default_s: float, max_s: float) -> float:
    """A request's TTL (0 = default), bounded so one client cannot pin memory forever."""
    if ttl_ms == 0:
        return default_s
    if ttl_ms / 1000.0 > max_s:
        raise ValueError(f"ttl_ms {ttl_ms} exceeds the maximum of {int(max_s * 1000)}")
    return ttl_ms / 1000.0


# ---- engine <-> wire: sampling parameters and token deltas ------------------------------------------
_FINISH = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
           "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}
_FINISH_NAMES = {v: k for k, v in _FINISH.items()}


def sampling_to_proto(p) -> common_pb2.SamplingParams:
    """engine.SamplingParams -> wire (every field set explicitly)."""
    return common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed,
        max_tokens=p.max_tokens, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=p.logprobs, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens,
        structured_outputs=structured_to_proto(p.structured_outputs))


def sampling_from_proto(m: common_pb2.SamplingParams):
    """wire -> engine.SamplingParams (vLLM's defaults for unset optional fields); ValueError if invalid."""
    from engine.core.sampling_params import SamplingParams

    opt = {}
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "logprobs", "repetition_penalty",
                 "skip_special_tokens"):
        if m.HasField(name):
            opt[name] = getattr(m, name)
    return SamplingParams(min_p=m.min_p, stop=list(m.stop), stop_token_ids=list(m.stop_token_ids),
                          ignore_eos=m.ignore_eos, presence_penalty=m.presence_penalty,
                          frequency_penalty=m.frequency_penalty, min_tokens=m.min_tokens,
                          include_stop_str_in_output=m.include_stop_str_in_output,
                          structured_outputs=structured_from_proto(m), **opt)


def structured_to_proto(spec) -> common_pb2.StructuredOutput | None:
    if spec is None:
        return None
    return common_pb2.StructuredOutput(kind=spec.kind, spec=spec.spec, reasoning_end=spec.reasoning_end)


def structured_from_proto(m: common_pb2.SamplingParams):
    """The request's StructuredOutputSpec, or None when unset; ValueError if malformed."""
    from engine.structured import StructuredOutputSpec

    if not m.HasField("structured_outputs"):
        return None
    s = m.structured_outputs
    return StructuredOutputSpec(kind=s.kind, spec=s.spec, reasoning_end=s.reasoning_end)


def finish_to_proto(reason: str | None) -> int:
    return _FINISH[reason]


def finish_from_proto(code: int) -> str | None:
    return _FINISH_NAMES.get(code)


def logprobs_to_proto(token_ids: Sequence[int], logprobs: Sequence[dict] | None) -> list[common_pb2.TokenLogprobs]:
    if not logprobs:
        return []
    out = []
    for tok, d in zip(token_ids, logprobs):
        ranked = sorted(d.items(), key=lambda kv: -kv[1])
        rank = {t: i + 1 for i, (t, _) in enumerate(ranked)}
        out.append(common_pb2.TokenLogprobs(
            sampled=common_pb2.Logprob(token_id=tok, logprob=d[tok], rank=rank[tok]),
            top=[common_pb2.Logprob(token_id=t, logprob=v, rank=rank[t]) for t, v in ranked]))
    return out


def logprobs_from_proto(items: Sequence[common_pb2.TokenLogprobs]) -> list[dict[int, float]] | None:
    if not items:
        return None
    out = []
    for it in items:
        d = {lp.token_id: lp.logprob for lp in it.top}
        d[it.sampled.token_id] = it.sampled.logprob
        out.append(d)
    return out


def delta_to_proto(token_ids: Sequence[int], logprobs, finish_reason: str | None,
                   stop_reason: int | str | None) -> common_pb2.TokenDelta:
    d = common_pb2.TokenDelta(token_ids=list(token_ids), logprobs=logprobs_to_proto(token_ids, logprobs),
                              finish_reason=finish_to_proto(finish_reason))
    if isinstance(stop_reason, str):
        d.stop_reason = stop_reason
    elif isinstance(stop_reason, int):
        d.stop_token_id = stop_reason
    return d
