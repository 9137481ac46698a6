"""Tenants over real gRPC: identity, isolation, quotas at run time, SIGHUP, WaitAdmission,
Explain."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvd_client import (
    AlreadyExistsError,
    AsyncClient,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    pb,
)
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

from .conftest import TOKENS_ONLY, free_port, reload_config, scrape

CONFIG = """
[server]
grace_s = 2
allow_plaintext_tokens = true  # TLS has tests of its own
{tcp}
""" + TOKENS_ONLY + """
[[pool]]
name = "default"
model = "tiny"
device_pages = 8
host_pages = 32
policy = "{policy}"
admission = "reservation"

[[tenant]]
name = "alpha"
token = "alpha-token"

[[tenant]]
name = "beta"
token_file = "beta.token"
"""


@pytest.fixture
def tenants_kvd(tmp_path):
    port = free_port()
    (tmp_path / "beta.token").write_text("beta-token\n")
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(tcp=f'tcp = "127.0.0.1:{port}"', policy="lru"))
    with LocalKvd("--config", str(config), workdir=tmp_path, env={"KVD_TOKEN": "root-token"}
                  ) as kvd:
        kvd.port = port
        kvd.config = config
        yield kvd


async def test_tenants_see_and_touch_only_their_own_requests(tenants_kvd):
    target = tenants_kvd.target
    async with AsyncClient(target, token="alpha-token") as alpha, \
            AsyncClient(target, token="beta-token") as beta:
        assert (await alpha.admit("a1", 32)).decision == pb.DECISION_ADMITTED
        await alpha.allocate("a1", 2)
        for call in (lambda: beta.access("a1"), lambda: beta.release("a1"),
                     lambda: beta.explain("a1"), lambda: beta.allocate("a1", 1),
                     lambda: beta.free("a1", [0])):
            with pytest.raises(NotFoundError, match="'a1'"):
                await call()  # the answer for an id nobody holds: nothing to learn
        with pytest.raises(NotFoundError) as missing:
            await beta.access("nobody-has-this")
        assert "no request 'nobody-has-this'; admit it first" in missing.value.details
        with pytest.raises(PermissionDeniedError, match="cannot admit for 'alpha'"):
            await beta.admit("b-as-a", 16, tenant="alpha")
        with pytest.raises(PermissionDeniedError, match="admin identity"):
            await alpha.list_tenants()
        with pytest.raises(PermissionDeniedError, match="admin identity"):
            await alpha.evict(1)
        # On the Step stream too: the foreign item errors, the rest of the step happens.
        await beta.admit("b1", 16)
        async with beta.step_stream() as stream:
            reply = await stream.step(allocations=[("b1", 1)], read_all=["a1", "b1"])
        assert [(e.section, e.code) for e in reply.errors] == [("read_all", 5)]
        assert len(reply.allocated) == 1
        assert (await alpha.explain("a1")).tenant == "alpha"


async def test_callers_without_identity_are_refused(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="") as anonymous:
        with pytest.raises(UnauthenticatedError, match="bearer token on the unix socket"):
            await anonymous.admit("x", 16)
    async with AsyncClient(f"127.0.0.1:{tenants_kvd.port}", token="") as tcp:
        with pytest.raises(UnauthenticatedError, match="TCP callers must present"):
            await tcp.pool_stats()
    async with AsyncClient(f"127.0.0.1:{tenants_kvd.port}", token="nope") as wrong:
        with pytest.raises(UnauthenticatedError, match="unknown bearer token"):
            await wrong.pool_stats()
    async with AsyncClient(f"127.0.0.1:{tenants_kvd.port}", token="alpha-token") as alpha:
        assert (await alpha.admit("ok", 16)).decision == pb.DECISION_ADMITTED
    assert "alpha-token" not in tenants_kvd.log() and "root-token" not in tenants_kvd.log()


async def test_quota_change_at_run_time_takes_effect(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="root-token") as admin, \
            AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        (info,) = await admin.set_quota("alpha", limit_pages=2)
        assert info.limit_pages == 2
        rejected = await alpha.admit("big", 16 * 3)
        assert rejected.decision == pb.DECISION_REJECTED and "limit of 2" in rejected.reason
        assert (await alpha.admit("small", 32)).decision == pb.DECISION_ADMITTED
        queued = await alpha.admit("more", 16)
        assert queued.decision == pb.DECISION_QUEUED and "2-page limit" in queued.reason
        (info,) = await admin.set_quota("alpha", limit_pages=0, weight=3)  # no limit now
        assert (info.limit_pages, info.weight, info.reserved_pages) == (0, 3.0, 3)


async def test_a_tenant_pinning_all_it_may_leaves_anothers_guarantee_free(tenants_kvd):
    # beta is guaranteed 3 of the 8 device pages and uses none: alpha may hold all 8, but
    # pin only 5. beta then comes, is admitted, and gets its 3 pages while alpha's pins hold.
    target = tenants_kvd.target
    async with AsyncClient(target, token="root-token") as admin, \
            AsyncClient(target, token="alpha-token") as alpha, \
            AsyncClient(target, token="beta-token") as beta:
        await admin.set_quota("beta", guaranteed_pages=3)
        assert (await alpha.admit("a1", 16 * 8)).decision == pb.DECISION_ADMITTED
        await alpha.allocate("a1", 8)

        def pins(indices):
            return [pb.IntentUpdate(request_id="a1", block_index=i,
                                    intent=pb.MemoryIntent(pin_requested=True))
                    for i in indices]

        with pytest.raises(ResourceExhaustedError) as refused:
            await alpha.update_intents(pins(range(6)))
        assert ("pinning 6 more block(s) of tenant 'alpha' would take device pages of pool "
                "'default' guaranteed to other tenants") in refused.value.details
        await alpha.update_intents(pins(range(5)))
        assert (await beta.admit("b1", 16 * 3)).decision == pb.DECISION_ADMITTED
        assert len((await beta.allocate("b1", 3)).handles) == 3
        tenants = {t.tenant: t for t in await admin.list_tenants()}
        assert (tenants["alpha"].pinned_pages, tenants["alpha"].device_pages) == (5, 5)
        assert tenants["beta"].device_pages == 3


async def test_sighup_reloads_tenants_without_dropping_state(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        await alpha.admit("kept", 16)
        await alpha.allocate("kept", 1)
    config = tenants_kvd.config.read_text() + '\n[[tenant]]\nname = "gamma"\ntoken = "g-token"\n'
    tenants_kvd.config.write_text(config.replace('name = "alpha"', 'name = "alpha"\nweight = 4'))
    tenants_kvd.proc.send_signal(signal.SIGHUP)
    async with AsyncClient(tenants_kvd.target, token="g-token") as gamma:
        for _ in range(100):
            try:
                assert (await gamma.admit("g1", 16)).decision == pb.DECISION_ADMITTED
                break
            except UnauthenticatedError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the new tenant's token was not accepted after SIGHUP")
    async with AsyncClient(tenants_kvd.target, token="root-token") as admin:
        weights = {t.tenant: t.weight for t in await admin.list_tenants()}
        assert weights["alpha"] == 4 and weights["gamma"] == 1
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        assert len((await alpha.access("kept")).handles) == 1  # state survived the reload


async def test_a_reload_of_a_file_cut_short_lets_no_token_less_caller_in(tenants_kvd):
    # Written halfway (an editor's save, a deploy tool's copy) when the SIGHUP came: the
    # [auth] section that locks the unix socket down is not there yet.
    full = tenants_kvd.config.read_text()
    await reload_config(tenants_kvd, tenants_kvd.config, full[:full.index("[auth]")],
                        "config reloaded")
    assert "auth.unix_admin" in tenants_kvd.log() and "auth.unix_tenant" in tenants_kvd.log()
    async with AsyncClient(tenants_kvd.target) as anyone:
        with pytest.raises(UnauthenticatedError):
            await anyone.list_tenants()
        with pytest.raises(UnauthenticatedError):
            await anyone.admit("mine", 16)
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        with pytest.raises(UnauthenticatedError):  # the file names no tenant: as it says
            await alpha.admit("a0", 16)
    # Written whole: as before.
    await reload_config(tenants_kvd, tenants_kvd.config, full, "config reloaded")
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        assert (await alpha.admit("a1", 16)).decision == pb.DECISION_ADMITTED


async def test_a_reload_of_an_empty_file_changes_nothing(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        await alpha.admit("kept", 16)
    await reload_config(tenants_kvd, tenants_kvd.config, "# being written\n", "reload failed")
    assert "sets nothing" in tenants_kvd.log()
    async with AsyncClient(tenants_kvd.target) as anyone:
        with pytest.raises(UnauthenticatedError):
            await anyone.list_tenants()
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        assert len((await alpha.allocate("kept", 1)).handles) == 1
    async with AsyncClient(tenants_kvd.target, token="root-token") as admin:
        assert {t.tenant for t in await admin.list_tenants()} >= {"alpha", "beta"}


def test_a_reload_widens_no_unix_access_and_narrows_any():
    from kvd.config import AuthConfig
    from kvd.daemon import widened_auth

    closed = AuthConfig(unix_tenant="", unix_admin=False)
    tenant = AuthConfig(unix_tenant="default", unix_admin=False)
    admin = AuthConfig(unix_tenant="", unix_admin=True)
    assert widened_auth(closed, AuthConfig()) == ["unix_tenant", "unix_admin"]
    assert widened_auth(closed, tenant) == ["unix_tenant"]
    assert widened_auth(tenant, AuthConfig()) == ["unix_admin"]
    assert widened_auth(tenant, AuthConfig(unix_tenant="other", unix_admin=False)) == []
    assert widened_auth(admin, tenant) == []  # from the admin to a tenant: less
    assert widened_auth(AuthConfig(), closed) == []


@contextlib.asynccontextmanager
async def _watching(client: AsyncClient, kinds: list[str]):
    """The events of these kinds the client's watcher gets while inside (subscribed before
    the body runs)."""
    seen: list = []

    subscribed = asyncio.Event()

    async def watch():
        async for event in client.watch_events(kinds=kinds, on_subscribed=subscribed.set):
            seen.append(event)

    watcher = asyncio.ensure_future(watch())
    await asyncio.wait_for(subscribed.wait(), 10)
    try:
        yield seen
    finally:
        watcher.cancel()


async def _until(done, tries: int) -> None:
    """Wait for done() at most `tries` times 20 ms (the machine may be busy)."""
    for _ in range(tries):
        if done():
            return
        await asyncio.sleep(0.02)


async def _watched_waiter(alpha: AsyncClient) -> tuple[list, asyncio.Task]:
    """alpha fills 32 of the pool's 39 reservable pages (8 device + 32 host - 1 headroom) and
    queues "waiter" for 8 more: its WaitAdmission updates as they come, and the task that
    reads them (the first, QUEUED, already in)."""
    for i in range(4):
        await alpha.admit(f"fill{i}", 16 * 8)
    assert (await alpha.admit("waiter", 16 * 8)).decision == pb.DECISION_QUEUED
    updates = []

    async def wait():
        async for update in alpha.wait_admission("waiter"):
            updates.append(update)

    task = asyncio.ensure_future(wait())
    await _until(lambda: updates, 500)
    assert [u.decision for u in updates] == [pb.DECISION_QUEUED]
    return updates, task


async def test_wait_admission_streams_until_memory_frees(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        updates, task = await _watched_waiter(alpha)
        await alpha.release("fill0")
        await asyncio.wait_for(task, 10)
        assert updates[-1].decision == pb.DECISION_ADMITTED
        assert len((await alpha.allocate("waiter", 1)).handles) == 1


async def test_a_queued_request_a_lowered_limit_shuts_out_is_told_it_is_rejected(tenants_kvd):
    """alpha's request waits for room; the operator lowers alpha's limit below it. It can
    never be admitted now: its WaitAdmission stream says REJECTED and why, and the id is
    alpha's to use again."""
    target = tenants_kvd.target
    async with AsyncClient(target, token="root-token") as admin, \
            AsyncClient(target, token="alpha-token") as alpha:
        updates, task = await _watched_waiter(alpha)
        await admin.set_quota("alpha", limit_pages=40)  # nothing changes: it still fits
        await asyncio.sleep(0.1)
        assert [u.decision for u in updates] == [pb.DECISION_QUEUED]
        await admin.set_quota("alpha", limit_pages=6)
        await asyncio.wait_for(task, 10)
        assert updates[-1].decision == pb.DECISION_REJECTED
        assert "over tenant 'alpha''s limit of 6 pages" in updates[-1].reason
        assert not (await alpha.explain("waiter")).active  # gone from the pool
        again = await alpha.admit("waiter", 16 * 2)  # the id is free: it waits anew
        assert again.decision == pb.DECISION_QUEUED and "its own requests" in again.reason
        assert (await admin.self_check()).ok


