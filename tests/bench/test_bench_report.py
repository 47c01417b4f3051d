"""Report helpers: the table, the results.json shape check, Prometheus counter sums."""

from __future__ import annotations

from kvscorer_tools.bench.e2e import LoadResult, counter_totals, summarize
from kvscorer_tools.bench.procs import metric_sums
from kvscorer_tools.bench.report import check_results_shape, format_table

ROW = {
    "hit_rate": 0.5, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "throughput_rps": 3.0,
    "imbalance": 1.1, "requests": 10, "errors": 0,
}  # fmt: skip


def test_table_shows_numbers_and_peer_errors() -> None:
    text = format_table(
        {"kv": ROW, "sglang_cache_aware": {"error": "not installed"}, "oracle": {"hit_rate": 0.9}},
        "title",
    )
    lines = text.splitlines()
    assert lines[0] == "title" and "hit rate" in lines[1]
    assert any(line.startswith("kv") and "0.500" in line and "1.10" in line for line in lines)
    assert any("sglang_cache_aware" in line and "error: not installed" in line for line in lines)
    assert any(line.startswith("oracle") and "0.900" in line for line in lines)


def test_shape_check_names_what_is_missing() -> None:
    good = {"workload": "w", "policies": {"kv": ROW, "oracle": {"hit_rate": 0.3}}}
    assert check_results_shape(good) == []
    bad = {"policies": {"kv": {k: v for k, v in ROW.items() if k != "errors"}, "oracle": {}}}
    problems = check_results_shape(bad)
    assert "workload: missing or not a string" in problems
    assert "policies.kv.errors: missing or not a number" in problems
    assert "policies.oracle.hit_rate: missing or not a number" in problems
    assert check_results_shape({"workload": "w", "policies": {}}) == ["policies: missing or empty"]


def test_metric_sums_reads_vllm_counters() -> None:
    text = (
        "# HELP vllm:prefix_cache_queries Prefix cache queries (tokens).\n"
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0\n'
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 120.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 30.0\n'
    )
    got = metric_sums(text, ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "other"])
    assert got == {
        "vllm:prefix_cache_queries": 300.0,
        "vllm:prefix_cache_hits": 150.0,
        "other": 0.0,
    }


def test_summarize_uses_counter_deltas_and_model_time() -> None:
    res = LoadResult(ttft_s=[0.01, 0.02, 0.03], errors=1, done=3, t_start=0.0, t_end=2.0)
    res.send_lag_s = [0.0, 0.001, 0.002]
    before = [(100.0, 10.0), (100.0, 0.0)]
    after = [(400.0, 160.0), (200.0, 50.0)]
    out = summarize(res, before, after, speed=10.0, requests=4)
    assert out["hit_rate"] == 0.5  # (150 + 50) / (300 + 100)
    assert out["imbalance"] == 1.5  # max 300 / mean 200
    assert out["ttft_p50_ms"] == 200.0  # 20 ms wall x speed 10
    assert out["throughput_rps"] == 0.15  # 3 done in 2 s wall = 20 s model
    assert out["requests"] == 4 and out["errors"] == 1
    assert out["send_lag_p99_ms"] == 19.8  # p99 of (0, 1, 2) ms late = 1.98 ms, x speed 10


def test_counter_totals_sums_a_labelled_counter_by_the_chosen_labels() -> None:
    text = "\n".join(
        [
            "# TYPE kv_scorer_events_applied_total counter",
            'kv_scorer_events_applied_total{outcome="ok",type="BlockStored"} 355.0',
            'kv_scorer_events_applied_total{outcome="unknown_parent",type="BlockStored"} 2.0',
            'kv_scorer_events_applied_total{outcome="ok",type="BlockRemoved"} 1885.0',
            'kv_scorer_events_applied_total{outcome="ok",type="AllBlocksCleared"} 0.0',
            'kv_scorer_events_applied_created{outcome="ok",type="BlockStored"} 1.7e9',
        ]
    )
    by_both = counter_totals(text, "kv_scorer_events_applied_total", ("type", "outcome"))
    assert by_both == {
        "BlockRemoved/ok": 1885,
        "BlockStored/ok": 355,
        "BlockStored/unknown_parent": 2,
    }
    by_outcome = counter_totals(text, "kv_scorer_events_applied_total", ("outcome",))
    assert by_outcome == {"ok": 2240, "unknown_parent": 2}


def test_counter_totals_reads_an_unlabelled_counter() -> None:
    text = "\n".join(
        [
            "# TYPE kv_scorer_event_gaps_total counter",
            "kv_scorer_event_gaps_total 3.0",
            "kv_scorer_event_gaps_created 1.7e9",
            'kv_scorer_event_gaps_total_other{x="y"} 9.0',
        ]
    )
    assert counter_totals(text, "kv_scorer_event_gaps_total", ()) == {"": 3}
    # A labelled read never takes the unlabelled line.
    assert counter_totals(text, "kv_scorer_event_gaps_total", ("x",)) == {}
