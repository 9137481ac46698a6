"""kvd's own KV cache events (kvd.tier_events) over real pools: what the batches add up to
is what kvd keeps, whatever happened in between, and a batch looks only at what changed."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvd import tier_events
from kvd.core.errors import KvdError
from kvd.core.invariants import check_pool
from kvd.tier_events import TierEventPublisher

from .conftest import settle

# Two namespaces, and keys of which some share their low 64 bits (the hash published):
# one hash may stand for several kept blocks.
NAMESPACES = ("model-a", "model-b")
KEYS = [bytes([i]) * 8 + bytes([i % 3]) * 8 for i in range(6)]


def _publisher(pool) -> TierEventPublisher:
    """A publisher over one pool, as kvd's start makes it (its sockets left out), its device
    tier in GPU memory: the tiers are two media."""
    node = SimpleNamespace(pools={pool.name: SimpleNamespace(
        pool=pool, arenas={"device": SimpleNamespace(backend="cupy")})})
    publisher = TierEventPublisher(node, "inproc://unused")
    pool.pages.named_changed = set(pool.pages.named)  # what start() does
    return publisher


class Router:
    """What a router following the stream knows: each (hash, medium) it was told is there."""

    def __init__(self) -> None:
        self.held: set[tuple[int, str]] = set()

    def apply(self, events: list[dict]) -> None:
        for e in events:
            for h in e["block_hashes"]:
                held = (h, e["medium"])
                if e["type"] == "BlockStored":
                    assert held not in self.held, f"stored twice: {held}"
                    self.held.add(held)
                else:
                    assert held in self.held, f"removed, never stored: {held}"
                    self.held.remove(held)


def _admit(pool, rid: str, blocks: int) -> bool:
    return pool.admit(rid, tenant="t", prompt_tokens=16 * blocks,
                      output_tokens=0).decision == "admitted"


def test_a_batch_looks_at_the_blocks_that_changed_not_at_every_block_kept(make_pool,
                                                                         monkeypatch):
    # Every batch walked every block kvd keeps: with 200,000 kept on a host tier, kvd's
    # event loop was held ~100 ms of every 100 ms interval (a KeepAlive's p99 102 ms with
    # events on, 3 ms off). Now a batch looks at the blocks noted as changed.
    pool = make_pool(device_pages=64, host_pages=4096)
    publisher = _publisher(pool)
    router = Router()
    keys = [i.to_bytes(16, "big") for i in range(3000)]
    for start in range(0, len(keys), 60):
        rid = f"r{start}"
        assert _admit(pool, rid, 60)
        settle(pool, pool.store(rid, "ns", keys[start:start + 60])[0])
        pool.commit(rid, "ns", keys[start:start + 60])
        pool.release(rid)
        settle(pool, pool.evict(min(60, pool.device.num_used)))  # room for the next
    router.apply(publisher.events())  # may take a few batches: PUBLISH_SLICE each
    router.apply(publisher.events())
    assert router.held == publisher.holdings() and len(router.held) == len(keys)

    looked = []
    hash_key = tier_events.hash_key
    monkeypatch.setattr(tier_events, "hash_key", lambda h: looked.append(h) or hash_key(h))
    assert publisher.events() == [] and looked == []  # nothing changed: nothing looked at
    assert _admit(pool, "x", 2)  # one kept block back to the device
    run = pool.load("x", "ns", keys[:1])
    settle(pool, pool.prefetch(run))
    router.apply(publisher.events())
    assert len(looked) == 1 and router.held == publisher.holdings()


STORE = st.tuples(st.just("store"), st.sampled_from(NAMESPACES),
                  st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
                  st.booleans())
LOAD = st.tuples(st.just("load"), st.sampled_from(NAMESPACES),
                 st.lists(st.sampled_from(KEYS), min_size=1, max_size=2, unique=True))
OPS = st.lists(st.one_of(
    STORE, STORE,
    st.tuples(st.just("evict"), st.integers(1, 3)),
    st.tuples(st.just("pressure"), st.integers(1, 10)),
    LOAD, LOAD,
    st.tuples(st.just("publish")),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, policy=st.sampled_from(["lru", "fair", "intent"]),
       host_pages=st.sampled_from([0, 2, 8]), batch=st.sampled_from([1, 3, 8192]))
def test_what_the_batches_add_up_to_is_what_kvd_keeps(ops, policy, host_pages, batch):
    # Blocks stored, committed or not, in two namespaces whose keys share hashes; pushed to
    # the host tier or dropped by evictions and by other requests' pages; brought back to
    # the device by a prefetch. A batch looks at `batch` changed blocks at most.
    from .conftest import PoolFactory

    pool = PoolFactory()(device_pages=8, host_pages=host_pages, policy=policy)
    publisher = _publisher(pool)
    router = Router()
    slice_was, tier_events.PUBLISH_SLICE = tier_events.PUBLISH_SLICE, batch
    try:
        _run(pool, publisher, router, ops)
    finally:
        tier_events.PUBLISH_SLICE = slice_was
    assert router.held == publisher.holdings()
    assert check_pool(pool) == []


def _run(pool, publisher, router, ops) -> None:
    for n, op in enumerate(ops):
        rid = f"r{n}"
        try:
            if op[0] == "store":
                _, ns, keys, commit = op
                if _admit(pool, rid, len(keys)):
                    settle(pool, pool.store(rid, ns, keys)[0])
                    if commit:
                        pool.commit(rid, ns, keys)
                    pool.release(rid)
            elif op[0] == "evict":
                settle(pool, pool.evict(op[1]))
            elif op[0] == "pressure":
                if _admit(pool, rid, op[1]):
                    settle(pool, pool.allocate(rid, op[1]))
                    pool.release(rid)
            elif op[0] == "load":
                _, ns, keys = op
                if _admit(pool, rid, len(keys)):
                    run = pool.load(rid, ns, keys)
                    settle(pool, pool.prefetch(run))  # those on the host back to the device
                    pool.release(rid)
            else:
                router.apply(publisher.events())
        except KvdError:
            pass  # refused (no room, nothing to evict): the pool is as it was
    while pool.pages.named_changed:  # the rest, a batch at a time
        router.apply(publisher.events())
