"""The tokens stage of the request path: body → token ids → block keys.

`Tokenization` owns the tokenizer registry (one tokenizer per model, LoRA adapters share
their base model's), the segment cache and a small thread pool, and implements the
`RequestPreparer` protocol of scorer.director.

Completions (`prompt`): a string is tokenized with the tokenizer's default
`add_special_tokens=True` (vLLM's default for /v1/completions); a list of ints is taken as
token ids; a batch (a list of strings or a list of id lists) is scored by its FIRST prompt:
vLLM runs every prompt of a batch on the worker the request lands on, and the first
prompt's leading blocks carry whatever prefix the batch shares, at the cost of one prompt
instead of all of them. `prompt_tokens` is that first prompt's length.

Chat (`messages`): rendered like vLLM (see scorer.tokens.chat), then tokenized with
`add_special_tokens=False` (vLLM's default for chat). A body's own `add_special_tokens`
field overrides either default, as in vLLM.

`truncate_prompt_tokens: k` (vLLM) keeps the last k tokens, as the engine does.

The block namespace folds the LoRA adapter (the request's `model` when it names an
adapter of `tokens.lora_base`, or `RoutingRequest.lora`) and vLLM's `cache_salt`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from scorer.blocks import BlockHasher, namespace_key
from scorer.body import PackedIds
from scorer.config import Config, ConfigError
from scorer.errors import json_error
from scorer.histogram import LoopCounter, LoopHistogram
from scorer.native import NATIVE
from scorer.routing import RoutingRequest
from scorer.tokens.budget import BudgetExceeded
from scorer.tokens.chat import ChatError, render_chat
from scorer.tokens.prefix import HEAD_CHARS, PrefixState, PrefixStates, Space
from scorer.tokens.registry import (
    EncodeStats,
    LocalTokenizer,
    TokenizerLoadError,
    load_tokenizer_shared,
)
from scorer.tokens.segments import (
    SEGMENT_BYTES,
    SegmentCache,
    bytes_to_ids,
    ids_array,
    ids_to_bytes,
)

log = logging.getLogger(__name__)

# Observed on the event loop when the work is done (wherever it ran): see scorer.histogram.
TOKENIZE_SECONDS = LoopHistogram(
    "kv_scorer_tokenize_seconds",
    "Time from request body to block keys (render + tokenize + hash).",
    buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),
)
# Counted on the event loop by `prepare` (a LoopCounter: no lock, ~100 instructions).
TOKENIZE_OUTCOMES = LoopCounter(
    "kv_scorer_tokenize_requests",
    "Requests through the tokens stage by outcome (ok, no_tokenizer, error, over_budget).",
    ["outcome"],
)
# Children resolved once.
_OUTCOME = {o: TOKENIZE_OUTCOMES.labels(o) for o in ("ok", "no_tokenizer", "error", "over_budget")}
# A token-id list's check and packing in one compiled pass (scorer/native/_speedups.pyx),
# when built; `Tokenization._ids_bytes(native=False)` is the reference.
_NATIVE_IDS = getattr(NATIVE, "ids_u32_bytes", None)


# Text prompts are tokenized on the event loop when the work is estimated to cost at most
# INLINE_BUDGET_S: about what handing them to the pool costs (the hop measured ~100-130 µs
# per request by bench/profile_kv.py). The estimate counts the characters to encode (a
# completion prompt's pieces the segment cache lacks, else every body byte) at the
# tokenizer's measured typical rate (`LocalTokenizer.encode_ns_per_char`), plus the chat
# template's render per message. The same characters at the tokenizer's worst measured
# rate (random words, nothing cached) must stay within INLINE_MAX_STALL_S: the
# bound on how long one request may hold the loop, whatever it sends. Bodies over
# INLINE_MAX_BYTES never run on the loop.
INLINE_BUDGET_S = 100e-6
INLINE_MAX_STALL_S = 1e-3
INLINE_MAX_BYTES = 8192
# The Qwen3 template renders ~5 µs per message (bench/bench_tokens.py: 0.30 ms for 58).
RENDER_S_PER_MESSAGE = 6e-6
# Token-id prompts up to this many ids are hashed on the event loop (~20-30 µs per 1,000
# ids, less than decoding the same ids from the JSON body, which the loop already did);
# longer ones go to the pool. The pool hop is not free: the hashing holds the GIL either
# way, and under CPU contention handing it to a thread and back cost 10-15 ms wall at p50
# (e2e Mooncake run, prompts of 2k-30k ids: decision total 13.7 ms through the pool,
# 1.2 ms inline; bench/routing/results.md, "decision latency"), which is why 2,048 was too
# low: most conversation prompts are longer.
INLINE_MAX_IDS = 32768


def _id_count(body: Mapping[str, Any]) -> int:
    """Ids in a token-id prompt (its first prompt for a batch)."""
    prompt = body.get("prompt")
    # (`type(...) is`: PackedIds is final, and isinstance against a Sequence subclass runs
    # ABCMeta's check)
    if type(prompt) is PackedIds:  # packed at parse (scorer.body)
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, list) else 0


def is_token_id_prompt(body: Mapping[str, Any]) -> bool:
    """A completions body whose prompt is already token ids (or a batch of them).

    Such a prompt needs no tokenizer: the ids are what the engine sees.
    """
    prompt = body.get("prompt")
    if type(prompt) is PackedIds:  # packed at parse: never empty (scorer.body; final)
        return "messages" not in body
    if not isinstance(prompt, list) or not prompt or "messages" in body:
        return False
    first = prompt[0]
    if isinstance(first, list):
        first = first[0] if first else None
    return isinstance(first, int) and not isinstance(first, bool)


REQUEST_TEMPLATES = Counter(
    "kv_scorer_tokens_request_chat_templates_total",
    "Request bodies carrying their own chat_template, by outcome (ignored: not allowed, the "
    "model's template used; rendered; over_budget: past its time or output budget)",
    ["outcome"],
)


class TokenizeError(ValueError):
    """The body cannot be turned into tokens (bad shape, template error)."""


class NoTokenizer(LookupError):
    """No tokenizer is configured for the model."""


class PromptTooLarge(TokenizeError):
    """The prompt is over the per-request budget (`tokens.max_prompt_tokens` or
    `tokens.max_tokenize_bytes`): refused with 413, never routed by load."""

    status = 413


@dataclass(slots=True)
class _Cut:
    """Where a prompt's text is cut for the prefix states, and the state it extends."""

    space: Space
    text: str
    packed_bytes: int
    replaces: int | None


