"""Merged decode runs (--stream-interval > 1) keep what the step-by-step engine shows.

A virtual clock stands in for time.monotonic and asyncio.sleep: a sleep jumps the clock to
its deadline, stopping at each scheduled arrival or abort so the driver acts at exactly
that instant. The same schedule runs with interval 1 (the reference) and with
merged runs; token ids, TTFT and e2e latencies, KV events, metrics, step count and the
queue/running counts seen at every arrival must be identical.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvscorer_tools.sim import engine as engine_mod
from kvscorer_tools.sim.engine import Engine, SimRequest
from kvscorer_tools.sim.metrics import SimMetrics
from kvscorer_tools.sim.timing import TimingModel

# (arrival in wall seconds from 0, prompt, max_tokens): shared prefixes (cache hits and
# evictions in a small pool), arrivals inside merged runs, at a step boundary and while idle.
SCHEDULE: list[tuple[float, list[int], int]] = [
    (0.0, list(range(1000, 1100)), 30),
    (0.0305, list(range(1000, 1080)) + [7] * 20, 9),
    (0.0871, list(range(2000, 2064)), 17),
    (0.0872, list(range(1000, 1050)), 3),
    (0.2003, list(range(3000, 3200)), 25),
    (0.9, list(range(2000, 2070)), 12),
    (0.95, list(range(4000, 4100)), 1),
]
# (time, index in SCHEDULE): a client goes away while its request decodes.
ABORTS: list[tuple[float, int]] = [(0.0407, 0), (0.2309, 4)]


class Publisher:
    def __init__(self) -> None:
        self.batches: list[bytes] = []

    def publish(self, events: list[msgspec.Struct]) -> None:
        self.batches.append(msgspec.json.encode(events))


class VirtualTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.arrivals = sorted([t for t, _, _ in SCHEDULE] + [t for t, _ in ABORTS])
        self.submitted = asyncio.Event()
        self.engine: Engine | None = None

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        end = self.now + max(delay, 0.0)
        while self.arrivals and self.arrivals[0] < end:
            self.now = max(self.now, self.arrivals[0])
            self.submitted.clear()
            await asyncio.wait_for(self.submitted.wait(), 5.0)
            assert self.engine is not None
            if asyncio.current_task() is not self.engine._task:
                # A merged run's timer: the run listens to the engine's wake-up, which the
                # arrival set; it cancels this timer.
                await asyncio.wait_for(asyncio.Future(), 5.0)
        self.now = max(self.now, end)
        await REAL_SLEEP(0)


REAL_SLEEP = asyncio.sleep


def run(monkeypatch: pytest.MonkeyPatch, interval: int) -> dict[str, Any]:
    vt = VirtualTime()
    monkeypatch.setattr(engine_mod.time, "monotonic", vt.monotonic)
    monkeypatch.setattr(engine_mod.asyncio, "sleep", vt.sleep)
    pub = Publisher()
    metrics = SimMetrics(f"m{interval}", 16, 24, 0)

    async def go() -> dict[str, Any]:
        eng = Engine(
            block_size=16, capacity_blocks=24, max_num_seqs=3, max_num_batched_tokens=8192,
            max_model_len=4096, vocab_size=32000, timing=TimingModel(speed=4.0),
            metrics=metrics, publisher=pub, era="map", seed=3, stream_interval=interval,  # type: ignore[arg-type]
        )  # fmt: skip
        vt.engine = eng
        eng.start()
        reqs: list[SimRequest] = []
        seen: list[tuple[int, int]] = []
        todo = sorted(
            [(t, i, True) for i, (t, _, _) in enumerate(SCHEDULE)]
            + [(t, i, False) for t, i in ABORTS]
        )
        for t, i, arrives in todo:
            for _ in range(100_000):
                if vt.now >= t:
                    break
                if not eng.waiting and not eng.running and not eng._wake.is_set():
                    vt.now = t  # parked idle (wake-up cleared): jump to the event
                else:
                    await REAL_SLEEP(0)
            assert vt.now == t
            seen.append((len(eng.waiting), len(eng.running)))
            if arrives:
                _, prompt, max_tokens = SCHEDULE[i]
                req = SimRequest(f"r{i}", prompt, max_tokens, arrival=t)
                eng.submit(req)
                reqs.append(req)
            else:
                assert reqs[i] in eng.running  # the abort hits a decoding request
                eng.abort(reqs[i])
            vt.arrivals.pop(0)
            vt.submitted.set()
        for req in reqs:
            await asyncio.wait_for(req.done.wait(), 5.0)
        await eng.stop()
        return {
            "tokens": [r.output_ids for r in reqs],
            "ttft": [r.ttft_s for r in reqs],
            "cached": [r.cached_tokens for r in reqs],
            "finish": [r.finish_reason for r in reqs],
            "seen": seen,
            "events": pub.batches,
            "metrics": [  # *_created and the LoRA info's value are wall-clock times
                line.replace(f"m{interval}", "m").rsplit(" ", 1)[0]
                if line.startswith("vllm:lora_requests_info{")
                else line.replace(f"m{interval}", "m")
                for line in metrics.exposition().decode().splitlines()
                if "_created" not in line
            ],
            "end": vt.now,
            "steps": eng.steps,
        }

    return asyncio.run(go())


@pytest.mark.parametrize("interval", [2, 4, 64])
def test_merged_runs_match_step_by_step(monkeypatch: pytest.MonkeyPatch, interval: int) -> None:
    ref = run(monkeypatch, 1)
    merged = run(monkeypatch, interval)
    aborted = {i for _, i in ABORTS}
    assert ref["finish"] == ["abort" if i in aborted else "length" for i in range(len(SCHEDULE))]
    assert all(0 < len(ref["tokens"][i]) < SCHEDULE[i][2] for i in aborted)
    assert any(c > 0 for c in ref["cached"])  # the schedule exercises cache hits
    for key in ref:
        assert merged[key] == ref[key], key


def test_stream_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        Engine(
            block_size=16, capacity_blocks=24, max_num_seqs=3, max_num_batched_tokens=8192,
            max_model_len=4096, vocab_size=32000, timing=TimingModel(),
            metrics=SimMetrics("z", 16, 24, 0), publisher=None, era="map", seed=0,
            stream_interval=0,
        )  # fmt: skip
