"""Workloads: exact sharing of token prefixes, trace parsing, the oracle on the real trace."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvscorer_tools.bench.workloads import (
    MOONCAKE_BLOCK,
    default_trace_path,
    load_workload,
    mooncake_conversation,
    oracle_block_hit_rate,
    read_mooncake,
    segment_tokens,
)


@pytest.mark.slow
def test_oracle_on_the_real_conversation_trace() -> None:
    wl = mooncake_conversation()
    assert len(wl) == 12031
    # Mooncake's own block-level definition: leading hash ids seen before / all hash ids.
    assert oracle_block_hit_rate(wl, MOONCAKE_BLOCK) == pytest.approx(0.366, abs=0.0005)
    assert wl.requests[0].arrival_s == 0.0
    assert wl.duration_s == pytest.approx(3537.0, abs=1.0)


@pytest.mark.slow
def test_shared_hash_ids_share_tokens_exactly() -> None:
    wl = mooncake_conversation()
    a, b = wl.requests[0], wl.requests[1]  # both start with hash id 0, then differ
    assert a.segments[0] == b.segments[0] and a.segments[1] != b.segments[1]
    ta, tb = a.token_array(), b.token_array()
    assert len(ta) == a.prompt_tokens and len(tb) == b.prompt_tokens
    assert (ta[:MOONCAKE_BLOCK] == tb[:MOONCAKE_BLOCK]).all()
    second = slice(MOONCAKE_BLOCK, 2 * MOONCAKE_BLOCK)
    assert (ta[second] != tb[second]).any()
    # A segment's tokens do not depend on where they are cut.
    assert (segment_tokens(7, 100)[40:] == segment_tokens(7, 60, start=40)).all()


def test_shared_prefix_and_prefix_groups_shapes() -> None:
    sp = load_workload("shared-prefix")
    assert len(sp) == 64 * 16
    assert {r.prompt_tokens for r in sp} == {2048 + 128}
    assert all(r.arrival_s == 0.0 for r in sp)
    same_group = [r for r in sp if r.group == "g3"]
    t0, t1 = same_group[0].token_array(), same_group[1].token_array()
    assert (t0[:2048] == t1[:2048]).all() and (t0[2048:] != t1[2048:]).any()
    pg = load_workload("prefix-groups", rate=8.0)
    assert len(pg) == 750 and {r.output_tokens for r in pg} == {1000}
    arrivals = [r.arrival_s for r in pg]
    assert arrivals == sorted(arrivals) and arrivals[-1] == pytest.approx(750 / 8.0, rel=0.2)
    # Seeded: the same seed gives the same workload, another seed another one.
    assert [r.segments for r in load_workload("prefix-groups", seed=1)] == [
        r.segments for r in load_workload("prefix-groups", seed=1)
    ]
    assert [r.group for r in pg] != [r.group for r in load_workload("prefix-groups", seed=1)]


def test_chat_turns_extend_the_previous_prompt() -> None:
    wl = load_workload("chat", sessions=3, turns=4)
    by_session: dict[str, list] = {}
    for r in wl:
        by_session.setdefault(r.session or "", []).append(r)
    assert len(by_session) == 3
    for turns in by_session.values():
        assert len(turns) == 4
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival_s > prev.arrival_s
            assert nxt.segments[: len(prev.segments)] == prev.segments


def test_bad_names_and_rows_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope")
    with pytest.raises(ValueError, match="unknown parameter"):
        load_workload("shared-prefix", colour="red")
    bad = tmp_path / "t.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 9999, "output_length": 1, "hash_ids": [1]}\n'
    )
    with pytest.raises(ValueError, match=r"t.jsonl:2: input_length 9999"):
        read_mooncake(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"t.jsonl:1"):
        read_mooncake(bad)
    assert default_trace_path().is_file()
