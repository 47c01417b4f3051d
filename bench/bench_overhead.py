"""Overhead side by side: direct, Envoy alone, Envoy + kv-scorer, and the peer routers.

    .venv/bin/python bench/bench_overhead.py               # full run (see bench/README.md)
    .venv/bin/python bench/bench_overhead.py --quick       # smoke: 4 paths, c=1/8, 1 repeat
    .venv/bin/python bench/bench_overhead.py --paths direct,envoy,kv-scorer:kv:local

Paths, all in front of the same two `kv-scorer sim --speed 1000` workers (loopback):

* `direct`: the client talks to one worker (alternating per connection);
* `envoy`: Envoy alone, round robin over both workers, no ext_proc (the `direct` listener
  of scorer.envoyproc.render_envoy_config);
* `kv-scorer:<policy>:<shape>`: Envoy + `kv-scorer serve` for each shipped policy, with
  `local` = the envoy/envoy.yaml shape (lean: nothing of the response sent to the
  scorer), `local-full` = envoy/envoy-full.yaml (response headers sent too), or a
  gateway shape (scorer.envoyproc.render_gateway_config: istio / envoy-ai-gateway /
  kgateway; response bodies FULL_DUPLEX_STREAMED, TLS to the scorer where the gateway
  uses it). Started with the e2e harness (kvscorer_tools.bench.e2e.ScorerRun);
* `peer:<name>`: sglang-router 0.3.2 and vllm-router 0.1.17 (round_robin, cache_aware,
  kv_aware), started by kvscorer_tools.bench.e2e.peers. A peer that is not installed
  (`pip install -e './tools[peers]'`) is reported as "not installed";
* `peer-envoy:<name>`: the same peer behind an Envoy of its own (a plain route, no
  ext_proc: kvscorer_tools.bench.e2e.peers.front_envoy), the install of a user who
  already runs a gateway; its added latency over Envoy alone is then the peer's own, as
  `kv-scorer:*` paths' is ours. Not in the default set (`--paths` asks for it).

Load: a keep-alive HTTP/1.1 client (bench_extproc.Conn), non-streaming /v1/completions
with max_tokens 512 (ignore_eos), token-id prompts and the same prompts as text ("t<id>"
words: the sim's tokenizer and the scorer's stub tokenizer make one token of each word);
8 shared 256-token prefixes + a unique 32-token suffix. Per path x prompt kind x
concurrency (1, 8, 32): `--repeats` runs of `--seconds` each; p50/p99 latency, requests/s,
scorer CPU µs per request (utime+stime of the scorer process from /proc/PID/stat), the
median over repeats and the spread (max - min) of each. Against noise: the repeats are
interleaved across paths (every path once, then every path again: A B C A B C), each
path started afresh for each repeat; and each repeat of a cell first runs the same cell
`direct` and on Envoy alone (kept up the whole run, `--baselines`), so the added p50/p99
are medians over repeats of (path - direct) and (path - Envoy alone) measured seconds
apart, and `rps_ratio_vs_envoy` the median of path req/s / Envoy-alone req/s. Writes
bench/out/overhead.json and bench/out/overhead.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_extproc import Conn, cpu_seconds, pct  # noqa: E402

from kvscorer_tools.bench.e2e import E2ESettings, ScorerRun, SimFleet  # noqa: E402
from kvscorer_tools.bench.e2e import peers as peer_mod  # noqa: E402
from kvscorer_tools.bench.e2e.settings import MODEL  # noqa: E402
from kvscorer_tools.bench.procs import ProcGroup  # noqa: E402

SHAPES = ("local", "local-full", "istio", "envoy-ai-gateway", "kgateway")
LOCAL_SHAPES = ("local", "local-full")
PEERS = tuple(peer_mod.PEER_POLICIES)
KINDS = ("ids", "text")
PREFIXES, PREFIX_LEN, SUFFIX_LEN, VOCAB = 8, 256, 32, 4096


def shipped_policies() -> list[str]:
    """The policies `kv-scorer serve --policy` accepts (scorer.policy.policy_names)."""
    from scorer.policy import policy_names

    return list(policy_names())


def default_paths() -> list[str]:
    paths = ["direct", "envoy"]
    paths += [f"kv-scorer:{p}:{s}" for p in shipped_policies() for s in SHAPES]
    return paths + [f"peer:{p}" for p in PEERS]


QUICK_PATHS = [
    "direct",
    "envoy",
    "kv-scorer:round_robin:local",
    "kv-scorer:kv:local",
]


# ------------------------------------------------------------------ requests


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` token-id prompts: one of PREFIXES shared prefixes + a unique suffix."""
    rng = random.Random(seed)
    heads = [[rng.randrange(VOCAB) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    return [
        heads[i % PREFIXES] + [rng.randrange(VOCAB) for _ in range(SUFFIX_LEN)] for i in range(n)
    ]


def request_bytes(ids: list[int], kind: str, max_tokens: int) -> bytes:
    """One keep-alive HTTP/1.1 POST of a non-streaming completion."""
    prompt: Any = ids if kind == "ids" else " ".join(f"t{t}" for t in ids)
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": False,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def run_cell(
    ports: Sequence[int], reqs: Sequence[bytes], conc: int, seconds: float
) -> dict[str, Any]:
    """`conc` connections (round robin over `ports`) posting `reqs` in turn for `seconds`."""
    conns = [await Conn.open(ports[i % len(ports)]) for i in range(conc)]
    nxt = 0
    lat: list[float] = []
    errors = 0
    first_error = 0
    try:
        for c in conns:  # warm: connection, Envoy's upstream pool
            await c.post(reqs[0])
        stop_at = time.perf_counter() + seconds

        async def worker(c: Conn) -> None:
            nonlocal nxt, errors, first_error
            while time.perf_counter() < stop_at:
                req = reqs[nxt % len(reqs)]
                nxt += 1
                t0 = time.perf_counter()
                status = await c.post(req)
                if status == 200:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1
                    first_error = first_error or status

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns))
        wall = time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
    return {"lat": lat, "wall": wall, "errors": errors, "first_status": first_error}


