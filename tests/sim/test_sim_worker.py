"""The simulated worker's HTTP API, metrics, scheduler and CLI, over real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscorer_tools.sim.worker import SimConfig, SimWorker, running_workers

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def worker() -> AsyncIterator[SimWorker]:
    async with running_workers(
        [SimConfig(port=0, block_size=4, capacity_blocks=64, speed=100.0, model="m")]
    ) as ws:
        yield ws[0]


async def _post(w: SimWorker, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(w.url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def _metrics(w: SimWorker) -> dict[str, list[tuple[dict[str, str], float]]]:
    async with aiohttp.ClientSession() as s, s.get(w.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _value(m: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    (_labels, value), *_ = m[name]
    return value


async def test_metrics_counters_in_tokens(worker: SimWorker) -> None:
    m = await _metrics(worker)
    assert _value(m, "vllm:prefix_cache_queries_total") == 0
    (labels, v), *_ = m["vllm:cache_config_info"]
    assert labels["block_size"] == "4" and labels["num_gpu_blocks"] == "64" and v == 1
    assert m["vllm:num_requests_running"][0][0] == {"model_name": "m", "engine": "0"}
    assert "vllm:lora_requests_info" in m and "vllm:num_preemptions_total" in m

    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks of 4
    for expect_cached in (0, 8):
        status, body = await _post(worker, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
        assert status == 200
        assert body["usage"] == {
            "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": expect_cached},
        }  # fmt: skip
        assert body["choices"][0]["finish_reason"] == "length"
    m = await _metrics(worker)
    assert _value(m, "vllm:prefix_cache_queries_total") == 20
    assert _value(m, "vllm:prefix_cache_hits_total") == 8
    assert _value(m, "vllm:time_to_first_token_seconds_count") == 2
    assert _value(m, "vllm:generation_tokens_total") == 6
    assert _value(m, "vllm:num_requests_running") == 0
    assert _value(m, "vllm:kv_cache_usage_perc") == 0.0
    # A full-prompt hit still recomputes the last token: 8 prompt tokens = 2 blocks, only 1 hits.
    status, body = await _post(worker, "/v1/completions", {"prompt": prompt[:8]})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


async def test_streaming_sse_arrives_in_chunks() -> None:
    cfg = SimConfig(port=0, block_size=4, capacity_blocks=64, speed=1.0)
    async with running_workers([cfg]) as (w,), aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 20,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with s.post(w.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events: list[str] = []
            running_at_first_token: int | None = None
            async for raw in r.content:
                line = raw.decode().strip()
                if not line:
                    continue
                assert line.startswith("data: ")
                events.append(line[6:])
                if len(events) == 2:  # role chunk, then the first token
                    running_at_first_token = len(w.engine.running)
        # The first token reached us while the request was still generating.
        assert running_at_first_token == 1
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        tokens = [c for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]]
        assert len(tokens) == 1 + 20  # role chunk has empty content
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 20
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_waiting_queue_over_max_num_seqs() -> None:
    cfg = SimConfig(port=0, block_size=4, capacity_blocks=256, max_num_seqs=2, speed=1.0)
    async with running_workers([cfg]) as (w,):
        body = {"prompt": list(range(1, 30)), "max_tokens": 10}
        tasks = [asyncio.create_task(_post(w, "/v1/completions", body)) for _ in range(4)]
        seen = None
        for _ in range(6000):  # bounded wait for the queue to form
            m = await _metrics(w)
            seen = (_value(m, "vllm:num_requests_running"), _value(m, "vllm:num_requests_waiting"))
            if seen == (2, 2):
                break
            await asyncio.sleep(0.005)
        assert seen == (2, 2)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(status == 200 for status, _ in results)
        m = await _metrics(w)
        assert _value(m, "vllm:num_requests_waiting") == 0
        assert _value(m, "vllm:request_success_total") == 4


async def test_tokenize_render_and_info(worker: SimWorker) -> None:
    status, tok = await _post(worker, "/tokenize", {"model": "m", "prompt": "the same words"})
    assert status == 200
    assert set(tok) >= {"count", "max_model_len", "tokens"}
    assert tok["count"] == 3 == len(tok["tokens"]) and tok["max_model_len"] == 131072
    _, again = await _post(worker, "/tokenize", {"prompt": "the same words again"})
    assert again["tokens"][:3] == tok["tokens"]  # deterministic, prefix-stable
    _, ids = await _post(worker, "/tokenize", {"prompt": [5, 6, 7]})
    assert ids["tokens"] == [5, 6, 7]
    msgs = {"messages": [{"role": "user", "content": "the same words"}]}
    _, chat = await _post(worker, "/tokenize", msgs)
    assert chat["tokens"][1:4] == tok["tokens"]
    status, render = await _post(worker, "/v1/completions/render", {"prompt": "the same words"})
    assert status == 200 and render[0]["token_ids"] == tok["tokens"]
    status, render = await _post(worker, "/v1/chat/completions/render", msgs)
    assert status == 200 and render["token_ids"] == chat["tokens"]
    status, detok = await _post(worker, "/detokenize", {"tokens": [1001, 1002]})
    assert status == 200 and isinstance(detok["prompt"], str)
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/server_info", "/get_server_info", "/model_info", "/v1/models"):
            async with s.get(worker.url + path) as r:
                assert r.status == 200, path
        async with s.get(worker.url + "/v1/models") as r:
            assert [c["id"] for c in (await r.json())["data"]] == ["m"]
        async with s.get(worker.url + "/get_model_info") as r:
            assert (await r.json())["model_path"] == "m"


async def test_bad_requests_get_openai_errors(worker: SimWorker) -> None:
    status, body = await _post(worker, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    status, body = await _post(worker, "/v1/completions", {"prompt": {"a": 1}})
    assert status == 400 and "prompt" in body["error"]["message"]
    status, body = await _post(worker, "/v1/completions", {"prompt": "x y", "max_tokens": 10**6})
    assert status == 400 and "maximum context length" in body["error"]["message"]
    big = {"prompt": list(range(1, 300)), "max_tokens": 1}  # 75 blocks > 64
    status, body = await _post(worker, "/v1/completions", big)
    assert status == 400 and "KV blocks" in body["error"]["message"]
    async with (
        aiohttp.ClientSession() as s,
        s.post(worker.url + "/v1/chat/completions", data=b"{not json") as r,
    ):
        assert r.status == 400
    # Nothing was queued by the failures.
    assert not worker.engine.waiting and not worker.engine.running


async def test_several_workers_in_one_process() -> None:
    cfgs = [SimConfig(port=0, speed=100.0, model=f"w{i}") for i in range(3)]
    async with running_workers(cfgs) as ws:
        assert len({w.port for w in ws}) == 3
        for w in ws:
            status, _ = await _post(w, "/v1/completions", {"prompt": "a b c", "max_tokens": 1})
            assert status == 200
        m = await _metrics(ws[1])
        assert _value(m, "vllm:prefix_cache_queries_total") == 3
        assert m["vllm:prefix_cache_queries_total"][0][0]["model_name"] == "w1"


@pytest.mark.slow
def test_cli_prints_endpoints_and_stops_on_sigterm() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "scorer.cli", "sim", "--port", "0", "--speed", "50",
         "--kv-events", "tcp://127.0.0.1:0", "--kv-events-mode", "bind", "--era", "array"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline and not line:
            line = proc.stdout.readline()
        assert line.startswith("sim ready: http=http://127.0.0.1:"), line
        assert "kv_events=tcp://127.0.0.1:" in line and "era=array" in line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--block-size", "--stream-interval"])
def test_cli_rejects_bad_flags(flag: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scorer.cli", "sim", flag, "0"],
        capture_output=True, text=True, cwd=REPO, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2 and flag in proc.stderr


async def test_request_log_has_one_line_per_request(tmp_path: Path) -> None:
    """`--request-log`: the prompt's key (hash of its ids), its times in order, its hit."""
    log = tmp_path / "req.jsonl"
    cfg = SimConfig(port=0, block_size=4, capacity_blocks=64, speed=100.0, model="m")
    cfg.request_log = str(log)
    prompt = list(range(100, 117))
    async with running_workers([cfg]) as ws:
        for _ in range(2):
            status, _body = await _post(
                ws[0], "/v1/completions", {"prompt": prompt, "max_tokens": 2}
            )
            assert status == 200
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["key"] for x in lines] == [hash(tuple(prompt))] * 2
    assert [x["cached_tokens"] for x in lines] == [0, 16]  # the second one hits
    for x in lines:
        assert x["arrival"] <= x["admitted"] <= x["first"] and x["ttft_ms"] > 0
        assert x["prompt_tokens"] == 17 and x["waiting"] == 0


async def test_stream_interval_coalesces_tokens_after_the_first() -> None:
    cfg = SimConfig(port=0, block_size=4, capacity_blocks=64, speed=100.0, stream_interval=8)
    async with running_workers([cfg]) as (w,), aiohttp.ClientSession() as s:
        texts: list[str] = []
        finishes: list[str | None] = []
        body = {"prompt": "one two three four five", "max_tokens": 20, "stream": True}
        async with s.post(w.url + "/v1/completions", json=body) as r:
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    texts.append(choice["text"])
                    finishes.append(choice["finish_reason"])
        _, whole = await _post(w, "/v1/completions", {**body, "stream": False})
        _, first = await _post(w, "/v1/completions", {**body, "stream": False, "max_tokens": 1})
    # Same tokens as unmerged; the first token alone (TTFT), then at most 8 per chunk:
    # 19 tokens after the first make 3 merged runs, so 4 chunks unless the reader lagged.
    assert "".join(texts) == whole["choices"][0]["text"]
    assert texts[0] == first["choices"][0]["text"]
    assert 2 <= len(texts) <= 4
    assert finishes == [None] * (len(texts) - 1) + ["length"]
