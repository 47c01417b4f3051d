"""The one error shape every client of kv-scorer sees: the OpenAI API error object.

`{"error": {"message", "type", "param", "code"}}` (OpenAI API reference, "Error codes").
Used for the data path's refusals (ImmediateResponse bodies) and for every admin
endpoint's 4xx, so a client parses one shape whatever it called.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_encoder = msgspec.json.Encoder()

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object for an HTTP `status`."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    """The OpenAI error object as JSON bytes."""
    return _encoder.encode(openai_error(status, message, param, code))


def json_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> web.Response:
    """An aiohttp JSON response carrying the OpenAI error object (admin endpoints)."""
    return web.Response(
        body=error_body(status, message, param, code),
        status=status,
        content_type="application/json",
    )
