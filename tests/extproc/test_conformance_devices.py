"""The conformance picker's test devices: off by default, selection header semantics."""

from __future__ import annotations

import json
from typing import Any

from extproc_helpers import body_msg, headers_msg, lb_metadata

from scorer.extproc.conformance import SELECTION_HEADER, restrict, selection

PAIRS = [("10.0.0.1:3000", "10.0.0.1"), ("10.0.0.1:3002", "10.0.0.1"), ("[fd00::1]:80", "fd00::1")]


def test_selection_parses_ip_and_ip_port_entries() -> None:
    assert selection({}) is None
    assert selection({SELECTION_HEADER: ""}) == frozenset()  # present, empty: nothing
    got = selection({SELECTION_HEADER: " 10.0.0.1 , 10.0.0.2:3002,[fd00::1],[fd00::2]:80,"})
    assert got == {"10.0.0.1", "10.0.0.2:3002", "fd00::1", "[fd00::2]:80"}
    many = ",".join(f"10.1.0.{i}" for i in range(200))
    assert len(selection({SELECTION_HEADER: many}) or ()) == 64  # bounded


def test_restrict_combines_hint_and_selection() -> None:
    sel = frozenset({"10.0.0.1:3002", "fd00::1"})
    assert restrict(None, None, PAIRS) is None
    assert restrict(None, sel, PAIRS) == sel
    assert restrict(frozenset({"10.0.0.1"}), None, PAIRS) == {"10.0.0.1"}
    # Both: the pool's endpoints allowed by each.
    assert restrict(frozenset({"10.0.0.1"}), sel, PAIRS) == {"10.0.0.1:3002"}
    assert restrict(frozenset({"10.0.0.9"}), sel, PAIRS) == frozenset()


async def route(h: Any, headers: dict[str, str]) -> Any:
    call = h.stream()
    await call.write(headers_msg(headers))
    await call.write(body_msg(json.dumps({"model": "m", "prompt": "p"}).encode(), True))
    resp = await call.read()
    call.cancel()
    return resp


async def test_selection_header_is_ignored_unless_enabled(harness: Any) -> None:
    h = await harness()
    resp = await route(h, {SELECTION_HEADER: "10.9.9.9"})
    assert lb_metadata(resp)  # routed: the header means nothing by default
    h2 = await harness(extproc={"test_endpoint_selection": True})
    resp = await route(h2, {SELECTION_HEADER: "127.0.0.2"})
    assert lb_metadata(resp) == "127.0.0.2:7003"
    resp = await route(h2, {SELECTION_HEADER: "10.9.9.9"})
    assert resp.immediate_response.status.code == 503
