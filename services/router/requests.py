"""The last step of preparing a request (services/router/prepare.py): a checked body, or a gRPC
`GenerateRequest`, as engine work: prompts as token ids, validated SamplingParams, the cache salt.

What is checked here depends on the prompt (its length against the context, what max_tokens leaves)
or on the deployment (vocabulary, stop lists); the body's own numbers were checked before
(services/router/validation.py, bounds declared in services/rpc/bounds.py). Every check raises
`BadRequest` with a message that names the field: HTTP 400 / gRPC INVALID_ARGUMENT, before anything is
sent to an engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.core.sampling_params import SamplingParams
from engine.frontend.tokenizer import Tokenizer
from proto.pdserve.v1 import common_pb2
from services.router.chat_output import OutputOptions
from services.router.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.structured import SpecError, check_grammar, structured_from_request
from services.rpc.bounds import InvalidArgument as BadRequest
from services.rpc.bounds import check_min_max_tokens, check_sampling_proto, check_token_ids
from services.rpc.convert import sampling_from_proto

__all__ = ["BadRequest", "Limits", "Prepared", "build_chat", "build_completion", "build_generate"]


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_n: int = 16
    max_prompts: int = 64
    max_stop: int = 16
    max_stop_len: int = 256
    max_stop_token_ids: int = 64
    reasoning_end: str = ""  # with a reasoning parser: structured outputs apply after this text


@dataclass
class Prepared:
    """What the engines are asked: every prompt `n` times with `params`; how the answer is shaped."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    return_token_ids: bool = False
    top_logprobs: int = 0  # chat: alternatives per token in the response
    output: OutputOptions | None = None  # chat: the reasoning and tool-call parsers of each choice


def build_completion(body: CompletionRequest, tok: Tokenizer, limits: Limits, cache_salt: str | None) -> Prepared:
    prompts = _ids_from_prompt(body.prompt, tok)
    if len(prompts) > limits.max_prompts:
        raise BadRequest(f"at most {limits.max_prompts} prompts per request", "prompt")
    for ids in prompts:
        _check_prompt(ids, limits)
    params = _params(body, body.max_tokens, body.logprobs, max(len(p) for p in prompts), limits)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(prompts, params, body.n, body.stream, include_usage, cache_salt, body.return_token_ids)


def build_chat(body: ChatCompletionRequest, plan, tok: Tokenizer, limits: Limits, cache_salt: str | None) -> Prepared:
    """`plan`: the rendered chat (services/router/chat_request.py's ChatPlan)."""
    ids = tok.encode(plan.prompt)
    _check_prompt(ids, limits)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _params(body, max_tokens, logprobs, len(ids), limits)
    params = force_tool_call(params, plan.forced, "another structured output (response_format, structured_outputs)")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared([ids], params, body.n, body.stream, include_usage, cache_salt, body.return_token_ids,
                    body.top_logprobs or 0, plan.output)


def build_generate(g: common_pb2.GenerateRequest, tok: Tokenizer, limits: Limits, cache_salt: str | None,
                   plan=None) -> Prepared:
    """gRPC Router.Generate: the same checks as the HTTP API, on a `GenerateRequest` (with `plan`, the
    rendered chat whose prompt ids `g` carries)."""
    if bool(g.prompt) == bool(g.prompt_token_ids):
        raise BadRequest("give exactly one of prompt and prompt_token_ids", "prompt")
    check_sampling_proto(g.sampling_params, limits)
    ids = tok.encode(g.prompt) if g.prompt else list(g.prompt_token_ids)
    _check_prompt(ids, limits, "prompt" if g.prompt else "prompt_token_ids")
    try:
        params = sampling_from_proto(g.sampling_params)
    except ValueError as e:
        raise BadRequest(str(e), "sampling_params") from e
    if params.structured_outputs is not None:
        try:
            check_grammar(params.structured_outputs)
        except ValueError as e:
            raise BadRequest(str(e), "sampling_params.structured_outputs") from e
    _check_sampling(params, len(ids), limits)
    if plan is not None:
        params = force_tool_call(params, plan.forced, "structured_outputs")
    return Prepared([ids], params, 1, True, False, cache_salt, output=plan.output if plan is not None else None)


def force_tool_call(params: SamplingParams, forced, others: str) -> SamplingParams:
    """`params` constrained to the forced call's grammar (a required or named tool_choice), if any."""
    if forced is None:
        return params
    if params.structured_outputs is not None:
        raise BadRequest(f"a required or named tool_choice cannot be combined with {others}", "tool_choice")
    return dataclasses.replace(params, structured_outputs=forced)


def _ids_from_prompt(prompt, tok: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [tok.encode(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise BadRequest("prompt must be a string, a list of strings, token ids, or lists of token ids", "prompt")


def _check_prompt(ids: list[int], limits: Limits, param: str = "prompt") -> None:
    if not ids:
        raise BadRequest("a prompt is empty: give at least one token", param)
    check_token_ids(ids, limits, param)
    if len(ids) >= limits.max_model_len:
        raise BadRequest(f"this model's maximum context length is {limits.max_model_len} tokens; the prompt has "
                         f"{len(ids)} tokens", param, code="context_length_exceeded")


def _stop(stop, limits: Limits) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop:
        raise BadRequest(f"at most {limits.max_stop} stop strings", "stop")
    if any(not s or len(s) > limits.max_stop_len for s in stops):
        raise BadRequest(f"stop strings must be 1..{limits.max_stop_len} characters", "stop")
    return stops


def _check_sampling(p: SamplingParams, prompt_len: int, limits: Limits) -> None:
    """Bounds of the engine's own parameters that depend on this deployment (gRPC and HTTP alike)."""
    _stop(p.stop, limits)
    if len(p.stop_token_ids) > limits.max_stop_token_ids:
        raise BadRequest(f"at most {limits.max_stop_token_ids} stop_token_ids", "stop_token_ids")
    if any(not 0 <= t < limits.vocab_size for t in p.stop_token_ids):
        raise BadRequest(f"stop_token_ids must be in [0, {limits.vocab_size})", "stop_token_ids")
    if prompt_len + p.max_tokens > limits.max_model_len:
        raise BadRequest(f"this model's maximum context length is {limits.max_model_len} tokens; the prompt has "
                         f"{prompt_len} tokens and max_tokens is {p.max_tokens}", "max_tokens",
                         code="context_length_exceeded")


def _params(body, max_tokens: int | None, logprobs: int | None, prompt_len: int, limits: Limits) -> SamplingParams:
    """An HTTP body's SamplingParams (vLLM's defaults for unset fields); what is checked here depends on
    the prompt's length."""
    room = limits.max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room
    if max_tokens > room:
        raise BadRequest(f"this model's maximum context length is {limits.max_model_len} tokens; the prompt has "
                         f"{prompt_len} tokens and max_tokens is {max_tokens}", "max_tokens",
                         code="context_length_exceeded")
    check_min_max_tokens(body.min_tokens, max_tokens)
    stop = _stop(body.stop, limits)  # outside the try: keeps its own param name
    try:
        gate = limits.reasoning_end if isinstance(body, ChatCompletionRequest) else ""
        structured = structured_from_request(body, gate)
    except SpecError as e:
        raise BadRequest(str(e), e.param) from e
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k in (None, 0) else body.top_k,
            min_p=body.min_p, seed=body.seed, stop=stop, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, logprobs=logprobs, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_tokens=body.min_tokens, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, structured_outputs=structured)
    except ValueError as e:
        raise BadRequest(str(e)) from e
    _check_sampling(params, prompt_len, limits)
    return params
