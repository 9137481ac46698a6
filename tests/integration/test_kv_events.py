"""A running kvd follows an engine's KV cache events ([[engine]] in its config): what the
engine holds on its GPU shows per tenant in ListTenants and in /metrics, a batch lost on the
way comes back through the replay socket, and a bad [[engine]] entry is one line and exit 2.

The publisher here speaks the wire format of vLLM's and SGLang's ZmqEventPublisher (typed
from vllm/distributed/kv_events.py, vLLM 0.32: frames (topic, 8-byte big-endian sequence,
msgpack [ts, [events], dp_rank]), events maps tagged by "type", a ROUTER answering a start
sequence with the batches from there and then sequence -1). The engine tier runs the real
publishers of both packages."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.memory.cuda import gpu_available
from kvd_client import AsyncClient, pb
from kvd_loadgen.local import LocalKvd

from .conftest import free_port, scrape
from .test_startup import kvd as run_kvd, one_line

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    """An engine's event publisher: PUB on `endpoint`, ROUTER for replay; `lose` sends a
    batch to the replay buffer only, as if the network had dropped it."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(replay)
        self.sent: list[tuple[int, bytes]] = []
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._lock = threading.Lock()
        self._thread.start()

    def publish(self, events: list[dict], lose: bool = False) -> None:
        payload = msgpack.packb([time.time(), events, 0])
        with self._lock:
            seq = len(self.sent)
            self.sent.append((seq, payload))
            if not lose:
                self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            self.replays += 1
            with self._lock:
                for seq, payload in self.sent:
                    if seq >= int.from_bytes(start, "big"):
                        self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"),
                                                    payload])
                self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def stored(hashes, medium="GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": [], "block_size": 16, "lora_id": None, "medium": medium}


async def _until(cond, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_an_engines_gpu_blocks_count_to_the_tenants_kvd_charges_for_them(tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/ev", f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    config = tmp_path / "kvd.toml"
    config.write_text(
        '[[pool]]\nmodel = "tiny"\nblock_tokens = 16\ndevice_pages = 16\nhost_pages = 16\n'
        '[[tenant]]\nname = "x"\ntoken = "x-token"\n[[tenant]]\nname = "y"\ntoken = "y-token"\n'
        f'[[engine]]\nname = "gpu0"\nendpoint = "{endpoint}"\n'
        f'replay_endpoint = "{replay}"\ntenant = "y"\n[auth]\nadmin_token = "admin-token"\n')
    publisher = Publisher(endpoint, replay)
    try:
        with LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}",
                      workdir=tmp_path) as kvd:
            async with AsyncClient(kvd.target, token="x-token") as x:
                # x keeps two prefix blocks in kvd; the engine then holds them on its GPU
                # (vLLM publishes a bytes hash as its low 64 bits), and one kvd knows
                # nothing of, which counts to the engine's tenant, y.
                keys = [bytes([i]) * 32 for i in (1, 2)]
                await x.admit("r", prompt_tokens=32)
                await x.store("r", "ns", keys)
                await x.commit("r", "ns", keys)
                hashes = [int.from_bytes(k, "big") & (2**64 - 1) for k in keys]
                publisher.publish([stored(hashes)])
                publisher.publish([stored([7]), stored([8], medium="CPU")])
                publisher.publish([{"type": "BlockRemoved", "block_hashes": [hashes[1]],
                                    "medium": "GPU"}], lose=True)
                publisher.publish([stored([9])])

                async def caught_up():
                    s = scrape(port)[1]
                    return s.get(("kvd_engine_event_batches_total",
                                  (("engine", "gpu0"), ("outcome", "replayed")))) is not None \
                        and s.get(("kvd_engine_blocks",
                                (("engine", "gpu0"), ("medium", "GPU")))) == 3

                await _until(caught_up)
                # A last batch lost on the way shows no gap: kvd asks for it once quiet.
                publisher.publish([stored([10])], lose=True)

                async def trailing_loss_recovered():
                    return scrape(port)[1][("kvd_engine_blocks", (("engine", "gpu0"),
                                                                 ("medium", "GPU")))] == 4

                await _until(trailing_loss_recovered)
            async with AsyncClient(kvd.target, token="admin-token") as admin:
                gpu = {t.tenant: t.engine_gpu_blocks for t in await admin.list_tenants()}
            samples = scrape(port)[1]
    finally:
        publisher.close()
    # On the GPU: hashes[0] (x's, in kvd), 7, 9 and 10 (unknown to kvd: y's); hashes[1]
    # was removed by the batch lost on the way and brought back by replay.
    assert gpu == {"x": 1.0, "y": 3.0}
    assert samples[("kvd_engine_gpu_blocks", (("engine", "gpu0"), ("tenant", "x")))] == 1
    assert samples[("kvd_engine_blocks", (("engine", "gpu0"), ("medium", "CPU")))] == 1
    assert samples[("kvd_engine_event_batches_total",
                    (("engine", "gpu0"), ("outcome", "lost")))] == 0
    assert publisher.replays >= 1


