"""Unpredictable numbers of the soft device: memory keys and QP numbers.

Memory keys. On hardware an rkey is a capability that a peer may try to guess; here
each protection domain draws its keys from a :class:`KeyStream`: a secret-keyed
permutation of the 32-bit integers (a four-round Feistel network over two 16-bit
halves, with keyed BLAKE2b as the round function: Luby-Rackoff's construction) applied
to a counter. The keys of one PD are therefore unpredictable without the PD's secret
(``secrets``, 128 bits) and never repeat in the PD's life, so a descriptor of a region
that was closed never becomes valid again, however often memory is re-registered; and
a key works only through a QP of the same PD (the responder checks), so keys of other
PDs -- which may coincide with a closed one's -- are no way in either. The device-wide
table keeps keys unique among live regions.

QP numbers are random 24-bit values (from ``secrets``), as real devices' are not
sequential either; the first PSN comes from the user of the QP (the endpoint draws it
with ``secrets``).
"""

from __future__ import annotations

import errno
import hashlib
import secrets
from collections.abc import Container
from typing import Final

from ...errors import RegistrationError

_ROUNDS: Final = 4
_M16: Final = 0xFFFF


class KeyStream:
    """32-bit keys, unpredictable and pairwise distinct: ``next()`` is a secret
    permutation of 0, 1, 2, ... Raises RegistrationError (ENOMEM) after 2**32 keys."""

    __slots__ = ("_secret", "_count")

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(16)
        self._count = 0

    def next(self) -> int:
        n = self._count
        if n >> 32:
            raise RegistrationError(errno.ENOMEM, "out of memory keys in this protection domain")
        self._count = n + 1
        return permute(self._secret, n)


def permute(secret: bytes, x: int) -> int:
    """The image of the 32-bit ``x`` under the permutation keyed by ``secret``."""
    left, right = x >> 16, x & _M16
    for r in range(_ROUNDS):
        f = hashlib.blake2b(right.to_bytes(2, "little") + bytes((r,)), digest_size=2,
                            key=secret).digest()
        left, right = right, left ^ int.from_bytes(f, "little")
    return (left << 16) | right


def random_qpn(in_use: Container[int]) -> int:
    """A random QP number (24 bits, not 0 or 1, which IB reserves) not in ``in_use``."""
    while True:
        qpn = secrets.randbelow(0xFFFFFE) + 2
        if qpn not in in_use:
            return qpn
