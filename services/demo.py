"""`make demo`: generate from the shipped tiny-code checkpoint and print tokens and timings."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "tiny-code"


def offline_demo() -> None:
    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(CHECKPOINT), num_blocks=256, num_speculative_tokens=3)
    load_s = time.perf_counter() - t0
    prompt = "def fibonacci(n):\n"
    t1 = time.perf_counter()
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0))
    gen_s = time.perf_counter() - t1
    st = llm.get_stats()
    print(f"model: {CHECKPOINT.name} (loaded in {load_s:.2f} s)")
    print(f"prompt: {prompt!r}")
    print("output:\n" + prompt + out.text)
    print(f"token ids: {out.token_ids}")
    m = out.metrics
    print(f"{len(out.token_ids)} tokens in {gen_s:.2f} s ({len(out.token_ids) / gen_s:.1f} tok/s), "
          f"TTFT {m.ttft * 1e3:.0f} ms, MTP acceptance length {st.spec_mean_acceptance_length:.2f}")


if __name__ == "__main__":
    offline_demo()
    sys.exit(0)