async def test_cancelling_the_wait_withdraws_the_request(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        for i in range(4):
            await alpha.admit(f"fill{i}", 16 * 8)
        assert (await alpha.admit("impatient", 16 * 8)).decision == pb.DECISION_QUEUED
        async with AsyncClient(tenants_kvd.target, token="beta-token") as beta:
            with pytest.raises(NotFoundError):  # and does not withdraw alpha's request
                async for _ in beta.wait_admission("impatient"):
                    pass
        assert (await alpha.explain("impatient")).active
        stream = alpha.wait_admission("impatient")
        first = await stream.__anext__()
        assert first.queue_position == 1
        await stream.aclose()  # the client gives up
        for _ in range(200):  # the server sees the cancellation asynchronously
            try:
                account_active = (await alpha.explain("impatient")).active
            except NotFoundError:
                account_active = False
            if not account_active:
                break
            await asyncio.sleep(0.05)
        assert not account_active
        with pytest.raises(NotFoundError):
            await alpha.release("impatient")


async def test_explain_names_the_whale_as_the_cause_of_a_minnows_stall(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as whale, \
            AsyncClient(tenants_kvd.target, token="beta-token") as minnow:
        await minnow.admit("minnow", 32)
        await minnow.allocate("minnow", 2)
        await whale.admit("whale", 16 * 8)
        await whale.allocate("whale", 8)  # LRU pushes the minnow out
        access = await minnow.access("minnow")
        assert access.num_promoted == 2 and access.stall_us > 0
        why = await minnow.explain("minnow")
        assert why.stall_seconds > 0 and why.num_stalls == 1
        top = why.stalls_by_cause[0]  # the minnow's tenant sees the whale's tenant only
        assert (top.cause.tenant, top.cause.request_id) == ("alpha", "")
        assert top.stall_seconds == pytest.approx(why.stall_seconds)
        (suffered,) = why.evictions_suffered
        assert (suffered.other.tenant, suffered.count) == ("alpha", 2)
        caused = await whale.explain("whale")
        assert {(e.other.tenant, e.count) for e in caused.evictions_caused} >= {("beta", 2)}
    async with AsyncClient(tenants_kvd.target, token="root-token") as admin:
        top = (await admin.explain("beta/minnow")).stalls_by_cause[0]  # the admin sees all
        assert (top.cause.tenant, top.cause.request_id) == ("alpha", "alpha/whale")
    async with AsyncClient(tenants_kvd.target, token="root-token") as admin:
        beta = next(t for t in await admin.list_tenants() if t.tenant == "beta")
        assert beta.evictions_suffered == 2
        assert beta.stalls_by_cause[0].cause_tenant == "alpha"


def test_overcommitted_guarantees_are_scaled_and_said(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text('[[pool]]\nmodel = "tiny"\ndevice_pages = 8\nhost_pages = 8\n\n'
                      '[[tenant]]\nname = "a"\nguaranteed = 6\n\n'
                      '[[tenant]]\nname = "b"\nguaranteed = 10\n')
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        from kvd_client import Client

        with Client(kvd.target, lease="") as client:
            client.admit("ra", 16 * 8, tenant="a")
            client.admit("rb", 16 * 8, tenant="b")
            shares = {t.tenant: t.fair_share_pages for t in client.list_tenants()}
    assert '"guarantees overcommitted: scaled down proportionally"' in kvd.log()
    assert '"guaranteed_pages": 16' in kvd.log()
    # 16 pages promised on 7 shareable (8 less the fair reserve is not taken under lru):
    # a and b get 6/16 and 10/16 of the device tier as floors.
    assert shares["a"] == pytest.approx(8 * 6 / 16) and shares["b"] == pytest.approx(8 * 10 / 16)


async def test_a_revoked_token_stops_working_on_open_streams(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="beta-token") as beta:
        await beta.admit("b1", 16)
        async with beta.step_stream() as stream:
            await stream.step(allocations=[("b1", 1)])
            (tenants_kvd.config.parent / "beta.token").write_text("beta-token-2\n")
            tenants_kvd.proc.send_signal(signal.SIGHUP)
            for _ in range(100):  # the reload lands; the next message is refused
                try:
                    await stream.step(read_all=["b1"])
                except UnauthenticatedError as exc:
                    assert "unknown bearer token" in exc.details
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a revoked token kept working on an open Step stream")


async def test_a_lease_belongs_to_its_tenant(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(tcp="lease_ttl_s = 0.5", policy="lru"))
    (tmp_path / "beta.token").write_text("beta-token\n")
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, token="alpha-token", lease="shared") as alpha:
            await alpha.admit("a1", 16)
        # Beta names alpha's lease id and keeps calling: alpha's lease still lapses.
        async with AsyncClient(kvd.target, token="beta-token", lease="shared") as beta, \
                AsyncClient(kvd.target, token="root-token") as admin:
            for _ in range(30):
                await beta.keep_alive()
                await asyncio.sleep(0.05)
            assert not [r for r in await admin.list_requests() if r.request_id == "alpha/a1"]


async def test_other_tenants_request_ids_are_not_shown(tenants_kvd):
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha, \
            AsyncClient(tenants_kvd.target, token="beta-token") as beta, \
            AsyncClient(tenants_kvd.target, token="root-token") as admin:
        async with _watching(alpha, ["eviction"]) as seen:
            await alpha.admit("a1", 16 * 8)
            await alpha.allocate("a1", 8)
            await alpha.keep_alive()  # done writing: its pages may be taken
            await beta.admit("secret-b1", 16 * 8)
            await beta.allocate("secret-b1", 8)  # pushes alpha's blocks to host
            await _until(lambda: seen, 100)
        assert seen and seen[0].detail["cause_tenant"] == "beta"
        assert seen[0].detail["cause_request"] == ""
        mine = await alpha.explain("a1")
        assert [(c.other.tenant, c.other.request_id) for c in mine.evictions_suffered] == [
            ("beta", "")]
        full = await admin.explain("alpha/a1")  # the admin names a tenant's requests whole
        assert [(c.other.tenant, c.other.request_id) for c in full.evictions_suffered] == [
            ("beta", "beta/secret-b1")]


async def test_each_tenant_names_its_requests_in_a_namespace_of_its_own(tenants_kvd):
    """Whether another tenant uses an id is not a tenant's to learn: the same id admitted by
    two tenants is two requests (no ALREADY_EXISTS to tell one of the other's), each seen
    by its own tenant under the id it gave, in handles, events and errors alike."""
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha, \
            AsyncClient(tenants_kvd.target, token="beta-token") as beta, \
            AsyncClient(tenants_kvd.target, token="root-token") as admin:
        async with _watching(beta, ["admission", "allocation"]) as seen:
            assert (await alpha.admit("same", 32)).decision == pb.DECISION_ADMITTED
            assert (await beta.admit("same", 32)).decision == pb.DECISION_ADMITTED
            with pytest.raises(AlreadyExistsError, match="'same'") as again:
                await beta.admit("same", 32)  # its own id twice is still refused
            assert "beta/" not in again.value.details
            a = await alpha.allocate("same", 2)
            b = await beta.allocate("same", 1)
            assert [h.request_id for h in [*a.handles, *b.handles]] == ["same"] * 3
            assert len((await alpha.access("same")).handles) == 2
            assert len((await beta.access("same")).handles) == 1
            async with beta.step_stream() as stream:
                reply = await stream.step(allocations=[("same", 1)], read_all=["same", "nope"])
            assert [h.request_id for h in reply.allocated] == ["same"]
            assert [(e.section, e.item_index) for e in reply.errors] == [("read_all", 1)]
            assert "'nope'" in reply.errors[0].message and "beta/" not in reply.errors[0].message
            assert (await beta.explain("same")).request_id == "same"
            listed = await admin.list_requests()
            assert sorted((r.tenant, r.request_id) for r in listed) == [
                ("alpha", "alpha/same"), ("beta", "beta/same")]
            await beta.release("same")
            assert len((await alpha.access("same")).handles) == 2  # alpha's is untouched
            await _until(lambda: len(seen) >= 3, 100)
        assert {(e.tenant, e.request_id) for e in seen} == {("beta", "same")}


async def test_a_pool_restricted_to_tenants_refuses_the_others(tmp_path):
    config = tmp_path / "kvd.toml"
    (tmp_path / "beta.token").write_text("beta-token\n")
    config.write_text(CONFIG.format(tcp="", policy="lru") + (
        '\n[[pool]]\nname = "private"\nmodel = "tiny"\ndevice_pages = 4\nhost_pages = 4\n'
        'tenants = ["alpha"]\n'))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, token="alpha-token") as alpha, \
                AsyncClient(kvd.target, token="beta-token") as beta, \
                AsyncClient(kvd.target, token="root-token") as admin:
            assert (await alpha.admit("a", 16, pool="private")).decision == pb.DECISION_ADMITTED
            assert (await alpha.export_pool("private")).tiers
            await alpha.store("a", "ns", [b"k"])
            await alpha.commit("a", "ns", [b"k"])
            assert (await alpha.lookup("ns", [b"k"], pool="private")).num_hit == 1
            # An engine with the admin identity serves the pool's tenants: it admitted,
            # stored and exported there, but its lookups were refused as tenant 'default'.
            assert (await admin.lookup("ns", [b"k"], pool="private")).num_hit == 1
            with pytest.raises(PermissionDeniedError, match="not open to tenant 'beta'"):
                await beta.lookup("ns", [b"k"], pool="private")
            # Nor may the admin put a request of a tenant in a pool not open to it (it could
            # hand one there, though Admit refused it the same).
            assert (await admin.admit("b", 16, tenant="beta")).decision == pb.DECISION_ADMITTED
            await admin.allocate("b", 1)
            with pytest.raises(PermissionDeniedError, match="not open to tenant 'beta'"):
                async for _ in admin.handoff("b", target_pool="private"):
                    pass
            assert [r.pool for r in await admin.list_requests() if r.request_id == "b"] == [
                "default"]
            with pytest.raises(PermissionDeniedError, match="not open to tenant 'beta'"):
                await beta.admit("b", 16, pool="private")
            with pytest.raises(PermissionDeniedError, match="not open to tenant 'beta'"):
                await beta.export_pool("private")
            with pytest.raises(PermissionDeniedError):
                await beta.admit("b", 16, handoff_pool="private")
            assert (await beta.export_pool("default")).tiers  # shared pools stay open


async def test_a_tenant_cannot_open_watchers_and_waiters_without_bound(tenants_kvd):
    from kvd_client import ResourceExhaustedError

    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha:
        for i in range(4):  # fill the pool: the next one queues
            await alpha.admit(f"fill{i}", 16 * 8)
        assert (await alpha.admit("q", 16 * 8)).decision == pb.DECISION_QUEUED
        waits = [alpha.wait_admission("q") for _ in range(8)]
        for w in waits:
            assert (await w.__anext__()).decision == pb.DECISION_QUEUED
        with pytest.raises(ResourceExhaustedError, match="at most 8"):
            await alpha.wait_admission("q").__anext__()
        subscribed: list[int] = []
        watchers = [alpha.watch_events(on_subscribed=lambda: subscribed.append(1))
                    for _ in range(16)]
        pending = [asyncio.ensure_future(w.__anext__()) for w in watchers]
        await _until(lambda: len(subscribed) == 16, 500)
        with pytest.raises(ResourceExhaustedError, match="16 event watchers"):
            await alpha.watch_events().__anext__()
        for p in pending:
            p.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for w in waits:
            await w.aclose()


def test_a_tenant_filling_the_queue_with_whales_leaves_every_listing_readable(tmp_path):
    """Each queued request fits the device, but 1,024 of them near its size ask for more
    than 2**32 pages: the tenant's queued_pages overflowed its uint32 field, and every
    ListTenants (and GetCluster's node totals) failed for everyone while they waited."""
    import grpc

    from kvd_api.v1 import kvd_pb2 as pb
    from kvd_api.v1 import kvd_pb2_grpc as pb_grpc

    pages = 2**22 + 200  # one-byte pages: 4 MiB of shared memory a tier
    whale = pages - 50
    with LocalKvd("--device-pages", str(pages), "--host-pages", str(pages), "--page-bytes",
                  "1", "--block-tokens", "16", workdir=tmp_path) as kvd:
        channel = grpc.insecure_channel(kvd.target)
        memory, admin = pb_grpc.MemoryStub(channel), pb_grpc.AdminStub(channel)
        queued = 0
        for i in range(1025):
            reply = memory.Admit(pb.AdmitRequest(request_id=f"w{i}", tenant="whales",
                                                 prompt_tokens=whale * 16), timeout=10)
            queued += reply.decision == pb.DECISION_QUEUED
        assert queued == 1024
        [info] = [t for t in admin.ListTenants(pb.ListTenantsRequest(), timeout=10).tenants
                  if t.tenant == "whales"]
        assert info.queued_pages == 1024 * whale > 2**32
        assert memory.GetPoolStats(pb.GetPoolStatsRequest(), timeout=10).pools[0].num_queued \
            == 1024
        channel.close()


async def test_tenants_that_came_and_went_leave_no_trace_in_listings_or_metrics(tmp_path):
    """Tenants named by callers (an engine passing each customer's name) come and go: once a
    tenant holds, reserves and queues nothing, ListTenants and /metrics no longer carry it,
    and a configured tenant stays listed all the same."""
    config = tmp_path / "kvd.toml"
    config.write_text('[[pool]]\nmodel = "tiny"\ndevice_pages = 16\nhost_pages = 16\n'
                      '[[tenant]]\nname = "configured"\nweight = 2\n')
    port = free_port()
    with LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}",
                  workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as c:
            await c.admit("live", 32, tenant="live")
            await c.allocate("live", 2)
            for i in range(30):
                await c.admit(f"r{i}", 32, tenant=f"customer-{i}")
                await c.allocate(f"r{i}", 2)
                await c.access(f"r{i}")
                await c.release(f"r{i}")
            listed = {t.tenant for t in await c.list_tenants()}
        text, _ = scrape(port)
    assert listed == {"live", "configured"}
    assert "customer-" not in text
    assert 'tenant="live"' in text


