"""Engine core on CPU: MTP speculation, prefix caching, chunking, preemption, aborts, seeds."""

from __future__ import annotations

import inspect

import pytest

from engine import LLM, SamplingParams
from engine.core.request import Request


def _code_prompts(tok, n: int, length: int = 24) -> list[list[int]]:
    import difflib
    ids = tok.encode(inspect.getsource(difflib))
    step = (len(ids) - length) // n
    return [ids[i * step: i * step + length] for i in range(n)]


GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def test_mtp3_greedy_equals_plain_greedy(tiny_code):
    base = LLM(str(tiny_code), num_blocks=256)
    prompts = _code_prompts(base.tokenizer, 20)
    ref = base.generate(prompts, GREEDY)
    spec = LLM(str(tiny_code), num_blocks=256, num_speculative_tokens=3)
    got = spec.generate(prompts, GREEDY)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.token_ids == b.token_ids, f"prompt {i} diverged"
    st = spec.get_stats()
    print(f"\nMTP3 on tiny-code: per-draft acceptance {st.spec_acceptance_rate:.3f}, "
          f"mean acceptance length {st.spec_mean_acceptance_length:.3f}")
    assert st.spec_drafts > 0 and st.spec_accepted > 0
    assert st.num_free_blocks == 256


@pytest.mark.parametrize("k", [1, 2])
def test_fewer_drafts_also_exact(tiny_code, k):
    base = LLM(str(tiny_code), num_blocks=64)
    prompts = _code_prompts(base.tokenizer, 4)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = LLM(str(tiny_code), num_blocks=64, num_speculative_tokens=k)
    assert [o.token_ids for o in base.generate(prompts, sp)] == [o.token_ids for o in spec.generate(prompts, sp)]


def test_synthetic_acceptance_length(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=512, max_num_seqs=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.99})
    prompts = _code_prompts(llm.tokenizer, 64, length=8)
    llm.generate(prompts, SamplingParams(max_tokens=110, temperature=0.0, ignore_eos=True))
    st = llm.get_stats()
    assert st.spec_steps >= 2000
    assert abs(st.spec_mean_acceptance_length - 2.99) <= 0.05, st.spec_mean_acceptance_length


def test_prefix_cache_hit_gives_same_output(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=64)
    prefix = _code_prompts(llm.tokenizer, 1, length=256)[0]
    first = prefix + [llm.tokenizer.encode(" a")[0]] * 5
    second = prefix + llm.tokenizer.encode("\n# second turn\n")
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate([first], sp)
    (warm,) = llm.generate([second], sp)
    assert warm.num_cached_tokens >= 4 * 64
    cold = LLM(str(tiny_code), num_blocks=64, enable_prefix_caching=False).generate([second], sp)[0]
    assert cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids
    assert llm.get_stats().num_free_blocks == 64


def test_chunked_prefill_equals_unchunked(tiny_code):
    base = LLM(str(tiny_code), num_blocks=64)
    prompts = _code_prompts(base.tokenizer, 3, length=150)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    chunked = LLM(str(tiny_code), num_blocks=64, max_num_batched_tokens=32)
    assert [o.token_ids for o in base.generate(prompts, sp)] == [o.token_ids for o in chunked.generate(prompts, sp)]


@pytest.mark.parametrize("spec", [None, 3])
def test_preemption_completes_with_identical_outputs(tiny_code, spec):
    kw = dict(num_speculative_tokens=spec) if spec else {}
    ref_llm = LLM(str(tiny_code), num_blocks=128, **kw)
    prompts = _code_prompts(ref_llm.tokenizer, 6, length=100)
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ref = ref_llm.generate(prompts, sp)
    small = LLM(str(tiny_code), num_blocks=9, enable_prefix_caching=False, **kw)  # 6 x 3 blocks won't fit
    got = small.generate(prompts, sp)
    st = small.get_stats()
    assert st.num_preemptions > 0
    assert [o.token_ids for o in ref] == [o.token_ids for o in got]
    assert st.num_free_blocks == 9 and st.num_running == 0


def test_abort_frees_blocks_immediately(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=32)
    core = llm.core
    for i in range(3):
        core.add_request(Request(f"r{i}", list(range(10, 150)), SamplingParams(max_tokens=100, ignore_eos=True)))
    for _ in range(3):
        core.step()
    assert core.stats().num_free_blocks < 32
    for i in range(3):
        assert core.abort(f"r{i}")
    st = core.stats()
    assert st.num_free_blocks == 32 and st.num_running == 0 and st.num_waiting == 0
    assert not core.has_unfinished()
    core.step()  # the runner drops the aborted requests' state
    assert not llm.core.runner.states


def test_seeded_sampling_reproducible_and_batch_independent(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=64)
    prompts = _code_prompts(llm.tokenizer, 4)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=42, ignore_eos=True)
    other = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    again = LLM(str(tiny_code), num_blocks=64, seed=5).generate([prompts[0]], seeded)[0].token_ids
    mixed = llm.generate(prompts, [other, other, seeded, other])[2].token_ids
    mixed_prompt0 = llm.generate([prompts[1], prompts[0]], [other, seeded])[1].token_ids
    assert alone == again
    assert mixed_prompt0 == alone
    assert mixed != alone or prompts[2] == prompts[0]
    unseeded = [llm.generate([prompts[0]], other)[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_sampled_speculation_runs_and_is_seeded(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=64, num_speculative_tokens=3)
    prompts = _code_prompts(llm.tokenizer, 3)
    sp = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompts, sp)]
    b = [o.token_ids for o in llm.generate(prompts, sp)]
    assert a == b and all(len(x) == 30 for x in a)
    assert llm.get_stats().spec_accepted > 0


def test_stop_strings_tokens_logprobs(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=64)
    p = llm.tokenizer.encode("def f(x):\n    return")
    (full,) = llm.generate([p], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    word = full.text[3:6]
    (stopped,) = llm.generate([p], SamplingParams(max_tokens=30, temperature=0.0, stop=[word]))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert stopped.text == full.text[: full.text.index(word)]
    stop_tok = full.token_ids[4]
    (st,) = llm.generate([p], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_tok]))
    assert st.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1] and st.stop_reason == stop_tok
    (lp,) = llm.generate([p], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True))
    assert len(lp.logprobs) == 5
    for tok, d in zip(lp.token_ids, lp.logprobs):
        assert tok in d and len(d) == 3 and max(d, key=d.get) == tok  # greedy picks the top logprob
    assert llm.get_stats().num_free_blocks == 64
