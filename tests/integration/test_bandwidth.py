"""Bandwidth over real gRPC: a tenant flooding promotions cannot hold up another tenant's
decode-critical promotion beyond a bound under fair link scheduling (and, to show the test
can fail, does under fifo); links, caps and read metering are reported."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from kvd_client import AsyncClient, InvalidArgumentError, pb
from kvd_client.client import intent_update
from kvd_loadgen.local import LocalKvd

CONFIG = """
[[pool]]
model = "tiny"
device_pages = 16
host_pages = 128
policy = "intent"
admission = "reservation"  # the hog's reads page through the link
link_bandwidth = "4MiB/s"
link_burst = "64KiB"
link_chunk = "64KiB"
link_scheduling = "{scheduling}"

[[tenant]]
name = "hog"
read_budget = "{read_budget}"

[[tenant]]
name = "calm"
bandwidth_cap = "2MiB/s"
"""

HOG_TASKS = 10
HOG_BLOCKS = 12
# One 64 KiB chunk of the hog in flight, then calm's own chunk (its promotions and the
# demotions making room for them), each 16 ms at 4 MiB/s; the rest is gRPC and scheduling
# on a shared 2-core machine.
BOUND_S = 0.15


def start(tmp_path, scheduling="fair", read_budget=0):
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(scheduling=scheduling, read_budget=read_budget))
    return LocalKvd("--config", str(config), workdir=tmp_path)


async def calm_waits(c: AsyncClient, trials: int) -> list[float]:
    """Seconds from marking calm's two demoted blocks decode-critical until its access of
    them returns, per trial; between trials the hog's traffic pushes them out again."""
    waits = []
    for _ in range(trials):
        for _ in range(100):  # wait until the hog's traffic has evicted both blocks
            info = {r.request_id: r for r in await c.list_requests()}
            if info["calm"].device_blocks == 0:
                break
            await asyncio.sleep(0.05)
        assert info["calm"].device_blocks == 0, "the flood did not reach calm's blocks"
        started = time.perf_counter()
        await c.update_intents([intent_update("calm", i, priority=pb.PRIORITY_DECODE_CRITICAL)
                                for i in (0, 1)])
        await c.access("calm", [0, 1])
        waits.append(time.perf_counter() - started)
        await c.update_intents([intent_update("calm", i, priority=pb.PRIORITY_COLD)
                                for i in (0, 1)])
    return waits


async def flood(c: AsyncClient, request_id: str, stop: asyncio.Event) -> None:
    window = 0
    while not stop.is_set():
        blocks = [(window + i) % HOG_BLOCKS for i in range(8)]
        await c.access(request_id, blocks)
        window += 8


async def run(tmp_path, scheduling: str) -> tuple[list[float], list[pb.LinkStats]]:
    with start(tmp_path, scheduling) as kvd:
        async with AsyncClient(kvd.target, timeout_s=30) as c:
            await c.admit("calm", 32, 0, tenant="calm")
            await c.allocate("calm", 2)
            await c.update_intents([intent_update("calm", i, priority=pb.PRIORITY_COLD)
                                    for i in (0, 1)])
            for i in range(HOG_TASKS):
                await c.admit(f"hog{i}", HOG_BLOCKS * 16, 0, tenant="hog")
                await c.allocate(f"hog{i}", HOG_BLOCKS)
            stop = asyncio.Event()
            hogs = [asyncio.ensure_future(flood(c, f"hog{i}", stop)) for i in range(HOG_TASKS)]
            await asyncio.sleep(0.5)  # a standing queue on the link
            waits = await calm_waits(c, 4)
            links = await c.list_links()
            stop.set()
            await asyncio.gather(*hogs)
            assert (await c.self_check()).ok
            return waits, links


async def test_flooding_tenant_cannot_delay_decode_critical_promotions(tmp_path):
    waits, links = await run(tmp_path, "fair")
    assert max(waits) < BOUND_S, waits
    (link,) = links
    assert link.link == "default:device<->host" and link.scheduling == "fair"
    assert link.capacity_bytes_per_s == 4 * 2**20
    by_tenant = {t.tenant: t for t in link.tenants}
    assert by_tenant["hog"].bytes > 10 * by_tenant["calm"].bytes > 0
    assert by_tenant["calm"].cap_bytes_per_s == 2 * 2**20