@pytest.mark.parametrize("policy", ["lru", "fair"])
async def test_a_guarantee_admits_its_tenant_while_anothers_working_sets_fill_the_device(
        tmp_path, policy):
    """beta is guaranteed 4 of the 8 device pages and runs nothing; alpha's working sets
    take 7 of them meanwhile. beta's request of 3 pages is within its guarantee: it is
    admitted at once (not queued until alpha's requests end) and gets its pages from
    alpha's, whose bytes come back intact from the host tier."""
    (tmp_path / "beta.token").write_text("beta-token\n")
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(tcp="", policy=policy)
                      .replace('admission = "reservation"', 'admission = "working_set"'))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, token="root-token") as admin, \
                AsyncClient(kvd.target, token="alpha-token") as alpha, \
                AsyncClient(kvd.target, token="beta-token") as beta:
            await admin.set_quota("beta", guaranteed_pages=4)
            mapped = MappedPool(await alpha.export_pool())
            rng = np.random.default_rng(7)
            written = {}

            async def fill(client, rid, num):
                for h in (await client.allocate(rid, num)).handles:
                    data = rng.integers(0, 256, mapped.page_bytes, dtype=np.uint8)
                    mapped.write(h, data)
                    written[(rid, h.block_index)] = data

            for rid, num in (("a0", 4), ("a1", 3)):
                assert (await alpha.admit(rid, 16 * num)).decision == pb.DECISION_ADMITTED
                await fill(alpha, rid, num)
            admitted = await beta.admit("b1", 16 * 3)
            assert admitted.decision == pb.DECISION_ADMITTED, admitted.reason
            await fill(beta, "b1", 3)
            tenants = {t.tenant: t for t in await admin.list_tenants()}
            assert tenants["beta"].device_pages == 3
            assert tenants["alpha"].device_pages <= 8 - 3  # the rest went to the host
            for client, rid in ((alpha, "a0"), (alpha, "a1"), (beta, "b1")):
                for h in (await client.access(rid)).handles:
                    assert np.array_equal(mapped.read(h), written[(rid, h.block_index)])
            assert (await admin.self_check()).ok


