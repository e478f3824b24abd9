"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

Same Jinja rules as transformers, so a model's published template gives the prompt it was trained on:
a sandboxed environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension (`break`,
`continue`), a `{% generation %}` block tag (rendered as its body), `raise_exception(msg)`,
`strftime_now(fmt)`, a `tojson` filter that is `json.dumps` with its keyword arguments (`ensure_ascii`
false by default, no HTML escaping), `dict(...)` and a `namespace` that rejects underscore names. The
template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the named special tokens
(`bos_token`, `eos_token`, ...) and the request's `chat_template_kwargs` (e.g. `enable_thinking`).

Where the template comes from (first found): `--chat-template FILE`, `chat_template.jinja` in the
checkpoint, `chat_template.json`, then `chat_template` in `tokenizer_config.json` (a string, or a list
of named templates: `tool_use` when tools are given, else `default`). A checkpoint without one has no
chat template: the chat endpoints answer 400 instead of inventing a prompt format.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# names the renderer fills itself: a request's chat_template_kwargs may not replace them
RESERVED_NAMES = frozenset(("messages", "tools", "documents", "add_generation_prompt"))
# older names of a message's reasoning text; templates read `reasoning_content`
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template could not be rendered for these messages (its raise_exception, or a Jinja error)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering is its body."""

    tags = frozenset(("generation",))

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() without underscore-prefixed attributes (no reaching into object internals)."""

    def __init__(*args, **kwargs):
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _Namespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key, value):
        _Namespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r}: underscore names are not allowed")


class _Dict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


def _plain(value):
    """A fresh copy made of JSON types only: the template can neither see nor change the caller's objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):  # subclasses (enums, ...) stripped back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """One compiled template plus the special tokens it may refer to."""

    def __init__(self, source: str | dict[str, str], special_tokens: dict[str, str] | None = None):
        self.sources = source if isinstance(source, dict) else {"default": source}
        self.special_tokens = dict(special_tokens or {})
        env = make_environment()
        self._compiled = {name: env.from_string(text) for name, text in self.sources.items()}

    @classmethod
    def load(cls, model_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
        """The checkpoint's template (or `override`, a file); None when there is none."""
        model_dir = Path(model_dir)
        cfg_file = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            tok = cfg.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(tok, str):
                special[name] = tok
        source = _find_source(model_dir, cfg, override)
        return None if source is None else cls(source, special)

    def _pick(self, has_tools: bool) -> jinja2.Template:
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        if has_tools and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ChatTemplateError(f"the model has several chat templates ({sorted(self._compiled)}) and no default")

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        """The prompt text; ChatTemplateError when the template refuses these messages.
        `template_kwargs`: more variables for the template (a request's chat_template_kwargs)."""
        kwargs = template_kwargs or {}
        clash = RESERVED_NAMES & kwargs.keys()
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(clash)}")
        context = {**self.special_tokens, **_plain(kwargs)}
        msgs = [_alias_reasoning(m) for m in _plain(messages)]
        try:
            return self._pick(bool(tools)).render(messages=msgs, tools=_plain(tools), documents=_plain(documents),
                                                  add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e


def _find_source(model_dir: Path, cfg: dict, override) -> str | dict[str, str] | None:
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {override}: no such file")
        return path.read_text()
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    if (model_dir / "chat_template.json").is_file():
        cfg = {**cfg, **json.loads((model_dir / "chat_template.json").read_text())}
    source = cfg.get("chat_template")
    if isinstance(source, list):
        return {t["name"]: t["template"] for t in source}
    return source or None
