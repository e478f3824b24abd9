"""DSA hot-path kernels. Each module holds a plain-torch `*_ref` that defines the semantics; the Triton
kernels beside them are used on CUDA (see `kernels.dispatch`)."""

from kernels.formats import (dequantize_index_rows_ref, dequantize_mla_rows_ref, quantize_index_q_ref,
                             quantize_index_rows_ref, quantize_mla_rows_ref)
from kernels.indexer import indexer_topk_ref, store_index_k_ref
from kernels.merge import merge_attn_states_ref
from kernels.sparse_mla import sparse_mla_ref
from kernels.store_kv import gather_kv_ref, store_kv_ref

__all__ = [
    "dequantize_index_rows_ref", "dequantize_mla_rows_ref", "quantize_index_q_ref", "quantize_index_rows_ref",
    "quantize_mla_rows_ref", "indexer_topk_ref", "store_index_k_ref", "merge_attn_states_ref", "sparse_mla_ref",
    "gather_kv_ref", "store_kv_ref",
]
