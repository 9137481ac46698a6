"""What each engine holds on its GPU, from its KV cache events: vLLM's and SGLang's ZMQ
publishers, which share one wire format, and TensorRT-LLM's /kv_cache_events (polled).

A publisher sends three frames per batch: topic, sequence number (8 bytes, big-endian) and a
msgpack payload `[timestamp, [events], dp_rank?]`; events are maps tagged by `type`
(`BlockStored` with `block_hashes` and `medium`, `BlockRemoved`, `AllBlocksCleared`), hashes
int64 or bytes. A ROUTER beside it answers `[start_seq]` with the batches it still buffers
from there, ended by sequence -1. kvd applies batches in sequence order: a batch lost on the
way (ZMQ drops on a slow joiner or a full queue) is asked of the replay socket before the
next is applied; what the publisher no longer buffers is counted as lost.

kvd attributes an engine's GPU blocks to tenants through the shared prefix blocks it keeps
under the same hashes (the tenants they are charged to), and the rest to the engine's
configured tenant.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

from kvd.core.blocks import MASK_64, key_hash

log = structlog.get_logger("kvd.kv_events")

END_SEQ = -1

Hash = int | bytes

# What kvd keeps of one engine is bounded whatever its publisher sends (anyone who reaches a
# bound endpoint can publish): at most `max_blocks` blocks (EngineEventsConfig) and this many
# media, each named in at most MAX_MEDIUM characters; past them, events are dropped and
# counted (num_dropped).
MAX_MEDIA = 8
MAX_MEDIUM = 64


def hash_key(h: Hash) -> int:
    """A block hash as the 64-bit int vLLM publishes by default (bytes: their low 64 bits,
    as vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES folds them)."""
    if isinstance(h, bytes):
        return key_hash(h)
    return h & MASK_64


@dataclass(slots=True)
class Residency:
    """One engine's blocks and the media each is in, as its events say (a block offloaded
    to host memory while still on the GPU is in both); and how the stream went."""

    engine: str
    tenant: str = ""  # for blocks kvd keeps nothing under
    max_blocks: int = 1 << 21
    # hash -> media, one frozenset for each set of media (see _media): a block costs its
    # entry in the dict and nothing more.
    blocks: dict[int, frozenset[str]] = field(default_factory=dict)
    num_dropped: int = 0  # hashes and media past the bounds above, not followed
    last_seq: int = -1
    num_batches: int = 0
    num_events: int = 0
    num_replayed: int = 0  # batches recovered from the replay socket
    num_lost: int = 0  # batches the publisher no longer had
    num_bad: int = 0  # payloads that did not decode
    num_malformed: int = 0  # events not applied: not a map, or hashes or medium malformed
    num_restarts: int = 0  # times the publisher started its sequence over
    _media: dict[frozenset[str], frozenset[str]] = field(default_factory=dict)

    def _interned(self, media: frozenset[str]) -> frozenset[str] | None:
        """The one frozenset kept for these media; None past MAX_MEDIA media in all."""
        kept = self._media.get(media)
        if kept is None:
            if len(frozenset().union(media, *self._media)) > MAX_MEDIA:
                return None
            kept = self._media[media] = media
        return kept

    def apply(self, events: Iterable[Any]) -> None:
        """One batch's events, in order. An event that is not a map, or whose hashes or
        medium are of the wrong kind, changes nothing and is counted (num_malformed): one
        engine's bad event never stops kvd following it."""
        blocks = self.blocks
        for event in events:
            self.num_events += 1
            if not isinstance(event, dict):
                self.num_malformed += 1
                continue
            kind = event.get("type")
            if kind == "AllBlocksCleared":
                blocks.clear()
                continue
            if kind != "BlockStored" and kind != "BlockRemoved":
                continue  # a kind that says nothing of where blocks are
            keys, medium = _hash_keys(event.get("block_hashes")), event.get("medium")
            if keys is None or not (medium is None or (type(medium) is str
                                                       and len(medium) <= MAX_MEDIUM)):
                self.num_malformed += 1
                continue
            if kind == "BlockStored":
                self._stored(keys, medium or "GPU")  # vLLM leaves it out for its GPU
                continue
            for key in keys:
                media = blocks.get(key)
                if media is None:
                    continue
                left = self._interned(media - {medium}) if medium is not None else None
                if left:
                    blocks[key] = left
                else:  # gone from wherever it was
                    del blocks[key]

    def _stored(self, keys: list[int], medium: str) -> None:
        blocks = self.blocks
        alone = self._interned(frozenset((medium,)))
        for key in keys:
            media = blocks.get(key)
            if media is None:
                if alone is None or len(blocks) >= self.max_blocks:
                    self.num_dropped += 1
                    continue
                blocks[key] = alone
            elif medium not in media:
                more = self._interned(media | {medium})
                if more is None:
                    self.num_dropped += 1
                    continue
                blocks[key] = more

    def start_over(self) -> None:
        """The engine's publisher started its sequence over (the engine restarted): what it
        held is gone, and its batches are numbered from the start again."""
        self.blocks.clear()
        self.last_seq = -1
        self.num_restarts += 1

    def by_medium(self) -> Counter[str]:
        return Counter(m for media in self.blocks.values() for m in media)

    def gpu_hashes(self) -> list[int]:
        return [h for h, media in self.blocks.items() if "GPU" in media]


