"""Budgets for rendering a chat template a request supplied (`tokens.allow_request_chat_template`).

A request template is code from the client. It runs in the tokens thread pool (never on the
event loop) in a sandbox with a time and an output-size budget:

* `*` and `**` are intercepted: `'a' * 200000000` or `9 ** 9 ** 9` fail before allocating;
* every call and filter refuses an integer argument above the output budget (`'a'.center(n)`,
  `range(n)`, `indent(n)`), refuses a result above it, and checks the deadline;
* `range` checks the deadline at every step, so nested loops end when the time is up;
* the output is produced chunk by chunk (`Template.generate`) and stops past the budget.

A template running only loops over request data with neither calls nor output is checked
only at its next call, filter, `range` step or output chunk (the sandbox exposes no per-
iteration hook); the body size bounds that data.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
from jinja2.sandbox import MAX_RANGE

_state = threading.local()  # the budget of the render running in this thread


class BudgetExceeded(jinja2.exceptions.SecurityError):
    """A request template went over its time or output budget."""


def _limits() -> tuple[float, int] | None:
    return getattr(_state, "limits", None)


def check(value: Any = None) -> None:
    """Raise BudgetExceeded when the deadline passed or `value` is a sized result over the
    output budget (no-op outside a budgeted render)."""
    lim = _limits()
    if lim is None:
        return
    deadline, max_chars = lim
    if time.perf_counter() > deadline:
        raise BudgetExceeded("request chat template ran out of time")
    if isinstance(value, str | list | tuple | dict) and len(value) > max_chars:
        raise BudgetExceeded("request chat template produced too much output")


def check_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse an integer argument larger than the output budget (sizes, widths, counts)."""
    lim = _limits()
    if lim is None:
        return
    for a in (*args, *kwargs.values()):
        if type(a) is int and abs(a) > lim[1]:
            raise BudgetExceeded(f"request chat template argument {a} over the budget")
    check()


def bounded_binop(op: str, left: Any, right: Any) -> Any:
    """`*` and `**` with their result size checked before it is computed."""
    lim = _limits()
    if lim is not None:
        max_chars = lim[1]
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if (
                    isinstance(seq, str | list | tuple)
                    and isinstance(n, int)
                    and len(seq) * max(n, 0) > max_chars
                ):
                    raise BudgetExceeded("request chat template repeats past the budget")
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and left.bit_length() + right.bit_length() > 4 * max_chars
            ):
                raise BudgetExceeded("request chat template number past the budget")
        elif (
            op == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right * max(left.bit_length(), 1) > 4 * max_chars
        ):
            raise BudgetExceeded("request chat template power past the budget")
        check()
    return left * right if op == "*" else left**right


def bounded_range(*args: int) -> Iterator[int]:
    """The sandbox's `range` (at most MAX_RANGE items) checking the deadline every step."""
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise OverflowError(f"range too big, maximum size for range is {MAX_RANGE}")
    for i in r:
        check()
        yield i


def bounded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter with its arguments and result checked (keeps jinja's pass_* marker)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _limits() is None:
            # Jinja's optimizer folds constant filter calls at compile time; refusing here
            # leaves them to the budgeted render.
            raise BudgetExceeded("request template filters run only within a budget")
        check_args(args, kwargs)
        out = f(*args, **kwargs)
        check(out)
        return out

    return wrapper


def render_within(template: jinja2.Template, seconds: float, max_chars: int, **context: Any) -> str:
    """Render with a deadline and an output budget (BudgetExceeded past either)."""
    _state.limits = (time.perf_counter() + seconds, max_chars)
    try:
        out: list[str] = []
        size = 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > max_chars:
                raise BudgetExceeded("request chat template produced too much output")
            check()
            out.append(chunk)
        return "".join(out)
    finally:
        _state.limits = None
