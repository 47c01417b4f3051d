"""Reading `usage` from JSON and SSE responses, bounded, never failing."""

from __future__ import annotations

import json

from hypothesis import example, given
from hypothesis import strategies as st

from scorer.usage import Usage, UsageReader

U = {"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}


def read(ctype: str | None, chunks: list[bytes], **kw: int) -> tuple[Usage | None, str]:
    r = UsageReader(ctype, **kw)
    for c in chunks:
        r.feed(c)
    return r.finish()


def test_json_body_usage() -> None:
    body = json.dumps({"id": "x", "usage": U}).encode()
    assert read("application/json; charset=utf-8", [body[:5], body[5:]]) == (Usage(9, 4, 2), "ok")
    no_details = json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 2}}).encode()
    assert read("application/json", [no_details]) == (Usage(1, 2, None), "ok")
    assert read("application/json", [b'{"id": 1}']) == (None, "absent")
    assert read("application/json", [b"{oops"]) == (None, "malformed")
    assert read("application/json", [b'{"usage": {"prompt_tokens": -1}}']) == (None, "absent")


def test_other_types_empty_and_too_large() -> None:
    assert read("text/plain", [b"hello"]) == (None, "not_json")
    assert read(None, [b"hello"]) == (None, "not_json")
    assert read("application/json", []) == (None, "empty")
    big = json.dumps({"pad": "x" * 5000, "usage": U}).encode()
    assert read("application/json", [big], max_json_bytes=1000) == (None, "too_large")


def sse(events: list[object]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_sse_last_event_usage_with_a_small_tail() -> None:
    events: list[object] = [{"choices": [{"text": "a" * 50}], "usage": None}] * 200
    stream = sse([*events, {"choices": [], "usage": U}])
    chunks = [stream[i : i + 33] for i in range(0, len(stream), 33)]
    assert read("text/event-stream", chunks, tail_bytes=512) == (Usage(9, 4, 2), "ok")
    assert read("text/event-stream", [sse(events)]) == (None, "absent")
    assert read("text/event-stream", [b'data: {"usage": {"prompt_tokens"\n\n']) == (
        None,
        "malformed",
    )


@example(cut=1)
@given(st.integers(1, 400))
def test_sse_any_chunking_gives_the_same_usage(cut: int) -> None:
    stream = sse([{"choices": [], "usage": None}, {"choices": [], "usage": U}]).replace(
        b"\n", b"\r\n"
    )
    chunks = [stream[i : i + cut] for i in range(0, len(stream), cut)]
    assert read("text/event-stream", chunks) == (Usage(9, 4, 2), "ok")
