"""Integration fixtures: a real kvd process on a unix socket in a temp dir."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import urllib.request

import pytest
from hypothesis import HealthCheck, Phase, settings
from prometheus_client.parser import text_string_to_metric_families

from kvd_client import AsyncClient, DeadlineExceededError, UnavailableError
from kvd_loadgen.local import LocalKvd


# A state machine's pool: its engines' holds end with their next calls or messages, never by
# lapsing (hold_s), under reservation admission (the machines drive paging).
MACHINE_CONFIG = """
[server]
hold_s = 120

[[pool]]
page_bytes = {page_bytes}
block_tokens = {block_tokens}
device_pages = {device}
host_pages = {host}
admission = "reservation"
policy = "lru"
"""


# The [auth] of configs whose tenants are told apart by their tokens: the admin's is
# "root-token", and a unix caller without a token is refused.
TOKENS_ONLY = """
[auth]
admin_token = "root-token"
unix_tenant = ""
unix_admin = false
"""


# A machine size's third part: each engine a tenant of its own with quotas (the first
# guaranteed a quarter of the device, the second limited to half of it, the third weighted
# twice), rather than only a tenant of its own (True) or all the socket's tenant (False).
QUOTAS = "quotas"
# A tenant per engine, the first keeping its prefix blocks apart (share_prefixes = false).
PRIVATE = "private"


def _quotas(device: int) -> dict[int, str]:
    return {0: f"guaranteed = {device // 4}\n", 1: f"limit = {device // 2}\n",
            2: "weight = 2.0\n"}


@contextlib.contextmanager
def machine_kvd(tmp_path_factory, name: str, size: tuple[int, int, bool | str], *,
                page_bytes: int, block_tokens: int, engines: int, pool_extra: str = "",
                slice_blocks: int | None = None):
    """A kvd for a state machine's examples (one process for all of them), of `size`
    (device pages, host pages, whether each engine is a tenant of its own: engineN, with
    the token engineN-token; QUOTAS: with quotas too; PRIVATE: engine0 shares no prefix
    blocks, `kvd.private`); it must be alive when they end.
    `pool_extra`: more lines for its pool's table. `slice_blocks`: the blocks a slice of
    a big call handles (kvd's default when None)."""
    device, host, tenants = size
    config = MACHINE_CONFIG.format(page_bytes=page_bytes, block_tokens=block_tokens,
                                   device=device, host=host) + pool_extra
    if slice_blocks is not None:
        config = config.replace("[server]\n", f"[server]\nslice_blocks = {slice_blocks}\n", 1)
    if tenants:
        quotas = (_quotas(device) if tenants == QUOTAS else
                  {0: "share_prefixes = false\n"} if tenants == PRIVATE else {})
        config += "".join(f'\n[[tenant]]\nname = "engine{i}"\ntoken = "engine{i}-token"\n'
                          + quotas.get(i, "") for i in range(engines))
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "kvd.toml").write_text(config)
    with LocalKvd("--config", str(tmp / "kvd.toml"), workdir=tmp) as kvd:
        kvd.tenants = tenants
        kvd.private = {"engine0"} if tenants == PRIVATE else set()
        kvd.device = device
        yield kvd
        assert kvd.proc.poll() is None, f"kvd died:\n{kvd.log()}"


def on_live_daemons(examples: int) -> settings:
    """Hypothesis settings for examples run against daemons that live on across them: no
    shrinking and no database (a replay is not the same run, so the failing example is
    reported as generated), no deadline."""
    return settings(max_examples=examples, deadline=None, database=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck))


async def done_with_pages(clients) -> None:
    """Each client says it is done with the pages its calls were handed (KeepAlive ends its
    holds), as an engine's next call does: the pages of a request that another client
    released stay out of use until then."""
    for c in clients:
        await c.keep_alive(timeout_s=10)


def engine_clients(kvd, n: int, timeout_s: float) -> list[AsyncClient]:
    """Clients for a machine_kvd's n engines: each its own tenant (by its token) where the
    kvd has a tenant per engine, else all the unix socket's."""
    return [AsyncClient(kvd.target, timeout_s=timeout_s,
                        token=f"engine{i}-token" if kvd.tenants else None) for i in range(n)]