def test_a_bad_engine_entry_is_one_line_and_exit_2(tmp_path):
    one_line(run_kvd(config='[server]\nsocket = "k.sock"\n[[engine]]\nname = "e"\n'
                            'endpoint = "http://x"\n', tmp_path=tmp_path),
             "endpoint must be tcp://, ipc:// or inproc://")
    one_line(run_kvd(config='[server]\nsocket = "k.sock"\n[[engine]]\nname = "e"\n'
                            'endpoint = "tcp://256.0.0.1:1"\nbind = true\n',
                     tmp_path=tmp_path), "engine 'e': cannot bind")
    one_line(run_kvd(config='[server]\nsocket = "k.sock"\n[[engine]]\nname = "e"\n'
                            'endpoint = "ipc://x"\nurl = "http://127.0.0.1:1/kv_cache_events"\n',
                     tmp_path=tmp_path), "give either endpoint (vLLM, SGLang) or url")
    one_line(run_kvd(config='[server]\nsocket = "k.sock"\n[[engine]]\nname = "e"\n'
                            'url = "127.0.0.1:8000"\n', tmp_path=tmp_path),
             "url must be http:// or https://")
    one_line(run_kvd(config='[server]\nsocket = "k.sock"\nkv_events_endpoint = "5558"\n',
                     tmp_path=tmp_path), "kv_events_endpoint must be tcp://")


async def test_kvd_publishes_what_it_keeps_in_the_engines_event_format(tmp_path):
    # kvd's own stream, followed by kvd's own subscriber (the engine tier reads it with
    # vLLM's decoder): the kept prefix blocks, stored and then let go under pressure.
    from kvd.kv_events import Residency, Subscriber, hash_key

    endpoint, replay = f"ipc://{tmp_path}/kvd-ev", f"ipc://{tmp_path}/kvd-replay"
    config = tmp_path / "kvd.toml"
    config.write_text(
        f'[server]\nkv_events_endpoint = "{endpoint}"\n'
        f'kv_events_replay_endpoint = "{replay}"\n'
        '[[pool]]\nmodel = "tiny"\nblock_tokens = 16\ndevice_pages = 8\nhost_pages = 4\n')
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        res = Residency("kvd")
        sub = Subscriber(res, endpoint, replay)
        task = asyncio.ensure_future(sub.run())
        try:
            async with AsyncClient(kvd.target) as c:
                keys = [bytes([i]) * 16 for i in range(6)]
                await c.admit("w", prompt_tokens=16 * 6)
                await c.store("w", "ns", keys)
                await c.commit("w", "ns", keys[:5])  # the sixth is never published
                await c.release("w")

                async def held_as_published():
                    held = (await c.lookup("ns", keys)).num_hit
                    return res.blocks and set(res.blocks) == {hash_key(k) for k in keys[:held]}

                await _until(held_as_published)
                # The device tier's medium: GPU memory with CuPy on a GPU, else its stand-in.
                assert set(res.by_medium()) == {"GPU" if gpu_available() else "CPU"}
                # Another request's pages push the kept blocks out of both tiers.
                admitted = await c.admit("big", prompt_tokens=16 * 8)
                assert admitted.decision == pb.DECISION_ADMITTED, admitted
                await c.allocate("big", 8)
                assert (await c.lookup("ns", keys)).num_hit < 5

                async def gone():
                    return len(res.blocks) < 5 and await held_as_published()

                await _until(gone)
                await c.release("big")
        finally:
            task.cancel()
    assert res.num_lost == 0 and res.num_bad == 0


