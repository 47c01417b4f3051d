"""A large body's token-id prompt packed at parse (scorer/body.py + the compiled
`json_ids_u32`) against the reference decode (`parse_body(native=False)`): the same
document or the same 400 (message and param), then the same tokens stage outcome (packed
ids and block keys, or the same refusal) for any prompt text, well-formed or not."""

from __future__ import annotations

from typing import Any

from configs import make_config
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer import body as body_json
from scorer.blocks import BlockHasher
from scorer.director import BadRequest, parse_body
from scorer.native import NATIVE
from scorer.tokens.service import (
    NoTokenizer,
    Tokenization,
    TokenizeError,
    _id_count,
    is_token_id_prompt,
)

TOKENS = Tokenization(make_config(), BlockHasher(16))
SMALL = Tokenization(make_config(), BlockHasher(16))
SMALL.max_prompt_tokens = 5  # the count refusal (413) of a packed prompt
PAD = "p" * body_json.PACK_MIN_BYTES  # puts every body past the packing threshold


def _body(prompt: str, pad: bool = True, extra: str = "", before: str = "") -> bytes:
    user = f', "user": "{PAD}"' if pad else ""
    return f'{{"model": "m", {before}"prompt": {prompt}{user}{extra}}}'.encode()


def _parsed(body: bytes, native: bool) -> Any:
    try:
        return body_json.plain(parse_body(body, native))
    except BadRequest as e:
        return ("400", e.message, e.param)


def _tokens(tk: Tokenization, doc: Any) -> Any:
    try:
        tp = tk.tokenize_body(None, doc)
    except (TokenizeError, NoTokenizer) as e:
        return (type(e).__name__, str(e))
    return (tp.kind, tp.packed, tp.block_keys)


def _same(body: bytes) -> None:
    assert NATIVE is not None  # (tests/index/test_native.py says why when not)
    ref = _parsed(body, native=False)
    assert _parsed(body, native=True) == ref
    if isinstance(ref, dict):
        fast = parse_body(body)
        assert is_token_id_prompt(fast) == is_token_id_prompt(ref)
        assert _id_count(fast) == _id_count(ref)
        for tk in (TOKENS, SMALL):
            assert _tokens(tk, fast) == _tokens(tk, ref)


_ITEMS = [
    "0", "1", "7", "50256", "4294967295", "4294967296", "18446744073709551616",
    "99999999999999999999999", "-1", "-0", "01", "00", "1.0", "1.", "1e2", "1E2", "0e0",
    "true", "false", "null", '"5"', "[1, 2]", "[]", "[[3]]", "{}", "+1", "0x10", "1_0", "",
    "\u0661",
]  # fmt: skip
_item = st.one_of(st.sampled_from(_ITEMS), st.integers(0, 2**32 - 1).map(str))
_ws = st.sampled_from(["", " ", "\n", "\t", "\r\n  ", "\u00a0", "\f"])
_sep = st.sampled_from([",", ", ", " ,", ",\n", ",,", "", " "])


@st.composite
def _prompt_text(draw: st.DrawFn) -> str:
    items = draw(st.lists(_item, max_size=30))
    out = draw(st.sampled_from(["[", " [", "", "{"]))
    for i, it in enumerate(items):
        out += draw(_ws) + it + draw(_ws)
        if i < len(items) - 1:
            out += draw(_sep)
    return out + draw(st.sampled_from(["]", "] ", "", ",]", "]]", "}"]))


# What may stand before or after the real key: "prompt" as text in a string, as a nested
# object's key, an earlier or later duplicate, the packing's marker integer (scorer.body).
_AROUND = [
    "",
    '"a": {"prompt": [5, 6]}, ',
    '"s": "x\\"prompt\\": [5]", ',
    '"s": "\\"prompt": [5]", ',
    '"prompt": [5, 6], ',
    '"prompt": "text", ',
    '"n": 7952834521136472161, ',
    '"n": [7952834521136472161], ',
    '"n": 7952834521136472161.0, ',
    '"l": [{"prompt": [1]}], ',
]


