"""The soft device's wire opcode predicates: each agrees with its opcode set."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from aiordma.verbs.soft import wire

_RD_ATOMIC = frozenset({wire.OP_READ, wire.OP_CMP_SWP, wire.OP_FETCH_ADD})


@pytest.mark.parametrize(("predicate", "ops"), [
    (wire.is_request, wire.REQUEST_OPS),
    (wire.is_response, wire.RESPONSE_OPS),
    (wire.has_payload, wire.PAYLOAD_OPS),
    (wire.is_cma_op, wire.CMA_OPS),
    (wire.is_rd_atomic, _RD_ATOMIC),
])
def test_predicate_matches_its_set(predicate: Callable[[int], bool], ops: frozenset[int]) -> None:
    assert {op for op in range(256) if predicate(op)} == set(ops)


def test_payload_len() -> None:
    hdr = wire.HDR.unpack(wire.pack(wire.OP_SEND, 1, 100))
    assert wire.payload_len(hdr) == 100
    assert wire.payload_len(wire.HDR.unpack(wire.pack(wire.OP_READ, 1, 100))) == 0
    cma = wire.HDR.unpack(wire.pack(wire.OP_WRITE, 1, 4096, flags=wire.FLAG_CMA, aux=3))
    assert wire.payload_len(cma) == 3 * wire.IOV_SIZE
    assert wire.payload_len(wire.HDR.unpack(wire.pack(wire.OP_SEND, 1, 9, flags=wire.FLAG_CMA))) == 0