async def test_an_evict_the_guarantees_refuse_is_refused_at_once_while_an_engine_holds_pages(
        tmp_path):
    """The operator evicts 2 pages: the 2 the policy holds are beta's, within its guarantee
    of 2, and alpha's step holds a third until alpha's next message (its hold lapses only
    after 30 s). The evict is refused then and there, saying why: alpha may be waiting for
    it before it steps again (a kvctl call in the engine's own loop), and the page alpha
    holds is no victim until then."""
    (tmp_path / "beta.token").write_text("beta-token\n")
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(tcp="hold_s = 30", policy="fair")
                      .replace("device_pages = 8", "device_pages = 4"))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, token="root-token", timeout_s=5) as admin, \
                AsyncClient(kvd.target, token="alpha-token") as alpha, \
                AsyncClient(kvd.target, token="beta-token") as beta:
            await admin.set_quota("beta", guaranteed_pages=2)
            await beta.admit("b1", 32)
            await beta.allocate("b1", 2)
            await beta.keep_alive()  # done writing: its pages are evictable
            await alpha.admit("a1", 16)
            async with alpha.step_stream() as stream:
                reply = await stream.step(allocations=[("a1", 1)])
                assert len(reply.allocated) == 1  # alpha's until its next message
                with pytest.raises(ResourceExhaustedError) as refused:
                    await admin.evict(2)
                assert ("cannot evict 2 device page(s) now: 2 evictable, but the policy "
                        "keeps each tenant's pages within its guarantee (device pages: "
                        "beta: 2 of 2 guaranteed); 1 held by engines") in refused.value.details
                reply = await stream.step(read_all=["a1"])
                assert not reply.errors
            (evicted,) = (await admin.evict(1)).evicted  # alpha's, no longer held
            assert evicted.request_id == "alpha/a1"
            assert (await admin.self_check()).ok


