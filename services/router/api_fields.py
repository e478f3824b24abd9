"""No silent drops: every request field the OpenAI-compatible API receives is implemented, harmless, or a 400.

Fields declared on the request models are implemented. Any other field is looked up here:

    IGNORED      fields of OpenAI's or vLLM's API that do not change the output (bookkeeping, hints):
                 accepted and ignored
    UNSUPPORTED  fields that would change the output and that we do not implement: accepted only with
                 a value that changes nothing (e.g. `logit_bias: {}`, `best_of: 1`), else 400 naming it
    anything else: a field neither API defines, 400 naming it (OpenAI answers unknown arguments so too)

The Responses API (services/router/responses_api/models.py) passes its own two tables to the same check.
"""

from __future__ import annotations

from services.router.requests import BadRequest

IGNORED = frozenset((
    "store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prediction", "priority", "request_id", "guided_decoding_backend", "spaces_between_special_tokens",
))


def _empty(v) -> bool:
    return not v


UNSUPPORTED = {
    # OpenAI
    "logit_bias": _empty, "functions": _empty, "function_call": lambda v: v in (None, "none"),
    "audio": _empty, "modalities": lambda v: v in (None, ["text"]), "reasoning_effort": _empty,
    "verbosity": _empty, "web_search_options": _empty,
    # vLLM
    "best_of": lambda v: v in (None, 1), "use_beam_search": _empty, "length_penalty": lambda v: v in (None, 1, 1.0),
    "truncate_prompt_tokens": lambda v: v is None, "prompt_logprobs": lambda v: v is None,
    "allowed_token_ids": lambda v: v is None, "bad_words": _empty, "logits_processors": _empty,
    "return_tokens_as_token_ids": _empty, "vllm_xargs": _empty, "kv_transfer_params": _empty,
    "continue_final_message": _empty, "add_special_tokens": _empty, "chat_template": _empty,
    "mm_processor_kwargs": _empty, "media_io_kwargs": _empty, "thinking_token_budget": lambda v: v is None,
    "structural_tag": _empty, "echo": _empty, "suffix": _empty,
    # structured outputs (served where the request models declare them)
    "response_format": lambda v: v in (None, {"type": "text"}), "structured_outputs": _empty,
    "guided_json": _empty, "guided_regex": _empty, "guided_choice": _empty, "guided_grammar": _empty,
    "guided_whitespace_pattern": _empty,
}


def check_extra_fields(body, ignored=IGNORED, unsupported=UNSUPPORTED,
                       unknown: str = "neither the OpenAI nor the vLLM API defines it") -> None:
    """BadRequest for the first field of `body` (a pydantic model with extra="allow") that would be dropped;
    `unknown` says, in the message, why a field in neither table is refused."""
    for name, value in (body.model_extra or {}).items():
        if name in ignored:
            continue
        harmless = unsupported.get(name)
        if harmless is None:
            raise BadRequest(f"unknown field {name!r}: {unknown}", name, code="unknown_parameter")
        if not harmless(value):
            raise BadRequest(f"{name} is not supported by this server (only its default value is accepted)", name,
                             code="unsupported_parameter")
