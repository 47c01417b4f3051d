"""`kv-scorer serve --pool-name vllm --pool-namespace llm` as a real subprocess against the
fake API server (KUBECONFIG), exactly the client calls it makes against a real one."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
from fake_kube import POOLS, FakeKubeAPI, inference_pool, kubeconfig, pod
from grpc_health.v1 import health_pb2_grpc
from k8s_helpers import until
from serve_proc import health_status, serve_ports


@pytest.mark.slow
async def test_serve_follows_the_inference_pool(tmp_path: Path) -> None:
    api = FakeKubeAPI()
    await api.start()
    env = dict(os.environ)
    env["KUBECONFIG"] = str(kubeconfig(tmp_path / "kubeconfig", api.port))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env.pop("KV_SCORER_SERVER__EVENT_LOOP", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scorer.cli", "serve", "--pool-name", "vllm",
        "--pool-namespace", "llm", "--policy", "round_robin", "--host", "127.0.0.1",
        "--extproc-port", "0", "--health-port", "0", "--admin-port", "0",
        stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        _, hp, ap = await serve_ports(proc.stderr, 30, event_loop="uvloop")  # the default
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{hp}") as hch,
            aiohttp.ClientSession() as http,
        ):
            health = health_pb2_grpc.HealthStub(hch)
            await until(lambda: "LIST inference.networking.k8s.io/inferencepools" in api.requests)
            # No InferencePool yet: alive, not ready.
            assert await health_status(health, "liveness") == "SERVING"
            assert await health_status(health, "readiness") == "NOT_SERVING"
            async with http.get(f"http://127.0.0.1:{ap}/readyz") as r:
                assert r.status == 503
            api.put("pods", pod("vllm-0", "10.1.0.1"))
            api.put("pods", pod("vllm-1", "10.1.0.2", ready=False))
            api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
            for _ in range(600):  # bounded (~30 s) for a loaded machine
                if await health_status(health, "readiness") == "SERVING":
                    break
                await asyncio.sleep(0.05)
            assert await health_status(health, "readiness") == "SERVING"

            async def workers() -> set[str]:
                async with http.get(f"http://127.0.0.1:{ap}/debug/pool") as r:
                    return {w["endpoint"] for w in (await r.json())["workers"]}

            assert await workers() == {"10.1.0.1:8000"}
            api.put("pods", pod("vllm-1", "10.1.0.2", ready=True))
            for _ in range(600):  # bounded (~30 s) for a loaded machine
                if await workers() == {"10.1.0.1:8000", "10.1.0.2:8000"}:
                    break
                await asyncio.sleep(0.05)
            assert await workers() == {"10.1.0.1:8000", "10.1.0.2:8000"}
            async with http.get(f"http://127.0.0.1:{ap}/debug/discovery") as r:
                d = await r.json()
            assert d["namespace"] == "llm" and d["synced"] is True
            assert d["selector"] == {"app": "vllm"} and d["target_ports"] == [8000]
            assert d["pod_watch"]["lists"] == 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await api.stop()


@pytest.mark.slow
async def test_bad_discovery_flags_stop_start_up_naming_the_field() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scorer.cli", "serve", "--endpoint-selector", "app=vllm",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"endpoint_selector needs endpoint_target_ports" in err