def _hash_keys(hashes: Any) -> list[int] | None:
    """An event's block_hashes as keys (see hash_key); None unless a list of int or bytes."""
    if not isinstance(hashes, (list, tuple)):
        return None
    keys = []
    for h in hashes:
        if type(h) is not int and type(h) is not bytes:
            return None
        keys.append(hash_key(h))
    return keys


def decode(payload: bytes) -> list[Any]:
    """A batch's events (raises ValueError for a payload that is not one)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:  # TypeError: a list key
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, (list, tuple)) or len(batch) not in (2, 3) \
            or not isinstance(batch[1], (list, tuple)):
        raise ValueError("not an event batch [ts, events, dp_rank?]")
    return list(batch[1])


class Subscriber:
    """Follows one engine's publisher: SUB on its endpoint (connected, or bound when the
    engine connects to kvd), DEALER to its replay socket."""

    def __init__(self, residency: Residency, endpoint: str, replay_endpoint: str = "",
                 topic: str = "", bind: bool = False, replay_timeout_s: float = 2.0,
                 idle_replay_s: float = 1.0,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.residency = residency
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.idle_replay_s = idle_replay_s
        self.ctx = context or zmq.asyncio.Context.instance()
        self.drop_next = 0  # tests: batches to throw away on arrival, as a lossy network
        self.applied = asyncio.Event()  # set after each batch applied (tests wait on it)
        # The last sequence number the PUB socket brought: a publisher's batches come
        # through it in order, so one that does not come after it is a new publisher's.
        self.pub_seq = -1
        self._sub: zmq.asyncio.Socket | None = None

    def open(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        if self.bind:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        self._sub = sub

    async def run(self) -> None:
        """Apply batches until cancelled."""
        if self._sub is None:
            self.open()
        try:
            while True:
                if not await self._sub.poll(self.idle_replay_s * 1000):
                    # Quiet a while: a last batch lost on the way shows no gap until the
                    # next one comes, so ask the replay socket for anything after ours.
                    if self.replay_endpoint:
                        await self._replay(self.residency.last_seq + 1, 2**63 - 1)
                    continue
                frames = await self._sub.recv_multipart()
                if len(frames) != 3:
                    self.residency.num_bad += 1
                    continue
                if self.drop_next > 0:
                    self.drop_next -= 1
                    continue
                await self.receive(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            self._sub.close(linger=0)

    async def receive(self, seq: int, payload: bytes) -> None:
        """A batch off the PUB socket: earlier ones missing are replayed first. One numbered
        no later than the last it brought comes from a publisher that started over (the
        engine restarted, and numbers its batches from 0 again): the engine's blocks are
        forgotten and its new batches followed from the start."""
        res = self.residency
        if seq <= self.pub_seq:
            log.warning("kv_events_publisher_restarted", engine=res.engine, seq=seq,
                        last=self.pub_seq)
            res.start_over()
        self.pub_seq = seq
        if seq <= res.last_seq:
            return  # already applied (through a replay)
        if seq > res.last_seq + 1 and self.replay_endpoint:
            await self._replay(res.last_seq + 1, seq)
        if seq > res.last_seq + 1:
            res.num_lost += seq - res.last_seq - 1
            log.warning("kv_events_lost", engine=res.engine, first=res.last_seq + 1,
                        last=seq - 1)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        res = self.residency
        try:
            events = decode(payload)
        except ValueError as exc:
            res.num_bad += 1
            log.warning("kv_events_bad_payload", engine=res.engine, seq=seq, error=str(exc))
            events = []
        res.apply(events)
        res.last_seq = seq
        res.num_batches += 1
        self.applied.set()

    async def _replay(self, start: int, stop: int) -> None:
        """Ask the replay socket for batches start..stop-1 and apply those it has."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(self.replay_timeout_s * 1000):
                    log.warning("kv_events_replay_timeout", engine=self.residency.engine)
                    return
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                if self.residency.last_seq < seq < stop:
                    self.residency.num_replayed += 1
                    self._apply(seq, frames[3])
                if seq >= stop - 1:
                    return  # the rest is what the PUB socket brings anyway
        finally:
            dealer.close(linger=0)