@dataclass(slots=True)
class TokenizedPrompt:
    """A request's prompt as the engine will see it, and its block keys."""

    packed: bytes  # the token ids as little-endian uint32 (scorer.blocks' packed form)
    block_keys: list[int]
    namespace: int
    block_size: int
    model: str | None = None  # the base model whose tokenizer was used
    lora: str | None = None
    cache_salt: str | None = None
    kind: str = "completion"  # "completion" | "chat" | "token_ids"
    stats: dict[str, int] = field(default_factory=dict)
    hash_seconds: float = 0.0  # of which: chaining the block keys (decision stage "hash")

    @property
    def token_ids(self) -> list[int]:
        """The token ids as a list (built on each access; the request path uses `packed`)."""
        return bytes_to_ids(self.packed)

    @property
    def prompt_tokens(self) -> int:
        """How many token ids."""
        return len(self.packed) // 4


class Tokenization:
    """Tokenizer registry + segment cache + thread pool; the scorer's `RequestPreparer`.

    Constructor: `Tokenization(config, hasher)`, with `config.tokens` (models, lora_base,
    on_missing, threads, segment_cache_bytes) and `config.pool.models` (checked at
    start-up when `on_missing` is "error"), and the app's shared `BlockHasher`
    (`config.pool.block_size`, `config.index.hash`). Tokenizers load here, from local files
    only; a bad path raises `ConfigError` naming `tokens.models.<model>.tokenizer`.

    `await prepare(request)` fills `token_ids`, `block_keys`, `block_size`, `prompt_tokens`
    (or `tokenize_error`), running the work in the pool. `tokenize_body(model, body)` is the
    same work, synchronously (for `/debug/score` and `kv-scorer tokens`). `stop()` shuts the
    pool down and releases the cache. As an app component it also serves
    `POST /debug/tokenize[?model=M]` on the admin port.
    """

    def __init__(self, config: Config, hasher: BlockHasher) -> None:
        self.config = config
        self.hasher = hasher
        tc = config.tokens
        self.lora_base = dict(tc.lora_base)
        self.cache = SegmentCache(tc.segment_cache_bytes)
        # Conversation prefixes already split and hashed get a quarter of the budget.
        self.prefixes = PrefixStates(tc.segment_cache_bytes // 4, SEGMENT_BYTES.inc)
        self._tokenizers: dict[str, LocalTokenizer] = {}
        by_source: dict[tuple[str, str | None], LocalTokenizer] = {}
        for model, mc in tc.models.items():
            key = (str(Path(mc.tokenizer).expanduser().resolve()), mc.chat_template)
            lt = by_source.get(key)
            if lt is None:
                if mc.chat_template is not None and not Path(mc.chat_template).is_file():
                    raise ConfigError(
                        f"tokens.models.{model}.chat_template: {mc.chat_template}: no such file"
                    )
                try:
                    lt = load_tokenizer_shared(mc.tokenizer, mc.chat_template)
                except TokenizerLoadError as e:
                    raise ConfigError(f"tokens.models.{model}.tokenizer: {e}") from e
                by_source[key] = lt
            self._tokenizers[model] = lt
        for adapter, base in self.lora_base.items():
            if base not in self._tokenizers and tc.on_missing == "error":
                raise ConfigError(
                    f"tokens.lora_base.{adapter}: base model {base!r} has no tokenizer in "
                    "tokens.models"
                )
        if tc.on_missing == "error":
            for model in config.pool.models:
                if self.tokenizer_for(model) is None:
                    raise ConfigError(
                        f"tokens.models: no tokenizer for model {model!r} (listed in "
                        "pool.models; tokens.on_missing is 'error')"
                    )
        self._pool: ThreadPoolExecutor | None = None
        self._threads = tc.threads
        self.max_prompt_tokens = tc.max_prompt_tokens
        self.max_tokenize_bytes = tc.max_tokenize_bytes
        # (bound once: a config model's attribute reads go through pydantic's __getattr__)
        self._adapter_of = tc.adapter_of

    # -- lifecycle (app component) -------------------------------------------------------
    async def start(self) -> None:
        """Create the thread pool (also created lazily by the first `prepare`)."""
        self._executor()

    async def stop(self) -> None:
        """Shut the pool down and release the segment cache."""
        self.close()

    def close(self) -> None:
        """Synchronous `stop`."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.cache.clear()
        self.prefixes.clear()

    def routes(self) -> list[tuple[str, str, Any]]:
        """Admin HTTP: `POST /debug/tokenize` (a request body → tokens, keys, namespace)."""
        return [("POST", "/debug/tokenize", self._debug_tokenize)]

    async def _debug_tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return json_error(400, "the body is not JSON")
        model = request.query.get("model")
        loop = asyncio.get_running_loop()
        try:
            tp = await loop.run_in_executor(self._executor(), self.tokenize_body, model, body)
        except NoTokenizer as e:
            return json_error(404, str(e), param="model")
        except PromptTooLarge as e:
            return json_error(413, str(e), param="prompt", code="prompt_too_large")
        except TokenizeError as e:
            return json_error(400, str(e))
        return web.json_response(
            {
                "model": tp.model,
                "lora": tp.lora,
                "cache_salt": tp.cache_salt,
                "kind": tp.kind,
                "prompt_tokens": tp.prompt_tokens,
                "token_ids": tp.token_ids,
                "block_size": tp.block_size,
                "namespace": tp.namespace,
                "block_keys": [str(k) for k in tp.block_keys],  # uint64: JSON-safe as text
                "stats": tp.stats,
            }
        )

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kv-tokens")
        return self._pool

    # -- lookups ---------------------------------------------------------------------------
    def base_model(self, model: str | None) -> str | None:
        """The model whose tokenizer serves `model` (itself, or a LoRA adapter's base)."""
        if model is None:
            return None
        return self.lora_base.get(model, model)

    def tokenizer_for(self, model: str | None) -> LocalTokenizer | None:
        """The tokenizer for a model or LoRA adapter name, or None."""
        base = self.base_model(model)
        return None if base is None else self._tokenizers.get(base)

    @property
    def models(self) -> list[str]:
        """Models with a tokenizer."""
        return sorted(self._tokenizers)

    # -- the work --------------------------------------------------------------------------
    def tokenize_body(
        self,
        model: str | None,
        body: Mapping[str, Any],
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> TokenizedPrompt:
        """Token ids and block keys of a completions or chat body (synchronous).

        `model` defaults to `body["model"]`; a LoRA adapter name (a key of
        `tokens.lora_base`) selects its base tokenizer and its own block namespace.
        Raises `NoTokenizer`, `TokenizeError` or `PromptTooLarge` (token-id prompts are
        counted before hashing, text prompts after tokenizing).
        """
        if type(body) is not dict and not isinstance(body, Mapping):  # (dict: no ABC check)
            raise TokenizeError("the request body must be a JSON object")
        if model is None:
            m = body.get("model")
            model = m if isinstance(m, str) else None
        lt = self.tokenizer_for(model)
        if lt is None and not is_token_id_prompt(body):
            raise NoTokenizer(f"no tokenizer for model {model!r}")
        base = self.base_model(model)
        if lora is None:
            lora = self._adapter_of(model)
        if cache_salt is None:
            salt = body.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise TokenizeError("cache_salt must be a string")
            cache_salt = salt
        ns = namespace_key(lora_name=lora, cache_salt=cache_salt)

        stats: dict[str, int] = {}
        add_special = body.get("add_special_tokens")
        if add_special is not None and not isinstance(add_special, bool):
            raise TokenizeError("add_special_tokens must be a boolean")
        known: tuple[int, ...] = ()
        cut: _Cut | None = None
        if "messages" in body:
            kind = "chat"
            assert lt is not None  # only token-id prompts get here without a tokenizer
            text = self._render(lt, body, stats)
            buf, known, cut = self._text_bytes(lt, text, bool(add_special), ns, stats)
        elif "prompt" in body:
            kind, buf, known, cut = self._prompt_bytes(
                lt, body["prompt"], True if add_special is None else add_special, ns, stats
            )
        else:
            raise TokenizeError("the body has neither 'messages' nor 'prompt'")
        if len(buf) > 4 * self.max_prompt_tokens:  # 4 bytes per token id; as sent
            raise PromptTooLarge(self._tokens_message(len(buf) // 4))
        trunc = body.get("truncate_prompt_tokens")
        if trunc is not None:
            # vLLM keeps the LAST k tokens (left truncation); -1 means "the model's maximum
            # length", which we do not know: leave the prompt whole then.
            if not isinstance(trunc, int) or isinstance(trunc, bool) or trunc < -1:
                raise TokenizeError("truncate_prompt_tokens must be an integer >= -1")
            if trunc > 0 and len(buf) > 4 * trunc:
                buf = buf[len(buf) - 4 * trunc :]
                stats["truncated_to"] = trunc
                known, cut = (), None  # the blocks moved: nothing of the prefix holds
        t_hash = time.perf_counter()
        hasher = self.hasher
        if known:
            # The prefix's full blocks are hashed already: chain on from its last key.
            keys = list(known)
            keys += hasher.keys_from_bytes(buf[len(known) * hasher.block_size * 4 :], 0, known[-1])
        else:
            keys = hasher.keys_from_bytes(buf, ns)
        hash_seconds = time.perf_counter() - t_hash
        if cut is not None:
            n = cut.packed_bytes // (4 * hasher.block_size)
            state = PrefixState(cut.text, buf[: cut.packed_bytes], tuple(keys[:n]))
            self.prefixes.store(cut.space, state, cut.replaces)
        # (positional, in field order: keywords cost a dict per call)
        return TokenizedPrompt(
            buf, keys, ns, hasher.block_size, base, lora, cache_salt, kind, stats, hash_seconds
        )

    def render(self, model: str | None, body: Mapping[str, Any]) -> str:
        """The prompt string a chat body renders to (for operators and tests)."""
        lt = self.tokenizer_for(model if model is not None else body.get("model"))
        if lt is None:
            raise NoTokenizer(f"no tokenizer for model {model!r}")
        if "messages" not in body and isinstance(body.get("prompt"), str):
            return str(body["prompt"])
        return self._render(lt, body)

    def _render(
        self, lt: LocalTokenizer, body: Mapping[str, Any], stats: dict[str, int] | None = None
    ) -> str:
        override = body.get("chat_template")
        if override is not None and not isinstance(override, str):
            raise TokenizeError("chat_template must be a string")
        budget: tuple[float, int] | None = None
        if override is not None and override not in lt.chat_templates:
            # Template source from the client: code we run only when configured to.
            tc = self.config.tokens
            if not tc.allow_request_chat_template:
                REQUEST_TEMPLATES.labels("ignored").inc()
                if stats is not None:
                    stats["request_template_ignored"] = 1
                override = None
            else:
                REQUEST_TEMPLATES.labels("rendered").inc()
                budget = (tc.request_template_timeout_s, tc.request_template_max_chars)
        template = lt.chat_template(override, bool(body.get("tools")))
        if template is None:
            raise TokenizeError("the model's tokenizer has no chat template")
        try:
            return render_chat(body, template, lt.special_tokens, budget)
        except ChatError as e:
            raise TokenizeError(str(e)) from e
        except BudgetExceeded as e:
            REQUEST_TEMPLATES.labels("over_budget").inc()
            raise TokenizeError(str(e)) from e

    def _text_bytes(
        self,
        lt: LocalTokenizer,
        text: str,
        add_special: bool,
        ns: int,
        stats: dict[str, int],
    ) -> tuple[bytes, tuple[int, ...], _Cut | None]:
        """Packed ids of a prompt text; the keys of the leading full blocks when a stored
        prefix gave them; where to cut this text for the next request (scorer.tokens.prefix)."""
        es = EncodeStats()
        cache = self.cache
        if not (
            lt.prefix_safe
            and lt.segment_safe
            and cache.max_bytes > 0
            and self.prefixes.max_bytes > 0
            and len(text) >= HEAD_CHARS
        ):
            buf = lt.encode_bytes(text, cache, add_special, es)
            stats.update(segments=es.segments, misses=es.misses, encoded_chars=es.encoded_chars)
            return buf, (), None
        specials = add_special and bool(lt.prefix_ids or lt.suffix_ids)
        space = (lt.space, ns, specials)
        found = self.prefixes.find(space, text)
        known: tuple[int, ...] = ()
        handle: int | None = None
        if found is None:
            start, head = 0, b""
            if specials:
                head = ids_to_bytes(lt.prefix_ids)
        else:
            handle, st = found
            start, head, known = len(st.text), st.packed, st.keys
            stats["prefix_chars"] = start
        pieces = lt.split(text[start:] if start else text)
        parts = lt.encode_parts(pieces, cache, es)
        stats.update(segments=es.segments, misses=es.misses, encoded_chars=es.encoded_chars)
        body = b"".join(parts)
        cut: _Cut | None = None
        last = pieces[-1]
        cut_chars = len(text) - len(last)
        if len(pieces) > 1 and cut_chars >= HEAD_CHARS:
            # The next request of this conversation starts here: after the last added token.
            packed = len(head) + len(body) - (len(parts[-1]) if last else 0)
            cut = _Cut(space, text[:cut_chars], packed, handle)
        buf = head + body
        if specials and lt.suffix_ids:
            buf += ids_to_bytes(lt.suffix_ids)
        return buf, known, cut

    def _prompt_bytes(
        self,
        lt: LocalTokenizer | None,
        prompt: Any,
        add_special: bool,
        ns: int,
        stats: dict[str, int],
    ) -> tuple[str, bytes, tuple[int, ...], _Cut | None]:
        if type(prompt) is PackedIds:  # (final)
            # Checked and packed at parse (scorer.body): only the count is left to check.
            if len(prompt) > self.max_prompt_tokens:
                raise PromptTooLarge(self._tokens_message(len(prompt)))
            return "token_ids", prompt.packed, (), None
        if isinstance(prompt, list):
            if not prompt:
                raise TokenizeError("prompt must not be an empty list")
            first = prompt[0]
            if isinstance(first, int) and not isinstance(first, bool):
                return "token_ids", self._ids_bytes(prompt), (), None
            # A batch: score the first prompt (see the module docstring).
            stats["batch"] = len(prompt)
            prompt = first
            if isinstance(prompt, list):
                return "token_ids", self._ids_bytes(prompt), (), None
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string, a list of token ids, or a batch")
        if lt is None:
            raise NoTokenizer("a text prompt needs a tokenizer")
        buf, known, cut = self._text_bytes(lt, prompt, add_special, ns, stats)
        return "completion", buf, known, cut

    def _tokens_message(self, n: int) -> str:
        return (
            f"the prompt has {n} tokens, over this router's limit of {self.max_prompt_tokens}"
            " (tokens.max_prompt_tokens)"
        )

    def bytes_message(self, n: int) -> str:
        """The refusal message of a text prompt whose body is over max_tokenize_bytes."""
        return (
            f"the request body has {n} bytes, over this router's limit of "
            f"{self.max_tokenize_bytes} for a text prompt (tokens.max_tokenize_bytes)"
        )

    def _ids_bytes(self, ids: list[Any], native: bool = True) -> bytes:
        if len(ids) > self.max_prompt_tokens:
            # Counted before any id is checked or hashed (cheap).
            raise PromptTooLarge(self._tokens_message(len(ids)))
        if native and _NATIVE_IDS is not None and type(ids) is list:
            # The same checks and bytes in one compiled pass (the code below is the
            # reference; tests/tokens/test_ids_native.py compares both).
            try:
                return _NATIVE_IDS(ids)  # type: ignore[no-any-return]
            except TypeError:
                raise TokenizeError("token id prompts must be lists of integers") from None
            except OverflowError:
                raise TokenizeError("token ids must be in [0, 2**32)") from None
        # One C-level pass over the types (a per-id isinstance generator cost ~10x more);
        # JSON gives int, float, str, bool, ...: only int is a token id (bool is an int
        # subclass, so `type` and not `isinstance`).
        if not set(map(type, ids)) <= {int}:
            raise TokenizeError("token id prompts must be lists of integers")
        try:
            return ids_to_bytes(ids)
        except OverflowError as e:
            raise TokenizeError("token ids must be in [0, 2**32)") from e

    def inline_text(self, model: Any, body: Mapping[str, Any], body_bytes: int) -> bool:
        """Whether a text body's tokens stage is cheap enough for the event loop (see
        INLINE_BUDGET_S): characters to encode (a completion prompt's pieces missing from
        the segment cache; else every body byte) x the tokenizer's measured rates, plus the
        render per chat message, within the budget (typical rate) and the stall bound
        (worst rate)."""
        if not 0 < body_bytes <= INLINE_MAX_BYTES:
            return False
        lt = self.tokenizer_for(model if isinstance(model, str) else None)
        if lt is None:
            return False
        render = 0.0
        chars = body_bytes
        messages = body.get("messages")
        prompt = body.get("prompt")
        if messages is not None:
            render = (len(messages) if isinstance(messages, list) else 1) * RENDER_S_PER_MESSAGE
        elif isinstance(prompt, str) and lt.segment_safe and self.cache.max_bytes > 0:
            # A completion prompt's pieces are known before any work: count only the
            # characters the segment cache does not hold (a repeated prompt costs lookups).
            chars = self.cache.missing_chars(lt.space, lt.split(prompt)[0::2])
        typical = chars * lt.encode_ns_per_char * 1e-9 + render
        worst = chars * lt.encode_ns_per_char_worst * 1e-9 + render
        return typical <= INLINE_BUDGET_S and worst <= INLINE_MAX_STALL_S

    # -- RequestPreparer -------------------------------------------------------------------
    def prepare_sync(self, request: RoutingRequest) -> str | None:
        """Fill the request's token fields in the calling thread (see `prepare`). Returns
        the outcome (ok, no_tokenizer, error, over_budget; None without a body), which
        `prepare` counts on the event loop."""
        body = request.body
        if body is None:
            return None
        model = request.model if request.model is not None else body.get("model")
        if self.tokenizer_for(model) is None and not is_token_id_prompt(body):
            return "no_tokenizer"  # token_ids stays None: the policy routes by load
        return self._fill(request, model, body)

    def _fill(self, request: RoutingRequest, model: Any, body: Mapping[str, Any]) -> str:
        """prepare_sync past its checks (a tokenizer, or token ids): the outcome."""
        t0 = time.perf_counter()
        try:
            tp = self.tokenize_body(model, body, lora=request.lora, cache_salt=request.cache_salt)
        except PromptTooLarge as e:
            request.over_budget = str(e)
            return "over_budget"
        except (TokenizeError, NoTokenizer) as e:
            request.tokenize_error = str(e)
            return "error"
        request.token_ids = ids_array(tp.packed)
        request.block_keys = tp.block_keys
        request.block_size = tp.block_size
        request.prompt_tokens = tp.prompt_tokens
        if request.cache_salt is None:
            request.cache_salt = tp.cache_salt
        if request.lora is None:
            request.lora = tp.lora
        elapsed = time.perf_counter() - t0
        # Decision stages: render + encode, then hashing (the router reports both).
        request.stages["tokenize"] = elapsed - tp.hash_seconds
        request.stages["hash"] = tp.hash_seconds
        return "ok"

    async def prepare(self, request: RoutingRequest) -> None:
        """Fill `token_ids`, `block_keys`, `block_size`, `prompt_tokens` off the event loop.

        No tokenizer for the model: leaves `token_ids` None. A body that cannot be
        rendered or tokenized: sets `tokenize_error`. A prompt over the budget (token ids
        counted, a text body's bytes, then its tokens): sets `over_budget`, before the work
        when it can. Never raises for a bad body.
        """
        body = request.body
        if body is None:
            return
        model = request.model if request.model is not None else body.get("model")
        if is_token_id_prompt(body):
            n = _id_count(body)
            if n > self.max_prompt_tokens:
                request.over_budget = self._tokens_message(n)
                _OUTCOME["over_budget"].value += 1.0
                return
            inline = n <= INLINE_MAX_IDS
        elif self.tokenizer_for(model) is None:
            # No tokenizer (and not ids): nothing to do but count it — the load fallback
            # costs no thread hop and renders nothing.
            _OUTCOME["no_tokenizer"].value += 1.0
            return
        elif request.body_bytes > self.max_tokenize_bytes:
            request.over_budget = self.bytes_message(request.body_bytes)
            _OUTCOME["over_budget"].value += 1.0
            return
        else:
            inline = self.inline_text(request.model or body.get("model"), body, request.body_bytes)
        # (past the checks above: a tokenizer or token ids, what prepare_sync checks first)
        if inline and "chat_template" not in body:  # request-supplied code: always off the loop
            # Cheap work: a thread-pool hop (~100-200 µs, more under load) would cost more.
            outcome = self._fill(request, model, body)
        else:
            loop = asyncio.get_running_loop()
            outcome = await loop.run_in_executor(self._executor(), self._fill, request, model, body)
        _OUTCOME[outcome].value += 1.0
        if request.block_keys is not None:
            stages = request.stages
            TOKENIZE_SECONDS.observe(stages.get("tokenize", 0.0) + stages.get("hash", 0.0))
