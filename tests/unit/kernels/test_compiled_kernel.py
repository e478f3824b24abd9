"""kernels.triton_support.CompiledKernel's key: what Triton specialises a kernel on (a compiled handle is reused
only for arguments that would have compiled to the same kernel). The direct launches themselves are checked on the GPU
by tests/kernels/test_hisparse_gather.py::test_layer_copy_launches_again_by_specialisation."""

from __future__ import annotations

import torch

from kernels.triton_support import CompiledKernel, _spec


def test_keys_follow_triton_specialisation():
    t = torch.zeros(64, dtype=torch.int64)
    assert _spec(t) == _spec(torch.zeros(8, dtype=torch.int64)) == (torch.int64, True)
    assert _spec(t[1:]) == (torch.int64, False), "8-byte offset: not 16-byte aligned"
    assert _spec(t[2:]) == (torch.int64, True)
    assert _spec(t.view(torch.int32)) != _spec(t), "dtype"
    assert _spec(1) != _spec(17) and _spec(16) != _spec(17) and _spec(17) == _spec(33)
    assert _spec(1 << 31) != _spec((1 << 31) - 16), "wider than 32 bits"
    assert _spec(True) is True and _spec(None) is None and _spec(0.5) == 0.5


def test_interpreted_launches_go_through_the_jit():
    calls = []

    class Fn:
        arg_names = ["x", "N", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launcher = CompiledKernel(Fn())
    launcher.use_jit = True
    launcher((2,), (torch.zeros(4), 4), {"BLOCK": 8}, 4)
    assert calls == [((2,), (calls[0][1][0], 4), {"BLOCK": 8, "num_warps": 4})] and not launcher.compiled
