"""The load generator: OpenAI completion bodies sent open loop at their arrival times.

TTFT is measured per request on the wall clock (first SSE data line).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvscorer_tools.bench.e2e.settings import MODEL, E2ESettings
from kvscorer_tools.bench.workloads import BenchRequest, Workload

SESSION_HEADER = "x-session-affinity"  # scorer.extproc.protocol.SESSION_HEADER


@dataclass(slots=True)
class LoadResult:
    """What the load generator measured (wall clock)."""

    ttft_s: list[float] = field(default_factory=list)
    # How late each request was sent after its arrival time (the event loop or the
    # concurrency cap behind): large values mean the machine could not keep up with the
    # time scale and the run's latencies say more about the machine than the router.
    send_lag_s: list[float] = field(default_factory=list)
    errors: int = 0
    done: int = 0
    # (prompt key, sent, first token) per answered request, wall clock (breakdown.py).
    records: list[tuple[int, float, float]] = field(default_factory=list)
    first_error: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0


def completion_body(r: BenchRequest, stream: bool = True, text: bool = False) -> dict[str, Any]:
    """An OpenAI /v1/completions body with a token-id prompt.

    `text`: the same prompt as text, one word "t<id>" per token, for routers that accept
    only text prompts (sglang-router); the simulated worker's synthetic tokenizer makes
    one token of each word, so equal prefixes stay equal and lengths do not change.
    """
    ids = r.token_ids()
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": " ".join(f"t{t}" for t in ids) if text else ids,
        "max_tokens": r.output_tokens,
        "ignore_eos": True,  # vLLM extension: generate exactly max_tokens
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


PREENCODE_BYTES = 1 << 30  # bodies encoded ahead of the run, at most (then on the fly)


def prompt_key(r: BenchRequest, text: bool = False) -> int:
    """The key a sim's `--request-log` gives this request: hash() of the token ids the sim
    sees (a text prompt's words go through the sim's synthetic tokenizer)."""
    ids = r.token_ids()
    if text:
        from kvscorer_tools.sim.prompts import load_tokenizer

        ids = load_tokenizer(None, 32000).encode(" ".join(f"t{t}" for t in ids))
    return hash(tuple(ids))


_KEYS: list[tuple[Sequence[BenchRequest], bool, list[int]]] = []


def prompt_keys(requests: Sequence[BenchRequest], text: bool = False) -> list[int]:
    """prompt_key of every request, cached for the same request list (as the bodies)."""
    for reqs, t, keys in _KEYS:
        if reqs is requests and t == text:
            return keys
    out = [prompt_key(r, text) for r in requests]
    _KEYS.append((requests, text, out))
    del _KEYS[:-_ENCODED_KEEP]
    return out


def encode_body(r: BenchRequest, text: bool = False) -> bytes:
    """The JSON body of `r` (see completion_body)."""
    return json.dumps(completion_body(r, text=text)).encode()


# The last workloads' encoded bodies: every policy and repeat of a run sends the same ones,
# and encoding a long trace's token ids takes seconds (~20 ms per Mooncake request).
_ENCODED: list[tuple[Sequence[BenchRequest], bool, list[bytes | None]]] = []
_ENCODED_KEEP = 2


def encoded_bodies(requests: Sequence[BenchRequest], text: bool = False) -> list[bytes | None]:
    """The requests' bodies (encode_body), up to PREENCODE_BYTES in all (None after that:
    encoded when sent); cached for the same request list."""
    for reqs, t, bodies in _ENCODED:
        if reqs is requests and t == text:
            return bodies
    out: list[bytes | None] = [None] * len(requests)
    size = 0
    for i, r in enumerate(requests):
        if size > PREENCODE_BYTES:
            break
        b = encode_body(r, text)
        out[i] = b
        size += len(b)
    _ENCODED.append((requests, text, out))
    del _ENCODED[:-_ENCODED_KEEP]
    return out


async def _one(
    http: aiohttp.ClientSession,
    url: str,
    r: BenchRequest,
    res: LoadResult,
    timeout_s: float,
    text: bool = False,
    data: bytes | None = None,
    key: int | None = None,
) -> None:
    headers = {"content-type": "application/json"}
    if r.session:
        headers[SESSION_HEADER] = r.session
    if data is None:
        data = encode_body(r, text)
    t0 = time.perf_counter()
    first: float | None = None
    try:
        async with http.post(
            url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                detail = (await resp.text())[:200]
                raise RuntimeError(f"HTTP {resp.status}: {detail}")
            async for line in resp.content:
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    first = time.perf_counter()
                    break
            if first is None:
                raise RuntimeError("stream ended without a token")
            # The rest only has to be read to the end (closing early would abort the
            # request and free its KV blocks): in big chunks, not line by line, so the
            # load generator's CPU stays off the sims' and Envoy's two cores.
            async for _chunk in resp.content.iter_any():
                pass
    except (aiohttp.ClientError, TimeoutError, RuntimeError) as e:
        res.errors += 1
        if res.first_error is None:
            res.first_error = f"{type(e).__name__}: {e}"
        return
    res.ttft_s.append(first - t0)
    res.done += 1
    if key is not None:
        res.records.append((key, t0, first))


async def generate_load(
    url: str,
    requests: Sequence[BenchRequest],
    concurrency: int,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
    text: bool = False,
    keys: Sequence[int] | None = None,
) -> LoadResult:
    """Send every request at its arrival time (open loop, at most `concurrency` in flight).

    TTFT = first SSE data line - request start (wall clock). Bodies are encoded before
    the clock starts (up to PREENCODE_BYTES), so building a burst of big prompts does not
    hold the event loop while responses wait to be read.
    """
    res = LoadResult()
    bodies = list(encoded_bodies(requests, text))  # a copy: sent bodies are dropped below
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    total = len(requests)
    finished = 0

    async with aiohttp.ClientSession(connector=conn) as http:
        res.t_start = time.perf_counter()

        async def fire(i: int, r: BenchRequest) -> None:
            nonlocal finished
            delay = res.t_start + r.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                res.send_lag_s.append(max(time.perf_counter() - res.t_start - r.arrival_s, 0.0))
                key = keys[i] if keys is not None else None
                await _one(http, url, r, res, timeout_s, text, bodies[i], key)
                bodies[i] = None
            finished += 1
            if progress is not None:
                progress(finished, total)

        await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests)))
        res.t_end = time.perf_counter()
    return res


def progress_printer(name: str) -> Callable[[int, int], None]:
    """A one-line progress display (no tqdm dependency): `kv  [#####-----] 40/100`."""
    last = [-1.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if done != total and now - last[0] < 0.25:
            return
        last[0] = now
        width = 30
        fill = int(width * done / max(total, 1))
        bar = "#" * fill + "-" * (width - fill)
        end = "\n" if done == total else ""
        print(f"\r  {name:<22} [{bar}] {done}/{total}", end=end, flush=True)

    return show


def run_load(
    url: str, wl: Workload, settings: E2ESettings, name: str, text: bool = False
) -> LoadResult:
    """Run the load generator to completion (its own event loop)."""
    prog = progress_printer(name) if settings.progress else None
    keys = prompt_keys(wl.requests, text) if settings.request_log else None
    return asyncio.run(
        generate_load(
            url, wl.requests, settings.concurrency, settings.request_timeout_s, prog, text, keys
        )
    )
