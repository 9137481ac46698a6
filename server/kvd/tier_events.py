"""kvd's own tiers as KV cache events, in the wire format of vLLM's and SGLang's publishers
(see kvd.kv_events), so a KV-aware router that reads theirs (Dynamo's, for one) can route
on what kvd holds with no new code.

What is published: the committed prefix blocks kvd keeps, by the hash engines publish for
them (the key's low 64 bits, as vLLM folds its block hashes), with kvd's tier as the medium:
"GPU" for a device tier in GPU memory, "CPU" for host memory (the host tier, and a device
tier that stands in for a GPU). Every interval kvd sends what changed since the last batch
as one batch: `BlockStored` for a hash that came to a medium, `BlockRemoved` for one that
left it (a hash stands in a medium while any block kvd keeps under it is there: two
namespaces, or two pools, may hold blocks of the same key). Batches are numbered; the last
ones are kept for the replay socket, which answers a start sequence with the batches from
there and then sequence -1, as vLLM's does.

What changed is what the pools noted (PageTable.named_changed: blocks committed, moved
between tiers, or gone), not a walk of every block kvd keeps: a host tier holds hundreds of
thousands, and a walk of them each interval held the event loop, and every engine's next
step, for about as long as the interval. A batch looks at PUBLISH_SLICE names at most; a
burst of more goes out over the next intervals.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict, deque

import msgpack
import structlog
import zmq
import zmq.asyncio

from kvd.core.blocks import TierKind
from kvd.kv_events import END_SEQ, hash_key

log = structlog.get_logger("kvd.tier_events")

# Replayed batches sent between two turns of the event loop (each send ~30 us here).
REPLAY_SLICE = 32
# Changed names one batch looks at (about 1 us each here).
PUBLISH_SLICE = 8192

Held = tuple[int, str]  # a hash and the medium it stands in


class TierEventPublisher:
    """Publishes a node's kept prefix blocks as KV cache events (see the module)."""

    def __init__(self, node, endpoint: str, replay_endpoint: str = "", topic: str = "",
                 interval_s: float = 0.1, buffer_batches: int = 10_000) -> None:
        self.node = node
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.interval_s = interval_s
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        # As last published: each kept block's (hash, medium) by (pool, name), and how many
        # blocks stand under each (hash, medium).
        self.counted: dict[tuple[str, tuple[str, bytes]], Held] = {}
        self.held: Counter[Held] = Counter()
        self.seq = 0
        self.ctx = zmq.asyncio.Context.instance()
        self._pub = self._router = None
        self._task: asyncio.Task | None = None
        self._replay_task: asyncio.Task | None = None

    def start(self) -> None:
        """Bind the sockets (a bad endpoint raises ValueError) and publish from now on."""
        try:
            self._pub = self.ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self.endpoint)
            if self.replay_endpoint:
                self._router = self.ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # A ROUTER drops what a peer's queue has no room for, silently: a replay of
                # the whole buffer (and the -1 that ends it) must fit in one.
                self._router.setsockopt(zmq.SNDHWM, self.buffer.maxlen + 1)
                self._router.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot publish KV events on {self.endpoint}"
                             f"{' / ' + self.replay_endpoint if self.replay_endpoint else ''}"
                             f": {exc}") from None
        for rt in self.node.pools.values():  # from here on the pools note what changes
            pages = rt.pool.pages
            pages.named_changed = set(pages.named)
        self._task = asyncio.ensure_future(self._run())
        if self._router is not None:
            self._replay_task = asyncio.ensure_future(self._serve_replays())

    def close(self) -> None:
        for task in (self._task, self._replay_task):
            if task is not None:
                task.cancel()
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        for rt in self.node.pools.values():
            rt.pool.pages.named_changed = None

    def holdings(self) -> set[Held]:
        """What kvd holds now, walked whole: each committed kept block's (hash, medium). What
        the published batches add up to (`held`) once the noted changes are out."""
        return {held for rt in self.node.pools.values()
                for b in rt.pool.pages.named.values()
                if (held := _held(b, _device_medium(rt))) is not None}

    def events(self) -> list[dict]:
        """What changed since the last batch, as events (the published view follows)."""
        touched: dict[Held, int] = {}  # each (hash, medium) changed, with its count before
        budget = PUBLISH_SLICE
        for rt in self.node.pools.values():
            pages = rt.pool.pages
            changed = pages.named_changed
            device = _device_medium(rt)
            while changed and budget:
                budget -= 1
                name = changed.pop()
                where = (rt.pool.name, name)
                block = pages.named.get(name)
                now = None if block is None else _held(block, device)
                before = self.counted.get(where)
                if now == before:
                    continue
                if before is not None:
                    touched.setdefault(before, self.held[before])
                    self.held[before] -= 1
                    del self.counted[where]
                if now is not None:
                    touched.setdefault(now, self.held[now])
                    self.held[now] += 1
                    self.counted[where] = now
        stored: dict[str, list[int]] = defaultdict(list)
        removed: dict[str, list[int]] = defaultdict(list)
        for held, before in touched.items():
            after = self.held[held]
            if not after:
                del self.held[held]
            if before and not after:
                removed[held[1]].append(held[0])
            elif after and not before:
                stored[held[1]].append(held[0])
        block_tokens = next(iter(self.node.pools.values())).pool.block_tokens
        return ([{"type": "BlockRemoved", "block_hashes": hs, "medium": m}
                 for m, hs in removed.items()]
                + [{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None,
                    "token_ids": [], "block_size": block_tokens, "lora_id": None,
                    "medium": m, "lora_name": None} for m, hs in stored.items()])

    def publish(self, events: list[dict]) -> None:
        payload = msgpack.packb([time.time(), events])
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def _run(self) -> None:
        while True:
            try:
                events = self.events()
                if events:
                    self.publish(events)
            except Exception as exc:  # keep publishing: a router can replay what it missed
                log.error("tier_events_failed", error=str(exc))
            await asyncio.sleep(self.interval_s)

    async def _serve_replays(self) -> None:
        """Answer each replay request with the buffered batches from its start on, then
        sequence -1. A send the socket takes at once does not give the event loop back, and
        a whole buffer is thousands of them: the loop serves engines' steps between every
        REPLAY_SLICE batches, and the batches go out from the buffer as it was asked."""
        while True:
            try:
                frames = await self._router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                batches = [b for b in self.buffer if b[0] >= first]
                for k, (seq, payload) in enumerate(batches, 1):
                    await self._router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload])
                    if k % REPLAY_SLICE == 0:
                        await asyncio.sleep(0)
                await self._router.send_multipart(
                    [client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""])
            except Exception as exc:  # a request that cannot be answered: the next may
                log.error("tier_events_replay_failed", error=str(exc))


def _device_medium(rt) -> str:
    return "GPU" if rt.arenas["device"].backend == "cupy" else "CPU"


def _held(block, device: str) -> Held | None:
    """A kept block's hash and medium, None while it is not published (not committed, or
    without bytes)."""
    if not block.committed or block.tier is TierKind.NONE:
        return None
    return hash_key(block.name[1]), device if block.tier is TierKind.DEVICE else "CPU"
