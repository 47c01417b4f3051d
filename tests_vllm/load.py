"""Clients of the tier: one request (streaming or not) and a multi-turn run with an order."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests_vllm.workload import Conversation


@dataclass
class Result:
    """One request as the client saw it."""

    status: int
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)


async def send(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float = 300.0
) -> Result:
    """POST a chat/completions body; SSE when body['stream'] (usage from the last chunk)."""
    t0 = time.monotonic()
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            if r.status != 200:
                text = await r.text()
                return Result(r.status, error=text[:300], latency_s=time.monotonic() - t0)
            if not body.get("stream"):
                doc = await r.json()
                t = time.monotonic() - t0
                usage = doc.get("usage") or {}
                return Result(
                    200,
                    int(usage.get("prompt_tokens", 0)),
                    t,
                    t,
                    prompt_token_ids=list(doc.get("prompt_token_ids") or []),
                )
            ttft = 0.0
            prompt_tokens = 0
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if not ttft and chunk.get("choices"):
                    ttft = time.monotonic() - t0
                usage = chunk.get("usage")
                if usage:
                    prompt_tokens = int(usage.get("prompt_tokens", 0))
            return Result(200, prompt_tokens, ttft, time.monotonic() - t0)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        return Result(0, error=f"{type(e).__name__}: {e}", latency_s=time.monotonic() - t0)


async def run_conversations(
    url: str,
    convs: list[Conversation],
    turns: int,
    order_seed: int,
    stream: bool,
    concurrency: int,
    max_tokens: int,
) -> list[Result]:
    """Every conversation's turns in sequence, conversations interleaved.

    The order (which conversation starts when) is a seeded shuffle; at most `concurrency`
    requests are in flight; a conversation's next turn waits for its previous one."""
    order = list(range(len(convs)))
    random.Random(order_seed).shuffle(order)
    sem = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    conn = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=conn) as session:
        # Tasks queue on the (FIFO) semaphore in the shuffled order; a conversation that
        # finished a turn queues again behind the others.
        async def one(c: Conversation) -> None:
            for t in range(turns):
                async with sem:
                    results.append(await send(session, url, c.body(t, max_tokens, stream)))

        await asyncio.gather(*(one(convs[i]) for i in order))
    return results
