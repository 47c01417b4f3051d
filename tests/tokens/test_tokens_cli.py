"""`kv-scorer tokens`: a body on stdin → token ids on stdout (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokens_helpers import QWEN3, hf


def _run(args: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scorer.cli", "tokens", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_cli_chat_and_completion_and_errors(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    body = {"model": "whatever", "messages": msgs}
    out = _run(["--tokenizer", str(QWEN3)], json.dumps(body))
    assert out.returncode == 0, out.stderr
    want = hf(QWEN3).apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert json.loads(out.stdout) == list(want)

    # --config/--model, with --keys: the namespace follows the body's cache_salt.
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"pool:\n  block_size: 4\ntokens:\n  models:\n    qwen3:\n      tokenizer: {QWEN3}\n"
    )
    body2 = {"model": "qwen3", "prompt": "one two three four five six seven eight nine"}
    out = _run(["--config", str(cfg), "--keys"], json.dumps({**body2, "cache_salt": "s"}))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["token_ids"] == list(hf(QWEN3)(body2["prompt"])["input_ids"])
    assert got["block_size"] == 4 and len(got["block_keys"]) == len(got["token_ids"]) // 4
    assert got["namespace"] != 0

    bad = _run(["--tokenizer", str(QWEN3)], "{not json")
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    bad = _run(["--config", str(cfg), "--model", "nope"], json.dumps(body2))
    assert bad.returncode == 2 and "no tokenizer for model 'nope'" in bad.stderr
    bad = _run(["--tokenizer", str(tmp_path / "missing")], json.dumps(body2))
    assert bad.returncode == 2 and "tokens.models.cli.tokenizer" in bad.stderr