async def test_kept_prefix_blocks_are_no_request_of_the_tenant_wherever_kvd_names_them(
        tenants_kvd):
    """A tenant's prefix blocks kept after its requests end belong to kvd's own record of
    them, whose id is internal. A tenant's watcher saw their eviction as one of its own
    requests', its id cut out of that record's ('\\0kept/alpha' less 'alpha/': 'alpha', the
    name of a request it had released); the admin saw the NUL-led id itself, in events, in
    Evict's reply and in Explain. They are now named by no request id, and events say
    `kept`."""
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha, \
            AsyncClient(tenants_kvd.target, token="beta-token") as beta, \
            AsyncClient(tenants_kvd.target, token="root-token") as admin:
        async with _watching(alpha, ["eviction"]) as by_alpha, \
                _watching(admin, ["eviction"]) as by_admin:
            for rid, keys in (("alpha", [b"k1", b"k2"]), ("again", [b"k3"])):
                await alpha.admit(rid, 32)
                await alpha.store(rid, "ns", keys)
                await alpha.commit(rid, "ns", keys)
                await alpha.release(rid)
            await admin.evict(1)  # one kept block, by the operator
            await beta.admit("big", 16 * 8)
            await beta.allocate("big", 8)  # the rest, by beta's request
            seen = {"alpha": by_alpha, "admin": by_admin}
            await _until(lambda: all(sum(e.count for e in events) >= 3  # both watchers
                                     for events in seen.values()), 500)
        for who, events in seen.items():
            assert sum(e.count for e in events) == 3, who
            assert [(e.tenant, e.request_id, e.detail["kept"]) for e in events] == [
                ("alpha", "", "prefix blocks")] * len(events), who
        for explain in (await beta.explain("big"), await admin.explain("beta/big")):
            assert [(x.other.tenant, x.other.request_id, x.count)
                    for x in explain.evictions_caused] == [("alpha", "", 2)]
        await beta.release("big")
        await alpha.admit("b", 32)
        await alpha.store("b", "ns", [b"k4"])
        await alpha.commit("b", "ns", [b"k4"])
        await alpha.release("b")
        evicted = (await admin.evict(1)).evicted
        assert [(e.request_id, e.block_index) for e in evicted] == [("", 0)]


