"""Checking and compiling structured-output specs with xgrammar.

`check_spec` parses a spec into a grammar without a tokenizer (cheap: the router runs it on every
request, so a bad schema, regex or grammar is a 400 before anything reaches an engine).
`GrammarBackend` holds one xgrammar compiler per tokenizer and the compiled grammars by spec; engines
get theirs from `backend_for` (one per tokenizer directory, shared by validation and the runner).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from pathlib import Path

import xgrammar as xgr
from tokenizers import Tokenizer

from engine.structured.spec import StructuredOutputSpec

MAX_COMPILED = 256  # compiled grammars kept per tokenizer (LRU)
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # "[09:03:56] /path/x.cc:83: " on xgrammar errors


def engine_backend(cfg) -> GrammarBackend:
    """The grammar backend for an engine's model (its tokenizer, logits width and EOS ids): what validation
    (EngineCore) and the runner's matchers share."""
    if cfg.model_path is None:
        raise ValueError("structured outputs need the model's tokenizer: this engine has no model directory")
    return backend_for(str(cfg.model_path), cfg.model.vocab_size, tuple(cfg.model.eos_token_ids))


def _ebnf_of_choice(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _reason(exc: Exception) -> str:
    return _XGR_PREFIX.sub("", str(exc).strip()).strip()


def check_spec(spec: StructuredOutputSpec) -> None:
    """Raise ValueError (naming what is wrong) for a spec xgrammar cannot turn into a grammar."""
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.spec)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.spec)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(_ebnf_of_choice(spec.choices))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"invalid {_label(spec.kind)}: {_reason(e)}") from e


def _label(kind: str) -> str:
    return {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}.get(kind, kind)


def tokenizer_info(tokenizer_dir: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the checkpoint's `tokenizer.json` (vocabulary, byte encoding, stop tokens);
    `vocab_size` is the model's logits width (it may exceed the tokenizer's)."""
    file = Path(tokenizer_dir) / "tokenizer.json"
    if not file.exists():
        raise ValueError(f"structured outputs need the model's tokenizer.json (none in {tokenizer_dir})")
    tok = Tokenizer.from_file(str(file))
    encoded = [""] * vocab_size
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=meta["add_prefix_space"])


class GrammarBackend:
    """One tokenizer's compiler and its compiled grammars (LRU by spec); thread-safe."""

    def __init__(self, info: xgr.TokenizerInfo, max_threads: int = 2):
        self.info = info
        self.vocab_size = info.vocab_size
        self.stop_token_ids = tuple(info.stop_token_ids)
        self.token_bytes: list[bytes] = list(info.decoded_vocab)  # for the reasoning-end gate
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (ValueError if it does not compile)."""
        key = (spec.kind, spec.spec)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {_label(spec.kind)}: {_reason(e)}") from e
        with self._lock:
            self.num_compiles += 1
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        # JSON without free whitespace (one space after ':' and ','): free whitespace lets a model pad forever
        if spec.kind == "json":
            return c.compile_json_schema(spec.spec, strict_mode=True, any_whitespace=False)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            return c.compile_grammar(_ebnf_of_choice(spec.choices))
        return c.compile_grammar(spec.spec)


@functools.lru_cache(maxsize=8)
def backend_for(tokenizer_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarBackend:
    """The process's backend for one tokenizer (built on first use: a 150k vocabulary takes a moment)."""
    return GrammarBackend(tokenizer_info(tokenizer_dir, vocab_size, stop_token_ids))
