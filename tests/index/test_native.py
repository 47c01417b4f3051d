"""The compiled hot paths (scorer.native) against the pure-Python reference: same keys, same
engine-key maps, same token arrays, same errors."""

from __future__ import annotations

import os
import subprocess
import sys
from array import array
from typing import Any

import msgspec
import pytest
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.blocks import BlockHasher, tokens_to_bytes
from scorer.index.slots import PyEngineMap
from scorer.native import ENV_PURE, NATIVE


def test_native_module_is_built() -> None:
    # `make` builds scorer/native/_speedups.pyx; a silently skipped build (the extension is
    # optional so that an install without a compiler still works) must fail here.
    assert os.environ.get(ENV_PURE, "") in ("", "0")
    assert NATIVE is not None
    assert BlockHasher(16).native
    assert not BlockHasher(16, native=False).native
    assert not BlockHasher(16, "fnv1a").native  # only xxh3 is compiled


def test_env_var_forces_pure_python() -> None:
    code = (
        "from scorer.native import NATIVE; from scorer.blocks import BlockHasher;"
        "from scorer.index import BlockIndex;"
        "print(NATIVE is None, BlockHasher(16).native, BlockIndex().native)"
    )
    env = {**os.environ, ENV_PURE: "1"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.split() == ["True", "False", "False"]


def _outcome(f: Any) -> Any:
    try:
        return f()
    except (TypeError, OverflowError, ValueError) as e:
        return type(e).__name__ if not isinstance(e, OverflowError) else "OverflowError"


_tok = st.integers(0, 2**32 - 1)
_odd_tok = st.one_of(
    st.integers(-(2**64), 2**70), st.booleans(), st.floats(allow_nan=False), st.text(max_size=2)
)


# xxh3's length classes: 4-byte blocks (1-16 B), 64 B (17-128), 132 B (129-240), 2 KiB (>240).
@settings(max_examples=scaled(300))
@given(
    st.lists(_tok, max_size=700) | st.lists(_tok | _odd_tok, max_size=40),
    st.sampled_from([1, 4, 16, 33, 60, 61, 512]),
    st.integers(0, 2**64 - 1),
    st.none() | st.integers(0, 2**64 - 1),
)
@example([], 16, 0, None)
@example(list(range(16)), 16, 0, None)
@example([2**32 - 1] * 16, 16, 5, 7)
@example([2**32] * 16, 16, 0, None)
@example([-1] * 16, 16, 0, None)
@example([1.0] * 16, 16, 0, None)
@example([True] * 16, 16, 0, None)
@example([*range(16), 2**40], 16, 0, None)  # past the last full block: not read
@example(list(range(1024)), 512, 2**64 - 1, 2**64 - 1)
def test_keys_are_the_reference_keys(toks: list[Any], bs: int, ns: int, parent: int | None) -> None:
    pure, nat = BlockHasher(bs, native=False), BlockHasher(bs, native=True)
    want = _outcome(lambda: pure.keys(toks, ns, parent))
    assert _outcome(lambda: nat.keys(toks, ns, parent)) == want
    assert _outcome(lambda: nat.keys(tuple(toks), ns, parent)) == want
    if isinstance(want, list):
        n = len(toks) // bs * bs
        arr = array("I", toks[:n])
        assert nat.keys(arr, ns, parent) == want
        packed = tokens_to_bytes(toks, n) + b"\x01\x02"  # a partial trailing block is ignored
        assert nat.keys_from_bytes(packed, ns, parent) == want
        assert pure.keys_from_bytes(packed, ns, parent) == want


@settings(max_examples=scaled(200))
@given(st.lists(st.integers(-(2**63), 2**64 - 1) | st.none() | st.text(max_size=1), max_size=50))
@example([])
@example([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1])
@example([2**32])
@example([-1])
@example([2**63, 2**64 - 1])
@example(list(range(70_000)))  # array32 header
def test_msgpack_uint32s_takes_exactly_the_uint32_lists(items: list[Any]) -> None:
    assert NATIVE is not None
    raw = msgspec.msgpack.encode(items)
    got = NATIVE.msgpack_uint32s(raw)
    if all(type(x) is int and 0 <= x < 2**32 for x in items):
        assert got is not None and list(got) == items and got.typecode == "I"
    else:
        assert got is None
    for cut in {0, 1, len(raw) // 2, len(raw) - 1}:  # truncated: refused, never read past
        if cut < len(raw):
            assert NATIVE.msgpack_uint32s(raw[:cut]) is None
    assert NATIVE.msgpack_uint32s(raw + b"\x00") is None


def test_msgpack_uint32s_refuses_other_values_and_lying_headers() -> None:
    assert NATIVE is not None
    f = NATIVE.msgpack_uint32s
    assert f(msgspec.msgpack.encode({"a": 1})) is None
    assert f(msgspec.msgpack.encode("xx")) is None
    assert f(b"\xdd\xff\xff\xff\xff\x01") is None  # claims 4G items, has one
    assert f(b"\xdc\x00\x02\xd0\x05\xd1\x00\x07") == array("I", [5, 7])  # signed forms
    assert f(b"\x92\xd0\xff\x01") is None  # a negative int8
    assert f(b"\x91\xcb" + bytes(8)) is None  # a float


def test_engine_keys_mask_like_apply() -> None:
    assert NATIVE is not None
    hs = [5, -1, 2**64 + 3, 2**63, True]
    assert NATIVE.engine_keys(hs) == [h & ((1 << 60) - 1) for h in hs]
    assert NATIVE.engine_keys([True, 1]) is None  # apply's comprehension needs an int first
    assert NATIVE.engine_keys([1, b"x"]) is None
    assert NATIVE.engine_keys([]) is None


# ---- EngineMap: the same dict semantics, insertion order included ---------------------------

_ek = st.integers(0, 300) | st.integers(0, (1 << 60) - 1)
_op = st.one_of(
    st.tuples(st.just("put"), st.lists(_ek, max_size=8), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("range"), st.integers(0, 400), st.integers(1, 700)),
    st.tuples(st.just("del"), _ek),
    st.tuples(st.just("pop"), st.integers(0, 400)),
    st.tuples(st.just("get"), _ek),
    st.just(("clear",)),
)


@settings(max_examples=scaled(200))
@given(st.lists(_op, max_size=25))
@example([("range", 0, 700), ("pop", 400), ("range", 0, 700), ("del", 5), ("get", 5)])
@example([("put", [1, 1, 2], 3), ("del", 1), ("put", [1], 4), ("pop", 1)])
def test_engine_map_is_an_ordered_dict(ops: list[tuple[Any, ...]]) -> None:
    assert NATIVE is not None
    ref, nat = PyEngineMap(), NATIVE.EngineMap()
    for op in ops:
        if op[0] == "put":
            vals = [(op[2] + i) % 2**64 for i in range(len(op[1]))]
            ref.update_pairs(op[1], vals)
            nat.update_pairs(op[1], vals)
        elif op[0] == "range":
            eks = list(range(op[1], op[1] + op[2]))
            ref.update_pairs(eks, eks[::-1])
            nat.update_pairs(eks, eks[::-1])
        elif op[0] == "del":
            assert (op[1] in ref) == (op[1] in nat)
            if op[1] in ref:
                del ref[op[1]]
                del nat[op[1]]
            else:
                with pytest.raises(KeyError):
                    del nat[op[1]]
        elif op[0] == "pop":
            assert nat.pop_oldest(op[1]) == ref.pop_oldest(op[1])
        elif op[0] == "get":
            assert nat.get(op[1]) == ref.get(op[1])
        else:
            ref.clear()
            nat.clear()
        assert len(nat) == len(ref)
    assert nat.items() == list(ref.items())
    assert nat.values() == list(ref.values()) and nat.keys() == list(ref)
    assert dict(nat) == ref  # dict() reads it through keys() + __getitem__


def test_engine_map_refuses_what_it_cannot_hold() -> None:
    assert NATIVE is not None
    m = NATIVE.EngineMap()
    for bad in (-1, 2**64 - 1, 2**64):
        with pytest.raises(OverflowError):
            m[bad] = 1
        assert m.get(bad) is None and bad not in m
    with pytest.raises(TypeError):
        m["x"] = 1  # type: ignore[index]
    assert m.get("x") is None  # type: ignore[arg-type]
    m.update_pairs([1, 2, 3], [10, 20])  # zip: the shorter bounds it
    assert m.items() == [(1, 10), (2, 20)]
    m.clear()
    assert len(m) == 0 and m.nbytes() == 0


def test_block_size_zero_is_refused_not_a_crash() -> None:
    # The C code divides by it: a bad size raises instead of faulting the process.
    assert NATIVE is not None
    with pytest.raises(ValueError):
        NATIVE.chain_keys([1, 2], 0, 0)
    with pytest.raises(ValueError):
        NATIVE.chain_keys_bytes(b"\x00" * 8, 0, 0)
