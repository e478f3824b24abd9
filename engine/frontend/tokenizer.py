"""The checkpoint's tokenizer (`tokenizer.json` via `tokenizers`) and its chat template (jinja2)."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Used when tokenizer_config.json has no template: `<|role|>\ncontent\n` per message.
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = HFTokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.chat_template = cfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        self.eos_token = cfg.get("eos_token")
        if isinstance(self.eos_token, dict):
            self.eos_token = self.eos_token.get("content")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        self._template = self._env.from_string(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
                raise ValueError("each chat message needs a 'role' and a string 'content'")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     eos_token=self.eos_token or "")
