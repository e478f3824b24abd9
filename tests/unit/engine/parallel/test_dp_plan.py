"""The DP × EP group's step plan (engine/parallel/dp_runner.py) and the static dispatch's refusals: which steps are
planned and with which passes, a pass larger than the plan, a rank with another capture set, a bucket the static
buffers do not have; the one-GPU emulation's loopback transport (engine/parallel/loopback.py)."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.dp_runner import StepPlan, _check_capture_set, plan_step
from engine.parallel.ep import StaticDispatcher, static_dispatch_bytes
from engine.parallel.loopback import LoopbackComm
from kernels.moe import fused_moe_ref

SIZES = [1, 2, 4, 8]


def test_decode_steps_are_planned_from_the_largest_rank():
    # rank 0: 3 requests verifying 3 drafts, rank 1: idle, rank 2: 5 requests (one without drafts yet)
    plan = plan_step([[4, 4, 4], [], [4, 4, 1, 4, 4]], SIZES, 3, with_mtp=True)
    assert plan == StepPlan(8, 4, (("target", 32), ("mtp", 32), ("mtp", 8), ("mtp", 8)))
    assert plan_step([[1]], SIZES, 0, with_mtp=False).passes == (("target", 1),)
    assert plan_step([[], []], SIZES, 3, with_mtp=True).passes == ()  # nobody runs a pass: no collective


def test_prompt_chunks_and_large_batches_run_dynamic():
    assert plan_step([[4, 70], [4]], SIZES, 3, with_mtp=True) is None  # a prompt chunk on rank 0
    assert plan_step([[1] * 9, [1]], SIZES, 0, with_mtp=False) is None  # past the largest capture size: eager


def _experts(E=8, H=16, inner=8):
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * inner, H, generator=g), torch.randn(E, H, inner, generator=g)

    class Experts:
        offset = 0

        def __call__(self, x, w, ids):
            return fused_moe_ref(x, w13, w2, w, ids)

    return Experts(), w13, w2


def test_static_dispatch_refuses_more_rows_than_planned_and_equals_local_experts():
    experts, w13, w2 = _experts()
    d = StaticDispatcher(LoopbackComm(1, torch.device("cpu")), 8)
    x, ids, w = torch.randn(5, 16), torch.randint(0, 8, (5, 2)), torch.rand(5, 2)
    d.rows = 4
    with pytest.raises(ValueError, match="exceeds the 4 rows the group planned"):
        d(x, w, ids, experts)
    d.rows = 8  # padded inside: the real rows' outputs are the experts' own
    assert torch.equal(d(x, w, ids, experts), fused_moe_ref(x, w13, w2, w, ids))
    d.rows, d.row_valid = None, torch.tensor([True, True, False, True, False])  # padding rows claim no expert
    out = d(x, w, ids, experts)
    assert torch.equal(out[[0, 1, 3]], fused_moe_ref(x[[0, 1, 3]], w13, w2, w[[0, 1, 3]], ids[[0, 1, 3]]))
    assert not out[[2, 4]].any()


def test_loopback_transport_moves_the_real_buffers_and_gives_ghost_ranks_this_ranks_experts():
    comm = LoopbackComm(4, torch.device("cpu"))
    E, n_local, T = 16, 4, 3
    d = StaticDispatcher(comm, E)
    seen = []

    class Experts:
        offset = 0

        def __call__(self, x, w, ids):
            seen.append(ids.clone())
            return torch.zeros_like(x)

    ids = torch.tensor([[0, 5], [9, 13], [2, 15]])
    d.row_valid = torch.tensor([True, True, False])
    d(torch.randn(T, 8), torch.rand(T, 2), ids, Experts())
    got = seen[0].view(4, T, 2)
    for slot in range(4):  # slot d: the token's experts on rank d land on this rank's [0, 4)
        want = (ids - slot * n_local) % E
        assert torch.equal(got[slot, :2], want[:2]) and (got[slot, 2] == E).all()  # padding keeps the sentinel
    W = 8 * 4 + 2 * 2 * 4
    assert comm.bytes["ep_dispatch"] == 4 * T * W and comm.bytes["ep_combine"] == 4 * T * 8 * 4
    assert static_dispatch_bytes(T, 8, 2, 4, elem=4) == {"dispatch": 3 * T * W, "combine": 3 * T * 8 * 4}


def test_a_rank_with_another_capture_set_is_refused_at_start(tiny_ckpt):
    from engine.config.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(tiny_ckpt), device="cpu", num_speculative_tokens=3).create_engine_config()

    class Comm:
        rank = 0

        def all_gather_objects(self, obj):
            return [obj, dict(obj, capture_sizes=[1, 2])]

    with pytest.raises(ValueError, match="DP rank 1 joins the group with"):
        _check_capture_set(cfg, Comm())


def test_a_planned_bucket_outside_the_capture_sizes_is_refused(tiny_ckpt):
    from engine import LLM

    st = LLM(str(tiny_ckpt), device="cpu", enforce_eager=False, cuda_graph_sizes=SIZES, max_num_seqs=8,
             num_speculative_tokens=3, num_blocks=32).core.runner.static
    with pytest.raises(ValueError, match="not among this rank's capture sizes"):
        st.force(16, 4)
    st.force(4, 4)
    assert st.bucket(3) == 4 and st.bucket(5) is None
    st.force(None)
    assert st.bucket(5) == 8
