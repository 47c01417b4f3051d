"""Request-supplied chat templates: ignored unless allowed; when allowed, rendered off the
event loop within a time and an output budget. Heavy prompts never run on the loop."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from configs import run_on_default_loop
from prometheus_client import REGISTRY
from tokens_helpers import QWEN3, make_tokens

from scorer.routing import RoutingRequest
from scorer.tokens import Tokenization
from scorer.tokens.service import TokenizeError

MSGS = [{"role": "user", "content": "hello"}]


def outcome(name: str) -> float:
    v = REGISTRY.get_sample_value(
        "kv_scorer_tokens_request_chat_templates_total", {"outcome": name}
    )
    return 0.0 if v is None else v


@pytest.fixture(scope="module")
def default_tokens() -> Iterator[Tokenization]:
    t = make_tokens({"qwen3": QWEN3})
    yield t
    t.close()


@pytest.fixture(scope="module")
def trusting() -> Iterator[Tokenization]:
    t = make_tokens(
        {"qwen3": QWEN3},
        allow_request_chat_template=True,
        request_template_timeout_s=0.3,
        request_template_max_chars=1 << 20,
    )
    yield t
    t.close()


def test_request_template_is_ignored_by_default(default_tokens: Tokenization) -> None:
    before = outcome("ignored")
    plain = default_tokens.tokenize_body("qwen3", {"messages": MSGS})
    hostile = default_tokens.tokenize_body(
        "qwen3", {"messages": MSGS, "chat_template": "{{ 'a' * 200000000 }}"}
    )
    assert hostile.token_ids == plain.token_ids  # the model's own template was used
    assert hostile.stats["request_template_ignored"] == 1
    assert outcome("ignored") - before == 1
    # A name of one of the tokenizer's own templates is not request code: honoured.
    named = default_tokens.tokenize_body("qwen3", {"messages": MSGS, "chat_template": "default"})
    assert named.token_ids == plain.token_ids and "request_template_ignored" not in named.stats


HOSTILE = [
    "{{ 'a' * 200000000 }}",  # the 130-byte request that held the loop 294 s and 13 GB
    "{{ [1] * 200000000 }}",
    "{{ 10 ** 200000000 }}",
    "{{ 'a'.center(200000000) }}",
    "{{ 'a'|center(200000000) }}",
    "{{ 'a'|indent(200000000) }}",
    # nested loops: 10^10 steps without output (the time budget ends them)
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # 100 MB of output in small pieces (the output budget ends it)
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_allowed_request_template_is_held_to_its_budget(
    trusting: Tokenization, template: str
) -> None:
    before = outcome("over_budget")
    tracemalloc.start()
    try:
        with pytest.raises(TokenizeError, match=r"budget|time|output"):
            trusting.tokenize_body("qwen3", {"messages": MSGS, "chat_template": template})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"rendering peaked at {peak} bytes"
    assert outcome("over_budget") - before == 1
    # A normal request still renders afterwards.
    body = {"messages": MSGS, "chat_template": "{{ messages[0]['content'] }}!"}
    assert trusting.render("qwen3", body) == "hello!"


def test_allowed_request_template_renders(trusting: Tokenization) -> None:
    text = trusting.render(
        "qwen3",
        {
            "messages": MSGS,
            "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% endfor %}{{ 'ok' * 3 }}",
        },
    )
    assert text == "<user>hellookokok"


def _loop_thread_ids(tokens: Tokenization, body: dict[str, Any], prompt_tokens: int) -> set[int]:
    """Threads the tokens stage ran in for `body` (recorded around `_fill`, the work that
    `prepare` runs inline or in the pool)."""
    seen: set[int] = set()
    real = tokens._fill

    def spy(request: RoutingRequest, model: Any, doc: Any) -> str:
        seen.add(threading.get_ident())
        return real(request, model, doc)

    tokens._fill = spy  # type: ignore[method-assign]
    try:
        req = RoutingRequest(request_id="t", model="qwen3", body=body)
        req.prompt_tokens = prompt_tokens
        run_on_default_loop(tokens.prepare(req))
        assert req.token_ids is not None or req.tokenize_error is not None
    finally:
        del tokens._fill
    return seen


def test_heavy_work_leaves_the_event_loop(trusting: Tokenization) -> None:
    main = threading.get_ident()
    # A small token-id prompt is hashed inline: cheaper than a thread hop.
    assert _loop_thread_ids(trusting, {"prompt": list(range(100))}, 100) == {main}
    # So is a conversation-length one (the pool hop cost 10-15 ms wall under load).
    assert _loop_thread_ids(trusting, {"prompt": list(range(20_000))}, 20_000) == {main}
    # A large one goes to the pool (a 29 MB id prompt once stalled everything 2.3 s).
    assert main not in _loop_thread_ids(trusting, {"prompt": list(range(50_000))}, 50_000)
    # A small body with a template of its own: request code, always in the pool.
    body = {"messages": MSGS, "chat_template": "{{ messages[0]['content'] }}"}
    assert main not in _loop_thread_ids(trusting, body, 20)
