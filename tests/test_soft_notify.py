"""The soft device's PipeFlag (verbs/soft/_core): its fd is readable exactly while the flag is raised."""

from __future__ import annotations

import select

from aiordma.verbs.soft._core import PipeFlag


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_the_fd_is_readable_exactly_while_raised() -> None:
    flag = PipeFlag()
    try:
        assert not _readable(flag.fd)
        for _ in range(3):  # bounded: raise twice, lower once, each round
            flag.raise_()
            flag.raise_()
            assert _readable(flag.fd)
            flag.lower()
            assert not _readable(flag.fd)
        flag.lower()  # lowering a lowered flag is a no-op
        assert not _readable(flag.fd)
    finally:
        flag.close()
    assert flag.fd == -1
    flag.raise_()  # closed: nothing to write to, no error
    flag.lower()
