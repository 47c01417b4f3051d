"""The simulator's wire format against vLLM's own output (tests/fixtures/sim_vectors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvscorer_tools.sim.cache import vllm_block_hashes
from kvscorer_tools.sim.kvevents import (
    Era,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
)

VECTORS = json.loads(
    (Path(__file__).parent.parent / "fixtures/sim_vectors/vllm-kv-events-subset.json").read_text()
)
ERAS: dict[str, Era] = {"0.21.0": "array", "0.25.0": "map", "0.32.0": "map"}
CASES = [
    "single_block_stored",
    "chained_multi_block_stored",
    "block_removed",
    "all_blocks_cleared",
    "mixed_batch",
    "topic_and_dp_rank_1",
    "lora_block_stored",
    "cache_salt_block_stored",
]


def _events(era: Era, decoded: list[dict[str, Any]]) -> list[msgspec.Struct]:
    out: list[msgspec.Struct] = []
    for ev in decoded:
        if ev["type"] == "BlockStored":
            out.append(
                block_stored(
                    era,
                    ev["block_hashes"],
                    ev["parent_block_hash"],
                    ev["token_ids"],
                    ev["block_size"],
                    lora_id=ev["lora_id"],
                    lora_name=ev["lora_name"],
                    extra_keys=ev["extra_keys"],
                    medium=ev["medium"],
                    group_idx=ev["group_idx"],
                )
            )
        elif ev["type"] == "BlockRemoved":
            out.append(block_removed(era, ev["block_hashes"], ev["medium"], ev["group_idx"]))
        else:
            out.append(all_blocks_cleared(era))
    return out


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for v in VECTORS["versions"]:
        for c in v["cases"]:
            if c["name"] in CASES:
                out.extend((v["vllm_version"], c["name"], m) for m in c["messages"])
    return out


@pytest.mark.parametrize(("version", "case", "message"), _cases())
def test_payload_byte_identical(version: str, case: str, message: dict[str, Any]) -> None:
    era = ERAS[version]
    d = message["decoded"]
    payload = encode_batch(d["ts"], _events(era, d["events"]), d["data_parallel_rank"])
    assert payload.hex() == message["payload_hex"], (version, case)


def test_block_hashes_match_vllm() -> None:
    for ex in VECTORS["block_hash_examples"]["modern_default_no_PYTHONHASHSEED"]:
        lora = ex["lora"]["lora_name"] if ex["lora"] else None
        hashes = vllm_block_hashes(
            ex["token_ids"], ex["block_size"], lora_name=lora, cache_salt=ex["cache_salt"]
        )
        assert [h.digest.hex() for h in hashes] == ex["block_hash_bytes_hex"], ex["name"]
        assert [h.value for h in hashes] == ex["event_block_hashes_int"], ex["name"]
        assert [list(h.extra) if h.extra else None for h in hashes] == ex["event_extra_keys"]
