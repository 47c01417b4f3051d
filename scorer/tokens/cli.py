"""`kv-scorer tokens`: one request body on stdin → its token ids (JSON list) on stdout.

For operators checking parity with their engine: compare with the `prompt_token_ids` vLLM
returns (`"return_token_ids": true`, or its /tokenize endpoint).

    kv-scorer tokens --tokenizer ./Qwen3-8B < body.json
    kv-scorer tokens --config scorer.yaml --model qwen3 --keys < body.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scorer.blocks import BlockHasher
from scorer.config import Config, ConfigError, TokenizerModelConfig, TokensConfig, load_config
from scorer.tokens.service import NoTokenizer, Tokenization, TokenizeError

_CLI_MODEL = "cli"


def register(subparsers: Any) -> None:
    """Add the `tokens` subcommand."""
    p = subparsers.add_parser(
        "tokens",
        help="print the token ids of a request body read on stdin",
        description=(
            "Read one /v1/completions or /v1/chat/completions body on stdin and print the "
            "token ids the engine would see, as a JSON list."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", help="tokenizer.json, or a directory (also a HF cache entry)")
    src.add_argument("--config", help="kv-scorer configuration file (uses tokens.models)")
    p.add_argument("--model", help="model name in --config (default: the body's 'model')")
    p.add_argument("--chat-template", help="chat template file (with --tokenizer)")
    p.add_argument(
        "--keys",
        action="store_true",
        help="print an object with token_ids, block_keys and namespace instead",
    )
    p.add_argument("--block-size", type=int, help="block size for --keys (default: config's)")
    p.add_argument("--text", action="store_true", help="print the rendered prompt text instead")
    p.set_defaults(func=run)


def _build(args: argparse.Namespace) -> tuple[Tokenization, str | None]:
    if args.tokenizer is not None:
        cfg = Config(
            tokens=TokensConfig(
                models={
                    _CLI_MODEL: TokenizerModelConfig(
                        tokenizer=args.tokenizer, chat_template=args.chat_template
                    )
                },
                segment_cache_bytes=0,
                threads=1,
            )
        )
        model: str | None = _CLI_MODEL
    else:
        cfg = load_config(args.config)
        model = args.model
    block = args.block_size or cfg.pool.block_size
    return Tokenization(cfg, BlockHasher(block, cfg.index.hash)), model


def run(args: argparse.Namespace) -> int:
    """Entry point of `kv-scorer tokens`; exit 0 ok, 2 on bad input or configuration."""
    try:
        body = json.loads(sys.stdin.read())
    except json.JSONDecodeError as e:
        print(f"kv-scorer tokens: stdin is not JSON: {e}", file=sys.stderr)
        return 2
    try:
        tokens, model = _build(args)
    except ConfigError as e:
        print(f"kv-scorer tokens: {e}", file=sys.stderr)
        return 2
    try:
        try:
            if args.text:
                print(tokens.render(model, body), end="")
                return 0
            tp = tokens.tokenize_body(model, body)
        except (TokenizeError, NoTokenizer) as e:
            print(f"kv-scorer tokens: {e}", file=sys.stderr)
            return 2
        if args.keys:
            out: Any = {
                "model": tp.model,
                "token_ids": tp.token_ids,
                "block_size": tp.block_size,
                "namespace": tp.namespace,
                "block_keys": tp.block_keys,
            }
        else:
            out = tp.token_ids
        print(json.dumps(out, separators=(",", ":")))
        return 0
    finally:
        tokens.close()