async def test_a_tenants_watcher_sees_the_ids_the_admin_gave_its_requests_whole(tenants_kvd):
    """An engine with the admin identity admits requests for tenants under ids of its own
    choosing; the tenant's watcher had the tenant's namespace's length cut off each such
    id ('request-123' came as 'st-123'), as if every id of its requests began with it."""
    async with AsyncClient(tenants_kvd.target, token="alpha-token") as alpha, \
            AsyncClient(tenants_kvd.target, token="root-token") as admin:
        async with _watching(alpha, ["admission"]) as seen:
            await admin.admit("request-123", 16, tenant="alpha")
            await alpha.admit("mine", 16)
            await _until(lambda: len(seen) >= 2, 500)
        assert [e.request_id for e in seen] == ["request-123", "mine"]


# Weights as an operator may type them: in kvd's range, anywhere a double reaches, and the
# edges of both.
WEIGHTS = (st.floats(1e-6, 1e6) | st.floats(min_value=0, max_value=1e308, exclude_min=True)
           | st.sampled_from([5e-324, 1e-300, 1e-7, 1e-6, 1e-3, 1.0, 1e6, 1e7, 1e300, 1e308]))


@pytest.fixture
def fair_tenants_kvd(tmp_path):
    (tmp_path / "beta.token").write_text("beta-token\n")
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(tcp="", policy="fair"))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        yield kvd


