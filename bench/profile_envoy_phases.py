"""Where the time ext_proc adds goes, as Envoy itself measures it, per request phase.

    .venv/bin/python bench/profile_envoy_phases.py [--requests 400] [--policy kv]
        [--shape local,local-full,istio,envoy-ai-gateway,kgateway] [--max-tokens 16]
        [--scorer-probes]

One Envoy with two listeners in front of the same two `kv-scorer sim` workers: `main`
(ext_proc to `kv-scorer serve`, the shape asked for; started by the e2e harness) and
`direct` (round robin, no ext_proc). A keep-alive client at concurrency 1 alternates
between them (one request each, in turn), so machine noise hits both alike. Both
listeners write an access log with Envoy's own stream timestamps (`%COMMON_DURATION%`,
µs since the first downstream byte) and, on `main`, the ext_proc filter's per-phase gRPC
call latency (`%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:...)%`; field names from
Envoy's source/extensions/filters/http/ext_proc/ext_proc.cc, ExtProcLoggingInfo). The
scorer's own time per message comes from bench/profile_datapath.py (in-process).

Per listener, medians over the requests (µs):
- `rx_end`: last request byte read (DS_RX_END)
- `us_tx`: first byte to the worker (US_TX_BEG): on `main` it includes the request-side
  ext_proc round trip(s)
- `us_rx`, `us_rx_end`: first / last byte from the worker
- `ds_tx`: first byte to the client (DS_TX_BEG): on `main` after the response-headers
  round trip
- `ds_tx_end`: last byte to the client
- `client`: the client's own round-trip time
and on `main` the ext_proc call latencies (request headers, request body calls, response
headers: each from Envoy sending the message to receiving its answer). Prints a table and
writes bench/out/envoy_phases.json.

`--scorer-probes`: the scorer's own share, timed inside it (bench/probes/sitecustomize.py,
loaded through PYTHONPATH by the scorer processes only): per answered read, from the read
reaching the HTTP/2 connection to the answer's socket write, and the write itself (`send`:
the loopback delivery and Envoy's wake-up), medians per `request` / `response` read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_extproc import Conn  # noqa: E402
from bench_overhead import (  # noqa: E402
    KINDS,
    LOCAL_SHAPES,
    TokenizerScorerRun,
    prompts,
    request_bytes,
)

from kvscorer_tools.bench.e2e import E2ESettings, SimFleet  # noqa: E402
from kvscorer_tools.bench.e2e import scorer as scorer_mod  # noqa: E402
from kvscorer_tools.bench.procs import ProcGroup  # noqa: E402

# (name, start, end): Envoy's COMMON_DURATION points (access log format docs).
POINTS = (
    ("rx_end", "DS_RX_END"),
    ("us_tx", "US_TX_BEG"),
    ("us_rx", "US_RX_BEG"),
    ("us_rx_end", "US_RX_END"),
    ("ds_tx", "DS_TX_BEG"),
    ("ds_tx_end", "DS_TX_END"),
)
EXT_PROC_FIELDS = (
    "request_header_latency_us",
    "request_body_call_count",
    "request_body_total_latency_us",
    "request_body_max_latency_us",
    "request_trailer_latency_us",
    "response_header_latency_us",
    "response_body_call_count",
    "response_body_total_latency_us",
    "response_body_max_latency_us",
    "response_trailer_latency_us",
)


_FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def with_access_logs(config_yaml: str, log_dir: Path, direct_backends: list[str]) -> str:
    """The harness's Envoy config plus a `direct` listener and an access log per listener."""
    cfg = yaml.safe_load(config_yaml)
    listeners = cfg["static_resources"]["listeners"]
    main = listeners[0]
    direct = json.loads(json.dumps(main))  # a copy without the ext_proc filter
    direct["name"] = "direct"
    direct["address"]["socket_address"]["port_value"] = 0
    dchain = direct["filter_chains"][0]
    dchain.pop("transport_socket", None)
    dhcm = dchain["filters"][0]["typed_config"]
    dhcm["stat_prefix"] = "direct"
    dhcm["http_filters"] = [f for f in dhcm["http_filters"] if "ext_proc" not in f["name"]]
    vh = dhcm["route_config"]["virtual_hosts"][0]
    vh["routes"] = [
        {"match": {"prefix": "/"}, "route": {"cluster": "bench_direct", "timeout": "0s"}}
    ]
    cfg["static_resources"]["clusters"].append(
        {
            "name": "bench_direct",
            "type": "STATIC",
            "connect_timeout": "1s",
            "lb_policy": "ROUND_ROBIN",
            "load_assignment": {
                "cluster_name": "bench_direct",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": b.rsplit(":", 1)[0],
                                            "port_value": int(b.rsplit(":", 1)[1]),
                                        }
                                    }
                                }
                            }
                            for b in direct_backends
                        ]
                    }
                ],
            },
        }
    )
    listeners.append(direct)
    for lst in listeners:
        name = lst["name"]
        fmt: dict[str, str] = {k: f"%COMMON_DURATION(DS_RX_BEG:{p}:us)%" for k, p in POINTS}
        if name != "direct":
            fmt |= {
                f: f"%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:{f})%" for f in EXT_PROC_FIELDS
            }
        for chain in lst["filter_chains"]:
            hcm = chain["filters"][0]["typed_config"]
            # main keeps the shape's own logs (the lean envoy.yaml's upstream failure log).
            kept = hcm.get("access_log", []) if name != "direct" else []
            hcm["access_log"] = [
                *kept,
                {
                    "name": "envoy.access_loggers.file",
                    "typed_config": {
                        "@type": _FILE_LOG,
                        "path": str(
                            log_dir / f"access-{'direct' if name == 'direct' else 'main'}.log"
                        ),
                        "log_format": {"json_format": fmt},
                    },
                },
            ]
    return yaml.safe_dump(cfg, sort_keys=False)


