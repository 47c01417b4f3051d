"""The segment cache is exact: segment-wise ids == whole-prompt ids.

HF tokenizers cut their input at added tokens before anything else; we rely on that to
encode the pieces between them separately and cache them. Hypothesis mixes random text
(whitespace, unicode, combining marks, digits, punctuation) with special and non-special
added tokens and checks the equality on the real Qwen3 tokenizer.
"""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest
from hypo import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY, CollectorRegistry
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
from tokens_helpers import QWEN3, local

from scorer.tokens import SegmentCache, load_tokenizer
from scorer.tokens.segments import SEGMENT_BYTES, SEGMENT_COUNTS, SegmentCounts, ids_to_bytes

LT = local(QWEN3)
ADDED = sorted(LT.added)
PIECES = st.one_of(
    st.sampled_from(ADDED),
    st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "\r\n", " \n ", "e\u0301", "\u0301"]),
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), max_codepoint=0x1FAFF),
        max_size=12,
    ),
    st.sampled_from(["<", "|", ">", "<|", "|>", "im_start", "think", "'s", "123", "日本"]),
)


@pytest.mark.slow
@settings(max_examples=scaled(400))
@given(st.lists(PIECES, max_size=16))
def test_segmentwise_equals_whole(pieces: list[str]) -> None:
    text = "".join(pieces)
    cache = SegmentCache(1 << 20)
    want = LT.encode_whole(text)
    assert LT.encode(text, cache) == want
    assert LT.encode(text, cache) == want  # second time from the cache


def test_qwen3_added_tokens_are_hard_boundaries() -> None:
    """Verify the premise on Qwen3: text around an added token never merges with it."""
    tok = LT.tokenizer
    assert LT.segment_safe
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</tool_call>"):
        for left, right in (("a", "b"), (" ", " "), ("\n", "\n"), ("x ", " y")):
            ids = tok.encode(left + t + right, add_special_tokens=False).ids
            want = [
                *tok.encode(left, add_special_tokens=False).ids,
                LT.added[t],
                *tok.encode(right, add_special_tokens=False).ids,
            ]
            assert ids == want


def test_cache_lru_is_bounded_in_bytes_and_counts() -> None:
    cache = SegmentCache(4000)
    before_bytes = SEGMENT_BYTES._value.get()
    hits0 = REGISTRY.get_sample_value("kv_scorer_token_segment_cache_hits_total")
    for i in range(100):
        cache.store(1, [(f"segment number {i} " * 3, ids_to_bytes(list(range(20))))])
    assert cache.bytes <= 4000
    assert 0 < len(cache) < 100
    newest = "segment number 99 " * 3
    oldest = "segment number 0 " * 3
    assert cache.lookup(1, [newest, oldest]) == [ids_to_bytes(list(range(20))), None]
    assert cache.lookup(2, [newest]) == [None]  # another tokenizer's space
    assert REGISTRY.get_sample_value("kv_scorer_token_segment_cache_hits_total") == hits0 + 1
    assert (cache.hits, cache.misses) == (1, 2)
    assert SEGMENT_BYTES._value.get() == before_bytes + cache.bytes
    cache.clear()
    assert SEGMENT_BYTES._value.get() == before_bytes
    # A segment larger than the whole budget is never cached, and nothing breaks.
    cache.store(1, [("y" * 10000, b"\0" * 4)])
    assert len(cache) == 0


def test_new_turn_only_encodes_what_is_new() -> None:
    cache = SegmentCache(1 << 20)
    from scorer.tokens.registry import EncodeStats

    turn1 = "<|im_start|>user\nA long question.<|im_end|>\n<|im_start|>assistant\n"
    turn2 = turn1 + "An answer.<|im_end|>\n<|im_start|>user\nFollow-up?<|im_end|>\n"
    LT.encode_bytes(turn1, cache)
    st2 = EncodeStats()
    buf = LT.encode_bytes(turn2, cache, stats=st2)
    assert st2.misses == 2  # "assistant\nAn answer." and "user\nFollow-up?"
    assert st2.encoded_chars == len("assistant\nAn answer.") + len("user\nFollow-up?")
    assert buf == ids_to_bytes(LT.encode_whole(turn2))


