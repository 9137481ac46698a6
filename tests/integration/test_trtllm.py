"""TensorRT-LLM beside kvd (it cannot run here: no CPU inference). kvd polls a server's
`/kv_cache_events` and follows its blocks; kvd's MemoryIntent maps to the retention
TensorRT-LLM takes per request.

The fixtures are typed from TensorRT-LLM's KVCacheEventSerializer (tensorrt_llm/_utils.py,
TensorRT-LLM 1.x: {event_id, data: {type: created | stored | removed | updated, ...},
window_size, attention_dp_rank?}, what trtllm-serve's POST /kv_cache_events returns, each
call draining the queue) and its KvCacheRetentionConfig docs; the HTTP server here stands in
for trtllm-serve."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvd.kv_events import Residency, TrtllmPoller, from_trtllm
from kvd_client.trtllm import DEFAULT_PRIORITY, retention
from kvd_loadgen.local import LocalKvd

from .conftest import free_port


def stored(event_id, hashes, level=0, parent=None):
    return {"event_id": event_id, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent, "blocks": [
            {"type": "stored_block", "block_hash": h, "cache_level": level, "priority": 35,
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                        for t in range(4)]} for h in hashes]}}


def removed(event_id, hashes):
    return {"event_id": event_id, "window_size": 64,
            "data": {"type": "removed", "block_hashes": hashes}}


def offloaded(event_id, h):
    return {"event_id": event_id, "window_size": 64, "data": {
        "type": "updated", "block_hash": h,
        "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
        "priority": {"type": "event_diff", "new_value": 35, "old_value": 35}}}


CREATED = {"event_id": 0, "window_size": 64,
           "data": {"type": "created", "num_blocks_per_cache_level": [128, 256]}}


class FakeTrtllmServe:
    """POST /kv_cache_events: the events queued since the last call, as trtllm-serve."""

    def __init__(self) -> None:
        self.queue: list[dict] = []
        self.lock = threading.Lock()
        self.polls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                with outer.lock:
                    body, outer.queue = json.dumps(outer.queue).encode(), []
                    outer.polls += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/kv_cache_events"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def add(self, *events) -> None:
        with self.lock:
            self.queue.extend(events)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_trtllm_events_become_the_blocks_an_engine_holds():
    res = Residency("trt")
    res.apply(from_trtllm([CREATED, stored(1, [11, 12, 13]), offloaded(2, 12),
                           removed(3, [13]), stored(4, [2**64 + 5], level=1)]))
    assert res.blocks == {11: {"GPU"}, 12: {"CPU"}, 5: {"CPU"}}  # hashes as 64-bit values
    poller = TrtllmPoller(res, "http://unused")
    poller.receive([stored(5, [21]), stored(8, [22])])  # 6 and 7 never came
    poller.receive([stored(8, [22])])  # a repeat changes nothing
    assert res.num_lost == 2 and res.blocks[21] == {"GPU"} and poller.last_id == 8


def test_trtllm_items_kvd_cannot_read_are_counted_and_the_rest_applied():
    res = Residency("trt")
    poller = TrtllmPoller(res, "http://unused")
    poller.receive([stored(1, [11]), {"event_id": 2, "data": {"type": "stored",
                                                             "blocks": [{"x": 1}, 5]}},
                    {"event_id": 3, "data": {"type": "removed", "block_hashes": 7}},
                    {"event_id": 4, "data": {"type": "updated", "cache_level": {}}},
                    {"event_id": 5, "data": {"type": "stored", "blocks": [
                        {"block_hash": 12, "cache_level": [1]}]}},
                    {"event_id": "6"}, "junk", stored(7, [13])])
    assert res.blocks == {11: {"GPU"}, 13: {"GPU"}} and poller.last_id == 7
    assert res.num_malformed == 7


def test_a_trtllm_server_that_starts_again_is_followed_from_its_new_start():
    # trtllm-serve's first event is `created` (its cache pools made), its ids from 0 again.
    res = Residency("trt")
    poller = TrtllmPoller(res, "http://unused")
    poller.receive([CREATED, stored(1, [11, 12]), stored(2, [13])])
    poller.receive([CREATED, stored(1, [21])])
    assert res.blocks == {21: {"GPU"}} and poller.last_id == 1
    assert res.num_lost == 0 and res.num_restarts == 1


async def test_kvd_polls_a_trtllm_server_and_counts_its_gpu_blocks(tmp_path):
    server = FakeTrtllmServe()
    port = free_port()
    config = tmp_path / "kvd.toml"
    config.write_text('[[pool]]\nmodel = "tiny"\ndevice_pages = 8\nhost_pages = 8\n'
                      f'[[engine]]\nname = "trt0"\nurl = "{server.url}"\npoll_s = 0.05\n'
                      'tenant = "t"\n')
    try:
        with LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}",
                      workdir=tmp_path):
            server.add(CREATED, stored(1, [1, 2, 3]), stored(2, [4], parent=3),
                       offloaded(3, 4))
            deadline = time.monotonic() + 10
            while True:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
                samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                           for f in text_string_to_metric_families(text.decode())
                           for s in f.samples}
                if samples.get(("kvd_engine_blocks", (("engine", "trt0"),
                                                       ("medium", "CPU")))) == 1:
                    break
                assert time.monotonic() < deadline, "kvd never saw the events"
                time.sleep(0.05)
    finally:
        server.close()
    assert samples[("kvd_engine_blocks", (("engine", "trt0"), ("medium", "GPU")))] == 3
    assert samples[("kvd_engine_gpu_blocks", (("engine", "trt0"), ("tenant", "t")))] == 3


@pytest.mark.parametrize("intent, priority, duration_ms", [
    ({"pin_requested": True}, 100, None),
    ({"priority": 4}, 100, None),  # DECODE_CRITICAL implies pinned
    ({"priority": 3, "deadline_us": 2_500_000}, 80, 2500),
    ({"priority": 2}, 50, None),
    ({"priority": 1, "deadline_us": 500}, 10, 1),
    ({"priority": 3, "request_priority": 100}, 89, None),
    ({}, DEFAULT_PRIORITY, None),
])
def test_an_intent_maps_to_trtllms_retention(intent, priority, duration_ms):
    r = retention(intent)
    [span] = r.token_range_retention_configs
    assert (span.token_start, span.token_end) == (0, None)
    assert (span.priority, span.duration_ms) == (priority, duration_ms)
    assert (r.decode_retention_priority, r.decode_duration_ms) == (priority, duration_ms)


TRT_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**70) | st.text(max_size=3)
    | st.sampled_from(["stored", "removed", "updated", "created", "stored_block"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["event_id", "data", "type", "blocks", "block_hash", "block_hashes",
                         "cache_level", "new_value"]), inner, max_size=4),
    max_leaves=16)


# Items shaped like trtllm-serve's, whatever their parts hold; and any JSON at all.
TRT_ITEMS = st.fixed_dictionaries(
    {"event_id": st.integers(0, 20), "data": st.fixed_dictionaries(
        {"type": st.sampled_from(["stored", "removed", "updated", "created"])},
        optional={"blocks": st.lists(st.fixed_dictionaries(
                      {}, optional={"block_hash": TRT_JSON, "cache_level": TRT_JSON}) | TRT_JSON,
                      max_size=3) | TRT_JSON,
                  "block_hashes": TRT_JSON, "block_hash": TRT_JSON,
                  "cache_level": st.fixed_dictionaries(
                      {}, optional={"new_value": TRT_JSON}) | TRT_JSON})}) | TRT_JSON


@settings(max_examples=400, deadline=None)
@given(st.lists(TRT_ITEMS, max_size=5))
def test_whatever_a_trtllm_server_answers_the_poller_follows_on(items):
    # Any JSON list off /kv_cache_events (a server of another version, a proxy's error
    # page as JSON): nothing raises out of receive() (the poller's task would end), and a
    # sound event after it is applied.
    res = Residency("trt")
    poller = TrtllmPoller(res, "http://unused")
    poller.receive(items)
    last = max([poller.last_id, *(i["event_id"] for i in items if isinstance(i, dict)
                                  and type(i.get("event_id")) is int)])
    poller.receive([stored(last + 1, [77])])
    assert 77 in res.blocks and poller.last_id == last + 1
