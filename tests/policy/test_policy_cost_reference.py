"""scorer.policy.cost implements the cost model once, evaluated a term at a time over all
candidates for speed (scoring 64 candidates is budgeted at 50 µs). tests/policy/cost_spec.py
writes it out plainly, one worker at a time: on random fleets every candidate row of a real
`kv` decision (load, credit, duplicate and continuity terms) must equal what the spec
computes."""

from __future__ import annotations

import math
from typing import Any

import pytest
from cost_spec import (
    busy_reason,
    cost,
    decayed_credit,
    duplicate_term,
    load_terms,
    previous_by_prefix,
)
from hypo import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy_helpers import endpoint, hold, keys, make, request

NOW = 1000.0

worker_st = st.fixed_dictionaries(
    {
        "prefill": st.integers(0, 40),
        "decode": st.integers(0, 200),
        "requests": st.integers(0, 12),
        # None: never scraped; else the scrape's age (clearly fresh or clearly stale).
        "age": st.one_of(st.none(), st.floats(0.0, 1.0), st.floats(5.0, 100.0)),
        "waiting": st.integers(0, 10),
        "kv_usage": st.floats(0.0, 1.0),
        "gpu_blocks": st.sampled_from([0, 100, 1000]),
        "held": st.integers(0, 12),
        "cpu_tail": st.integers(0, 4),
    }
)
options_st = st.fixed_dictionaries(
    {
        "prefill_load_scale": st.sampled_from([1.0, 2.5, 10.0]),
        "credit_decay": st.sampled_from([0.0, 0.1, 1.0]),
        "busy_waiting": st.sampled_from([None, 3, 5]),
        "busy_kv_usage": st.sampled_from([None, 0.5, 0.8]),
        "busy_inflight": st.sampled_from([None, 4]),
        "shed_when_busy": st.just(False),
        # Fleet terms every candidate pays (no session id: continuity by longest prefix).
        "duplicate_cost": st.sampled_from([0.0, 0.5, 12.0]),
        "continuity": st.sampled_from([0.0, 0.6]),
        "speculative": st.just(False),
    }
)


@pytest.mark.slow
@settings(max_examples=scaled(60))
@given(workers=st.lists(worker_st, min_size=1, max_size=6), options=options_st)
def test_decide_rows_equal_the_reference_functions(
    workers: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    s = make(len(workers), options=options)
    s.policy.clock = lambda: NOW  # type: ignore[attr-defined]
    prompt = keys(12)
    for i, spec in enumerate(workers):
        w = s.pool.workers[endpoint(i)]
        w.inflight.prefill_blocks = float(spec["prefill"])
        w.inflight.decode_blocks = float(spec["decode"])
        w.inflight.requests = spec["requests"]
        if spec["age"] is not None:
            w.scraped.at = NOW - spec["age"]
            w.scraped.waiting = float(spec["waiting"])
            w.scraped.kv_usage = spec["kv_usage"]
            w.scraped.num_gpu_blocks = spec["gpu_blocks"]
        held = spec["held"]
        if held:
            gpu = max(held - spec["cpu_tail"], 0)
            hold(s.index, endpoint(i), prompt[:gpu])
            if held > gpu:
                hold(s.index, endpoint(i), prompt[gpu:held], medium="CPU")
    req = request(prompt)
    d = s.policy.decide(req, list(s.pool))

    opts = s.policy.options
    req_blocks = 12.0
    stale_after = s.config.load.stale_after_s
    wrb = opts.waiting_request_blocks or req_blocks  # type: ignore[attr-defined]
    terms = [load_terms(w, NOW, stale_after, wrb) for w in s.pool]
    busy = [busy_reason(w, t, opts) for w, t in zip(s.pool, terms, strict=True)]  # type: ignore[arg-type]
    eligible = [i for i, b in enumerate(busy) if b is None] or list(range(len(terms)))
    load_min = min(terms[i].total for i in eligible)
    matches = s.index.match(prompt, s.endpoints)
    rows = {c.endpoint: c for c in d.candidates}
    eps = [w.endpoint for w in s.pool]
    cached = {i: m for i in eligible if (m := matches.get(eps[i])) is not None}
    best = max((m.weighted for m in cached.values()), default=0.0)
    previous = None
    if opts.continuity > 0.0:  # type: ignore[attr-defined]
        blocks = {i: m.blocks for i, m in cached.items()}
        previous = previous_by_prefix(blocks, len(prompt), opts.continuity_min_match)  # type: ignore[attr-defined]
    for i, w in enumerate(s.pool):
        row = rows[w.endpoint]
        assert row.prefill_blocks == pytest.approx(terms[i].prefill)
        assert row.decode_blocks == pytest.approx(terms[i].decode)
        assert row.filtered == busy[i]
        if i not in eligible:
            assert row.cost is None
            continue
        m = matches.get(w.endpoint)
        credit = 1.0
        overlap = 0.0
        if m is not None:
            credit = decayed_credit(terms[i].total, load_min, req_blocks, opts.credit_decay)  # type: ignore[attr-defined]
            overlap = credit * m.weighted
            assert row.credit == pytest.approx(credit)
            assert row.weighted_overlap == pytest.approx(m.weighted)
        want = cost(opts.prefill_load_scale, terms[i].prefill, terms[i].decode, req_blocks, overlap)  # type: ignore[attr-defined]
        weighted = 0.0 if m is None else m.weighted
        if cached:
            want += duplicate_term(opts.duplicate_cost, best, weighted)  # type: ignore[attr-defined]
            assert row.duplicate_blocks == pytest.approx(
                best - weighted if opts.duplicate_cost > 0.0 else 0.0  # type: ignore[attr-defined]
            )
        if i == previous:
            want *= 1.0 - opts.continuity  # type: ignore[attr-defined]
        assert row.cost is not None and math.isclose(row.cost, want, rel_tol=1e-9, abs_tol=1e-9)
