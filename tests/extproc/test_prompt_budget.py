"""The per-request CPU budget of the tokens stage, at the director: prompts past
`tokens.max_prompt_tokens` (token ids counted before hashing, text counted after tokenizing)
or text bodies past `tokens.max_tokenize_bytes` (before rendering) are refused with 413 in
the OpenAI error shape, counted and logged with reason `prompt_too_large`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from extproc_helpers import WORKERS
from prometheus_client import REGISTRY

from scorer.api.v1 import scorer_pb2, scorer_pb2_grpc
from scorer.config import ConfigError, TokensConfig, load_config
from scorer.director import Director
from scorer.routing import Decision

QWEN3 = Path(__file__).resolve().parent.parent / "fixtures" / "tokenizers" / "qwen3"
TOKENS = {"models": {"qwen3": {"tokenizer": str(QWEN3)}}}


def counted(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def decide(director: Director, rid: str, body: dict[str, Any]) -> Decision:
    req = director.new_request({"x-request-id": rid})
    return await director.request_received(req, json.dumps(body).encode())


def assert_refused(d: Decision, limit: str, param: str) -> dict[str, Any]:
    assert d.endpoints == [] and d.status == 413
    assert str(d.reason) == "prompt_too_large"
    err: dict[str, Any] = json.loads(Director.refusal_body(d))["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "prompt_too_large"
    assert err["param"] == param and limit in err["message"]
    return err


def test_defaults_never_meet_normal_traffic_and_bad_values_name_the_field() -> None:
    tc = TokensConfig()
    assert (tc.max_prompt_tokens, tc.max_tokenize_bytes) == (1 << 20, 16 << 20)
    for field, value in (("max_prompt_tokens", 0), ("max_tokenize_bytes", 10)):
        with pytest.raises(ConfigError, match=f"tokens.{field}"):
            load_config(overrides={"tokens": {field: value}}, environ={})


async def test_token_ids_are_counted_before_hashing(harness) -> None:
    h = await harness(policy="kv", tokens={"max_prompt_tokens": 64})
    director = h.app.director
    before = counted("kv_scorer_decisions_total", {"policy": "kv", "reason": "prompt_too_large"})
    ok = await decide(director, "ok", {"model": "m", "prompt": list(range(1, 65))})
    assert ok.status == 200 and ok.endpoints[0] in WORKERS and ok.request_tokens == 64
    # Over by one; a batch is counted by its first prompt, the one that is hashed.
    for rid, prompt in (("ids", list(range(1, 66))), ("batch", [list(range(1, 66)), [1]])):
        d = await decide(director, rid, {"model": "m", "prompt": prompt})
        err = assert_refused(d, "tokens.max_prompt_tokens", "prompt")
        assert "65 tokens" in err["message"] and "64" in err["message"]
        (logged,) = h.app.decisions.query(limit=1)
        assert (logged["request_id"], logged["status"]) == (rid, 413)
        assert logged["reason"] == "prompt_too_large"
    after = counted("kv_scorer_decisions_total", {"policy": "kv", "reason": "prompt_too_large"})
    assert after - before == 2
    # Refusals are never in flight: only the routed request is.
    assert len(h.app.pool.inflight) == 1 and len(director) == 1


async def test_text_prompts_are_counted_after_tokenizing(harness) -> None:
    h = await harness(policy="kv", tokens={**TOKENS, "max_prompt_tokens": 50})
    director = h.app.director
    small = await decide(director, "small", {"model": "qwen3", "prompt": "Hello " * 10})
    assert small.status == 200 and 0 < small.request_tokens <= 50
    chat = {"model": "qwen3", "messages": [{"role": "user", "content": "Hello " * 100}]}
    d = await decide(director, "chat", chat)
    err = assert_refused(d, "tokens.max_prompt_tokens", "messages")
    assert "limit of 50" in err["message"]
    d = await decide(director, "text", {"model": "qwen3", "prompt": "Hello " * 100})
    assert_refused(d, "tokens.max_prompt_tokens", "prompt")


async def test_text_bodies_past_the_byte_budget_are_refused_before_tokenizing(harness) -> None:
    h = await harness(policy="kv", tokens={**TOKENS, "max_tokenize_bytes": 2048})
    director = h.app.director
    outcome = {"outcome": "over_budget"}
    before = counted("kv_scorer_tokenize_requests_total", outcome)
    ok_before = counted("kv_scorer_tokenize_requests_total", {"outcome": "ok"})
    body = {"model": "qwen3", "prompt": "word " * 500}  # ~2.5 kB, ~500 tokens
    err = assert_refused(await decide(director, "big", body), "tokens.max_tokenize_bytes", "prompt")
    assert "limit of 2048" in err["message"]
    assert counted("kv_scorer_tokenize_requests_total", outcome) - before == 1
    # Refused before the tokenizer ran: no tokenize outcome "ok" was counted for it.
    assert counted("kv_scorer_tokenize_requests_total", {"outcome": "ok"}) == ok_before
    # Under the byte budget: tokenized and routed.
    d = await decide(director, "fits", {"model": "qwen3", "prompt": "word " * 300})
    assert d.status == 200 and d.endpoints
    # A model without a tokenizer is routed by load: no work is spent, none is refused.
    d = await decide(director, "untok", {"model": "other", "prompt": "word " * 500})
    assert d.status == 200 and str(d.reason) == "no_tokenizer"


async def test_debug_surfaces_answer_413_too(harness) -> None:
    h = await harness(policy="kv", tokens={**TOKENS, "max_prompt_tokens": 8})
    base = f"http://127.0.0.1:{h.app.admin_port}"
    body = {"model": "qwen3", "prompt": "Hello " * 40}
    ids = {"model": "m", "token_ids": list(range(9))}
    errors = []
    async with aiohttp.ClientSession() as s:
        for path, b in (("/debug/tokenize", body), ("/debug/score", body), ("/debug/score", ids)):
            async with s.post(base + path, json=b) as r:
                assert r.status == 413, path
                errors.append((await r.json())["error"])
        async with s.post(base + "/debug/score", json={**ids, "token_ids": [1] * 8}) as r:
            assert r.status == 200
            assert (await r.json())["decision"]["status"] == 200
    assert errors[0]["code"] == "prompt_too_large"
    for err in errors:
        assert set(err) == {"message", "type", "param", "code"}
        assert "tokens.max_prompt_tokens" in err["message"]
    # The Score RPC: the same refusal (nothing hashed), and a prompt at the limit decided.
    stub = scorer_pb2_grpc.ScorerStub(h.channel)
    for n, status in ((9, 413), (8, 200)):
        ids = scorer_pb2.TokenIds(ids=list(range(1, n + 1)))
        r = await stub.Score(scorer_pb2.ScoreRequest(model="m", token_ids=ids))
        assert r.status == status
        assert (r.reason == "prompt_too_large") == (status == 413)
    r = await stub.Score(scorer_pb2.ScoreRequest(model="qwen3", prompt="Hello " * 40))
    assert (r.status, r.reason) == (413, "prompt_too_large")
    assert len(h.app.pool.inflight) == 0  # dry runs: nothing in flight
