"""Prompt synthesis: blocks equal exactly where hash ids agree, exact lengths, per-copy markers;
trace parsing and token scaling."""

from __future__ import annotations

import itertools

import pytest

from bench.serving.synth import PromptSynth
from bench.serving.traces import BLOCK_SIZE, SubagentGroup, Turn, parse_trace, scale_hash_ids
from engine.kv.hashing import block_hashes


def _turn(turn_id: int, hash_ids: list[int], tail: int) -> Turn:
    return Turn(turn_id=turn_id, input_len=len(hash_ids) * BLOCK_SIZE + tail, output_len=4,
                hash_ids=tuple(hash_ids), think_s=0.0)


def _blocks(prompt: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]) for i in range(n)]


def test_blocks_equal_exactly_where_hash_ids_agree():
    synth = PromptSynth("trace_x", 3, vocab_size=4096)
    a = _turn(0, [1, 2, 3, 4, 9], tail=17)
    b = _turn(1, [1, 2, 5, 4, 6, 1], tail=40)
    pa, pb = synth.prompt(a), synth.prompt(b)
    blocks = list(zip(a.hash_ids, _blocks(pa, 5))) + list(zip(b.hash_ids, _blocks(pb, 6)))
    for (id_x, blk_x), (id_y, blk_y) in itertools.combinations(blocks, 2):
        assert (blk_x == blk_y) == (id_x == id_y), (id_x, id_y)


@pytest.mark.parametrize("hash_ids,tail", [([], 0), ([], 1), ([], 63), ([7], 0), ([7, 8], 5), ([1] * 30, 63)])
def test_exact_prompt_length_and_id_range(hash_ids, tail):
    turn = _turn(11, hash_ids, tail)
    if turn.input_len == 0:
        turn = Turn(turn_id=11, input_len=1, output_len=1, hash_ids=(), think_s=0.0)
    prompt = PromptSynth("t", 0, vocab_size=300, min_token_id=16).prompt(turn)
    assert len(prompt) == turn.input_len
    assert all(isinstance(x, int) and 16 <= x < 300 for x in prompt)


def test_tail_is_unique_per_turn_and_prompts_are_deterministic():
    s1, s2 = PromptSynth("t", 5, vocab_size=4096), PromptSynth("t", 5, vocab_size=4096)
    a, b = _turn(1, [1, 2], tail=30), _turn(2, [1, 2], tail=30)
    pa, pb = s1.prompt(a), s1.prompt(b)
    assert pa[:128] == pb[:128] and pa[128:] != pb[128:]
    assert s2.prompt(a) == pa  # a pure function of (trace, copy, turn)


def test_session_copies_differ_from_the_first_block_and_turns_share_prefix_hashes():
    turn1, turn2 = _turn(0, [1, 2, 3], tail=10), _turn(1, [1, 2, 3, 4], tail=3)
    copy_a, copy_b = PromptSynth("t", 0, vocab_size=4096), PromptSynth("t", 1, vocab_size=4096)
    ha1, ha2 = block_hashes(copy_a.prompt(turn1)), block_hashes(copy_a.prompt(turn2))
    hb1 = block_hashes(copy_b.prompt(turn1))
    assert ha2[:3] == ha1  # the next turn of one copy reuses the whole cached prefix
    assert copy_a.prompt(turn1)[:BLOCK_SIZE] != copy_b.prompt(turn1)[:BLOCK_SIZE]
    assert not set(hb1) & set(ha1 + ha2)  # another copy of the same trace shares nothing
    other_trace = PromptSynth("u", 0, vocab_size=4096)
    assert other_trace.block(1) != copy_a.block(1)


def test_bad_synth_arguments_raise():
    with pytest.raises(ValueError, match="vocab_size"):
        PromptSynth("t", 0, vocab_size=10, min_token_id=16)
    with pytest.raises(ValueError, match="do not fit"):
        PromptSynth("t", 0, vocab_size=100).prompt(Turn(0, 10, 1, (1,), 0.0))


def test_token_scale_keeps_prefix_structure():
    ids_a = list(range(100))
    ids_b = list(range(60)) + list(range(1000, 1050))  # shares the first 60 blocks
    scale = 0.1
    len_a, len_b = round(100 * 64 * scale), round(110 * 64 * scale)
    sa, sb = scale_hash_ids(ids_a, len_a, scale), scale_hash_ids(ids_b, len_b, scale)
    assert len(sa) == len_a // 64 and len(sb) == len_b // 64
    shared = sum(1 for x, y in zip(sa, sb) if x == y)
    assert shared == 6 and sa[:6] == sb[:6] and sa[6:] != sb[6:len(sa)]


def _req(t, n_in, n_out, ids, think=None, api=1.0):
    r = {"t": t, "type": "n", "in": n_in, "out": n_out, "hash_ids": ids, "api_time": api}
    if think is not None:
        r["think_time"] = think
    return r


def test_parse_trace_with_parallel_then_sequential_subagents():
    sub = lambda end, dur, n: {"type": "subagent", "t": end, "duration_ms": dur * 1000,
                               "requests": [_req(0.0, n, 5, list(range(50, 50 + n // 64)), think=0.0)]}
    data = {"id": "tr", "block_size": 64, "requests": [
        _req(0.0, 640, 20, list(range(10)), think=0.0),
        sub(31.0, 30.0, 200), sub(41.0, 40.0, 300),  # start together at t=1 (parallel)
        sub(60.0, 10.0, 128),  # starts at 50 after the group ended at 41: sequential, 9 s later
        _req(70.0, 700, 10, list(range(10)), think=69.0),  # think_time counts from t=1: use 70 - 60
        _req(80.0, 750, 10, list(range(11)), think=8.0)]}
    steps = parse_trace(data).session.steps
    assert [type(s).__name__ for s in steps] == ["Turn", "SubagentGroup", "SubagentGroup", "Turn", "Turn"]
    assert isinstance(steps[1], SubagentGroup) and len(steps[1].sessions) == 2 and steps[1].think_s == 0.0
    assert len(steps[2].sessions) == 1 and steps[2].think_s == pytest.approx(9.0)
    assert steps[3].think_s == pytest.approx(10.0) and steps[4].think_s == 8.0
    scaled = parse_trace(data, token_scale=0.1)
    turns = scaled.session.turns()
    assert [t.input_len for t in turns] == [64, 20, 30, 13, 70, 75] and [t.output_len for t in turns][:2] == [2, 1]
    assert len({t.turn_id for t in turns}) == 6


def test_parse_trace_rejects_inconsistent_hash_ids():
    with pytest.raises(ValueError, match="hash_ids"):
        parse_trace({"id": "bad", "requests": [_req(0.0, 640, 1, [1, 2])]})
