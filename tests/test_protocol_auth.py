"""Keys and MACs of connection setup (aiordma.protocol.auth), without a loop or a
provider."""

from __future__ import annotations

import dataclasses

import pytest

from aiordma.protocol import auth
from aiordma.protocol.handshake import Hello

SECRET = b"0123456789abcdef-shared"
HELLO = Hello(qp_num=0x11, psn=0x123456, gid=bytes(range(16)), lid=7, mtu=3,
              recv_credits=64, eager_size=8192, max_message_size=1 << 30, provider="soft",
              nonce=bytes(range(16, 32)))


def test_check_secret() -> None:
    assert auth.check_secret(None) is None
    assert auth.check_secret(bytearray(SECRET)) == SECRET
    with pytest.raises(TypeError, match="bytes"):
        auth.check_secret("a string secret!!")
    with pytest.raises(ValueError, match="at least 16"):
        auth.check_secret(b"short")


def test_connection_key_is_fresh_per_connection() -> None:
    ns, nc = auth.new_nonce(), auth.new_nonce()
    assert ns != nc and len(ns) == 16
    k = auth.connection_key(None, ns, nc)
    assert len(k) == 32
    assert auth.connection_key(None, ns, nc) == k  # both sides agree
    assert auth.connection_key(None, ns, auth.new_nonce()) != k
    assert auth.connection_key(SECRET, ns, nc) != k  # the secret keys it too


def test_client_mac_proves_the_secret_for_this_connection() -> None:
    ns = auth.new_nonce()
    mac = auth.client_mac(SECRET, ns, HELLO)
    signed = dataclasses.replace(HELLO, mac=mac)
    assert auth.same(auth.client_mac(SECRET, ns, signed), mac)  # the mac field is excluded
    assert not auth.same(auth.client_mac(SECRET + b"x", ns, signed), mac)
    assert not auth.same(auth.client_mac(SECRET, auth.new_nonce(), signed), mac)  # replay
    for field, value in (("qp_num", 0x12), ("gid", bytes(16)), ("psn", 1), ("lid", 8),
                         ("nonce", bytes(16)), ("provider", "verbs")):
        tampered = dataclasses.replace(signed, **{field: value})
        assert not auth.same(auth.client_mac(SECRET, ns, tampered), mac), field
    assert auth.client_mac(None, ns, HELLO) == bytes(32)


def test_server_mac_binds_the_reply_to_the_hello() -> None:
    accept = dataclasses.replace(HELLO, qp_num=0x22)
    c1, c2 = auth.client_mac(SECRET, b"a" * 16, HELLO), auth.client_mac(SECRET, b"b" * 16, HELLO)
    mac = auth.server_mac(SECRET, c1, accept)
    assert auth.same(auth.server_mac(SECRET, c1, dataclasses.replace(accept, mac=mac)), mac)
    assert not auth.same(auth.server_mac(SECRET, c2, accept), mac)
    assert not auth.same(auth.server_mac(SECRET, c1, dataclasses.replace(accept, lid=9)), mac)
    assert auth.server_mac(None, c1, accept) == bytes(32)
