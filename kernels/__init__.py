"""DSA hot-path kernels. Each module holds the Triton kernel, its checked launcher and a plain-torch `*_ref`
that defines the semantics. The engine calls the Triton launchers on CUDA and the references on CPU,
through one switch (`engine.attention.get_attention_backend`, `kernels.moe.moe_impl_for`)."""

from kernels import triton_support  # noqa: F401 - first: picks Triton's interpreter on CPU-only torch before triton loads
from kernels.formats import (
    dequantize_index_rows_ref,
    dequantize_mla_rows_ref,
    quantize_index_q_ref,
    quantize_index_rows_ref,
    quantize_mla_rows_ref,
)
from kernels.indexer import indexer_topk, indexer_topk_ref, quantize_index_q, store_index_k, store_index_k_ref
from kernels.merge import merge_attn_states, merge_attn_states_ref
from kernels.moe import fused_moe, fused_moe_ref, moe_impl_for
from kernels.moe_routing import route_ref
from kernels.sparse_mla import sparse_mla_decode, sparse_mla_prefill, sparse_mla_ref

# `store_kv` (the function) shadows the module name as a package attribute: import the module's other
# names with `from kernels.store_kv import ...`, which always resolves the module.
from kernels.store_kv import gather_kv, gather_kv_ref, store_kv, store_kv_ref
from kernels.topk import topk_rows

__all__ = [
    "dequantize_index_rows_ref", "dequantize_mla_rows_ref", "quantize_index_q_ref", "quantize_index_rows_ref",
    "quantize_mla_rows_ref", "indexer_topk", "indexer_topk_ref", "quantize_index_q", "store_index_k",
    "store_index_k_ref", "merge_attn_states", "merge_attn_states_ref", "fused_moe", "fused_moe_ref", "moe_impl_for",
    "route_ref", "sparse_mla_decode", "sparse_mla_prefill", "sparse_mla_ref", "gather_kv",
    "gather_kv_ref", "store_kv", "store_kv_ref", "topk_rows",
]