async def test_the_tenant_holding_more_on_the_engines_gpu_pays_first_in_kvd(tmp_path):
    # x and y keep four prefix pages each in a fair pool (the ninth page is its free
    # reserve), at their shares. The
    # engine's events say x's four are on its GPU too: an eviction takes x's page, where
    # without them the tie would go to y.
    endpoint = f"ipc://{tmp_path}/ev"
    port = free_port()
    config = tmp_path / "kvd.toml"
    config.write_text(
        '[[pool]]\nmodel = "tiny"\nblock_tokens = 16\ndevice_pages = 9\nhost_pages = 16\n'
        'policy = "fair"\n'
        '[[tenant]]\nname = "x"\ntoken = "x-token"\n[[tenant]]\nname = "y"\ntoken = "y-token"\n'
        f'[[engine]]\nname = "gpu0"\nendpoint = "{endpoint}"\n[auth]\nadmin_token = "a"\n')
    publisher = Publisher(endpoint, f"ipc://{tmp_path}/replay")
    try:
        with LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}",
                      workdir=tmp_path) as kvd:
            keys = {}
            for tenant in ("x", "y"):
                async with AsyncClient(kvd.target, token=f"{tenant}-token") as c:
                    keys[tenant] = [f"{tenant}{i}".encode() * 8 for i in range(4)]
                    await c.admit("r", prompt_tokens=64)
                    await c.store("r", "ns", keys[tenant])
                    await c.commit("r", "ns", keys[tenant])
                    await c.release("r")
            hashes = [int.from_bytes(k, "big") & (2**64 - 1) for k in keys["x"]]

            async def seen():
                publisher.publish([stored(hashes)])  # until the SUB socket has joined
                return scrape(port)[1].get(("kvd_engine_gpu_blocks", (("engine", "gpu0"),
                                                                     ("tenant", "x")))) == 4

            await _until(seen)
            await asyncio.sleep(0.6)  # the node passes it to the pools within a period
            async with AsyncClient(kvd.target, token="a") as admin:
                before = {t.tenant: t.device_pages for t in await admin.list_tenants()}
                await admin.evict(1)
                after = {t.tenant: t.device_pages for t in await admin.list_tenants()}
    finally:
        publisher.close()
    assert before["x"] == before["y"] == 4
    assert (after["x"], after["y"]) == (3, 4)


def test_a_block_offloaded_while_still_on_the_gpu_is_in_both_media():
    # vLLM's CPU offloading stores a copy (BlockStored, medium CPU) and keeps the GPU one.
    from kvd.kv_events import Residency

    res = Residency("e")
    res.apply([stored([1, 2]), stored([1], medium="CPU")])
    assert sorted(res.gpu_hashes()) == [1, 2] and res.by_medium() == {"GPU": 2, "CPU": 1}
    res.apply([{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}])
    assert res.blocks == {1: {"CPU"}, 2: {"GPU"}}
    res.apply([{"type": "BlockRemoved", "block_hashes": [1, 2], "medium": None}])
    assert res.blocks == {}


