"""Tokenization: the request-path stage, its registry, namespaces and thread pool."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from configs import make_config, run_on_default_loop
from tokens_helpers import HEADERS, QWEN3, hf, local, make_tokens

from scorer.blocks import BlockHasher, namespace_key
from scorer.config import ConfigError
from scorer.routing import RoutingRequest
from scorer.tokens import Tokenization, TokenizeError
from scorer.tokens.chat import content_format, normalize_messages, normalize_tools
from scorer.tokens.registry import resolve_tokenizer_files


@pytest.fixture(scope="module")
def tokens() -> Any:
    t = make_tokens(lora_base={"qwen3-sql-lora": "qwen3"})
    try:
        yield t
    finally:
        t.close()


async def test_prepare_fills_tokens_and_keys(tokens: Tokenization) -> None:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "Hello " * 40}]}
    req = RoutingRequest(request_id="r1", model="qwen3", body=body)
    await tokens.prepare(req)
    assert req.tokenize_error is None
    assert req.token_ids is not None and req.token_ids[0] == local(QWEN3).added["<|im_start|>"]
    assert req.prompt_tokens == len(req.token_ids)
    assert req.block_size == 16
    assert req.block_keys == BlockHasher(16).keys(req.token_ids)
    assert len(req.block_keys) == len(req.token_ids) // 16
    # Both decision stages are reported, and hashing is part of the whole.
    assert set(req.stages) == {"tokenize", "hash"}
    assert req.stages["hash"] > 0 and req.stages["tokenize"] > 0


async def test_token_id_prompts_need_no_tokenizer(tokens: Tokenization) -> None:
    ids = list(range(1, 41))
    for prompt in (ids, [ids, [9, 9]]):  # a prompt, and a batch scored by its first
        req = RoutingRequest(request_id="r", model="no-such-model", body={"prompt": prompt})
        await tokens.prepare(req)
        assert req.tokenize_error is None
        assert req.token_ids is not None and list(req.token_ids) == ids
        assert req.block_keys == BlockHasher(16).keys(ids)
    salted = RoutingRequest(
        request_id="r", model="no-such-model", body={"prompt": ids, "cache_salt": "t"}
    )
    await tokens.prepare(salted)
    assert salted.block_keys == BlockHasher(16).keys(ids, namespace_key(cache_salt="t"))


async def test_no_tokenizer_is_decided_without_a_thread_hop() -> None:
    """A long text prompt for a model without a tokenizer is the policy's load fallback:
    answered on the loop (the thread pool is never created), as cheap as round_robin."""
    t = make_tokens()
    try:
        body = {"model": "unknown", "prompt": "word " * 4000}
        req = RoutingRequest(request_id="r", model="unknown", body=body, prompt_tokens=5000)
        await t.prepare(req)
        assert req.token_ids is None and req.tokenize_error is None
        assert t._pool is None
        # A model with a tokenizer and a long prompt still goes to the pool.
        big = RoutingRequest(
            request_id="r2", model="qwen3", body={"prompt": "word " * 400}, prompt_tokens=5000
        )
        await t.prepare(big)
        assert big.token_ids and t._pool is not None
    finally:
        t.close()


async def test_no_tokenizer_and_bad_bodies(tokens: Tokenization) -> None:
    req = RoutingRequest(request_id="r", model="unknown", body={"prompt": "hi"})
    await tokens.prepare(req)
    assert req.token_ids is None and req.tokenize_error is None  # → no_tokenizer by policy
    bad: list[dict[str, Any]] = [
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "system", "content": "x"}, {"role": "system", "content": "y"}]},
        {"prompt": 42},
        {"prompt": [1, "a"]},
        {"prompt": [1, True]},  # bool is an int subclass, not a token id
        {"prompt": [1, 2.0]},
        {"prompt": [-1]},
        {"nothing": True},
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        {"prompt": "x", "cache_salt": 5},
    ]
    for body in bad:
        model = "headers" if body.get("messages") and len(body["messages"]) == 2 else "qwen3"
        r = RoutingRequest(request_id="r", model=model, body=body)
        await tokens.prepare(r)
        assert r.tokenize_error, body
        assert r.token_ids is None
    r = RoutingRequest(request_id="r", model="headers", body=bad[2])
    await tokens.prepare(r)
    assert "only allowed first" in (r.tokenize_error or "")  # raise_exception's message


def test_namespaces_lora_and_cache_salt(tokens: Tokenization) -> None:
    prompt = {"prompt": "The same words " * 20}
    base = tokens.tokenize_body("qwen3", prompt)
    lora = tokens.tokenize_body("qwen3-sql-lora", prompt)
    salted = tokens.tokenize_body("qwen3", {**prompt, "cache_salt": "tenant-a"})
    assert base.namespace == 0
    assert lora.token_ids == base.token_ids and lora.model == "qwen3"
    assert lora.namespace == namespace_key(lora_name="qwen3-sql-lora")
    assert salted.namespace == namespace_key(cache_salt="tenant-a")
    assert len({tuple(base.block_keys), tuple(lora.block_keys), tuple(salted.block_keys)}) == 3
    hasher = BlockHasher(16)
    assert salted.block_keys == hasher.keys(base.token_ids, salted.namespace)


def test_completions_token_ids_and_batches(tokens: Tokenization) -> None:
    ids = list(range(100, 140))
    tp = tokens.tokenize_body("qwen3", {"prompt": ids})
    assert tp.token_ids == ids and tp.kind == "token_ids"
    # A batch is scored by its first prompt (documented choice).
    first = tokens.tokenize_body("qwen3", {"prompt": "first prompt"})
    batch = tokens.tokenize_body("qwen3", {"prompt": ["first prompt", "second one"]})
    assert batch.token_ids == first.token_ids and batch.stats["batch"] == 2
    batch_ids = tokens.tokenize_body("qwen3", {"prompt": [[5, 6, 7], [8, 9]]})
    assert batch_ids.token_ids == [5, 6, 7]
    # The body's add_special_tokens overrides the default, as in vLLM.
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    plain = tokens.tokenize_body("headers", chat).token_ids
    with_bos = tokens.tokenize_body("headers", {**chat, "add_special_tokens": True}).token_ids
    assert plain == with_bos  # this tokenizer.json's post-processor adds nothing
    assert plain[0] == local(QWEN3).added["<|endoftext|>"]  # the template's own bos_token


def test_content_parts_flattened_like_vllm(tokens: Tokenization) -> None:
    parts = [
        {"type": "text", "text": "first"},
        {"type": "text", "text": "second"},
        "third",
        {"type": "refusal", "refusal": "no"},
    ]
    a = tokens.render("qwen3", {"messages": [{"role": "user", "content": parts}]})
    b = tokens.render(
        "qwen3", {"messages": [{"role": "user", "content": "first\nsecond\nthird\nno"}]}
    )
    assert a == b
    # Templates that loop over content get the parts ("openai" format).
    loop = (
        "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]"
        "{% endfor %}{% endfor %}"
    )
    assert content_format(loop) == "openai"
    assert content_format(local(QWEN3).chat_templates["default"]) == "string"
    trusting = make_tokens({"qwen3": QWEN3}, allow_request_chat_template=True)
    try:
        body = {"messages": [{"role": "user", "content": parts[:2]}], "chat_template": loop}
        assert trusting.render("qwen3", body) == "[first][second]"
        body = {"messages": [{"role": "user", "content": "plain"}], "chat_template": loop}
        assert trusting.render("qwen3", body) == "[plain]"
    finally:
        trusting.close()


def test_message_and_tool_normalization() -> None:
    msgs = normalize_messages(
        [
            {"role": "user", "content": None, "extra": 1},
            {
                "role": "assistant",
                "content": None,
                "reasoning": "r",
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1}'},
                    },
                    {"id": "2", "type": "function", "function": {"name": "g", "arguments": "oops"}},
                ],
            },
            {"role": "tool", "content": "x", "tool_call_id": "1", "name": "f"},
            {"role": "assistant", "content": "y", "tool_calls": []},
        ],
        "string",
    )
    assert msgs[0] == {"role": "user", "content": ""}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[1]["tool_calls"][1]["function"]["arguments"] == {}
    assert msgs[1]["reasoning_content"] == "r"
    assert msgs[2] == {"role": "tool", "content": "x", "tool_call_id": "1", "name": "f"}
    assert "tool_calls" not in msgs[3]
    tools = normalize_tools([{"function": {"parameters": {}, "name": "f", "strict": True}}])
    assert tools == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {}, "strict": True},
        }
    ]
    assert list(tools[0]["function"]) == ["name", "description", "parameters", "strict"]


@pytest.mark.slow
async def test_huge_prompt_does_not_stall_a_tiny_one() -> None:
    t = make_tokens({"qwen3": QWEN3}, threads=2, segment_cache_bytes=0)
    # The huge prompt is held inside the tokenizer thread until the test lets it go, so
    # "the tiny one finishes while the huge one is in the tokenizer" holds by construction,
    # not by how fast this machine is.
    in_tokenizer, release = threading.Event(), threading.Event()
    real = t.tokenize_body

    def gated(model: Any, body: dict[str, Any], **kw: Any) -> Any:
        if len(body.get("prompt", "")) > 1000:
            in_tokenizer.set()
            assert release.wait(60), "the test never released the huge prompt"
        return real(model, body, **kw)

    t.tokenize_body = gated  # type: ignore[method-assign]
    try:
        # ~ 600k characters of varied text: hundreds of milliseconds in the tokenizer.
        huge_text = " ".join(f"word{i} lorem ipsum {i * 7919 % 1000}" for i in range(40_000))
        huge = RoutingRequest(request_id="huge", model="qwen3", body={"prompt": huge_text})
        tiny = RoutingRequest(request_id="tiny", model="qwen3", body={"prompt": "hello"})
        huge_task = asyncio.create_task(t.prepare(huge))
        assert await asyncio.to_thread(in_tokenizer.wait, 60)  # the huge one is in a thread
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while not huge_task.done():
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        await t.prepare(tiny)  # the other thread serves it meanwhile
        assert tiny.token_ids is not None and list(tiny.token_ids) == [14990]
        for _ in range(6000):  # the event loop keeps running (bounded wait, ~30 s)
            if ticks >= 3:
                break
            await asyncio.sleep(0.005)
        assert ticks >= 3 and not huge_task.done()
        release.set()
        await huge_task
        await tick_task
        assert huge.prompt_tokens > 100_000
    finally:
        release.set()
        t.close()


@pytest.mark.slow
def test_registry_paths_and_hf_cache_layout(tmp_path: Path) -> None:
    # A tokenizer.json file; a directory; the HF hub cache layout.
    f, cfg = resolve_tokenizer_files(QWEN3 / "tokenizer.json")
    assert f == QWEN3 / "tokenizer.json" and cfg == QWEN3 / "tokenizer_config.json"
    snap = tmp_path / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snap / name).symlink_to(QWEN3 / name)
    (tmp_path / "models--Qwen--Qwen3-0.6B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3-0.6B" / "refs" / "main").write_text("abc123")
    f, cfg = resolve_tokenizer_files(tmp_path / "models--Qwen--Qwen3-0.6B")
    assert f == snap / "tokenizer.json" and cfg == snap / "tokenizer_config.json"
    # A bare tokenizer.json without a config: no chat template → chat is a tokenize error.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(QWEN3 / "tokenizer.json", bare / "tokenizer.json")
    t = make_tokens({"hub": tmp_path / "models--Qwen--Qwen3-0.6B", "bare": bare / "tokenizer.json"})
    try:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert t.tokenize_body("hub", body).token_ids == list(
            hf(QWEN3).apply_chat_template(body["messages"], add_generation_prompt=True)["input_ids"]
        )
        with pytest.raises(TokenizeError, match="no chat template"):
            t.tokenize_body("bare", body)
        assert t.tokenize_body("bare", {"prompt": "hello"}).token_ids == [14990]
    finally:
        t.close()


@pytest.mark.slow
def test_config_errors_name_the_field(tmp_path: Path) -> None:
    def build(**kw: Any) -> Tokenization:
        return Tokenization(make_config(**kw), BlockHasher(16))

    with pytest.raises(ConfigError, match=r"tokens\.models\.m\.tokenizer: .*no such file"):
        build(tokens={"models": {"m": {"tokenizer": str(tmp_path / "x")}}})
    with pytest.raises(ConfigError, match=r"tokens\.models\.m\.chat_template"):
        build(tokens={"models": {"m": {"tokenizer": str(QWEN3), "chat_template": "/nope.j2"}}})
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokens\.models\.m\.tokenizer: .*cannot load"):
        build(tokens={"models": {"m": {"tokenizer": str(tmp_path / "broken")}}})
    with pytest.raises(ConfigError, match=r"tokens\.models: no tokenizer for model 'other'"):
        build(
            pool={"models": ["qwen3", "other"]},
            tokens={"models": {"qwen3": {"tokenizer": str(QWEN3)}}, "on_missing": "error"},
        )
    # on_missing="load": the same configuration starts; the model routes by load.
    t = build(
        pool={"models": ["qwen3", "other"]},
        tokens={"models": {"qwen3": {"tokenizer": str(QWEN3)}}},
    )
    assert t.tokenizer_for("other") is None and t.tokenizer_for("qwen3") is not None
    t.close()
    # A chat_template file from the configuration overrides the tokenizer's.
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    t = build(tokens={"models": {"m": {"tokenizer": str(HEADERS), "chat_template": str(tpl)}}})
    assert t.render("m", {"messages": [{"role": "user", "content": "x"}]}) == "<user>x"
    t.close()


async def test_debug_tokenize_route_over_real_http(tokens: Tokenization) -> None:
    import aiohttp
    from aiohttp import web

    app = web.Application()
    for method, path, handler in tokens.routes():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/debug/tokenize"
        body = {"model": "qwen3", "prompt": "hello world " * 10, "cache_salt": "t1"}
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=body) as r:
                assert r.status == 200
                got = await r.json()
            want = tokens.tokenize_body("qwen3", body)
            assert got["token_ids"] == want.token_ids
            assert [int(k) for k in got["block_keys"]] == want.block_keys
            assert got["namespace"] == namespace_key(cache_salt="t1")
            async with http.post(url + "?model=nope", json=body) as r:
                assert r.status == 404
            async with http.post(url, json={"model": "qwen3", "messages": 3}) as r:
                assert r.status == 400 and "messages" in (await r.json())["error"]["message"]
            async with http.post(url, data=b"{not json") as r:
                assert r.status == 400
    finally:
        await runner.cleanup()


def test_truncate_prompt_tokens_keeps_the_tail(tokens: Tokenization) -> None:
    body = {"prompt": "one two three four five six seven eight nine ten"}
    full = tokens.tokenize_body("qwen3", body).token_ids
    cut = tokens.tokenize_body("qwen3", {**body, "truncate_prompt_tokens": 4})
    assert cut.token_ids == full[-4:] and cut.stats["truncated_to"] == 4
    same = tokens.tokenize_body("qwen3", {**body, "truncate_prompt_tokens": -1}).token_ids
    assert same == full
    with pytest.raises(TokenizeError, match="truncate_prompt_tokens"):
        tokens.tokenize_body("qwen3", {**body, "truncate_prompt_tokens": "x"})


@pytest.mark.slow
def test_named_templates_from_tokenizer_config(tmp_path: Path) -> None:
    import json

    d = tmp_path / "named"
    d.mkdir()
    (d / "tokenizer.json").symlink_to(QWEN3 / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "chat_template": [
                    {"name": "default", "template": "D{{ messages[0].content }}"},
                    {"name": "tool_use", "template": "T{{ tools | length }}"},
                    {"name": "rag", "template": "R{{ documents[0].text }}"},
                ],
            }
        )
    )
    t = make_tokens({"m": d})
    try:
        msgs = [{"role": "user", "content": "x"}]
        assert t.render("m", {"messages": msgs}) == "Dx"
        tools = [{"type": "function", "function": {"name": "f"}}]
        assert t.render("m", {"messages": msgs, "tools": tools}) == "T1"
        docs = [{"title": "t", "text": "doc"}]
        assert (
            t.render("m", {"messages": msgs, "documents": docs, "chat_template": "rag"}) == "Rdoc"
        )
    finally:
        t.close()


def test_text_prompts_go_inline_by_measured_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inline when (characters to encode x measured rate) fits the hop's cost and the stall
    bound; a completion prompt's cached pieces cost nothing to encode."""
    from scorer.tokens import service

    t = make_tokens({"qwen3": QWEN3})
    lt = t.tokenizer_for("qwen3")
    assert lt is not None
    # Load measured both rates, typical below worst.
    assert 0 < lt.encode_ns_per_char < lt.encode_ns_per_char_worst < float("inf")
    monkeypatch.setattr(lt, "encode_ns_per_char", 100.0)  # 1,000 chars = 100 µs
    monkeypatch.setattr(lt, "encode_ns_per_char_worst", 400.0)  # 2,500 chars = 1 ms
    main = threading.get_ident()

    def threads(body: dict[str, Any]) -> set[int]:
        seen: set[int] = set()
        real = t._fill  # the work prepare runs inline or in the pool

        def spy(request: RoutingRequest, model: Any, doc: Any) -> str:
            seen.add(threading.get_ident())
            return real(request, model, doc)

        t._fill = spy  # type: ignore[method-assign]
        try:
            req = RoutingRequest(request_id="t", model="qwen3", body=body)
            req.body_bytes = len(str(body))
            run_on_default_loop(t.prepare(req))
            assert req.token_ids is not None
        finally:
            del t._fill
        return seen

    try:
        assert threads({"prompt": "hello " * 100}) == {main}  # 600 chars: 60 µs
        new = {"prompt": "a new prompt " * 100}  # 1,300 chars: 130 µs typical
        assert main not in threads(new)
        assert threads(new) == {main}  # now its one piece is cached: lookups only
        monkeypatch.setattr(lt, "encode_ns_per_char_worst", 2000.0)
        assert main not in threads({"prompt": "worst case " * 60})  # 660 chars: 1.3 ms
        # Chat: every body byte, plus the render per message.
        msgs = [{"role": "user", "content": "hi"}] * 10
        assert threads({"messages": msgs[:1]}) == {main}
        monkeypatch.setattr(service, "RENDER_S_PER_MESSAGE", 10e-6)
        assert main not in threads({"messages": msgs})  # 100 µs of render alone
        assert not t.inline_text("qwen3", {"prompt": "x"}, service.INLINE_MAX_BYTES + 1)
        assert not t.inline_text("qwen3", {"prompt": "x"}, 0)  # size unknown
    finally:
        t.close()


