"""The replay follows the simulated worker's chunked prefill (the shared scheduler)."""

from __future__ import annotations

from typing import Any

import pytest

from kvscorer_tools.bench.replay import ReplaySettings, RequestKeys, _Replay
from kvscorer_tools.bench.workloads import BenchRequest, Workload
from kvscorer_tools.sim.timing import TimingModel

BS = 16
T = TimingModel()


def _run(reqs: list[tuple[float, int, int]], **kw: Any) -> tuple[_Replay, list[tuple[str, int]]]:
    """Replay (arrival s, prompt tokens, output tokens) requests on one worker."""
    wl = Workload(
        "chunked",
        [BenchRequest(i, at, p, o, "", ((i + 1, p),)) for i, (at, p, o) in enumerate(reqs)],
    )
    s = ReplaySettings(workers=1, capacity_blocks=None, block_size=BS, **kw)
    rep = _Replay(wl, RequestKeys(wl, BS), "round_robin", s)
    fed: list[tuple[str, int]] = []
    orig = rep.feed_store

    def feed(endpoint: str, keys: list[int]) -> None:
        fed.append((f"{rep.now:.6f}", len(keys)))
        orig(endpoint, keys)

    rep.feed_store = feed  # type: ignore[method-assign]
    rep.run()
    return rep, fed


def test_long_prompt_prefills_in_three_steps_and_feeds_the_index_per_step() -> None:
    rep, fed = _run([(0.0, 20_000, 4)])
    step = T.prefill_ms(8192) / 1000.0
    assert [n for _, n in fed] == [512, 512, 226]  # BlockStored per step, in step order
    assert [float(t) for t, _ in fed] == pytest.approx([0.0, step, 2 * step], abs=1e-6)
    long = rep.reqs[0]
    assert long.first == pytest.approx(2 * step + T.prefill_ms(3616) / 1000.0)
    res = rep.result()
    assert res.hit_rate == 0.0 and res.errors == 0


def test_short_request_and_decode_during_a_long_prefill() -> None:
    # With a budget larger than the prompt the replay prefills it in one step (the former
    # model): the reference for what chunking changes.
    work = [(0.0, 100, 40), (0.01, 20_000, 4), (0.05, 300, 4)]
    one, _ = _run(work, max_num_batched_tokens=100_000)
    chunked, _ = _run(work)
    capped, _ = _run(work, long_prefill_token_threshold=4096)
    d1, _, s1 = one.reqs
    d, long, short = chunked.reqs
    # The running decode keeps getting a token every step of the long prefill.
    assert d.done < d1.done
    # vLLM's default gives the running prefill the whole budget first: the short request
    # shares the long one's last step, still earlier than behind a one-step prefill.
    assert short.first == long.first < s1.first
    # With long_prefill_token_threshold the short one finishes before the long one.
    _, lc, sc = capped.reqs
    assert sc.first < lc.first
