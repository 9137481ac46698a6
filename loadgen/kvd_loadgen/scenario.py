"""What every scenario sets up the same way: a kvd of its own on a config written for it,
in a temporary directory, with a client to it; samplers that look at kvd every period until
the run ends; and the check that kvd is sound after it."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from kvd_client import AsyncClient
from kvd_loadgen.local import LocalKvd


def split_run(spec: str) -> tuple[str, str]:
    """A run's `POLICY[@ADMISSION]` as (policy, admission mode); working_set when unsaid
    (`lru@reservation`: the device over-subscribed, as an engine's own cache would be)."""
    policy, _, admission = spec.partition("@")
    return policy, admission or "working_set"


@contextlib.asynccontextmanager
async def local_kvd(config_text: str, *, prefix: str = "kvd-scenario-",
                    timeout_s: float = 120.0) -> AsyncIterator[tuple[LocalKvd, AsyncClient]]:
    """A kvd started on `config_text` in a temporary directory, and a client to it (the
    config's unix socket identity: the admin by default). Stopped and removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        config = Path(tmp) / "kvd.toml"
        config.write_text(config_text)
        with LocalKvd("--config", str(config), workdir=tmp) as kvd:
            async with AsyncClient(kvd.target, timeout_s=timeout_s) as client:
                yield kvd, client


class Samplers:
    """Sampling coroutines `sample(client) -> dict` run every period from start() until
    stop(); each sample is stamped with its time since start."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.start_time = 0.0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self, *samplers: tuple[Callable[[AsyncClient], Awaitable[dict]], float]
              ) -> list[list[dict]]:
        """Start each (sample, period_s); returns the lists their samples go to."""
        self.start_time = time.monotonic()
        outs: list[list[dict]] = []
        for sample, period_s in samplers:
            out: list[dict] = []
            outs.append(out)
            self._tasks.append(asyncio.ensure_future(self._run(sample, period_s, out)))
        return outs

    async def _run(self, sample, period_s: float, out: list[dict]) -> None:
        while not self._stop.is_set():
            out.append({"t": time.monotonic() - self.start_time, **await sample(self.client)})
            try:
                await asyncio.wait_for(self._stop.wait(), period_s)
            except asyncio.TimeoutError:
                pass

    @property
    def stopping(self) -> asyncio.Event:
        return self._stop

    async def stop(self) -> None:
        """Take the last samples and end."""
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def link_sample(client: AsyncClient) -> dict:
    """Each link's cumulative bytes (total and by tenant) and queue depth: utilisation over
    time is the difference between samples."""
    links = await client.list_links()
    return {"links": {link.link: {
        "capacity": link.capacity_bytes_per_s,
        "bytes": link.bytes_total,
        "tenants": {t.tenant: t.bytes for t in link.tenants},
        "queued": sum(q.transfers for q in link.queues)} for link in links}}


async def assert_sound(client: AsyncClient) -> None:
    """kvd's own SelfCheck after a run: every invariant holds, nothing is stuck."""
    check = await client.self_check()
    assert check.ok, list(check.problems)
