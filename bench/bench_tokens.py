"""Per-request cost of body → token ids → block keys (scorer.tokens + scorer.blocks).

Chat requests of about 1k, 8k and 32k tokens (Qwen3 tokenizer + chat template, block size
16, xxh3), each a multi-turn conversation. For every size:

* raw      `tokenizers` encode of the rendered prompt text (`Tokenizer.encode`, the figure
           the targets compare with), and `encode_batch_fast` of the same text;
* cold     `Tokenization.tokenize_body` with an empty segment cache and no prefix states
           (render + split + encode + hash);
* warm     the previous request of the conversation (one turn shorter: without the last
           assistant reply and user message) was seen just before; only the new turn is
           encoded, and only the text after the previous prompt's stored prefix is split,
           looked up and hashed (scorer.tokens.prefix). Wall time can include tokenizers'
           rayon workers still spinning after the cold `prev` (they share the 2 cores):
           "warm cpu" is the calling thread's CPU time, the work itself;
* new turn raw  `Tokenizer.encode` of only the warm request's new segments (the part of
           "warm" no cache can save);
* repeat   the same body again (everything cached: its own prefix state covers all but
           the generation prompt);
* render   the chat template alone (part of every figure above).

Targets (issue 4): warm 8k ≤ 1 ms p50; cold ≤ 1.2x raw. Prints a table and writes
bench/out/tokens.json.

`--ids`: a completions body whose `prompt` is 1k / 16k / 100k token ids (Mooncake-style
ids up to 150k), body bytes → parsed document (`parse_body`) → packed ids and block keys
(`tokenize_body`), with the prompt packed at parse (scorer/body.py, compiled
`json_ids_u32`) and the reference way (`parse_body(native=False)`: one Python int per id,
packed by the tokens stage), alternated. Writes bench/out/tokens_ids.json.

    .venv/bin/python bench/bench_tokens.py [--reps N] [--sizes 1000,8000,32000]
    .venv/bin/python bench/bench_tokens.py --ids [--reps 200] [--sizes 1000,16000,100000]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scorer.blocks import BlockHasher
from scorer.config import Config, TokenizerModelConfig, TokensConfig
from scorer.director import parse_body
from scorer.tokens import Tokenization

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = ROOT / "tests" / "fixtures" / "tokenizers" / "qwen3"
OUT = ROOT / "bench" / "out" / "tokens.json"

WORDS = [
    "the",
    "cache",
    "block",
    "prefix",
    "token",
    "router",
    "worker",
    "engine",
    "request",
    "latency",
    "throughput",
    "model",
    "prompt",
    "decode",
    "prefill",
    "memory",
    "GPU",
    "batch",
    "schedule",
    "queue",
    "policy",
    "score",
    "index",
    "event",
    "stream",
    "hash",
    "chain",
    "namespace",
    "adapter",
    "salt",
    "tenant",
    "session",
    "turn",
    "reply",
    "question",
    "answer",
    "explain",
    "detail",
    "example",
    "code",
    "function",
    "return",
    "value",
    "error",
    "retry",
    "timeout",
]
EXTRA = ["Paris", "Zürich", "東京", "3.14", "42", "(x)", "[1, 2]", "don't", "it's", "e.g.", "—"]


def _text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        w = rng.choice(EXTRA) if rng.random() < 0.08 else rng.choice(WORDS)
        out.append(w)
        if i % 17 == 16:
            out.append(".\n" if rng.random() < 0.3 else ".")
    return " ".join(out).replace(" .", ".")


def conversation(target_tokens: int, seed: int = 1) -> list[dict[str, Any]]:
    """system + (user ~60 words, assistant ~150 words) turns, ending with a user message."""
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": _text(rng, 120)}]
    # ~1.3 tokens per word for this vocabulary; stop when the estimate reaches the target.
    est = 160
    while est < target_tokens:
        msgs.append({"role": "user", "content": _text(rng, 60)})
        msgs.append({"role": "assistant", "content": _text(rng, 150)})
        est += int(1.3 * 210) + 10
    msgs.append({"role": "user", "content": _text(rng, 60)})
    return msgs


CPU: list[float] = []  # thread CPU seconds of the last _time() call, per repetition


def _time(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> list[float]:
    """Wall seconds per call (and the calling thread's CPU seconds in CPU)."""
    out = []
    CPU.clear()
    for _ in range(reps):
        if setup is not None:
            setup()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        CPU.append(time.thread_time() - c0)
    return out


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ids_main(reps: int, sizes: list[int], out: str) -> None:
    """`--ids`: token-id prompt bodies, packed at parse vs the reference decode."""
    tokens = Tokenization(Config(), BlockHasher(16, "xxh3"))
    tokens.max_prompt_tokens = max(sizes)
    rng = random.Random(1)
    results: list[dict[str, Any]] = []
    try:
        for n in sizes:
            ids = [rng.randrange(150_000) for _ in range(n)]
            body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode()
            row: dict[str, Any] = {"ids": n, "body_bytes": len(body)}
            samples: dict[str, dict[str, list[float]]] = {
                way: {"parse": [], "total": []} for way in ("reference", "packed")
            }
            k = max(5, reps if n <= 16000 else reps // 5)
            for _ in range(k):  # alternated, so both ways see the same machine
                for way, native in (("reference", False), ("packed", True)):
                    t0 = time.perf_counter()
                    doc = parse_body(body, native)
                    t1 = time.perf_counter()
                    tp = tokens.tokenize_body(None, doc)
                    t2 = time.perf_counter()
                    samples[way]["parse"].append(t1 - t0)
                    samples[way]["total"].append(t2 - t0)
                    assert tp.token_ids[:3] == ids[:3] and len(tp.packed) == 4 * n
            for way, d in samples.items():
                row[f"{way}_parse_us_p50"] = _p(d["parse"], 0.5) * 1e6
                row[f"{way}_total_us_p50"] = _p(d["total"], 0.5) * 1e6
            row["reps"] = k
            results.append(row)
    finally:
        tokens.close()
    print("token-id prompt body -> parsed -> packed ids + block keys, us p50 (block 16, xxh3)")
    print("    ids |  body KB | parse ref | parse packed | total ref | total packed")
    for r in results:
        print(
            f"{r['ids']:>7} | {r['body_bytes'] / 1024:>8.0f} | {r['reference_parse_us_p50']:>9.0f} "
            f"| {r['packed_parse_us_p50']:>12.0f} | {r['reference_total_us_p50']:>9.0f} "
            f"| {r['packed_total_us_p50']:>12.0f}"
        )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"bench": "tokens_ids", "results": results}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sizes", default=None)
    ap.add_argument("--ids", action="store_true", help="token-id prompt bodies (see above)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.ids:
        sizes = [int(s) for s in (args.sizes or "1000,16000,100000").split(",")]
        ids_main(args.reps, sizes, args.out or str(OUT.with_name("tokens_ids.json")))
        return
    args.sizes = args.sizes or "1000,8000,32000"
    args.out = args.out or str(OUT)

    cfg = Config(tokens=TokensConfig(models={"qwen3": TokenizerModelConfig(tokenizer=str(QWEN3))}))
    tokens = Tokenization(cfg, BlockHasher(16, "xxh3"))
    lt = tokens.tokenizer_for("qwen3")
    assert lt is not None
    tok = lt.tokenizer
    results: list[dict[str, Any]] = []

    def forget() -> None:
        """Empty the segment cache and the conversation prefix states."""
        tokens.cache.clear()
        prefixes = getattr(tokens, "prefixes", None)  # absent before scorer.tokens.prefix
        if prefixes is not None:
            prefixes.clear()

    try:
        for size in (int(s) for s in args.sizes.split(",")):
            msgs = conversation(size)
            body = {"model": "qwen3", "messages": msgs}
            prev = {"model": "qwen3", "messages": msgs[:-2]}
            text = tokens.render("qwen3", body)
            n = len(tok.encode(text, add_special_tokens=False).ids)
            reps = max(5, args.reps if size <= 8000 else args.reps // 3)
            raw = _time(lambda t=text: tok.encode(t, add_special_tokens=False), reps)
            raw_fast = _time(
                lambda t=text: tok.encode_batch_fast([t], add_special_tokens=False), reps
            )
            cold = _time(lambda b=body: tokens.tokenize_body("qwen3", b), reps, forget)

            def see_prev(p: dict[str, Any] = prev) -> None:
                forget()
                tokens.tokenize_body("qwen3", p)

            warm = _time(lambda b=body: tokens.tokenize_body("qwen3", b), reps * 3, see_prev)
            warm_cpu = list(CPU)
            tp = tokens.tokenize_body("qwen3", body)
            see_prev()
            new_chars = tokens.tokenize_body("qwen3", body).stats["encoded_chars"]
            new_tokens = n - len(tok.encode(tokens.render("qwen3", prev), add_special_tokens=False))
            old_segments = set(lt.split(tokens.render("qwen3", prev))[0::2])
            new_segments = [x for x in lt.split(text)[0::2] if x and x not in old_segments]
            new_raw = _time(
                lambda segs=new_segments: [tok.encode(x, add_special_tokens=False) for x in segs],
                reps * 3,
            )
            repeat = _time(lambda b=body: tokens.tokenize_body("qwen3", b), reps * 3)
            render = _time(lambda b=body: tokens.render("qwen3", b), reps * 3)
            assert tp.token_ids == list(tok.encode(text, add_special_tokens=False).ids)
            row = {
                "target_tokens": size,
                "tokens": n,
                "messages": len(msgs),
                "blocks": len(tp.block_keys),
                "new_turn_chars": new_chars,
                "raw_encode_ms_p50": _p(raw, 0.5) * 1e3,
                "raw_encode_batch_fast_ms_p50": _p(raw_fast, 0.5) * 1e3,
                "cold_ms_p50": _p(cold, 0.5) * 1e3,
                "cold_ms_p90": _p(cold, 0.9) * 1e3,
                "cold_over_raw": _p(cold, 0.5) / _p(raw, 0.5),
                "warm_ms_p50": _p(warm, 0.5) * 1e3,
                "warm_ms_p90": _p(warm, 0.9) * 1e3,
                "warm_cpu_ms_p50": _p(warm_cpu, 0.5) * 1e3,
                "new_turn_tokens": new_tokens,
                "new_turn_raw_encode_ms_p50": _p(new_raw, 0.5) * 1e3,
                "repeat_ms_p50": _p(repeat, 0.5) * 1e3,
                "render_ms_p50": _p(render, 0.5) * 1e3,
                "reps": reps,
            }
            results.append(row)
    finally:
        tokens.close()

    cols = [
        ("tokens", "tokens", "{:.0f}"),
        ("msgs", "messages", "{:.0f}"),
        ("raw encode", "raw_encode_ms_p50", "{:.2f}"),
        ("raw batch_fast", "raw_encode_batch_fast_ms_p50", "{:.2f}"),
        ("cold p50", "cold_ms_p50", "{:.2f}"),
        ("cold/raw", "cold_over_raw", "{:.2f}"),
        ("warm p50", "warm_ms_p50", "{:.3f}"),
        ("warm p90", "warm_ms_p90", "{:.3f}"),
        ("warm cpu p50", "warm_cpu_ms_p50", "{:.3f}"),
        ("new turn raw", "new_turn_raw_encode_ms_p50", "{:.3f}"),
        ("repeat p50", "repeat_ms_p50", "{:.3f}"),
        ("render p50", "render_ms_p50", "{:.3f}"),
    ]
    print("tokenize + hash per chat request, ms (Qwen3 tokenizer + template, block 16, xxh3)")
    print(" | ".join(f"{h:>{max(len(h), 7)}}" for h, _, _ in cols))
    for r in results:
        print(" | ".join(f"{f.format(r[k]):>{max(len(h), 7)}}" for h, k, f in cols))
    print(
        "warm = the previous request of the conversation was seen; its new turn "
        f"(assistant reply + user message) is {results[0]['new_turn_chars']} chars, "
        f"~{results[0]['new_turn_tokens']} tokens; 'new turn raw' = tokenizers' encode of just "
        "those new segments. cpu = the calling thread's CPU time."
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"bench": "tokens", "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
