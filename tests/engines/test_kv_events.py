"""kvd follows engines' KV cache events: the real publishers of vLLM
(vllm.distributed.kv_events.ZmqEventPublisher) and SGLang
(sglang.srt.disaggregation.kv_events.ZmqEventPublisher) send their own event classes, and
kvd's subscriber (kvd.kv_events) keeps what each engine holds, recovering batches lost on
the way through the publisher's replay socket."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "stand_ins"))  # see test_sglang
warnings.filterwarnings("ignore", message="Only CUDA")

from kvd.kv_events import Residency, Subscriber, hash_key  # noqa: E402

vllm_events = pytest.importorskip("vllm.distributed.kv_events")
sglang_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_publisher(endpoint: str, replay: str):
    return vllm_events.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)


def sglang_publisher(endpoint: str, replay: str):
    return sglang_events.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)


def vllm_batch(events, m):
    return m.KVEventBatch(ts=time.time(), events=events)


STORED = {
    "vllm": lambda m, hashes, medium: m.BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))),
        block_size=16, lora_id=None, medium=medium, lora_name=None),
    "sglang": lambda m, hashes, medium: m.BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))),
        block_size=16, lora_id=None, medium=medium),
}


async def _wait(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_the_real_publishers_events_are_followed_and_gaps_replayed(engine, tmp_path):
    m = vllm_events if engine == "vllm" else sglang_events
    endpoint = f"ipc://{tmp_path}/events"
    replay = f"tcp://127.0.0.1:{free_port()}"
    publisher = (vllm_publisher if engine == "vllm" else sglang_publisher)(endpoint, replay)
    res = Residency(engine, tenant="t")
    sub = Subscriber(res, endpoint, replay)
    task = asyncio.ensure_future(sub.run())
    try:
        stored = STORED[engine]
        # Published before kvd is sure to be subscribed (ZMQ's slow joiner): the replay
        # socket brings whatever the SUB socket missed once a later batch shows the gap.
        publisher.publish(vllm_batch([stored(m, [1, 2, 3], "GPU")], m))
        await asyncio.sleep(0.3)
        publisher.publish(vllm_batch([stored(m, [4], "GPU")], m))
        await _wait(lambda: res.last_seq == 1)
        assert set(res.blocks) == {1, 2, 3, 4}
        # Two batches lost on the way on purpose: both come back by replay, in order.
        sub.drop_next = 2
        publisher.publish(vllm_batch([m.BlockRemoved(block_hashes=[2], medium="GPU")], m))
        publisher.publish(vllm_batch([stored(m, [5, 6], "CPU")], m))
        publisher.publish(vllm_batch([m.BlockRemoved(block_hashes=[5], medium="CPU")], m))
        await _wait(lambda: res.last_seq == 4)
        assert res.num_replayed >= 2 and res.num_lost == 0
        assert res.blocks == {1: {"GPU"}, 3: {"GPU"}, 4: {"GPU"}, 6: {"CPU"}}
        assert sorted(res.gpu_hashes()) == [1, 3, 4]
        publisher.publish(vllm_batch([m.AllBlocksCleared()], m))
        await _wait(lambda: res.last_seq == 5)
        assert res.blocks == {}
    finally:
        task.cancel()
        publisher.shutdown()


def test_bytes_hashes_fold_to_the_ints_vllm_publishes():
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    h = bytes(range(32))
    assert hash_key(h) == maybe_convert_block_hash(h)


def test_vllms_own_decoder_reads_what_kvd_publishes(tmp_path):
    # kvd's tiers in the engines' format: vLLM's msgspec decoder of KVEventBatch (what a
    # KV-aware router reading vLLM's stream uses) takes kvd's batches as they are.
    import msgspec
    import zmq

    from kvd_client import Client
    from kvd_loadgen.local import LocalKvd

    endpoint = f"ipc://{tmp_path}/kvd-ev"
    config = tmp_path / "kvd.toml"
    config.write_text(f'[server]\nkv_events_endpoint = "{endpoint}"\n'
                      '[[pool]]\nmodel = "tiny"\nblock_tokens = 16\ndevice_pages = 8\n'
                      'host_pages = 8\n')
    decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
    keys = [bytes([i]) * 32 for i in range(1, 4)]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
            sub.connect(endpoint)
            time.sleep(0.3)  # the SUB joins before kvd has anything to say
            with Client(kvd.target) as c:
                c.admit("r", prompt_tokens=48)
                c.store("r", "ns", keys)
                c.commit("r", "ns", keys)
            assert sub.poll(10_000), "kvd published nothing"
            _topic, seq, payload = sub.recv_multipart()
            batch = decoder.decode(payload)
    finally:
        sub.close(0)
        ctx.term()
    assert int.from_bytes(seq, "big") == 0
    [event] = batch.events
    assert isinstance(event, vllm_events.BlockStored)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    assert sorted(event.block_hashes) == sorted(maybe_convert_block_hash(k) for k in keys)
    assert event.medium == "CPU" and event.block_size == 16
