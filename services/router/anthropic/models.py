"""Request bodies of the Anthropic Messages API (pydantic).

Top-level fields are closed (`extra="forbid"`), as Anthropic's own API answers an unknown field with
400: a field we do not know could change the output. Fields that never change the output here are
accepted and ignored: `metadata`, `service_tier`, `speed`, `inference_geo`, `user_profile_id`,
`workspace_id`, `diagnostics` (cache-miss reports), `cache_control` and the blocks' `cache_control`
(prefix caching here is automatic), `context_management` (server-side context editing: the whole
conversation is always sent to the model), `output_config.effort`. `container` (code execution) is
refused when set. `temperature`, `top_p` and `top_k`, which newer clients no longer send, are still
honoured for those that do. Content blocks stay
plain dicts: `convert` checks them one by one so that an error names the block (`messages.2.content.0`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict]


class Tool(_Open):
    """A client tool; `type` is absent or "custom". Anthropic's server tools are refused in `convert`."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict
    type: str | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: str | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: str | None = None
    format: OutputFormat | None = None


class _Prompt(BaseModel):
    """What both /v1/messages and /v1/messages/count_tokens take: everything that makes the prompt."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict | None = None
    cache_control: dict | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: object | None = None


class MessagesRequest(_Prompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    diagnostics: dict | None = None


class CountTokensRequest(_Prompt):
    pass
