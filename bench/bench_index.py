"""Block-index benchmark: apply rate, hash+match latency, bytes per entry (+ Dynamo's RadixTree).

    .venv/bin/python bench/bench_index.py [--blocks 1000000] [--workers 8 64] [--reps 300]

Workload: `--blocks` stored (block, worker) entries spread over W workers, delivered as
vLLM 0.24+ messages (3 frames, msgpack batch of 4 tagged BlockStored events x 16 blocks of
16 tokens, chained by parent hash). Applying = decode_message + Applier.apply (our keys are
recomputed from token_ids, as in production). The probe prompt has 4,096 tokens (256 blocks):
worker 0 holds all of it, half the workers hold its first 128 blocks.
find_matches = BlockHasher.keys(4,096 token ids) + BlockIndex.match(keys).
Bytes per entry: tracemalloc growth while building the index / stored (block, worker) entries.

Side by side, when `ai-dynamo-runtime==1.6.1` imports: dynamo._core.RadixTree fed the same
blocks (JSON KvCacheEvent bytes, pre-encoded, via apply_event), find_matches =
compute_block_hash_for_seq + RadixTree.find_matches. Prints a table, writes bench/out/index.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scorer.blocks import BlockHasher
from scorer.events.apply import Applier
from scorer.events.decode import decode_message
from scorer.index import BlockIndex

BS = 16
EVENT_BLOCKS = 16
EVENTS_PER_MSG = 4
PROMPT_TOKENS = 4096


def make_workload(
    blocks: int, workers: int, seed: int = 1
) -> tuple[list[int], list[tuple[str, list[bytes]]], list[tuple[int, list[Any]]]]:
    """(probe prompt, [(endpoint, frames)], [(worker, dynamo chain events)])."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int64).tolist()
    enc = msgspec.msgpack.Encoder()
    msgs: list[tuple[str, list[bytes]]] = []
    # (worker, tokens, first engine hash): the engines share a hash seed, so the same
    # prompt prefix has the same engine hashes on every worker (as Dynamo assumes).
    chains: list[tuple[int, list[int], int | None]] = []
    chains.append((0, prompt, 1))
    used = PROMPT_TOKENS // BS
    for w in range(1, max(2, workers // 2 + 1)):
        chains.append((w % workers, prompt[: PROMPT_TOKENS // 2], 1))
        used += PROMPT_TOKENS // 2 // BS
    chain_blocks = EVENT_BLOCKS * EVENTS_PER_MSG * 4  # 256-block random chains
    w = 0
    while used < blocks:
        n = min(chain_blocks, blocks - used)
        toks = rng.integers(0, 150_000, n * BS, dtype=np.int64).tolist()
        chains.append((w, toks, None))
        used += n
        w = (w + 1) % workers
    seqs = [0] * workers
    next_hash = PROMPT_TOKENS // BS + 1
    dyn: list[tuple[int, list[Any]]] = []
    for w, toks, first in chains:
        nblocks = len(toks) // BS
        own = first is None
        parent: int | None = None
        events: list[Any] = []
        for start in range(0, nblocks, EVENT_BLOCKS):
            end = min(nblocks, start + EVENT_BLOCKS)
            if own:
                hashes = list(range(next_hash, next_hash + end - start))
                next_hash += end - start
            else:
                hashes = list(range(1 + start, 1 + end))
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": parent,
                    "token_ids": toks[start * BS : end * BS],
                    "block_size": BS,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
            parent = hashes[-1]
            if len(events) == EVENTS_PER_MSG or end == nblocks:
                payload = enc.encode([time.time(), events, 0])
                msgs.append((f"w{w}", [b"", seqs[w].to_bytes(8, "big"), payload]))
                seqs[w] += 1
                dyn.append((w, events))
                events = []
    return prompt, msgs, dyn


def apply_all(msgs: list[tuple[str, list[bytes]]], hasher: BlockHasher) -> BlockIndex:
    index = BlockIndex()
    index.max_blocks = 10**9
    ap = Applier(index, hasher)
    for ep, frames in msgs:
        ap.apply(ep, decode_message(frames).batch)
    return index


def pctl(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def run_ours(blocks: int, workers: int, reps: int, memory: bool) -> dict[str, Any]:
    hasher = BlockHasher(BS)
    prompt, msgs, dyn = make_workload(blocks, workers)
    gc.collect()
    # The workload's own millions of objects must not be re-scanned by every GC pass.
    gc.freeze()
    t0 = time.perf_counter()
    index = apply_all(msgs, hasher)
    dt = time.perf_counter() - t0
    entries = index.total_entries()
    # Hash + match latency of the probe prompt.
    for _ in range(20):
        index.match(hasher.keys(prompt))
    hash_us, match_us, total_us = [], [], []
    for _ in range(reps):
        a = time.perf_counter()
        keys = hasher.keys(prompt)
        b = time.perf_counter()
        res = index.match(keys)
        c = time.perf_counter()
        hash_us.append((b - a) * 1e6)
        match_us.append((c - b) * 1e6)
        total_us.append((c - a) * 1e6)
    assert res["w0"].blocks == PROMPT_TOKENS // BS
    out: dict[str, Any] = {
        "impl": "kv-scorer BlockIndex",
        "workers": workers,
        "entries": entries,
        "apply_blocks_per_s": entries / dt,
        "hash_p50_us": statistics.median(hash_us),
        "match_p50_us": statistics.median(match_us),
        "find_matches_p50_us": statistics.median(total_us),
        "find_matches_p99_us": pctl(total_us, 0.99),
        "matched_workers": len(res),
    }
    del index
    gc.collect()
    if memory:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        index = apply_all(msgs, hasher)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        out["bytes_per_entry"] = (after - before) / index.total_entries()
        del index
    out["_dyn"] = (prompt, dyn)
    return out


def run_dynamo(
    prompt: list[int], dyn: list[tuple[int, list[Any]]], workers: int, reps: int
) -> dict[str, Any]:
    try:
        from dynamo._core import RadixTree, compute_block_hash_for_seq
    except Exception as e:  # not installed, or its pins clash with ours
        return {"impl": "dynamo RadixTree", "workers": workers, "error": f"import failed: {e}"}
    # Dynamo keys the tree by per-block content hashes (tokens_hash) chained by the tree.
    payloads: list[tuple[int, bytes]] = []
    eid = 0
    n_blocks = 0
    for w, events in dyn:
        for ev in events:
            toks = ev["token_ids"]
            th = compute_block_hash_for_seq(toks, BS)
            blocks = [
                {"block_hash": h, "tokens_hash": t}
                for h, t in zip(ev["block_hashes"], th, strict=True)
            ]
            data = {"stored": {"parent_hash": ev["parent_block_hash"], "blocks": blocks}}
            payloads.append((w, json.dumps({"event_id": eid, "data": data}).encode()))
            eid += 1
            n_blocks += len(blocks)
    tree = RadixTree()
    failed = 0
    t0 = time.perf_counter()
    for w, p in payloads:
        try:
            tree.apply_event(w, p)
        except RuntimeError:
            failed += 1
    tree.find_matches([1])  # queued behind the events: waits until they are applied
    dt = time.perf_counter() - t0
    for _ in range(20):
        tree.find_matches(compute_block_hash_for_seq(prompt, BS))
    hash_us, total_us = [], []
    for _ in range(reps):
        a = time.perf_counter()
        seq = compute_block_hash_for_seq(prompt, BS)
        b = time.perf_counter()
        sc = tree.find_matches(seq)
        c = time.perf_counter()
        hash_us.append((b - a) * 1e6)
        total_us.append((c - a) * 1e6)
    scores = sc.scores
    return {
        "impl": "dynamo RadixTree",
        "workers": workers,
        "entries": n_blocks,
        "apply_blocks_per_s": n_blocks / dt,
        "hash_p50_us": statistics.median(hash_us),
        "match_p50_us": statistics.median(total_us) - statistics.median(hash_us),
        "find_matches_p50_us": statistics.median(total_us),
        "find_matches_p99_us": pctl(total_us, 0.99),
        "matched_workers": len(scores),
        "failed_events": failed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--no-dynamo", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "index.json"))
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for i, w in enumerate(args.workers):
        ours = run_ours(args.blocks, w, args.reps, memory=(i == 0))
        prompt, dyn = ours.pop("_dyn")
        rows.append(ours)
        if not args.no_dynamo:
            rows.append(run_dynamo(prompt, dyn, w, args.reps))
        del prompt, dyn
        gc.collect()
    cols = [
        ("impl", "{:<22}"), ("workers", "{:>7}"), ("entries", "{:>9}"),
        ("apply_blocks_per_s", "{:>12,.0f}"), ("hash_p50_us", "{:>9.1f}"),
        ("match_p50_us", "{:>9.1f}"), ("find_matches_p50_us", "{:>10.1f}"),
        ("find_matches_p99_us", "{:>10.1f}"), ("bytes_per_entry", "{:>9.1f}"),
    ]  # fmt: skip
    heads = ["impl", "workers", "entries", "apply blk/s", "hash p50", "match p50",
             "h+m p50 µs", "h+m p99 µs", "B/entry"]  # fmt: skip
    print(
        " ".join(
            f"{h:>{len(f.format(0) if 'f' in f else f.format(''))}}"
            for h, (_, f) in zip(heads, cols, strict=True)
        )
    )
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<22} {r['workers']:>7}  {r['error']}")
            continue
        cells = []
        for key, f in cols:
            v = r.get(key)
            cells.append(
                f.format(v) if v is not None else f"{'-':>{len(f.format(0)) if 'f' in f else 9}}"
            )
        print(" ".join(cells))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"blocks": args.blocks, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
