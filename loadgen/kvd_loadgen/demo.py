"""`kvd-loadgen demo`: create memory pressure against a running kvd and show what happened."""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
from rich.console import Console
from rich.table import Table

from kvd_client import AsyncClient, DeadlineExceededError, pb
from kvd_client.arena import MappedPool


def _digest(page: np.ndarray) -> str:
    return hashlib.blake2b(page.tobytes(), digest_size=8).hexdigest()


async def run_demo(target: str, *, num_requests: int = 6, rounds: int = 3,
                   token: str | None = None, tenant: str = "demo",
                   console: Console | None = None) -> dict:
    """Six requests that together need twice the device tier, each written and then read
    `rounds` times (round-robin among those running). Under working-set admission (kvd's
    default) half of them wait in the queue, with kvd's reason, and run as the first ones
    end: no step pages. Under reservation admission all run at once: kvd demotes and
    promotes. Either way every byte an engine wrote comes back intact. The request ids carry
    this run's own tag: demos run at once do not collide."""
    console = console or Console()
    run = secrets.token_hex(2)
    async with AsyncClient(target, timeout_s=30, token=token) as kvd:
        stats = (await kvd.pool_stats()).pools[0]
        device = stats.tiers[0]
        pages_each = max(1, 2 * device.capacity_pages // num_requests)
        before = stats
        mapped = MappedPool(await kvd.export_pool())
        rng = np.random.default_rng(0)
        rows = {}
        digests: dict[tuple[str, int], str] = {}
        waiting = []
        try:
            for i in range(num_requests):
                rid = f"demo-{run}-{i}"
                reply = await kvd.admit(rid, prompt_tokens=pages_each * stats.block_tokens,
                                        tenant=tenant)
                decision = pb.Decision.Name(reply.decision).removeprefix("DECISION_").lower()
                rows[rid] = {"pages": reply.projected_pages, "decision": decision,
                             "promoted": 0, "stall_ms": 0.0, "verified": "-",
                             "reason": reply.reason}
                if reply.decision == pb.DECISION_QUEUED:
                    waiting.append(rid)
            running = [rid for rid, row in rows.items() if row["decision"] == "admitted"]
            while running:
                for rid in running:
                    await _write(kvd, mapped, rng, rid, rows[rid], digests)
                await _read(kvd, mapped, running, rows, digests, rounds)
                for rid in running:  # they end; what waited for their room goes in
                    await kvd.release(rid)
                # The first in line waits for its room; those behind it go along if they
                # are admitted by then.
                running = [rid for i, rid in enumerate(waiting)
                           if await _admitted(kvd, rid, 10.0 if i == 0 else 0.2)]
                waiting = [rid for rid in waiting if rid not in running]
                for rid in running:
                    rows[rid]["decision"] = "queued, then admitted"
            after = (await kvd.pool_stats()).pools[0]
            for rid in waiting:
                await kvd.release(rid)
        finally:
            mapped.close()

    _print_table(console, rows, num_requests, pages_each, device, rounds, after.admission)
    summary = _summary(console, before, after, rows)
    return summary


async def _write(kvd, mapped, rng, rid, row, digests) -> None:
    alloc = await kvd.allocate(rid, row["pages"])
    row["stall_ms"] += alloc.stall_us / 1e3
    for h in alloc.handles:  # the engine writes its KV into the page
        data = rng.integers(0, 256, mapped.page_bytes, dtype=np.uint8)
        mapped.write(h, data)
        digests[(rid, h.block_index)] = _digest(data)


async def _read(kvd, mapped, running, rows, digests, rounds) -> None:
    for _ in range(rounds):
        for rid in running:
            row = rows[rid]
            access = await kvd.access(rid)  # attention reads every block
            row["promoted"] += access.num_promoted
            row["stall_ms"] += access.stall_us / 1e3
            ok = all(_digest(mapped.read(h)) == digests[(rid, h.block_index)]
                     for h in access.handles)
            row["verified"] = "yes" if ok and row["verified"] != "NO" else "NO"


async def _admitted(kvd, rid: str, timeout_s: float) -> bool:
    """Whether a queued request is admitted within timeout_s."""
    try:
        async for update in kvd.wait_admission(rid, timeout_s=timeout_s):
            if update.decision == pb.DECISION_ADMITTED:
                return True
    except DeadlineExceededError:
        pass
    return False


def _print_table(console: Console, rows: dict, num_requests: int, pages_each: int, device,
                 rounds: int, admission: str) -> None:
    table = Table(title=f"kvd demo: {num_requests} requests x {pages_each} pages on "
                        f"{device.capacity_pages} device pages ({device.backend}), "
                        f"{rounds} rounds of reads, {admission.replace('_', '-')} admission")
    for col in ("request", "pages", "admission", "promoted", "stall ms", "bytes intact"):
        table.add_column(col, justify="right" if col in ("pages", "promoted", "stall ms")
                         else "left")
    for rid, row in rows.items():
        table.add_row(rid, str(row["pages"]), row["decision"], str(row["promoted"]),
                      f"{row['stall_ms']:.2f}", row["verified"])
    console.print(table)
    reasons = {row["reason"] for row in rows.values() if row["reason"]}
    for reason in sorted(reasons):
        console.print(f"queued: {reason}", soft_wrap=True)


def _summary(console: Console, before, after, rows: dict) -> dict:
    """What the demo moved and whether every byte read back was the byte written."""
    summary = {
        "evictions": after.num_evictions - before.num_evictions,
        "demotions": after.num_demotions - before.num_demotions,
        "promotions": after.num_promotions - before.num_promotions,
        "bytes_moved": after.bytes_moved - before.bytes_moved,
        "stall_s": after.stall_seconds_total - before.stall_seconds_total,
        "page_bytes": after.page_bytes,
        "policy": after.policy,
        "admission": after.admission,
        "queued": sum(1 for r in rows.values() if r["decision"].startswith("queued")),
        "all_intact": all(r["verified"] != "NO" for r in rows.values()),
    }
    if summary["queued"]:
        console.print(f"{summary['queued']} of {len(rows)} requests waited for room: their "
                      "working sets would not have fit the device beside the running ones, "
                      "and admitting them would have made every read page.", soft_wrap=True)
    console.print(
        f"policy {summary['policy']}: {summary['evictions']} evictions, "
        f"{summary['demotions']} demotions, {summary['promotions']} promotions, "
        f"{summary['bytes_moved'] / 2**20:.1f} MiB copied between tiers, "
        f"{summary['stall_s'] * 1e3:.1f} ms of memory stall; "
        f"bytes intact after every move: {'yes' if summary['all_intact'] else 'NO'}"
    )
    return summary