def test_prepare_counts_each_outcome_once() -> None:
    """kv_scorer_tokenize_requests_total: one outcome per prepared request, counted by
    prepare on the event loop (prepare_sync returns it)."""
    from prometheus_client import REGISTRY

    def counts() -> dict[str, float]:
        return {
            o: REGISTRY.get_sample_value("kv_scorer_tokenize_requests_total", {"outcome": o}) or 0.0
            for o in ("ok", "no_tokenizer", "error", "over_budget")
        }

    t = Tokenization(make_config(), BlockHasher(16))  # no tokenizer for model "m"
    t.max_prompt_tokens = 3
    cases = [
        ({"model": "m", "prompt": "some text"}, "no_tokenizer"),
        ({"model": "m", "prompt": [1, 2, 3]}, "ok"),
        ({"model": "m", "prompt": [1, 2, 3, 4]}, "over_budget"),  # counted before hashing
        ({"model": "m", "prompt": [1, 2**32]}, "error"),
    ]
    for body, outcome in cases:
        before = counts()
        req = RoutingRequest(request_id="c", model="m", body=body)
        run_on_default_loop(t.prepare(req))
        after = counts()
        assert {o: after[o] - before[o] for o in after} == {
            o: 1.0 if o == outcome else 0.0 for o in after
        }, body
        assert (req.block_keys is not None) == (outcome == "ok")
    # prepare_sync (the same checks, in the calling thread) returns the outcome uncounted.
    before = counts()
    assert t.prepare_sync(RoutingRequest(request_id="s", model="m", body=cases[0][0])) == (
        "no_tokenizer"
    )
    assert t.prepare_sync(RoutingRequest(request_id="s", model="m", body=cases[1][0])) == "ok"
    assert counts() == before
