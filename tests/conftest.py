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
import contextlib
import faulthandler
import gc
import inspect
import os
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Mapping
from typing import Any

import pytest
import zmq.asyncio
from configs import DEFAULT_LOOP
from hypothesis import HealthCheck, settings
from ports import HeldPort

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


@pytest.fixture
def closed_port() -> Generator[Callable[[], int], None, None]:
    """Makes loopback ports nothing listens on, each held bound until the test ends
    (tests/ports.py: a bind-and-closed port may be taken meanwhile by any port-0 bind)."""
    held: list[HeldPort] = []

    def make() -> int:
        held.append(HeldPort())
        return held[-1].port

    yield make
    for h in held:
        h.close()


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
# Three layers, each armed per test from its setup to the next test's setup:
# - pytest-timeout (`timeout`, signal method) fails a slow test cleanly and its fixtures
#   still stop their processes;
# - its signal does not end a test whose uvloop loop sits idle (awaiting what never comes),
#   so 2 s later a thread cancels every task of the running loops (the test fails, its
#   fixtures still run);
# - neither can act while the main thread sits in C code that does not return to the
#   interpreter, nor after the session (a thread joined at exit): faulthandler's watchdog,
#   a C thread needing no GIL, past the timeout plus a margin (or a minute after the
#   session ended) prints every thread's stack, just after a Python thread printed every
#   loop's tasks with their awaits, and exits 1. A hang is a failure.
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


_task_timer: threading.Timer | None = None
_cancel_timer: threading.Timer | None = None
# After pytest-timeout's own signal: the time it gets to end the test first.
_CANCEL_AFTER_S = 2.0


def _running_loops() -> list[asyncio.AbstractEventLoop]:
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
    return [loop for loop in loops if loop.is_running() and not loop.is_closed()]


def _cancel_tasks(fd: int) -> None:
    """pytest-timeout's signal cannot end a test whose uvloop loop idles (uvloop runs the
    handler as a callback; its exception goes nowhere): cancel the loop's tasks instead,
    from this thread, so the test fails and its fixtures still stop what they started."""
    for loop in _running_loops():
        with contextlib.suppress(OSError):
            os.write(fd, b"\nHang backstop: test timed out on an idle loop; cancelling\n")

        def cancel_all(loop: asyncio.AbstractEventLoop = loop) -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()

        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(cancel_all)


def _dump_tasks(fd: int) -> None:
    """Every running event loop's tasks, each with its chain of awaits: a hang on an idle
    loop shows only `asyncio.run` in faulthandler's dump; this says what it waits for."""
    lines = ["", "Hang backstop: asyncio tasks of running loops"]
    for loop in _running_loops():
        with contextlib.suppress(RuntimeError):  # the set changed while we read it
            for task in list(asyncio.all_tasks(loop)):
                lines.append(f"  {task.get_name()}:")
                coro: Any = task.get_coro()
                while coro is not None:
                    frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                    if frame is not None:
                        code = frame.f_code
                        lines.append(f"    {code.co_filename}:{frame.f_lineno} {code.co_name}")
                    coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    with contextlib.suppress(OSError):
        os.write(fd, ("\n".join(lines) + "\n").encode())


def _watchdog(seconds: float, timeout: float | None = None) -> None:
    global _task_timer, _cancel_timer
    fd = _real_stderr if _real_stderr is not None else 2
    faulthandler.dump_traceback_later(seconds, exit=True, file=fd)
    if _task_timer is not None:
        _task_timer.cancel()
    # Just before faulthandler exits the process (a Python thread: needs the GIL, which an
    # idle loop releases).
    _task_timer = threading.Timer(max(0.0, seconds - 5.0), _dump_tasks, (fd,))
    _task_timer.daemon = True
    _task_timer.start()
    if _cancel_timer is not None:
        _cancel_timer.cancel()
        _cancel_timer = None
    if timeout is not None:
        _cancel_timer = threading.Timer(timeout + _CANCEL_AFTER_S, _cancel_tasks, (fd,))
        _cancel_timer.daemon = True
        _cancel_timer.start()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None]:
    # Armed from setup to the next test's setup (covers call and teardown too).
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker and marker.args else None
    timeout = timeout or item.config.getoption("timeout", None) or _ini_timeout(item.config)
    if float(timeout or 0) > 0:
        _watchdog(float(timeout) + _BACKSTOP_MARGIN_S, float(timeout))
    else:  # --timeout 0 (debugging): no backstop either
        faulthandler.cancel_dump_traceback_later()
        for timer in (_task_timer, _cancel_timer):
            if timer is not None:
                timer.cancel()
    yield


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    _watchdog(_BACKSTOP_MARGIN_S)  # interpreter exit: atexit handlers, thread joins


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """One asyncio ZMQ context per test, destroyed after it.

    `Context.term()` blocks in libzmq until every socket is closed, so one socket left open
    (a test that failed before its cleanup, a task that never ran its `finally`) would hang
    the run. Teardown closes the leftovers with linger 0 instead, then fails the test
    naming them: a leak is a bug, never a hang.
    """
    c = zmq.asyncio.Context()
    try:
        yield c
    finally:
        gc.collect()  # an unreachable socket is closed by its finalizer, not a leak
        # pyzmq keeps a weak set of the context's sockets (what `destroy()` closes).
        left = [s for s in list(getattr(c, "_sockets", ())) if not s.closed]
        kinds = sorted(zmq.SocketType(s.type).name for s in left)
        c.destroy(linger=0)
    if left:
        pytest.fail(f"test left {len(left)} ZMQ socket(s) open: {kinds}")
