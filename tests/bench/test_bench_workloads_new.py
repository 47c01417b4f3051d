"""The agentic and rag generators and `--trace` (Mooncake-format) parsing."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from kvscorer_tools.bench.replay import ReplaySettings, RequestKeys, run_replay
from kvscorer_tools.bench.workloads import (
    BenchRequest,
    load_workload,
    oracle_block_hit_rate,
    read_mooncake,
)
from scorer.cli import main


def _sessions(reqs: list[BenchRequest]) -> dict[str, list[BenchRequest]]:
    out: dict[str, list[BenchRequest]] = {}
    for r in reqs:
        out.setdefault(r.session or "", []).append(r)
    return out


def _shape(wl: object) -> list[tuple[float, int, int, object]]:
    return [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.segments) for r in wl]  # type: ignore[attr-defined]


def test_agentic_sessions_grow_share_the_agent_prefix_and_overlap() -> None:
    wl = load_workload("agentic", sessions=12)
    assert _shape(wl) == _shape(load_workload("agentic", sessions=12))  # deterministic
    assert _shape(wl) != _shape(load_workload("agentic", sessions=12, seed=1))
    arrivals = [r.arrival_s for r in wl]
    assert arrivals == sorted(arrivals)
    by = _sessions(wl.requests)
    parents = {s: rs for s, rs in by.items() if "/" not in s}
    subs = {s: rs for s, rs in by.items() if "/" in s}
    assert len(parents) == 12 and subs, "sub-agents are spawned"
    for sid, turns in by.items():
        assert sid and all(r.group == sid for r in turns)
        # system + tools + task: ~20k for an agent, 19-22k for a sub-agent's own task
        assert 19_000 <= turns[0].prompt_tokens <= 25_000
        for prev, nxt in itertools.pairwise(turns):
            # every turn extends the previous prompt: reply + tool result (or user turn)
            assert nxt.segments[: len(prev.segments)] == prev.segments
            assert len(nxt.segments) == len(prev.segments) + 2
            assert nxt.prompt_tokens > prev.prompt_tokens
            assert nxt.arrival_s - prev.arrival_s >= 1.0  # tools run seconds to minutes
        assert turns[-1].prompt_tokens <= 200_000 + 35_000  # one turn past the window at most
    longest = max(r.prompt_tokens for r in wl)
    assert longest > 100_000
    # A sub-agent shares its parent's system prompt and tools, and nothing after them.
    for sid, turns in subs.items():
        parent = parents[sid.split("/")[0]][0]
        assert turns[0].segments[:2] == parent.segments[:2]
        assert turns[0].segments[2] not in parent.segments
    # Sessions of one agent kind share its prefix; the two kinds share nothing.
    kinds = {rs[0].segments[:2] for rs in parents.values()}
    assert len(kinds) == 2
    # Many sessions at once: at the median arrival, most parents have started and not ended.
    mid = arrivals[len(arrivals) // 2]
    live = [s for s, rs in parents.items() if rs[0].arrival_s <= mid <= rs[-1].arrival_s]
    assert len(live) >= 6
    assert oracle_block_hit_rate(wl, 512) > 0.8


def test_rag_shares_system_prompts_and_popular_passages() -> None:
    wl = load_workload("rag", queries=400, apps=3)
    assert _shape(wl) == _shape(load_workload("rag", queries=400, apps=3))
    assert _shape(wl) != _shape(load_workload("rag", queries=400, apps=3, seed=2))
    firsts = Counter(r.segments[0] for r in wl)
    assert len(firsts) == 3 and all(n >= 2_000 for _, n in firsts)  # a few long prompts
    assert firsts.most_common(1)[0][1] > len(wl) / 3  # app popularity skew
    by = _sessions(wl.requests)
    first_turns = [rs[0] for rs in by.values()]
    assert len(first_turns) == 400 and len(wl) > 400  # follow-ups
    # Passages right after the system prompt: Zipf-skewed, so the top passage recurs far
    # more often than a uniform draw from 5,000 would make it (400 x 8 / 5,000 < 1).
    passages = Counter(s for r in first_turns for s in r.segments[1:9])
    assert passages.most_common(1)[0][1] > 20
    for turns in by.values():
        assert all(r.segments[-1][1] <= 90 for r in turns)  # short user turns (60 x 1.5)
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.segments[: len(prev.segments)] == prev.segments
            assert nxt.arrival_s > prev.arrival_s


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_trace_rows_block_tokens_and_sessions(tmp_path: Path) -> None:
    t = _write(tmp_path / "t.jsonl", [
        {"timestamp": 1_700_000_000_500, "input_length": 300, "output_length": 5,
         "hash_ids": [7, 8, 9], "block_tokens": 128, "session_id": "a"},
        "",
        {"timestamp": 1_700_000_000_000, "input_length": 600, "output_length": 0,
         "hash_ids": [7, 1], "session_id": 42},
    ])  # fmt: skip
    wl = load_workload("trace", path=str(t))
    assert wl.name == "trace" and len(wl) == 2
    first, second = wl.requests
    # Sorted by time, relative to the first; ms → s.
    assert first.arrival_s == 0.0 and second.arrival_s == pytest.approx(0.5)
    assert first.segments == ((7, 512), (1, 512)) and first.session == "42"
    assert first.output_tokens == 1  # at least one token is generated
    assert second.segments == ((7, 128), (8, 128), (9, 128)) and second.session == "a"
    assert len(second.token_array()) == 300
    # Hash id 7 stands for the same tokens whatever its block_tokens: a prefix of them.
    assert (first.token_array()[:128] == second.token_array()[:128]).all()
    assert wl.hash_ids == [(7, 1), (7, 8, 9)]
    assert oracle_block_hit_rate(wl, 512) == pytest.approx(1 / 5)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing hash_ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "12"}',
         "hash_ids must be a list"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [1]}',
         "'5' is not an integer"),
        ('{"timestamp": 0, "input_length": 5, "output_length": true, "hash_ids": [1]}',
         "True is not an integer"),
        ('{"timestamp": -3, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "timestamp -3"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], '
         '"block_tokens": 0}', "block_tokens 0"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1], '
         '"block_tokens": 512}', "input_length 600 does not fit 1 hash ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], '
         '"session_id": [1]}', "session_id must be"),
    ],
)  # fmt: skip
def test_bad_trace_lines_name_the_line(tmp_path: Path, row: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    t = _write(tmp_path / "bad.jsonl", [good, good, row])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: ") as e:
        read_mooncake(t)
    assert message in str(e.value)


def test_empty_or_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        read_mooncake(_write(tmp_path / "e.jsonl", [""]))
    with pytest.raises(ValueError, match=r"nope\.jsonl"):
        read_mooncake(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="needs a file"):
        load_workload("trace")


def test_cli_trace_replay_with_sessions_and_oracle(tmp_path: Path) -> None:
    rows: list[object] = []
    # 7 conversations x 4 turns (7 so that round robin does not keep them in place by
    # accident on 3 workers), each turn one more 64-token block.
    for s in range(7):
        for k in range(4):
            rows.append({
                "timestamp": 1000 * k + 10 * s, "input_length": 64 * (k + 2) - 5,
                "output_length": 8, "hash_ids": [999, *range(s * 10, s * 10 + k + 1)],
                "block_tokens": 64, "session_id": f"c{s}",
            })  # fmt: skip
    t = _write(tmp_path / "mine.jsonl", rows)
    out = tmp_path / "o"
    rc = main([
        "bench", "--trace", str(t), "--mode", "replay", "--out", str(out),
        "--workers", "3", "--block-size", "64", "--capacity-blocks", "12",
        "--policies", "kv,session,round_robin",
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["workload"] == "trace" and doc["settings"]["trace"] == str(t)
    assert set(doc["policies"]) == {"kv", "session", "round_robin", "oracle"}
    # Block-level oracle from the hash ids: the shared block 999 after the first request,
    # then each turn re-reads the previous turn's blocks: (6 + 7 x (2 + 3 + 4)) / (7 x 14).
    assert doc["policies"]["oracle"]["hit_rate"] == pytest.approx(69 / 98, abs=1e-4)
    for name in ("kv", "session", "round_robin"):
        assert doc["policies"][name]["requests"] == 28 and doc["policies"][name]["errors"] == 0
    assert doc["policies"]["kv"]["hit_rate"] > doc["policies"]["round_robin"]["hit_rate"]
    # The session id reached the session policy (it keeps each conversation on one worker).
    assert doc["policies"]["session"]["hit_rate"] > doc["policies"]["round_robin"]["hit_rate"]
    base = ["bench", "--out", str(tmp_path / "x")]
    assert main([*base, "--trace", str(t), "--workload", "rag"]) == 2
    assert main([*base, "--workload", "trace"]) == 2
    assert main([*base, "--trace", str(tmp_path / "nope.jsonl")]) == 2


def test_new_workloads_replay_small() -> None:
    s = ReplaySettings(workers=4, capacity_blocks=300, block_size=512, seed=0)
    for wl in (
        load_workload("agentic", sessions=4, max_context=60_000, start_window_s=30),
        load_workload("rag", queries=60),
    ):
        keys = RequestKeys(wl, 512)
        kv = run_replay(wl, "kv", s, keys)
        rr = run_replay(wl, "round_robin", s, keys)
        assert kv.errors == rr.errors == 0 and kv.requests == len(wl)
        assert kv.hit_rate > rr.hit_rate
