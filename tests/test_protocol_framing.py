"""Frame header writers and parser (aiordma.protocol.engine)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocol import (
    HEADER,
    HEADER_SIZE,
    RNDV_SIZE,
    Frame,
    FrameType,
    LocalProtocolError,
    RemoteProtocolError,
    parse_frame,
    write_close,
    write_credit,
    write_data_header,
    write_rndv,
    write_rndv_done,
)
from aiordma.protocol.engine import (
    BATCH_RECORD,
    batch_records,
    write_batch,
    write_batch_header,
    write_batch_record,
)

MAX = 1 << 30
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)


def raw(t: int, flags: int = 0, credits: int = 0, aux: int = 0, tail: bytes = b"") -> bytearray:
    return bytearray(HEADER.pack(t, flags, credits, aux) + tail)


def parse(buf: bytes | bytearray, max_message_size: int = MAX) -> Frame:
    return parse_frame(buf, len(buf), max_message_size)


# -- round trips ---------------------------------------------------------------------------


@given(credits=u16, payload=st.binary(max_size=64))
def test_data_round_trip(credits: int, payload: bytes) -> None:
    buf = bytearray(HEADER_SIZE + len(payload))
    assert write_data_header(buf, credits, len(payload)) == HEADER_SIZE
    buf[HEADER_SIZE:] = payload
    f = parse(buf)
    assert (f.type, f.credits, f.aux, f.flags) == (FrameType.DATA, credits, len(payload), 0)
    assert bytes(buf[f.payload_offset : f.payload_offset + f.payload_len]) == payload


@given(credits=u16, msg_id=u32, length=st.integers(1, MAX), addr=u64, rkey=u32)
def test_rndv_round_trip(credits: int, msg_id: int, length: int, addr: int, rkey: int) -> None:
    buf = memoryview(bytearray(64))
    assert write_rndv(buf, credits, msg_id, length, addr, rkey) == RNDV_SIZE
    f = parse_frame(buf, RNDV_SIZE, MAX)
    assert f == Frame(FrameType.RNDV, credits, msg_id, 0, HEADER_SIZE, 0, length, addr, rkey)
    assert f.msg_id == msg_id


@given(credits=u16, msg_id=u32, ok=st.booleans())
def test_rndv_done_round_trip(credits: int, msg_id: int, ok: bool) -> None:
    buf = bytearray(8)
    assert write_rndv_done(buf, credits, msg_id, ok) == HEADER_SIZE
    f = parse(buf)
    assert (f.type, f.credits, f.msg_id, f.ok, f.payload_len) == (
        FrameType.RNDV_DONE,
        credits,
        msg_id,
        ok,
        0,
    )


@given(credits=st.integers(1, 0xFFFF))
def test_credit_and_close_round_trip(credits: int) -> None:
    buf = bytearray(8)
    assert write_credit(buf, credits) == 8
    assert parse(buf) == Frame(FrameType.CREDIT, credits, 0, 0, 8, 0)
    assert write_close(buf, credits - 1) == 8
    assert parse(buf) == Frame(FrameType.CLOSE, credits - 1, 0, 0, 8, 0)


def test_parse_reads_only_byte_len_of_a_larger_buffer() -> None:
    buf = bytearray(4096)
    write_data_header(buf, 3, 5)
    buf[8:13] = b"hello"
    f = parse_frame(memoryview(buf), 13, MAX)
    assert (f.payload_offset, f.payload_len, f.credits) == (8, 5, 3)


def test_empty_data_message_is_valid() -> None:
    f = parse(raw(1))
    assert (f.type, f.payload_len) == (FrameType.DATA, 0)


def test_frames_compare_by_value_and_have_no_other_attributes() -> None:
    f = parse(raw(5))
    assert f == Frame(FrameType.CLOSE, 0, 0, 0, HEADER_SIZE, 0)
    assert f != Frame(FrameType.CLOSE, 1, 0, 0, HEADER_SIZE, 0)
    assert f != (FrameType.CLOSE, 0, 0, 0, HEADER_SIZE, 0)
    assert repr(f).startswith("Frame(type=<FrameType.CLOSE: 5>, credits=0, aux=0")
    with pytest.raises(AttributeError):
        f.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        hash(f)


# -- parser rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("buf", "byte_len", "match"),
    [
        (bytearray(7), 7, "frame too short: 7 bytes, the header is 8"),
        (bytearray(0), 0, "frame too short: 0 bytes"),
        (raw(1, aux=8, tail=b"x" * 8), 20, "frame length 20 exceeds the receive buffer"),
        (raw(0), 8, "unknown frame type 0"),
        (raw(7), 8, "unknown frame type 7"),
        (raw(6), 8, "BATCH of 0 messages cannot fit 0 bytes"),
        (raw(6, aux=2, tail=b"\0" * 4), 12, "BATCH of 2 messages cannot fit 4 bytes"),
        (raw(6, flags=1, aux=1, tail=b"\0" * 4), 12, "BATCH frame must have flags 0"),
        (raw(255), 8, "unknown frame type 255"),
        (raw(1, aux=3, tail=b"ab"), 10, "DATA length mismatch: header says 3 payload bytes"),
        (raw(1, aux=0, tail=b"ab"), 10, "DATA length mismatch"),
        (raw(1, flags=1), 8, "DATA frame must have flags 0"),
        (raw(2, aux=1, tail=bytes(19)), 27, "RNDV frame must be 28 bytes, got 27"),
        (raw(2, aux=1, tail=bytes(21)), 29, "RNDV frame must be 28 bytes, got 29"),
        (raw(2, aux=1), 8, "RNDV frame must be 28 bytes, got 8"),
        (raw(2, tail=bytes(20)), 28, r"RNDV length 0 out of range"),
        (raw(2, flags=2, tail=bytes(20)), 28, "RNDV frame must have flags 0"),
        (raw(3, tail=b"x"), 9, "RNDV_DONE frame has 1 trailing bytes"),
        (raw(3, flags=2), 8, "RNDV_DONE flags must be 0 .ok. or 1 .failed., got 2"),
        (raw(4, credits=1, tail=b"xy"), 10, "CREDIT frame has 2 trailing bytes"),
        (raw(4, credits=0), 8, "CREDIT frame returns no credits"),
        (raw(4, credits=1, aux=7), 8, "CREDIT frame must have aux 0, got 7"),
        (raw(4, credits=1, flags=1), 8, "CREDIT frame must have flags 0"),
        (raw(5, tail=b"x"), 9, "CLOSE frame has 1 trailing bytes"),
        (raw(5, aux=1), 8, "CLOSE frame must have aux 0"),
        (raw(5, flags=0x80), 8, "CLOSE frame must have flags 0, got 0x80"),
    ],
)
def test_parse_rejects(buf: bytearray, byte_len: int, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        parse_frame(buf, byte_len, MAX)


def test_rndv_longer_than_max_message_size() -> None:
    buf = bytearray(28)
    write_rndv(buf, 0, 1, 1001, 0, 0)
    assert parse_frame(buf, 28, 1001).rndv_length == 1001
    with pytest.raises(RemoteProtocolError, match=r"RNDV length 1001 out of range .*1000"):
        parse_frame(buf, 28, 1000)


def test_data_longer_than_max_message_size() -> None:
    buf = raw(1, aux=4, tail=b"abcd")
    with pytest.raises(RemoteProtocolError, match="exceeds max_message_size 3"):
        parse_frame(buf, 12, 3)


@given(data=st.binary(max_size=40), extra=st.integers(0, 8))
def test_parse_random_bytes_never_crashes(data: bytes, extra: int) -> None:
    buf = data + bytes(extra)
    try:
        f = parse_frame(buf, len(data), 1 << 20)
    except RemoteProtocolError:
        return
    assert isinstance(f.type, FrameType)
    assert f.payload_offset + f.payload_len == len(data) or f.type is FrameType.RNDV


# -- writer rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda b: write_data_header(b, 0x10000, 0), r"credits 65536 out of range \(0..65535\)"),
        (lambda b: write_data_header(b, -1, 0), "credits -1 out of range"),
        (lambda b: write_data_header(b, 0, 1 << 32), "payload_len 4294967296 out of range"),
        (lambda b: write_data_header(b, 0, -5), "payload_len -5 out of range"),
        (lambda b: write_rndv(b, 0, 1 << 32, 1, 0, 0), "msg_id 4294967296 out of range"),
        (lambda b: write_rndv(b, 0, 1, 0, 0, 0), "RNDV length must be positive, got 0"),
        (lambda b: write_rndv(b, 0, 1, 1 << 64, 0, 0), "length 18446744073709551616 out of"),
        (lambda b: write_rndv(b, 0, 1, 1, -1, 0), "addr -1 out of range"),
        (lambda b: write_rndv(b, 0, 1, 1, 0, 1 << 32), "rkey 4294967296 out of range"),
        (lambda b: write_rndv_done(b, 0, -1, True), "msg_id -1 out of range"),
        (lambda b: write_credit(b, 0), "a CREDIT frame must return at least one credit"),
        (lambda b: write_credit(b, 1 << 16), "credits 65536 out of range"),
        (lambda b: write_close(b, 1 << 16), "credits 65536 out of range"),
    ],
)
def test_writers_reject_out_of_range(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LocalProtocolError, match=match):
        call(bytearray(64))


def test_writers_reject_short_or_readonly_buffers() -> None:
    with pytest.raises(LocalProtocolError, match="buffer of 7 bytes too small for a 8-byte"):
        write_close(bytearray(7), 0)
    with pytest.raises(LocalProtocolError, match="buffer of 20 bytes too small for a 28-byte"):
        write_rndv(bytearray(20), 0, 1, 1, 0, 0)
    with pytest.raises(TypeError):
        write_close(bytes(8), 0)  # type: ignore[arg-type]


def test_writers_reject_arguments_of_the_wrong_type() -> None:
    """TypeError, compiled (on entry) or not (the pack fails, then names the field)."""
    with pytest.raises(TypeError):
        write_data_header(bytearray(64), 1.5, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        write_rndv(bytearray(64), 0, 1, "1", 0, 0)  # type: ignore[arg-type]


def test_errors_carry_eproto_and_pickle() -> None:
    import errno
    import pickle

    with pytest.raises(RemoteProtocolError) as info:
        parse(raw(9))
    assert info.value.errno == errno.EPROTO
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is RemoteProtocolError and again.strerror == info.value.strerror


@given(st.lists(st.binary(max_size=40), min_size=1, max_size=20), u16)
def test_batch_roundtrip(msgs: list[bytes], credits: int) -> None:
    buf = bytearray(HEADER_SIZE + sum(BATCH_RECORD + len(m) for m in msgs))
    off = write_batch_header(buf, credits, len(msgs))
    for m in msgs:
        off = write_batch_record(buf, off, m)
    assert off == len(buf)
    f = parse_frame(buf, off, MAX)
    assert (f.type, f.credits, f.aux) == (FrameType.BATCH, credits, len(msgs))
    recs = batch_records(buf, off, f.aux, MAX)
    assert [bytes(buf[o:o + n]) for o, n in recs] == msgs
    again = bytearray(len(buf))
    assert write_batch(again, credits, msgs) == len(buf) and again == buf


def test_batch_records_reject_malformed() -> None:
    buf = bytearray(64)
    off = write_batch_header(buf, 0, 2)
    off = write_batch_record(buf, off, b"abc")
    off = write_batch_record(buf, off, b"de")
    with pytest.raises(RemoteProtocolError, match="records span 21 bytes, the frame carries 22"):
        batch_records(buf, off + 1, 2, MAX)
    with pytest.raises(RemoteProtocolError, match="beyond the frame"):
        batch_records(buf, off, 3, MAX)
    with pytest.raises(RemoteProtocolError, match="exceeds max_message_size 2"):
        batch_records(buf, off, 2, 2)
    with pytest.raises(LocalProtocolError, match="at least one message"):
        write_batch_header(buf, 0, 0)
    with pytest.raises(LocalProtocolError, match="does not fit"):
        write_batch_record(bytearray(16), 8, b"12345")
    with pytest.raises(LocalProtocolError, match="does not fit"):
        write_batch(bytearray(20), 0, [b"1234", b"5"])
    with pytest.raises(LocalProtocolError, match="at least one message"):
        write_batch(bytearray(20), 0, [])