# ------------------------------------------------------------------ paths


class Target:
    """A running path: the ports the client uses, the scorer's pid, and every process of
    the path whose CPU is counted per request (`procs`: name -> pid; "scorer", "envoy",
    or "router" for a peer)."""

    def __init__(
        self, ports: list[int], scorer_pid: int | None = None, procs: dict[str, int] | None = None
    ) -> None:
        self.ports = ports
        self.scorer_pid = scorer_pid
        self.procs = procs or ({"scorer": scorer_pid} if scorer_pid else {})


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot, from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


class CpuMeter:
    """CPU seconds of named processes and the machine's busy fraction over a span: where a
    path's requests/s go (a path that adds CPU per request on a saturated machine loses
    throughput in proportion; one that adds none but waits does not saturate it)."""

    def __init__(self, procs: dict[str, int], sims: Sequence[int]) -> None:
        self.procs = dict(procs)
        self.sims = list(sims)

    def read(self) -> tuple[dict[str, float], tuple[int, int]]:
        out = {n: cpu_seconds(pid) for n, pid in self.procs.items()}
        out["sims"] = sum(cpu_seconds(pid) for pid in self.sims)
        out["bench_client"] = cpu_seconds(os.getpid())
        return out, machine_ticks()

    @staticmethod
    def per_request(
        a: tuple[dict[str, float], tuple[int, int]],
        b: tuple[dict[str, float], tuple[int, int]],
        requests: int,
    ) -> dict[str, float]:
        """CPU µs per request of each process, and `machine_busy` (0-1) between a and b."""
        out = {f"{n}_us": (b[0][n] - a[0][n]) / max(requests, 1) * 1e6 for n in a[0]}
        busy, total = b[1][0] - a[1][0], b[1][1] - a[1][1]
        out["machine_busy"] = busy / total if total else 0.0
        return out