def size_id(size: tuple[int, int, bool | str]) -> str:
    """A machine's (device pages, host pages, a tenant per engine or QUOTAS) as a test id."""
    device, host, tenants = size
    kind = (f"-{tenants}" if tenants in (QUOTAS, PRIVATE) else "-tenants" if tenants
            else "")
    return f"device{device}-host{host}{kind}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> tuple[str, dict]:
    """A kvd's /metrics: the text, and each sample's value by (name, sorted labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return text, samples


def slow_link_kvd(tmp_path, *args: str, bandwidth: str = "64KiB/s",
                  server: str = "") -> LocalKvd:
    """A kvd (not started) whose device<->host link moves 8 pages (64 KiB) a second: a read
    of 8 blocks off the device waits a second on it. `bandwidth`: another link speed;
    `server`: [server] keys (TOML lines)."""
    config = tmp_path / "slow-link.toml"
    config.write_text((f"[server]\n{server}" if server else "")
                      + '[[pool]]\nname = "default"\npage_bytes = 8192\ndevice_pages = 8\n'
                      'host_pages = 32\nadmission = "reservation"\n'
                      f'link_bandwidth = "{bandwidth}"\nlink_burst = 8192\nlink_chunk = 8192\n')
    return LocalKvd("--config", str(config), *args, workdir=tmp_path)


async def start_slow_read(client, stream) -> asyncio.Future:
    """On a slow_link_kvd: request "r" (admitted here) gets 8 blocks twice, so its first 8 go
    to the host; then a read of them, which kvd serves for a second (the link). Returns the
    read's future; kvd is serving it from about 0.2 s on."""
    await client.admit("r", 64)
    await stream.step(allocations=[("r", 8)])
    await stream.step(allocations=[("r", 8)])
    return asyncio.ensure_future(stream.step(accesses=[("r", list(range(8)))]))


# The tests on it drive demotions and promotions: requests over-subscribe the device tier,
# which working-set admission would queue (it has tests of its own).
SMALL = ("--model", "tiny", "--block-tokens", "16", "--device-pages", "8", "--host-pages", "32",
         "--admission", "reservation")


@contextlib.contextmanager
def answered_as(client: AsyncClient, method: str, fault: str):
    """The client's next call of `method` goes as `fault` says: "none" (answered),
    "undelivered" (UNAVAILABLE: kvd never got it), "lost" (kvd did it, and its answer was
    lost: DEADLINE_EXCEEDED), or cancelled by its caller while it waited (a timeout around
    it): "cut" after kvd did it, "cut early" before kvd got it."""
    if fault == "none":
        yield
        return
    real = getattr(client, method)

    async def unanswered(*args, **kwargs):
        setattr(client, method, real)  # the next call goes through
        if fault in ("lost", "cut"):
            await real(*args, **kwargs)
            if fault == "cut":
                raise asyncio.CancelledError()
            raise DeadlineExceededError("the answer was lost")
        if fault == "cut early":
            raise asyncio.CancelledError()
        raise UnavailableError("kvd did not get the call")

    setattr(client, method, unanswered)
    try:
        yield
    finally:
        vars(client).pop(method, None)


@pytest.fixture
def kvd(tmp_path):
    """A running kvd with 8 device and 32 host pages of 16 KiB."""
    with LocalKvd(*SMALL, workdir=tmp_path) as proc:
        yield proc
        assert proc.proc.poll() is None, f"kvd died during the test:\n{proc.log()}"


@pytest.fixture
async def client(kvd):
    async with AsyncClient(kvd.target, timeout_s=10) as c:
        yield c
    # Every test leaves a consistent daemon behind.
    async with AsyncClient(kvd.target, timeout_s=10) as c:
        check = await c.self_check()
        assert check.ok, list(check.problems)


async def reload_config(kvd: LocalKvd, path, text: str, landed: str) -> None:
    """Write the config file at `path`, SIGHUP kvd, and wait for the log line that says how
    the reload went ("config reloaded", "reload failed")."""
    seen = kvd.log().count(landed)
    path.write_text(text)
    kvd.proc.send_signal(signal.SIGHUP)
    for _ in range(200):
        if kvd.log().count(landed) > seen:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {landed!r} in kvd's log after SIGHUP:\n{kvd.log()[-3000:]}")
