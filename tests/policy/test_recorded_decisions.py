"""Decisions of the shipped policies are pinned on the replay workloads.

bench/record_decisions.py recorded every decision (endpoint, reason, notes) of `kv`,
`approx`, `session`, `least_loaded` and `round_robin` on the reduced workload set; the
same replay must give the same decisions. A change that moves decisions on purpose
re-records (`python bench/record_decisions.py --set reduced`) and says why.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "record_decisions.py"


def _recorder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("record_decisions", _SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["kv", "approx", "session", "least_loaded", "round_robin"])
def test_reduced_set_decides_as_recorded(policy: str) -> None:
    rec = _recorder()
    expected = rec.load("reduced")
    got = rec.record("reduced", (policy,))
    for wl in expected["workloads"].values():
        wl["decisions"] = {policy: wl["decisions"][policy]}
    assert rec.diff(expected, got) == []
