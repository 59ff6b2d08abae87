"""Out-of-band handshake codec (aiordma.protocol.handshake)."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.errors import HandshakeError
from aiordma.protocol import (
    Accept,
    HandshakeDecoder,
    Hello,
    Kind,
    Message,
    Ready,
    Reject,
    encode,
    encode_accept,
    encode_hello,
    encode_ready,
    encode_reject,
)
from aiordma.protocol.handshake import (
    MAX_BODY,
    PREAMBLE,
    VERSION,
    Greeting,
    RejectCode,
    encode_greeting,
)

HELLO = Hello(
    qp_num=0x11,
    psn=0x123456,
    gid=bytes(range(16)),
    lid=7,
    mtu=3,
    recv_credits=64,
    eager_size=8192,
    max_message_size=1 << 30,
    provider="soft",
)


@st.composite
def hellos(draw: st.DrawFn) -> Hello:
    eager = draw(st.integers(64, 16 << 20))
    return Hello(
        qp_num=draw(st.integers(0, (1 << 24) - 1)),
        psn=draw(st.integers(0, (1 << 24) - 1)),
        gid=draw(st.binary(min_size=16, max_size=16)),
        lid=draw(st.integers(0, 0xFFFF)),
        mtu=draw(st.integers(1, 5)),
        recv_credits=draw(st.integers(4, 0xFFFF)),
        eager_size=eager,
        max_message_size=draw(st.integers(eager, 1 << 40)),
        provider=draw(st.sampled_from(["soft", "verbs"])),
        flags=draw(st.integers(0, 0xFFFFFFFF)),
        nonce=draw(st.binary(min_size=16, max_size=16)),
        mac=draw(st.binary(min_size=32, max_size=32)),
    )


messages = st.one_of(
    hellos(),
    hellos().map(Accept),
    st.builds(Reject, st.text(max_size=80), st.sampled_from(list(RejectCode)),
              st.integers(0, 0xFFFF)),
    st.just(Ready()),
    st.builds(Greeting, st.binary(min_size=16, max_size=16), st.integers(0, 0xFFFFFFFF)),
)


def header(
    kind: int, length: int, *, magic: bytes = b"AIOR", version: int = VERSION, res: int = 0
) -> bytes:
    return struct.pack("!4sHBBI", magic, version, kind, res, length)


def decode_all(data: bytes) -> list[Message]:
    dec = HandshakeDecoder()
    out = dec.feed(data)
    dec.eof()
    return out


def outcome(chunks: list[bytes]) -> tuple[list[Message], str | None]:
    """Messages obtained and the error raised (by feed or the final eof), if any."""
    dec = HandshakeDecoder()
    got: list[Message] = []
    try:
        for c in chunks:
            got += dec.feed(c)
        dec.eof()
    except HandshakeError as exc:
        return got, exc.strerror
    return got, None


# -- round trips ---------------------------------------------------------------------------


@given(hellos())
def test_hello_and_accept_round_trip(h: Hello) -> None:
    assert decode_all(encode_hello(h)) == [h]
    assert decode_all(encode_hello(h, Kind.ACCEPT)) == [Accept(h)]
    assert decode_all(encode_accept(h)) == [Accept(h)]


def test_accept_is_not_a_hello() -> None:
    (msg,) = decode_all(encode_accept(HELLO))
    assert isinstance(msg, Accept) and not isinstance(msg, Hello)
    assert msg.params == HELLO


@given(st.lists(messages, max_size=6))
def test_message_sequences_round_trip(msgs: list[Message]) -> None:
    assert decode_all(b"".join(encode(m) for m in msgs)) == msgs


def test_reject_and_ready() -> None:
    assert decode_all(encode_reject("go away ✋")) == [Reject("go away ✋")]
    assert decode_all(encode_reject("full", RejectCode.LIMIT, 24)) == [
        Reject("full", RejectCode.LIMIT, 24)]
    assert decode_all(encode_ready()) == [Ready()]
    assert encode_ready() == b"AIOR\x00\x02\x04\x00\x00\x00\x00\x00"
    g = Greeting(bytes(range(16)), 1)
    assert decode_all(encode_greeting(g)) == [g]
    with pytest.raises(ValueError, match="nonce"):
        Greeting(b"short")


def test_reject_reason_is_cut_at_a_character_boundary() -> None:
    (msg,) = decode_all(encode_reject("é" * 200))  # 400 bytes of utf-8
    assert isinstance(msg, Reject) and msg.reason == "é" * 128
    (msg,) = decode_all(encode_reject("x" + "é" * 200))
    assert isinstance(msg, Reject) and msg.reason == "x" + "é" * 127


def test_encode_hello_rejects_other_kinds() -> None:
    with pytest.raises(ValueError, match="HELLO or ACCEPT"):
        encode_hello(HELLO, Kind.READY)
    with pytest.raises(TypeError):
        encode("nope")  # type: ignore[arg-type]


def test_wire_layout() -> None:
    data = encode_hello(HELLO)
    assert data[:12] == header(1, 98)
    assert data[12:16] == b"\x00\x00\x00\x11"  # qp_num, network order
    assert data[-53:-5] == bytes(48)  # nonce and mac (zeros by default)
    assert data[-5:] == b"\x04soft"


# -- robustness ----------------------------------------------------------------------------


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_handshake_error(data: bytes) -> None:
    outcome([data])  # any other exception fails the test


@settings(max_examples=300)
@given(st.lists(messages, min_size=1, max_size=3), st.binary(max_size=20), st.data())
def test_mutated_streams_decode_or_raise_handshake_error(
    msgs: list[Message], junk: bytes, data: st.DataObject
) -> None:
    raw = bytearray(b"".join(encode(m) for m in msgs))
    pos = data.draw(st.integers(0, len(raw)))
    raw[pos : pos + len(junk)] = junk
    outcome([bytes(raw)])


@settings(max_examples=100)
@given(st.lists(messages, min_size=1, max_size=3), st.binary(max_size=16))
def test_split_feeding_at_every_boundary(msgs: list[Message], tail: bytes) -> None:
    data = b"".join(encode(m) for m in msgs) + tail
    whole = outcome([data])
    for i in range(len(data) + 1):
        assert outcome([data[:i], data[i:]]) == whole
    assert outcome([data[i : i + 1] for i in range(len(data))]) == whole


def test_message_then_garbage_in_one_feed() -> None:
    dec = HandshakeDecoder()
    assert dec.feed(encode_ready() + b"GET /") == [Ready()]
    assert dec.error is not None and "not an aiordma peer" in str(dec.error)
    with pytest.raises(HandshakeError, match="not an aiordma peer"):
        dec.eof()


# -- validation rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GET / HTTP/1.1\r\n", r"not an aiordma peer: magic byte 0 is 0x47, expected b'AIOR'"),
        (b"AIOX", "not an aiordma peer: magic byte 3"),
        (b"A", None),  # a prefix of the magic is fine ... until eof
        (header(4, 0, version=3), "version mismatch: peer speaks 3, we speak 2"),
        (header(4, 0, version=0), "version mismatch: peer speaks 0, we speak 2"),
        (header(0, 0), "unknown handshake message kind 0"),
        (header(6, 0), "unknown handshake message kind 6"),
        (header(4, 0, res=1), "reserved byte must be 0, got 1"),
        (header(3, MAX_BODY + 1), "REJECT body of 1025 bytes exceeds 1024"),
        (header(3, 0xFFFFFFFF), "exceeds 1024"),
        (header(4, 1), r"READY body must be 0..0 bytes, got 1"),
        (header(3, 260), r"REJECT body must be 3..259 bytes, got 260"),
        (header(3, 2), r"REJECT body must be 3..259 bytes, got 2"),
        (header(5, 19), r"GREETING body must be 20..20 bytes, got 19"),
        (header(1, 93), r"HELLO body must be 94..110 bytes, got 93"),
        (header(2, 111), r"ACCEPT body must be 94..110 bytes, got 111"),
        (header(3, 5) + b"\x00\x00\x00\xff\xfe", "REJECT reason is not valid utf-8"),
    ],
)
def test_header_rules(data: bytes, match: str | None) -> None:
    dec = HandshakeDecoder()
    if match is None:
        assert dec.feed(data) == []
        with pytest.raises(HandshakeError, match="truncated handshake header"):
            dec.eof()
        return
    with pytest.raises(HandshakeError, match=match):
        dec.feed(data)


def test_oversize_body_is_refused_before_buffering() -> None:
    dec = HandshakeDecoder()
    with pytest.raises(HandshakeError, match="exceeds"):
        dec.feed(header(1, 1 << 20))  # no body sent at all
    assert dec.buffered == 0


def hello_body(provider: bytes = b"soft", plen: int | None = None, **over: int) -> bytes:
    f = dict(qp_num=1, psn=2, lid=3, mtu=3, recv_credits=16, eager=4096, max_msg=1 << 20, flags=0)
    f.update(over)
    return struct.pack(
        "!II16sHBHIQI16s32sB", f["qp_num"], f["psn"], bytes(16), f["lid"], f["mtu"],
        f["recv_credits"], f["eager"], f["max_msg"], f["flags"], bytes(16), bytes(32),
        len(provider) if plen is None else plen,
    ) + provider  # fmt: skip


def hello_frame(body: bytes, kind: int = 1) -> bytes:
    return header(kind, len(body)) + body


def test_hello_body_helper_is_valid() -> None:
    (msg,) = decode_all(hello_frame(hello_body()))
    assert isinstance(msg, Hello) and msg.provider == "soft" and msg.recv_credits == 16


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (hello_body(qp_num=1 << 24), r"bad HELLO: qp_num 16777216 out of range \(0..16777215\)"),
        (hello_body(psn=1 << 24), "psn 16777216 out of range"),
        (hello_body(mtu=0), r"mtu 0 out of range \(1..5\)"),
        (hello_body(mtu=6), "mtu 6 out of range"),
        (hello_body(recv_credits=3), r"recv_credits 3 out of range \(4..65535\)"),
        (hello_body(eager=63), "eager_size 63 out of range"),
        (hello_body(eager=(16 << 20) + 1), "eager_size 16777217 out of range"),
        (hello_body(eager=4096, max_msg=4095), r"max_message_size 4095 out of range \(4096.."),
        (hello_body(max_msg=(1 << 40) + 1), "max_message_size 1099511627777 out of range"),
        (hello_body(b"rxe"), "unknown provider 'rxe'"),
        (hello_body(b"Soft"), "unknown provider 'Soft'"),
        (hello_body(b"s\xffft"), "bad HELLO: 'ascii' codec"),
        (hello_body(b"soft", plen=5), "provider name of 5 bytes overruns the body .4 left."),
        (hello_body(b"soft", plen=3), "HELLO has 1 bytes of trailing garbage"),
        (hello_body(b"soft") + b"\x00", "HELLO has 1 bytes of trailing garbage"),
    ],
)
def test_hello_field_rules(body: bytes, match: str) -> None:
    with pytest.raises(HandshakeError, match=match):
        decode_all(hello_frame(body))
    with pytest.raises(HandshakeError, match=match.replace("HELLO", "ACCEPT")):
        decode_all(hello_frame(body, kind=2))


def test_hello_constructor_validates() -> None:
    bad: list[tuple[str, Any]] = [
        ("qp_num", -1),
        ("gid", b"short"),
        ("lid", 1 << 16),
        ("flags", 1 << 32),
        ("provider", "x" * 17),
        ("recv_credits", True),
        ("nonce", b"short"),
        ("mac", bytes(31)),
    ]
    for field, value in bad:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(HELLO, **{field: value})


def test_truncated_at_eof() -> None:
    data = encode_hello(HELLO)
    dec = HandshakeDecoder()
    assert dec.feed(data[:-1]) == []
    assert dec.buffered == len(data) - 1
    with pytest.raises(
        HandshakeError,
        match=f"truncated handshake message: .* after {len(data) - 1} of {len(data)} bytes",
    ):
        dec.eof()
    dec = HandshakeDecoder()
    dec.feed(data[:5])
    with pytest.raises(HandshakeError, match="truncated handshake header: .* 5 of 12 bytes"):
        dec.eof()
    HandshakeDecoder().eof()  # nothing buffered: a clean end


def test_error_poisons_the_decoder() -> None:
    dec = HandshakeDecoder()
    with pytest.raises(HandshakeError) as first:
        dec.feed(header(4, 0, version=VERSION + 1))
    for _ in range(2):
        with pytest.raises(HandshakeError) as again:
            dec.feed(encode_ready())
        assert again.value.strerror == first.value.strerror
    with pytest.raises(HandshakeError) as again:
        dec.eof()
    assert again.value.strerror == first.value.strerror
    assert dec.error is not None and dec.error.strerror == first.value.strerror


def test_truncation_poisons_too() -> None:
    dec = HandshakeDecoder()
    dec.feed(b"AIOR")
    with pytest.raises(HandshakeError, match="truncated"):
        dec.eof()
    with pytest.raises(HandshakeError, match="truncated"):
        dec.feed(encode_ready())


# -- the client's preamble (the listener's decoder) ------------------------------------------


def test_preamble_then_messages_split_anywhere() -> None:
    data = PREAMBLE + encode_hello(HELLO) + encode_ready()
    for i in range(len(data) + 1):
        dec = HandshakeDecoder(preamble=True)
        assert dec.feed(data[:i]) + dec.feed(data[i:]) == [HELLO, Ready()]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GET / HTTP/1.1\r\n", r"not an aiordma client: it sent b'GET / HTTP/1.1"),
        (b"AIORDMA/3\r\n\r\n", "not an aiordma client"),
        (header(1, 98, version=1), "version mismatch: peer speaks 1, we speak 2"),
        (b"AIORD", None),
    ],
)
def test_preamble_rules(data: bytes, match: str | None) -> None:
    dec = HandshakeDecoder(preamble=True)
    if match is None:
        assert dec.feed(data) == []
        with pytest.raises(HandshakeError, match="truncated preamble: .* 5 of 13 bytes"):
            dec.eof()
        return
    with pytest.raises(HandshakeError, match=match):
        dec.feed(data)
    assert dec.first_bytes == data[:64]


def test_a_line_based_server_answers_the_preamble() -> None:
    """The preamble is a complete (bad) HTTP request: an HTTP server answers it."""
    request_line, _, rest = PREAMBLE.partition(b"\r\n")
    assert rest == b"\r\n" and b" " not in request_line  # one word: "Bad request syntax"