# Events kvd cannot read: a map whose hashes or medium are of the wrong kind, or no map.
MALFORMED = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["BlockStored", "BlockRemoved"]),
                           "block_hashes": st.one_of(
                               st.none(), st.integers(), st.text(max_size=3),
                               st.lists(st.one_of(st.floats(), st.text(max_size=2),
                                                  st.none(), st.booleans()),
                                        min_size=1, max_size=3))}),
    st.fixed_dictionaries({"type": st.sampled_from(["BlockStored", "BlockRemoved"]),
                           "block_hashes": st.lists(st.integers(0, 7), max_size=3),
                           "medium": st.one_of(st.integers(), st.lists(st.text(max_size=2),
                                                                       max_size=2))}),
    st.none(), st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
SOUND = st.one_of(
    st.builds(lambda hashes, medium: {"type": "BlockStored", "block_hashes": hashes,
                                      **({} if medium is None else {"medium": medium})},
              st.lists(st.one_of(st.integers(0, 7), st.binary(min_size=1, max_size=2)),
                       max_size=3),
              st.sampled_from([None, "GPU", "CPU"])),
    st.builds(lambda hashes, medium: {"type": "BlockRemoved", "block_hashes": hashes,
                                      "medium": medium},
              st.lists(st.integers(0, 7), max_size=3), st.sampled_from([None, "GPU", "CPU"])),
    st.just({"type": "AllBlocksCleared"}), st.just({"type": "SomethingNew", "x": 1}))


def _model(events: list) -> dict[int, set[str]]:
    """Where blocks are after the sound events, applied one by one."""
    blocks: dict[int, set[str]] = {}
    for e in events:
        keys = [int.from_bytes(h, "big") if isinstance(h, bytes) else h
                for h in e.get("block_hashes", ())]
        if e["type"] == "BlockStored":
            for k in keys:
                blocks.setdefault(k, set()).add(e.get("medium") or "GPU")
        elif e["type"] == "BlockRemoved":
            for k in keys:
                media = blocks.get(k, set())
                media.difference_update(media if e["medium"] is None else {e["medium"]})
                if k in blocks and not media:
                    del blocks[k]
        elif e["type"] == "AllBlocksCleared":
            blocks.clear()
    return blocks


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), SOUND, MALFORMED), max_size=30))
def test_an_event_kvd_cannot_read_changes_nothing_and_is_counted(mix):
    # A publisher's batch with events of the wrong shape among sound ones (a buggy or
    # hostile engine): applied, it leaves what the sound ones alone would, never raises
    # (the follower would stop for good), and counts each bad one.
    from kvd.kv_events import Residency

    events = [bad if is_bad else good for is_bad, good, bad in mix]
    res = Residency("e")
    res.apply(events)
    assert res.blocks == _model([good for is_bad, good, _ in mix if not is_bad])
    assert res.num_malformed == sum(is_bad for is_bad, _, _ in mix)


async def test_a_publisher_that_starts_over_is_followed_from_its_new_start():
    # vLLM numbers its batches from 0 in each process: an engine that restarts starts over.
    # Its old blocks are gone (its GPU cache is new), and its batches are not "already
    # applied" because their numbers are.
    from kvd.kv_events import Residency, Subscriber

    res = Residency("e")
    sub = Subscriber(res, "ipc://unused")
    for seq, hashes in enumerate([[1], [2], [3]]):
        await sub.receive(seq, msgpack.packb([0.0, [stored(hashes)], 0]))
    assert set(res.blocks) == {1, 2, 3}
    await sub.receive(0, msgpack.packb([0.0, [stored([10])], 0]))
    await sub.receive(1, msgpack.packb([0.0, [stored([11])], 0]))
    assert set(res.blocks) == {10, 11} and res.last_seq == 1 and res.num_lost == 0
    assert res.num_restarts == 1


