"""scorer.extproc.transport.tls_transport.TlsTransport against an `ssl` client in memory:
the plaintext reaches the inner protocol unchanged however records and reads are cut,
every whole record of one read in one `data_received` (so the inner's answers to them
leave in one write), close_notify and bad records after the data of the same read."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import pytest
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.extproc.tls import self_signed, server_context
from scorer.extproc.transport.tls_transport import TlsTransport

_CERT = self_signed()


class Raw(asyncio.Transport):
    """The socket side: what TlsTransport writes, and whether it closed it."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.out.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def take(self) -> bytes:
        data = b"".join(self.out)
        self.out.clear()
        return data


class Inner:
    """The HTTP/2 side: records each data_received; echoes `answer` per call if set."""

    def __init__(self, answer: bytes = b"") -> None:
        self.calls: list[bytes] = []
        self.answer = answer
        self.lost = False
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.calls.append(data)
        if self.answer:
            self.transport.write(self.answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass


class Pair:
    """A TlsTransport with a connected in-memory client (handshake done)."""

    def __init__(self, inner: Inner) -> None:
        self.raw = Raw()
        self.inner = inner
        self.failures: list[str] = []
        self.tls = TlsTransport(
            server_context(*_CERT, None), inner, self.failures.append, handshake_timeout=30.0
        )
        self.tls.connection_made(self.raw)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["h2"])
        self.cin, self.cout = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.client = ctx.wrap_bio(self.cin, self.cout, server_hostname="kv-scorer")
        for _ in range(10):  # bounded: TLS 1.3 is done in two flights
            try:
                self.client.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.tls.data_received(self.cout.read())
                self.cin.write(self.raw.take())
        else:
            raise AssertionError("no handshake")
        self.tls.data_received(self.cout.read())  # the client's Finished
        assert inner.transport is self.tls
        self.cin.write(self.raw.take())  # session tickets

    def records(self, *pieces: bytes) -> bytes:
        """One TLS record (at least) per piece, as the client sends them."""
        out = []
        for p in pieces:
            self.client.write(p)
            out.append(self.cout.read())
        return b"".join(out)

    def answers(self) -> bytes:
        """What the server sent, decrypted by the client."""
        self.cin.write(self.raw.take())
        got = []
        while True:
            try:
                got.append(self.client.read(1 << 20))
            except ssl.SSLWantReadError:
                return b"".join(got)


async def test_records_of_one_read_reach_the_inner_protocol_in_one_call() -> None:
    inner = Inner(answer=b"ok")
    p = Pair(inner)
    p.tls.data_received(p.records(b"headers", b"body", b"end"))
    assert inner.calls == [b"headersbodyend"]
    # One answer for the one call: one write, one record back.
    assert len(p.raw.out) == 1
    assert p.answers() == b"ok"


async def test_a_partial_record_waits_for_its_rest() -> None:
    inner = Inner()
    p = Pair(inner)
    data = p.records(b"first", b"second")
    cut = len(data) - 3
    p.tls.data_received(data[:cut])
    assert inner.calls == [b"first"]
    p.tls.data_received(data[cut:])
    assert inner.calls == [b"first", b"second"]


async def test_close_notify_after_data_in_the_same_read() -> None:
    inner = Inner(answer=b"bye")
    p = Pair(inner)
    data = p.records(b"last words")
    with pytest.raises(ssl.SSLWantReadError):
        p.client.unwrap()  # sends close_notify, waits for ours
    p.tls.data_received(data + p.cout.read())
    assert inner.calls == [b"last words"]
    assert p.answers() == b"bye"
    # SSLObject.read returns 0 at close_notify (no SSLZeroReturnError): the socket's EOF,
    # which follows, ends the connection (unchanged by the batching).
    assert not p.raw.closed


async def test_a_bad_record_after_data_delivers_the_data_then_aborts() -> None:
    inner = Inner()
    p = Pair(inner)
    data = p.records(b"good", b"tampered")
    bad = bytearray(data)
    bad[-1] ^= 0xFF  # the second record's tag no longer verifies
    p.tls.data_received(bytes(bad))
    assert inner.calls == [b"good"]
    assert p.raw.closed


async def test_a_full_buffer_is_handed_over_and_reading_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inner = Inner()
    p = Pair(inner)
    small = memoryview(bytearray(10))
    monkeypatch.setattr(p.tls, "_pview", small)
    p.tls.data_received(p.records(b"0123456", b"789abcdefghij"))
    assert b"".join(inner.calls) == b"0123456789abcdefghij"
    assert inner.calls[0] == b"0123456789"


@settings(max_examples=scaled(100))
@given(
    pieces=st.lists(st.binary(min_size=1, max_size=40_000), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 100_000), max_size=5),
)
@example(pieces=[b"a", b"b"], cuts=[])
@example(pieces=[b"x" * 16_385, b"y"], cuts=[5, 16_400])  # over one record's 16 KiB
def test_plaintext_arrives_unchanged_however_cut(pieces: list[bytes], cuts: list[int]) -> None:
    async def go() -> None:
        inner = Inner()
        p = Pair(inner)
        data = p.records(*pieces)
        at = sorted({c % (len(data) + 1) for c in cuts})
        for a, b in zip([0, *at], [*at, len(data)], strict=True):
            p.tls.data_received(data[a:b])
        assert b"".join(inner.calls) == b"".join(pieces)
        # No call without data, and no more calls than reads.
        assert all(inner.calls) and len(inner.calls) <= len(at) + 1

    asyncio.run(go())