async def drive(
    main_port: int, direct_port: int, reqs: list[bytes], n: int
) -> dict[str, list[float]]:
    """`n` requests on each listener, alternating, one connection each (concurrency 1)."""
    cm, cd = await Conn.open(main_port), await Conn.open(direct_port)
    try:
        for c in (cm, cd):
            for _ in range(20):  # warm: connections, pools, the scorer's caches
                assert await c.post(reqs[0]) == 200
        lat: dict[str, list[float]] = {"main": [], "direct": []}
        for i in range(n):
            req = reqs[i % len(reqs)]
            for name, c in (("main", cm), ("direct", cd)):
                t0 = time.perf_counter()
                status = await c.post(req)
                if status == 200:
                    lat[name].append((time.perf_counter() - t0) * 1e6)
        return lat
    finally:
        cm.close()
        cd.close()


def wait_for_lines(path: Path, n: int, timeout_s: float = 20.0) -> None:
    """Until the access log at `path` has `n` lines, or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)


def read_log(path: Path, skip: int) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines()[skip:]:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = []
    for r in rows:
        v = r.get(key)
        if v in (None, "-", ""):
            continue
        try:
            xs.append(float(v))
        except (TypeError, ValueError):
            continue
    return round(statistics.median(xs), 1) if xs else None


def run_shape(
    group: ProcGroup,
    fleet: SimFleet,
    args: argparse.Namespace,
    shape: str,
    scorer_dir: Path,
    log_dir: Path,
) -> dict[str, Any]:
    """One scorer + Envoy in `shape`, driven per prompt kind: {kind: {listener: medians}}."""
    results: dict[str, Any] = {}
    settings = E2ESettings(
        workers=2,
        block_size=16,
        run_dir=scorer_dir,
        gateway=None if shape in LOCAL_SHAPES else shape,
        response_body_mode="NONE" if shape in LOCAL_SHAPES else "FULL_DUPLEX_STREAMED",
        response_headers=shape == "local-full",
    )
    ids = prompts(64)
    probes = scorer_dir / "probes"
    if args.scorer_probes:
        # Read by bench/probes/sitecustomize.py in the scorer started next.
        probes.mkdir(parents=True, exist_ok=True)
        for f in probes.glob("probes-*.json"):
            f.unlink()
        os.environ["KVSCORER_PROBES_DIR"] = str(probes)
    windows: dict[str, tuple[float, float]] = {}
    with TokenizerScorerRun(group, fleet, args.policy, settings) as run:
        ports = run.envoy.listener_ports
        main_port = next(p for n, p in ports.items() if n != "direct")
        for kind in [k for k in args.kinds.split(",") if k in KINDS]:
            reqs = [request_bytes(p, kind, args.max_tokens) for p in ids]
            skip = {
                n: len((log_dir / f"access-{n}.log").read_text().splitlines())
                if (log_dir / f"access-{n}.log").exists()
                else 0
                for n in ("main", "direct")
            }
            t_start = time.time()
            lat = asyncio.run(drive(main_port, ports["direct"], reqs, args.requests))
            windows[kind] = (t_start, time.time())
            for n in ("main", "direct"):
                # 20 warm-up requests + the measured ones: wait for Envoy to flush them all
                # (every second, later under load; a short log made empty medians).
                wait_for_lines(log_dir / f"access-{n}.log", skip[n] + 20 + args.requests)
            cell: dict[str, Any] = {}
            for n in ("main", "direct"):
                rows = read_log(log_dir / f"access-{n}.log", skip[n] + 20)
                fields = [k for k, _ in POINTS] + (list(EXT_PROC_FIELDS) if n == "main" else [])
                cell[n] = {k: median_of(rows, k) for k in fields}
                cell[n]["client"] = round(statistics.median(lat[n]), 1)
                cell[n]["requests"] = len(rows)
            results[kind] = cell
    if args.scorer_probes:
        os.environ.pop("KVSCORER_PROBES_DIR", None)
        for kind, (t0, t1) in windows.items():
            results[kind]["scorer"] = probe_medians(probes, t0, t1)
    return results


def probe_medians(probes: Path, t0: float, t1: float) -> dict[str, Any]:
    """Medians of the scorer's probe rows (bench/probes/sitecustomize.py) written between
    `t0` and `t1`, per kind: read → answer written, and the write itself (µs)."""
    deadline = time.monotonic() + 20  # the scorer writes them at exit (bounded wait)
    files: list[Path] = []
    while time.monotonic() < deadline and not files:
        files = sorted(probes.glob("probes-*.json"))
        if not files:
            time.sleep(0.1)
    rows = [r for f in files for r in json.loads(f.read_text()) if t0 <= r[3] <= t1]
    out: dict[str, Any] = {}
    for kind in ("request", "response", "end"):
        got = [r for r in rows if r[0] == kind]
        if got:
            out[kind] = {
                "reads": len(got),
                "read_to_write_us": round(statistics.median(r[1] for r in got), 1),
                "write_us": round(statistics.median(r[2] for r in got), 1),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="per listener and prompt kind")
    ap.add_argument("--policy", default="kv")
    ap.add_argument(
        "--shape",
        default="local",
        help="comma list, run one after the other: local (lean envoy.yaml), local-full "
        "(envoy-full.yaml: response headers sent), or a gateway shape",
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kinds", default="ids,text")
    ap.add_argument(
        "--scorer-probes",
        action="store_true",
        help="time each answered read inside the scorer (bench/probes/sitecustomize.py): "
        "from the read to the answer's socket write, and the write",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "envoy_phases.json"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    run_dir = out.parent / "envoy-phases-run"
    run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    for f in log_dir.glob("*.log"):
        f.unlink()
    group = ProcGroup(run_dir)
    results: dict[str, Any] = {}
    try:
        fleet = SimFleet(
            group,
            E2ESettings(workers=2, block_size=16, speed=1e6, capacity_blocks=None, sim_nice=0),
        )
        fleet.start()
        if args.scorer_probes:  # for the scorers started from now on (not the sims)
            probe_path = str(ROOT / "bench" / "probes")
            rest = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = probe_path + (os.pathsep + rest if rest else "")
        backends = [s.endpoint for s in fleet.specs]
        original = scorer_mod.envoy_config
        scorer_mod.envoy_config = lambda s, fl, port: with_access_logs(  # type: ignore[assignment]
            original(s, fl, port), log_dir, backends
        )
        for shape in args.shape.split(","):
            results[shape] = run_shape(
                group, fleet, args, shape, run_dir / f"scorer-{shape}", log_dir
            )
    finally:
        group.stop_all()
    for shape, kind, cell in ((sh, k, c) for sh, r in results.items() for k, c in r.items()):
        print(f"\n{kind} prompts, {args.policy} / {shape}, c=1, medians in µs")
        keys = [k for k, _ in POINTS] + ["client"]
        print(f"{'':>10}" + "".join(f"{k:>11}" for k in keys))
        for n in ("direct", "main"):
            print(f"{n:>10}" + "".join(f"{cell[n].get(k) or 0:>11.0f}" for k in keys))
        print(
            "ext_proc calls (main): "
            + ", ".join(f"{f}={cell['main'].get(f)}" for f in EXT_PROC_FIELDS)
        )
        for k, v in cell.get("scorer", {}).items():
            print(
                f"scorer, {k} reads ({v['reads']}): read → answer written "
                f"{v['read_to_write_us']} µs, the write {v['write_us']} µs"
            )
    doc = {
        "benchmark": "envoy_phases",
        "cores": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "settings": vars(args),
        "results": results,
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
