"""Endpoint options: defaults, validation, and the environment overrides."""

from __future__ import annotations

import dataclasses
import os
import ssl
from typing import Any

from .protocol.auth import check_secret

KiB = 1024
MiB = 1024 * KiB

#: ``ack_timeout`` by provider. soft: 18, 1.07 s a try, 8.6 s without progress before
#: RETRY_EXC_ERR with 7 retries -- its responder is the peer's process, so the timer
#: must outlast a paused peer (3 s) and TCP's retransmission back-off on a lossy link
#: underneath; verbs: 14, 67 ms a try (0.54 s): the NIC answers for its host, and a
#: retry resends what a lossy fabric dropped.
DEFAULT_ACK_TIMEOUT = {"soft": 18, "verbs": 14}


DEFAULT_LIVENESS_TIMEOUT = 8.0


def _liveness_default() -> float | None:
    """``liveness_timeout``'s default: ``AIORDMA_LIVENESS_TIMEOUT`` (seconds, or ``none``)
    when set -- an emulated or heavily loaded machine, whose event loops can stall for
    seconds, wants more -- else ``DEFAULT_LIVENESS_TIMEOUT``. ValueError if invalid."""
    raw = os.environ.get("AIORDMA_LIVENESS_TIMEOUT")
    if not raw:
        return DEFAULT_LIVENESS_TIMEOUT
    if raw.strip().lower() == "none":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"AIORDMA_LIVENESS_TIMEOUT={raw!r} is not a number or 'none'") from None


