"""Peer routers in the end-to-end benchmark, fronting the same simulated workers.

* ``sglang_cache_aware``: sglang-router 0.3.2 (PyPI ``sglang-router``), policy
  ``cache_aware`` — an approximate radix tree of the prompts it routed, with load-balance
  thresholds. Started as ``python -m sglang_router.launch_router --worker-urls ...
  --policy cache_aware`` (the launcher's documented form).
* ``vllm_router_cache_aware``: vllm-router (PyPI ``vllm-router`` 0.1.17), policy
  ``cache_aware`` — the same approximate-tree idea as sglang-router's (vllm-router is
  its fork), on token-id prompts as well.
* ``vllm_router_kv_aware``: vllm-router (PyPI ``vllm-router`` 0.1.17), policy
  ``kv_aware`` — routes by the workers' ZMQ KV events, tokenizing through the workers'
  ``/tokenize`` endpoint. Flags from the installed launcher's ``--help``:
  ``--kv-event-source WORKER_URL=ENDPOINT``, ``--kv-event-replay-source``,
  ``--kv-event-block-size``, ``--kv-event-model``.

With ``E2ESettings.peers_behind_envoy`` each peer gets an Envoy of its own in front (a plain
route to the peer, no ext_proc: `scorer.envoyproc.render_envoy_config`'s `direct`
listener, the overhead benchmark's "Envoy alone"), and the load goes to that Envoy.

The ``round_robin`` policy of each (``sglang_round_robin``, ``vllm_router_round_robin``) is
available too (the overhead benchmark runs it). All are optional
(``pip install -e './tools[peers]'``). A peer that is not installed,
does not start or fails its requests gets ``{"error": "..."}`` in the results and the run goes on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

from kvscorer_tools.bench.e2e.breakdown import add_breakdown, log_marks
from kvscorer_tools.bench.e2e.cpu import CpuMeter
from kvscorer_tools.bench.e2e.fleet import SimFleet
from kvscorer_tools.bench.e2e.load import run_load
from kvscorer_tools.bench.e2e.settings import PEER_POLICIES, ROUTING_PEERS, E2ESettings
from kvscorer_tools.bench.e2e.summary import summarize
from kvscorer_tools.bench.procs import Proc, ProcError, ProcGroup, free_port, http_get, wait_until
from kvscorer_tools.bench.workloads import Workload

# Every peer configuration (name -> (module, --policy)): the routing benchmark runs
# ROUTING_PEERS by default, the overhead benchmark (bench/bench_overhead.py) all of them.
# Same launchers and flags; only the policy differs.
PEERS = PEER_POLICIES


class PeerError(RuntimeError):
    """A peer router is not installed or could not be started."""


# Each launcher's name for its quietest useful log level.
_LOG_LEVEL = {"sglang_router": "warn", "vllm_router": "warning"}


def peer_argv(name: str, fleet: SimFleet, settings: E2ESettings, port: int) -> list[str]:
    """The command line of peer `name` fronting `fleet` on `port`."""
    module, policy = PEER_POLICIES.get(name, ("", ""))
    if module not in _LOG_LEVEL:
        raise PeerError(f"unknown peer {name!r} (known: {', '.join(PEER_POLICIES)})")
    metrics_port = str(free_port())  # both default to a fixed Prometheus port; avoid clashes
    argv = [
        sys.executable, "-m", f"{module}.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(s.url for s in fleet.specs),
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", metrics_port,
        "--log-level", _LOG_LEVEL[module],
    ]  # fmt: skip
    if module == "vllm_router" and policy == "kv_aware":
        # vllm-router's kv_aware reads each worker's ZMQ KV events (and their replay).
        argv += ["--kv-event-block-size", str(settings.block_size)]
        argv += ["--kv-event-model", "bench-model"]
        for s in fleet.specs:
            argv += ["--kv-event-source", f"{s.url}={s.events}"]
            argv += ["--kv-event-replay-source", f"{s.url}={s.replay}"]
    return argv


def start_peer(
    name: str, group: ProcGroup, fleet: SimFleet, settings: E2ESettings
) -> tuple[Proc, str]:
    """Start peer `name` (a PEER_POLICIES key) in front of `fleet` and wait for /health.

    Returns the process and its base URL. Raises PeerError when the peer is
    not installed or does not come up."""
    module = PEER_POLICIES.get(name, ("", ""))[0]
    if not module:
        raise PeerError(f"unknown peer {name!r}")
    if importlib.util.find_spec(module) is None:
        raise PeerError(f"{module} is not installed (pip install -e './tools[peers]')")
    port = free_port()
    proc = group.start(name, peer_argv(name, fleet, settings, port))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_get(base + "/health", 1.0)[0] == 200, 90.0, name, proc)
    except ProcError as e:
        group.stop(proc)
        raise PeerError(str(e)) from e
    return proc, base


@contextlib.contextmanager
def plain_envoy(backends: list[str], concurrency: int = 1) -> Iterator[tuple[int, int]]:
    """Envoy round-robining to `backends` (ip:port) with no ext_proc (the `direct`
    listener of scorer.envoyproc.render_envoy_config): yields (its port, its pid)."""
    from kvscorer_tools.envoyrun import EnvoyProcess
    from scorer.envoyproc import render_envoy_config

    cfg = render_envoy_config(0, free_port(), 0, direct_backends=backends, direct_port=0)
    with EnvoyProcess(cfg, concurrency=concurrency) as envoy:
        assert envoy.proc is not None
        yield envoy.listener_ports["direct"], envoy.proc.pid


@contextlib.contextmanager
def front_envoy(base: str, settings: E2ESettings) -> Iterator[tuple[str, int]]:
    """An Envoy routing everything to the router at `base` (http://ip:port): yields (its
    URL, its pid)."""
    with plain_envoy([base.removeprefix("http://")], settings.envoy_concurrency) as (port, pid):
        yield f"http://127.0.0.1:{port}", pid


def run_peer(
    name: str, group: ProcGroup, fleet: SimFleet, wl: Workload, settings: E2ESettings
) -> dict[str, Any]:
    """Start peer `name` in front of `fleet` (caches reset), run the workload, stop it."""
    fleet.reset()
    proc, base = start_peer(name, group, fleet, settings)
    try:
        with contextlib.ExitStack() as stack:
            router = [proc.pid]
            if settings.peers_behind_envoy:
                base, envoy_pid = stack.enter_context(front_envoy(base, settings))
                router.append(envoy_pid)
            return _measure(name, proc, base, router, fleet, wl, settings)
    finally:
        group.stop(proc)


def _measure(
    name: str,
    proc: Proc,
    base: str,
    router: list[int],
    fleet: SimFleet,
    wl: Workload,
    settings: E2ESettings,
) -> dict[str, Any]:
    """Run the workload through `base` (the peer, or its Envoy) and summarize it."""
    before = fleet.counters()
    # sglang-router 0.3.2 accepts only text prompts on /v1/completions (HTTP 422 for
    # token ids): it gets the same prompts as "t<id>" words (see completion_body).
    text = PEER_POLICIES[name][0] == "sglang_router"
    marks = log_marks(fleet.request_logs)
    cpu = CpuMeter({"sims": [p.pid for p in fleet.procs], "router": router})
    res = run_load(base + "/v1/completions", wl, settings, name, text)
    cpu_s = cpu.done()
    after = fleet.counters()
    out = summarize(res, before, after, settings.speed, len(wl))
    add_breakdown(out, res, fleet, marks, settings.speed, name)
    out["cpu_s"] = cpu_s
    if res.done == 0:
        raise PeerError(f"every request failed; first: {res.first_error}\n{proc.log_tail()}")
    return out


__all__ = [
    "PEERS",
    "PEER_POLICIES",
    "ROUTING_PEERS",
    "PeerError",
    "front_envoy",
    "peer_argv",
    "plain_envoy",
    "run_peer",
    "start_peer",
]