async def test_an_allocation_the_fair_policy_refuses_says_whose_share_keeps_the_pages(
        fair_tenants_kvd):
    # Under fair, another tenant's pages go only down to its fair share: one allocation of
    # the whole device beside it is refused. The message said "8 evictable ... the rest in
    # transit", which names no reason: now it names the shares that keep the pages.
    target = fair_tenants_kvd.target
    async with AsyncClient(target, token="alpha-token") as alpha, \
            AsyncClient(target, token="beta-token") as beta, \
            AsyncClient(target, token="root-token") as admin:
        await beta.admit("b", 16 * 6)
        await beta.allocate("b", 6)
        await alpha.admit("a", 16 * 8)
        with pytest.raises(ResourceExhaustedError) as refused:
            await alpha.allocate("a", 8)
        assert "for tenant 'alpha'" in refused.value.details
        assert "fair share" in refused.value.details
        assert "'beta' holds 6, may keep 3.5" in refused.value.details
        assert "ask for fewer pages at once" in refused.value.details
        # Nothing was taken: alpha holds no page, beta keeps its six.
        held = {t.tenant: t.device_pages for t in await admin.list_tenants()}
        assert held == {"alpha": 0, "beta": 6}
        await alpha.allocate("a", 3)  # what its share and the free pages allow
        assert (await admin.self_check()).ok