@dataclasses.dataclass
class EndpointOptions:
    """Keyword options of ``connect``/``listen``/``create_connection``/... .

    * ``provider``/``device``: which device (name, or an ``aiordma.Device``).
    * ``recv_depth``: receive buffers posted for the peer (its initial credits).
    * ``send_depth``: send-queue depth and eager send buffers.
    * ``eager_size``: receive buffer size; larger messages go by rendezvous (RDMA READ).
    * ``max_message_size``: largest message ``send``/``recv`` accept (default 256 MiB).
    * ``signal_interval``: at most this many unsignaled sends in a row.
    * ``signal_bytes``: at most this many bytes posted unsignaled in a row (a batch of
      large READs/WRITEs then reports each operation as it finishes, see
      aiordma.protocol.engine).
    * ``repost_batch``: consumed receive buffers are re-posted this many at a time (one
      post for all; fewer when ``recv_depth`` is small, see the engine's credit rule 6).
    * ``inline_threshold``: frames up to this size are posted inline (device limit too).
    * ``handshake_timeout``: seconds for each step of connection setup.
    * ``secret``: a shared secret (bytes, at least 16) both sides must prove in the
      handshake (mutual challenge-response, ``protocol.auth``); a listener with one
      refuses clients without it, and a client with one refuses a listener without it.
    * ``ssl``/``server_hostname``: an ``ssl.SSLContext`` for the setup TCP connection
      (descriptors and keys travel on it), as asyncio's ``create_connection`` and
      ``start_server`` take them.
    * ``max_handshakes``: a listener's handshakes in progress at most; a new connection
      beyond it drops the oldest one (a silent or slow client), which is refused.
    * ``poll_mode``/``spin_us``: completion polling policy (see cq_reactor).
    * ``close_timeout``: seconds ``close()`` waits for pending sends and flushes.
    * ``max_wr_size``: most bytes one RDMA READ/WRITE work request moves (default and
      ceiling: the port's ``max_msg_sz``); longer transfers are posted in pieces.
    * ``rndv_prefetch``: bytes of large messages read ahead into staging while the
      application is not receiving (like a TCP receive buffer); beyond it the sender
      waits for ``recv``. While a receive is in progress (its own message is READ
      straight into its buffer), at most ``min(rndv_prefetch, 4 MiB)`` of the ones
      behind it are read ahead (on ``soft``, whose READs are CPU copies, only while
      the receive in progress itself needs staging, as ``recv()`` does: a receive into
      a registered buffer READs its message straight into it). 0: nothing is staged,
      every READ waits for a receiver.
    * ``ack_timeout``/``retry_cnt``: the QP's local ACK timeout and retry count, with
      their verbs meaning: one try lasts ``4.096 us * 2**ack_timeout``, and
      ``retry_cnt + 1`` tries in a row without progress fail the connection with
      ``RetryExceededError`` (IBV_WC_RETRY_EXC_ERR). ``None``: the provider's default
      (``DEFAULT_ACK_TIMEOUT``; docs/networks.md says how they were chosen).
    * ``liveness_timeout``: seconds without an answer from the peer's event loop (a
      heartbeat on the setup connection, every quarter of it) after which the endpoint
      fails with ``PeerUnresponsive``: a peer frozen, or cut off, is found
      ``liveness_timeout * 3/4`` to ``liveness_timeout`` after it went silent. Default
      8 s, or ``AIORDMA_LIVENESS_TIMEOUT``: a 3 s pause of the peer passes, a silent
      peer is found within 8 s. None: this side never gives up on the peer (it still
      answers the peer's heartbeat).
    """

    provider: str | None = None
    device: Any = None
    recv_depth: int = 64
    send_depth: int = 128
    eager_size: int = 16 * KiB
    max_message_size: int = 256 * MiB
    signal_interval: int = 16
    signal_bytes: int = 64 * KiB
    repost_batch: int = 16
    inline_threshold: int = 128
    handshake_timeout: float = 10.0
    secret: bytes | None = dataclasses.field(default=None, repr=False)  # never printed
    ssl: Any = None
    server_hostname: str | None = None
    max_handshakes: int = 128
    poll_mode: str | None = None
    spin_us: int | None = None
    close_timeout: float = 10.0
    rndv_prefetch: int = 64 * MiB
    max_wr_size: int | None = None
    ack_timeout: int | None = None
    retry_cnt: int = 7
    liveness_timeout: float | None = dataclasses.field(default_factory=_liveness_default)

    @classmethod
    def from_kwargs(cls, opts: dict[str, Any]) -> EndpointOptions:
        """Build from keyword options. Raises TypeError for unknown names, ValueError
        for out-of-range values."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(opts) - names
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
        o = cls(**opts)
        o.validate()
        return o

    def qp_timeout(self, provider: str) -> int:
        """The QP's ``timeout`` attribute on ``provider`` (``ack_timeout`` or its default)."""
        if self.ack_timeout is not None:
            return self.ack_timeout
        return DEFAULT_ACK_TIMEOUT.get(provider, DEFAULT_ACK_TIMEOUT["verbs"])

    def validate(self) -> None:
        if not 4 <= self.recv_depth <= 16384:
            raise ValueError("recv_depth must be in [4, 16384]")
        if not 4 <= self.send_depth <= 16384:
            raise ValueError("send_depth must be in [4, 16384]")
        if not 64 <= self.eager_size <= 16 * MiB:
            raise ValueError("eager_size must be in [64, 16 MiB]")
        if not self.eager_size <= self.max_message_size <= 1 << 40:
            raise ValueError("max_message_size must be in [eager_size, 2**40]")
        if self.signal_interval < 1:
            raise ValueError("signal_interval must be >= 1")
        if self.signal_bytes < 1:
            raise ValueError("signal_bytes must be >= 1")
        if self.repost_batch < 1:
            raise ValueError("repost_batch must be >= 1")
        if self.max_wr_size is not None and self.max_wr_size < 4 * KiB:
            raise ValueError("max_wr_size must be >= 4 KiB")
        if self.ack_timeout is not None and not 0 <= self.ack_timeout <= 31:
            raise ValueError("ack_timeout must be in [0, 31] (0: wait forever)")
        if not 0 <= self.retry_cnt <= 7:
            raise ValueError("retry_cnt must be in [0, 7]")
        if self.liveness_timeout is not None and not self.liveness_timeout > 0:
            raise ValueError("liveness_timeout must be positive, or None (never)")
        if self.rndv_prefetch < 0:
            raise ValueError("rndv_prefetch must be >= 0")
        self.secret = check_secret(self.secret)
        if self.ssl is not None and not isinstance(self.ssl, ssl.SSLContext):
            raise TypeError("ssl must be an ssl.SSLContext")
        if self.max_handshakes < 1:
            raise ValueError("max_handshakes must be >= 1")
        if self.handshake_timeout <= 0 or self.close_timeout <= 0:
            raise ValueError("timeouts must be positive")
