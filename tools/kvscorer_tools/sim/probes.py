"""Everything routers ask a simulated worker besides generation.

Health, models, load, metrics, prefix-cache reset; tokenization and request rendering
(vllm-router `kv_aware`); the server/model info sglang-router probes. Shapes are vLLM's
and SGLang's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvscorer_tools.sim.openai_api import BadRequest, OpenAIRequests, error_response
from kvscorer_tools.sim.prompts import PromptError

if TYPE_CHECKING:
    from kvscorer_tools.sim.worker import SimWorker

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProbeRoutes:
    """The non-generation endpoints of one `SimWorker`."""

    def __init__(self, worker: SimWorker, parse: OpenAIRequests) -> None:
        self.worker = worker
        self.parse = parse

    def routes(self) -> list[tuple[str, str, Handler]]:
        """(method, path, handler) of every endpoint here."""
        return [
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
            ("GET", "/debug/kv_cache", self._kv_cache),
        ]

    # --- tokenizer endpoints ---------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self.parse.body(request)
            self.parse.lora(body)
            tokens = self.parse.tokens_of(body)
        except BadRequest as e:
            return error_response(e.status, str(e), e.etype)
        except PromptError as e:
            return error_response(400, str(e))
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.worker.config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self.parse.body(request)
            self.parse.lora(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise BadRequest("`tokens` must be a list of token ids")
        except BadRequest as e:
            return error_response(e.status, str(e), e.etype)
        return web.json_response({"prompt": self.worker.tokenizer.decode(tokens)})

    def _generate_request(
        self, body: dict[str, Any], tokens: list[int], prefix: str
    ) -> dict[str, Any]:
        # vLLM's GenerateRequest (the token-in request /inference/v1/generate takes).
        out: dict[str, Any] = {
            "request_id": self.worker.engine.next_id(prefix),
            "model": body.get("model") or self.worker.config.model,
            "token_ids": tokens,
            "sampling_params": {
                "max_tokens": body.get("max_tokens")
                or body.get("max_completion_tokens")
                or self.worker.config.default_max_tokens,
            },
            "stream": bool(body.get("stream", False)),
        }
        if body.get("cache_salt") is not None:
            out["cache_salt"] = body["cache_salt"]
        return out

    async def _render_completion(self, request: web.Request) -> web.Response:
        try:
            body = await self.parse.body(request)
            self.parse.lora(body)
            tokens = self.parse.completion_prompt(body)
        except BadRequest as e:
            return error_response(e.status, str(e), e.etype)
        except PromptError as e:
            return error_response(400, str(e))
        # vLLM answers a list: one GenerateRequest per prompt.
        return web.json_response([self._generate_request(body, tokens, "cmpl")])

    async def _render_chat(self, request: web.Request) -> web.Response:
        try:
            body = await self.parse.body(request)
            self.parse.lora(body)
            tokens = self.parse.chat_prompt(body)
        except BadRequest as e:
            return error_response(e.status, str(e), e.etype)
        except PromptError as e:
            return error_response(400, str(e))
        return web.json_response(self._generate_request(body, tokens, "chatcmpl"))

    # --- info, health, metrics -------------------------------------------------------

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.0+kv-scorer-sim"})

    async def _models(self, request: web.Request) -> web.Response:
        c = self.worker.config

        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": self.worker.started_at,
                "owned_by": "vllm",
                "root": name,
                "parent": parent,
                "max_model_len": c.max_model_len,
            }

        data = [card(c.model, None)] + [card(name, c.model) for name in c.loras]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.worker.engine._update_gauges()
        return web.Response(
            body=self.worker.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _reset(self, request: web.Request) -> web.Response:
        # vLLM answers 200 even when the reset is refused (it logs a warning).
        ok = self.worker.engine.reset_prefix_cache()
        return web.Response(status=200, headers={"X-Reset-Prefix-Cache": str(ok).lower()})

    async def _kv_cache(self, request: web.Request) -> web.Response:
        # Ours: what the engine's prefix cache holds (pinned and evictable), the truth an
        # index built from this worker's KV events is checked against (bench/chaos.py).
        cache = self.worker.engine.cache
        body: dict[str, Any] = {"blocks": len(cache), "block_size": cache.block_size}
        if request.query.get("hashes") in ("1", "true"):
            body["block_hashes"] = cache.cached_hashes()
        return web.json_response(body)

    async def _vllm_load(self, request: web.Request) -> web.Response:
        e = self.worker.engine
        return web.json_response({"server_load": len(e.running) + len(e.waiting)})

    async def _sglang_load(self, request: web.Request) -> web.Response:
        e = self.worker.engine
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
        c = self.worker.config
        return web.json_response(
            {
                "model_path": c.model,
                "tokenizer_path": c.tokenizer or c.model,
                "served_model_name": c.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "max_context_length": c.max_model_len,
                "vocab_size": self.worker.tokenizer.vocab_size,
                "supports_vision": False,
                "model_type": "sim",
                "architectures": ["SimForCausalLM"],
                "eos_token_ids": [],
                "pad_token_id": None,
                "bos_token_id": None,
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        c = self.worker.config
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
                "endpoint": self.worker.events_endpoint,
                "replay": self.worker.replay_endpoint,
                "era": c.era,
                "topic": c.topic,
            },
            **c.extra,
        }
        return web.json_response(info)
