"""The request body of `POST /v1/responses` (pydantic: it also makes the OpenAPI description), and which
of its fields are implemented, harmless or refused.

Declared fields are implemented (services/router/responses_api/convert.py says how each one maps onto
the chat request). Any other field goes through services/router/api_fields.py with the two tables below:

    IGNORED      fields that do not change the output here (bookkeeping, cache hints): accepted, ignored
    UNSUPPORTED  fields that would change the output and are not implemented: accepted only with the
                 value that changes nothing (`background: false`, `truncation: "disabled"`), else 400
    anything else: 400 `unknown_parameter`, naming it
Input items, tools and `text.format` stay plain dicts: `convert` checks them one by one, so an error
names the item (`input[2].content[0].type`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from services.router.api_fields import check_extra_fields

IGNORED = frozenset(("service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                     "stream_options"))  # stream_options: {include_obfuscation}, padding only


def _unset(v) -> bool:
    return v is None


UNSUPPORTED = {
    "background": lambda v: v in (None, False),  # responses run while the request is open, never queued
    "conversation": _unset,  # the Conversations API: use previous_response_id
    "prompt": _unset,  # stored prompt templates
    "max_tool_calls": _unset,  # built-in tool calls: none here
    "top_logprobs": lambda v: v in (None, 0),
    "truncation": lambda v: v in (None, "disabled"),  # "auto" would drop items of a long conversation
    "context_management": lambda v: not v,
}

# `include` values: the one implemented, and those asking for outputs of built-in tools, which are refused
# in `tools` (so there is never anything to include: harmless)
INCLUDE_ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDE_HARMLESS = frozenset(("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                              "message.input_image.image_url", "computer_call_output.output.image_url",
                              "code_interpreter_call.outputs"))


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}: convert checks it
    verbosity: Literal["medium"] | None = None  # "low" / "high" would change the output: not implemented


class ReasoningConfig(BaseModel):
    """`effort: "none"` turns thinking off; any other effort leaves it on (its level is not enforced).
    `summary`: accepted; the reasoning is returned whole as `reasoning_text` content, never summarized."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def check_fields(body: ResponsesRequest) -> None:
    """BadRequest naming the first field that would be dropped (services/router/api_fields.py)."""
    check_extra_fields(body, IGNORED, UNSUPPORTED, "OpenAI's Responses API does not define it")
