"""`use_kernels`: one switch for the Triton kernels, and `fused` for the one-launch small ops beside them."""

from __future__ import annotations

import functools

import pytest

from engine.config.presets import preset
from engine.loading.loader import build_model, use_kernels
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.mla import Indexer, MLAttention
from engine.model.moe import Experts, MoEGate
from kernels.moe import fused_moe, fused_moe_ref

SMALL_OPS = (RMSNorm, MLAttention, Indexer, MoEGate, GatedMLP)


def _flags(model) -> set[bool]:
    return {m.fused for m in model.modules() if isinstance(m, SMALL_OPS)}


def _impls(model) -> list:
    return [m.impl for m in model.modules() if isinstance(m, Experts)]


@pytest.mark.parametrize("on,fused", [(True, True), (True, False), (False, True), (False, False)])
def test_the_switch_sets_every_module(on, fused):
    model = build_model(preset("tiny"))
    use_kernels(model, on, fused)
    assert _flags(model) == {on and fused}, "the small ops follow the kernels and the fused switch together"
    impls = _impls(model)
    assert impls
    for impl in impls:
        if not on:
            assert impl is fused_moe_ref
        elif fused:
            assert impl is fused_moe  # its one-launch sort and combine (small_routing=True, the default)
        else:
            assert isinstance(impl, functools.partial) and impl.func is fused_moe
            assert impl.keywords == {"small_routing": False}

