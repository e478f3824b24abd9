"""Structured outputs: the request spec (`spec.py`), its validation and compilation with xgrammar
(`grammar.py`), and the per-request matcher the runner's sampler masks logits with (`matcher.py`)."""

from engine.structured.spec import KINDS, StructuredOutputSpec

__all__ = ["KINDS", "StructuredOutputSpec"]
