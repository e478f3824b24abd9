"""Request bodies of the OpenAI-compatible API (pydantic: they also make the OpenAPI description).

Field names and defaults follow OpenAI, plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, skip_special_tokens,
include_stop_str_in_output, return_token_ids: each choice / chunk also carries its `token_ids`) and
`cache_salt`; chat requests also take tools, tool_choice, parallel_tool_calls, chat_template_kwargs,
documents and include_reasoning. Fields not declared here go through services/router/api_fields.py
(accepted when they change nothing, else 400).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = None
    # structured outputs (services/router/structured.py): OpenAI's, vLLM's and vLLM's older names
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # assistant turns: earlier calls, arguments as JSON text
    tool_call_id: str | None = None  # tool turns: the call this result answers
    reasoning_content: str | None = None  # assistant turns: earlier reasoning (templates may keep it)
    reasoning: str | None = None  # the same under vLLM's newer name


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # agents: tools and reasoning (services/router/chat_request.py)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # passed to the template, e.g. {"enable_thinking": false}
    documents: list[dict] | None = None  # passed to the template
    include_reasoning: bool = True  # false: reasoning is left out of the response


def error_body(message: str, type_: str = "invalid_request_error", code: str | int | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