async def test_without_budgets_the_flood_does_delay_them(tmp_path):
    waits, _ = await run(tmp_path, "fifo")
    assert statistics.median(waits) > BOUND_S, waits


async def test_link_is_paced_at_its_capacity(tmp_path):
    """Whatever the copy engine could do, the link moves at most rate x time + burst."""
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=30) as c:
            for i in range(HOG_TASKS):
                await c.admit(f"hog{i}", HOG_BLOCKS * 16, 0, tenant="hog")
                await c.allocate(f"hog{i}", HOG_BLOCKS)
            stop = asyncio.Event()
            before = (await c.list_links())[0].bytes_total
            started = time.perf_counter()
            hogs = [asyncio.ensure_future(flood(c, f"hog{i}", stop)) for i in range(HOG_TASKS)]
            await asyncio.sleep(2.0)
            stop.set()
            await asyncio.gather(*hogs)
            elapsed = time.perf_counter() - started
            moved = (await c.list_links())[0].bytes_total - before
            # Charged as chunks start: allow the burst and the chunks still being started.
            assert moved <= 4 * 2**20 * elapsed + 64 * 1024 + HOG_TASKS * 256 * 1024
            assert moved >= 0.8 * 4 * 2**20 * 2.0  # and it was kept busy
            stats = (await c.pool_stats()).pools[0]
            assert stats.links[0].busy_seconds > 0
            assert stats.bytes_read > 0


async def test_read_budget_holds_promotions_of_a_request_over_it(tmp_path):
    # 64 KiB/s of reads (a second's worth may come at once): reading 8 blocks (128 KiB)
    # with the budget spent holds that request's next promotion for about two seconds.
    with start(tmp_path, read_budget="64KiB/s") as kvd:
        async with AsyncClient(kvd.target, timeout_s=30) as c:
            await c.admit("r", 12 * 16, 0, tenant="hog")
            await c.allocate("r", 12)  # 12 blocks, 16 device pages: all resident
            await c.admit("other", 12 * 16, 0, tenant="calm")
            await c.allocate("other", 12)  # pushes 8 of r's blocks out
            await c.access("r", list(range(12)))  # promotes r's; reads 192 KiB
            await c.access("other", list(range(12)))  # pushes r's out again
            started = time.perf_counter()
            reply = await c.access("r", list(range(8)))
            held = time.perf_counter() - started
            assert reply.num_promoted > 0
            assert held > 1.2, held
            (tenant,) = [t for t in await c.list_tenants() if t.tenant == "hog"]
            assert tenant.read_budget_bytes_per_s == 64 * 1024
            assert tenant.bytes_read == (12 + 8) * 16 * 1024
            (info,) = [r for r in await c.list_requests() if r.request_id == "r"]
            assert info.bytes_read == (12 + 8) * 16 * 1024 and info.bytes_moved > 0


async def test_bandwidth_quotas_change_at_run_time(tmp_path):
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=30) as c:
            (info,) = await c.set_quota("hog", bandwidth_cap_bytes_per_s=2**20,
                                        read_budget_bytes_per_s=4096)
            assert info.bandwidth_cap_bytes_per_s == 2**20
            assert info.read_budget_bytes_per_s == 4096
            (link,) = await c.list_links()
            caps = {t.tenant: t.cap_bytes_per_s for t in link.tenants}
            assert caps["hog"] == 2**20 and caps["calm"] == 2 * 2**20
            (info,) = await c.set_quota("calm", bandwidth_cap_bytes_per_s=0)  # no cap now
            (link,) = await c.list_links()
            assert "calm" not in {t.tenant for t in link.tenants if t.cap_bytes_per_s}
            with pytest.raises(InvalidArgumentError, match="bandwidth_cap"):
                await c.set_quota("hog", bandwidth_cap_bytes_per_s=-1)
