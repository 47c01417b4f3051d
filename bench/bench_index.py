"""Block-index benchmark: apply rate, hash+match latency, bytes per entry (+ Dynamo's RadixTree).

    .venv/bin/python bench/bench_index.py [--blocks 1000000] [--workers 8 64] [--reps 300] [--pure]

Runs the compiled hot paths (scorer.native) when they are built; `--pure` runs the
pure-Python reference code instead (same as KV_SCORER_PURE_PYTHON=1).

Workload: `--blocks` stored (block, worker) entries spread over W workers, delivered as
vLLM 0.24+ messages (3 frames, msgpack batch of tagged BlockStored events of 16 tokens per
block, chained by parent hash). Two event shapes, as vLLM emits them (one BlockStored per
scheduler step per request): *prefill* = 16 blocks per event, 4 events per message;
*decode* = 1 block per event, 32 events per message (the 1-block rows). Applying =
decode_message + Applier.apply (our keys are recomputed from token_ids, as in production);
"apply blk/s" is wall clock, "cpu blk/s" the same run in process CPU time (the machine
may be shared). The probe prompt has 4,096 tokens (256 blocks): worker 0 holds all of it,
half the workers hold its first 128 blocks.
find_matches = hashing the 4,096 token ids + BlockIndex.match(keys), twice: from a list of
ints (`BlockHasher.keys`, includes the list → uint32 conversion) and from packed uint32
bytes (`keys_from_bytes`: what the request path runs, scorer/tokens keeps ids packed).
Bytes per entry: tracemalloc growth while building the index / stored (block, worker)
entries, in the worst case (every random chain held by ONE worker) and a shared case
(each chain held by 2-4 workers, same engine hashes).

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

from scorer.blocks import BlockHasher, tokens_to_bytes
from scorer.events.apply import Applier
from scorer.events.decode import decode_message
from scorer.index import BlockIndex
from scorer.native import NATIVE

BS = 16
EVENT_BLOCKS = 16
EVENTS_PER_MSG = 4
PROMPT_TOKENS = 4096
# False with --pure: the pure-Python reference; None: the compiled code when built.
USE_NATIVE: bool | None = None


def impl_name() -> str:
    native = NATIVE is not None and USE_NATIVE is not False
    return "kv-scorer " + ("compiled" if native else "pure Py")


def make_hasher() -> BlockHasher:
    return BlockHasher(BS, native=USE_NATIVE)


def make_workload(
    blocks: int,
    workers: int,
    seed: int = 1,
    event_blocks: int = EVENT_BLOCKS,
    events_per_msg: int = EVENTS_PER_MSG,
    share: tuple[int, int] = (1, 1),
) -> tuple[list[int], list[tuple[str, list[bytes]]], list[tuple[int, list[Any]]]]:
    """(probe prompt, [(endpoint, frames)], [(worker, dynamo chain events)]).

    `blocks` counts (block, worker) entries; each random chain is held by a number of
    workers drawn from `share` (inclusive range), with the same engine hashes on each."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int64).tolist()
    enc = msgspec.msgpack.Encoder()
    msgs: list[tuple[str, list[bytes]]] = []
    # (worker, tokens, first engine hash): the engines share a hash seed, so the same
    # prompt prefix has the same engine hashes on every worker (as Dynamo assumes).
    chains: list[tuple[int, list[int], int | None]] = []
    next_shared = PROMPT_TOKENS // BS + 1  # engine hashes of chains held by several workers
    chains.append((0, prompt, 1))
    used = PROMPT_TOKENS // BS
    for w in range(1, max(2, workers // 2 + 1)):
        chains.append((w % workers, prompt[: PROMPT_TOKENS // 2], 1))
        used += PROMPT_TOKENS // 2 // BS
    chain_blocks = 256  # random chains of 256 blocks
    w = 0
    while used < blocks:
        k = min(workers, int(rng.integers(share[0], share[1] + 1)))
        n = min(chain_blocks, -(-(blocks - used) // k))
        toks = rng.integers(0, 150_000, n * BS, dtype=np.int64).tolist()
        first = None if k == 1 else next_shared
        if k > 1:
            next_shared += n
        for j in range(k):
            chains.append(((w + j) % workers, toks, first))
        used += n * k
        w = (w + k) % workers
    seqs = [0] * workers
    next_hash = 10**12  # engine hashes of single-holder chains
    dyn: list[tuple[int, list[Any]]] = []
    for w, toks, first in chains:
        nblocks = len(toks) // BS
        own = first is None
        parent: int | None = None
        events: list[Any] = []
        for start in range(0, nblocks, event_blocks):
            end = min(nblocks, start + event_blocks)
            if own:
                hashes = list(range(next_hash, next_hash + end - start))
                next_hash += end - start
            else:
                assert first is not None
                hashes = list(range(first + start, first + end))
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
            if len(events) == events_per_msg or end == nblocks:
                payload = enc.encode([time.time(), events, 0])
                msgs.append((f"w{w}", [b"", seqs[w].to_bytes(8, "big"), payload]))
                seqs[w] += 1
                dyn.append((w, events))
                events = []
    return prompt, msgs, dyn


def apply_all(msgs: list[tuple[str, list[bytes]]], hasher: BlockHasher) -> BlockIndex:
    index = BlockIndex(native=USE_NATIVE)
    index.max_blocks = 10**9
    ap = Applier(index, hasher, native=USE_NATIVE)
    for ep, frames in msgs:
        ap.apply(ep, decode_message(frames, native=USE_NATIVE).batch)
    return index


def pctl(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def timed_apply(
    msgs: list[tuple[str, list[bytes]]], hasher: BlockHasher
) -> tuple[BlockIndex, float, float]:
    """(index, wall seconds, process CPU seconds) of applying every message."""
    t0, c0 = time.perf_counter(), time.process_time()
    index = apply_all(msgs, hasher)
    return index, time.perf_counter() - t0, time.process_time() - c0


def run_ours(blocks: int, workers: int, reps: int) -> dict[str, Any]:
    hasher = make_hasher()
    prompt, msgs, dyn = make_workload(blocks, workers)
    gc.collect()
    # The workload's own millions of objects must not be re-scanned by every GC pass.
    gc.freeze()
    index, dt, dc = timed_apply(msgs, hasher)
    entries = index.total_entries()
    # Hash + match latency of the probe prompt, from a list of ints and from packed bytes.
    packed = tokens_to_bytes(prompt)
    for _ in range(20):
        index.match(hasher.keys(prompt))
        index.match(hasher.keys_from_bytes(packed))
    hl, hb, mt, tl, tb = [], [], [], [], []
    for _ in range(reps):
        a = time.perf_counter()
        keys = hasher.keys(prompt)
        b = time.perf_counter()
        res = index.match(keys)
        c = time.perf_counter()
        keys2 = hasher.keys_from_bytes(packed)
        d = time.perf_counter()
        index.match(keys2)
        e = time.perf_counter()
        hl.append((b - a) * 1e6)
        mt.append((c - b) * 1e6)
        tl.append((c - a) * 1e6)
        hb.append((d - c) * 1e6)
        tb.append((e - c) * 1e6)
    assert keys == keys2 and res["w0"].blocks == PROMPT_TOKENS // BS
    out: dict[str, Any] = {
        "impl": impl_name(),
        "workers": workers,
        "shape": "16 blk/ev",
        "entries": entries,
        "apply_blocks_per_s": entries / dt,
        "apply_blocks_per_cpu_s": entries / dc,
        "hash_p50_us": statistics.median(hl),
        "hash_bytes_p50_us": statistics.median(hb),
        "match_p50_us": statistics.median(mt),
        "find_matches_p50_us": statistics.median(tl),
        "find_matches_p99_us": pctl(tl, 0.99),
        "find_matches_bytes_p50_us": statistics.median(tb),
        "find_matches_bytes_p99_us": pctl(tb, 0.99),
        "matched_workers": len(res),
    }
    del index
    gc.collect()
    out["_dyn"] = (prompt, dyn)
    return out


def run_decode_shape(blocks: int, workers: int) -> dict[str, Any]:
    """Apply rate when every BlockStored carries ONE block (decode steps), 32 per message."""
    hasher = make_hasher()
    _, msgs, _ = make_workload(blocks, workers, event_blocks=1, events_per_msg=32)
    gc.collect()
    gc.freeze()
    index, dt, dc = timed_apply(msgs, hasher)
    entries = index.total_entries()
    del index, msgs
    gc.collect()
    return {
        "impl": impl_name(),
        "workers": workers,
        "shape": "1 blk/ev",
        "entries": entries,
        "apply_blocks_per_s": entries / dt,
        "apply_blocks_per_cpu_s": entries / dc,
    }


def run_memory(blocks: int, workers: int, share: tuple[int, int]) -> dict[str, Any]:
    """tracemalloc bytes per stored (block, worker) entry."""
    hasher = make_hasher()
    _, msgs, _ = make_workload(blocks, workers, share=share)
    gc.collect()
    gc.freeze()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = apply_all(msgs, hasher)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    entries = index.total_entries()
    blocks_stored = len(index._gpu)
    del index, msgs
    gc.collect()
    return {
        "impl": impl_name(),
        "workers": workers,
        "shape": f"held by {share[0]}" + ("" if share[0] == share[1] else f"-{share[1]}"),
        "entries": entries,
        "distinct_blocks": blocks_stored,
        "bytes_per_entry": (after - before) / entries,
    }


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
        "shape": "16 blk/ev",
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
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs")
    ap.add_argument("--pure", action="store_true", help="the pure-Python reference code")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "index.json"))
    args = ap.parse_args()
    global USE_NATIVE
    USE_NATIVE = False if args.pure else None
    rows: list[dict[str, Any]] = []
    for i, w in enumerate(args.workers):
        ours = run_ours(args.blocks, w, args.reps)
        prompt, dyn = ours.pop("_dyn")
        rows.append(ours)
        if not args.no_dynamo:
            rows.append(run_dynamo(prompt, dyn, w, args.reps))
        del prompt, dyn
        gc.collect()
        if i == 0:
            rows.append(run_decode_shape(args.blocks, w))
    if not args.no_memory:
        w0 = args.workers[0]
        rows.append(run_memory(args.blocks, w0, (1, 1)))
        for w in args.workers:
            rows.append(run_memory(args.blocks, w, (2, 4)))
    cols = [
        ("impl", "{:<20}"), ("workers", "{:>3}"), ("shape", "{:>11}"), ("entries", "{:>8}"),
        ("apply_blocks_per_s", "{:>11,.0f}"), ("apply_blocks_per_cpu_s", "{:>11,.0f}"),
        ("hash_p50_us", "{:>6.1f}"), ("hash_bytes_p50_us", "{:>6.1f}"),
        ("match_p50_us", "{:>6.1f}"), ("find_matches_p50_us", "{:>7.1f}"),
        ("find_matches_bytes_p50_us", "{:>7.1f}"), ("find_matches_bytes_p99_us", "{:>7.1f}"),
        ("bytes_per_entry", "{:>7.1f}"),
    ]  # fmt: skip
    heads = ["impl", "W", "shape", "entries", "apply blk/s", "cpu blk/s", "h(ls)",
             "h(by)", "match", "h+m ls", "h+m by", "p99 by", "B/entry"]  # fmt: skip
    widths = [len(f.format(0) if "f" in f else f.format("")) for _, f in cols]
    print(" ".join(f"{h:>{n}}" for h, n in zip(heads, widths, strict=True)))
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<20} {r['workers']:>3}  {r['error']}")
            continue
        cells = []
        for (key, f), n in zip(cols, widths, strict=True):
            v = r.get(key)
            cells.append(f.format(v) if v is not None else f"{'-':>{n}}")
        print(" ".join(cells))
    print("h(ls)/h(by): hashing 4,096 tokens from a list / from packed uint32 bytes; h+m: + match")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"blocks": args.blocks, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
