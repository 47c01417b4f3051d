"""Optional bearer token for the read surfaces: `/metrics`, `/debug/*` and `scorer.v1 Score`.

`server.auth_token_file` names a file holding the token (surrounding whitespace ignored,
as a Kubernetes Secret mounted as a file has it). Off by default. The file is re-read when
it changes (its mtime, size or inode, checked at most once per `RECHECK_S`), so a rotated
Secret takes effect without a restart; a file that disappears or becomes empty keeps the
last good token (logged) rather than opening the surfaces. Comparison is constant time.
The ext_proc data path and the health endpoints are never guarded: Envoy and the kubelet
do not send a token.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from scorer.api.v1 import scorer_pb2, scorer_pb2_grpc

log = logging.getLogger(__name__)

RECHECK_S = 1.0
# Paths of the admin server that need the token (prefix match).
GUARDED_PREFIXES = ("/metrics", "/debug/")


class TokenError(ValueError):
    """The token file cannot be read or is empty (at start-up)."""


class BearerToken:
    """The expected token, re-read from its file when the file changes."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.clock = clock
        self._token = self._read()
        self._stamp = self._stat()
        self._checked = clock()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> bytes:
        try:
            token = self.path.read_bytes().strip()
        except OSError as e:
            raise TokenError(
                f"server.auth_token_file: cannot read {self.path}: {e.strerror}"
            ) from e
        if not token:
            raise TokenError(f"server.auth_token_file: {self.path} is empty")
        return token

    def current(self) -> bytes:
        """The token now (re-read if the file changed since the last check)."""
        now = self.clock()
        if now - self._checked >= RECHECK_S:
            self._checked = now
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._token = self._read()
                    log.warning("auth token reloaded from %s", self.path)
                except TokenError as e:
                    log.error("%s; keeping the previous token", e)
        return self._token

    def allows(self, authorization: str | None) -> bool:
        """True when `authorization` is `Bearer <the token>`."""
        if not authorization:
            return False
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.strip().encode(), self.current())


def admin_middleware(token: BearerToken) -> Any:
    """aiohttp middleware: 401 on guarded paths without the right bearer token."""

    @web.middleware
    async def check(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path.startswith(GUARDED_PREFIXES) and not token.allows(
            request.headers.get("Authorization")
        ):
            return web.json_response(
                {"error": "unauthorized: send Authorization: Bearer <token>"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="kv-scorer"'},
            )
        return await handler(request)

    return check


def metadata_authorization(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The `authorization` value of gRPC call metadata (grpc.aio or our H2 transport)."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


class GuardedScorer(scorer_pb2_grpc.ScorerServicer):
    """`scorer.v1.Scorer` behind the bearer token: UNAUTHENTICATED without it."""

    def __init__(self, inner: Any, token: BearerToken) -> None:
        self.inner = inner
        self.token = token

    async def Score(self, request: scorer_pb2.ScoreRequest, context: Any) -> Any:
        if not self.token.allows(metadata_authorization(context.invocation_metadata())):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "send metadata authorization: Bearer <token>",
            )
        return await self.inner.Score(request, context)
