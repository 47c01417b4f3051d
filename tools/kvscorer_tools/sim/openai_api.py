"""The OpenAI wire format of the simulated worker: request bodies in, vLLM's responses out.

Parsing turns a /v1/completions or /v1/chat/completions body into a `SimRequest` (or a
`BadRequest` answered in vLLM's OpenAI error shape); the response helpers write vLLM's
JSON and SSE shapes (`usage.prompt_tokens_details.cached_tokens` included).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvscorer_tools.sim.config import SimConfig
from kvscorer_tools.sim.engine import SimRequest
from kvscorer_tools.sim.prompts import SimTokenizer


def error_response(status: int, message: str, etype: str = "BadRequestError") -> web.Response:
    """vLLM's ErrorResponse in the OpenAI shape."""
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    return web.json_response(body, status=status)


class BadRequest(Exception):
    """A client error turned into an OpenAI-shaped JSON response."""

    def __init__(self, message: str, status: int = 400, etype: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.etype = etype


class OpenAIRequests:
    """Parses and validates OpenAI request bodies for one worker's model and LoRAs."""

    def __init__(
        self, config: SimConfig, tokenizer: SimTokenizer, next_id: Callable[[str], str]
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.next_id = next_id

    async def body(self, request: web.Request) -> dict[str, Any]:
        """The JSON object of the request body (BadRequest otherwise)."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def lora(self, body: dict[str, Any]) -> tuple[int | None, str | None]:
        """(lora_id, lora_name) of the body's `model`; (None, None) for the base model."""
        model = body.get("model")
        if model is None or model == self.config.model:
            return None, None
        if model in self.config.loras:
            return self.config.loras.index(model) + 1, str(model)
        raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")

    def completion_prompt(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a /v1/completions `prompt` (text or ids; one prompt)."""
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

    def chat_prompt(self, body: dict[str, Any]) -> list[int]:
        """Token ids of /v1/chat/completions `messages` (rendered by the tokenizer)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list")
        return self.tokenizer.encode_chat(messages, bool(body.get("add_generation_prompt", True)))

    def max_tokens(self, body: dict[str, Any], *keys: str) -> int:
        """The first of `keys` present (a positive int), else the configured default."""
        for key in keys:
            val = body.get(key)
            if val is not None:
                if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                    raise BadRequest(f"`{key}` must be a positive integer")
                return val
        return self.config.default_max_tokens

    def new_request(
        self, body: dict[str, Any], prompt: list[int], prefix: str, *keys: str
    ) -> SimRequest:
        """The engine request for a validated body (n=1, LoRA, cache_salt, max tokens)."""
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest("the simulator supports n=1 only")
        lora_id, lora_name = self.lora(body)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise BadRequest("`cache_salt` must be a string")
        return SimRequest(
            request_id=self.next_id(prefix),
            prompt_ids=prompt,
            max_tokens=self.max_tokens(body, *keys),
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=salt,
        )

    def tokens_of(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a completions or chat body (by whether it has `messages`)."""
        if "messages" in body:
            return self.chat_prompt(body)
        return self.completion_prompt(body)


# --- responses ---------------------------------------------------------------------


def usage(req: SimRequest) -> dict[str, Any]:
    """vLLM's `usage`, with `prompt_tokens_details.cached_tokens` (the prefix hit)."""
    out = len(req.output_ids)
    return {
        "prompt_tokens": req.prompt_tokens,
        "total_tokens": req.prompt_tokens + out,
        "completion_tokens": out,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


def full_response(req: SimRequest, model: str, text: str, *, chat: bool) -> dict[str, Any]:
    """The non-streaming completion (or chat completion) body, `text` being the output."""
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
        "usage": usage(req),
        "system_fingerprint": None,
    }


async def stream(
    request: web.Request,
    req: SimRequest,
    model: str,
    token_text: Callable[[int], str],
    *,
    chat: bool,
    include_usage: bool,
    interval: int = 1,
) -> web.StreamResponse:
    """vLLM's SSE stream: one chunk per token, the usage chunk when asked, then [DONE].

    With `interval` > 1 a chunk carries every token produced since the last one (the first
    token always alone), as vLLM's `--stream-interval` does.
    """
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], totals: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": req.request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = totals
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
    ended = False
    while not ended:
        tok = await req.queue.get()
        if tok is None:
            break
        toks = [tok]
        # --stream-interval > 1: the tokens already produced go out as one chunk (vLLM's
        # stream_interval); the first token always goes alone, so TTFT is not delayed.
        while n > 0 and interval > 1 and not req.queue.empty():
            more = req.queue.get_nowait()
            if more is None:
                ended = True
                break
            toks.append(more)
        n += len(toks)
        last = n >= req.max_tokens
        text = "".join(token_text(t) for t in toks)
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
        await resp.write(chunk([], usage(req)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