# An engine's blocks a walk of them takes between two turns of the event loop (about 1 ms
# here).
WALK_SLICE = 1024


@dataclass(slots=True, frozen=True)
class Holdings:
    """What the followed engines hold, as last walked (see walk_holdings): each engine's
    blocks by medium and its GPU blocks by tenant, and those over every engine."""

    media: dict[str, dict[str, int]] = field(default_factory=dict)
    gpu: dict[str, dict[str, float]] = field(default_factory=dict)
    gpu_by_tenant: dict[str, float] = field(default_factory=dict)


async def walk_holdings(residency: dict[str, Residency],
                        kept: Iterable[dict[int, list[Any]]]) -> tuple[Holdings, float]:
    """Each engine's blocks by medium and its GPU blocks by tenant: a block kvd keeps under
    the same hash (`kept`: each pool's kept blocks by hash, PageTable.by_hash) counts to
    the tenants it is charged to, 1/k each, any other to the engine's tenant. Returns them
    and the seconds the walk held the event loop: it gives the loop back every WALK_SLICE
    blocks (an engine's GPU holds hundreds of thousands), walking a list taken of the
    engine's hashes as it starts; a block gone meanwhile counts as where it was or not at
    all."""
    spent = 0.0
    kept = list(kept)
    holdings = Holdings()
    for name, res in list(residency.items()):
        hashes = list(res.blocks)
        media: Counter[str] = Counter()
        gpu: Counter[str] = Counter()
        for i in range(0, len(hashes), WALK_SLICE):
            started = time.perf_counter()
            blocks = res.blocks
            for h in hashes[i:i + WALK_SLICE]:
                held = blocks.get(h)
                if held is None:
                    continue
                media.update(held)
                if "GPU" in held:
                    payers = None
                    for by_hash in kept:  # a loop, not a generator: nothing for the GC
                        found = by_hash.get(h)
                        if found:
                            payers = found[0].payers
                            break
                    if payers:
                        for tenant in payers:
                            gpu[tenant] += 1 / len(payers)
                    else:
                        gpu[res.tenant] += 1
            spent += time.perf_counter() - started
            await asyncio.sleep(0)
        holdings.media[name] = dict(media)
        holdings.gpu[name] = dict(gpu)
        for tenant, n in gpu.items():
            holdings.gpu_by_tenant[tenant] = holdings.gpu_by_tenant.get(tenant, 0.0) + n
    return holdings, spent


class EngineEvents:
    """The engines a node follows (config `[[engine]]`), each with its residency."""

    def __init__(self, engines: Iterable[Any]) -> None:
        self.residency: dict[str, Residency] = {}
        self.subscribers: dict[str, Subscriber | TrtllmPoller] = {}
        for e in engines:
            res = Residency(e.name, e.tenant, max_blocks=e.max_blocks)
            self.residency[e.name] = res
            self.subscribers[e.name] = (
                TrtllmPoller(res, e.url, e.poll_s) if e.url
                else Subscriber(res, e.endpoint, e.replay_endpoint, e.topic, e.bind))
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Open every engine's sockets and follow them (a bad endpoint raises ValueError)."""
        for name, sub in self.subscribers.items():
            try:
                sub.open()
            except zmq.ZMQError as exc:
                raise ValueError(f"engine {name!r}: cannot {'bind' if sub.bind else 'connect'}"
                                 f" {sub.endpoint}: {exc}") from None
            self._tasks.append(asyncio.ensure_future(sub.run()))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()


# ---------------------------------------------------------------------- TensorRT-LLM

# TensorRT-LLM's cache levels: 0 is the primary pool (GPU memory), 1 the secondary (host).
TRTLLM_MEDIA = {0: "GPU", 1: "CPU"}


