"""Run under torchrun by test_cp_engine: every rank runs this file; rank 0 builds a PCP=2 x DCP=2 engine
(it finds torchrun's environment and spawns nothing), the other rank serves as its worker."""

from __future__ import annotations

import json
import sys

from engine.parallel.spawn import run_rank


def main() -> None:
    from engine import LLM, SamplingParams

    ckpt, prompts_json, out_path = sys.argv[1:4]
    llm = LLM(ckpt, device="cpu", dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32",
              num_blocks=32, prefill_context_parallel_size=2, decode_context_parallel_size=2)
    outs = llm.generate(json.loads(prompts_json), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    with open(out_path, "w") as f:
        json.dump([o.token_ids for o in outs], f)
    llm.core.shutdown()


if __name__ == "__main__":
    run_rank(main)
