"""The simulated vLLM worker: an OpenAI-compatible aiohttp server around `Engine`.

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
(what sglang-router probes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvscorer_tools.sim.engine import Engine, RequestRejected, SimRequest
from kvscorer_tools.sim.kvevents import Era, KVEventPublisher, ReplayLayout, SocketMode
from kvscorer_tools.sim.metrics import SimMetrics
from kvscorer_tools.sim.prompts import PromptError, SimTokenizer, load_tokenizer
from kvscorer_tools.sim.timing import TimingModel

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class SimConfig:
    """Settings of one simulated worker (the `kv-scorer sim` flags)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see SimWorker.port)
    model: str = "sim-model"
    loras: tuple[str, ...] = ()  # served LoRA adapter names (lora_id = position + 1)
    block_size: int = 16
    capacity_blocks: int = 32768  # KV pool size in blocks (vLLM num_gpu_blocks)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    speed: float = 1.0  # wall clock runs this many times faster than model time
    seed: int = 0
    kv_events: str | None = None  # ZMQ PUB endpoint, e.g. tcp://*:5557
    kv_events_mode: SocketMode = "auto"  # auto: vLLM's rule (bind on "*", else connect)
    replay: str | None = None  # ZMQ ROUTER replay endpoint, e.g. tcp://*:5558
    era: Era = "map"
    replay_layout: ReplayLayout = "topic"
    topic: str = ""
    data_parallel_rank: int = 0
    tokenizer: str | None = None  # tokenizer.json (or its directory); None: synthetic ids
    vocab_size: int = 32000  # synthetic tokenizer only
    default_max_tokens: int = 16
    timing: TimingModel | None = None  # None: default model at `speed`
    extra: dict[str, Any] = field(default_factory=dict)  # free-form, shown in /server_info


def _error(status: int, message: str, etype: str = "BadRequestError") -> web.Response:
    # vLLM's ErrorResponse in the OpenAI shape.
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    return web.json_response(body, status=status)


