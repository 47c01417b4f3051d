"""bench/profile_datapath.py runs end to end (a few requests, its own process: it patches
timers into the transport) and reports every message kind of a streamed request, each
stage, on the fast path and with it off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"request_headers", "request_body", "response_headers", "response_body", "end_of_stream"}


@pytest.mark.parametrize(("reference", "tls"), [(False, False), (True, False), (False, True)])
def test_profile_reports_every_message_and_stage(
    tmp_path: Path, reference: bool, tls: bool
) -> None:
    out = tmp_path / "stages.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "profile_datapath.py"), "--requests", "3",
        "--warmup", "1", "--chunks", "4", "--out", str(out),
    ]  # fmt: skip
    if reference:
        cmd.append("--reference")
    if tls:
        cmd.append("--tls")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    doc = json.loads(out.read_text())
    assert doc["reference"] is reference
    assert doc["tls"] is tls
    rows = {r["message"]: r for r in doc["rows"]}
    assert set(rows) == KINDS
    assert rows["response_body"]["count"] == 3 * 4
    for r in rows.values():
        st = r["stages_us_median"]
        assert set(st) == {"frame", "decode", "director", "encode", "tls", "write", "other"}
        assert all(v >= 0 for v in st.values())
        # TLS work is seen exactly when the connection is behind TLS.
        assert (st["tls"] > 0) is tls
    # Body chunks are answered (encoded and written) and seen by the director on both paths.
    chunk = rows["response_body"]["stages_us_median"]
    assert chunk["encode"] > 0 and chunk["write"] > 0 and chunk["director"] > 0


def test_chunk_loop_answers_every_chunk_from_the_lane(tmp_path: Path) -> None:
    """bench/profile_chunk_loop.py: every chunk answered (one write each), a CPU figure."""
    out = tmp_path / "loop.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "profile_chunk_loop.py"), "--chunks", "300",
        "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    doc = json.loads(out.read_text())
    assert doc["answered"] == doc["chunks"] == 300
    assert doc["cpu_us_per_chunk"] > 0
