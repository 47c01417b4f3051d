"""The one way tests build a scorer `Config`: `make_config(workers, **sections)`.

Loopback, ports chosen by the OS, a short grace period, `round_robin` unless a test names
a policy (deterministic, needs no tokenizer); validated by `load_config` with the
environment ignored, exactly as `kv-scorer serve` validates a file (so a bad test config
fails the way a user's would).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from scorer.app import loop_factory
from scorer.config import Config, ServerConfig, load_config

T = TypeVar("T")

# The event loop `kv-scorer serve` runs by default (`server.event_loop`): tests run on it.
DEFAULT_LOOP = ServerConfig().event_loop

LOOPBACK_SERVER: dict[str, Any] = {
    "host": "127.0.0.1",
    "extproc_port": 0,
    "health_port": 0,
    "admin_port": 0,
    "grace_period_s": 0.5,
}


def make_config(workers: Sequence[str | Mapping[str, Any]] = (), **sections: Any) -> Config:
    """A Config over `workers` (endpoints "ip:port" or worker mappings).

    Each keyword is a top-level section: `policy="kv"`, `pool={"block_size": 16}`,
    `server={"extproc_transport": "grpcio"}`. A mapping is merged into the defaults
    (`server`, `pool`) one level deep; anything else replaces them.
    """
    data: dict[str, Any] = {
        "server": dict(LOOPBACK_SERVER),
        "pool": {"workers": [w if isinstance(w, str) else dict(w) for w in workers]},
        "policy": "round_robin",
    }
    for key, value in sections.items():
        if isinstance(value, Mapping) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return load_config(overrides=data, environ={})


def new_default_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the kind `kv-scorer serve` runs by default (tests' private loops)."""
    return loop_factory(DEFAULT_LOOP)()


def run_on_default_loop(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the default event loop (sync tests that drive a coroutine)."""
    with asyncio.Runner(loop_factory=loop_factory(DEFAULT_LOOP)) as runner:
        return runner.run(coro)
