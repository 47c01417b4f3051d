"""`EventIngest`: the app component that keeps the block index current from every worker.

Wiring (scorer/app.py `build_components`)::

    hasher = BlockHasher(config.pool.block_size, config.index.hash)
    index = BlockIndex(config.index)
    events = EventIngest(config, pool, index, hasher)          # optional: tokenize=callable
    components.append(events)            # start()/stop() + routes() (/debug/score, /debug/index)
    parts = Parts(hasher=hasher, index=index, events=events, ...)  # scorer.policy.parts
    # once Tokenization exists: events.tokenize = lambda model, body: <token ids or None>

It starts one `Subscriber` per pool worker that has `events` configured (when
`events.enabled`), and answers `status(endpoint)` for policies from memory only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from scorer.blocks import BlockHasher, namespace_key
from scorer.config import Config
from scorer.errors import json_error
from scorer.events.apply import BLOCK_SIZE_MISMATCH, Applier
from scorer.events.subscriber import StreamStatus, Subscriber
from scorer.index import BlockIndex
from scorer.pool import Pool
from scorer.pool.workers import PoolChange
from scorer.routing import Decision
from scorer.tasks import cancel_and_wait, wait_all

Tokenize = Callable[[str | None, dict[str, Any]], list[int] | None]


class EventIngest:
    """One subscriber per worker with `events` configured, plus the /debug routes."""

    def __init__(
        self,
        config: Config,
        pool: Pool,
        index: BlockIndex,
        hasher: BlockHasher,
        tokenize: Tokenize | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.hasher = hasher
        # Turns a /debug/score body with "prompt"/"messages" into token ids (scorer.tokens).
        self.tokenize = tokenize
        # The director's dry run (set by the app once it exists): /debug/score then also
        # shows the decision the policy would make now, without changing any state.
        self.dry_run: Callable[[dict[str, Any]], Awaitable[Decision]] | None = None
        self.applier = Applier(index, hasher)
        self.subscribers: dict[str, Subscriber] = {}
        self._context: zmq.asyncio.Context | None = None
        # Workers come and go (scorer.pool.discovery): follow the pool from now on. Their
        # subscribers' start() and stop() run as tasks: stop() cancels the starts and waits
        # for the closes (each closes its sockets before the context goes).
        self._starting: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()
        pool.subscribe(self._pool_changed)

    def _pool_changed(self, change: PoolChange) -> None:
        """Added: purge leftovers, subscribe. Removed: close its subscription first (no
        event of the old pod applies after this), then drop its index entries and free its
        index slots (pods come and go: slots stay as many as the live workers)."""
        ep = change.worker.endpoint
        sub = self.subscribers.pop(ep, None)
        if sub is not None:
            sub.cancel()
            task = asyncio.get_running_loop().create_task(sub.stop())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        if change.change == "removed":
            self.index.release(ep)
            self.applier.stats.pop(ep, None)
            # Its per-endpoint series goes too (pods churn: series must not grow).
            with contextlib.suppress(KeyError):
                BLOCK_SIZE_MISMATCH.remove(ep)
            return
        self.index.purge(ep)
        events = change.worker.config.events
        if self._context is not None and events is not None and events.mode != "pool":
            sub = Subscriber(
                ep,
                events,
                self.applier,
                self.config.events,
                self._context,
                on_disconnect=self._dropped,
            )
            self.subscribers[ep] = sub
            task = asyncio.get_running_loop().create_task(sub.start())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def start(self) -> None:
        """Open a SUB socket per worker (connect or bind, per its `events.mode`)."""
        if not self.config.events.enabled:
            return
        self._context = zmq.asyncio.Context()
        for w in list(self.pool):
            ev = w.config.events
            if ev is None or ev.mode == "pool" or w.endpoint in self.subscribers:
                continue
            sub = Subscriber(
                w.endpoint,
                ev,
                self.applier,
                self.config.events,
                self._context,
                on_disconnect=self._dropped,
            )
            self.subscribers[w.endpoint] = sub
            await sub.start()

    def _dropped(self, endpoint: str) -> None:
        # Evidence for scorer.pool.health (confirmed by a probe of the serving port).
        self.pool.report(endpoint, "events_dropped", "KV-event stream disconnected")

    async def stop(self) -> None:
        """Stop every subscriber, then the ZMQ context. A cancellation of the caller
        propagates (never swallowed by a wait for a subscriber); the context still goes."""
        try:
            await cancel_and_wait(*self._starting)
            for sub in list(self.subscribers.values()):
                await sub.stop()
            self.subscribers.clear()
            await wait_all(*self._closing)
        finally:
            if self._context is not None:
                # destroy, not term: term() blocks in libzmq while any socket is still
                # open, so a leaked one would hang shutdown; every subscriber is stopped by
                # now (or the stop was cancelled: destroy closes what is left).
                self._context.destroy(linger=0)
                self._context = None

    def status(self, endpoint: str) -> StreamStatus:
        """The worker's stream status (a fresh disconnected status when it has no stream)."""
        sub = self.subscribers.get(endpoint)
        return sub.status if sub is not None else StreamStatus()

    # ---- admin routes ------------------------------------------------------------------

    def routes(self) -> list[tuple[str, str, Callable[[web.Request], Any]]]:
        return [
            ("POST", "/debug/score", self.debug_score),
            ("GET", "/debug/index", self.debug_index),
        ]

    def score(
        self,
        token_ids: list[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """The /debug/score answer for a token list (every known worker, best first)."""
        return self.score_keys(self.hasher.keys(token_ids, namespace_key(lora_name, cache_salt)))

    def score_keys(self, keys: list[int]) -> dict[str, Any]:
        """The /debug/score answer for block keys (reads the index: on the event loop)."""
        matches = self.index.match(keys)
        bs = self.hasher.block_size
        endpoints = list(self.pool.workers)
        endpoints += [ep for ep in self.index.endpoints() if ep not in self.pool.workers]
        workers: list[dict[str, Any]] = []
        for ep in endpoints:
            m = matches.get(ep)
            workers.append(
                {
                    "endpoint": ep,
                    "matched_blocks": m.blocks if m else 0,
                    "matched_tokens": m.blocks * bs if m else 0,
                    "by_medium": dict(m.by_medium) if m else {},
                    "weighted": m.weighted if m else 0.0,
                }
            )
        workers.sort(key=lambda w: (-float(w["weighted"]), str(w["endpoint"])))
        return {"block_size": bs, "blocks": len(keys), "workers": workers}

    async def debug_score(self, request: web.Request) -> web.Response:
        """POST /debug/score {"model", "token_ids" | "prompt" | "messages", "cache_salt"?}.

        Parsing, tokenizing and hashing run in a worker thread (a 1 MB prompt must not stall
        the event loop); the decision is the director's dry run, the request path's own."""
        raw = await request.read()
        try:
            body = await asyncio.to_thread(json.loads, raw)
        except (ValueError, RecursionError):
            return _error(400, "body is not JSON (or nested too deeply)")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        try:
            keys = await asyncio.to_thread(self._body_keys, body)
        except _BadScoreBody as e:
            return _error(e.status, str(e))
        out = self.score_keys(keys)
        model = body.get("model")
        if self.dry_run is not None and isinstance(model, str):
            # What the policy would decide now, changing no state (the director's dry run).
            out["decision"] = (await self.dry_run(body)).as_dict()
        return web.json_response(out)

    def _body_keys(self, body: dict[str, Any]) -> list[int]:
        """Block keys of a /debug/score body (runs in a worker thread: no index access)."""
        model = body.get("model")
        ids = body.get("token_ids")
        if ids is None and self.tokenize is not None:
            try:
                ids = self.tokenize(model if isinstance(model, str) else None, body)
            except Exception as e:  # the tokenizer's own error, reported to the operator
                # A prompt past the tokens budget carries its 413 (PromptTooLarge.status).
                status = getattr(e, "status", 400)
                raise _BadScoreBody(f"cannot tokenize: {e}", status) from None
        limit = self.config.tokens.max_prompt_tokens
        if isinstance(ids, list) and len(ids) > limit:  # the data path's budget, counted first
            raise _BadScoreBody(
                f"the prompt has {len(ids)} tokens, over this router's limit of {limit} "
                "(tokens.max_prompt_tokens)",
                413,
            )
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in ids
        ):
            raise _BadScoreBody("token_ids must be a list of non-negative 32-bit integers")
        salt = body.get("cache_salt")
        lora = body.get("lora_name")
        if lora is None and isinstance(model, str):
            lora = self.config.tokens.adapter_of(model)
        ns = namespace_key(
            lora if isinstance(lora, str) else None, salt if isinstance(salt, str) else None
        )
        return self.hasher.keys(ids, ns)

    def index_report(self) -> dict[str, Any]:
        """Per worker: blocks by medium, last seq per rank, event age, gaps, replays, ..."""
        now = time.monotonic()
        endpoints = list(self.pool.workers)
        endpoints += [ep for ep in self.index.endpoints() if ep not in self.pool.workers]
        out: dict[str, Any] = {}
        for ep in endpoints:
            st = self.index.stats(ep)
            sub = self.subscribers.get(ep)
            ap = self.applier.stats.get(ep)
            rep: dict[str, Any] = {
                "blocks": st["blocks"],
                "speculative": st["speculative"],
                "evictions": st["evictions"],
                "stream": None,
            }
            if ap is not None:
                rep["events"] = {
                    "stored_blocks": ap.stored,
                    "removed_blocks": ap.removed,
                    "cleared": ap.cleared,
                    "unknown_parent": ap.unknown_parent,
                    "unknown_hash": ap.unknown_hash,
                    "other_group": ap.other_group,
                    "block_size_mismatch": ap.block_size_mismatch,
                    "engine_block_size": ap.last_block_size,
                }
            if sub is not None:
                s = sub.status
                rep["stream"] = {
                    "endpoint": sub.events.endpoint,
                    "mode": sub.events.mode,
                    "connected": s.connected,
                    "last_seq": {str(r): q for r, q in sub.stats.last_seq.items()},
                    "seconds_since_last_event": (
                        None if s.last_event_at is None else round(now - s.last_event_at, 3)
                    ),
                    "messages": sub.stats.messages,
                    "gaps": sub.stats.gaps,
                    "replays": dict(sub.stats.replays),
                    "purges": dict(sub.stats.purges),
                    "decode_errors": dict(sub.stats.decode_errors),
                    "drops": dict(sub.stats.drops),
                    "restarts": sub.stats.restarts,
                    "syncs": dict(sub.stats.syncs),
                    "warm_messages": sub.stats.warm_messages,
                    "sync_skipped": sub.stats.sync_skipped,
                    "unrecovered_gap": s.unrecovered_gap,
                    "bind_error": sub.stats.bind_error,
                }
            out[ep] = rep
        return {"block_size": self.hasher.block_size, "hash": self.hasher.algo, "workers": out}

    async def debug_index(self, request: web.Request) -> web.Response:
        """GET /debug/index."""
        return web.json_response(self.index_report())


class _BadScoreBody(ValueError):
    """A /debug/score body that cannot be scored (400; 413 past the prompt budget)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> web.Response:
    return json_error(status, message)
