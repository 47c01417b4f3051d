"""bench/profile_datapath.py runs end to end (a few requests, its own process: it patches
timers into the transport) and reports every message kind of a streamed request, each
stage, on the fast path and with it off."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc_helpers import PM, body_msg, harnesses, headers_msg

from scorer.extproc.transport import H2Connection

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


async def test_scorer_probes_time_request_and_response_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/probes/sitecustomize.py (profile_envoy_phases.py --scorer-probes): one row per
    answered read, the routing answer as `request`, each response message answered in
    the frame loop as `response`, the trailers as `end`."""
    spec = importlib.util.spec_from_file_location(
        "kvscorer_probes", ROOT / "bench" / "probes" / "sitecustomize.py"
    )
    assert spec is not None and spec.loader is not None
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)  # KVSCORER_PROBES_DIR unset: installs nothing
    assert H2Connection.flush.__name__ == "flush"
    for name in ("data_received", "flush"):  # restored after the test
        monkeypatch.setattr(H2Connection, name, getattr(H2Connection, name))
    dump = probes._install(str(tmp_path))
    async with harnesses("asyncio") as make:
        h = await make()
        call = h.stream()
        hm = headers_msg({"x-request-id": "probe-1"})
        hm.protocol_config.response_body_mode = PM.FULL_DUPLEX_STREAMED  # type: ignore[assignment]
        await call.write(hm)
        await call.write(body_msg(json.dumps({"model": "m", "prompt": "hi"}).encode(), True))
        for _ in range(2):  # the routing answer, the body streamed back
            assert await asyncio.wait_for(call.read(), 5) is not grpc.aio.EOF
        rh = ep.ProcessingRequest()
        rh.response_headers.headers.headers.add(key=":status", raw_value=b"200")
        rb = ep.ProcessingRequest()
        rb.response_body.body = b"{}"
        rb.response_body.end_of_stream = True
        for m in (rh, rb):
            await call.write(m)
            assert await asyncio.wait_for(call.read(), 5) is not grpc.aio.EOF
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
    dump()
    rows = json.loads(next(tmp_path.glob("probes-*.json")).read_text())
    assert [r[0] for r in rows] == ["request", "response", "response", "end"]
    assert all(r[1] > 0 and r[2] > 0 for r in rows)
