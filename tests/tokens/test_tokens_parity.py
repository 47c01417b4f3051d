"""Parity with transformers' apply_chat_template + tokenizer (the engine's own path).

vLLM renders chat requests with `tokenizer.apply_chat_template(..., tokenize=False)` and
tokenizes the text with add_special_tokens=False; completions with the tokenizer's default.
These tests feed transformers and scorer.tokens the same conversations and compare the
text and the ids, over the Qwen3 tokenizer + template and our header-style template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypo import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from tokens_helpers import HEADERS, QWEN3, SNIPPETS, TOOLS, hf, make_tokens, random_conversation

from scorer.tokens import Tokenization, load_tokenizer, render_chat

# Parity against transformers' apply_chat_template: seconds per test (imports and
# renders with transformers); make test runs it, make test-quick does not.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokens() -> Any:
    t = make_tokens()
    try:
        yield t
    finally:
        t.close()


def _hf_ids(path: Path, messages: list[dict[str, Any]], **kw: Any) -> tuple[str, list[int]]:
    tok = hf(path)
    text = tok.apply_chat_template(messages, tokenize=False, **kw)
    return text, list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def shared_tokens() -> Any:
    # hypothesis runs one test function many times: a module fixture, not per example.
    t = make_tokens({"qwen3": QWEN3})
    try:
        yield t
    finally:
        t.close()


FAMILIES = [("qwen3", QWEN3), ("headers", HEADERS)]


@pytest.mark.parametrize(("model", "path"), FAMILIES)
def test_corpus_multi_turn_matches_transformers(
    tokens: Tokenization, model: str, path: Path
) -> None:
    rng = random.Random(7)
    checked = 0
    for conv_no in range(12):
        conv = random_conversation(rng, turns=rng.randint(1, 5), tools=conv_no % 3 == 0)
        body_tools = TOOLS if conv_no % 3 == 0 else None
        # Every request a client would send: the history up to each user/tool message.
        for end in range(1, len(conv) + 1):
            if conv[end - 1]["role"] not in ("user", "tool"):
                continue
            msgs = conv[:end]
            text, ids = _hf_ids(path, msgs, tools=body_tools, add_generation_prompt=True)
            body: dict[str, Any] = {"model": model, "messages": msgs}
            if body_tools:
                body["tools"] = body_tools
            assert tokens.render(model, body) == text
            tp = tokens.tokenize_body(model, body)
            assert tp.token_ids == ids, (model, conv_no, end)
            checked += 1
    assert checked > 20
    # The cache worked across turns: far fewer misses than segments.
    assert tokens.cache.hits > tokens.cache.misses


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_thinking": False},
        {"enable_thinking": True},
    ],
)
def test_qwen3_chat_template_kwargs(tokens: Tokenization, kwargs: dict[str, Any]) -> None:
    msgs = [{"role": "user", "content": "Solve 2+2."}]
    text, ids = _hf_ids(QWEN3, msgs, add_generation_prompt=True, **kwargs)
    tp = tokens.tokenize_body("qwen3", {"messages": msgs, "chat_template_kwargs": kwargs})
    assert tp.token_ids == ids
    assert ("<think>\n\n</think>" in text) == (kwargs["enable_thinking"] is False)


def test_qwen3_reasoning_and_tool_calls(tokens: Tokenization) -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": {"q": "Paris"}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": "second result"},
    ]
    text, ids = _hf_ids(QWEN3, msgs, tools=TOOLS, add_generation_prompt=True)
    body = {"messages": msgs, "tools": TOOLS}
    assert tokens.render("qwen3", body) == text
    assert tokens.tokenize_body("qwen3", body).token_ids == ids
    assert "<think>\nI should call the tool.\n</think>" in text


def test_continue_final_message_and_no_generation_prompt(tokens: Tokenization) -> None:
    msgs = [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight—"},
    ]
    for path, model in ((QWEN3, "qwen3"), (HEADERS, "headers")):
        text, ids = _hf_ids(path, msgs, continue_final_message=True)
        body = {
            "messages": msgs,
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        assert tokens.render(model, body) == text
        assert text.endswith("Autumn moonlight—")
        assert tokens.tokenize_body(model, body).token_ids == ids
        _text2, ids2 = _hf_ids(path, msgs[:1], add_generation_prompt=False)
        body2 = {"messages": msgs[:1], "add_generation_prompt": False}
        assert tokens.tokenize_body(model, body2).token_ids == ids2


def test_completion_prompt_matches_tokenizer_default(tokens: Tokenization) -> None:
    for text in SNIPPETS:
        want = list(hf(QWEN3)(text)["input_ids"])  # add_special_tokens default (True)
        assert tokens.tokenize_body("qwen3", {"prompt": text}).token_ids == want


def test_multi_turn_prefix_property(tokens: Tokenization) -> None:
    """Turn N's tokens are a prefix of turn N+1's where the template allows it."""
    rng = random.Random(11)
    for model in ("qwen3", "headers"):
        conv = random_conversation(rng, turns=4)
        prev: list[int] | None = None
        for end in range(1, len(conv) + 1):
            if conv[end - 1]["role"] != "user":
                continue
            ids = tokens.tokenize_body(model, {"messages": conv[:end]}).token_ids
            if prev is not None:
                assert ids[: len(prev)] == prev, model
            prev = ids


def test_qwen3_breaks_prefix_when_history_drops_thinking(tokens: Tokenization) -> None:
    """Where the template rewrites history, turn N is NOT a prefix of turn N+1.

    Qwen3's template renders an assistant message's reasoning only after the last user
    query: once a new user message arrives, the earlier `<think>` block disappears. The
    same happens with enable_thinking=False, whose empty think block is part of the
    generation prompt but not of the rendered history. The engine's cache then only
    matches up to the rewritten message; we tokenize what the engine sees, so our keys
    diverge at exactly the same place.
    """
    turn1 = [
        {"role": "user", "content": "Look up Paris."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": {"q": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "Paris is in France."},
    ]
    turn2 = [*turn1, {"role": "assistant", "content": "It is in France."}]
    turn2.append({"role": "user", "content": "And Rome?"})
    a = tokens.tokenize_body("qwen3", {"messages": turn1, "tools": TOOLS})
    b = tokens.tokenize_body("qwen3", {"messages": turn2, "tools": TOOLS})
    assert b.token_ids[: len(a.token_ids)] != a.token_ids
    assert "Need the tool." in tokens.render("qwen3", {"messages": turn1, "tools": TOOLS})
    assert "Need the tool." not in tokens.render("qwen3", {"messages": turn2, "tools": TOOLS})
    for body_msgs in (turn1, turn2):  # still exact against transformers
        _, ids = _hf_ids(QWEN3, body_msgs, tools=TOOLS, add_generation_prompt=True)
        got = tokens.tokenize_body("qwen3", {"messages": body_msgs, "tools": TOOLS})
        assert got.token_ids == ids

    kw = {"enable_thinking": False}
    t1 = [{"role": "user", "content": "Hi"}]
    t2 = [*t1, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    x = tokens.tokenize_body("qwen3", {"messages": t1, "chat_template_kwargs": kw}).token_ids
    y = tokens.tokenize_body("qwen3", {"messages": t2, "chat_template_kwargs": kw}).token_ids
    assert y[: len(x)] != x
    # The blocks before the rewritten message still match.
    common = next(i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)
    assert common >= 5


def test_headers_template_tools_tojson_indent(tokens: Tokenization) -> None:
    msgs = [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Look up «Zürich»"},
    ]
    text, ids = _hf_ids(HEADERS, msgs, tools=TOOLS, add_generation_prompt=True)
    body = {"messages": msgs, "tools": TOOLS}
    assert tokens.render("headers", body) == text
    assert tokens.tokenize_body("headers", body).token_ids == ids
    assert '    "type": "function"' in text  # tojson(indent=4)
    assert text.startswith("<|endoftext|>")  # bos_token from tokenizer_config


PARTS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- if not loop.last %}{{- ' | ' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- '!' }}{% endgeneration %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_openai_content_format_and_generation_block() -> None:
    """A template that loops over content parts gets them as parts, as vLLM passes them
    (the template comes in the body: allowed here, as vLLM's --trust-request-chat-template)."""
    tokens = make_tokens({"qwen3": QWEN3}, allow_request_chat_template=True)
    body_msgs: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "plain"},
        {"role": "user", "content": "c"},
    ]
    # What vLLM hands to transformers for an "openai"-format template: parts everywhere.
    as_parts = [
        {"role": m["role"], "content": m["content"]}
        if isinstance(m["content"], list)
        else {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
        for m in body_msgs
    ]
    text, ids = _hf_ids(QWEN3, as_parts, chat_template=PARTS_TEMPLATE, add_generation_prompt=True)
    body = {"messages": body_msgs, "chat_template": PARTS_TEMPLATE}
    assert tokens.render("qwen3", body) == text
    assert "a | b" in text and "plain!" in text
    assert tokens.tokenize_body("qwen3", body).token_ids == ids


def test_legacy_special_tokens_map(tmp_path: Path) -> None:
    """A repo whose BOS is only in special_tokens_map.json renders it like transformers."""
    d = tmp_path / "legacy"
    d.mkdir()
    (d / "tokenizer.json").symlink_to(QWEN3 / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"})
    )
    (d / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|endoftext|>", "lstrip": False, "rstrip": False},
                "eos_token": "<|im_end|>",
            }
        )
    )
    ref = hf(d)
    msgs = [{"role": "user", "content": "hi"}]
    want = ref.apply_chat_template(msgs, tokenize=False)
    lt = load_tokenizer(d)
    got = render_chat(
        {"messages": msgs, "add_generation_prompt": False},
        lt.chat_templates["default"],
        lt.special_tokens,
    )
    assert got == want == "<|endoftext|>hi<|im_end|>"


_CONTENT = st.lists(
    st.one_of(
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20),
        st.sampled_from(["<|im_end|>", "<think>", "</think>", "\n\n", "  ", "<tool_response>"]),
    ),
    max_size=5,
).map("".join)


@settings(max_examples=scaled(60))
@given(
    st.lists(st.tuples(st.sampled_from(["user", "assistant"]), _CONTENT), min_size=1, max_size=6),
    st.booleans(),
)
def test_random_chats_match_transformers(
    shared_tokens: Tokenization, turns: list[tuple[str, str]], thinking: bool
) -> None:
    msgs = [{"role": r, "content": c} for r, c in turns]
    kw = {"enable_thinking": thinking}
    text, ids = _hf_ids(QWEN3, msgs, add_generation_prompt=True, **kw)
    body = {"messages": msgs, "chat_template_kwargs": kw}
    assert shared_tokens.render("qwen3", body) == text
    assert shared_tokens.tokenize_body("qwen3", body).token_ids == ids
