"""Keys and authentication of connection setup (sans-IO).

Every connection gets two fresh 128-bit nonces: the listener's (in its GREETING) and
the client's (in its HELLO). From them:

* **The connection key**, ``connection_key(secret, server_nonce, client_nonce)`` =
  HMAC-SHA256(secret or b"", "aiordma connection key" | Ns | Nc): fresh for every
  connection, it is the secret both QPs of the connection prove to a ``soft`` device
  (``QPAttr.auth_key``), so a soft connection is bound to its handshake. Without a
  shared secret, whoever reads the handshake (on the network) can compute it: use
  ``ssl=`` for the setup connection, or a shared secret.
* With a **shared secret** (the ``secret=`` option, at least 16 bytes): the client's
  MAC in HELLO, HMAC(secret, "aiordma client" | Ns | HELLO body with a zero mac),
  proves to the listener that the client knows the secret, for this connection only
  (Ns is fresh: a recorded HELLO is worthless). The listener's MAC in ACCEPT,
  HMAC(secret, "aiordma server" | client MAC | ACCEPT body with a zero mac), proves the
  same to the client and binds the reply to that HELLO. Both MACs cover every
  parameter (QP number, PSN, GID, limits), so a man in the middle without the secret
  can neither connect nor redirect a QP, and the connection key is then unknown to
  anyone without the secret.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets

from .handshake import MAC_SIZE, NONCE_SIZE, Hello, hello_body

MIN_SECRET = 16
_ZERO_MAC = bytes(MAC_SIZE)


def check_secret(secret: object) -> bytes | None:
    """``secret`` as bytes (None stays None). Raises TypeError for a non-bytes value and
    ValueError for one shorter than 16 bytes."""
    if secret is None:
        return None
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET:
        raise ValueError(f"secret must be at least {MIN_SECRET} bytes (e.g. "
                         "secrets.token_bytes(32))")
    return bytes(secret)


def new_nonce() -> bytes:
    """A fresh random nonce."""
    return secrets.token_bytes(NONCE_SIZE)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def connection_key(secret: bytes | None, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The connection's key (32 bytes), as both sides compute it."""
    return _mac(secret or b"", b"aiordma connection key", server_nonce, client_nonce)


def client_mac(secret: bytes | None, server_nonce: bytes, hello: Hello) -> bytes:
    """The MAC the client puts in its HELLO (zeros without a secret)."""
    if secret is None:
        return _ZERO_MAC
    unsigned = hello_body(dataclasses.replace(hello, mac=_ZERO_MAC))
    return _mac(secret, b"aiordma client", server_nonce, unsigned)


def server_mac(secret: bytes | None, hello_mac: bytes, accept: Hello) -> bytes:
    """The MAC the listener puts in its ACCEPT (zeros without a secret)."""
    if secret is None:
        return _ZERO_MAC
    unsigned = hello_body(dataclasses.replace(accept, mac=_ZERO_MAC))
    return _mac(secret, b"aiordma server", hello_mac, unsigned)


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(a, b)
