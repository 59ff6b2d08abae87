"""aiordma.dask.frames: the layout of one Dask message on aiordma messages (sans-IO)."""

from __future__ import annotations

import array
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.dask import frames as fr


def _roundtrip(frames: list[bytes], budget: int) -> list[bytes]:
    head, separate = fr.plan(frames, budget)
    rest = iter(bytes(mv) for mv in separate)
    out = []
    for item in fr.parse(memoryview(head)):
        if isinstance(item, int):
            data = next(rest)
            assert len(data) == item
            out.append(data)
        else:
            out.append(bytes(item))
    assert next(rest, None) is None
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=6000), max_size=12), st.integers(16, 20000))
def test_plan_then_parse_gives_the_frames_back(frames: list[bytes], budget: int) -> None:
    assert _roundtrip(frames, budget) == frames


def test_small_frames_inline_large_ones_separate() -> None:
    small, big = b"s" * 100, bytes(fr.INLINE_MAX + 1)
    head, separate = fr.plan([small, big, b""], budget=16 * 1024)
    assert [mv.nbytes for mv in separate] == [len(big)]
    assert len(head) == 8 * 4 + len(small)
    items = fr.parse(memoryview(head))
    assert bytes(items[0]) == small and items[1] == len(big) and bytes(items[2]) == b""  # type: ignore[arg-type]


def test_inline_frames_stop_at_the_budget() -> None:
    frames = [bytes([i]) * 1000 for i in range(10)]
    head, separate = fr.plan(frames, budget=8 * 11 + 3500)
    assert len(head) <= 8 * 11 + 3500
    assert len(separate) == 7  # three fit, the rest travel separately
    assert _roundtrip(frames, 8 * 11 + 3500) == frames


def test_separate_frames_are_views_not_copies() -> None:
    buf = bytearray(1 << 20)
    _head, separate = fr.plan([buf], budget=1024)
    separate[0][0] = 7  # a view of the caller's buffer
    assert buf[0] == 7


def test_inline_frames_are_writable_views_of_the_head() -> None:
    head, _ = fr.plan([b"abc"], budget=1024)
    (item,) = fr.parse(memoryview(head))
    assert isinstance(item, memoryview) and not item.readonly


def test_as_bytes_view_casts_and_copies_only_non_contiguous() -> None:
    a = array.array("d", [1.0, 2.0, 3.0])
    mv = fr.as_bytes_view(a)
    assert mv.format == "B" and mv.nbytes == 24 and mv.obj is a
    strided = memoryview(bytes(range(10)))[::2]
    assert bytes(fr.as_bytes_view(strided)) == bytes(range(0, 10, 2))
    with pytest.raises(TypeError, match="bytes-like"):
        fr.as_bytes_view(42)


def test_pieces() -> None:
    assert list(fr.pieces(0)) == [(0, 0)]
    assert list(fr.pieces(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(fr.pieces(8, 4)) == [(0, 4), (4, 4)]
    assert list(fr.pieces(3 * fr.PIECE + 1)) == [
        (0, fr.PIECE), (fr.PIECE, fr.PIECE), (2 * fr.PIECE, fr.PIECE), (3 * fr.PIECE, 1)]


@pytest.mark.parametrize("head, message", [
    (b"", "shorter than its frame count"),
    (b"\x01\x00\x00", "shorter than its frame count"),
    (struct.pack("<Q", 2) + struct.pack("<Q", 0), "cannot describe 2 frames"),
    (struct.pack("<Q", fr.MAX_FRAMES + 1) + bytes(64), "cannot describe"),
    (struct.pack("<QQ", 1, 5) + b"abc", "shorter than its inline frames"),
    (struct.pack("<QQ", 1, 2) + b"abc", "1 bytes after its inline frames"),
    (struct.pack("<QQ", 1, fr.SEPARATE | (fr.MAX_FRAME + 1)), "announces a frame"),
])
def test_malformed_heads_are_refused(head: bytes, message: str) -> None:
    with pytest.raises(fr.FramingError, match=message):
        fr.parse(memoryview(bytearray(head)))


def test_too_many_frames_are_refused() -> None:
    with pytest.raises(ValueError, match="frames exceeds"):
        fr.plan([b""] * (fr.MAX_FRAMES + 1), budget=1024)
