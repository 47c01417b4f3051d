"""The per-request metric hooks: `observe_completion` records what `observe_request` of the
same request records (its children cached per model), `observe_decision` what its
definition says, and the director's kv_scorer_response_tokens_total series leave with
their worker."""

from __future__ import annotations

import json
from typing import Any

import pytest
from configs import run_on_default_loop
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from scorer.api.inference_metrics import RequestRecord, observe_completion, observe_request
from scorer.config import WorkerConfig, load_config
from scorer.director import Completion, Director
from scorer.policy.base import PolicyContext, build_policy
from scorer.policy.metrics import observe_decision
from scorer.pool.workers import Pool
from scorer.routing import Decision, Reason

EP = "127.0.0.1:7101"
EP2 = "127.0.0.1:7102"


def snapshot(prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name.startswith(prefix) and not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    # New series count from zero (a series made but not moved shows as 0.0).
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def record_of(c: Completion) -> RequestRecord:
    """The RequestRecord the hook used to build (the reference)."""
    return RequestRecord(
        model=c.model or "",
        routed=c.routed,
        status=c.status or 0,
        from_model_server=c.from_model_server,
        duration_s=c.duration_s,
        request_bytes=c.request_bytes,
        response_bytes=c.response_bytes,
        input_tokens=c.input_tokens,
        output_tokens=c.output_tokens,
        cached_tokens=c.cached_tokens,
    )


_opt_int = st.one_of(st.none(), st.integers(0, 10**6))


@settings(max_examples=scaled(60))
@given(
    model=st.sampled_from([None, "", "hook-model-a", "hook-model-b"]),
    routed=st.booleans(),
    status=st.sampled_from([None, 0, 200, 204, 400, 413, 429, 500, 503]),
    from_server=st.booleans(),
    duration=st.one_of(st.none(), st.floats(-1.0, 100.0)),
    request_bytes=_opt_int,
    response_bytes=_opt_int,
    tokens=st.tuples(_opt_int, _opt_int, _opt_int),
)
@example(
    model="hook-model-a",
    routed=True,
    status=200,
    from_server=True,
    duration=0.5,
    request_bytes=1000,
    response_bytes=300,
    tokens=(50, 7, 0),
)
def test_observe_completion_records_what_observe_request_does(
    model: str | None,
    routed: bool,
    status: int | None,
    from_server: bool,
    duration: float | None,
    request_bytes: int | None,
    response_bytes: int | None,
    tokens: tuple[int | None, int | None, int | None],
) -> None:
    c = Completion(
        "r", model, EP if routed else None, routed, status, from_server, duration, request_bytes
    )
    c.response_bytes = response_bytes
    c.input_tokens, c.output_tokens, c.cached_tokens = tokens
    s0 = snapshot("inference_objective_")
    observe_completion(c)
    s1 = snapshot("inference_objective_")
    observe_request(record_of(c))
    s2 = snapshot("inference_objective_")
    # (sums are added onto a running total: equal up to its rounding)
    assert delta(s0, s1) == pytest.approx(delta(s1, s2), rel=1e-9)


def test_observe_decision_counts_and_observes() -> None:
    d = Decision([EP], Reason.KV_HIT, "hook-policy", matched_tokens=30, request_tokens=60)
    d.stages = {"parse": 2e-5, "total": 3e-4, "policy": 1e-4}
    s0 = snapshot("kv_scorer_")
    observe_decision(d)
    observe_decision(d)
    got = delta(s0, snapshot("kv_scorer_"))
    assert (
        got[("kv_scorer_decisions_total", (("policy", "hook-policy"), ("reason", "kv_hit")))] == 2
    )
    ratio = (("policy", "hook-policy"),)
    assert got[("kv_scorer_matched_token_ratio_count", ratio)] == 2
    assert got[("kv_scorer_matched_token_ratio_sum", ratio)] == 1.0
    assert got[("kv_scorer_matched_token_ratio_bucket", (("le", "0.5"), *ratio))] == 2
    stage = "kv_scorer_decision_stage_seconds"
    assert got[(f"{stage}_count", (("stage", "parse"),))] == 2
    assert got[(f"{stage}_bucket", (("le", "2.5e-05"), ("stage", "parse")))] == 2
    assert got[(f"{stage}_count", (("stage", "total"),))] == 2
    assert not any(k[1] == (("stage", "policy"),) for k in got)  # not a histogram stage
    # A refusal has no endpoint: counted, no ratio.
    r = Decision([], Reason.NO_WORKERS, "hook-policy-2", request_tokens=5)
    observe_decision(r)
    got = delta(s0, snapshot("kv_scorer_"))
    assert ("kv_scorer_matched_token_ratio_count", (("policy", "hook-policy-2"),)) not in got


def tokens_series(ep: str) -> dict[str, float]:
    out = {}
    for (name, labels), v in snapshot("kv_scorer_response_tokens_total").items():
        lab = dict(labels)
        if name == "kv_scorer_response_tokens_total" and lab["endpoint"] == ep:
            out[lab["kind"]] = v
    return out


def test_response_token_series_leave_with_their_worker() -> None:
    cfg = load_config(
        overrides={"pool": {"workers": [EP, EP2], "block_size": 16}, "policy": "round_robin"},
        environ={},
    )
    pool = Pool.from_config(cfg)
    d = Director(cfg, pool, build_policy("round_robin", PolicyContext(pool=pool, config=cfg), {}))
    usage = {"usage": {"prompt_tokens": 40, "completion_tokens": 3}}

    def serve(rid: str) -> str:
        req = d.new_request({"x-request-id": rid})
        body = json.dumps({"model": "hook-tokens-model", "prompt": "hello"}).encode()
        dec = run_on_default_loop(d.request_received(req, body))
        ep = dec.endpoints[0]
        d.response_started(rid, 200, None, "application/json", bodies=True)
        return ep

    ep = serve("t1")
    d.response_chunk("t1", json.dumps(usage).encode(), True)
    assert tokens_series(ep) == {"input": 40.0, "output": 3.0}
    ep_b = serve("t2")  # round robin: the other worker, its response still running
    assert ep_b != ep
    pool.remove(ep, "test")
    assert tokens_series(ep) == {}
    pool.remove(ep_b, "test")
    # Its response ends after it left: not counted into a series nobody would remove.
    d.response_chunk("t2", json.dumps(usage).encode(), True)
    assert tokens_series(ep_b) == {}
    assert d._token_counters == {}
    # A worker back at the address counts again from zero.
    pool.add(WorkerConfig(endpoint=ep), "test")
    serve("t3")
    d.response_chunk("t3", json.dumps(usage).encode(), True)
    assert tokens_series(ep) == {"input": 40.0, "output": 3.0}
