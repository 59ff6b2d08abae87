"""Security guarantees at the endpoint API, on the provider under test and both loops:
regions of one endpoint are refused by another before anything is posted."""

from __future__ import annotations

import asyncio

import pytest
from _pairs import T, pair


@pytest.fixture
def opts(provider_name: str) -> dict:
    return {"provider": provider_name}


async def test_another_endpoints_region_is_refused_before_posting(opts: dict) -> None:
    """B has no regions of its own: A's region handed to B's one-sided calls is a
    ValueError, nothing is posted, and B's connection keeps working."""
    async with pair(opts) as (a, qa), pair(opts) as (b, qb):
        srv_b = await asyncio.wait_for(qb.get(), T)
        target = srv_b.register(bytearray(4096), remote_read=True, remote_write=True,
                                remote_atomic=True)
        desc = target.remote()
        region_a = a.register(bytearray(4096))
        posted = b.statistics()["work_requests_posted"]
        for call in (lambda: b.write(region_a, desc), lambda: b.read(region_a, desc),
                     lambda: b.write_with_imm(region_a, desc, 7)):
            with pytest.raises(ValueError, match="another endpoint"):
                await asyncio.wait_for(call(), T)
        assert b.statistics()["work_requests_posted"] == posted
        # and once B has regions of its own, A's is still refused
        own = b.register(bytearray(4096))
        with pytest.raises(ValueError, match="another endpoint"):
            await asyncio.wait_for(b.write(region_a, desc), T)
        own.view[:5] = b"hello"
        await asyncio.wait_for(b.write(own, desc), T)
        assert bytes(target.view[:5]) == b"hello"
        await asyncio.wait_for(b.send(b"still alive"), T)
        assert await asyncio.wait_for(srv_b.recv(), T) == b"still alive"
        del qa
