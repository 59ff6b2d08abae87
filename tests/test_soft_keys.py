"""The soft device's memory keys and QP numbers: unpredictable, and a key never comes
back within its protection domain, so a revoked descriptor stays revoked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_verbs_provider import Pair, Resources, S, poll_n, send, sge

from aiordma.verbs import MR, Access, Context, WROpcode
from aiordma.verbs.soft.keys import KeyStream, permute, random_qpn


def test_permute_is_a_bijection_on_a_sample() -> None:
    secret = bytes(range(16))
    outs = {permute(secret, x) for x in range(20000)}
    assert len(outs) == 20000
    assert all(0 <= k < 1 << 32 for k in outs)
    assert permute(secret, 5) != permute(bytes(16), 5)


def test_key_stream_is_not_sequential() -> None:
    ks = KeyStream()
    keys = [ks.next() for _ in range(2000)]
    assert len(set(keys)) == len(keys)
    deltas = {(b - a) & 0xFFFFFFFF for a, b in zip(keys, keys[1:], strict=False)}
    assert len(deltas) > 1900  # no stride to predict the next key from the last
    assert len({k >> 24 for k in keys}) > 200  # every byte of the key changes
    assert len({k & 0xFF for k in keys}) > 200


def test_random_qpns() -> None:
    qpns = [random_qpn({}) for _ in range(500)]
    assert len(set(qpns)) > 490 and all(2 <= q <= 0xFFFFFF for q in qpns)
    taken: dict[int, object] = dict.fromkeys(range(2, 0x1000))
    assert all(random_qpn(taken) >= 0x1000 for _ in range(50))


@pytest.fixture
def soft_ctx(provider_name: str) -> Iterator[Context]:
    if provider_name != "soft":
        pytest.skip("soft device keys")
    from aiordma.verbs import open_context

    c = open_context(provider="soft")
    yield c
    c.close()


def test_keys_of_a_pd_never_repeat_and_revoked_stays_revoked(soft_ctx: Context) -> None:
    """Re-registering one buffer 600 times (past the 256 that an 8-bit key byte
    allows) gives 600 distinct keys, and a READ with the first, revoked rkey fails."""
    res = Resources(soft_ctx)
    try:
        p = Pair(soft_ctx, res)
        local, _ = p.mr("a", 64)
        buf = bytearray(b"secret!!" * 8)
        first = p.pd_b.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_READ)
        old_rkey, old_addr = first.rkey, first.addr
        first.close()
        seen = {old_rkey}
        for _ in range(600):
            mr = p.pd_b.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_READ)
            assert mr.rkey not in seen
            seen.add(mr.rkey)
            mr.close()
        live = res.add(p.pd_b.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_READ))
        assert live.rkey not in seen
        p.a.post_send([send(1, [sge(local)], WROpcode.RDMA_READ, remote_addr=old_addr,
                            rkey=old_rkey)])
        (wc,) = poll_n(p.cq_a, 1)
        assert wc.status == S.REM_ACCESS_ERR
    finally:
        res.close()


def test_a_key_used_lately_is_revoked_with_its_region(soft_ctx: Context) -> None:
    """The device remembers the regions of the keys it used lately (a cache in front of
    its key table): an rkey that served a READ fails the next READ once its region is
    deregistered (REM_ACCESS_ERR), and so does a local key (LOC_PROT_ERR)."""
    res = Resources(soft_ctx)
    try:
        buf = bytearray(b"secret!!" * 8)

        def read(p: Pair, local: MR, target: MR) -> S:
            p.a.post_send([send(1, [sge(local)], WROpcode.RDMA_READ, remote_addr=target.addr,
                                rkey=target.rkey)])
            (wc,) = poll_n(p.cq_a, 1)
            return wc.status

        for revoke in ("remote", "local"):
            p = Pair(soft_ctx, res)
            into = bytearray(64)
            local = res.add(p.pd_a.reg_mr(into, Access.LOCAL_WRITE))
            target = res.add(p.pd_b.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_READ))
            assert read(p, local, target) == S.SUCCESS  # both keys looked up, remembered
            assert bytes(into[:8]) == b"secret!!"
            (target if revoke == "remote" else local).close()  # (closing twice is fine)
            assert read(p, local, target) == (S.REM_ACCESS_ERR if revoke == "remote"
                                              else S.LOC_PROT_ERR)
    finally:
        res.close()


def test_qp_numbers_are_not_sequential(soft_ctx: Context) -> None:
    res = Resources(soft_ctx)
    try:
        pairs = [Pair(soft_ctx, res, connect=False) for _ in range(8)]
        qpns = [q.qp_num for p in pairs for q in (p.a, p.b)]
        steps = {(b - a) & 0xFFFFFF for a, b in zip(qpns, qpns[1:], strict=False)}
        assert len(steps) > 10
    finally:
        res.close()
