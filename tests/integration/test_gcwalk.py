"""Python's collector beside kvd's cache (kvd.gcwalk): what a long full collection kept is
set aside, a full walk frees what was set aside and became garbage since, and kvd's own
objects never wait for it (they go by reference counting)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from kvd.config import Config, PoolConfig, TenantConfig
from kvd.core.errors import KvdError
from kvd.gcwalk import Collections
from kvd.node import Node
from kvd.service.auth import Authenticator
from kvd.service.memory import MemoryService
from kvd_api.v1 import kvd_pb2 as pb
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL, free_port, scrape


class _Thing:
    """A container object the collector tracks."""

    def __init__(self) -> None:
        self.other = None


@pytest.fixture
def collections():
    made = Collections()
    yield made
    made.uninstall()
    gc.unfreeze()  # what the test set aside goes back to this process's collections


def _tracked(obj) -> bool:
    """Whether the collector's generations hold obj (set aside, they do not)."""
    return any(o is obj for o in gc.get_objects())


def test_a_long_full_collection_sets_what_it_kept_aside(collections):
    collections.install(set_aside_s=0.0)
    kept = [_Thing() for _ in range(100)]
    gc.collect()
    assert collections.set_asides == 1
    assert gc.get_freeze_count() >= len(kept)
    assert not _tracked(kept[0]), "later collections still walk what the long one kept"
    young = _Thing()
    assert _tracked(young)


def test_a_short_full_collection_sets_nothing_aside(collections):
    collections.install(set_aside_s=3600.0)
    before = gc.get_freeze_count()
    kept = _Thing()
    gc.collect()
    assert collections.set_asides == 0
    assert gc.get_freeze_count() == before
    assert _tracked(kept)


def test_a_cycle_set_aside_while_alive_is_freed_by_the_next_full_walk(collections):
    collections.install(set_aside_s=0.0)
    a, b = _Thing(), _Thing()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    gc.collect()  # a and b are alive: set aside
    del a, b
    gc.collect()
    assert gone() is not None, "a collection walked what was set aside"
    freed = collections.full_walk()
    assert gone() is None
    assert freed >= 2
    assert collections.full_walks == 1 and collections.full_walk_freed == freed
    assert collections.last_full_walk_s > 0


def test_uninstalled_no_collection_sets_anything_aside(collections):
    collections.install(set_aside_s=0.0)
    collections.uninstall()
    kept = _Thing()
    gc.collect()
    assert collections.set_asides == 0
    assert _tracked(kept)


class _Context:
    def __init__(self, token: str) -> None:
        self.token = token

    def invocation_metadata(self):
        return (("authorization", f"Bearer {self.token}"), ("kvd-lease", self.token))

    def peer(self) -> str:
        return "unix:test"

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def _kvds_own(objects) -> dict[str, int]:
    found: dict[str, int] = {}
    for o in objects:
        module = type(o).__module__ or ""
        if module.split(".")[0] in ("kvd", "kvd_api", "kvd_client"):
            name = f"{module}.{type(o).__qualname__}"
            found[name] = found.get(name, 0) + 1
    return found


