"""server.auth_token_file and server.debug_endpoints, over real sockets (both transports)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from configs import make_config
from extproc_helpers import WORKERS, Harness, harnesses

from scorer.api import auth
from scorer.api.auth import BearerToken
from scorer.api.v1 import scorer_pb2, scorer_pb2_grpc
from scorer.app import App
from scorer.config import ConfigError


@pytest.fixture
async def harness_asyncio() -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """The harness on the asyncio transport only (the admin checks need one transport)."""
    async with harnesses("asyncio") as make:
        yield make


async def _get(port: int, path: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{port}{path}", headers=headers) as r,
    ):
        await r.read()
        return r.status


async def _score(h: Any, token: str | None) -> grpc.StatusCode:
    stub = scorer_pb2_grpc.ScorerStub(h.channel)
    md = (("authorization", f"Bearer {token}"),) if token is not None else None
    try:
        await stub.Score(scorer_pb2.ScoreRequest(model="m", prompt="hello"), metadata=md)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_token_guards_metrics_debug_and_score(harness: Any, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")  # a mounted Secret may end with a newline
    h = await harness(server={"auth_token_file": str(token_file)})
    port = h.app.admin_port
    for path in ("/metrics", "/debug/decisions", "/debug/pool", "/debug/index"):
        assert await _get(port, path) == 401, path
        assert await _get(port, path, "wrong") == 401, path
        assert await _get(port, path, "s3cret") == 200, path
    # Probes and the data path are never guarded (the kubelet and Envoy send no token).
    assert await _get(port, "/healthz") == 200
    assert await _score(h, None) == grpc.StatusCode.UNAUTHENTICATED
    assert await _score(h, "wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert await _score(h, "s3cret") == grpc.StatusCode.OK


async def test_no_token_file_leaves_everything_open(harness_asyncio: Any) -> None:
    h = await harness_asyncio()
    assert await _get(h.app.admin_port, "/metrics") == 200
    assert await _get(h.app.admin_port, "/debug/pool") == 200
    assert await _score(h, None) == grpc.StatusCode.OK


async def test_debug_endpoints_off(harness_asyncio: Any) -> None:
    h = await harness_asyncio(server={"debug_endpoints": False})
    port = h.app.admin_port
    for path in ("/debug/decisions", "/debug/pool", "/debug/index"):
        assert await _get(port, path) == 404, path
    assert await _get(port, "/metrics") == 200
    assert await _get(port, "/readyz") in (200, 503)


def test_token_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "token"
    path.write_text("one")
    t = BearerToken(path, clock=lambda: now[0])
    assert t.allows("Bearer one") and not t.allows("Bearer two")
    assert not t.allows("Basic one") and not t.allows(None) and not t.allows("Bearer")
    path.write_text("two-longer")  # new size and mtime
    os.utime(path, ns=(1, 1))
    assert t.allows("Bearer one")  # not re-checked before RECHECK_S
    now[0] += auth.RECHECK_S
    assert t.allows("Bearer two-longer") and not t.allows("Bearer one")
    # A removed or emptied file keeps the last good token (never opens the surfaces).
    path.write_text("")
    now[0] += auth.RECHECK_S
    assert t.allows("Bearer two-longer")
    path.unlink()
    now[0] += auth.RECHECK_S
    assert t.allows("Bearer two-longer")


def test_missing_or_empty_token_file_stops_start_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.auth_token_file"):
        App(make_config(WORKERS, server={"auth_token_file": str(tmp_path / "absent")}))
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ConfigError, match=r"server\.auth_token_file"):
        App(make_config(WORKERS, server={"auth_token_file": str(tmp_path / "empty")}))