@settings(max_examples=int(os.environ.get("KVD_WEIGHT_EXAMPLES", "12")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(weights=st.tuples(WEIGHTS, WEIGHTS),
       requests=st.lists(st.tuples(st.sampled_from(["alpha", "beta"]), st.integers(1, 8)),
                         min_size=1, max_size=8))
@example(weights=(1e308, 1e308), requests=[("alpha", 8), ("beta", 8), ("alpha", 8)])
@example(weights=(4096.0, 1e-6), requests=[("alpha", 1), ("beta", 7)])  # found by this test
def test_whatever_weights_kvd_takes_it_divides_the_device_by_and_serves(
        fair_tenants_kvd, weights, requests):
    """Two tenants' weights set at run time, from any a double can hold: kvd takes them or
    refuses them as invalid, and with those it took, the tenants' requests (more than the
    pool holds) are admitted, queued or refused as documented, their fair shares are
    numbers that add up to the device's pages they want, and kvd's bookkeeping stays
    sound. (Two weights of 1e308 made every Admit meeting a queue fail inside kvd: the
    queue's share of each came to infinity over infinity. Weights of 4096 and 1e-6 gave
    the second tenant a share 2e-6 pages short: see test_fairness.)"""
    asyncio.run(_weights_case(fair_tenants_kvd.target, weights, requests))


async def _weights_case(target: str, weights: tuple[float, float],
                        requests: list[tuple[str, int]]) -> None:
    async with AsyncClient(target, token="root-token") as admin, \
            AsyncClient(target, token="alpha-token") as alpha, \
            AsyncClient(target, token="beta-token") as beta:
        clients = {"alpha": alpha, "beta": beta}
        for tenant, weight in zip(clients, weights):
            await admin.set_quota(tenant, reset=True)
            try:
                (info,) = await admin.set_quota(tenant, weight=weight)
            except InvalidArgumentError as refused:
                assert "weight" in refused.details
            else:
                assert info.weight == weight
        held = []
        try:
            for i, (tenant, pages) in enumerate(requests):
                client, rid = clients[tenant], f"r{i}"
                try:
                    reply = await client.admit(rid, 16 * pages)
                except ResourceExhaustedError:
                    continue  # the tenant's share of the admission queue is taken
                if reply.decision != pb.DECISION_REJECTED:
                    held.append((client, rid))
                if reply.decision == pb.DECISION_ADMITTED:
                    with contextlib.suppress(ResourceExhaustedError):  # past its share
                        await client.allocate(rid, pages)
            capacity = (await admin.pool_stats()).pools[0].working_set_capacity_pages
            infos = await admin.list_tenants()
            shares = {t.tenant: t.fair_share_pages for t in infos}
            wanted = sum(t.reserved_pages + t.queued_pages for t in infos)
            assert all(math.isfinite(s) and s >= 0 for s in shares.values()), shares
            assert sum(shares.values()) == pytest.approx(min(capacity, wanted), abs=1e-6), (
                shares, wanted)
        finally:
            for client, rid in held:
                await client.release(rid)
        check = await admin.self_check()
        assert check.ok, list(check.problems)
