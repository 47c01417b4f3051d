"""The replay-vs-e2e comparison: conversation parents, and replaying a run's own routing."""

from __future__ import annotations

import json
from pathlib import Path

from kvscorer_tools.bench.compare import (
    continuations,
    e2e_rows,
    event_path,
    follow_rows,
    main,
    parents,
    replay_rows,
)
from kvscorer_tools.bench.replay import ReplaySettings, RequestKeys
from kvscorer_tools.bench.workloads import load_workload


def _wl():  # type: ignore[no-untyped-def]
    return load_workload("mooncake-conversation").slice(250, 1.0)


def test_parents_are_the_longest_shared_prefix_of_hash_ids() -> None:
    wl = _wl()
    par = parents(wl)
    assert wl.hash_ids is not None
    assert par[0] == (-1, 0)
    for i, (j, n) in enumerate(par):
        if j < 0:
            continue
        assert j < i and wl.hash_ids[i][:n] == wl.hash_ids[j][:n]
        # No earlier request shares more.
        longer = wl.hash_ids[i][: n + 1]
        assert len(longer) == n or all(h[: n + 1] != longer for h in wl.hash_ids[:i])


def test_parents_of_a_workload_without_hash_ids_come_from_its_block_keys() -> None:
    wl = load_workload("prefix-groups").slice(60, 1.0)
    assert wl.hash_ids is None
    keys = RequestKeys(wl, 512)
    par = parents(wl, keys)
    assert len(par) == len(wl.requests) and par[0] == (-1, 0)
    # The groups' shared prefixes make parents; each shares its blocks with its parent.
    assert any(j >= 0 for j, _ in par)
    for i, (j, n) in enumerate(par):
        if j >= 0:
            assert j < i and n >= 1 and keys.keys[i][:n] == keys.keys[j][:n]
            assert len(keys.keys[i]) == n or keys.keys[i][n] not in {
                k[n] for k in keys.keys[:i] if len(k) > n and k[:n] == keys.keys[i][:n]
            }


def test_following_a_replays_own_routing_reproduces_it(tmp_path: Path) -> None:
    """Sent where a replay sent them, the requests find the same cache hits (the check the
    comparison makes against an e2e run), and the policy's dry run picks the same worker
    when nothing is random (round robin is deterministic given the same order)."""
    wl = _wl()
    keys = RequestKeys(wl, 512)
    s = ReplaySettings(capacity_blocks=200, seed=1)
    rows = replay_rows(wl, keys, "kv", s)
    # As the e2e rows look (key = hash of the prompt's token ids, wall times).
    e2e_file = tmp_path / "kv.jsonl"
    lines = []
    for br, r in zip(wl.requests, rows, strict=True):
        line = dict(r, key=hash(tuple(br.token_ids())), sent=r["arrival"])
        lines.append(json.dumps(line))
    e2e_file.write_text("\n".join(reversed(lines)) + "\n")  # any order: paired by key
    e2e = e2e_rows(e2e_file, wl)
    assert [x["worker"] for x in e2e if x] == [r["worker"] for r in rows]
    followed, would = follow_rows(wl, keys, "kv", s, e2e)
    assert [r["cached_tokens"] for r in followed] == [r["cached_tokens"] for r in rows]
    assert sum(r["cached_tokens"] for r in rows) > 0
    assert len(would) == len(rows) and all(0 <= w < 8 for w in would)
    c = continuations(wl, rows, parents(wl))
    assert c["turns"] > 0 and c["stayed"] <= c["turns"]
    assert c["hits"] == c["hit_stayed"] + c["hit_moved"] + c["hit_other"]


def test_cli_writes_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "c.json"
    main(
        [
            "--rows",
            str(tmp_path),
            "--policies",
            "round_robin",
            "--max-requests",
            "60",
            "--json",
            str(out),
        ]
    )
    got = json.loads(out.read_text())
    assert set(got) == {"round_robin"} and "replay" in got["round_robin"]
    assert "round_robin replay" in capsys.readouterr().out


def test_event_path_counts_unconfirmed_blocks_and_an_earlier_runs_events() -> None:
    # A results.json run entry as the last session's second repeat wrote it (abridged).
    run = {
        "speculative": {"confirmed": 17021, "inserted": 17853},
        "events": {"AllBlocksCleared/ok": 56, "BlockRemoved/ok": 72394, "BlockStored/ok": 4829},
        "at_start": {"sync_messages": {"skipped": 1200, "applied": 3}},
        "gaps": {"": 1},
        "purges": {"cleared": 56},
    }
    e = event_path(run)
    assert e["unconfirmed"] == 832 and e["expired"] == 0 and e["cleared_in_run"] == 56
    assert e["removed_in_run"] == 72394 and e["sync_skipped"] == 1200
    assert e["sync_applied"] == 3 and e["gaps"] == 1 and e["purges"] == 56
    assert e["replays"] == 0


def test_cli_shows_the_event_path_from_results_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    rows = tmp_path / "run" / "cap-1000" / "requests"
    rows.mkdir(parents=True)
    runs = [{"speculative": {"inserted": 10, "confirmed": 7, "expired": 3}}]
    doc = {"policies": {"round_robin": {"runs": runs}}}
    (tmp_path / "results.json").write_text(json.dumps(doc))
    out = tmp_path / "c.json"
    main(["--rows", str(rows), "--policies", "round_robin", "--max-requests", "60",
          "--json", str(out)])  # fmt: skip
    got = json.loads(out.read_text())["round_robin"]["event_path"]
    assert got[0]["unconfirmed"] == 3 and got[0]["expired"] == 3
    assert "unconfirmed 3 (expired 3)" in capsys.readouterr().out


def test_a_peers_rows_replayed_give_that_routings_timing(tmp_path: Path) -> None:
    """A peer's e2e placement replayed on the replay's engines: the same placement as a
    replay of kv gives kv's TTFT, queue and prefill exactly (placement-only timing)."""
    wl = load_workload("mooncake-conversation").slice(120, 1.0)
    keys = RequestKeys(wl, 512)
    s = ReplaySettings(capacity_blocks=1000, seed=0)
    rows = replay_rows(wl, keys, "kv", s)
    lines = [
        json.dumps(dict(r, key=hash(tuple(br.token_ids())), sent=r["arrival"]))
        for br, r in zip(wl.requests, rows, strict=True)
    ]
    (tmp_path / "vllm_router_kv_aware.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "c.json"
    main(["--rows", str(tmp_path), "--policies", "kv", "--peers", "vllm_router_kv_aware",
          "--max-requests", "120", "--json", str(out)])  # fmt: skip
    got = json.loads(out.read_text())
    mine, peer = got["kv"]["replay_timing"], got["vllm_router_kv_aware"]["follow_timing"]
    assert mine == peer
    assert peer["ttft_p50_ms"] > peer["prefill_p50_ms"] > 0 and peer["ttft_p99_ms"] > 0
    # Another placement (everything on one worker) queues: the timing follows the rows.
    pile = [json.dumps(dict(json.loads(x), worker=0)) for x in lines]
    (tmp_path / "vllm_router_kv_aware.jsonl").write_text("\n".join(pile) + "\n")
    main(["--rows", str(tmp_path), "--policies", "kv", "--peers", "vllm_router_kv_aware",
          "--max-requests", "120", "--json", str(out)])  # fmt: skip
    piled = json.loads(out.read_text())["vllm_router_kv_aware"]["follow_timing"]
    assert piled["queue_mean_ms"] > 10 * max(mine["queue_mean_ms"], 1.0)