def engine_gpu0(tmp_path, more: str) -> tuple[Path, str, str]:
    """A kvd config following engine "gpu0" (with `more` in its [[engine]] entry) on ipc
    endpoints in tmp_path: the config's path, the endpoint and the replay endpoint."""
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    config = tmp_path / "kvd.toml"
    config.write_text(
        '[[pool]]\nmodel = "tiny"\nblock_tokens = 16\ndevice_pages = 16\nhost_pages = 16\n'
        f'[[engine]]\nname = "gpu0"\nendpoint = "{endpoint}"\nreplay_endpoint = "{replay}"\n'
        f"{more}\n")
    return config, endpoint, replay


async def test_kvd_follows_an_engine_past_bad_events_and_a_restart(tmp_path):
    # A running kvd and a publisher that sends events kvd cannot read, then stops and
    # starts again on the same endpoint (the engine restarted), numbering from 0.
    config, endpoint, replay = engine_gpu0(tmp_path, 'tenant = "default"')
    port = free_port()
    engine = (("engine", "gpu0"),)

    def sample(name, labels=engine):
        return scrape(port)[1].get((name, labels))

    def gpu_blocks():
        return sample("kvd_engine_blocks", engine + (("medium", "GPU"),))

    publisher = Publisher(endpoint, replay)
    try:
        with LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}",
                      workdir=tmp_path) as kvd:
            publisher.publish([stored([1, 2])])
            publisher.publish([stored([3]), {"type": "BlockStored", "block_hashes": "ab"},
                               {"type": "BlockRemoved", "block_hashes": [1.5], "medium": 7},
                               "not a map", stored([4])])
            publisher.publish([stored([5])])
            for _ in range(100):  # a long-running engine's batches
                publisher.publish([])

            async def past_the_bad_events():
                return gpu_blocks() == 5

            await _until(past_the_bad_events)
            assert sample("kvd_engine_events_malformed_total") == 3
            publisher.close()
            publisher = Publisher(endpoint, replay)  # the engine again, its numbers from 0
            publisher.publish([stored([10])])  # may be lost while kvd reconnects: replayed

            async def following_the_new_engine():
                publisher.publish([])
                return gpu_blocks() == 1

            await _until(following_the_new_engine)
            assert sample("kvd_engine_restarts_total") == 1
            assert kvd.proc.poll() is None
    finally:
        publisher.close()


PAYLOADS = st.one_of(
    st.binary(max_size=40),
    st.just(b"\x81\x92\x01\x02\x01"),  # a map keyed by an array: Python cannot hash the key
    st.just(b"\x91" * 5000 + b"\x90"),  # nested deeper than msgpack unpacks
    st.builds(lambda events: _packed([0.0, events, 0]), st.lists(MALFORMED | SOUND, max_size=4)))


def _packed(batch: list) -> bytes:
    """The batch as a publisher sends it (msgpack holds integers of 64 bits at most)."""
    try:
        return msgpack.packb(batch)
    except OverflowError:
        return msgpack.packb([0.0, [], 0])


@settings(max_examples=300, deadline=None)
@given(st.lists(PAYLOADS, min_size=1, max_size=5))
async def test_a_batch_that_does_not_decode_is_counted_and_the_next_applied(payloads):
    from kvd.kv_events import Residency, Subscriber

    res = Residency("e")
    sub = Subscriber(res, "ipc://unused")
    for seq, payload in enumerate(payloads):
        await sub.receive(seq, payload)
    await sub.receive(len(payloads), msgpack.packb([0.0, [stored([99])], 0]))
    assert 99 in res.blocks and res.last_seq == len(payloads) and res.num_lost == 0