@settings(max_examples=scaled(400))
@given(
    prompt=_prompt_text(),
    pad=st.booleans(),
    dup=st.booleans(),
    before=st.sampled_from(_AROUND),
    after=st.sampled_from(_AROUND),
)
@example(prompt="[1, 2, 3]", pad=True, dup=False, before="", after="")
@example(prompt="[]", pad=True, dup=False, before="", after="")
@example(
    prompt="[1, 2, 3, 4, 5, 6]", pad=True, dup=False, before="", after=""
)  # over SMALL's limit
@example(prompt="[0, 4294967296]", pad=True, dup=False, before="", after="")
@example(prompt="[-1]", pad=True, dup=False, before="", after="")
@example(prompt="[1.0, 2]", pad=True, dup=False, before="", after="")
@example(
    prompt="[[1, 2], [3]]", pad=True, dup=False, before="", after=""
)  # a batch: its first prompt
@example(prompt="[01]", pad=True, dup=False, before="", after="")
@example(prompt=" [ 1 ,\n2\t] ", pad=True, dup=False, before="", after="")
@example(prompt="[1, 2]", pad=True, dup=True, before="", after="")  # a later "prompt" key wins
@example(prompt="[true]", pad=True, dup=False, before="", after="")
@example(
    prompt="[1]5", pad=True, dup=False, before="", after=""
)  # a digit after the array: malformed
@example(prompt="[1, 2]", pad=True, dup=False, before='"a": {"prompt": [5, 6]}, ', after="")
@example(prompt='"t"', pad=True, dup=False, before='"a": {"prompt": [5, 6]}, ', after="")
@example(prompt="[1]", pad=True, dup=False, before='"s": "x\\"prompt\\": [5]", ', after="")
@example(
    prompt="[1, 2]", pad=True, dup=False, before='"prompt": "text", ', after=""
)  # a string-valued "prompt" first: the packed path declines, the reference decodes
@example(prompt='"t1 t2"', pad=True, dup=False, before="", after="")  # a text prompt
@example(
    prompt="7952834521136472161", pad=True, dup=False, before='"a": {"prompt": [5]}, ', after=""
)
def test_packed_prompt_is_the_reference(
    prompt: str, pad: bool, dup: bool, before: str, after: str
) -> None:
    extra = (', "prompt": [9]' if dup else "") + (", " + after.rstrip(", ") if after else "")
    _same(_body(prompt, pad, extra, before))


@settings(max_examples=scaled(200))
@given(
    prompt=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50),
    at=st.integers(0, 10**6),
    byte=st.integers(0, 255),
    insert=st.booleans(),
)
@example(prompt=[1, 2], at=0, byte=0xFF, insert=False)
def test_corrupted_bodies_get_the_reference_400(
    prompt: list[int], at: int, byte: int, insert: bool
) -> None:
    # One byte changed or inserted anywhere: the same document or the same error text.
    body = bytearray(_body(str(prompt), extra=', "messages": null, "n": 1.5'))
    at %= len(body)
    if insert:
        body.insert(at, byte)
    else:
        body[at] = byte
    _same(bytes(body))


def test_large_prompt_is_packed_not_listed() -> None:
    ids = list(range(100_000))
    doc = parse_body(_body(str(ids), pad=False))
    prompt = doc["prompt"]
    assert isinstance(prompt, body_json.PackedIds)
    assert len(prompt) == 100_000 and prompt == ids and prompt[-1] == 99_999
    assert TOKENS.tokenize_body(None, doc).packed is prompt.packed  # no copy, no re-check


def test_small_body_and_non_native_decode_lists() -> None:
    assert parse_body(b'{"model": "m", "prompt": [1, 2]}')["prompt"] == [1, 2]
    big = _body("[1, 2]")
    assert type(parse_body(big, native=False)["prompt"]) is list
    assert type(parse_body(big)["prompt"]) is body_json.PackedIds


def test_bad_top_levels_keep_their_errors() -> None:
    for body in (b"[" + b"1," * 3000 + b"1]", b'{"prompt": [1]' + b" " * 5000, b'"prompt"' * 600):
        _same(body)
    assert _parsed(b'{"prompt": [1, 2]' + b" " * 5000 + b"}", True) == (
        "400",
        "you must provide a model parameter",
        "model",
    )
