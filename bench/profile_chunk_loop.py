"""Our own CPU per streamed response chunk, in a tight loop: no socket, no Envoy.

    .venv/bin/python bench/profile_chunk_loop.py [--chunks 20000] [--profile]

A real `App` (asyncio transport, `extproc.track_responses` on, `round_robin`) gets one
HTTP/2 connection whose transport only counts writes. One ext_proc stream is routed
(request headers and body in FULL_DUPLEX_STREAMED, response headers), then `--chunks`
response-body messages as Envoy 1.40 sends them, each DATA frame in its own
`data_received` (as chunks arrive one by one), the peer's window returned every 5,000.
Prints process CPU per chunk (frame loop, wire reader, answer, director's per-chunk
bookkeeping, the transport.write call) and, with `--profile`, the cProfile top 18; writes
bench/out/chunk_loop.json. What a chunk costs through Envoy is bench_response_chunks.py:
this is the part of it that is ours, without the event loop's wake-up.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import profile_datapath as pd  # noqa: E402
from hpack import Encoder  # noqa: E402

from scorer.app import App  # noqa: E402
from scorer.extproc.transport import H2Connection  # noqa: E402
from scorer.extproc.transport import frames as F  # noqa: E402


class CountingTransport(pd.QuietTransport):
    """Counts writes; sends nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: Any) -> None:
        self.writes += 1


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def run(chunks: int, profile: bool) -> dict[str, Any]:
    cfg = pd.inprocess_config("round_robin")
    app = App(cfg)
    await app.start()
    server = app.extproc_h2
    assert server is not None
    t = CountingTransport()
    conn = H2Connection(server)
    conn.connection_made(t)
    conn.data_received(F.PREFACE + F.frame(F.SETTINGS, 0, 0))
    sid = 1
    block = Encoder().encode(pd.CALL_HEADERS)
    hmsg = pd.message("request_headers", 0, mode=pd.PM.FULL_DUPLEX_STREAMED)
    conn.data_received(F.frame(F.HEADERS, F.END_HEADERS, sid, block) + pd.data_frame(sid, hmsg))
    await settle()
    conn.data_received(pd.data_frame(sid, pd.message("request_body")))
    await settle()
    conn.data_received(pd.data_frame(sid, pd.message("response_headers")))
    await settle()
    frames = [pd.data_frame(sid, pd.message("response_body", i)) for i in range(100)]
    conn.data_received(F.window_update(0, 1 << 30) + F.window_update(sid, 1 << 30))
    w0 = t.writes
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    t0 = time.process_time()
    for i in range(chunks):
        conn.data_received(frames[i % 100])
        if i % 5000 == 4999:
            conn.data_received(F.window_update(0, 500_000) + F.window_update(sid, 500_000))
    cpu = time.process_time() - t0
    if prof is not None:
        prof.disable()
    answered = t.writes - w0
    await app.stop()
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return {
        "benchmark": "chunk_loop",
        "chunks": chunks,
        "answered": answered,
        "profiled": profile,
        "cpu_us_per_chunk": round(cpu / chunks * 1e6, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=20_000)
    ap.add_argument("--profile", action="store_true", help="cProfile (inflates the figure)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "chunk_loop.json"))
    args = ap.parse_args()
    r = asyncio.run(run(args.chunks, args.profile))
    print(f"{r['cpu_us_per_chunk']} µs CPU per chunk ({r['answered']} of {r['chunks']} answered)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))
    print(f"wrote {out}")
    return 0 if r["answered"] == r["chunks"] else 1


if __name__ == "__main__":
    sys.exit(main())