async def test_a_replay_of_the_whole_buffer_gives_the_event_loop_back_as_it_goes(tmp_path):
    # A router asking kvd's replay socket for everything (a new one, or one that lost its
    # place) got the first ~1,000 batches and no end: the ROUTER dropped what did not fit
    # its peer's queue. And they went in one turn of the event loop, ~0.3 s here; ten such
    # requests held every engine's steps for 2 s. Now all come, the loop turning between
    # every REPLAY_SLICE of them.
    from kvd import tier_events
    from kvd.tier_events import TierEventPublisher

    class NoPools:
        pools: dict = {}

    publisher = TierEventPublisher(NoPools(), f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/rep")
    publisher.events = lambda: []  # nothing kept: only the buffer below is replayed
    for seq in range(10_000):
        publisher.buffer.append((seq, msgpack.packb([0.0, [stored([seq])]])))
    publisher.start()
    sends = 0
    router_send = publisher._router.send_multipart

    def counted(frames):
        nonlocal sends
        sends += 1
        return router_send(frames)

    publisher._router.send_multipart = counted
    most = 0  # the most batches sent between two turns of the loop

    async def turns():
        nonlocal most
        seen = sends
        while True:
            await asyncio.sleep(0)
            most, seen = max(most, sends - seen), sends

    ticker = asyncio.ensure_future(turns())
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/rep")
    try:
        await asyncio.sleep(0.2)  # the ticker turning, the publisher waiting for requests
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            try:
                frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
            except asyncio.TimeoutError:
                pytest.fail(f"the replay stopped after {len(seqs)} batches, and no -1")
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                break
            seqs.append(seq)
        for _ in range(3):  # the ticker's turn after the last send
            await asyncio.sleep(0)
    finally:
        ticker.cancel()
        dealer.close(linger=0)
        publisher.close()
    assert seqs == list(range(10_000))
    assert most <= tier_events.REPLAY_SLICE + 1, most


def test_a_publisher_flooding_hashes_or_media_holds_kvd_to_a_bound():
    # Anyone who can reach a bound endpoint can publish: a publisher storing hash after hash
    # that it never removes, or naming a new medium on every event, grew what kvd kept of
    # the engine without end. kvd follows at most max_blocks blocks and MAX_MEDIA media per
    # engine, drops the rest and counts it; blocks already followed keep being followed.
    import tracemalloc

    from kvd.kv_events import MAX_MEDIA, Residency

    res = Residency("e", max_blocks=1000)
    res.apply([stored([1, 2])])
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for batch in range(100):
        res.apply([stored(list(range(10 + batch * 1000, 10 + (batch + 1) * 1000)))])
        res.apply([stored([1], medium=f"medium-{batch}")])
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(res.blocks) == 1000
    assert len(res.by_medium()) <= MAX_MEDIA
    assert res.num_dropped == 100 * 1000 - 998 + 100 - (MAX_MEDIA - 1)
    assert grown < 1000 * 400  # what 1,000 blocks take, not 100,000
    # What was followed before the flood still is: removed, and stored again in its place.
    res.apply([{"type": "BlockRemoved", "block_hashes": [1, 2], "medium": None}])
    res.apply([stored([3])])
    assert 3 in res.blocks and 1 not in res.blocks and len(res.blocks) == 999


async def test_a_running_kvd_follows_an_engine_up_to_its_max_blocks(tmp_path):
    config, endpoint, replay = engine_gpu0(tmp_path, "max_blocks = 100")
    port = free_port()
    engine = (("engine", "gpu0"),)
    publisher = Publisher(endpoint, replay)
    try:
        with LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}",
                      workdir=tmp_path):
            publisher.publish([stored(list(range(1000)))])

            async def applied():
                publisher.publish([])
                return scrape(port)[1].get(("kvd_engine_events_dropped_total", engine)) == 900

            await _until(applied)

            async def walked():  # what the engine holds is walked every second or so
                return gpu_blocks() is not None

            def gpu_blocks():
                return scrape(port)[1].get(("kvd_engine_blocks", engine + (("medium", "GPU"),)))

            await _until(walked)
            assert gpu_blocks() == 100
    finally:
        publisher.close()
