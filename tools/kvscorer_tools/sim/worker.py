"""The simulated vLLM worker: an aiohttp server around `Engine` (lifecycle, generation).

    worker = SimWorker(SimConfig(port=0, kv_events="tcp://127.0.0.1:0", kv_events_mode="bind"))
    await worker.start()          # worker.port, worker.events_endpoint: actual bound addresses
    ...
    await worker.stop()

Endpoints (vLLM's shapes unless noted): POST /v1/completions, /v1/chat/completions (SSE
streaming or JSON, `usage` with `prompt_tokens_details.cached_tokens`,
`stream_options.include_usage`), GET /v1/models, /health, /ping, /version, /load, /metrics,
POST /reset_prefix_cache, /tokenize, /detokenize, /v1/completions/render,
/v1/chat/completions/render (vllm-router kv_aware); GET /server_info, /get_server_info,
/model_info, /get_model_info, /get_load, /health_generate and POST /flush_cache
(what sglang-router probes). Ours: GET /debug/kv_cache (`?hashes=1` lists them): what
the prefix cache holds, to check an index built from the events against.

Request parsing and response shapes: openai_api.py; the other endpoints: probes.py;
settings: config.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import IO, Any

from aiohttp import web

from kvscorer_tools.sim.config import SimConfig
from kvscorer_tools.sim.engine import Engine, RequestRejected, SimRequest
from kvscorer_tools.sim.kvevents import KVEventPublisher
from kvscorer_tools.sim.metrics import SimMetrics
from kvscorer_tools.sim.openai_api import (
    BadRequest,
    OpenAIRequests,
    error_response,
    full_response,
    stream,
)
from kvscorer_tools.sim.probes import Handler, ProbeRoutes
from kvscorer_tools.sim.prompts import PromptError, SimTokenizer, load_tokenizer
from kvscorer_tools.sim.timing import TimingModel

__all__ = ["SimConfig", "SimWorker", "running_workers"]

log = logging.getLogger(__name__)


class SimWorker:
    """One simulated vLLM server: HTTP API, engine loop, KV-event publisher."""

    def __init__(self, config: SimConfig) -> None:
        self.config = c = config
        self.timing = c.timing if c.timing is not None else TimingModel(speed=c.speed)
        self.tokenizer: SimTokenizer = load_tokenizer(c.tokenizer, c.vocab_size)
        self.metrics = SimMetrics(c.model, c.block_size, c.capacity_blocks, len(c.loras))
        self.publisher: KVEventPublisher | None = None
        if c.kv_events is not None or c.replay is not None:
            self.publisher = KVEventPublisher(
                c.kv_events,
                c.replay,
                era=c.era,
                replay_layout=c.replay_layout,
                topic=c.topic,
                data_parallel_rank=c.data_parallel_rank,
                mode=c.kv_events_mode,
            )
        self.engine = Engine(
            block_size=c.block_size,
            capacity_blocks=c.capacity_blocks,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            max_model_len=c.max_model_len,
            vocab_size=self.tokenizer.vocab_size,
            timing=self.timing,
            metrics=self.metrics,
            publisher=self.publisher,
            era=c.era,
            stream_interval=c.stream_interval,
            seed=c.seed,
        )
        self._request_log: IO[str] | None = None
        if c.request_log is not None:
            # Line-buffered: a reader (the benchmark) sees every finished line at once.
            self._request_log = open(c.request_log, "a", buffering=1)  # noqa: SIM115
            self.engine.on_first_token = self._log_request
        self.started_at = int(time.time())
        self.parse = OpenAIRequests(c, self.tokenizer, self.engine.next_id)
        self._runner: web.AppRunner | None = None
        self.port: int = c.port

    # --- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """host:port, as the scorer and Envoy address the worker."""
        return f"{self.config.host}:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        """Actual PUB address (port resolved when bound to port 0)."""
        return self.publisher.bound_endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        """Actual ROUTER replay address."""
        return self.publisher.bound_replay_endpoint if self.publisher else None

    def describe(self) -> str:
        """One line naming every endpoint (printed by `kv-scorer sim` when ready)."""
        parts = [f"sim ready: http={self.url}", f"model={self.config.model}"]
        if self.events_endpoint:
            parts.append(f"kv_events={self.events_endpoint}")
        if self.replay_endpoint:
            parts.append(f"replay={self.replay_endpoint}")
        parts.append(f"era={self.config.era}")
        parts.append(f"block_size={self.config.block_size}")
        parts.append(f"capacity_blocks={self.config.capacity_blocks}")
        return " ".join(parts)

    def app(self) -> web.Application:
        """The aiohttp application (routes only; `start` runs it)."""
        app = web.Application(client_max_size=256 * 1024 * 1024)
        routes: list[tuple[str, str, Handler]] = [
            ("POST", "/v1/completions", self._completions),
            ("POST", "/v1/chat/completions", self._chat),
            *ProbeRoutes(self, self.parse).routes(),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    async def start(self) -> None:
        """Open the event sockets, start the engine, serve HTTP."""
        if self.publisher is not None:
            await self.publisher.start()
        self.engine.start()
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port, reuse_address=True)
        await site.start()
        self._runner = runner
        addrs = runner.addresses  # actual (host, port) pairs, so port 0 resolves
        if addrs:
            self.port = int(addrs[0][1])

    async def stop(self) -> None:
        """Stop serving, end the engine (open requests are aborted), close sockets."""
        await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.publisher is not None:
            await self.publisher.stop()
        if self._request_log is not None:
            self._request_log.close()
            self._request_log = None

    def _log_request(self, req: SimRequest, start: float, end: float) -> None:
        """One `--request-log` line: wall-clock (monotonic) times, model-time TTFT."""
        if self._request_log is None:
            return
        line = {
            # hash() of a tuple of ints is the same in every process (no hash seed), so
            # the load generator can find its own requests by their token ids.
            "key": hash(tuple(req.prompt_ids)),
            "prompt_tokens": req.prompt_tokens,
            "cached_tokens": req.cached_tokens,
            "waiting": req.ahead[0],
            "running": req.ahead[1],
            "arrival": req.arrival,
            "admitted": start,
            "first": end,
            "ttft_ms": (req.ttft_s or 0.0) * 1000.0,
        }
        self._request_log.write(json.dumps(line) + "\n")

    async def __aenter__(self) -> SimWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- generation ------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self.parse.body(request)
            if chat:
                prompt = self.parse.chat_prompt(body)
                req = self.parse.new_request(
                    body, prompt, "chatcmpl", "max_completion_tokens", "max_tokens"
                )
            else:
                prompt = self.parse.completion_prompt(body)
                req = self.parse.new_request(body, prompt, "cmpl", "max_tokens")
            self.engine.submit(req)
        except BadRequest as e:
            return error_response(e.status, str(e), e.etype)
        except (PromptError, RequestRejected) as e:
            return error_response(400, str(e))
        model = str(body.get("model") or self.config.model)
        try:
            if body.get("stream"):
                opts = body.get("stream_options") or {}
                usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
                return await stream(
                    request,
                    req,
                    model,
                    self.tokenizer.token_text,
                    chat=chat,
                    include_usage=usage,
                    interval=self.config.stream_interval,
                )
            await req.done.wait()
            text = self.tokenizer.decode(req.output_ids)
            return web.json_response(full_response(req, model, text, chat=chat))
        finally:
            # Client gone (cancelled handler or broken pipe): free the engine's resources.
            self.engine.abort(req)


@contextlib.asynccontextmanager
async def running_workers(configs: list[SimConfig]) -> Any:
    """Start several workers in this process; stops every one that started, always."""
    workers: list[SimWorker] = []
    try:
        for cfg in configs:
            w = SimWorker(cfg)
            workers.append(w)
            await w.start()
        yield workers
    finally:
        for w in reversed(workers):
            with contextlib.suppress(Exception):
                await w.stop()
