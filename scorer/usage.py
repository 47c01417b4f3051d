"""The `usage` of an OpenAI-style response, read while the response streams past.

Nothing here holds a chunk back: the data path forwards every chunk first and feeds a copy
here. Memory is bounded per response:

- JSON (`application/json`): the body is kept up to `max_json_bytes` and decoded once at
  the end; `usage` is a top-level object (OpenAI API reference, "The completion object").
- SSE (`text/event-stream`): only the tail is kept (the last `tail_bytes`); at the end the
  last `data:` event carrying a JSON object with a non-null `usage` is decoded (vLLM and
  OpenAI send it in the final chunk with `stream_options.include_usage`).
- Anything else, a body over the bound, or bytes that do not decode: no usage, counted by
  outcome; the response itself is never touched.

Fields: `prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()

# Outcomes (metric label values of kv_scorer_response_usage_total).
OK = "ok"  # usage found
ABSENT = "absent"  # a JSON or SSE body without usage
MALFORMED = "malformed"  # JSON / SSE data that does not decode
NOT_JSON = "not_json"  # another content type (or none)
TOO_LARGE = "too_large"  # a JSON body over max_json_bytes
EMPTY = "empty"  # no body at all
OUTCOMES = (OK, ABSENT, MALFORMED, NOT_JSON, TOO_LARGE, EMPTY)


@dataclass(slots=True, frozen=True)
class Usage:
    """Token counts of one response."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def usage_of(doc: Any) -> Usage | None:
    """The usage of a decoded response object, or None."""
    if not isinstance(doc, dict):
        return None
    u = doc.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    got = Usage(_int(u.get("prompt_tokens")), _int(u.get("completion_tokens")), cached)
    if got.prompt_tokens is None and got.completion_tokens is None:
        return None
    return got


class UsageReader:
    """Feed a response's chunks; `finish()` returns (usage or None, outcome)."""

    __slots__ = ("_chunks", "_kind", "_max_json", "_size", "_tail", "body_bytes", "chunks")

    def __init__(
        self, content_type: str | None, max_json_bytes: int = 4 << 20, tail_bytes: int = 64 << 10
    ) -> None:
        ct = (content_type or "").lower()
        if "text/event-stream" in ct:
            self._kind = "sse"
        elif "json" in ct:
            self._kind = "json"
        else:
            self._kind = "other"
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._max_json = max_json_bytes
        self._tail = tail_bytes
        self.chunks = 0  # chunks seen
        self.body_bytes = 0  # bytes seen

    @property
    def streaming(self) -> bool:
        """True for an SSE response."""
        return self._kind == "sse"

    def feed(self, data: bytes) -> None:
        """One response body chunk (kept only as far as the bound allows)."""
        self.chunks += 1
        self.body_bytes += len(data)
        if not data or self._kind == "other":
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._kind == "sse":
            # Keep the tail: drop whole chunks from the front while the rest covers it.
            while self._size - len(self._chunks[0]) >= self._tail:
                self._size -= len(self._chunks.popleft())
        elif self._size > self._max_json:
            self._kind = "too_large"
            self._chunks.clear()
            self._size = 0

    def finish(self) -> tuple[Usage | None, str]:
        """Decode what was kept. Called once, at the end of the response."""
        kind = self._kind
        if self.body_bytes == 0:
            return None, EMPTY
        if kind == "other":
            return None, NOT_JSON
        if kind == "too_large":
            return None, TOO_LARGE
        body = b"".join(self._chunks)
        self._chunks.clear()
        if kind == "json":
            try:
                doc = _decoder.decode(body)
            except (msgspec.DecodeError, UnicodeDecodeError):
                return None, MALFORMED
            u = usage_of(doc)
            return u, OK if u is not None else ABSENT
        return _last_sse_usage(body)


def _last_sse_usage(tail: bytes) -> tuple[Usage | None, str]:
    """The usage of the last SSE `data:` event that has one (events end at a blank line)."""
    malformed = False
    for event in reversed(tail.replace(b"\r\n", b"\n").split(b"\n\n")):
        data = b"".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data or data == b"[DONE]" or b'"usage"' not in data:
            continue
        try:
            doc = _decoder.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            malformed = True  # e.g. the first event of the tail, cut in the middle
            continue
        u = usage_of(doc)
        if u is not None:
            return u, OK
    return None, MALFORMED if malformed else ABSENT
