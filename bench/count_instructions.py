"""Instructions the scorer process executes per request through a real Envoy (callgrind).

    .venv/bin/python bench/count_instructions.py [--paths kv:local,round_robin:local]
        [--kinds ids,text] [--requests 300] [--warmup 1100] [--keep DIR]

Time on this machine swings run to run (a shared VM: ±50 % between two idle runs of the
same code), so A/Bs of the data path by CPU time need many alternated runs and still blur
changes of a few percent. Instructions do not: the same code, requests and configuration
give the same count within a fraction of a percent whatever else the host runs.

Per path (`POLICY:SHAPE`, shapes as in bench/bench_overhead.py: `local` = envoy/envoy.yaml,
`local-full`, `istio`, `envoy-ai-gateway`, `kgateway`) and prompt kind: two `kv-scorer sim`
workers, `kv-scorer serve` started under `valgrind --tool=callgrind`, Envoy in front;
the workers' caches reset first, so each run's requests bring the same KV events;
`--warmup` requests, then the counts are zeroed (`callgrind_control --zero`), `--requests`
non-streaming completions are sent one at a time (bench_overhead.py's requests: 288-token
prompts, token ids or the same as text), and the counts are dumped (`--dump`); then the
same for an idle window as long as the measured one (the scorer's background work:
metric scrapes, every 5 s here, health probes, event streams), which is subtracted.
Reports instructions (Ir) per request of the scorer process, its user-space side only:
the kernel's share of its system calls is not counted (the number of reads and writes
per request is what moves that). Under
valgrind the scorer runs ~50x slower, which changes timing-dependent batching (several
requests' frames in one read at c > 1), so the requests go one at a time. Writes
bench/out/instructions.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_extproc import Conn  # noqa: E402
from bench_overhead import LOCAL_SHAPES, TokenizerScorerRun, prompts, request_bytes  # noqa: E402
from callgrind import control, instructions  # noqa: E402

from kvscorer_tools.bench.e2e import E2ESettings, SimFleet  # noqa: E402
from kvscorer_tools.bench.procs import ProcGroup, kv_scorer_argv  # noqa: E402


class CallgrindScorerRun(TokenizerScorerRun):
    """The overhead benchmark's scorer, started under callgrind."""

    out_file = ""

    def launch(self) -> CallgrindScorerRun:
        d = self.settings.run_dir
        tok = self.write_tokenizer(d / "tokenizer" / "tokenizer.json")
        cfg_path = d / f"scorer-{self.policy}.yaml"
        import yaml

        from kvscorer_tools.bench.e2e.scorer import scorer_config

        cfg = scorer_config(self.fleet, self.policy, self.settings, tok)
        # Background work is counted apart (an idle window) but varies with valgrind's
        # timing: scrapes every 5 s instead of 0.2 (valgrind runs ~50x slower: that is
        # still one every ~0.1 s of the scorer's real time), the load view fresh meanwhile.
        cfg["load"] = {"scrape_interval_s": 5.0, "stale_after_s": 600.0}
        # The default decision log (1,000), full before the count starts (--warmup): while a
        # log fills, every decision it keeps is new memory and the cyclic GC runs often
        # (one collection in the window moves the count per request by 10-40 %); once it
        # is full each kept decision frees the one it evicts (README "Data path").
        cfg.pop("decisions", None)
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.out_file = str(d / "callgrind.out")
        argv = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out_file}",
            *kv_scorer_argv("serve", "--config", str(cfg_path)),
        ]  # fmt: skip
        self.scorer = self.group.start(f"scorer-{self.policy}", argv)
        return self


async def send(port: int, reqs: list[bytes]) -> int:
    conn = await Conn.open(port)
    ok = 0
    try:
        for r in reqs:
            ok += await conn.post(r) == 200
    finally:
        conn.close()
    return ok


def measure(
    group: ProcGroup, fleet: SimFleet, run_dir: Path, path: str, kind: str, args: argparse.Namespace
) -> dict[str, Any]:
    policy, shape = path.split(":", 1)
    settings = E2ESettings(
        workers=len(fleet.specs),
        block_size=16,
        run_dir=run_dir / f"{policy}-{shape}-{kind}",
        gateway=None if shape in LOCAL_SHAPES else shape,
        response_body_mode="NONE" if shape in LOCAL_SHAPES else "FULL_DUPLEX_STREAMED",
        response_headers=shape == "local-full",
    )
    # Every measurement starts from empty worker caches: the same prompts then bring the
    # same KV events (their decoding and applying is per-request work too).
    fleet.reset()
    run = CallgrindScorerRun(group, fleet, policy, settings)
    run.launch()
    try:
        run.ready(timeout_s=600.0)
        assert run.scorer is not None and run.envoy is not None
        pid = run.scorer.pid
        port = run.envoy.listener_port
        ps = prompts(args.warmup + args.requests, seed=1)
        reqs = [request_bytes(p, kind, args.max_tokens) for p in ps]
        warm = asyncio.run(send(port, reqs[: args.warmup]))
        out = Path(run.out_file)
        control(pid, "--zero")  # counts from here
        t0 = time.perf_counter()
        ok = asyncio.run(send(port, reqs[args.warmup :]))
        took = time.perf_counter() - t0
        control(pid, "--dump=measured")  # the first dump: OUT.1
        ir = instructions(out.with_name(out.name + ".1"))
        control(pid, "--zero")
        time.sleep(took)  # an idle window as long: the background work's share
        control(pid, "--dump=idle")
        idle = instructions(out.with_name(out.name + ".2"))
        if args.keep:
            keep = Path(args.keep)
            keep.mkdir(parents=True, exist_ok=True)
            name = f"{policy}-{shape}-{kind}-{len(list(keep.glob('*.measured')))}"
            shutil.copy(out.with_name(out.name + ".1"), keep / f"{name}.measured")
            shutil.copy(out.with_name(out.name + ".2"), keep / f"{name}.idle")
        return {
            "path": path,
            "kind": kind,
            "requests": args.requests,
            "ok": ok,
            "warmup_ok": warm,
            "ir_total": ir,
            "ir_idle_same_time": idle,
            "ir_per_request": round((ir - idle) / max(ok, 1)),
            "seconds_under_valgrind": round(took, 1),
        }
    finally:
        run.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--paths", default="kv:local,round_robin:local")
    ap.add_argument("--kinds", default="ids,text")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=1100, help="more than the decision log")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "instructions.json"))
    ap.add_argument(
        "--keep", metavar="DIR", help="copy each callgrind dump here (callgrind_annotate them)"
    )
    args = ap.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (callgrind) is not installed", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvs-ir-") as tmp:
        run_dir = Path(tmp)
        group = ProcGroup(run_dir)
        try:
            fleet = SimFleet(
                group, E2ESettings(workers=2, block_size=16, speed=1000.0, capacity_blocks=None)
            )
            fleet.start()
            for path in args.paths.split(","):
                for kind in args.kinds.split(","):
                    row = measure(group, fleet, run_dir, path, kind, args)
                    rows.append(row)
                    print(
                        f"{path:>24} {kind:>4}: {row['ir_per_request']:>10,} instructions per "
                        f"request ({row['ok']}/{args.requests} ok)",
                        flush=True,
                    )
        finally:
            group.stop_all()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "scorer_instructions", "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