def _tiny_tokenizer(tmp: Path, lstrip: bool) -> Path:
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<sep>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.add_special_tokens([AddedToken("<sep>", special=True, lstrip=lstrip)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    d = tmp / ("lstrip" if lstrip else "plain")
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


def test_post_processor_and_unsafe_tokens(tmp_path: Path) -> None:
    """BOS/EOS come from the post-processor; lstrip tokens disable the segment path."""
    from transformers import AutoTokenizer

    for lstrip in (False, True):
        d = _tiny_tokenizer(tmp_path, lstrip)
        lt = load_tokenizer(d)
        ref = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        assert lt.prefix_ids == (1,) and lt.suffix_ids == (2,)
        assert lt.segment_safe is (not lstrip)
        cache = SegmentCache(1 << 16)
        for text in ("hello world", "hello <sep> world", "hello   <sep>world <s>"):
            want = list(ref(text)["input_ids"])
            assert lt.encode(text, cache, add_special_tokens=True) == want
            assert lt.encode(text, cache) == list(ref(text, add_special_tokens=False)["input_ids"])


def test_segment_counts_add_up_across_threads_and_outlive_their_cache() -> None:
    # Lookups run in the tokens pool's threads and on the loop: each cache counts under
    # its lock, a scrape sums the caches, and a cache gone keeps its counts in the total.
    registry = CollectorRegistry()
    counts = SegmentCounts(registry)
    caches = [SegmentCache(100_000), SegmentCache(100_000)]
    for c in caches:
        c._counts = counts.cell(c)  # (counted by this registry's counts, not the global)
        c.store(1, [("hit", ids_to_bytes([1, 2]))])
    rounds = 2000
    barrier = threading.Barrier(4)

    def work(c: SegmentCache) -> None:
        barrier.wait()  # all four threads look up at once
        for _ in range(rounds):
            c.lookup(1, ["hit", "miss", "hit"])

    threads = [threading.Thread(target=work, args=(caches[i % 2],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = (4 * rounds * 2, 4 * rounds)
    assert counts.totals() == want
    assert registry.get_sample_value("kv_scorer_token_segment_cache_hits_total") == want[0]
    assert registry.get_sample_value("kv_scorer_token_segment_cache_misses_total") == want[1]
    assert (caches[0].hits, caches[0].misses) == (2 * rounds * 2, 2 * rounds)
    del c, caches
    gc.collect()  # the caches are gone (finalized): their counts stay in the total
    assert counts.totals() == want
    assert not counts._cells
    # The process-wide counts are one collector in the default registry.
    assert SEGMENT_COUNTS in REGISTRY._collector_to_names


def test_a_plain_prompt_is_one_piece_looked_up_once() -> None:
    # No added token: encode_parts' one-piece path: a miss encodes and stores, a hit is one
    # lookup; the bytes, the stats and the cache's counts as the general path's.
    from scorer.tokens.registry import EncodeStats

    cache = SegmentCache(1 << 20)
    text = "A plain completion prompt with no added token in it."
    st1, st2 = EncodeStats(), EncodeStats()
    first = LT.encode_bytes(text, cache, stats=st1)
    second = LT.encode_bytes(text, cache, stats=st2)
    assert first == second == ids_to_bytes(LT.encode_whole(text))
    assert (st1.segments, st1.misses, st1.encoded_chars) == (1, 1, len(text))
    assert (st2.segments, st2.misses, st2.encoded_chars) == (1, 0, 0)
    assert (cache.hits, cache.misses) == (1, 1)
    assert LT.encode_parts([""], cache) == []  # (an empty prompt: nothing looked up)
    assert (cache.hits, cache.misses) == (1, 1)


def test_split_remembers_the_last_small_text() -> None:
    text = "<|im_start|>user\nHello there.<|im_end|>\n"
    pieces = LT.split(text)
    assert LT.split(text) is pieces  # the same str object again: no second split
    same = "".join([text[:5], text[5:]])  # equal, another object: split afresh, equal
    assert same is not text
    again = LT.split(same)
    assert again == pieces and again is not pieces
    assert LT.split(text) is not pieces  # (only the last text is remembered)
    assert LT.split(text) == pieces
    big = "x" * 20000 + "<|im_end|>"
    assert LT.split(big) is not LT.split(big)  # not kept alive past its request
    assert LT.split(big) == ["x" * 20000, "<|im_end|>", ""]
