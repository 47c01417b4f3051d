"""Where the `kv` policy's time goes per request, with and without a tokenizer (no network).

    .venv/bin/python bench/profile_kv.py [--iterations 3000] [--profile] [--case kv:no:ids]

A loop of requests through scorer.director.Director exactly as the data path drives it
(new_request → request_received(body) → response_ended), 2 workers (`--workers N`), the
bodies of bench/bench_overhead.py (288-token completions, token ids and text). Cases:
`round_robin` and `kv`, each with a tokenizer configured (a word-level tokenizer that
knows the text prompts' words) and without one. The 64 prompts repeat, so after the
warm-up the segment cache holds every text prompt: they are tokenized on the event loop
(scorer.tokens.service.INLINE_BUDGET_S; a prompt never seen would take the thread hop
unless small). Prints µs per request (p50, mean) and
the mean of each decision stage; `--profile` adds cProfile's top functions per case.
Writes bench/out/profile_kv.json.

Instructions per request (the machine's timing swings too much for A/Bs): one case, its
loop bare (`--bare`: no per-request clock or stage bookkeeping in the harness), under
callgrind at two iteration counts; (Ir(1200) - Ir(200)) / 1000 is one request:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \
        bench/profile_kv.py --case kv:no:ids --bare --iterations 200   # and 1200
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_overhead import KINDS, prompts, request_bytes, write_vocab_tokenizer  # noqa: E402
from bench_policy import build_rig  # noqa: E402

from scorer.config import Config  # noqa: E402

MODEL = "bench-model"


async def run_case(
    policy_name: str,
    tokenizer: Path | None,
    kind: str,
    iterations: int,
    profile: bool,
    bare: bool = False,
    workers: int = 2,
) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if tokenizer is not None:
        extra["tokens"] = {"models": {MODEL: {"tokenizer": str(tokenizer)}}}
    cfg = Config.model_validate(
        {
            "pool": {
                "workers": [{"endpoint": f"127.0.0.1:{9001 + i}"} for i in range(workers)],
                "block_size": 16,
            },
            "policy": policy_name,
            **extra,
        }
    )
    _pool, _index, tokens, director = await build_rig(cfg, policy_name, seed=1)
    bodies = []
    for p in prompts(64):
        raw = request_bytes(p, kind, 512)
        bodies.append(raw[raw.index(b"\r\n\r\n") + 4 :])
    headers = {":path": "/v1/completions", ":method": "POST", "content-type": "application/json"}
    per_req: list[float] = []
    stages: dict[str, list[float]] = {}
    reasons: dict[str, int] = {}
    prof = cProfile.Profile() if profile else None
    try:
        if bare:
            for it in range(iterations + 200):
                if it == 200:
                    # What the warm-up left is not this loop's: a full collection's walk
                    # over it would land in one count and not the other.
                    gc.collect()
                    gc.freeze()
                req = director.new_request(headers)
                await director.request_received(req, bodies[it % len(bodies)])
                director.response_ended(req.request_id)
            gc.unfreeze()
            return {"policy": policy_name, "prompt": kind, "iterations": iterations}
        for it in range(iterations + 200):
            if it == 200 and prof is not None:
                prof.enable()
            body = bodies[it % len(bodies)]
            t0 = time.perf_counter()
            req = director.new_request(headers)
            d = await director.request_received(req, body)
            director.response_ended(req.request_id)
            dt = time.perf_counter() - t0
            if it < 200:
                continue
            per_req.append(dt)
            reasons[str(d.reason)] = reasons.get(str(d.reason), 0) + 1
            for k, v in d.stages.items():
                stages.setdefault(k, []).append(v)
    finally:
        if prof is not None:
            prof.disable()
        await tokens.stop()
    out: dict[str, Any] = {
        "policy": policy_name,
        "tokenizer": tokenizer is not None,
        "prompt": kind,
        "p50_us": statistics.median(per_req) * 1e6,
        "mean_us": statistics.fmean(per_req) * 1e6,
        "stages_mean_us": {k: statistics.fmean(v) * 1e6 for k, v in stages.items()},
        "reasons": reasons,
    }
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        out["profile"] = s.getvalue()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--case",
        help="one case only, POLICY:TOKENIZER:PROMPT (e.g. kv:no:ids, round_robin:yes:text)",
    )
    ap.add_argument(
        "--bare", action="store_true", help="no per-request timing (instruction counts)"
    )
    ap.add_argument("--workers", type=int, default=2, help="workers in the pool (default 2)")
    args = ap.parse_args()
    only = tuple(args.case.split(":")) if args.case else None
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tok = write_vocab_tokenizer(Path(d) / "tokenizer.json")
        for policy in ("round_robin", "kv"):
            for tk in (tok, None):
                for kind in KINDS:
                    if only is not None and only != (policy, "yes" if tk else "no", kind):
                        continue
                    r = asyncio.run(
                        run_case(
                            policy,
                            tk,
                            kind,
                            args.iterations,
                            args.profile,
                            args.bare,
                            args.workers,
                        )
                    )
                    if args.bare:
                        continue
                    rows.append(r)
                    st = " ".join(f"{k}={v:.0f}" for k, v in r["stages_mean_us"].items())
                    print(
                        f"{policy:>11} tokenizer={'yes' if tk else 'no ':3} {kind:>4}: "
                        f"p50 {r['p50_us']:6.0f} µs mean {r['mean_us']:6.0f} µs | {st} | "
                        f"{r['reasons']}",
                        flush=True,
                    )
                    if args.profile:
                        print(r["profile"])
    if args.bare or only is not None or args.workers != 2:
        return 0  # (a partial run does not overwrite the full one's file)
    out = ROOT / "bench" / "out" / "profile_kv.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "profile_kv", "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
