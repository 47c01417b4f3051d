"""A token-id prompt's check and packing, compiled (scorer/native/_speedups.pyx
ids_u32_bytes) against the Python reference (`Tokenization._ids_bytes(native=False)`): the
same bytes, or the same refusal message, for any JSON list."""

from __future__ import annotations

from typing import Any

from configs import make_config
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.blocks import BlockHasher
from scorer.native import NATIVE
from scorer.tokens.service import Tokenization, TokenizeError

TOKENS = Tokenization(make_config(), BlockHasher(16))


class IntSub(int):
    """An int subclass (not a JSON type, and not a token id to the reference)."""


def _outcome(ids: list[Any], native: bool) -> bytes | str:
    try:
        return TOKENS._ids_bytes(ids, native=native)
    except TokenizeError as e:
        return str(e)


_item = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),  # (mostly valid ids)
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=2),
    st.none(),
)


@settings(max_examples=scaled(300))
@given(ids=st.lists(_item, max_size=40))
@example(ids=[])
@example(ids=[0, 2**32 - 1, 1])
@example(ids=[2**32, 1.5])  # out of range and a float: the type refusal wins
@example(ids=[-1, True])
@example(ids=[2**63, 2**64, -(2**63) - 1])
@example(ids=[IntSub(3)])
def test_native_ids_are_the_reference_bytes_or_refusal(ids: list[Any]) -> None:
    assert NATIVE is not None  # (tests/index/test_native.py says why when not)
    assert _outcome(ids, native=True) == _outcome(ids, native=False)
