"""EngineCoreOutput stream -> RequestOutputs: detokenization, stop strings, logprobs, timing.

A stop string is found here (it needs text); the caller then aborts the request in the core. A processor
built with `text=False` (the services: token ids go on the wire, the router makes the text) detokenizes only
the requests that have stop strings; the others' outputs carry no text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.core.request import Request
from engine.core.scheduler import EngineCoreOutput
from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.outputs import RequestMetrics, RequestOutput
from engine.frontend.tokenizer import Tokenizer


@dataclass
class _Tracked:
    out: RequestOutput
    detok: IncrementalDetokenizer | None
    logits_chunks: list = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, text: bool = True):
        self.tokenizer = tokenizer
        self.text = text
        self.tracked: dict[str, _Tracked] = {}

    def add(self, req: Request) -> None:
        out = RequestOutput(req_id=req.req_id, prompt_token_ids=list(req.prompt_token_ids),
                            logprobs=[] if req.sampling_params.logprobs is not None else None,
                            metrics=RequestMetrics(arrival_time=time.monotonic()))
        wants_text = self.text or bool(req.sampling_params.stop)
        detok = IncrementalDetokenizer(self.tokenizer, req.sampling_params) if self.tokenizer and wants_text else None
        if detok is not None and req.output_token_ids:  # tokens produced elsewhere (prefill): context only
            detok.update(list(req.output_token_ids))
            detok.flush()
        self.tracked[req.req_id] = _Tracked(out, detok)

    def abort(self, req_id: str) -> RequestOutput | None:
        t = self.tracked.pop(req_id, None)
        if t is None:
            return None
        t.out.finish_reason = "abort"
        t.out.delta_token_ids, t.out.delta_text = [], ""
        return t.out

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated outputs and the ids to abort in the core (stop string hit)."""
        updated, to_abort = [], []
        now = time.monotonic()
        for o in outputs:
            t = self.tracked.get(o.req_id)
            if t is None:
                continue
            out = t.out
            if o.prompt_logits is not None:
                t.logits_chunks.append(o.prompt_logits)
            out.num_cached_tokens = o.num_cached_tokens
            out.delta_token_ids = list(o.new_token_ids)
            out.token_ids.extend(o.new_token_ids)
            if out.logprobs is not None and o.new_logprobs:
                out.logprobs.extend(o.new_logprobs)
            if o.new_token_ids:
                m = out.metrics
                m.num_generated += len(o.new_token_ids)
                if m.first_token_time is None:
                    m.first_token_time = now
            out.delta_text = t.detok.update(o.new_token_ids) if t.detok else ""
            if t.detok is not None and t.detok.stop_hit is not None:
                out.finish_reason, out.stop_reason = "stop", t.detok.stop_hit
                if o.finish_reason is None:
                    to_abort.append(o.req_id)
            elif o.finish_reason is not None:
                out.finish_reason, out.stop_reason = o.finish_reason, o.stop_reason
            if out.finish_reason is not None and t.detok is not None:
                out.delta_text += t.detok.flush()
            out.text += out.delta_text
            if out.finish_reason is not None:
                out.metrics.finished_time = now
                self.tracked.pop(o.req_id, None)
                if t.logits_chunks:
                    out.prompt_logits = torch.cat(t.logits_chunks, dim=0)
            updated.append(out)
        return updated, to_abort
