"""Turning an API request into engine work: prompts as token ids and validated SamplingParams.

Every check raises `BadRequest` with a message that names the field, so the HTTP API answers 400 and
the gRPC API INVALID_ARGUMENT, before anything is sent to an engine. Numeric bounds are declared once
(services/rpc/bounds.py) and applied to a body by services/router/validation.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.sampling_params import SamplingParams
from engine.frontend.tokenizer import Tokenizer
from services.router.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.structured import SpecError, check_spec, structured_from_request
from services.router.validation import check_body
from services.rpc.bounds import InvalidArgument as BadRequest
from services.rpc.bounds import check_min_max_tokens, check_sampling_proto, check_token_ids

__all__ = ["BadRequest", "Limits", "Prepared", "prepare_chat", "prepare_completion", "prepare_generate"]


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
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    return_token_ids: bool = False


def _ids_from_prompt(prompt, tok: Tokenizer, limits: Limits) -> list[list[int]]:
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


def prepare_generate(g, tok: Tokenizer, limits: Limits) -> tuple[list[int], SamplingParams]:
    """gRPC Router.Generate: the same checks as the HTTP API, on a `GenerateRequest`."""
    from services.transfer.wire import sampling_from_proto

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
            check_spec(params.structured_outputs)
        except ValueError as e:
            raise BadRequest(str(e), "sampling_params.structured_outputs") from e
    _check_sampling(params, len(ids), limits)
    return ids, params


def _params(body, max_tokens: int | None, logprobs: int | None, prompt_len: int, limits: Limits) -> SamplingParams:
    """Bodies reach here checked by `check_body`; what is left depends on the prompt's length."""
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


def prepare_completion(body: CompletionRequest, tok: Tokenizer, limits: Limits) -> Prepared:
    if body.echo:
        raise BadRequest("echo is not supported", "echo")
    if body.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    check_body(body, "completions", limits)
    prompts = _ids_from_prompt(body.prompt, tok, limits)
    if len(prompts) > limits.max_prompts:
        raise BadRequest(f"at most {limits.max_prompts} prompts per request", "prompt")
    for ids in prompts:
        _check_prompt(ids, limits)
    params = _params(body, body.max_tokens, body.logprobs, max(len(p) for p in prompts), limits)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(prompts, params, body.n, body.stream, include_usage, body.cache_salt, body.return_token_ids)


def prepare_chat(body: ChatCompletionRequest, tok: Tokenizer, limits: Limits, prompt: str) -> Prepared:
    """`prompt`: the rendered chat template (services/router/chat_request.py)."""
    ids = tok.encode(prompt)
    check_body(body, "chat", limits)
    _check_prompt(ids, limits)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _params(body, max_tokens, logprobs, len(ids), limits)
    return Prepared([ids], params, body.n, body.stream, bool(body.stream_options and body.stream_options.include_usage),
                    body.cache_salt, body.return_token_ids)
