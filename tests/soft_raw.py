"""A raw client of the ``soft`` device's wire format, written from its description
(aiordma/verbs/soft/wire.py) without importing aiordma: what an attacker on the host
can do. Also a command-line tool for the tests that run it as another user:

    python soft_raw.py probe --target (unix:@NAME | tcp:HOST:PORT) --src QPN --dst QPN

prints one JSON line: ``{"connected": bool, "answer": hex of the bytes the device sent
before it closed, "closed": bool, "seconds": float}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import time

MAGIC = b"AIOSOFT1"
VERSION = 3
HELLO = struct.Struct("<8sHHII16s16s16s")
HDR = struct.Struct("<BBHIIIIIQQQ")
OP_SEND, OP_WRITE, OP_READ = 1, 3, 5


def unix_name(host: str, port: int) -> str:
    return f"\0aiordma-soft/{host}/{port}"


def hello(src_qpn: int, dst_qpn: int, *, port: int = 1, mac: bytes | None = None,
          version: int = VERSION) -> bytes:
    """A HELLO naming the pair, with a random nonce and (unless given) a random MAC."""
    gid = b"\0" * 10 + b"\xff\xff" + socket.inet_aton("127.0.0.1")
    return HELLO.pack(MAGIC, version, port, src_qpn, dst_qpn, gid, os.urandom(16),
                      mac if mac is not None else os.urandom(16))


def read_request(psn: int, rkey: int, addr: int, length: int) -> bytes:
    return HDR.pack(OP_READ, 0, 0, psn, length, 0, rkey, 0, addr, 0, 0)


def write_request(psn: int, rkey: int, addr: int, data: bytes) -> bytes:
    return HDR.pack(OP_WRITE, 0, 0, psn, len(data), 0, rkey, 0, addr, 0, 0) + data


def open_socket(target: str) -> socket.socket:
    """``unix:NAME`` (abstract when NAME starts with @) or ``tcp:HOST:PORT``."""
    kind, _, where = target.partition(":")
    if kind == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + where[1:] if where.startswith("@") else where)
    else:
        host, _, port = where.rpartition(":")
        s = socket.create_connection((host, int(port)))
    return s


def probe(target: str, payload: bytes, wait: float = 3.0) -> dict[str, object]:
    """Connect, send ``payload``, and collect what comes back until the device closes
    (or ``wait`` seconds pass)."""
    t0 = time.monotonic()
    try:
        s = open_socket(target)
    except OSError as exc:
        return {"connected": False, "error": str(exc), "closed": True, "answer": "",
                "seconds": time.monotonic() - t0}
    answer = b""
    closed = False
    with s:
        s.settimeout(wait)
        try:
            s.sendall(payload)
            while len(answer) < 1 << 20:
                chunk = s.recv(65536)
                if not chunk:
                    closed = True
                    break
                answer += chunk
        except TimeoutError:
            pass
        except (ConnectionResetError, BrokenPipeError):
            closed = True
    return {"connected": True, "answer": answer.hex(), "closed": closed,
            "seconds": time.monotonic() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["probe"])
    ap.add_argument("--target", required=True)
    ap.add_argument("--src", type=int, default=2)
    ap.add_argument("--dst", type=int, default=2)
    args = ap.parse_args()
    print(json.dumps(probe(args.target, hello(args.src, args.dst))), flush=True)


if __name__ == "__main__":
    main()
