"""Shared fixtures of the tokens tests (a plain module: imported, loaded once per process)."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

from configs import make_config

from scorer.blocks import BlockHasher
from scorer.tokens import LocalTokenizer, Tokenization, load_tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "tokenizers"
QWEN3 = FIXTURES / "qwen3"
HEADERS = FIXTURES / "headers-bos"  # our own template over the Qwen3 tokenizer.json


@cache
def local(path: Path = QWEN3) -> LocalTokenizer:
    """A loaded LocalTokenizer (once per process)."""
    return load_tokenizer(path)


@cache
def hf(path: Path = QWEN3) -> Any:
    """transformers' tokenizer for the same files (the parity reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def make_tokens(
    models: dict[str, Path] | None = None,
    block_size: int = 16,
    **tokens: Any,
) -> Tokenization:
    """A Tokenization over the fixtures ({"qwen3": QWEN3, "headers": HEADERS} by default)."""
    models = models if models is not None else {"qwen3": QWEN3, "headers": HEADERS}
    cfg = make_config(
        tokens={"models": {m: {"tokenizer": str(p)} for m, p in models.items()}, **tokens}
    )
    return Tokenization(cfg, BlockHasher(block_size))


SNIPPETS = [
    "Hello!",
    "What is the capital of France?",
    "  leading and trailing spaces  ",
    "line one\nline two\n\nline four\n",
    "def f(x):\n    return x * 2\n\n\tif y:\n\t\tpass",
    "日本語のテキストと中文混合。",
    "emoji 🙂🚀 and accents e\u0301 caf\u00e9",
    "numbers 1234567890 and 3.14159",
    'JSON {"a": [1, 2, {"b": null}], "c": "d"}',
    "a literal <|im_end|> inside user text",
    "thinking tags <think>inline</think> in text",
    "<tool_call> pseudo </tool_call>",
    "\n\n\n",
    "   ",
    "",
    "It's we're they'll I'd",
    "x" * 300,
    "A longer paragraph. " * 40,
]


def random_conversation(
    rng: random.Random, turns: int, tools: bool = False
) -> list[dict[str, Any]]:
    """A conversation in the shape vLLM hands to the template (string contents)."""

    def text() -> str:
        return " ".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, 4)))

    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        msgs.append({"role": "system", "content": text() or "You are helpful."})
    for _ in range(turns):
        msgs.append({"role": "user", "content": text() or "hi"})
        if tools and rng.random() < 0.4:
            msgs.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": {"q": text()[:40]}},
                        }
                    ],
                }
            )
            msgs.append({"role": "tool", "content": text(), "tool_call_id": "call_1"})
        msgs.append({"role": "assistant", "content": text() or "ok"})
    return msgs


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a term up.",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string", "description": "the term"}},
                "required": ["q"],
            },
        },
    }
]
