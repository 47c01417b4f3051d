"""Turning OpenAI request bodies into prompt token ids for the simulated worker.

Two tokenizers:

- `SyntheticTokenizer` (default, tokenizer-free mode): NOT a real tokenizer. Each
  whitespace-separated word of a text becomes one id, blake2b(word) mapped into
  [FIRST_WORD_ID, vocab_size); chat messages become [role id] + words + [end-of-turn id]
  per message, then [assistant role id] as the generation prompt. The same text always
  gives the same ids (no randomness, no process seed), so equal prefixes share blocks;
  ids of generated tokens decode to the placeholder words "t<id>".
- `HFTokenizer` (`kv-scorer sim --tokenizer PATH`): a real `tokenizers.Tokenizer` loaded
  from tokenizer.json (a file or a directory holding it); chat messages are rendered with the
  `chat_template` of a tokenizer_config.json next to it (jinja2), else with a plain
  "role: content" layout.

Token-id prompts (`"prompt": [1, 2, 3]` in /v1/completions) are used as they are, with
either tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "HFTokenizer",
    "PromptError",
    "SimTokenizer",
    "SyntheticTokenizer",
    "load_tokenizer",
    "message_text",
]


class PromptError(ValueError):
    """The request body holds no usable prompt (answered with HTTP 400)."""


class SimTokenizer(Protocol):
    """What the worker needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_text(self, token_id: int) -> str: ...


def message_text(content: Any) -> str:
    """Text of an OpenAI message `content`: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
        return "\n".join(parts)
    raise PromptError("message content must be a string or a list of content parts")


class SyntheticTokenizer:
    """Deterministic word-hash ids; see the module docstring. Not a real tokenizer."""

    EOT_ID = 2  # end of a chat turn
    ROLE_IDS = {"system": 3, "user": 4, "assistant": 5, "tool": 6, "developer": 7}
    FIRST_WORD_ID = 1000

    def __init__(self, vocab_size: int = 32000) -> None:
        if vocab_size <= self.FIRST_WORD_ID:
            raise ValueError(f"vocab_size must be > {self.FIRST_WORD_ID}")
        self.vocab_size = vocab_size
        self._span = vocab_size - self.FIRST_WORD_ID

    def _word_id(self, word: str) -> int:
        h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
        return self.FIRST_WORD_ID + h % self._span

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One id per whitespace-separated word (no special tokens are ever added)."""
        return [self._word_id(w) for w in text.split()]

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """[role] + words + [end of turn] per message, then [assistant] to generate."""
        ids: list[int] = []
        for m in messages:
            if not isinstance(m, dict):
                raise PromptError("each message must be an object")
            role = str(m.get("role", "user"))
            ids.append(self.ROLE_IDS.get(role) or self._word_id(f"<|{role}|>"))
            ids.extend(self.encode(message_text(m.get("content"))))
            ids.append(self.EOT_ID)
        if add_generation_prompt:
            ids.append(self.ROLE_IDS["assistant"])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Placeholder text: the ids cannot be turned back into the words."""
        return "".join(self.token_text(i) for i in ids)

    def token_text(self, token_id: int) -> str:
        """Text of one generated token: " t<id>"."""
        return f" t{token_id}"


class HFTokenizer:
    """A real Hugging Face `tokenizers.Tokenizer`, with an optional jinja2 chat template."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = int(self._tok.get_vocab_size())
        self._template: Any = None
        self._special: dict[str, str] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                val = cfg.get(key)
                if isinstance(val, dict):
                    val = val.get("content")
                if isinstance(val, str):
                    self._special[key] = val
            template = cfg.get("chat_template")
            if isinstance(template, list):  # named templates: take "default"
                named = {t.get("name"): t.get("template") for t in template}
                template = named.get("default")
            if isinstance(template, str):
                self._template = self._compile(template)

    @staticmethod
    def _compile(template: str) -> Any:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, indent: int | None = None) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (the tokenizer's post-processor adds BOS etc. if asked)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render the chat template, then tokenize without adding special tokens again."""
        msgs = [
            {**m, "content": message_text(m.get("content"))} if isinstance(m, dict) else m
            for m in messages
        ]
        if self._template is not None:
            text = self._template.render(
                messages=msgs, add_generation_prompt=add_generation_prompt, **self._special
            )
        else:
            text = "".join(f"{m.get('role', 'user')}: {m.get('content', '')}\n" for m in msgs)
            if add_generation_prompt:
                text += "assistant:"
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """Text of one generated token."""
        return str(self._tok.decode([token_id], skip_special_tokens=True))


def load_tokenizer(path: str | None, vocab_size: int = 32000) -> SimTokenizer:
    """The real tokenizer at `path`, or the synthetic one when `path` is None."""
    if path is None:
        return SyntheticTokenizer(vocab_size)
    return HFTokenizer(path)