@pytest.mark.parametrize("policy", ["lru", "intent", "regret"])
async def test_kvds_own_objects_leave_no_garbage_cycles(policy):
    """Requests allocated, read, freed and released; pages moved between tiers by the
    link's worker and inline; prefix blocks stored, committed, loaded; calls refused: what
    kvd let go of was freed by reference counting, nothing left in a cycle for the
    collector, which kvd's collections may not walk for minutes (set aside)."""
    page = 4096  # a copy of more than one page goes to the link's worker
    config = Config(socket="", tcp="127.0.0.1:0", slice_blocks=16, inline_copy_bytes=page,
                    pools=(PoolConfig(page_bytes=page, block_tokens=1, device_pages=64,
                                      host_pages=512, policy=policy, device_backend="host",
                                      admission="reservation"),),
                    tenants=(TenantConfig("a", token="ta"), TenantConfig("b", token="tb")))
    node = Node(config)
    service = MemoryService(node, Authenticator(node.config, node.leases))
    a, b = _Context("ta"), _Context("tb")
    gc.collect()
    gc.disable()
    try:
        for round_ in range(3):
            x, y = f"x{round_}", f"y{round_}"
            # What a call hands out is held for its holder until the holder's next call:
            # y's allocation, made of x's pages, waits in line for a's next call.
            for rid, ctx in ((x, a), (y, b)):
                await service.Admit(pb.AdmitRequest(request_id=rid, prompt_tokens=1), ctx)
            await service.Allocate(pb.AllocateRequest(request_id=x, num_blocks=48), a)
            waiting = asyncio.ensure_future(
                service.Allocate(pb.AllocateRequest(request_id=y, num_blocks=32), b))
            # And one released while it waits is refused when its turn comes.
            gone = f"b/z{round_}"
            await node.admit_async(gone, tenant="b", pool="", prompt_tokens=1,
                                   output_tokens=0, priority=0)
            refused = asyncio.ensure_future(node.allocate(gone, 20, holder="b/z"))
            await asyncio.sleep(0.01)
            assert not waiting.done() and not refused.done()
            await node.release(gone)
            await service.Free(pb.FreeRequest(request_id=x, block_indices=[47]), a)
            await waiting
            with pytest.raises(KvdError):
                await refused
            await service.Free(pb.FreeRequest(request_id=y, block_indices=[31]), b)
            # y's room was made of x's blocks; reading x brings them back, y's go out,
            # and the second read waits for the first one's copies.
            read = pb.AccessRequest(request_id=x, all_blocks=True)
            await asyncio.gather(service.Access(read, a), service.Access(read, a))
            await service.Release(pb.ReleaseRequest(request_id=y), b)
            await service.Free(pb.FreeRequest(request_id=x, block_indices=list(range(0, 46, 2))),
                               a)
            keys = [b"r%d/%d" % (round_, i) for i in range(40)]
            store, load = f"s{round_}", f"l{round_}"
            await service.Admit(pb.AdmitRequest(request_id=store, prompt_tokens=1), b)
            await service.Store(pb.StoreRequest(request_id=store, keys=keys), b)
            await service.Commit(pb.CommitRequest(request_id=store, keys=keys), b)
            await service.Admit(pb.AdmitRequest(request_id=load, prompt_tokens=1), a)
            await service.Load(pb.LoadRequest(request_id=load, keys=keys), a)
            for bad in (lambda: node.allocate("a/none", 1),
                        lambda: node.access("a/none", None)):
                with pytest.raises(KvdError):
                    await bad()
            for rid, ctx in ((x, a), (store, b), (load, a)):
                await service.Release(pb.ReleaseRequest(request_id=rid), ctx)
        assert node.runtime("default").pool.counters.num_promotions > 0
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = _kvds_own(gc.garbage)
        assert not left, f"kvd's objects left in garbage cycles: {left}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await node.aclose()


@pytest.mark.parametrize("walk_s", [0.2, 0.0])
async def test_a_serving_kvd_walks_everything_every_gc_full_walk_s(tmp_path, walk_s):
    """Its metrics show the full walks, what they freed and what is set aside; with
    gc_full_walk_s = 0, Python's own collections, nothing set aside past start-up."""
    port = free_port()
    config = tmp_path / "kvd.toml"
    config.write_text(f"[server]\ngc_full_walk_s = {walk_s}\n")
    with LocalKvd("--config", str(config), *SMALL, "--metrics", f"127.0.0.1:{port}",
                  workdir=tmp_path):
        for _ in range(100 if walk_s else 10):
            _, samples = scrape(port)
            if samples[("kvd_gc_full_walks_total", ())] >= 2:
                break
            await asyncio.sleep(0.05)
        _, samples = scrape(port)
    walks = samples[("kvd_gc_full_walks_total", ())]
    if walk_s:
        assert walks >= 2
        assert samples[("kvd_gc_full_walk_last_seconds", ())] > 0
        assert samples[("kvd_gc_set_aside_objects", ())] > 0
    else:
        assert walks == 0 and samples[("kvd_gc_set_asides_total", ())] == 0
