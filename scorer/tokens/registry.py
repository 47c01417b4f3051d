"""Local tokenizers per model: files on disk only, never the network.

A model's tokenizer is a `tokenizer.json` file, a directory holding `tokenizer.json` (and
usually `tokenizer_config.json`, maybe `chat_template.jinja`), or a HuggingFace cache entry
(`models--ORG--NAME/snapshots/HASH/`, the snapshot named by `refs/main` first).

What transformers adds on top of `tokenizer.json` and we mirror (transformers 5.x,
`TokenizersBackend.__init__` / `update_post_processor`):

* named special tokens (`bos_token`, `eos_token`, ...) from `tokenizer_config.json` (and a
  legacy `special_tokens_map.json` over them when the config has no
  `added_tokens_decoder`); they are the template variables `apply_chat_template` passes;
* `add_special_tokens=True` adds what `tokenizer.json`'s post-processor adds (BOS/EOS of a
  `TemplateProcessing`); like transformers 5, `add_bos_token`/`add_eos_token` in
  `tokenizer_config.json` are ignored when a `tokenizer.json` exists.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from scorer.tokens.segments import SegmentCache, added_token_pattern, bytes_to_ids, ids_to_bytes

log = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_space_ids = itertools.count(1)
# Below this many new characters a request's missing segments are encoded one by one in the
# calling thread; above, as one parallel batch (see `LocalTokenizer.encode_bytes`).
PARALLEL_MIN_CHARS = 32_768


class TokenizerLoadError(Exception):
    """A tokenizer path that cannot be used; the message names the path and why."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerLoadError(f"{path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise TokenizerLoadError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path}: the top level must be an object")
    return data


def _hf_snapshot(root: Path) -> Path | None:
    """The snapshot directory of a HF cache entry `models--ORG--NAME` (or its snapshots/)."""
    snaps = root / "snapshots" if (root / "snapshots").is_dir() else root
    if snaps.name != "snapshots":
        return None
    ref = snaps.parent / "refs" / "main"
    if ref.is_file():
        cand = snaps / ref.read_text().strip()
        if (cand / "tokenizer.json").is_file():
            return cand
    found = [d for d in snaps.iterdir() if (d / "tokenizer.json").is_file()]
    if not found:
        return None
    # No refs/main: the most recently written snapshot.
    return max(found, key=lambda d: (d / "tokenizer.json").stat().st_mtime)


def resolve_tokenizer_files(path: str | Path) -> tuple[Path, Path | None]:
    """(tokenizer.json, tokenizer_config.json or None) for a file, directory or HF cache."""
    p = Path(path).expanduser()
    if p.is_file():
        cfg = p.parent / "tokenizer_config.json"
        return p, cfg if cfg.is_file() else None
    if not p.is_dir():
        raise TokenizerLoadError(f"{p}: no such file or directory")
    d: Path | None = p if (p / "tokenizer.json").is_file() else _hf_snapshot(p)
    if d is None:
        raise TokenizerLoadError(
            f"{p}: no tokenizer.json here (nor in a HuggingFace cache snapshot below it)"
        )
    cfg = d / "tokenizer_config.json"
    return d / "tokenizer.json", cfg if cfg.is_file() else None


# Texts up to this many characters are remembered by LocalTokenizer.split until the next
# split: the inline bound of the tokens stage (scorer.tokens.service.INLINE_MAX_BYTES) with
# room; a longer prompt is split once anyway (it goes to the pool), and is not kept alive.
SPLIT_MEMO_CHARS = 16384


