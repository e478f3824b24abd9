"""bench.prefill.stack on CPU (tiny preset): each length's shapes run untimed first (`--warmup`), then the timed
fresh prompts, the cached second turn and PCP rank 0's two chunks, and the JSON row has every figure."""

from __future__ import annotations

import json

import bench.prefill.stack as stack


def test_each_length_is_warmed_up_before_it_is_timed(monkeypatch, tmp_path):
    calls = []
    time_prefill = stack._time_prefill
    monkeypatch.setattr(stack, "_time_prefill", lambda llm, ids, **kw: (calls.append(len(ids)),
                                                                         time_prefill(llm, ids, **kw))[1])
    out = tmp_path / "stack.json"
    assert stack.main(["--preset", "tiny", "--device", "cpu", "--lengths", "512", "--pcp", "2", "--reps", "1",
                       "--warmup", "1", "--out", str(out)]) == 0
    # engine warm-up; the length's warm-up: a fresh prompt, a cached tail (prefix, whole), PCP-2 rank 0's chunks;
    # then timed: a fresh prompt, the second turn (prefix, whole), PCP-2 rank 0's chunks 0 (128) and 3 (prefix
    # 384, whole)
    assert calls == [512, 512, 384, 512, 128, 384, 512, 512, 384, 512, 128, 384, 512]
    row = json.loads(out.read_text())["lengths"]["512"]
    assert row["ttft_s"] > 0 and row["second_turn_s"] > 0 and row["pcp_rank0"]["2"]["rank0_s"] > 0
