"""The offline API: `LLM(model=DIR, ...)`, `.generate(prompts, SamplingParams)`, `.prompt_logits(ids)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from engine.config.arg_utils import EngineArgs
from engine.core.core import EngineStats
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.frontend.core_factory import make_engine_core
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.outputs import RequestOutput
from engine.frontend.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: str, rank_pool=None, **kwargs):
        """Keyword arguments are `EngineArgs` fields (vLLM's names): device, dtype, kv_cache_dtype,
        indexer_precision, seed, max_model_len, max_num_batched_tokens, max_num_seqs, num_blocks,
        enable_prefix_caching, num_speculative_tokens, speculative_config, hisparse, ...
        `rank_pool` (engine.parallel.spawn.RankPool): a multi-rank engine reuses its idle ranks and gives
        them back at `core.shutdown()`."""
        self.args = EngineArgs(model=str(model), **kwargs)
        self.config = self.args.create_engine_config()
        self.core = make_engine_core(self.config, rank_pool)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(model)
        except FileNotFoundError:
            self.tokenizer = None
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------------
    def _to_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: str | Sequence[int] | list, sampling_params: SamplingParams | list | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        reqs = [Request(req_id=f"offline-{next(self._ids)}", prompt_token_ids=self._to_ids(p), sampling_params=sp,
                        cache_salt=cache_salt) for p, sp in zip(prompts, params_list)]
        return self._run(reqs)

    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len, vocab] (fp32) at every prompt position, computed through the paged cache."""
        req = Request(req_id=f"logits-{next(self._ids)}", prompt_token_ids=list(token_ids),
                      sampling_params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                      return_prompt_logits=True)
        (out,) = self._run([req])
        return out.prompt_logits

    def _run(self, reqs: list[Request]) -> list[RequestOutput]:
        proc = OutputProcessor(self.tokenizer)
        added = []
        try:
            for r in reqs:
                self.core.add_request(r)
                added.append(r.req_id)
                proc.add(r)
            final: dict[str, RequestOutput] = {}
            while self.core.has_unfinished():
                updated, to_abort = proc.process(self.core.step())
                for rid in to_abort:
                    self.core.abort(rid)
                for o in updated:
                    if o.finished:
                        final[o.req_id] = o
        except BaseException:
            for rid in added:
                self.core.abort(rid)
            raise
        return [final[r.req_id] for r in reqs]

    def get_stats(self) -> EngineStats:
        return self.core.stats()
