"""Conversation prefix states (scorer.tokens.prefix) never change ids or keys.

Every request below is checked against a fresh computation: the tokenizer's encode of the
whole rendered prompt and `BlockHasher.keys` of those ids, in the same namespace.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from tokens_helpers import QWEN3, local, make_tokens, random_conversation

from scorer.blocks import BlockHasher, namespace_key
from scorer.tokens import load_tokenizer
from scorer.tokens.prefix import FANOUT, HEAD_CHARS, PrefixState, PrefixStates
from scorer.tokens.segments import SEGMENT_BYTES

LT = local(QWEN3)
SYSTEM = "You are a careful assistant. " * 12  # > HEAD_CHARS once rendered


def _check(tokens: Any, body: dict[str, Any], salt: str | None = None) -> Any:
    tp = tokens.tokenize_body("qwen3", body, cache_salt=salt)
    text = tokens.render("qwen3", body) if "messages" in body else body["prompt"]
    add = body.get("add_special_tokens", "messages" not in body)
    want = LT.encode_whole(text, add_special_tokens=add)
    trunc = body.get("truncate_prompt_tokens")
    if trunc:
        want = want[-trunc:]
    assert tp.token_ids == want
    ns = namespace_key(cache_salt=salt)
    assert tp.block_keys == BlockHasher(16).keys(want, ns)
    return tp


def test_each_turn_reuses_the_previous_prompt_and_stays_exact() -> None:
    tokens = make_tokens({"qwen3": QWEN3})
    rng = random.Random(7)
    conv = [{"role": "system", "content": SYSTEM}, *random_conversation(rng, 6)]
    try:
        reused = []
        # Requests end with a user message: the template renders earlier turns the same
        # way then (Qwen3 shows the reasoning of turns after the last user message only).
        for end in [k + 1 for k, m in enumerate(conv) if m["role"] == "user"]:
            tp = _check(tokens, {"messages": conv[:end]})
            reused.append(tp.stats.get("prefix_chars", 0))
        assert reused[0] == 0 and all(r > HEAD_CHARS for r in reused[1:]), reused
        assert len(tokens.prefixes) == 1  # each turn's state replaced the one it extended
        # A branch (an earlier message edited): the one state (the last turn's) does not
        # hold its text; it is encoded from the segments, exact, and kept beside it.
        edited = [*conv[:2], {"role": "user", "content": "something else entirely"}]
        tp = _check(tokens, {"messages": edited})
        assert "prefix_chars" not in tp.stats and len(tokens.prefixes) == 2
        # Another namespace (cache_salt) never reuses this one's keys.
        tp = _check(tokens, {"messages": conv}, salt="tenant-b")
        assert "prefix_chars" not in tp.stats
        # Truncation moves the blocks: the keys are computed afresh, still exact.
        _check(tokens, {"messages": conv, "truncate_prompt_tokens": 50})
    finally:
        tokens.close()
    assert len(tokens.prefixes) == 0 and tokens.prefixes.bytes == 0


def test_completion_prompts_with_special_tokens() -> None:
    tokens = make_tokens({"qwen3": QWEN3})
    base = SYSTEM + "<|im_start|>user\nquestion one<|im_end|>\n"
    try:
        _check(tokens, {"prompt": base})
        tp = _check(tokens, {"prompt": base + "<|im_start|>user\nquestion two"})
        assert tp.stats["prefix_chars"] == len(base) - 1  # cut after the last <|im_end|>
        tp = _check(tokens, {"prompt": base + "<|im_start|>x", "add_special_tokens": False})
        assert "prefix_chars" in tp.stats
    finally:
        tokens.close()


WORDS = st.sampled_from(["hello", "world", " ", "\n", "<|im_start|>", "<|im_end|>", "<think>"])


@settings(max_examples=scaled(60), deadline=None)
@given(st.lists(st.lists(WORDS, min_size=1, max_size=30), min_size=1, max_size=6))
@example([["<|im_start|>", "hello"], ["<|im_end|>", "world"], ["\n"]])
def test_growing_prompts_property(turns: list[list[str]]) -> None:
    """Any sequence of prompts, each the previous one plus more text, stays exact."""
    tokens = make_tokens({"qwen3": QWEN3}, block_size=4)
    text = "x" * HEAD_CHARS
    try:
        for turn in turns:
            text += "".join(turn)
            tp = tokens.tokenize_body("qwen3", {"prompt": text, "add_special_tokens": False})
            want = LT.encode_whole(text)
            assert tp.token_ids == want
            assert tp.block_keys == BlockHasher(4).keys(want)
    finally:
        tokens.close()


def test_tokenizer_with_nested_added_tokens_is_not_prefix_safe(tmp_path: Path) -> None:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<x>", special=True), AddedToken("<x>y", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    lt = load_tokenizer(tmp_path / "tokenizer.json")
    assert lt.segment_safe and not lt.prefix_safe
    assert LT.prefix_safe


def test_states_are_bounded() -> None:
    gauge0 = SEGMENT_BYTES._value.get()
    states = PrefixStates(200_000, SEGMENT_BYTES.inc)
    space = (1, 0, False)
    head = "h" * HEAD_CHARS
    for i in range(3 * FANOUT):  # one head, many conversations: at most FANOUT kept
        states.store(space, PrefixState(f"{head}{i:04d}", b"\0" * 64, (1, 2, 3, 4)))
    assert len(states) == FANOUT
    assert states.find(space, f"{head}{3 * FANOUT - 1:04d} and more") is not None
    assert states.find(space, f"{head}0000 and more") is None  # the oldest went first
    assert states.find((2, 0, False), f"{head}{3 * FANOUT - 1:04d}") is None  # other space
    for i in range(2000):  # many heads: the byte bound holds
        states.store(space, PrefixState(f"{i:04d}" + head, b"\0" * 400, ()))
    assert states.bytes <= 200_000
    assert SEGMENT_BYTES._value.get() == gauge0 + states.bytes
    # A state over a quarter of the budget is never kept.
    states.store(space, PrefixState(head + "z" * 60_000, b"", ()))
    assert states.find(space, head + "z" * 60_000) is None
    states.clear()
    assert SEGMENT_BYTES._value.get() == gauge0


def test_bos_and_eos_from_the_post_processor(tmp_path: Path) -> None:
    """A tokenizer that adds <s> ... </s>: the state holds <s> and never the trailing </s>."""
    from tokenizers import processors

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<sep>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<sep>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    tokens = make_tokens({"tiny": tmp_path / "tokenizer.json"}, block_size=4)
    lt = tokens.tokenizer_for("tiny")
    assert lt is not None and lt.prefix_ids == (1,) and lt.suffix_ids == (2,)
    text = "hello world " * 30 + "<sep>"
    try:
        for add in (True, False, True):
            for more in ("", " hello", " hello <sep> world", " world world <sep>"):
                text += more
                body = {"prompt": text, "add_special_tokens": add}
                tp = tokens.tokenize_body("tiny", body)
                want = lt.encode_whole(text, add_special_tokens=add)
                assert tp.token_ids == want
                assert tp.block_keys == BlockHasher(4).keys(want)
        assert len(tokens.prefixes) == 2  # one state per (add_special_tokens) space
    finally:
        tokens.close()
