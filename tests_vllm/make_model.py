"""Build the tier's tiny model offline: random-weight Llama, our own BPE tokenizer, a chat template.

Runs in `.venv-vllm` (needs torch and transformers):

    .venv-vllm/bin/python tests_vllm/make_model.py OUT_DIR

Nothing comes from a model hub. The tokenizer is a byte-level BPE trained with
`tokenizers` on this repository's own text (README, docs, Python sources), so token ids
are meaningful-looking and prompts tokenize to varied lengths. The weights are random
(seeded): the model's output is noise, which is all the tier needs — it measures routing,
prefix caching and KV events, never text quality.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 2048
SPECIALS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

# Our own template (ChatML-like markers). Content is rendered as a string, so vLLM flattens
# OpenAI content parts to text before rendering, as it does for string-only templates:
# the tier checks that kv-scorer renders those bodies to the same ids. Tools are listed in
# the system turn; tool calls and tool results are rendered as JSON.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>Tools available:\n"
    "{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}<|end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}<|system|>{{ m['content'] }}<|end|>\n"
    "{%- elif m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>\n"
    "{%- elif m['role'] == 'assistant' %}<|assistant|>"
    "{%- if m['content'] %}{{ m['content'] }}{%- endif %}"
    "{%- if m['tool_calls'] %}{%- for c in m['tool_calls'] %}"
    "call {{ c['function']['name'] }} {{ c['function']['arguments'] }}\n"
    "{%- endfor %}{%- endif %}<|end|>\n"
    "{%- elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}<|end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)


def corpus(root: Path) -> list[str]:
    """This repository's own text, in a fixed order (the tokenizer is deterministic)."""
    files: list[Path] = []
    for pattern in ("*.md", "docs/*.md", "scorer/**/*.py", "tests/**/*.py"):
        files.extend(sorted(root.glob(pattern)))
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    if not out:
        raise SystemExit(f"no training text under {root}")
    return out


def build_tokenizer(out: Path, texts: list[str]) -> int:
    """Train and save tokenizer.json + tokenizer_config.json; returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    # A BOS on plain (completions) prompts, as Llama tokenizers do; the chat template
    # writes its own, and vLLM renders chat with add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|end|>",
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|end|>", "pad_token": "<|pad|>"})
    )
    return int(tok.get_vocab_size())


def build_model(out: Path, vocab: int) -> None:
    """Random-weight Llama saved as safetensors (seeded)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: a size vLLM's CPU attention supports
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<|bos|>"),
        eos_token_id=tok.token_to_id("<|end|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
        dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(str(out))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parent.parent
    vocab = build_tokenizer(out, corpus(root))
    build_model(out, vocab)
    print(json.dumps({"model_dir": str(out), "vocab": vocab}))


if __name__ == "__main__":
    main()
