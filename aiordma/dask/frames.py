"""How one Dask message travels as aiordma messages (sans-IO: no event loop, no device).

``distributed`` serializes a message into a list of *frames* (``to_frames``). One
``Comm.write`` sends:

1. the **head**, one aiordma message: ``count`` (u64), ``count`` descriptors (u64
   each), then the bytes of the *inline* frames, in order. A descriptor is the frame's
   length, with bit 63 set when the frame travels *separately*. Small frames are
   inline, so a small Dask message is one SEND.
2. each separate frame, in frame order, as aiordma messages of at most ``PIECE`` bytes
   (a longer frame is cut into pieces; the receiver knows the cuts from the length).
   Large ones go by rendezvous: the receiver READs them straight into a buffer
   allocated for the frame.

``plan`` builds the head and lists the separate frames; ``parse`` checks a received
head and returns the inline frames (writable views of it) and the separate lengths.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any, Final

KiB: Final = 1024
MiB: Final = 1024 * KiB

#: a frame this size or smaller goes inline while the head stays within its budget
INLINE_MAX: Final = 4 * KiB
#: the largest aiordma message a separate frame is cut into
PIECE: Final = 64 * MiB
#: the most frames one head may describe
MAX_FRAMES: Final = 1 << 20
#: the largest frame a head may announce
MAX_FRAME: Final = 1 << 48

SEPARATE: Final = 1 << 63
_U64: Final = struct.Struct("<Q")


class FramingError(ValueError):
    """A received head is malformed (truncated, inconsistent lengths, too many frames)."""


def as_bytes_view(frame: Any) -> memoryview:
    """``frame`` (any buffer-protocol object) as a 1-D unsigned-byte memoryview, without
    a copy when it is C-contiguous (a copy otherwise). Raises TypeError for an object
    that is no buffer."""
    try:
        mv = memoryview(frame)
    except TypeError:
        raise TypeError(f"a Dask frame must be a bytes-like object, not "
                        f"{type(frame).__name__!r}") from None
    if mv.ndim == 1 and mv.format == "B":
        return mv
    if not mv.c_contiguous:
        return memoryview(bytes(mv))  # (tobytes copies in C order)
    return mv.cast("B")


def plan(frames: Sequence[Any], budget: int,
         inline_max: int = INLINE_MAX) -> tuple[bytearray, list[memoryview]]:
    """The head of a message of ``frames`` and, in order, the frames that travel
    separately (views of the caller's buffers, not copies).

    A frame of at most ``inline_max`` bytes is copied into the head as long as the head
    stays within ``budget`` bytes (the endpoint's eager payload: one SEND). Raises
    ValueError for more than ``MAX_FRAMES`` frames or a frame over ``MAX_FRAME`` bytes,
    TypeError for a frame that is no buffer.
    """
    count = len(frames)
    if count > MAX_FRAMES:
        raise ValueError(f"a Dask message of {count} frames exceeds {MAX_FRAMES}")
    views = [as_bytes_view(f) for f in frames]
    size = 8 * (count + 1)
    descs: list[int] = []
    inline: list[memoryview] = []
    separate: list[memoryview] = []
    for mv in views:
        n = mv.nbytes
        if n > MAX_FRAME:
            raise ValueError(f"a frame of {n} bytes exceeds {MAX_FRAME}")
        if n <= inline_max and size + n <= budget:
            inline.append(mv)
            descs.append(n)
            size += n
        else:
            separate.append(mv)
            descs.append(n | SEPARATE)
    head = bytearray(size)
    struct.pack_into(f"<{count + 1}Q", head, 0, count, *descs)
    pos = 8 * (count + 1)
    for mv in inline:
        head[pos: pos + mv.nbytes] = mv
        pos += mv.nbytes
    return head, separate


def parse(head: memoryview) -> list[memoryview | int]:
    """The frames a head describes, in order: an inline frame as a view of ``head``, a
    separate one as its length (its bytes follow in pieces, see ``pieces``). Raises
    FramingError when ``head`` is malformed."""
    total = head.nbytes
    if total < 8:
        raise FramingError(f"head of {total} bytes is shorter than its frame count")
    (count,) = _U64.unpack_from(head, 0)
    if count > MAX_FRAMES or 8 * (count + 1) > total:
        raise FramingError(f"head of {total} bytes cannot describe {count} frames")
    descs = struct.unpack_from(f"<{count}Q", head, 8)
    pos = 8 * (count + 1)
    out: list[memoryview | int] = []
    for d in descs:
        n = d & ~SEPARATE
        if n > MAX_FRAME:
            raise FramingError(f"head announces a frame of {n} bytes")
        if d & SEPARATE:
            out.append(n)
        else:
            if pos + n > total:
                raise FramingError("head is shorter than its inline frames")
            out.append(head[pos: pos + n])
            pos += n
    if pos != total:
        raise FramingError(f"head has {total - pos} bytes after its inline frames")
    return out


def pieces(length: int, piece: int | None = None) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of each aiordma message a separate frame of ``length``
    bytes travels in: ``piece`` (default ``PIECE``) bytes each, the last one shorter;
    one empty piece for an empty frame."""
    piece = piece or PIECE
    if length == 0:
        yield 0, 0
        return
    for off in range(0, length, piece):
        yield off, min(piece, length - off)
