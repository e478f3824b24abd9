"""Engine values <-> the wire forms every service shares; no torch, so the router can use them.

    SamplingParams (+ StructuredOutputSpec)  <-> common_pb2.SamplingParams   router -> prefill, decode
    token ids, logprobs, finish / stop reason <-> common_pb2.TokenDelta       engines -> router -> client
    block hashes (xxh3-128, 16 bytes)         <-  bytes fields                 router, prefill, kvstore
    monotonic deadline                        <-> wall-clock unix ms           leases, reservations
    a request's TTL in ms                      -> seconds, bounded

Optional proto fields left unset take vLLM's defaults. The KV layouts and NIXL peers that only the
transfer code exchanges are converted beside it (services/transfer/convert.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.core.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutputSpec
from proto.pdserve.v1 import common_pb2

HASH_BYTES = 16  # xxh3-128 (engine/kv/hashing.py)


# ---- sampling parameters ----------------------------------------------------------------------------
def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """engine.SamplingParams -> wire (every field set explicitly)."""
    return common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed,
        max_tokens=p.max_tokens, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=p.logprobs, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens,
        structured_outputs=structured_to_proto(p.structured_outputs))


def sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """wire -> engine.SamplingParams (vLLM's defaults for unset optional fields); ValueError if invalid."""
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


def structured_to_proto(spec: StructuredOutputSpec | None) -> common_pb2.StructuredOutput | None:
    if spec is None:
        return None
    return common_pb2.StructuredOutput(kind=spec.kind, spec=spec.spec, reasoning_end=spec.reasoning_end)


def structured_from_proto(m: common_pb2.SamplingParams) -> StructuredOutputSpec | None:
    """The request's StructuredOutputSpec, or None when unset; ValueError if malformed."""
    if not m.HasField("structured_outputs"):
        return None
    s = m.structured_outputs
    return StructuredOutputSpec(kind=s.kind, spec=s.spec, reasoning_end=s.reasoning_end)


# ---- token deltas -------------------------------------------------------------------------------------
_FINISH = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
           "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}
_FINISH_NAMES = {v: k for k, v in _FINISH.items()}


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


# ---- block hashes, expiries ---------------------------------------------------------------------------
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
