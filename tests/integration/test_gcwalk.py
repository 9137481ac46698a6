"""kvd's own objects go by reference counting: none is left in a cycle for Python's
collector to find."""

from __future__ import annotations

import asyncio
import gc

import pytest

from kvd.config import Config, PoolConfig, TenantConfig
from kvd.core.errors import KvdError
from kvd.node import Node
from kvd.service.auth import Authenticator
from kvd.service.memory import MemoryService
from kvd_api.v1 import kvd_pb2 as pb


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
    collector: each waits for a full collection, which walks every object kvd holds."""
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