def write_vocab_tokenizer(path: Path) -> Path:
    """A WordLevel tokenizer with the words "t0".."t<VOCAB>": text prompts tokenize to the
    ids they were made from, as the sim's own synthetic tokenizer does."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": VOCAB} | {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


class TokenizerScorerRun(ScorerRun):
    """The harness's ScorerRun with a tokenizer that knows the benchmark's words."""

    write_tokenizer = staticmethod(write_vocab_tokenizer)


@contextlib.contextmanager
def envoy_alone(fleet: SimFleet) -> Iterator[list[int]]:
    """Envoy alone in front of the workers (round robin, no ext_proc): its listener port
    (ENVOY_ALONE_PID[0] holds its pid while it runs, for the CPU breakdown)."""
    with peer_mod.plain_envoy([s.endpoint for s in fleet.specs]) as (port, pid):
        ENVOY_ALONE_PID[:] = [pid]
        try:
            yield [port]
        finally:
            ENVOY_ALONE_PID.clear()


ENVOY_ALONE_PID: list[int] = []


@contextlib.contextmanager
def start_path(path: str, group: ProcGroup, fleet: SimFleet, run_dir: Path) -> Iterator[Target]:
    """Start what `path` needs, yield its Target, stop it."""
    worker_ports = [s.port for s in fleet.specs]
    if path == "direct":
        yield Target(worker_ports)
        return
    if path == "envoy":
        with envoy_alone(fleet) as ports:
            yield Target(ports, procs={"envoy": ENVOY_ALONE_PID[0]})
        return
    if path.startswith("kv-scorer:"):
        _, policy, shape = path.split(":", 2)
        settings = E2ESettings(
            workers=len(fleet.specs),
            block_size=16,
            run_dir=run_dir / f"{policy}-{shape}",
            gateway=None if shape in LOCAL_SHAPES else shape,
            response_body_mode="NONE" if shape in LOCAL_SHAPES else "FULL_DUPLEX_STREAMED",
            response_headers=shape == "local-full",
        )
        run = TokenizerScorerRun(group, fleet, policy, settings)
        with run:
            assert run.scorer is not None and run.envoy is not None
            envoy_pid = run.envoy.proc.pid if run.envoy.proc is not None else None
            procs = {"scorer": run.scorer.pid} | ({"envoy": envoy_pid} if envoy_pid else {})
            yield Target([run.envoy.listener_port], run.scorer.pid, procs)
        return
    if path.startswith(("peer:", "peer-envoy:")):
        kind, name = path.split(":", 1)
        settings = E2ESettings(workers=len(fleet.specs), block_size=16, run_dir=run_dir)
        proc, base = peer_mod.start_peer(name, group, fleet, settings)
        try:
            with contextlib.ExitStack() as stack:
                procs = {"router": proc.pid}
                if kind == "peer-envoy":
                    base, envoy_pid = stack.enter_context(peer_mod.front_envoy(base, settings))
                    procs["envoy"] = envoy_pid
                yield Target([int(base.rsplit(":", 1)[1])], procs=procs)
        finally:
            group.stop(proc)
        return
    raise ValueError(f"unknown path {path!r}")


# ------------------------------------------------------------------ the run


def summarize(samples: list[dict[str, Any]], cpu: list[float | None]) -> dict[str, Any]:
    """Median over repeats and the spread (max - min) of each figure."""

    def agg(xs: list[float]) -> tuple[float, float]:
        return statistics.median(xs), max(xs) - min(xs)

    ok = [s for s in samples if s["lat"]]
    out: dict[str, Any] = {
        "requests": sum(len(s["lat"]) for s in samples),
        "errors": sum(s["errors"] for s in samples),
        "repeats": len(samples),
    }
    if not ok:
        out["first_status"] = next((s["first_status"] for s in samples if s["first_status"]), 0)
        return out
    for key, fn in (
        ("p50_ms", lambda s: pct(s["lat"], 0.5) * 1e3),
        ("p99_ms", lambda s: pct(s["lat"], 0.99) * 1e3),
        ("rps", lambda s: len(s["lat"]) / s["wall"]),
    ):
        med, spread = agg([fn(s) for s in ok])
        out[key], out[key.replace("_ms", "") + "_spread" + ("_ms" if "ms" in key else "")] = (
            med,
            spread,
        )
    cpus = [c for c in cpu if c is not None]
    if cpus:
        out["scorer_cpu_us_per_req"], out["scorer_cpu_spread_us"] = agg(cpus)
    return out


class Cell:
    """One (prompt kind, concurrency) cell of one path, accumulated over the repeats.

    `added[base]` holds, per repeat, (path - base) of p50 and p99 and the ratio of
    requests/s, where `base` ("direct", "envoy") ran the same cell just before the path."""

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self.cpu: list[float | None] = []
        self.added: dict[str, list[tuple[float, float, float]]] = {}
        # Per repeat: CPU µs per request of each process of the path, the sims, the
        # benchmark's own client, and the machine's busy fraction (CpuMeter).
        self.breakdown: list[dict[str, float]] = []

    def add(self, s: dict[str, Any], cpu: float | None, bases: dict[str, dict[str, Any]]) -> None:
        self.samples.append(s)
        self.cpu.append(cpu)
        if not s["lat"]:
            return
        for name, b in bases.items():
            if b["lat"]:
                self.added.setdefault(name, []).append(
                    (
                        (pct(s["lat"], 0.5) - pct(b["lat"], 0.5)) * 1e3,
                        (pct(s["lat"], 0.99) - pct(b["lat"], 0.99)) * 1e3,
                        (len(s["lat"]) / s["wall"]) / (len(b["lat"]) / b["wall"]),
                    )
                )

    def result(self) -> dict[str, Any]:
        """summarize() plus added_p50_ms / added_p99_ms / rps_ratio against each base
        (suffix `_vs_envoy` for Envoy alone; none for direct), medians over repeats."""
        out = summarize(self.samples, self.cpu)
        if self.breakdown:
            keys = sorted({k for b in self.breakdown for k in b})
            out["cpu_breakdown"] = {
                k: statistics.median(b[k] for b in self.breakdown if k in b) for k in keys
            }
        for name, rows in self.added.items():
            sfx = "" if name == "direct" else f"_vs_{name}"
            p50s = [a for a, _, _ in rows]
            out[f"added_p50_ms{sfx}"] = statistics.median(p50s)
            out[f"added_p99_ms{sfx}"] = statistics.median(b for _, b, _ in rows)
            out[f"added_p50_spread_ms{sfx}"] = max(p50s) - min(p50s)
            out[f"rps_ratio{sfx}"] = statistics.median(c for _, _, c in rows)
        return out


def measure_once(
    target: Target,
    reqs: dict[str, list[bytes]],
    concs: Sequence[int],
    seconds: float,
    baselines: dict[str, list[int]],
    cells: dict[str, Cell],
    sims: Sequence[int] = (),
) -> None:
    """One repeat of every cell of one path. Each cell first runs on every baseline
    (`direct`: the workers' ports, `envoy`: Envoy alone), then on the path, seconds
    apart, so machine load that moves over minutes cancels out of the added figures."""
    for kind, rs in reqs.items():
        for conc in concs:
            bases = {
                name: asyncio.run(run_cell(ports, rs, conc, seconds))
                for name, ports in baselines.items()
            }
            meter = CpuMeter(target.procs, sims)
            c0 = cpu_seconds(target.scorer_pid) if target.scorer_pid else None
            m0 = meter.read()
            s = asyncio.run(run_cell(target.ports, rs, conc, seconds))
            m1 = meter.read()
            cpu = None
            if c0 is not None and target.scorer_pid and s["lat"]:
                cpu = (cpu_seconds(target.scorer_pid) - c0) / len(s["lat"]) * 1e6
            cell = cells.setdefault(f"{kind}/c{conc}", Cell())
            cell.add(s, cpu, bases)
            if s["lat"]:
                cell.breakdown.append(CpuMeter.per_request(m0, m1, len(s["lat"])))


def add_deltas(results: dict[str, Any]) -> None:
    """added_p50_ms / added_p99_ms against `direct` where not measured interleaved."""
    base = results.get("direct", {}).get("cells", {})
    for res in results.values():
        for key, cell in res.get("cells", {}).items():
            b = base.get(key)
            if b and "p50_ms" in cell and "p50_ms" in b and "added_p50_ms" not in cell:
                cell["added_p50_ms"] = cell["p50_ms"] - b["p50_ms"]
                cell["added_p99_ms"] = cell["p99_ms"] - b["p99_ms"]


def print_table(results: dict[str, Any], concs: Sequence[int], log: Callable[[str], None]) -> None:
    """One line per path x prompt kind x concurrency: medians, spreads, added latency."""
    log(
        f"{'path':<40} {'prompt':>6} {'conc':>4} | {'p50 ms':>7} {'±':>5} {'p99 ms':>7} | "
        f"{'+p50 vs':>7} {'±':>5} {'+p50 vs':>7} {'+p99':>7} | {'req/s':>7} {'±':>5} "
        f"{'/envoy':>6} | {'CPU µs/req':>10}"
    )
    log(f"{'':<40} {'':>6} {'':>4} | {'':>7} {'':>5} {'':>7} | {'envoy':>7} {'':>5} "
        f"{'direct':>7} {'direct':>7} | {'':>7} {'':>5} {'':>6} |")  # fmt: skip
    for path, res in results.items():
        if "error" in res:
            log(f"{path:<40} {res['error']}")
            continue
        for key, c in res["cells"].items():
            kind, conc = key.split("/")
            if "p50_ms" not in c:
                log(f"{path:<40} {kind:>6} {conc[1:]:>4} | every request failed "
                    f"(HTTP {c.get('first_status')})")  # fmt: skip
                continue
            cpu = c.get("scorer_cpu_us_per_req")
            cpu_s = "" if cpu is None else f"{cpu:.0f} ±{c['scorer_cpu_spread_us']:.0f}"
            ve = c.get("added_p50_ms_vs_envoy")
            ve_s = "-" if ve is None else f"{ve:.2f}"
            ve_sp = c.get("added_p50_spread_ms_vs_envoy")
            ve_sp_s = "" if ve_sp is None else f"{ve_sp:.2f}"
            ratio = c.get("rps_ratio_vs_envoy")
            ratio_s = "-" if ratio is None else f"{ratio:.2f}"
            log(
                f"{path:<40} {kind:>6} {conc[1:]:>4} | {c['p50_ms']:>7.2f} "
                f"{c['p50_spread_ms']:>5.2f} {c['p99_ms']:>7.2f} | "
                f"{ve_s:>7} {ve_sp_s:>5} "
                f"{c.get('added_p50_ms', 0.0):>7.2f} {c.get('added_p99_ms', 0.0):>7.2f} | "
                f"{c['rps']:>7.0f} {c['rps_spread']:>5.0f} {ratio_s:>6} | "
                f"{cpu_s:>10}"
            )
    if not any(
        c.get("cpu_breakdown") for r in results.values() for c in r.get("cells", {}).values()
    ):
        return
    log("")
    log("CPU per request (µs, median over repeats) of each process, and the machine's busy")
    log("fraction (2 cores = 1.0) while the path ran:")
    for path, res in results.items():
        for key, c in res.get("cells", {}).items():
            bd = c.get("cpu_breakdown")
            if not bd:
                continue
            kind, conc = key.split("/")
            procs = "  ".join(f"{k[:-3]} {v:.0f}" for k, v in bd.items() if k.endswith("_us"))
            total = sum(v for k, v in bd.items() if k.endswith("_us"))
            log(
                f"{path:<40} {kind:>6} {conc[1:]:>4} | busy {bd['machine_busy']:.2f} | "
                f"total {total:.0f} | {procs}"
            )


def plot(results: dict[str, Any], out: Path) -> Path | None:
    """Added p50 at c=1 and requests/s at c=8 per path and prompt kind (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [p for p, r in results.items() if "cells" in r and p != "direct"]
    fig, axes = plt.subplots(1, 3, figsize=(20, max(4, 0.32 * len(names) + 1.5)))
    panels = (
        ("c1", "added_p50_ms_vs_envoy", "added p50 over Envoy alone at c=1 (ms)"),
        ("c1", "added_p50_ms", "added p50 over direct at c=1 (ms)"),
        ("c8", "rps", "requests/s at c=8"),
    )
    for ax, (key, field, label) in zip(axes, panels, strict=True):
        for j, kind in enumerate(KINDS):
            vals = []
            for n in names:
                c = results[n]["cells"].get(f"{kind}/{key}", {})
                vals.append(c.get(field, 0.0) or 0.0)
            ys = [i + (j - 0.5) * 0.4 for i in range(len(names))]
            ax.barh(ys, vals, height=0.4, label=f"{kind} prompt")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--paths", help="comma list (default: all; see the module docstring)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma list")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="per repeat of a cell")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument(
        "--speed",
        type=float,
        default=1e6,
        help="the sims' --speed (default 1e6: no model time, see the module docstring)",
    )
    ap.add_argument(
        "--sim-nice",
        type=int,
        choices=range(20),
        default=0,
        metavar="0-19",
        help="the sims' CPU priority (nice; default 0, the same as every router; see"
        " `kv-scorer bench --sim-nice`)",
    )
    ap.add_argument(
        "--baselines",
        default="direct,envoy",
        help="run before every cell of every path: direct, and Envoy alone (added latency "
        "is reported against each; `direct` only halves the run time)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 paths, c=1,8, 1 repeat")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "overhead.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.seconds = 1, min(args.seconds, 0.5)
        if args.concurrency == "1,8,32":
            args.concurrency = "1,8"
    paths = (
        [p.strip() for p in args.paths.split(",") if p.strip()]
        if args.paths
        else (QUICK_PATHS if args.quick else default_paths())
    )
    if "direct" not in paths:
        paths.insert(0, "direct")
    concs = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    run_dir = out.parent / "overhead-run"
    run_dir.mkdir(parents=True, exist_ok=True)
    ids = prompts(64)
    reqs = {k: [request_bytes(p, k, args.max_tokens) for p in ids] for k in KINDS}
    baselines_wanted = [b.strip() for b in args.baselines.split(",") if b.strip()]
    if not set(baselines_wanted) <= {"direct", "envoy"} or "direct" not in baselines_wanted:
        ap.error("--baselines: direct, or direct,envoy")
    load = os.getloadavg()[0]
    print(
        f"{os.cpu_count()} cores, load average {load:.1f}; {len(paths)} paths; "
        f"concurrency {concs}; {args.repeats} x {args.seconds}s per cell",
        flush=True,
    )
    group = ProcGroup(run_dir)
    cells: dict[str, dict[str, Cell]] = {p: {} for p in paths}
    errors: dict[str, str] = {}
    took: dict[str, float] = {}
    try:
        fleet = SimFleet(
            group,
            E2ESettings(
                workers=2,
                block_size=16,
                speed=args.speed,
                capacity_blocks=None,
                sim_nice=args.sim_nice,
            ),
        )
        fleet.start()
        with contextlib.ExitStack() as stack:
            # Envoy alone stays up the whole run (idle between its cells: a static cluster,
            # no health checks) as the second baseline of every cell.
            baselines = {"direct": [sp.port for sp in fleet.specs]}
            if "envoy" in baselines_wanted:
                baselines["envoy"] = stack.enter_context(envoy_alone(fleet))
            # Repeats interleaved across paths (A B C A B C ...): a path's repeats are
            # minutes apart, so a slow change in the machine's load spreads over all paths.
            for rep in range(args.repeats):
                for path in paths:
                    if path in errors:
                        continue
                    t0 = time.monotonic()
                    # A baseline is not run next to itself; `direct` has none.
                    bases = {} if path == "direct" else dict(baselines)
                    bases.pop(path, None)
                    try:
                        running = (
                            contextlib.nullcontext(
                                Target(baselines["envoy"], procs={"envoy": ENVOY_ALONE_PID[0]})
                            )
                            if path == "envoy" and "envoy" in baselines
                            else start_path(path, group, fleet, run_dir)
                        )
                        with running as target:
                            measure_once(
                                target,
                                reqs,
                                concs,
                                args.seconds,
                                bases,
                                cells[path],
                                [p.pid for p in fleet.procs],
                            )
                    except peer_mod.PeerError as e:
                        msg = str(e)
                        errors[path] = (
                            "not installed" if "not installed" in msg else msg.splitlines()[0]
                        )
                    took[path] = took.get(path, 0.0) + time.monotonic() - t0
                    print(
                        f"  [{rep + 1}/{args.repeats}] {path}: {time.monotonic() - t0:.0f}s",
                        flush=True,
                    )
    finally:
        group.stop_all()
    results: dict[str, Any] = {}
    for path in paths:
        if path in errors:
            results[path] = {"error": errors[path]}
        else:
            cs = cells[path]
            results[path] = {
                "cells": {k: c.result() for k, c in cs.items()},
                "wall_s": round(took.get(path, 0.0), 1),
            }
    add_deltas(results)
    print_table(results, concs, print)
    doc = {
        "benchmark": "overhead",
        "cores": os.cpu_count(),
        "load_average_at_start": load,
        "settings": {
            "concurrency": concs,
            "repeats": args.repeats,
            "seconds_per_repeat": args.seconds,
            "max_tokens": args.max_tokens,
            "sim_speed": args.speed,
            "sim_nice": args.sim_nice,
            "prompt_tokens": PREFIX_LEN + SUFFIX_LEN,
            "baselines": baselines_wanted,
            "order": "repeats interleaved across paths; baselines adjacent to every cell",
        },
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    png = plot(results, out.with_suffix(".png"))
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
