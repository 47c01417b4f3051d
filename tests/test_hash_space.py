"""The one invariant everything rests on: a request and the engine's events land on the
same block keys, also when the chain carries a LoRA adapter or a `cache_salt`.

The event side is built from vLLM's own `extra_keys` layouts (`block_hash_examples` in the
vectors: the LoRA name in every block, the salt in block 0 only); the request side goes
through the real tokens stage with a token-id prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from configs import make_config

from scorer.blocks import BlockHasher
from scorer.events.apply import Applier
from scorer.events.decode import BlockStored, EventBatch
from scorer.index import BlockIndex
from scorer.tokens.service import Tokenization

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VECTORS = json.loads((FIXTURES / "vectors" / "vllm-kv-events.json").read_text())


def _examples() -> list[dict[str, Any]]:
    out = []
    for group in VECTORS["block_hash_examples"].values():
        if not isinstance(group, list):
            continue
        out += [e for e in group if isinstance(e, dict) and "event_extra_keys" in e]
    return out


EXAMPLES = _examples()
NAMESPACED = [e for e in EXAMPLES if e.get("cache_salt") or e.get("lora")]


@pytest.fixture(scope="module")
def tokens() -> Tokenization:
    config = make_config(
        tokens={
            "models": {"base": {"tokenizer": str(FIXTURES / "tokenizers" / "qwen3")}},
            "lora_base": {"sql-lora": "base"},
        },
    )
    return Tokenization(config, BlockHasher(16))


def _engine_hash(h: Any) -> int | bytes:
    # The fixture writes bytes as {"bytes_hex": ...}; on the wire they are msgpack bin.
    return bytes.fromhex(h["bytes_hex"]) if isinstance(h, dict) else int(h)


def _index_from_event(example: dict[str, Any], hasher: BlockHasher) -> BlockIndex:
    lora = example.get("lora") or {}
    stored = BlockStored(
        block_hashes=[_engine_hash(h) for h in example["event_block_hashes_int"]],
        parent_block_hash=None,
        token_ids=example["token_ids"],
        block_size=example["block_size"],
        lora_name=lora.get("lora_name"),
        extra_keys=example["event_extra_keys"],
    )
    index = BlockIndex()
    Applier(index, hasher).apply("w", EventBatch(ts=0.0, events=[stored]))
    return index


def _request_keys(tokens: Tokenization, example: dict[str, Any], **body: Any) -> list[int]:
    lora = example.get("lora") or {}
    model = lora.get("lora_name", "base")
    doc = {"model": model, "prompt": example["token_ids"], **body}
    return tokens.tokenize_body(model, doc).block_keys


def test_examples_cover_salt_lora_and_plain_chains() -> None:
    assert any(e.get("cache_salt") for e in NAMESPACED)
    assert any(e.get("lora") for e in NAMESPACED)
    assert any(not (e.get("cache_salt") or e.get("lora")) for e in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e["name"])
def test_request_keys_match_event_keys(tokens: Tokenization, example: dict[str, Any]) -> None:
    index = _index_from_event(example, tokens.hasher)
    keys = _request_keys(tokens, example, cache_salt=example.get("cache_salt"))
    assert len(keys) == 3
    assert index.match(keys)["w"].blocks == 3


@pytest.mark.parametrize("example", NAMESPACED, ids=lambda e: e["name"])
def test_other_namespaces_never_match(tokens: Tokenization, example: dict[str, Any]) -> None:
    index = _index_from_event(example, tokens.hasher)
    plain = {"model": "base", "prompt": example["token_ids"]}
    assert "w" not in index.match(tokens.tokenize_body("base", plain).block_keys)
    if example.get("cache_salt"):
        other = _request_keys(tokens, example, cache_salt="tenant-b")
        assert "w" not in index.match(other)
