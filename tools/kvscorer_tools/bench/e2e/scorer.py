"""The router under test: `kv-scorer serve` for one policy with a real Envoy in front."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvscorer_tools.bench.e2e.fleet import SimFleet
from kvscorer_tools.bench.e2e.settings import MODEL, E2ESettings
from kvscorer_tools.bench.procs import (
    Proc,
    ProcGroup,
    http_get,
    kv_scorer_argv,
    scorer_ports,
    wait_until,
)


def write_stub_tokenizer(path: Path) -> Path:
    """A tiny tokenizer.json: the scorer needs *a* tokenizer for the model even though
    every benchmark prompt is token ids (taken as they are, never re-encoded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def gateway_uses_tls(gateway: str | None) -> bool:
    """Envoy AI Gateway and kgateway always connect to the picker over TLS; Istio only with
    its guide's DestinationRule, which the rendered Istio shape does not assume."""
    return gateway in ("envoy-ai-gateway", "kgateway")


def envoy_config(settings: E2ESettings, fleet: SimFleet, extproc_port: int) -> str:
    """Envoy's bootstrap for one scorer: the local shape or a gateway's."""
    from scorer.envoyproc import render_envoy_config, render_gateway_config

    if settings.gateway is None:
        return render_envoy_config(0, extproc_port, 0, response_headers=settings.response_headers)
    return render_gateway_config(
        settings.gateway,  # type: ignore[arg-type]
        [s.endpoint for s in fleet.specs],
        listener_port=0,
        admin_port=0,
        extproc_port=extproc_port,
        response_body_mode=settings.response_body_mode,
    )


def scorer_config(
    fleet: SimFleet, policy: str, settings: E2ESettings, tokenizer: Path
) -> dict[str, Any]:
    """The `kv-scorer serve` configuration for one policy over the fleet."""
    return {
        "server": {
            "host": "127.0.0.1",
            "extproc_port": 0,
            "health_port": 0,
            "admin_port": 0,
            "grace_period_s": 1.0,
            # TLS (a self-signed certificate made at start-up) when the gateway shape in
            # front connects to its picker over TLS.
            "tls": {"enabled": gateway_uses_tls(settings.gateway)},
        },
        "pool": {
            "workers": [
                {
                    "endpoint": s.endpoint,
                    "events": {"endpoint": s.events, "replay_endpoint": s.replay},
                    "metrics_url": s.url + "/metrics",
                }
                for s in fleet.specs
            ],
            "block_size": settings.block_size,
        },
        "tokens": {"models": {MODEL: {"tokenizer": str(tokenizer)}}},
        "policy": policy,
        "policies": settings.policy_options,
        # Every decision of a run stays in /debug/decisions, kept at its end (ScorerRun.
        # save_decisions) for per-request analysis (bench/routing/e2e_moves.py).
        "decisions": {"log_size": DECISION_LOG_SIZE},
        "log_level": "warning",
    }


DECISION_LOG_SIZE = 10_000


class ScorerRun:
    """`kv-scorer serve` + Envoy for one policy.

    `launch()` starts the scorer process and returns at once, `ready()` waits for it and
    starts Envoy in front of it, so several scorers can boot in parallel. Also a context
    manager (launch + ready on enter, `close()` on exit).
    """

    # Writes the tokenizer.json the scorer is configured with (a subclass may replace it:
    # bench/bench_overhead.py uses one that knows its text prompts' words).
    write_tokenizer = staticmethod(write_stub_tokenizer)

    def __init__(
        self, group: ProcGroup, fleet: SimFleet, policy: str, settings: E2ESettings
    ) -> None:
        self.group = group
        self.fleet = fleet
        self.policy = policy
        self.settings = settings
        self.scorer: Proc | None = None
        self.envoy: Any = None
        self.url = ""
        self.admin_url = ""

    def launch(self) -> ScorerRun:
        """Write the config and start `kv-scorer serve` (does not wait)."""
        d = self.settings.run_dir
        tok = self.write_tokenizer(d / "tokenizer" / "tokenizer.json")
        cfg_path = d / f"scorer-{self.policy}.yaml"
        cfg = scorer_config(self.fleet, self.policy, self.settings, tok)
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.scorer = self.group.start(
            f"scorer-{self.policy}", kv_scorer_argv("serve", "--config", str(cfg_path))
        )
        return self

    def ready(self, timeout_s: float = 60.0) -> ScorerRun:
        """Wait for the scorer's ports, then start Envoy in front of it."""
        from kvscorer_tools.envoyrun import EnvoyProcess

        if self.scorer is None:
            self.launch()
        assert self.scorer is not None
        log = self.scorer.log
        extproc, _, admin = wait_until(
            lambda: scorer_ports(log), timeout_s, f"scorer-{self.policy}", self.scorer
        )
        self.admin_url = f"http://127.0.0.1:{admin}"
        # Every policy starts alike: its scorer has read each worker's replay buffer
        # (skipping the history before the fleet's reset) before any request is sent, so
        # no sync of an earlier run's events overlaps the run.
        wait_until(self.streams_synced, timeout_s, f"scorer-{self.policy} event syncs", self.scorer)
        self.envoy = EnvoyProcess(
            envoy_config(self.settings, self.fleet, extproc),
            concurrency=self.settings.envoy_concurrency,
        )
        self.envoy.start()
        if self.envoy.proc is not None:
            self.group.record(self.envoy.proc.pid, f"envoy-{self.policy}")
        self.url = f"http://127.0.0.1:{self.envoy.listener_port}/v1/completions"
        return self

    def close(self) -> None:
        """Stop Envoy and the scorer (idempotent)."""
        if self.envoy is not None:
            with contextlib.suppress(Exception):
                self.envoy.stop()
            self.envoy = None
        if self.scorer is not None:
            self.group.stop(self.scorer)
            self.scorer = None

    def __enter__(self) -> ScorerRun:
        try:
            return self.launch().ready()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def streams_synced(self) -> bool:
        """Every worker's KV-event stream is connected and its replay sync is over (its
        outcome counted in /debug/index); a worker without a stream (events off) has
        nothing to wait for."""
        status, text = http_get(self.admin_url + "/debug/index", 5.0)
        if status != 200:
            return False
        workers = json.loads(text).get("workers", {})
        streams = [workers.get(s.endpoint, {}).get("stream") for s in self.fleet.specs]
        return all(st is None or (st.get("connected") and st.get("syncs")) for st in streams)

    def save_decisions(self, folder: Path) -> Path | None:
        """Write /debug/decisions (up to DECISION_LOG_SIZE, newest first) to the next free
        FOLDER/<policy>/<n>.json (one file per run of the policy); None when unreachable."""
        status, text = http_get(f"{self.admin_url}/debug/decisions?limit={DECISION_LOG_SIZE}", 30.0)
        if status != 200:
            return None
        d = folder / self.policy
        d.mkdir(parents=True, exist_ok=True)
        n = 1
        while (d / f"{n}.json").exists():
            n += 1
        (d / f"{n}.json").write_text(text)
        return d / f"{n}.json"

    def decision_reasons(self) -> dict[str, int]:
        """Decisions by reason, from the scorer's kv_scorer_decisions_total counter."""
        return self.counter("kv_scorer_decisions_total", ("reason",))

    def counter(self, name: str, labels: Sequence[str]) -> dict[str, int]:
        """A labelled counter of the scorer (see `counter_totals`); {} when unreachable."""
        status, text = http_get(self.admin_url + "/metrics", 5.0)
        return counter_totals(text, name, labels) if status == 200 else {}


def counter_totals(text: str, name: str, labels: Sequence[str]) -> dict[str, int]:
    """Sum a labelled Prometheus counter by the values of `labels`, keyed "a/b"."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        # Unlabelled: "name 3.0" (key ""); labelled: "name{a="x"} 3.0".
        if not line.startswith(name + "{") and not (not labels and line.startswith(name + " ")):
            continue
        found = dict(_LABEL.findall(line))
        try:
            n = int(float(line.rsplit(" ", 1)[1]))
        except (IndexError, ValueError):
            continue
        if n:
            key = "/".join(found.get(k, "") for k in labels)
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


# What the scorer did with the workers' KV events and its own speculative entries during a
# run: with the reasons, this tells a routing problem from an event-path problem.
DIAGNOSTICS = {
    "events": ("kv_scorer_events_applied_total", ("type", "outcome")),
    "speculative": ("kv_scorer_index_speculative_total", ("outcome",)),
    "syncs": ("kv_scorer_event_syncs_total", ("outcome",)),
    "sync_messages": ("kv_scorer_event_sync_messages_total", ("outcome",)),
    "gaps": ("kv_scorer_event_gaps_total", ()),
    "replays": ("kv_scorer_event_replays_total", ("outcome",)),
    "purges": ("kv_scorer_event_purges_total", ("cause",)),
    "drops": ("kv_scorer_event_drops_total", ("reason",)),
}


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def start_scorers(
    group: ProcGroup, fleet: SimFleet, policies: Sequence[str], settings: E2ESettings
) -> dict[str, ScorerRun]:
    """Boot one scorer + Envoy per policy, in parallel (imports take seconds each)."""
    runs = {p: ScorerRun(group, fleet, p, settings) for p in policies}
    try:
        for r in runs.values():
            r.launch()
        for r in runs.values():
            r.ready()
    except BaseException:
        for r in runs.values():
            r.close()
        raise
    return runs
