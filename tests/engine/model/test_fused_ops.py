"""The model with its norms, RoPE and routing as one-launch kernels (what CUDA runs) equals the eager model.

On the CPU the kernels run in Triton's interpreter inside a real forward of tiny-code; the MoE experts stay
on their reference so the comparison isolates the small ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.model.layers as layers
import engine.model.mla as attention
import engine.model.moe as moe
from engine.frontend.llm import LLM
from engine.model.layers import RMSNorm
from engine.model.mla import Indexer, MLAttention
from engine.model.moe import MoEGate
from kernels.triton_support import interpreting

DATA = Path(__file__).resolve().parents[2] / "data" / "heldout_python.txt"
pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the kernels in Triton's interpreter")


def _counted(monkeypatch, module, name: str, counts: dict) -> None:
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_small_ops_equal_the_eager_model(tiny_code, dtype, monkeypatch):
    llm = LLM(str(tiny_code), num_blocks=8, dtype=dtype)
    ids = llm.tokenizer.encode(DATA.read_text())[:12]
    eager = llm.prompt_logits(ids)
    counts: dict = {}
    for module, name in ((layers, "rms_norm"), (attention, "rope"), (attention, "rope_cat"), (moe, "route")):
        _counted(monkeypatch, module, name, counts)
    for m in llm.core.runner.model.modules():
        if isinstance(m, (RMSNorm, MLAttention, Indexer, MoEGate)):
            m.fused = True
    fused = llm.prompt_logits(ids)
    assert set(counts) == {"rms_norm", "rope", "rope_cat", "route"}, counts
    if dtype == "float32":
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    else:  # the sums of squares add in another order: a bf16 rounding may differ, rarely
        assert (fused.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.95
        cos = torch.nn.functional.cosine_similarity(fused, eager, dim=-1)
        assert cos.min() > 0.999, cos.min()
