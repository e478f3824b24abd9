"""Threshold top-k (`kernels.topk_threshold`): exact against `topk_positions_ref` on every branch.

Scores past a row's position and maxima past its groups are NaN, so a read beyond them shows up. Each case
states which branch its rows take (a host mirror of the kernel's predicates) and the test asserts every
branch ran, so a change of sizes cannot quietly stop covering one.
"""

from __future__ import annotations

import pytest
import torch

from kernels.indexer import topk_positions_ref
from kernels.topk_threshold import SelectConfig, num_maxima, topk_threshold_rows
from tests.helpers.kernel_inputs import as_sets, block_tables, gpu, interp, randn, slots_of


def group_maxima(scores: torch.Tensor, positions: torch.Tensor, group: int) -> torch.Tensor:
    """What the fused score kernel writes: max of each group's positions <= the row's; NaN past them."""
    T, S = scores.shape
    cols = num_maxima(S, SelectConfig(group=group))
    padded = torch.full((T, cols * group), float("-inf"), device=scores.device)
    padded[:, :S] = scores
    live = torch.arange(cols * group, device=scores.device)[None, :] <= positions[:, None]
    gmax = padded.masked_fill(~live, float("-inf")).view(T, cols, group).amax(dim=2)
    first = torch.arange(cols, device=scores.device)[None, :] * group
    return gmax.masked_fill(first > positions[:, None], float("nan"))


def branch(scores: torch.Tensor, n: int, k: int, cfg: SelectConfig) -> str:
    """The kernel's path for a row of n positions (a mirror of `_select_kernel`)."""
    if n <= k:
        return "all"
    groups = -(-n // cfg.group)
    fold = -(-groups // cfg.sum_cap)
    folded = -(-groups // fold)
    if folded < k:
        return "direct" if n <= cfg.cap else "radix"
    g = torch.full((folded * fold * cfg.group,), float("-inf"))
    g[:n] = scores[:n].cpu()
    theta = g.view(folded, fold * cfg.group).amax(dim=1).sort(descending=True).values[k - 1]
    listed = int((g.view(-1, cfg.group).amax(dim=1) >= theta).sum())
    if listed > cfg.gcap:
        return "radix (groups)"
    kind = "threshold" if int((scores[:n].cpu() >= theta).sum()) <= cfg.cap else "radix"
    return kind + (" folded" if fold > 1 else "")


def score_rows(gen: torch.Generator, T: int, S: int, device) -> torch.Tensor:
    s = randn(gen, T, S)
    s[1] = torch.randint(0, 5, (S,), generator=gen).float()  # heavy ties
    s[2] = -s[2].abs()  # all negative
    s[3, ::2], s[3, 1::2] = 0.0, -0.0  # +0 and -0 tie: every row's candidates overflow
    s[4] = s[4].round()
    s[5, S // 2:] += 3.0  # the top-k clustered in one range of positions
    return s.to(device)


def check_threshold(device, S: int, k: int, cfg: SelectConfig, positions: list[int], expect: set[str],
                    block_size: int = 16) -> None:
    gen = torch.Generator().manual_seed(S + k)
    T = len(positions)
    pos = torch.tensor(positions, device=device)
    scores = score_rows(gen, T, S, device)
    want = topk_positions_ref(scores, pos, k)
    poisoned = scores.masked_fill(torch.arange(S, device=device)[None, :] > pos[:, None], float("nan"))
    gmax = group_maxima(scores, pos, cfg.group)
    seen = {branch(scores[t], int(pos[t]) + 1, k, cfg) for t in range(T)}
    assert expect <= seen, f"cases cover {seen}, not {expect}: resize them"
    out = torch.full((T + 2, k), 1234, dtype=torch.int32, device=device)
    topk_threshold_rows(poisoned, gmax, torch.cat([pos.new_zeros(2), pos]), k, out, 2, cfg)
    assert as_sets(out[2:]) == as_sets(want), "selection differs from the stable descending sort"
    valid = out[2:] >= 0
    assert torch.all(valid[:, :-1] >= valid[:, 1:]), "valid entries must come first"
    got = out[2:].masked_fill(~valid, 1 << 30)
    assert torch.all(got[:, 1:] > got[:, :-1]), "positions must ascend"
    assert torch.all(out[:2] == 1234), "rows before row_offset were written"
    # as slots through a shuffled block table, each row its own request
    table = block_tables([S] * T, block_size, T * -(-S // block_size) + 2, gen, device)
    req = torch.arange(T, dtype=torch.int32, device=device)
    slots = torch.full((T, k), 1234, dtype=torch.int32, device=device)
    topk_threshold_rows(poisoned, gmax, pos, k, slots, 0, cfg, token_req_idx=req, block_table=table,
                        block_size=block_size)
    for t in range(T):
        expect_slots = slots_of(table[t], out[2 + t][valid[t]], block_size)
        assert torch.equal(slots[t][valid[t]].long(), expect_slots) and torch.all(slots[t][~valid[t]] == -1)


CASES = {  # name: (S, k, config, positions, branches that must be hit)
    "threshold": (700, 20, SelectConfig(group=4, sum_cap=256, gcap=128, cap=128, scan=64, block=64, programs=1),
                  [699, 650, 600, 699, 680, 699, 19, 18, 20], {"all", "threshold", "radix"}),
    "small steps": (700, 20, SelectConfig(group=4, sum_cap=256, gcap=64, cap=128, scan=32, block=32, num_warps=4),
                    [699, 650, 600, 699, 680, 699, 300], {"threshold", "radix (groups)"}),
    "folded": (900, 16, SelectConfig(group=4, sum_cap=64, gcap=64, cap=128, scan=128, block=64, programs=2),
               [899, 880, 870, 899, 700, 899], {"threshold folded"}),
    "direct": (300, 40, SelectConfig(group=16, sum_cap=64, gcap=64, cap=256, scan=64, block=64),
               [255, 250, 200, 299, 255, 255, 39], {"all", "direct", "radix"}),
}


@interp
@pytest.mark.parametrize("case", sorted(CASES))
def test_threshold_interp(case):
    S, k, cfg, positions, expect = CASES[case]
    check_threshold("cpu", S, k, cfg, positions, expect)


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_threshold_gpu(mark):
    S, k = 131072, 2048
    positions = [S - 1, S - 7, 100_000, S - 1, S - 1, S - 1, 2047, 5000, 8191]
    check_threshold("cuda", S, k, SelectConfig(), positions, {"all", "threshold", "radix", "direct"}, block_size=64)
    S = 1 << 20
    check_threshold("cuda", S, k, SelectConfig(programs=1), [S - 1, S - 3, 700_000, S - 1, S - 1, S - 1],
                    {"threshold folded", "radix (groups)"}, block_size=64)
