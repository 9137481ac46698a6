"""What each engine holds on its GPU, from its KV cache events (vLLM's and SGLang's ZMQ
publishers, which share one wire format).

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
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

log = structlog.get_logger("kvd.kv_events")

END_SEQ = -1
GPU_MEDIA = frozenset({"GPU", None})  # vLLM leaves medium out for its GPU blocks
MASK_64 = (1 << 64) - 1

Hash = int | bytes


def hash_key(h: Hash) -> int:
    """A block hash as the 64-bit int vLLM publishes by default (bytes: their low 64 bits,
    as vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES folds them)."""
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & MASK_64
    return h & MASK_64


@dataclass(slots=True)
class Residency:
    """One engine's blocks by medium, as its events say; and how the stream went."""

    engine: str
    tenant: str = ""  # for blocks kvd keeps nothing under
    blocks: dict[int, str | None] = field(default_factory=dict)  # hash -> medium
    last_seq: int = -1
    num_batches: int = 0
    num_events: int = 0
    num_replayed: int = 0  # batches recovered from the replay socket
    num_lost: int = 0  # batches the publisher no longer had
    num_bad: int = 0  # payloads that did not decode

    def apply(self, events: Iterable[Any]) -> None:
        """One batch's events, in order."""
        blocks = self.blocks
        for event in events:
            self.num_events += 1
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "BlockStored":
                medium = event.get("medium")
                for h in event.get("block_hashes") or ():
                    blocks[hash_key(h)] = medium
            elif kind == "BlockRemoved":
                medium = event.get("medium")
                for h in event.get("block_hashes") or ():
                    key = hash_key(h)
                    if blocks.get(key, medium) == medium:
                        blocks.pop(key, None)
            elif kind == "AllBlocksCleared":
                blocks.clear()

    def by_medium(self) -> Counter[str]:
        return Counter("GPU" if m is None else m for m in self.blocks.values())

    def gpu_hashes(self) -> list[int]:
        return [h for h, m in self.blocks.items() if m in GPU_MEDIA]


def decode(payload: bytes) -> list[Any]:
    """A batch's events (raises ValueError for a payload that is not one)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as exc:
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
                 context: zmq.asyncio.Context | None = None) -> None:
        self.residency = residency
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.ctx = context or zmq.asyncio.Context.instance()
        self.drop_next = 0  # tests: batches to throw away on arrival, as a lossy network
        self.applied = asyncio.Event()  # set after each batch applied (tests wait on it)
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
        """A batch off the PUB socket: earlier ones missing are replayed first."""
        res = self.residency
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
        finally:
            dealer.close(linger=0)


def gpu_blocks_by_tenant(residency: Residency, owners: dict[int, tuple[str, ...]]
                         ) -> dict[str, float]:
    """The engine's GPU blocks per tenant: a block kvd keeps under the same hash counts to
    the tenants it is charged to (1/k each), any other to the engine's tenant."""
    figures: Counter[str] = Counter()
    for h in residency.gpu_hashes():
        payers = owners.get(h)
        if payers:
            for tenant in payers:
                figures[tenant] += 1 / len(payers)
        else:
            figures[residency.tenant] += 1
    return dict(figures)


class EngineEvents:
    """The engines a node follows (config `[[engine]]`), each with its residency."""

    def __init__(self, engines: Iterable[Any]) -> None:
        self.residency: dict[str, Residency] = {}
        self.subscribers: dict[str, Subscriber] = {}
        for e in engines:
            res = Residency(e.name, e.tenant)
            self.residency[e.name] = res
            self.subscribers[e.name] = Subscriber(res, e.endpoint, e.replay_endpoint,
                                                  e.topic, e.bind)
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

    def gpu_by_tenant(self, owners: dict[int, tuple[str, ...]]) -> dict[str, float]:
        """Every engine's GPU blocks per tenant, added up."""
        total: Counter[str] = Counter()
        for res in self.residency.values():
            total.update(gpu_blocks_by_tenant(res, owners))
        return dict(total)
