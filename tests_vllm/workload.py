"""Request bodies of the tier: the token-parity corpus and the multi-turn chat workload.

Text is made of words drawn (seeded) from this repository's own README, so it tokenizes
like prose under the tiny model's tokenizer (trained on the same repository). Everything
is deterministic for a given seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL = "tiny"
ROOT = Path(__file__).resolve().parent.parent


def _words() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    words = sorted(set(re.findall(r"[A-Za-z][A-Za-z'-]{1,14}", text)))
    if len(words) < 100:
        raise RuntimeError("README.md has too few words to build prompts from")
    return words


WORDS = _words()


def text(rng: random.Random, n_words: int) -> str:
    """`n_words` words in sentences (about 1.5 tokens a word under the tiny tokenizer)."""
    out: list[str] = []
    for i in range(n_words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i % 12 == 0 else w)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out) + "."


def parity_corpus() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, endpoint kind `completions`|`chat`, body) — the token-parity bodies."""
    rng = random.Random(7)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
    sys_msg = {"role": "system", "content": text(rng, 40)}
    bodies: list[tuple[str, str, dict[str, Any]]] = [
        ("completions", "completions", {"model": MODEL, "prompt": text(rng, 60)}),
        (
            "chat",
            "chat",
            {"model": MODEL, "messages": [{"role": "user", "content": text(rng, 30)}]},
        ),
        (
            "chat-system",
            "chat",
            {"model": MODEL, "messages": [sys_msg, {"role": "user", "content": text(rng, 20)}]},
        ),
        (
            "multi-turn",
            "chat",
            {
                "model": MODEL,
                "messages": [
                    sys_msg,
                    {"role": "user", "content": text(rng, 25)},
                    {"role": "assistant", "content": text(rng, 15)},
                    {"role": "user", "content": text(rng, 25)},
                    {"role": "assistant", "content": text(rng, 15)},
                    {"role": "user", "content": text(rng, 10)},
                ],
            },
        ),
        (
            "content-parts",
            "chat",
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": text(rng, 12)},
                            {"type": "text", "text": text(rng, 12)},
                        ],
                    }
                ],
            },
        ),
        (
            "system-content-parts",
            "chat",
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": [{"type": "text", "text": text(rng, 20)}]},
                    {"role": "user", "content": text(rng, 10)},
                ],
            },
        ),
        (
            "tools",
            "chat",
            {
                "model": MODEL,
                "tools": [tool],
                "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            },
        ),
        (
            "tool-call-round-trip",
            "chat",
            {
                "model": MODEL,
                "tools": [tool],
                "messages": [
                    {"role": "user", "content": "Weather in Lima, in C?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {
                                    "name": "get_weather",
                                    "arguments": '{"city": "Lima", "unit": "C"}',
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 19}'},
                    {"role": "user", "content": "And tomorrow?"},
                ],
            },
        ),
        (
            "unicode-and-markers",
            "chat",
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": "naïve café — 東京 🚀\n\n\ttabs  and  spaces <|end|> literal",
                    }
                ],
            },
        ),
        (
            "no-generation-prompt",
            "chat",
            {
                "model": MODEL,
                "add_generation_prompt": False,
                "messages": [
                    {"role": "user", "content": text(rng, 10)},
                    {"role": "assistant", "content": text(rng, 10)},
                ],
            },
        ),
        (
            "long",
            "chat",
            {"model": MODEL, "messages": [sys_msg, {"role": "user", "content": text(rng, 700)}]},
        ),
    ]
    return bodies


@dataclass
class Conversation:
    """A multi-turn chat: a system prompt, then user turns; assistant turns are fixed text
    (the same for every policy, so every policy sees identical prompts)."""

    cid: int
    system: str
    users: list[str]
    replies: list[str]
    messages: list[dict[str, Any]] = field(default_factory=list)

    def body(self, turn: int, max_tokens: int, stream: bool) -> dict[str, Any]:
        """The request of turn `turn` (0-based): the history so far plus the new user turn."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for t in range(turn):
            msgs.append({"role": "user", "content": self.users[t]})
            msgs.append({"role": "assistant", "content": self.replies[t]})
        msgs.append({"role": "user", "content": self.users[turn]})
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def conversations(
    n: int, turns: int, system_words: int, user_words: int, reply_words: int, seed: int = 1
) -> list[Conversation]:
    """`n` conversations of `turns` turns (same for every order/policy: seeded once)."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        out.append(
            Conversation(
                cid=c,
                system=f"Conversation {c}. " + text(rng, system_words),
                users=[text(rng, user_words) for _ in range(turns)],
                replies=[text(rng, reply_words) for _ in range(turns)],
            )
        )
    return out
