"""The one switch between the compiled hot paths and the pure-Python reference code.

`NATIVE` is the compiled module `scorer.native._speedups` (scorer/native/_speedups.pyx,
built by `make` / `pip install`) when it imports, else None. `KV_SCORER_PURE_PYTHON=1` in
the environment forces None. Callers (block hashing, event decoding and applying, the
index's engine-key maps) run the compiled code when it is there and their own Python code
otherwise; the Python code is the reference the differential tests compare against.
"""

from __future__ import annotations

import os
from types import ModuleType

ENV_PURE = "KV_SCORER_PURE_PYTHON"


def load() -> ModuleType | None:
    """The compiled module, or None (not built, or forced off by KV_SCORER_PURE_PYTHON)."""
    if os.environ.get(ENV_PURE, "").strip() not in ("", "0"):
        return None
    try:
        from scorer.native import _speedups
    except ImportError:  # built without a C compiler: the pure-Python code runs
        return None
    return _speedups


NATIVE: ModuleType | None = load()
