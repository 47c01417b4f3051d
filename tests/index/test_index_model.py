"""BlockIndex.match against a brute-force model, on random contents (every media path)."""

from __future__ import annotations

import pytest
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.blocks import BlockHasher
from scorer.config import IndexConfig
from scorer.index import MEDIA, BlockIndex, Match

KEYS = BlockHasher(4).keys(list(range(4 * 12)))
WEIGHTS = {"GPU": 1.0, "CPU": 0.3, "DISK": 0.05}
# (endpoint, rank, medium, block positions held)
_hold = st.tuples(
    st.sampled_from(["a", "b", "c", "d"]),
    st.integers(0, 1),
    st.sampled_from(MEDIA),
    st.sets(st.integers(0, len(KEYS) - 1), max_size=len(KEYS)),
)


def _model(
    holds: list[tuple[str, int, str, set[int]]], spec: dict[str, int], prompt: list[int]
) -> dict[str, Match]:
    """Per (endpoint, rank): walk the prompt, stop at the first block held on no medium."""
    held: dict[tuple[str, int], dict[int, set[str]]] = {}
    for ep, rank, medium, pos in holds:
        for p in pos:
            held.setdefault((ep, rank), {}).setdefault(KEYS[p], set()).add(medium)
    for ep, n in spec.items():
        for p in range(n):
            held.setdefault((ep, 0), {}).setdefault(KEYS[p], set()).add("GPU")
    # An endpoint's dp ranks keep separate caches and one rank serves the request: the
    # endpoint is worth its best rank by (blocks, weighted); ties in both are equal Matches.
    out: dict[str, Match] = {}
    for (ep, _), blocks in held.items():
        by: dict[str, int] = {}
        n = 0
        for k in prompt:
            media = blocks.get(k)
            if not media:
                break
            best = next(m for m in MEDIA if m in media)  # GPU > CPU > DISK
            by[best] = by.get(best, 0) + 1
            n += 1
        w = sum(WEIGHTS[m] * v for m, v in by.items())
        if n and (ep not in out or (n, w) > (out[ep].blocks, out[ep].weighted)):
            out[ep] = Match(n, by, w)
    return out


@settings(max_examples=scaled(300))
@given(
    st.lists(_hold, max_size=8),
    st.dictionaries(st.sampled_from(["a", "c"]), st.integers(1, 6), max_size=2),
    st.integers(0, len(KEYS)),
    st.none() | st.sets(st.sampled_from(["a", "b", "c", "d", "zz"])),
)
@example(  # rank 0's slot exists first (empty add); rank 1 holds block 0 on CPU, rank 0 on GPU
    holds=[("a", 0, "GPU", set()), ("a", 1, "CPU", {0}), ("a", 0, "GPU", {0})],
    spec={},
    plen=1,
    endpoints=None,
)
@example(  # the same with the CPU rank's slot first
    holds=[("a", 1, "CPU", {0}), ("a", 0, "GPU", {0})], spec={}, plen=1, endpoints=None
)
@pytest.mark.slow
def test_match_equals_the_model(
    holds: list[tuple[str, int, str, set[int]]],
    spec: dict[str, int],
    plen: int,
    endpoints: set[str] | None,
) -> None:
    idx = BlockIndex(IndexConfig.model_validate({"medium_weights": WEIGHTS}))
    for ep, rank, medium, pos in holds:
        ordered = sorted(pos)
        idx.add(ep, rank, [KEYS[p] ^ 0x77 for p in ordered], [KEYS[p] for p in ordered], medium)
    for ep, n in spec.items():
        idx.insert_speculative(ep, KEYS[:n])
    prompt = KEYS[:plen]
    want = _model(holds, spec, prompt)
    if endpoints is not None:
        want = {ep: m for ep, m in want.items() if ep in endpoints}
    got = idx.match(prompt, endpoints)
    assert set(got) == set(want)
    for ep, m in want.items():
        assert got[ep].blocks == m.blocks and got[ep].by_medium == m.by_medium, ep
        assert got[ep].weighted == pytest.approx(m.weighted)


def test_cpu_copies_elsewhere_cost_nothing_for_a_gpu_prompt() -> None:
    """A prompt with no CPU/disk block anywhere takes the GPU-only path; one that has some
    splits correctly even when many other workers hold only GPU copies."""
    idx = BlockIndex()
    other = BlockHasher(4).keys(list(range(1000, 1000 + 4 * 12)))
    for w in range(64):
        idx.add(f"w{w}", 0, range(12), KEYS)
    idx.add("w0", 0, [100, 101], other[:2], "CPU")
    got = idx.match(KEYS)
    assert len(got) == 64 and all(m.by_medium == {"GPU": 12} for m in got.values())
    idx.add("w3", 0, [200, 201], KEYS[5:7], "CPU")  # also on CPU: still counts as GPU
    idx.remove("w3", 0, [6], "GPU")  # block 6 of w3 now on CPU only
    got = idx.match(KEYS)
    assert got["w3"] == Match(12, {"GPU": 11, "CPU": 1}, pytest.approx(11.3))
    assert got["w4"].by_medium == {"GPU": 12}


def test_entries_gauge_is_read_from_the_live_index() -> None:
    from prometheus_client import REGISTRY

    def sample(medium: str) -> float:
        v = REGISTRY.get_sample_value("kv_scorer_index_entries", {"medium": medium})
        return 0.0 if v is None else v

    gpu0, cpu0 = sample("GPU"), sample("CPU")
    idx = BlockIndex()
    idx.add("a", 0, range(5), KEYS[:5])
    idx.add("b", 0, range(3), KEYS[:3])
    idx.add("a", 0, [50], KEYS[:1], "CPU")
    assert sample("GPU") - gpu0 == 8 and sample("CPU") - cpu0 == 1
    idx.remove("a", 0, [0, 1])
    idx.purge("b")
    assert sample("GPU") - gpu0 == 3 and sample("CPU") - cpu0 == 1


def test_shared_masks_are_one_object_and_stay_exact() -> None:
    idx = BlockIndex()
    for w in ("a", "b", "c"):
        idx.add(w, 0, range(12), KEYS)
    masks = [idx._gpu[k] for k in KEYS]
    assert all(m is masks[0] for m in masks) and masks[0] == 0b111
    idx.remove("b", 0, range(6))
    assert [idx._gpu[k] for k in KEYS] == [0b101] * 6 + [0b111] * 6
    assert idx._gpu[KEYS[0]] is idx._gpu[KEYS[5]]
    assert {ep: m.blocks for ep, m in idx.match(KEYS).items()} == {"a": 12, "c": 12}
