"""Instructions per request of the ext_proc data path in-process (callgrind), lean shape.

    .venv/bin/python bench/count_datapath.py [--policy round_robin] [--stub-director]
        [--requests 1000] [--base 300]

What Envoy sends with envoy/envoy.yaml, fed to a real `App`'s HTTP/2 connection (its
transport writes to a loopback socket): per request one read with the stream's HEADERS and
three messages (request headers, the 2 KB body, the empty end of body), answered in that
read, then one read with END_STREAM and RST_STREAM (bench/profile_datapath.py --shape lean,
without its stage timers). Every read is built before the count starts. The script runs
itself twice under `valgrind --tool=callgrind` (`--base` and `--base + --requests`
requests, the same start-up in both) and prints the difference per request: the
scorer's instructions per request, deterministic to ~0.3 % whatever else the machine runs
(time here swings ±50 % run to run). `--stub-director`: the director's hooks answer from a
cached decision, so what is left is the transport and the servicer.
Writes bench/out/datapath_instructions.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

COLLECTED = re.compile(rb"Collected : (\d+)")


def reads(n: int) -> list[tuple[bytes, bytes]]:
    """Per request: the read with the stream and its three messages, the read ending it."""
    from hpack import Encoder
    from profile_datapath import CALL_HEADERS, PM, data_frame, message

    from scorer.extproc.transport import frames as F

    enc = Encoder()
    body = message("request_body", 1)
    end_msg = message("request_end")
    out = []
    for r in range(n):
        sid = 2 * r + 1
        block = enc.encode(CALL_HEADERS)
        first = (
            F.frame(F.HEADERS, F.END_HEADERS, sid, block)
            + data_frame(sid, message("request_headers", r, mode=PM.FULL_DUPLEX_STREAMED))
            + data_frame(sid, body)
            + data_frame(sid, end_msg)
        )
        last = F.frame(F.DATA, F.END_STREAM, sid) + F.frame(F.RST_STREAM, 0, sid, bytes(4))
        # Envoy returns the connection window our answers used.
        out.append((first, last + F.window_update(0, 1 << 20)))
    return out


def stub_director(app: Any) -> None:
    """The director's hooks answer with the first decision they made (no decision, no
    bookkeeping after it): the transport and the servicer are what is left to count."""
    d = app.director
    real_received, real_new = d.request_received, d.new_request
    kept: dict[str, Any] = {}

    async def request_received(req: Any, body: Any, dry_run: bool = False) -> Any:
        if "d" not in kept:
            kept["d"] = await real_received(req, body, dry_run)
        return kept["d"]

    def new_request(headers: Any, subset: Any = None) -> Any:
        if "r" not in kept:
            kept["r"] = real_new(headers, subset)
        return kept["r"]

    d.request_received = request_received
    d.new_request = new_request
    d.response_ended = lambda rid, reset=False: None
    d.is_live = lambda rid: True


async def drive(n: int, policy: str, stub: bool) -> None:
    from profile_datapath import Clock, SocketTransport, inprocess_config, tcp_pair

    from scorer.app import App
    from scorer.extproc.transport import H2Connection
    from scorer.extproc.transport import frames as F

    app = App(inprocess_config(policy))
    await app.start()
    if stub:
        stub_director(app)
    server = app.extproc_h2
    assert server is not None
    ours, peer = tcp_pair()
    conn = H2Connection(server)
    conn.connection_made(SocketTransport(ours, Clock()))
    conn.data_received(F.PREFACE + F.frame(F.SETTINGS, 0, 0))
    for first, last in reads(n):
        conn.data_received(first)
        conn.data_received(last)
        for _ in range(3):  # bounded: a handler that moved to a task ends in a turn or two
            if not server.calls:
                break
            await asyncio.sleep(0)
        try:
            while peer.recv(1 << 20):
                pass
        except BlockingIOError:
            pass
    await app.stop()
    ours.close()
    peer.close()


def count(n: int, args: argparse.Namespace, out: Path) -> int:
    cmd = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
        sys.executable, __file__, "--drive", str(n), "--policy", args.policy,
    ] + (["--stub-director"] if args.stub_director else [])  # fmt: skip
    got = subprocess.run(cmd, capture_output=True, check=True, env=os.environ.copy())
    m = COLLECTED.search(got.stderr)
    if m is None:
        raise RuntimeError(got.stderr.decode()[-2000:])
    return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--stub-director", action="store_true")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--base", type=int, default=300)
    ap.add_argument("--drive", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "datapath_instructions.json"))
    args = ap.parse_args()
    if args.base + args.requests > 2000:
        # Each request hands back 1 MiB of connection window (reads()); past ~2,048 our
        # send window passes 2^31-1 and the connection ends in FLOW_CONTROL_ERROR.
        ap.error("--base + --requests must stay at or below 2000")
    if args.drive is not None:
        asyncio.run(drive(args.drive, args.policy, args.stub_director))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvs-dp-") as tmp:
        from concurrent.futures import ThreadPoolExecutor

        sizes = (args.base, args.base + args.requests)
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(lambda n: count(n, args, Path(tmp) / f"cg.{n}"), sizes)
    per = (b - a) / args.requests
    doc = {
        "benchmark": "datapath_instructions",
        "policy": args.policy,
        "stub_director": args.stub_director,
        "requests": args.requests,
        "instructions_per_request": round(per),
    }
    print(
        f"lean shape, {args.policy}{' (director stubbed)' if args.stub_director else ''}: "
        f"{per:,.0f} instructions per request"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