def _token_str(v: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as serialised AddedToken
    # objects ({"content": ..., "__type": "AddedToken", ...}).
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


@dataclass(slots=True)
class EncodeStats:
    """What one `encode_bytes` call did (for the benchmark and the tests)."""

    segments: int = 0
    misses: int = 0
    encoded_chars: int = 0


@dataclass
class LocalTokenizer:
    """One loaded tokenizer with its chat templates and special-token facts."""

    path: Path
    tokenizer: Tokenizer
    config: dict[str, Any]
    special_tokens: dict[str, str]  # bos_token → "<s>", ... (template variables)
    chat_templates: dict[str, str]  # name → source; "default" is the plain one
    prefix_ids: tuple[int, ...] = ()  # what add_special_tokens=True puts before the text
    suffix_ids: tuple[int, ...] = ()  # ... and after it
    added: dict[str, int] = field(default_factory=dict)  # added token content → id
    segment_safe: bool = False
    space: int = 0  # namespace of this tokenizer's entries in a shared SegmentCache
    # Measured at load (`encode_rate`): what encoding costs per character of new text,
    # typically and at worst. The tokens stage decides from them whether a small prompt is
    # encoded on the event loop.
    encode_ns_per_char: float = float("inf")
    encode_ns_per_char_worst: float = float("inf")

    def __post_init__(self) -> None:
        self.space = next(_space_ids)
        self._pattern = added_token_pattern(self.added)
        self._added_bytes = {c: ids_to_bytes([i]) for c, i in self.added.items()}
        # A text cut right after an added token splits the same way on its own as inside
        # any longer text, unless some added token contains another one (then a longer
        # match could start inside the cut text and run past it): scorer.tokens.prefix.
        contents = [c for c in self.added if c]
        self.prefix_safe = not any(a != b and a in b for a in contents for b in contents)
        # The last text split (the same str object) and its pieces: the tokens stage splits
        # a small prompt to decide where to encode it (Tokenization.inline_text), then
        # again to encode it; the second is this lookup. One tuple, replaced whole (the
        # pool's threads split too).
        self._split_memo: tuple[str | None, list[str]] = (None, [])

    # -- encoding ---------------------------------------------------------------------
    def encode_whole(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Reference path: one `tokenizers` call on the whole text."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if add_special_tokens:
            ids = [*self.prefix_ids, *ids, *self.suffix_ids]
        return ids

    def split(self, text: str) -> list[str]:
        """[text, added, text, added, ..., text] (the text pieces may be empty). A text of
        up to SPLIT_MEMO_CHARS is remembered with its pieces until the next one: the list
        is shared, read it only."""
        if self._pattern is None:
            return [text]
        memo = self._split_memo
        if memo[0] is text:
            return memo[1]
        pieces = self._pattern.split(text)
        if len(text) <= SPLIT_MEMO_CHARS:
            self._split_memo = (text, pieces)
        return pieces

    def encode_bytes(
        self,
        text: str,
        cache: SegmentCache | None,
        add_special_tokens: bool = False,
        stats: EncodeStats | None = None,
    ) -> bytes:
        """Token ids of `text` packed as uint32 LE, reusing cached segments.

        Equal to `encode_whole` (the property tests check it); falls back to one whole
        call when the tokenizer is not segment-safe or there is no cache.
        """
        if not self.segment_safe or cache is None or cache.max_bytes <= 0:
            # encode_batch_fast releases the GIL (plain `encode` does not, tokenizers
            # 0.23): other requests and the event loop keep running meanwhile.
            enc = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0]
            body = ids_to_bytes(enc.ids)
            if stats is not None:
                stats.segments += 1
                stats.misses += 1
                stats.encoded_chars += len(text)
        else:
            body = b"".join(self.encode_parts(self.split(text), cache, stats))
        if add_special_tokens and (self.prefix_ids or self.suffix_ids):
            body = ids_to_bytes(self.prefix_ids) + body + ids_to_bytes(self.suffix_ids)
        return body

    def encode_parts(
        self, pieces: list[str], cache: SegmentCache, stats: EncodeStats | None = None
    ) -> list[bytes]:
        """Packed ids of each non-empty piece of `split` output, in order: cached text
        pieces looked up, the rest encoded."""
        if len(pieces) == 1:
            # No added token (a plain completion prompt): the general path's work for one
            # piece, without its lists, dict and loops (~4,000 instructions).
            t = pieces[0]
            if not t:
                return []
            v = cache.lookup(self.space, [t])[0]
            if v is None:
                enc = self.tokenizer.encode_batch_fast([t], add_special_tokens=False)[0]
                v = ids_to_bytes(enc.ids)
                cache.store(self.space, [(t, v)])
                if stats is not None:
                    stats.misses += 1
                    stats.encoded_chars += len(t)
            if stats is not None:
                stats.segments += 1
            return [v]
        texts = pieces[0::2]
        # Empty pieces (adjacent added tokens) encode to nothing: skip them.
        wanted = [t for t in texts if t]
        found = cache.lookup(self.space, wanted)
        got: dict[str, bytes] = {}
        missing: list[str] = []
        for t, v in zip(wanted, found, strict=True):
            if v is None:
                missing.append(t)
            else:
                got[t] = v
        if missing:
            uniq = list(dict.fromkeys(missing))
            batch = self.tokenizer.encode_batch_fast
            if sum(map(len, uniq)) < PARALLEL_MIN_CHARS:
                # A new turn: encode in this thread. Fanning a few small pieces out to
                # tokenizers' rayon pool costs more in wake-ups than it saves.
                encs = [batch([t], add_special_tokens=False)[0] for t in uniq]
            else:
                # A cold, long prompt: one batch, encoded in parallel by tokenizers.
                encs = batch(uniq, add_special_tokens=False)
            new = [(t, ids_to_bytes(e.ids)) for t, e in zip(uniq, encs, strict=True)]
            cache.store(self.space, new)
            got.update(new)
        if stats is not None:
            stats.segments += len(wanted)
            stats.misses += len(missing)
            stats.encoded_chars += sum(len(t) for t in missing)
        added = self._added_bytes
        out: list[bytes] = []
        for i, p in enumerate(pieces):
            if i & 1:
                out.append(added[p])
            elif p:
                out.append(got[p])
        return out

    def encode(
        self, text: str, cache: SegmentCache | None = None, add_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of `text` (see `encode_bytes`)."""
        return bytes_to_ids(self.encode_bytes(text, cache, add_special_tokens))

    def chat_template(self, name_or_source: str | None, has_tools: bool) -> str | None:
        """The template to render: a request/config override, a named one, or the default.

        Mirrors transformers' `get_chat_template`: with several named templates, a name
        picks one, else "tool_use" when tools are given, else "default".
        """
        if name_or_source is not None:
            return self.chat_templates.get(name_or_source, name_or_source)
        if has_tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        return self.chat_templates.get("default")


_PROSE = (
    "the a of to and in is it that for on with as was by this be are from at or an have "
    "not they which one you had but all were when we there can more if will what about "
    "request model cache prompt token worker answer question time system user data code "
    "I'd it's don't 2024 3.14 (see above) e.g. café naïve — [1, 2]"
)


def encode_rate(tokenizer: Tokenizer, samples: int = 3) -> tuple[float, float]:
    """(typical, worst) nanoseconds per character of `encode_batch_fast` on new text.

    Typical: prose of common words (after one pass, as a serving tokenizer's word cache
    is); worst: words of random letters it has not seen (every one a BPE merge search).
    Each the median over `samples` different texts of ~2,000 characters. A busy machine
    measures slower, which only keeps more work off the event loop.
    """
    import random
    import time

    rng = random.Random(20260101)
    letters = "abcdefghijklmnopqrstuvwxyzéüß東京0123456789"

    def rate(text: str) -> float:
        t0 = time.perf_counter()
        tokenizer.encode_batch_fast([text], add_special_tokens=False)
        return (time.perf_counter() - t0) * 1e9 / len(text)

    words = _PROSE.split()
    typical, worst = [], []
    for _ in range(samples):
        prose = " ".join(rng.choice(words) for _ in range(400))
        rate(prose)  # the word cache learns the words
        typical.append(rate(prose))
        noise = " ".join(
            "".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(330)
        )
        worst.append(rate(noise))
    mid = len(typical) // 2
    return sorted(typical)[mid], sorted(worst)[mid]


def _probe_texts(added: list[str]) -> list[str]:
    """Texts that exercise whitespace and normalization next to added tokens."""
    words = [
        "",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "hello",
        " hello ",
        "hello\n",
        "\nworld",
        "e\u0301",
        "\u0301x",
        "'s",
        "123",
        "日本語",
        "<",
        ">",
        "|",
    ]
    out = []
    for tok in added:
        for a, b in itertools.product(words, repeat=2):
            out.append(a + tok + b)
        out.append(tok + tok + " " + tok + "\n" + tok)
    return out


def load_tokenizer(
    path: str | Path, chat_template_file: str | Path | None = None
) -> LocalTokenizer:
    """Load a tokenizer from local files (see the module docstring); never the network."""
    tj, cfg_path = resolve_tokenizer_files(path)
    try:
        tok = Tokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a plain Exception on bad files
        raise TokenizerLoadError(f"{tj}: cannot load: {e}") from e
    cfg = _read_json(cfg_path) if cfg_path is not None else {}

    special = {n: s for n in SPECIAL_TOKEN_NAMES if (s := _token_str(cfg.get(n))) is not None}
    stm = tj.parent / "special_tokens_map.json"
    if "added_tokens_decoder" not in cfg and stm.is_file():
        # Legacy repos: transformers 5 merges special_tokens_map.json over the config's
        # values when the config has no added_tokens_decoder.
        for n, v in _read_json(stm).items():
            if n in SPECIAL_TOKEN_NAMES and (s := _token_str(v)) is not None:
                special[n] = s

    templates: dict[str, str] = {}
    raw = cfg.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("template"), str):
                templates[str(item.get("name", "default"))] = item["template"]
    jinja_file = tj.parent / "chat_template.jinja"
    if jinja_file.is_file():  # transformers >= 4.43 saves the template beside the config
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    if chat_template_file is not None:
        try:
            templates["default"] = Path(chat_template_file).read_text(encoding="utf-8")
        except OSError as e:
            raise TokenizerLoadError(f"{chat_template_file}: {e.strerror}") from e

    decoder = tok.get_added_tokens_decoder()
    added = {t.content: i for i, t in decoder.items()}

    # add_special_tokens=True: what tokenizer.json's post-processor puts around the text.
    # transformers 5 ignores tokenizer_config's add_bos_token/add_eos_token when a
    # tokenizer.json exists (PreTrainedTokenizerBase._from_pretrained pops them), so we do
    # too: the post-processor is the one source of truth.
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            prefix, suffix = tuple(full[:i]), tuple(full[i + len(plain) :])
            break

    # Flags that make a token eat its neighbours or match after normalization break the
    # "pieces are independent" argument: such tokenizers are encoded whole.
    safe = all(
        not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in decoder.values()
    )
    lt = LocalTokenizer(
        path=tj,
        tokenizer=tok,
        config=cfg,
        special_tokens=special,
        chat_templates=templates,
        prefix_ids=prefix,
        suffix_ids=suffix,
        added=added,
        segment_safe=safe,
    )
    lt.encode_ns_per_char, lt.encode_ns_per_char_worst = encode_rate(tok)
    if safe and added:
        probe_cache = SegmentCache(1 << 20)
        by_id = sorted(added, key=added.__getitem__)
        # A few special and non-special tokens, not all of them: this runs at start-up.
        sample = list(dict.fromkeys(by_id[:3] + by_id[-3:]))
        for text in _probe_texts(sample):
            if lt.encode(text, probe_cache) != lt.encode_whole(text):
                log.warning(
                    "tokenizer %s: segment-wise encoding differs from whole-text encoding "
                    "on %r; encoding whole prompts (no segment cache)",
                    tj,
                    text,
                )
                lt.segment_safe = False
                break
    return lt


_loaded: dict[tuple[object, ...], LocalTokenizer] = {}
_loaded_lock = threading.Lock()


def _stamp(p: Path | None) -> tuple[object, ...]:
    if p is None:
        return (None,)
    st = p.stat()
    return (str(p.resolve()), st.st_mtime_ns, st.st_size)


def load_tokenizer_shared(
    path: str | Path, chat_template_file: str | Path | None = None
) -> LocalTokenizer:
    """`load_tokenizer`, once per process for the same unchanged files.

    Several apps (tests, `kv-scorer serve` restarts in one process) and several models on
    one tokenizer share the loaded object: `tokenizers.Tokenizer` is safe to use from many
    threads, and the rest of a LocalTokenizer is read-only after loading.
    """
    tj, cfg = resolve_tokenizer_files(path)
    tpl = None if chat_template_file is None else Path(chat_template_file)
    jinja = tj.parent / "chat_template.jinja"
    key = (_stamp(tj), _stamp(cfg), _stamp(tpl), _stamp(jinja if jinja.is_file() else None))
    with _loaded_lock:
        lt = _loaded.get(key)
        if lt is None:
            lt = load_tokenizer(path, chat_template_file)
            _loaded[key] = lt
        return lt
