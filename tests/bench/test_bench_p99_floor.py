"""bench/routing/p99_floor.py: the no-queue, perfect-cache TTFT floor is a floor.

The note on issue 13 rests on it: if some request's replayed TTFT came out below its
floor, the claim "no router can beat this p99" would be false.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvscorer_tools.bench import replay as rp
from kvscorer_tools.bench.workloads import load_workload
from kvscorer_tools.sim.timing import DEFAULT_TIMING

ROOT = Path(__file__).resolve().parents[2]


def load() -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench" / "routing"))
    spec = importlib.util.spec_from_file_location(
        "p99_floor", ROOT / "bench" / "routing" / "p99_floor.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_least_prefill_is_below_every_split_into_budget_chunks() -> None:
    pf = load()
    t = DEFAULT_TIMING
    for u in (1, 511, 8192, 8193, 20_000, 60_000, 120_000):
        least = pf.least_prefill_ms(u)
        # Every integer split into k chunks of at most the budget, k from the least to 3x.
        k0 = -(-u // pf.BUDGET)
        for k in range(k0, 3 * k0 + 2):
            even = [u // k + (1 if i < u % k else 0) for i in range(k)]
            assert least <= sum(t.prefill_ms(x) for x in even) + 1e-9, (u, k)
    # Below the budget's split once that many steps cost more than a fourth.
    assert pf.least_prefill_ms(60_000) < sum(t.prefill_ms(x) for x in [7500] * 8)


@pytest.mark.parametrize("policy", ["kv", "round_robin"])
def test_no_replayed_request_beats_its_floor(policy: str) -> None:
    pf = load()
    wl = load_workload("mooncake-conversation").slice(200, 1.0)
    settings = rp.ReplaySettings(capacity_blocks=500)
    keys = rp.RequestKeys(wl, settings.block_size)
    floor = pf.floor_ms(wl, keys, settings.block_size)
    sim = rp._Replay(wl, keys, policy, settings)
    sim.run()
    done = [r for r in sim.reqs if r.first >= 0]
    assert len(done) > 150
    for r in done:
        ttft = (r.first - r.arrival) * 1000.0
        assert ttft >= floor[r.idx] - 1e-6, (r.idx, ttft, floor[r.idx])
    # Queues and shared steps put most requests above their floor, not all on it.
    above = sum((r.first - r.arrival) * 1000.0 > floor[r.idx] + 1.0 for r in done)
    assert above > len(done) // 4