def from_trtllm(items: Iterable[Any]) -> list[dict | None]:
    """TensorRT-LLM's KV cache events (KVCacheEventSerializer's JSON, as trtllm-serve's
    /kv_cache_events returns them) as the events Residency applies; None for an item that is
    not one (Residency counts it malformed). `created` (the pools' sizes) and priority
    changes tell kvd nothing of where blocks are."""
    events: list[dict | None] = []
    for item in items:
        data = item.get("data") if isinstance(item, dict) else None
        if not isinstance(data, dict):
            events.append(None)
            continue
        kind = data.get("type")
        if kind == "stored":
            blocks = data.get("blocks")
            if not isinstance(blocks, list):
                events.append(None)
                continue
            for block in blocks:
                medium = (_trtllm_medium(block.get("cache_level", 0))
                          if isinstance(block, dict) and "block_hash" in block else None)
                events.append(None if medium is None else {
                    "type": "BlockStored", "block_hashes": [block["block_hash"]],
                    "medium": medium})
        elif kind == "removed":
            events.append({"type": "BlockRemoved", "block_hashes": data.get("block_hashes"),
                           "medium": None})
        elif kind == "updated" and isinstance(data.get("cache_level"), dict):
            medium = _trtllm_medium(data["cache_level"].get("new_value"))
            if medium is None or "block_hash" not in data:
                events.append(None)
                continue
            events.append({"type": "BlockRemoved", "block_hashes": [data["block_hash"]],
                           "medium": None})
            events.append({"type": "BlockStored", "block_hashes": [data["block_hash"]],
                           "medium": medium})
    return events


def _trtllm_medium(level: Any) -> str | None:
    """The medium of a TensorRT-LLM cache level (past the primary pool: host memory); None
    for a level that is not a number."""
    return TRTLLM_MEDIA.get(level, "CPU") if type(level) is int else None


class TrtllmPoller:
    """Follows a TensorRT-LLM server by polling its `/kv_cache_events` (each call drains the
    events queued since the last). Event ids are consecutive: a gap is counted as lost (the
    server keeps no replay); a `removed` for a block kvd never saw stored changes nothing.
    A server that starts again says so with its first event, `created` (its cache pools
    made anew): what it held before is forgotten, and its event ids counted from there."""

    def __init__(self, residency: Residency, url: str, poll_s: float = 0.1,
                 timeout_s: float = 2.0) -> None:
        self.residency = residency
        self.url = url
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.last_id = -1
        self.applied = asyncio.Event()

    def open(self) -> None:
        """Nothing to open: each poll is a request of its own."""

    def _fetch(self) -> list[Any]:
        import json
        import urllib.request

        request = urllib.request.Request(self.url, data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            return json.loads(reply.read() or b"[]")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                items = await loop.run_in_executor(None, self._fetch)
            except Exception as exc:  # the server restarting, or not up yet
                log.debug("trtllm_events_unreachable", engine=self.residency.engine,
                          error=str(exc))
                items = []
            if isinstance(items, list) and items:
                self.receive(items)
            await asyncio.sleep(self.poll_s)

    def receive(self, items: list[Any]) -> None:
        res = self.residency
        numbered = sorted((i for i in items if isinstance(i, dict)
                           and type(i.get("event_id")) is int),
                          key=lambda i: i["event_id"])
        res.num_malformed += len(items) - len(numbered)
        created = [k for k, i in enumerate(numbered) if _is_created(i)]
        if created and self.last_id >= 0:
            log.warning("trtllm_events_restarted", engine=res.engine, last=self.last_id)
            res.start_over()
            self.last_id = -1
            numbered = numbered[created[-1]:]
        fresh = [i for i in numbered if i["event_id"] > self.last_id]
        if fresh and self.last_id >= 0 and fresh[0]["event_id"] > self.last_id + 1:
            res.num_lost += fresh[0]["event_id"] - self.last_id - 1
        for i, j in zip(fresh, fresh[1:]):
            res.num_lost += j["event_id"] - i["event_id"] - 1
        if not fresh:
            return
        res.apply(from_trtllm(fresh))
        self.last_id = fresh[-1]["event_id"]
        res.num_batches += 1
        self.applied.set()


def _is_created(item: dict) -> bool:
    """Whether a TensorRT-LLM event is `created`: its KV cache pools were just made."""
    data = item.get("data")
    return isinstance(data, dict) and data.get("type") == "created"
