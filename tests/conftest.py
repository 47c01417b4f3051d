"""What every suite shares: hypothesis profiles, the transport fixture, the markers.

- hypothesis: `make test` derandomized (profile `ci`), `make fuzz` random (`fuzz`).
- `transport`: the one parametrized fixture for `server.extproc_transport`; a test (or a
  fixture such as the ext_proc `harness` or the e2e `scorer`) that asks for it runs once
  per transport, asyncio and grpcio.
- event loops: every async test runs on the loop `kv-scorer serve` runs by default
  (`server.event_loop`, uvloop: what users get); those in the modules of `BOTH_LOOPS` (the
  data path through a real Envoy: plaintext, TLS, streamed response bodies) run on
  asyncio's loop too.
- `envoy` marker: put on every test that uses a fixture starting a real Envoy (found from
  the fixture's code), so `make test-quick` (`-m "not envoy and not slow"`) starts none.
  A test that starts Envoy itself carries the marker explicitly; one that forgets fails:
  while an unmarked test runs, `kvscorer_tools.envoyrun` refuses to start Envoy (an
  environment variable, so child processes such as the demo refuse too).
- `slow` marker: tests that take several seconds on their own (the quick loop skips them).
"""

from __future__ import annotations

import asyncio
import faulthandler
import inspect
import os
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import Any

import pytest
from configs import DEFAULT_LOOP
from hypothesis import HealthCheck, settings

from kvscorer_tools.envoyrun import FORBID_ENVOY_ENV
from scorer.app import loop_factory

TRANSPORTS = ("asyncio", "grpcio")
# Test modules whose async tests run on both event loops (pytest-asyncio loop factories);
# every other async test runs on the default one.
BOTH_LOOPS = ("test_e2e_envoy.py", "test_tls.py", "test_e2e_response_bodies.py")
# What a fixture calls to run the Envoy binary (kvscorer_tools.envoyrun).
_ENVOY_CALLS = ("EnvoyProcess(", "validate_config(")

# `make test`: every property test runs the same examples on every run (derandomize, no
# example database), so the suite passes or fails the same way on any clone. A
# counterexample found by `make fuzz` is kept in its test as an `@example`.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# `make fuzz` (--hypothesis-profile=fuzz): random exploration, `hypo.scaled` examples per
# test, failures printed with a reproduction blob.
settings.register_profile(
    "fuzz",
    derandomize=False,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """`server.extproc_transport` under test (module scope: module fixtures may use it)."""
    return str(request.param)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """asyncio and uvloop for the modules of `BOTH_LOOPS`, the default loop elsewhere."""
    if item.path.name in BOTH_LOOPS:
        return {"asyncio_loop": loop_factory("asyncio"), "uvloop": loop_factory("uvloop")}
    return {DEFAULT_LOOP: loop_factory(DEFAULT_LOOP)}


def _starts_envoy(func: Any) -> bool:
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    return any(call in source for call in _ENVOY_CALLS)


def _fixture_funcs(item: pytest.Item) -> Iterable[Any]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [d.func for defs in info.name2fixturedefs.values() for d in defs]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cache: dict[Any, bool] = {}
    for item in items:
        if item.get_closest_marker("envoy") is not None:
            continue
        for func in _fixture_funcs(item):
            if func not in cache:
                cache[func] = _starts_envoy(func)
            if cache[func]:
                item.add_marker(pytest.mark.envoy)
                break


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    if item.get_closest_marker("envoy") is None:
        os.environ[FORBID_ENVOY_ENV] = item.nodeid
    else:
        os.environ.pop(FORBID_ENVOY_ENV, None)
    try:
        return (yield)
    finally:
        os.environ.pop(FORBID_ENVOY_ENV, None)


# ---- hang backstop -----------------------------------------------------------------------
# pytest-timeout (`timeout`, signal method) fails a slow test cleanly and its fixtures still
# stop their processes. It cannot fire while the main thread sits in C code that does not
# return to the interpreter, nor after the session (a thread joined at exit). faulthandler's
# watchdog is a C thread needing no GIL: past the timeout plus a margin, or a minute after
# the session ended, it prints every thread's stack and exits 1. A hang is a failure.
_BACKSTOP_MARGIN_S = 60.0
_real_stderr: int | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    global _real_stderr
    # fd 2 is pytest's capture file while tests run; the watchdog writes to the terminal.
    capture = config.pluginmanager.getplugin("capturemanager")
    err = getattr(getattr(capture, "_global_capturing", None), "err", None)
    _real_stderr = getattr(err, "targetfd_save", None)


def _ini_timeout(config: pytest.Config) -> Any:
    try:
        return config.getini("timeout")
    except ValueError:  # -p no:timeout
        return None


def _watchdog(seconds: float) -> None:
    fd = _real_stderr if _real_stderr is not None else 2
    faulthandler.dump_traceback_later(seconds, exit=True, file=fd)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None]:
    # Armed from setup to the next test's setup (covers call and teardown too).
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker and marker.args else None
    timeout = timeout or item.config.getoption("timeout", None) or _ini_timeout(item.config)
    if float(timeout or 0) > 0:
        _watchdog(float(timeout) + _BACKSTOP_MARGIN_S)
    else:  # --timeout 0 (debugging): no backstop either
        faulthandler.cancel_dump_traceback_later()
    yield


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    _watchdog(_BACKSTOP_MARGIN_S)  # interpreter exit: atexit handlers, thread joins