class BadRequest(Exception):
    """A client error turned into an OpenAI-shaped JSON response."""

    def __init__(self, message: str, status: int = 400, etype: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.etype = etype


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
            max_model_len=c.max_model_len,
            vocab_size=self.tokenizer.vocab_size,
            timing=self.timing,
            metrics=self.metrics,
            publisher=self.publisher,
            era=c.era,
            seed=c.seed,
        )
        self.started_at = int(time.time())
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
            ("GET", "/v1/models", self._models),
            ("GET", "/health", self._ok),
            ("GET", "/ping", self._ok),
            ("GET", "/health_generate", self._ok),
            ("GET", "/version", self._version),
            ("GET", "/load", self._vllm_load),
            ("GET", "/metrics", self._metrics),
            ("POST", "/reset_prefix_cache", self._reset),
            ("POST", "/flush_cache", self._reset),
            ("POST", "/tokenize", self._tokenize),
            ("POST", "/detokenize", self._detokenize),
            ("POST", "/v1/completions/render", self._render_completion),
            ("POST", "/v1/chat/completions/render", self._render_chat),
            ("GET", "/server_info", self._server_info),
            ("GET", "/get_server_info", self._server_info),
            ("GET", "/model_info", self._model_info),
            ("GET", "/get_model_info", self._model_info),
            ("GET", "/get_load", self._sglang_load),
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

    async def __aenter__(self) -> SimWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- request parsing -------------------------------------------------------------

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _lora(self, body: dict[str, Any]) -> tuple[int | None, str | None]:
        model = body.get("model")
        if model is None or model == self.config.model:
            return None, None
        if model in self.config.loras:
            return self.config.loras.index(model) + 1, str(model)
        raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")

    def _completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            if any(t < 0 or t >= self.tokenizer.vocab_size for t in prompt):
                raise BadRequest(f"token ids must be in [0, {self.tokenizer.vocab_size})")
            return list(prompt)
        if isinstance(prompt, list):
            raise BadRequest("the simulator takes one prompt per request (no batches)")
        raise BadRequest("`prompt` must be a string or a list of token ids")

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list")
        return self.tokenizer.encode_chat(messages, bool(body.get("add_generation_prompt", True)))

    def _max_tokens(self, body: dict[str, Any], *keys: str) -> int:
        for key in keys:
            val = body.get(key)
            if val is not None:
                if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                    raise BadRequest(f"`{key}` must be a positive integer")
                return val
        return self.config.default_max_tokens

    def _new_request(
        self, body: dict[str, Any], prompt: list[int], prefix: str, *keys: str
    ) -> SimRequest:
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest("the simulator supports n=1 only")
        lora_id, lora_name = self._lora(body)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise BadRequest("`cache_salt` must be a string")
        return SimRequest(
            request_id=self.engine.next_id(prefix),
            prompt_ids=prompt,
            max_tokens=self._max_tokens(body, *keys),
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=salt,
        )

    # --- generation ------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._json(request)
            if chat:
                prompt = self._chat_prompt(body)
                req = self._new_request(
                    body, prompt, "chatcmpl", "max_completion_tokens", "max_tokens"
                )
            else:
                prompt = self._completion_prompt(body)
                req = self._new_request(body, prompt, "cmpl", "max_tokens")
            self.engine.submit(req)
        except BadRequest as e:
            return _error(e.status, str(e), e.etype)
        except (PromptError, RequestRejected) as e:
            return _error(400, str(e))
        model = str(body.get("model") or self.config.model)
        try:
            if body.get("stream"):
                opts = body.get("stream_options") or {}
                usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
                return await self._stream(request, req, model, chat=chat, include_usage=usage)
            await req.done.wait()
            return web.json_response(self._full_response(req, model, chat=chat))
        finally:
            # Client gone (cancelled handler or broken pipe): free the engine's resources.
            self.engine.abort(req)

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        out = len(req.output_ids)
        return {
            "prompt_tokens": req.prompt_tokens,
            "total_tokens": req.prompt_tokens + out,
            "completion_tokens": out,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    def _full_response(self, req: SimRequest, model: str, *, chat: bool) -> dict[str, Any]:
        text = self.tokenizer.decode(req.output_ids)
        created = int(time.time())
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        return {
            "id": req.request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": self._usage(req),
            "system_fingerprint": None,
        }

    async def _stream(
        self, request: web.Request, req: SimRequest, model: str, *, chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": req.request_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if include_usage:
                payload["usage"] = usage
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        if chat:  # vLLM's first chat chunk carries the role
            first = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await resp.write(chunk([first]))
        n = 0
        async for tok in req.tokens():
            n += 1
            last = n >= req.max_tokens
            text = self.tokenizer.token_text(tok)
            finish = "length" if last else None
            c: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            if chat:
                c["delta"] = {"content": text}
            else:
                c["text"] = text
            await resp.write(chunk([c]))
        if include_usage:
            await resp.write(chunk([], self._usage(req)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # --- tokenizer endpoints ---------------------------------------------------------

    def _tokens_of(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            return self._chat_prompt(body)
        return self._completion_prompt(body)

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            self._lora(body)
            tokens = self._tokens_of(body)
        except BadRequest as e:
            return _error(e.status, str(e), e.etype)
        except PromptError as e:
            return _error(400, str(e))
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            self._lora(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise BadRequest("`tokens` must be a list of token ids")
        except BadRequest as e:
            return _error(e.status, str(e), e.etype)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    def _generate_request(
        self, body: dict[str, Any], tokens: list[int], prefix: str
    ) -> dict[str, Any]:
        # vLLM's GenerateRequest (the token-in request /inference/v1/generate takes).
        out: dict[str, Any] = {
            "request_id": self.engine.next_id(prefix),
            "model": body.get("model") or self.config.model,
            "token_ids": tokens,
            "sampling_params": {
                "max_tokens": body.get("max_tokens")
                or body.get("max_completion_tokens")
                or self.config.default_max_tokens,
            },
            "stream": bool(body.get("stream", False)),
        }
        if body.get("cache_salt") is not None:
            out["cache_salt"] = body["cache_salt"]
        return out

    async def _render_completion(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            self._lora(body)
            tokens = self._completion_prompt(body)
        except BadRequest as e:
            return _error(e.status, str(e), e.etype)
        except PromptError as e:
            return _error(400, str(e))
        # vLLM answers a list: one GenerateRequest per prompt.
        return web.json_response([self._generate_request(body, tokens, "cmpl")])

    async def _render_chat(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            self._lora(body)
            tokens = self._chat_prompt(body)
        except BadRequest as e:
            return _error(e.status, str(e), e.etype)
        except PromptError as e:
            return _error(400, str(e))
        return web.json_response(self._generate_request(body, tokens, "chatcmpl"))

    # --- info, health, metrics -------------------------------------------------------

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.0+kv-scorer-sim"})

    async def _models(self, request: web.Request) -> web.Response:
        c = self.config

        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": self.started_at,
                "owned_by": "vllm",
                "root": name,
                "parent": parent,
                "max_model_len": c.max_model_len,
            }

        data = [card(c.model, None)] + [card(name, c.model) for name in c.loras]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.engine._update_gauges()
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _reset(self, request: web.Request) -> web.Response:
        # vLLM answers 200 even when the reset is refused (it logs a warning).
        ok = self.engine.reset_prefix_cache()
        return web.Response(status=200, headers={"X-Reset-Prefix-Cache": str(ok).lower()})

    async def _vllm_load(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({"server_load": len(e.running) + len(e.waiting)})

    async def _sglang_load(self, request: web.Request) -> web.Response:
        e = self.engine
        tokens = sum(r.prompt_tokens + len(r.output_ids) for r in e.running)
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": len(e.running),
                    "num_waiting_reqs": len(e.waiting),
                    "num_tokens": tokens,
                }
            ]
        )

    async def _model_info(self, request: web.Request) -> web.Response:
        c = self.config
        return web.json_response(
            {
                "model_path": c.model,
                "tokenizer_path": c.tokenizer or c.model,
                "served_model_name": c.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "max_context_length": c.max_model_len,
                "vocab_size": self.tokenizer.vocab_size,
                "supports_vision": False,
                "model_type": "sim",
                "architectures": ["SimForCausalLM"],
                "eos_token_ids": [],
                "pad_token_id": None,
                "bos_token_id": None,
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        c = self.config
        info: dict[str, Any] = {
            "model_path": c.model,
            "tokenizer_path": c.tokenizer or c.model,
            "served_model_name": c.model,
            "is_generation": True,
            "model_type": "sim",
            "architectures": ["SimForCausalLM"],
            "tp_size": 1,
            "dp_size": 1,
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null",
            "max_batch_size": c.max_num_seqs,
            "max_running_requests": c.max_num_seqs,
            "max_num_reqs": c.max_num_seqs,
            "max_prefill_tokens": c.max_num_batched_tokens,
            "max_total_num_tokens": c.capacity_blocks * c.block_size,
            "page_size": c.block_size,
            "context_length": c.max_model_len,
            "version": "0.0.0+kv-scorer-sim",
            "kv_events": {
                "endpoint": self.events_endpoint,
                "replay": self.replay_endpoint,
                "era": c.era,
                "topic": c.topic,
            },
            **c.extra,
        }
        return web.json_response(info)


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
