"""No request waits for ever: a queued request goes as soon as it fits, whatever made the
room (a request released with no blocks, a quota changed pool by pool, a prefix stored), and
one that can never fit any more after a quota change is rejected and told why, rather than
wait, and keep every request behind it waiting. In-process (a Node, kvd's calls), so the
moment a request could go is seen, not timed; over gRPC in test_tenants."""

from __future__ import annotations

import dataclasses

import pytest

from kvd.config import Config, PoolConfig, TenantConfig
from kvd.node import Node

PAGE_BYTES = 64
BLOCK_TOKENS = 4


def _node(device_pages: int = 4, tenants=()) -> Node:
    pools = tuple(PoolConfig(name=name, page_bytes=PAGE_BYTES, block_tokens=BLOCK_TOKENS,
                             device_pages=device_pages, host_pages=device_pages,
                             device_backend="host", link_bandwidth="1GiB/s")
                  for name in ("default", "decode"))
    return Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=pools,
                       tenants=tuple(tenants)))


def _admit(node: Node, rid: str, pages: int, tenant: str = "a", pool: str = "default",
           handoff: str = "") -> str:
    return node.admit(rid, tenant=tenant, pool=pool, prompt_tokens=pages * BLOCK_TOKENS,
                      output_tokens=0, priority=0, handoff_pool=handoff).decision


async def _hand_off(node: Node, rid: str) -> None:
    async for _ in node.handoff(rid):
        pass


def _queued(node: Node, pool: str = "default") -> list[str]:
    return list(node.runtime(pool).pool.queue)


async def test_a_prefix_stored_in_the_decode_pool_lets_a_handoff_reservation_go():
    """Blocks a request stores are shared, counted out of its working set: the room that
    leaves in the decode pool is room for the reservation waiting on it."""
    node = _node()
    try:
        assert _admit(node, "decoding", 3, pool="decode") == "admitted"
        assert _admit(node, "prefill", 2, handoff="decode") == "queued"
        await node.shared.store("decoding", "m", [b"k0", b"k1"])
        assert _queued(node) == []
    finally:
        await node.aclose()
