"""The one internal form of a structured-output request: what the output must match.

Every API spelling (OpenAI `response_format`, vLLM `structured_outputs`, the older `guided_*` fields,
a forced tool call) becomes one `StructuredOutputSpec`. It is plain, hashable data: it travels in
`SamplingParams`, over the wire between router, prefill and decode, and keys the compiled-grammar cache.

    kind         spec (text)
    json         a JSON schema, as JSON text
    json_object  "" (any JSON object)
    regex        a regular expression the whole output matches
    choice       a JSON array of strings: the output is exactly one of them
    grammar      an EBNF grammar (GBNF: `root ::= ...`, as xgrammar reads it)

`reasoning_end` (e.g. "</think>"): when set, the output is free until this text has been generated
and the grammar constrains only what follows it; when the prompt already ends with it (thinking
closed by the chat template), the grammar applies from the first token. Empty: from the first token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # 1 MiB of schema / regex / grammar text


@dataclass(frozen=True)
class StructuredOutputSpec:
    kind: str
    spec: str = ""
    reasoning_end: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if not isinstance(self.spec, str) or not isinstance(self.reasoning_end, str):
            raise ValueError("structured output spec and reasoning_end must be strings")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output spec is longer than {MAX_SPEC_CHARS} characters")
        if self.kind == "json_object":
            if self.spec:
                raise ValueError("a json_object structured output takes no spec")
        elif not self.spec:
            raise ValueError(f"a {self.kind} structured output needs a non-empty spec")
        if self.kind in ("json", "choice"):
            value = _json(self.spec, self.kind)
            if self.kind == "json" and not isinstance(value, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or true/false)")
            if self.kind == "choice" and not (isinstance(value, list) and value
                                              and all(isinstance(c, str) and c for c in value)):
                raise ValueError("choice must be a non-empty list of non-empty strings")

    # ---- constructors for each API spelling ------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict | bool | str, reasoning_end: str = "") -> StructuredOutputSpec:
        # key order is kept: it orders the output
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return cls("json", text, reasoning_end)

    @classmethod
    def json_object(cls, reasoning_end: str = "") -> StructuredOutputSpec:
        return cls("json_object", "", reasoning_end)

    @classmethod
    def regex(cls, pattern: str, reasoning_end: str = "") -> StructuredOutputSpec:
        return cls("regex", pattern, reasoning_end)

    @classmethod
    def choice(cls, choices: list[str], reasoning_end: str = "") -> StructuredOutputSpec:
        return cls("choice", json.dumps(list(choices), separators=(",", ":")), reasoning_end)

    @classmethod
    def grammar(cls, ebnf: str, reasoning_end: str = "") -> StructuredOutputSpec:
        return cls("grammar", ebnf, reasoning_end)

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise ValueError(f"a {self.kind} structured output has no choices")
        return json.loads(self.spec)


def _json(text: str, kind: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the {kind} structured output spec is not valid JSON: {e}") from e
