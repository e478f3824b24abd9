"""Roofline of sparse MLA and the prefill FLOP split (indexer / sparse MLA / MoE / rest).

Sparse MLA, absorbed (MQA) form, per query token and layer, H heads on the GPU, k = top-k rows:

    FLOPs = H · k · 2 · (D_qk + D_v)          D_qk = 576 (latent + rope) for q·c, D_v = 512 for p·latent
    bytes = k · (row + 4)                      the selected KV rows (656 B fp8_ds_mla) + int32 indices
          + H · (2·D_qk + 2·D_v + 4)           bf16 query, bf16 output, fp32 LSE per head

Intensity = FLOPs / bytes, against the GPU's ridge point = peak FLOP/s / bandwidth: below the ridge
the kernel is memory-bound. The KV rows are shared by all heads, so intensity grows with H: TP=N
leaves num_heads/N heads per GPU, PCP keeps all of them.

Prefill of a fresh prompt of L tokens (no prefix cache), whole engine:

    indexer     n_index_layers · 2 · H_I · D_I · L(L+1)/2        every causal (query, key) pair
    sparse MLA  n_mla_layers · H · 2 · (D_qk + D_v) · Σ_s min(k, s+1)
    MoE         2 · L · (routed params · top_k / n_routed + shared experts + router), all MoE layers
    rest        2 · L · (every other matrix: attention and indexer projections, dense MLPs, MTP
                eh_proj) + 2 · lm_head (one sampled position)

Per GPU: under TP=N the indexer is replicated on every rank while MLA heads are split (MLA / N);
under PCP=N each rank runs both for its own query rows (both / N). The indexer overtakes sparse MLA
at the L where indexer_per_gpu = mla_per_gpu.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine.config.model_config import ModelConfig
from engine.kv.cache import KVCacheSpec
from planner.capacity import numel, param_shapes

QUERY_BYTES = 2  # bf16
OUT_BYTES = 2  # bf16
LSE_BYTES = 4  # fp32
INDEX_BYTES = 4  # int32 top-k positions


def sparse_mla_flops(cfg: ModelConfig, heads: int) -> int:
    """Per query token and layer."""
    return heads * cfg.index_topk * 2 * (cfg.kv_cache_dim + cfg.kv_lora_rank)


def sparse_mla_bytes(cfg: ModelConfig, spec: KVCacheSpec, heads: int) -> int:
    row = spec.mla_row * spec.mla_torch_dtype.itemsize
    per_head = QUERY_BYTES * cfg.kv_cache_dim + OUT_BYTES * cfg.kv_lora_rank + LSE_BYTES
    return cfg.index_topk * (row + INDEX_BYTES) + heads * per_head


def intensity(cfg: ModelConfig, spec: KVCacheSpec, heads: int) -> float:
    return sparse_mla_flops(cfg, heads) / sparse_mla_bytes(cfg, spec, heads)


def roofline(cfg: ModelConfig, spec: KVCacheSpec, *, flops_per_s: float, bytes_per_s: float,
             n: int, heads: list[int] | None = None) -> dict:
    """Intensity per head count; `n` GPUs: TP=n leaves num_heads/n heads per GPU, PCP=n all of them."""
    ridge = flops_per_s / bytes_per_s
    h_all = cfg.num_attention_heads
    heads = sorted(set(heads or [h for h in (1, 2, 4, 8, 16, 32, 64, 128) if h <= h_all]
                       + [max(h_all // n, 1), h_all]))
    rows = [{"heads": h, "flops": sparse_mla_flops(cfg, h), "bytes": sparse_mla_bytes(cfg, spec, h),
             "intensity": intensity(cfg, spec, h), "attainable_fraction": min(intensity(cfg, spec, h) / ridge, 1.0),
             "bound": "memory" if intensity(cfg, spec, h) < ridge else "compute"} for h in heads]
    return {"ridge_flop_per_byte": ridge, "flops_per_s": flops_per_s, "bytes_per_s": bytes_per_s,
            "n": n, "tp_heads": max(h_all // n, 1), "pcp_heads": h_all, "rows": rows}


# ---- prefill FLOPs -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ActiveParams:
    """Matrix parameters one token multiplies, by part (from the model built on `meta`)."""

    moe: int  # routed (scaled by top_k / n_routed) + shared experts + router
    rest: int  # every other matrix except embeddings and lm_head
    lm_head: int
    routed: int = 0  # of `moe`, the routed experts' (what expert parallelism spreads over the ranks)


@lru_cache(maxsize=16)
def active_params(cfg: ModelConfig, with_mtp: bool) -> ActiveParams:
    routed = moe = rest = head = 0
    for name, shape in param_shapes(cfg, with_mtp):
        n = numel(shape)
        if len(shape) < 2 or "embed_tokens" in name:  # norms, biases: elementwise; embeddings: a lookup
            continue
        if ".mlp.experts." in name:
            routed += n
        elif ".mlp.shared_experts." in name or ".mlp.gate." in name:
            moe += n
        elif "lm_head" in name:
            head += n
        else:
            rest += n
    active_routed = routed * cfg.num_experts_per_tok // cfg.n_routed_experts if cfg.n_routed_experts else 0
    return ActiveParams(moe=moe + active_routed, rest=rest, lm_head=head, routed=active_routed)


def selected_pairs(context: int, topk: int) -> int:
    """Σ_{s<L} min(k, s+1): (query, key) pairs sparse MLA attends in a causal prefill."""
    if context <= topk:
        return context * (context + 1) // 2
    return topk * (topk + 1) // 2 + (context - topk) * topk


def prefill_flops(cfg: ModelConfig, spec: KVCacheSpec, context: int, with_mtp: bool) -> dict[str, int]:
    act = active_params(cfg, with_mtp)
    indexer = spec.num_index_layers * 2 * cfg.index_n_heads * cfg.index_head_dim * context * (context + 1) // 2
    mla = spec.num_mla_layers * sparse_mla_flops(cfg, cfg.num_attention_heads) // cfg.index_topk \
        * selected_pairs(context, cfg.index_topk)
    out = {"indexer": indexer, "sparse_mla": mla, "moe": 2 * context * act.moe,
           "rest": 2 * context * act.rest + 2 * act.lm_head}
    out["total"] = sum(out.values())
    return out


def indexer_crossover(cfg: ModelConfig, spec: KVCacheSpec, with_mtp: bool, *, mla_divisor: int,
                      limit: int = 1 << 34) -> int | None:
    """Smallest L with indexer(L) >= sparse_mla(L) / mla_divisor, i.e. the per-GPU crossover when
    TP=N splits only MLA (divisor N) or PCP=N splits both (divisor 1). None if beyond `limit`."""
    def indexer_wins(n: int) -> bool:
        f = prefill_flops(cfg, spec, n, with_mtp)
        return f["indexer"] * mla_divisor >= f["sparse_mla"]

    if not indexer_wins(limit):
        return None
    lo, hi = 1, limit  # indexer/MLA grows with L (quadratic over at most linear): one crossing
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if indexer_wins(mid) else (mid + 1, hi)
    return lo


def prefill_split(cfg: ModelConfig, spec: KVCacheSpec, contexts: list[int], *, with_mtp: bool, n: int) -> dict:
    rows = []
    for ctx in contexts:
        f = prefill_flops(cfg, spec, ctx, with_mtp)
        rows.append({"context": ctx, **f, "shares": {k: v / f["total"] for k, v in f.items() if k != "total"}})
    return {"rows": rows, "n": n,
            "crossover_tp": indexer_crossover(cfg, spec, with_mtp, mla_divisor=n),
            "crossover_pcp": indexer_crossover(cfg, spec, with_mtp, mla_divisor=1)}
