"""The checkpoint's tokenizer (`tokenizer.json` via `tokenizers`). Chat templates are the router's
(services/router/chat_template.py: rendered as transformers renders them)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = HFTokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.eos_token = cfg.get("eos_token")
        if isinstance(self.eos_token, dict):
            self.eos_token = self.eos_token.get("content")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)
