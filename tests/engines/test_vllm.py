"""A real vLLM engine (CPU build, tiny random-weight Llama) uses kvd through its KV connector.

Each engine run is a process of its own, so the second run starts with vLLM's own prefix
cache empty: whatever prefix it does not compute came from kvd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest

from kvd_client import AsyncClient, Client, pb
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

pytest.importorskip("vllm")

RUNNER = Path(__file__).resolve().parent / "run_vllm.py"
# One vLLM block (32 tokens) of both layers: 2 x 32 tokens x 1 KV head x (K+V) 128 x 2 bytes.
PAGE_BYTES = 2 * 32 * 128 * 2
KVD = ("--page-bytes", str(PAGE_BYTES), "--block-tokens", "32", "--device-pages", "64",
       "--host-pages", "128")


def prompts(first: int, count: int = 3) -> list[list[int]]:
    """`count` prompts of 104 tokens sharing their first two blocks, unlike any other set
    (`first` below 448: the test model has 512 tokens)."""
    shared = list(range(first, first + 64))
    return [shared + [(first + 64 + 40 * i + j) % 500 + 10 for j in range(40)]
            for i in range(count)]


PROMPTS = prompts(10)


class Engine:
    """An engine process running batches of prompts (see run_vllm.py); with pause, it waits
    for go() between batches."""

    def __init__(self, target: str, batches: list[dict], pause: bool = False,
                 kv_events: tuple[str, str] | None = None, tenants: list[str] = (),
                 max_model_len: int = 1024, step_s: float = 0.0,
                 gpu_blocks: int | None = None, save_output: bool = False,
                 chunk: int | None = None) -> None:
        spec = json.dumps({"batches": batches, "pause": pause, "kv_events": kv_events,
                           "tenants": list(tenants), "max_model_len": max_model_len,
                           "step_s": step_s, "gpu_blocks": gpu_blocks,
                           "save_output": save_output, "chunk": chunk})
        # A session of its own: killing it takes vLLM's engine-core and worker processes
        # too, which a kill of the runner alone would leave running (about 2 GB each pair).
        self.proc = subprocess.Popen([sys.executable, str(RUNNER), target, spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []

    def result(self, timeout_s: float = 240) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if line.startswith("KVD_RESULT "):
                return json.loads(line.removeprefix("KVD_RESULT "))
        self.kill()
        raise AssertionError("engine ended without a result:\n"
                             + "".join(self.lines)[-2000:] + self.proc.stderr.read()[-4000:])

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """The runner and every process it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        self.kill()
        self.proc.wait()


def engine_run(target: str, prompts, params=None, **options) -> dict:
    """One batch on a fresh engine (`options`: Engine's)."""
    engine = Engine(target, [{"prompts": prompts, "params": params}], **options)
    try:
        return engine.result()
    finally:
        engine.close()


def vllm_config(target: str, dtype: str = "bfloat16", cache_dtype: str = "auto",
                extra: dict | None = None, **parallel):
    """vLLM's real configuration of the test model with kvd's connector at `target` (and
    the connector's `extra` settings)."""
    from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             VllmConfig)

    return VllmConfig(
        model_config=ModelConfig(model=str(RUNNER.parent / "tiny_llama"),
                                 skip_tokenizer_init=True, dtype=dtype, max_model_len=1024),
        cache_config=CacheConfig(block_size=32, cache_dtype=cache_dtype),
        parallel_config=ParallelConfig(**parallel),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvdConnector", kv_role="kv_both",
            kv_connector_module_path="kvd_client.vllm_connector",
            kv_connector_extra_config={"kvd_target": target, **(extra or {})}))


class Waiting:
    """What the connector's scheduler side reads of a vLLM request."""

    def __init__(self, request_id: str) -> None:
        self.request_id, self.cache_salt, self.kv_transfer_params = request_id, None, None
        self.prompt_token_ids, self.block_hashes = list(range(64)), [b"h0", b"h1"]
        self.sampling_params, self.priority = None, 0


def test_the_test_models_weights_follow_its_config(tmp_path, monkeypatch):
    # The weights are made once per checkout: a config changed since makes them again,
    # else a model of other shapes would load weights that do not fit it.
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_vllm_under_test", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    config = json.loads((runner.MODEL / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(runner, "MODEL", tmp_path)
    monkeypatch.setattr(runner, "WEIGHTS", tmp_path / "model.safetensors")
    runner.ensure_weights()
    made = runner.WEIGHTS.read_bytes()
    runner.ensure_weights()  # the same config: kept as it is
    assert runner.WEIGHTS.read_bytes() == made
    (tmp_path / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    runner.ensure_weights()
    from safetensors import safe_open

    with safe_open(str(runner.WEIGHTS), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_shape() == [
            128, config["hidden_size"]]
    assert not list(tmp_path.glob("*.part"))


@pytest.mark.timeout(600)  # three engine starts of ~30 s each
def test_a_fresh_engine_takes_its_prefix_from_kvd_and_computes_the_same_tokens(tmp_path):
    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        first = engine_run(kvd.target, PROMPTS)
        with Client(kvd.target) as c:
            tenants = {t.tenant: t for t in c.list_tenants()}
            stats = c.pool_stats().pools[0]
        # Every prompt's three full blocks were stored once: the shared two and one each.
        assert stats.tiers[0].used_pages == 2 + 3
        assert tenants["engine"].device_pages == 5
        second = engine_run(kvd.target, PROMPTS)
        # The control: the same prefix with its bytes in kvd spoiled must change the output,
        # else equal outputs would prove nothing.
        with Client(kvd.target) as c:
            arena = MappedPool(c.export_pool())
            arena.tiers[pb.TIER_DEVICE][:] ^= 0x55
            arena.close()
        spoiled = engine_run(kvd.target, PROMPTS)
    print(f"\nrun 1: {first}\nrun 2: {second}\nspoiled: {spoiled}")
    # All but the last (partial) block of each 104-token prompt came from kvd.
    assert second["cached"] == [96, 96, 96]
    assert second["tokens"] == first["tokens"]
    assert spoiled["cached"] == [96, 96, 96] and spoiled["tokens"] != first["tokens"]


@pytest.mark.timeout(600)  # two engine starts of ~30 s each, and their batches
def test_a_prompt_prefilled_in_chunks_is_stored_only_in_computed_blocks(tmp_path):
    # A prompt longer than a step's token budget is prefilled over several steps (vLLM's
    # chunked prefill; a long prompt in production), a chunk ending mid-block. A block is
    # stored only once every token of it is computed: a fresh engine loading the prefix
    # must make the tokens of the engine that computed it.
    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        computed = engine_run(kvd.target, PROMPTS, chunk=48)  # 1.5 blocks a step
        with Client(kvd.target) as c:
            stats = c.pool_stats().pools[0]
        fresh = engine_run(kvd.target, PROMPTS)
    print(f"\ncached tokens: computed in chunks {computed['cached']}, then {fresh['cached']}")
    assert computed["cached"] == [0, 64, 64]  # its own cache: the shared two blocks
    # Each prompt's 3 whole blocks, the first two shared: 2 + 3 x 1 stored.
    assert stats.num_prefix_stored == 5
    assert fresh["cached"] == [96, 96, 96]
    assert fresh["tokens"] == computed["tokens"]


@pytest.mark.timeout(600)  # two engine starts of ~30 s each
def test_the_engine_serves_through_a_kvd_restart_and_then_uses_the_new_kvd(tmp_path):
    before, away, after = prompts(100), prompts(200), prompts(300)
    kvd = LocalKvd(*KVD, workdir=tmp_path).start()
    engine = Engine(kvd.target, [{"prompts": before}, {"prompts": away}, {"prompts": after}],
                    pause=True)
    try:
        first = engine.result()
        with Client(kvd.target) as c:
            assert c.pool_stats().pools[0].tiers[0].used_pages == 5
        kvd.stop()  # kvd goes away mid-run
        engine.go()
        served = engine.result()  # computed without kvd
        kvd = LocalKvd(*KVD, workdir=tmp_path).start()  # a new, empty kvd on the same socket
        time.sleep(3.5)  # the client's reconnect backoff (2 s) and the connector's pause (1 s)
        engine.go()
        back = engine.result()
    finally:
        engine.close()
    try:
        with Client(kvd.target) as c:
            stats = c.pool_stats().pools[0]
        # The new kvd was used: the last batch's blocks were stored in it...
        assert stats.tiers[0].used_pages == 5
        # ...through its own arenas, not the old kvd's: a fresh engine loads them and
        # computes the same tokens.
        fresh = engine_run(kvd.target, after)
    finally:
        kvd.stop()
    print(f"\nbefore: {first}\naway: {served}\nback: {back}\nfresh: {fresh}")
    assert all(len(t) == 8 for t in served["tokens"])
    assert fresh["cached"] == [96, 96, 96] and fresh["tokens"] == back["tokens"]


def watch_events(target: str, kinds: list[str]) -> list:
    """Every event of these kinds kvd publishes, collected on a thread of its own while the
    test runs."""
    seen: list = []
    subscribed = threading.Event()

    async def watch():
        try:
            async with AsyncClient(target) as c:
                async for e in c.watch_events(kinds=kinds, on_subscribed=subscribed.set):
                    seen.append(e)
        except Exception:  # kvd stopped at the end of the test
            pass

    threading.Thread(target=lambda: asyncio.run(watch()), daemon=True).start()
    assert subscribed.wait(30)  # subscribed before the engine starts
    return seen


def admissions(events: list) -> list[tuple[str, str, str]]:
    """(request id, decision, reason) of each admission event."""
    return [(e.request_id, e.detail["decision"].lower(), e.detail["reason"]) for e in events]


# The engine's tenant may hold at most 5 pages: one request (104 prompt + 8 output tokens,
# 4 pages) at a time.
LIMITED = f"""
[[pool]]
name = "default"
policy = "fair"
page_bytes = {PAGE_BYTES}
block_tokens = 32
device_pages = 64
host_pages = 128

[[tenant]]
name = "engine"
limit = 5
"""


@contextlib.contextmanager
def limited_kvd(tmp_path):
    """A kvd whose tenant "engine" runs one request at a time (LIMITED), and the admission
    events it publishes (watch_events)."""
    config = tmp_path / "kvd.toml"
    config.write_text(LIMITED)
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        yield kvd, watch_events(kvd.target, ["admission"])


@pytest.mark.timeout(600)
def test_a_request_waits_while_its_tenants_kvd_budget_is_spent_then_runs(tmp_path):
    with limited_kvd(tmp_path) as (kvd, events):
        ran = engine_run(kvd.target, prompts(100, 2))
        time.sleep(0.5)
    seen = admissions(events)
    print(f"\nrun: {ran}\nadmissions: {seen}")
    assert all(len(t) == 8 for t in ran["tokens"])
    queued = [rid for rid, decision, _ in seen if "queued" in decision]
    assert len(queued) == 1  # the second waited in kvd's queue while the first ran...
    assert (queued[0], "from the queue") in [(rid, reason) for rid, _, reason in seen]


@pytest.mark.timeout(600)
def test_a_request_aborted_while_kvd_queues_it_leaves_kvd(tmp_path):
    # The second request waits in kvd's queue behind the first (its tenant's budget is
    # spent); its client goes away meanwhile. vLLM tells the connector it finished: kvd
    # must forget it, not admit it later for a request nobody runs (holding the tenant's
    # budget for as long as the engine lives).
    with limited_kvd(tmp_path) as (kvd, events):
        engine = Engine(kvd.target, [{"prompts": prompts(300, 2), "abort": [1]}], pause=True)
        try:
            ran = engine.result()
            with Client(kvd.target) as c:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    stats = c.pool_stats().pools[0]
                    if not stats.num_requests and not stats.num_queued:
                        break
                    time.sleep(0.2)
        finally:
            engine.close()
    seen = admissions(events)
    print(f"\nrun: {ran}\nadmissions: {seen}")
    assert len(ran["tokens"][0]) == 8 and ran["tokens"][1] is None
    assert [decision for _, decision, _ in seen].count("queued") == 1  # it did wait
    assert (stats.num_requests, stats.num_queued) == (0, 0)


# Two tenants of equal weight: a fair share of 8 device pages each; the host tier is too
# small to keep what the device tier lets go.
TWO_TENANTS = f"""
[[pool]]
name = "default"
policy = "fair"
page_bytes = {PAGE_BYTES}
block_tokens = 32
device_pages = 16
host_pages = 2

[[tenant]]
name = "a"

[[tenant]]
name = "b"
"""


@pytest.mark.timeout(600)
def test_the_tenant_over_its_share_loses_its_kept_prefixes_first(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text(TWO_TENANTS)
    quiet = [prompts(100 + 40 * i, 1)[0] for i in range(2)]  # 3 blocks each, none shared
    greedy = [prompts(200 + 40 * i, 1)[0] for i in range(6)]
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        engine = Engine(kvd.target, [
            {"prompts": quiet, "params": [{"kvd": {"tenant": "b"}}] * len(quiet)},
            {"prompts": greedy, "params": [{"kvd": {"tenant": "a"}}] * len(greedy)}],
            tenants=["a", "b"])
        try:
            runs = [engine.result(), engine.result()]
        finally:
            engine.close()
        with Client(kvd.target) as c:
            tenants = {t.tenant: t for t in c.list_tenants()}
    print(f"\nruns: {runs}\ntenants: {tenants}")
    a, b = tenants["a"], tenants["b"]
    # a stored 18 pages into a device tier of 16: what went was a's own, b's 6 survive.
    assert a.evictions_suffered > 0
    assert b.evictions_suffered == 0 and b.device_pages == 6
    assert a.device_pages <= 16 - 6


@pytest.mark.timeout(300)
def test_a_request_names_only_a_listed_tenant_and_bad_params_do_not_stop_the_engine(tmp_path):
    # Whoever sends vLLM's API server a request writes its kv_transfer_params. The connector
    # took the tenant from there: a client could name another's tenant, or a new one per
    # request, each with a fair share of its own; and a field of the wrong type (a string
    # priority, say) raised in the scheduler and stopped the engine for everyone.
    params = [{"kvd": {"tenant": "a"}},
              {"kvd": {"tenant": "mallory"}},  # not in kvd_tenants: runs as "engine"
              {"kvd": "chat"},
              {"kvd": {"tenant": 7, "priority": "high"}},
              {"kvd": {"priority": 10**12, "deadline_ms": -5}},
              {"kvd": {"pin": "yes", "deadline_ms": "soon", "priority": 3}}]
    batch = [prompts(10 + 70 * i, 1)[0] for i in range(len(params))]
    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        events = watch_events(kvd.target, ["admission"])
        engine = Engine(kvd.target, [{"prompts": batch, "params": params}], tenants=["a"])
        try:
            run = engine.result()
        finally:
            engine.close()
        time.sleep(0.5)
    tenants = [e.tenant for e in events]
    print(f"\nrun: {run}\nadmitted for: {tenants}")
    assert [len(t) for t in run["tokens"]] == [8] * len(params)
    assert sorted(tenants) == ["a"] + ["engine"] * (len(params) - 1)


def test_kvd_tenants_and_request_params_are_read_strictly():
    from kvd_client.vllm_connector import allowed_tenants, clamp_priority, kvd_params

    assert allowed_tenants(None) == allowed_tenants("") == frozenset()
    assert allowed_tenants("*") is None
    assert allowed_tenants("a, b") == allowed_tenants(["a", "b"]) == {"a", "b"}
    with pytest.raises(ValueError, match="kvd_tenants"):
        allowed_tenants(7)
    assert kvd_params(None, "e", None) == kvd_params({"other": 1}, "e", None)
    assert kvd_params({"kvd": {"tenant": "x"}}, "e", None).tenant == "x"  # "*"
    assert kvd_params({"kvd": {"tenant": "x"}}, "e", frozenset({"y"})).tenant == "e"
    good = kvd_params({"kvd": {"priority": -3, "pin": True, "deadline_ms": 1.5}}, "e", None)
    assert (good.priority, good.problems) == (-3, ())
    assert good.intent == pb.MemoryIntent(pin_requested=True, deadline_us=1500)
    for bad in ({"priority": True}, {"priority": 2**31}, {"priority": 1.0},
                {"pin": 1}, {"deadline_ms": float("inf")}, {"deadline_ms": float("nan")},
                {"deadline_ms": True}, {"tenant": ["a"]}):
        params = kvd_params({"kvd": bad}, "e", None)
        assert (params.tenant, params.priority, params.intent) == ("e", None, None), bad
        assert len(params.problems) == 1, bad
    assert clamp_priority(2**40) == 2**31 - 1 and clamp_priority(-(2**40)) == -(2**31)
    # A setting of the wrong type stops the engine's start with its name, not silently.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client.vllm_connector import KvdConnector

    for bad in ("true", 1, None):
        with pytest.raises(ValueError, match="kvd_save_output"):
            KvdConnector(vllm_config("unix:///nowhere", extra={"kvd_save_output": bad}),
                         KVConnectorRole.WORKER)
    # And every other: float() took a negative timeout (every call failed, and the engine
    # ran without kvd, saying nothing), and a policy vLLM lacks went into its config.
    for extra, says in (({"kvd_timeout_s": -1}, "kvd_timeout_s: Input should be greater"),
                        ({"kvd_load_failure_policy": "retry"}, "kvd_load_failure_policy"),
                        ({"kvd_timout_s": 3}, "kvd_timout_s: not a setting")):
        with pytest.raises(ValueError, match=f"kv_connector_extra_config: {says}"):
            KvdConnector(vllm_config("unix:///nowhere", extra=extra),
                         KVConnectorRole.SCHEDULER)


def test_a_request_whose_max_tokens_outruns_the_model_is_admitted_for_its_context(tmp_path):
    # max_tokens past AdmitRequest's uint32 raised in vLLM's scheduler and stopped the
    # engine; and no request outgrows the model's context, whatever max_tokens says, so
    # kvd is told what it can grow to.
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        events = watch_events(kvd.target, ["admission"])
        scheduler = vc.KvdConnector(vllm_config(kvd.target), KVConnectorRole.SCHEDULER)
        request = Waiting("r")  # 64 prompt tokens, of a model of 1024
        request.sampling_params = SimpleNamespace(max_tokens=2**40)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        time.sleep(0.3)
        scheduler.client.close()
    assert [(e.request_id, e.count) for e in events] == [("r", 1024 // 32)]  # its pages


@pytest.mark.timeout(300)
def test_kvd_follows_a_running_engines_gpu_blocks_by_its_kv_events(tmp_path):
    # vLLM connects its PUB socket to a plain tcp:// address: kvd binds it on loopback;
    # vLLM binds its replay socket, here an ipc:// path.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/replay"
    config = tmp_path / "kvd.toml"
    config.write_text(
        f'[[pool]]\npage_bytes = {PAGE_BYTES}\nblock_tokens = 32\ndevice_pages = 64\n'
        f'host_pages = 128\n[[engine]]\nname = "vllm"\nendpoint = "{endpoint}"\n'
        f'replay_endpoint = "{replay}"\nbind = true\ntenant = "other"\n')
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        engine = Engine(kvd.target, [{"prompts": PROMPTS}], kv_events=(endpoint, replay))
        try:
            run = engine.result()
            with Client(kvd.target) as c:
                # kvd takes the engine's events as they come: wait for all five blocks (the
                # first figures seen may be of the first events only).
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    gpu = {t.tenant: t.engine_gpu_blocks for t in c.list_tenants()}
                    if gpu.get("engine", 0) >= 5:
                        break
                    time.sleep(0.2)
        finally:
            engine.close()
    print(f"\nrun: {run}\nGPU blocks by tenant, from the engine's events: {gpu}")
    # The five full blocks of the three prompts (two shared, one each) are on the engine's
    # GPU, and kvd keeps each under the same hash for tenant "engine": all count to it.
    assert gpu.get("engine") == 5 and not gpu.get("other")


@pytest.mark.timeout(300)
def test_a_requests_pin_and_deadline_reach_kvd_and_go_with_it(tmp_path):
    # {"pin": true, "deadline_ms": ...} in kv_transfer_params: the connector stores the
    # prompt's blocks with that intent (kvd would refuse an intent it does not take, and
    # nothing would be stored); the pins go when vLLM finishes the requests.
    from kvd_client.vllm_connector import block_intent

    assert block_intent({"pin": True, "deadline_ms": 250}) == pb.MemoryIntent(
        pin_requested=True, deadline_us=250_000)
    assert block_intent({"tenant": "x"}) is None
    assert block_intent({"pin": "yes", "deadline_ms": float("nan")}) is None  # ignored
    params = [{"kvd": {"pin": True, "deadline_ms": 250}}] * len(PROMPTS)
    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        run = engine_run(kvd.target, PROMPTS, params)
        with Client(kvd.target) as c:
            device = c.pool_stats().pools[0].tiers[0]
    print(f"\nrun: {run}")
    assert device.used_pages == 5 and device.pinned_pages == 0


@pytest.mark.timeout(300)
def test_each_worker_of_a_tensor_parallel_engine_gets_back_its_own_shard(tmp_path,
                                                                         monkeypatch):
    # The workers of a tensor-parallel engine each hold their own heads of every block, under
    # the same block hash. Named alike in kvd, the second worker's store found the first's
    # pages and wrote nothing, and both loaded the first worker's heads. Two workers of a
    # TP=2 engine: vLLM's real config and the connector's real worker side against a real
    # kvd; each worker is told its rank as vLLM's parallel state would tell it (one process
    # cannot form a tensor-parallel group, and this machine cannot run two vLLM workers).
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        config = vllm_config(kvd.target, tensor_parallel_size=2)
        namespace, keys = "tiny|32|", [b"block-0", b"block-1", b"block-2"]
        with Client(kvd.target) as c:
            assert c.admit("r", 96, 8).decision == pb.DECISION_ADMITTED
        workers, caches = [], []
        gen = torch.Generator().manual_seed(7)
        for rank in (0, 1):
            monkeypatch.setattr(vc.KvdConnector, "_ranks", lambda self, r=rank: (r, 0, 0),
                                raising=False)
            worker = vc.KvdConnector(config, KVConnectorRole.WORKER)
            # Two layers of 8 blocks, 32 tokens x 128 bf16 each: one kvd page a block.
            layers = {f"layer.{i}": torch.randint(-2**15, 2**15, (8, 32, 128), generator=gen,
                                                  dtype=torch.int16).view(torch.bfloat16)
                      for i in range(2)}
            worker.register_kv_caches(layers)
            # Both workers store blocks 0 and 1; the first also block 2.
            worker.bind_connector_metadata(vc.KvdConnectorMetadata(saves=[vc._Transfer(
                "r", namespace, keys[:3 - rank], list(range(3 - rank)))]))
            worker.wait_for_save()
            workers.append(worker)
            caches.append(layers)
        for worker, layers in zip(workers, caches):
            worker.bind_connector_metadata(vc.KvdConnectorMetadata(loads=[vc._Transfer(
                "r", namespace, keys[:2], [4, 5])]))
            worker.start_load_kv(None)
            assert worker.get_block_ids_with_load_errors() == set()
            for name, t in layers.items():
                assert torch.equal(t[4:6].view(torch.int16), t[0:2].view(torch.int16)), \
                    f"worker {workers.index(worker)}, {name}: another worker's heads"
        # A block counts as a hit while kvd holds every worker's shard of it.
        scheduler = vc.KvdConnector(config, KVConnectorRole.SCHEDULER)
        assert scheduler._lookup(vc._Tracked(namespace, keys)) == 2
        for connector in (*workers, scheduler):
            connector.client.close()


@contextlib.contextmanager
def failing_loads(target: str, tmp_path: Path):
    """A gRPC proxy in front of kvd that passes every unary call through (bytes and metadata
    as they are) but answers each Load with UNAVAILABLE, as when kvd goes away between the
    scheduler's lookup and the worker's load. Yields its target and the Loads it failed."""
    import grpc

    sock = tmp_path / "proxy.sock"
    failed: list[str] = []
    ready = threading.Event()
    stop: list = []

    async def serve() -> None:
        channel = grpc.aio.insecure_channel(target)

        class Pass(grpc.GenericRpcHandler):
            def service(self, details):
                method = details.method

                async def unary(request: bytes, context):
                    if method == "/kvd.v1.Memory/Load":
                        failed.append(method)
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "kvd went away")
                    metadata = [(k, v) for k, v in context.invocation_metadata()
                                if k.startswith(("kvd-", "authorization"))]
                    try:
                        return await channel.unary_unary(method)(request, metadata=metadata)
                    except grpc.aio.AioRpcError as exc:
                        await context.abort(exc.code(), exc.details())

                return grpc.unary_unary_rpc_method_handler(unary)

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((Pass(),))
        server.add_insecure_port(f"unix:{sock}")
        await server.start()
        done = asyncio.Event()
        stop.append((asyncio.get_running_loop(), done))
        ready.set()
        await done.wait()
        await server.stop(None)
        await channel.close()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"unix://{sock}", failed
    finally:
        loop, done = stop[0]
        loop.call_soon_threadsafe(done.set)
        thread.join(10)


@pytest.mark.timeout(600)  # two engine starts of ~30 s each
def test_a_prefix_kvd_cannot_load_after_its_lookup_is_computed_not_an_error(tmp_path):
    # The scheduler's lookup finds a prompt's prefix in kvd; by the time the worker loads it,
    # kvd is gone (or let the blocks go). The connector reports those blocks as not loaded,
    # and vLLM (whose kv_load_failure_policy is "fail" unless told) must recompute them: a
    # miss in a cache is no reason to fail a user's request.
    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        first = engine_run(kvd.target, PROMPTS)
        with failing_loads(kvd.target, tmp_path) as (proxy, failed):
            second = engine_run(proxy, PROMPTS)
        with Client(kvd.target) as c:
            left = c.pool_stats().pools[0].num_requests
    print(f"\nrun 1: {first}\nrun 2 (every Load failed): {second}\nLoads failed: {len(failed)}")
    assert failed  # the lookups hit, and the loads were tried
    assert second["tokens"] == first["tokens"]
    assert left == 0


def test_engines_whose_kv_bytes_differ_name_their_blocks_apart(tmp_path):
    # vLLM's block hashes name tokens, not the bytes an engine keeps for them: engines of
    # one model whose KV caches hold another dtype of the same size (bf16 against fp16, one
    # fp8 format against the other) would load each other's blocks as their own. And a long
    # cache salt must not push the name past what kvd takes (it refused every lookup).
    from vllm.config import ModelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        def namespace(dtype="bfloat16", cache_dtype="auto", salt=None, **model):
            config = vllm_config(kvd.target, dtype, cache_dtype)
            if model:  # the same model at another revision, or quantized
                config.model_config = ModelConfig(
                    model=str(RUNNER.parent / "tiny_llama"), skip_tokenizer_init=True,
                    dtype=dtype, max_model_len=1024, **model)
            connector = vc.KvdConnector(config, KVConnectorRole.SCHEDULER)
            request = Waiting("r")
            request.cache_salt = salt
            connector._track(request)
            connector.client.close()
            return connector.tracked["r"].namespace

        names = {namespace(), namespace(dtype="float16"),
                 namespace(cache_dtype="fp8_e4m3"), namespace(cache_dtype="fp8_e5m2")}
        assert len(names) == 4, names
        assert namespace(cache_dtype="fp8") == namespace(cache_dtype="fp8_e4m3")
        assert namespace(salt="a") != namespace(salt="b")
        # Other weights under one model name: they compute other bytes for the same tokens.
        weights = {namespace(), namespace(revision="v2"), namespace(quantization="fp8")}
        assert len(weights) == 3, weights
        long = [namespace(salt=c * 300) for c in "ab"]
        assert long[0] != long[1]
        with Client(kvd.target) as c:
            for name in long:  # kvd takes the name, and the longest shard suffix after it
                assert c.lookup(name + vc.shard_suffix((99, 99, 99), (100, 100, 100)),
                                [b"h0"]).num_hit == 0


def trace_prompts(pairs: int = 12, depth: int = 6, tail: int = 8) -> list[list[int]]:
    """Prompts with the prefix structure of Mooncake's production trace: `pairs` of its
    conversations, each a request and a later one that shares 2 to `depth` of its first
    blocks (as a conversation's next turn does), every prompt cut to its first `depth`
    blocks plus `tail` tokens of its own. Each hash id is one vLLM block (32 tokens drawn
    from the id), so prompts share blocks wherever the trace's requests do, the trace's
    first block (its system prompt) among all of them."""
    import random

    from kvd_loadgen.data import data_dir

    path = data_dir() / "request-traces" / "mooncake_conversation_trace_head4000.jsonl"
    rows = [json.loads(line)["hash_ids"][:depth] for line in path.open()]
    first: dict[tuple, int] = {}  # a prefix of hash ids -> the first row that had it
    chosen: list[int] = []
    for i, ids in enumerate(rows):
        shared = next((k for k in range(len(ids), 1, -1) if tuple(ids[:k]) in first), 0)
        if shared and first[tuple(ids[:shared])] not in chosen and len(chosen) < 2 * pairs:
            chosen += [first[tuple(ids[:shared])], i]
        for k in range(1, len(ids) + 1):
            first.setdefault(tuple(ids[:k]), i)
    assert len(chosen) == 2 * pairs, "the trace has fewer conversations than asked for"

    def block(hash_id: int) -> list[int]:
        rng = random.Random(hash_id)
        return [rng.randrange(10, 500) for _ in range(32)]

    return [[t for h in rows[i] for t in block(h)]
            + [(7 * i + j) % 490 + 10 for j in range(tail)] for i in sorted(chosen)]


@pytest.mark.timeout(900)  # four engine starts of ~30 s each (two at once), and their batches
def test_under_pressure_fresh_engines_get_back_the_bytes_they_computed(tmp_path):
    # The block model engines use, under pressure: prompts sharing prefix blocks as the
    # trace's requests do, through a kvd whose tiers hold a fraction of the blocks they
    # make, so kvd demotes and drops blocks between one engine's stores and another's
    # loads. Then two fresh engines (replicas of the model: their caches empty, their
    # blocks shared in kvd) run the prompts again at once, one in the trace's order and
    # one in the other: each loads whatever kvd has while the other's stores push blocks
    # out. Every prompt's tokens must be the first engine's, on both.
    prompts_ = trace_prompts()
    batches = [prompts_[i:i + 8] for i in range(0, len(prompts_), 8)]
    small = ("--page-bytes", str(PAGE_BYTES), "--block-tokens", "32", "--device-pages", "12",
             "--host-pages", "12")
    with LocalKvd(*small, workdir=tmp_path) as kvd:
        def run(*orders):
            engines = [Engine(kvd.target, [{"prompts": b} for b in order]) for order in orders]
            try:
                return [[e.result() for _ in order] for e, order in zip(engines, orders)]
            finally:
                for e in engines:
                    e.close()

        [first] = run(batches)
        with Client(kvd.target) as c:
            after_first = c.pool_stats().pools[0]
        forward, backward = run(batches, batches[::-1])
        backward = backward[::-1]
        with Client(kvd.target) as c:
            after_both = c.pool_stats().pools[0]
            # The control: a run with every byte kvd keeps spoiled must change some output,
            # else equal outputs would prove nothing.
            arena = MappedPool(c.export_pool())
            for tier in (pb.TIER_DEVICE, pb.TIER_HOST):
                arena.tiers[tier][:] ^= 0x55
            arena.close()
        [spoiled] = run(batches[::-1])
        spoiled = spoiled[::-1]
    distinct = len({tuple(p[:k]) for p in prompts_ for k in range(32, len(p) + 1, 32)})
    print(f"\n{len(prompts_)} prompts, {distinct} distinct blocks, 12 + 12 pages in kvd")
    for name, stats in (("the first engine", after_first), ("the two", after_both)):
        print(f"after {name}: evictions {stats.num_evictions}, demotions "
              f"{stats.num_demotions}, drops {stats.num_drops}")
    for name, result in (("forward", forward), ("backward", backward)):
        print(f"cached tokens, {name}:", [r["cached"] for r in result])
    assert distinct > 2 * 24  # kvd holds a fraction of the blocks
    # Pressure all along: the engines' stores demoted and dropped what earlier ones made
    # (an engine loads a block from whichever tier holds it).
    assert 0 < after_first.num_evictions < after_both.num_evictions
    assert after_both.num_drops
    # Each one's first batch found nothing in its own cache: what it did not compute came
    # from kvd.
    assert sum(forward[0]["cached"]) > 0 and sum(backward[-1]["cached"]) > 0
    for i, reference in enumerate(first):
        assert forward[i]["tokens"] == reference["tokens"], f"batch {i}, trace order"
        assert backward[i]["tokens"] == reference["tokens"], f"batch {i}, other order"
    assert any(s["tokens"] != f["tokens"] for s, f in zip(spoiled, first))


def test_requests_vllm_preempts_come_back_with_their_prefix_from_kvd(tmp_path):
    # vLLM short of its own blocks preempts running requests (their blocks freed, their
    # tokens to compute again) and schedules them again later, when the connector is asked
    # about them afresh: they resume with the blocks kvd keeps, loaded into the new blocks
    # vLLM gives them, while other requests store and load beside them: their prompt's, and
    # with kvd_save_output the output's they had made. Their tokens must be those of the
    # same requests run with room to spare.
    n, prompt, output = 12, 64, 128
    distinct = [[(i * 37 + j * 3) % 500 + 10 for j in range(prompt)] for i in range(n)]
    batch = [{"prompts": distinct, "max_tokens": output}]  # 2 blocks, growing to 6

    def run(gpu_blocks, save_output=False):
        metrics = free_address()
        with LocalKvd(*KVD, "--metrics", metrics, workdir=tmp_path) as kvd:
            # 9 blocks: vLLM's least for a context of 256 tokens (one is its null block).
            engine = Engine(kvd.target, batch, max_model_len=256, gpu_blocks=gpu_blocks,
                            save_output=save_output)
            try:
                result = engine.result()
                with Client(kvd.target) as c:  # every request done: what kvd keeps
                    kept = sum(t.used_pages for t in c.pool_stats().pools[0].tiers)
                loaded = metric_value(metrics, "kvd_prefix_blocks_total", op="loaded")
            finally:
                engine.close()
            return result, rpc_counts(metrics, "Load"), loaded, kept

    roomy, roomy_loads, _, _ = run(None)
    pressed, loads, blocks, kept = run(9)
    outputs, output_loads, output_blocks, kept_outputs = run(9, save_output=True)
    for name, (result, loaded, loaded_blocks) in {
            "prompts kept": (pressed, loads, blocks),
            "outputs kept too": (outputs, output_loads, output_blocks),
            "with room": (roomy, roomy_loads, 0)}.items():
        print(f"\n{name}: preemptions {result['preemptions']:.0f}, loads from kvd {loaded} "
              f"({loaded_blocks:.0f} blocks)")
    assert roomy["preemptions"] == 0 and roomy_loads == 0
    for result, loaded in ((pressed, loads), (outputs, output_loads)):
        assert result["preemptions"] > 0
        # No prompt shares a block with another, and none found one in kvd when it came:
        # what was loaded was loaded by a request coming back after a preemption.
        assert result["cached"] == [0] * n
        assert loaded > 0
        assert result["tokens"] == roomy["tokens"]
    # A prompt's last block is vLLM's to compute: with prompts kept, a request comes back
    # with one block from kvd at most. With outputs kept, with those it had made too.
    assert blocks <= loads
    assert output_blocks > output_loads
    # kvd keeps each request's prompt blocks; with save_output also every block of its
    # output whose KV vLLM computed (all but the last token's).
    assert kept == n * (prompt // 32)
    assert kept_outputs == n * ((prompt + output - 1) // 32)


@pytest.mark.timeout(600)  # three engine starts of ~30 s each (two at once), and their batches
def test_a_conversations_next_turn_finds_the_answer_in_kvd(tmp_path):
    # A conversation's next turn sends the last prompt, the answer and a new message: with
    # kvd_save_output, a fresh engine (another replica) finds the answer's blocks in kvd as
    # well as the first prompt's, and computes the tokens an engine that finds nothing does.
    prompt, output, more = 64, 96, 16
    first = [[(i * 41 + j * 7) % 500 + 10 for j in range(prompt)] for i in range(4)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with LocalKvd(*KVD, workdir=tmp_path / "a") as kvd, \
            LocalKvd(*KVD, workdir=tmp_path / "b") as empty:
        turn = Engine(kvd.target, [{"prompts": first, "max_tokens": output}], save_output=True)
        try:
            answers = turn.result()["tokens"]
        finally:
            turn.close()
        second = [p + a + [(i * 13 + j) % 500 + 10 for j in range(more)]
                  for i, (p, a) in enumerate(zip(first, answers))]
        batch = [{"prompts": second, "max_tokens": 8}]
        engines = [Engine(kvd.target, batch, save_output=True), Engine(empty.target, batch)]
        try:
            found, computed = (e.result() for e in engines)
        finally:
            for e in engines:
                e.close()
    print(f"\ncached tokens of the next turn: {found['cached']} (from an empty kvd: "
          f"{computed['cached']})")
    assert [len(a) for a in answers] == [output] * len(first)
    assert computed["cached"] == [0] * len(first)
    # Every block whose KV the first turn computed: the prompt's and the answer's, but for
    # the answer's last token, which no step fed back.
    assert found["cached"] == [(prompt + output - 1) // 32 * 32] * len(first)
    assert found["tokens"] == computed["tokens"]


def free_address() -> str:
    """A free local TCP address (for kvd's metrics)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def metric_samples(metrics: str):
    """The samples of kvd's Prometheus exposition."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric_value(metrics: str, name: str, **labels: str) -> float:
    """The one sample called `name` (with these labels) in kvd's exposition."""
    values = [s.value for s in metric_samples(metrics)
              if s.name == name and labels.items() <= s.labels.items()]
    assert len(values) == 1, (name, values)
    return values[0]


def rpc_counts(metrics: str, *methods: str) -> int:
    """Calls of these methods kvd served, from its Prometheus exposition."""
    return int(sum(s.value for s in metric_samples(metrics)
                   if s.name == "kvd_rpc_duration_seconds_count"
                   and s.labels["method"] in methods))


@pytest.mark.timeout(300)
def test_a_request_that_runs_longer_than_the_lease_stays_admitted(tmp_path):
    # kvd releases the requests of a client silent for lease_ttl_s (one that died). The
    # connector calls kvd when requests arrive and finish, not while they decode: a request
    # decoding for longer than the lease (a long answer) was released under the running
    # engine, and kvd counted its pages free for others to be admitted into.
    # The lease (6 s, renewed every 2 s) leaves 4 s to spare. A 1.5 s lease (1 s to spare)
    # lapsed in CI under the running engine: on these 2-core machines one CPU was seen
    # stalled for 2.5 s while the other ran on, and kvd, on the other, cannot tell an engine
    # stalled that long from one that died. So that it outlasts two such leases on any
    # machine, the engine steps at most 125 times a second (as a large model decodes), not
    # as fast as this machine runs the tiny model.
    # When kvd held the request is read from kvd's own events, stamped when kvd admitted and
    # released it: a test polling kvd could not tell a released request from an answer that
    # a machine busy decoding delayed past the release.
    lease_s = 6.0
    metrics = free_address()
    with LocalKvd(*KVD, "--lease-ttl-s", str(lease_s), "--metrics", metrics,
                  workdir=tmp_path) as kvd:
        events = watch_events(kvd.target, ["admission", "release", "lease"])
        # As long an answer as the model holds, 8 ms a step at least: 15 s.
        engine = Engine(kvd.target, [{"prompts": PROMPTS[:1], "max_tokens": 1880}],
                        max_model_len=2048, step_s=0.008)
        try:
            run = engine.result()
        finally:
            engine.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.kind == "release" for e in events):
            time.sleep(0.05)
        expired = metric_value(metrics, "kvd_lease_expirations_total")
    stamps = {e.kind: e.time_s for e in events if e.request_id}
    print(f"\nrun: {run['run_s']:.1f} s; kvd events: {[(e.kind, e.time_s) for e in events]}; "
          f"{expired:.0f} leases expired")
    assert len(run["tokens"][0]) == 1880
    assert run["run_s"] > 2 * lease_s  # decoding outlasts the lease
    assert expired == 0 and "lease" not in {e.kind for e in events}
    assert [e.kind for e in events] == ["admission", "release"]  # the engine released it...
    held_s = stamps["release"] - stamps["admission"]
    assert held_s > run["run_s"] - lease_s  # ...once it had run, not a lease after it began


def test_a_lease_renewal_that_fails_once_is_sent_again_within_the_lease(tmp_path):
    # A renewal that failed (its connection broke, say) was sent again kvd_retry_s later (a
    # second by default) whatever the lease: under a TTL not much longer than that, one
    # failed renewal lapsed the lease under a running request. The failure is made by the
    # test (the client's call answers with an error once); kvd and its lease are real. The
    # lease (6 s) is long enough that a stall of this machine (2.5 s seen) cannot lapse it
    # between renewals (every 2 s; one a second after a failure); kvd_retry_s is longer.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import KvdClientError
    from kvd_client import vllm_connector as vc

    metrics = free_address()
    with LocalKvd(*KVD, "--lease-ttl-s", "6", "--metrics", metrics, workdir=tmp_path) as kvd:
        config = vllm_config(kvd.target, extra={"kvd_retry_s": 8.0})
        scheduler = vc.KvdConnector(config, KVConnectorRole.SCHEDULER)
        scheduler.client.admit("r", 64)  # under the scheduler's lease
        scheduler.tracked["r"] = vc._Tracked("ns", [])
        start, renewals, failed = scheduler.client.start, [], []

        def fails_once(name, *args, **kwargs):  # the second renewal
            if name == "keep_alive":
                renewals.append(time.monotonic())
            if len(renewals) == 2 and not failed:
                failed.append(renewals[-1])
                future = Future()
                future.set_exception(KvdClientError("connection broke",
                                                    grpc.StatusCode.UNAVAILABLE))
                return future
            return start(name, *args, **kwargs)

        scheduler.client.start = fails_once
        until = time.monotonic() + 10.0
        while time.monotonic() < until:  # the scheduler's steps
            scheduler._renew_lease()
            time.sleep(0.02)
        expired = metric_value(metrics, "kvd_lease_expirations_total")
        with Client(kvd.target, lease="") as observer:
            active = observer.explain("r").active
        scheduler.client.close()
    assert failed  # a renewal failed...
    assert expired == 0 and active  # ...and the lease held


# The connector's timeout in the tests of a kvd that hangs: long against a stall of this
# machine (2.5 s seen), so that one timeout and a stall stay shorter than two timeouts.
HUNG_TIMEOUT_S = 4.0
HUNG = {"kvd_timeout_s": HUNG_TIMEOUT_S}


def test_a_hung_kvd_holds_up_a_scheduler_step_once_at_most(tmp_path):
    # A kvd that hangs (stopped, not gone: its socket still takes calls) answers nothing,
    # and each call waits out the connector's timeout. The first such call marks kvd
    # away for kvd_retry_s; no other may wait meanwhile. The lease renewal waited for its
    # answer at every renewal, and each request kvd had queued was asked after in turn.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        scheduler = vc.KvdConnector(vllm_config(kvd.target, extra=HUNG), KVConnectorRole.SCHEDULER)
        scheduler.tracked["r"] = vc._Tracked("ns", [])  # it holds a request...
        scheduler.queued.update(q0=0.0, q1=0.0, q2=0.0)  # ...and kvd queued three
        scheduler.client.keep_alive()  # connected
        os.kill(kvd.proc.pid, signal.SIGSTOP)
        try:
            renewals, asked = [], []
            for _ in range(3):
                started = time.monotonic()
                scheduler._renew_lease()
                renewals.append(time.monotonic() - started)
                time.sleep(0.2)
            started = time.monotonic()
            for rid in ("q0", "q1", "q2"):  # one scheduler step asks after each
                assert scheduler.get_num_new_matched_tokens(Waiting(rid), 0) == (0, False)
            asked = time.monotonic() - started
        finally:
            os.kill(kvd.proc.pid, signal.SIGCONT)
        scheduler.client.close()
    print(f"\nrenewals against a hung kvd took {renewals} s; a step asking after three "
          f"queued requests {asked:.1f} s")
    assert max(renewals) < HUNG_TIMEOUT_S - 1  # none waited out the timeout
    assert scheduler._renewed > 0  # a renewal was sent
    assert asked < 2 * HUNG_TIMEOUT_S  # one call's timeout, not three


def test_a_kvd_that_hangs_mid_step_holds_up_a_workers_step_once_at_most(tmp_path):
    # The worker's loads and saves of one step go to kvd one request after another. A kvd
    # that hangs once the step began (here: right after answering the worker's check of
    # which kvd it is) made each of them wait out the connector's timeout in turn.
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        worker = vc.KvdConnector(vllm_config(kvd.target, extra=HUNG), KVConnectorRole.WORKER)
        worker.register_kv_caches({f"layer.{i}": torch.zeros((8, 32, 128), dtype=torch.bfloat16)
                                   for i in range(2)})
        checked = worker._check_kvd

        def answered_then_hung():
            answer = checked()
            os.kill(kvd.proc.pid, signal.SIGSTOP)
            worker._check_kvd = checked
            return answer

        took = {}
        try:
            for phase, meta in (
                    ("loads", vc.KvdConnectorMetadata(loads=[
                        vc._Transfer(f"r{i}", "ns", [b"k"], [i]) for i in range(3)])),
                    ("saves", vc.KvdConnectorMetadata(saves=[
                        vc._Transfer(f"r{i}", "ns", [b"k"], [i]) for i in range(3)]))):
                worker._away_until = 0.0
                worker._check_kvd = answered_then_hung
                worker.bind_connector_metadata(meta)
                started = time.monotonic()
                (worker.start_load_kv(None) if phase == "loads" else worker.wait_for_save())
                took[phase] = time.monotonic() - started
                os.kill(kvd.proc.pid, signal.SIGCONT)
                time.sleep(0.5)
        finally:
            os.kill(kvd.proc.pid, signal.SIGCONT)
        worker.client.close()
    print(f"\na step of three loads, and one of three saves, against a kvd that hung: {took}")
    assert worker.get_block_ids_with_load_errors() == {0, 1, 2}  # recomputed
    assert max(took.values()) < 2 * HUNG_TIMEOUT_S  # one call's timeout, not three


# One request of 104 prompt and 400 output tokens (16 pages) at a time for tenant "engine".
ONE_LONG = LIMITED.replace("limit = 5", "limit = 20")


# How soon after an engine's scheduler starts kvd has subscribed its admission events (in
# milliseconds on a quiet machine; a busy one may take longer).
SUBSCRIBED_S = 1.0


@pytest.mark.timeout(600)
def test_requests_kvd_queues_are_asked_after_at_a_measured_pace(tmp_path):
    # vLLM asks the connector about every waiting request at every step. The connector
    # asked kvd twice each time (an Admit, then whether kvd had admitted it), then once per
    # request every kvd_queue_poll_s (50 ms): a tenant flooding the engine with requests kvd
    # queues still cost kvd, and the scheduler, 20 calls a second for each of them, and the
    # running requests waited on those calls at every step. The connector follows kvd's
    # admission events instead, asking after each queued request about once a second.
    from kvd_client.vllm_connector import QUEUE_FALLBACK_POLLS

    n = 10
    metrics = free_address()
    config = tmp_path / "kvd.toml"
    config.write_text(ONE_LONG)
    with LocalKvd("--config", str(config), "--metrics", metrics, workdir=tmp_path) as kvd:
        engine = Engine(kvd.target, [{"prompts": prompts(400, n), "max_tokens": 400}])
        try:
            run = engine.result()
        finally:
            engine.close()
        calls = rpc_counts(metrics, "Admit", "Store")
        commits = rpc_counts(metrics, "Commit")
    print(f"\nrun: {run['run_s']:.1f} s, {calls} Admit and Store calls ({commits} commits)")
    assert all(len(t) == 400 for t in run["tokens"])
    # Each request: its Admit, its first store, and the question once kvd admitted it; each
    # queued one asked 20 times a second until kvd has subscribed the event stream (it
    # starts with the engine's scheduler, a moment before the first requests: within
    # SUBSCRIBED_S), then once every fallback period for at most the whole run. Asked 20
    # times a second for as long as it waited, the nine queued requests made about
    # 10 x 9 x run_s calls.
    fallback_s = QUEUE_FALLBACK_POLLS * 0.05
    assert calls <= 3 * n + (n - 1) * (20 * SUBSCRIBED_S + run["run_s"] / fallback_s + 1)


def test_a_request_vllm_has_no_room_for_costs_kvd_a_lookup_a_period(tmp_path):
    # While vLLM's own cache is full, its scheduler asks the connector about the request at
    # the head of its queue at every step, and the connector looked the request's blocks up
    # in kvd each time: an engine short of memory made one more call at every step (367
    # lookups for 12 requests in an engine of 14 blocks), and its running requests waited
    # on each. The answer now stands for kvd_lookup_again_s, and the request is looked up
    # afresh once vLLM has given it blocks (asked again after a preemption).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    again_s = 0.5
    metrics = free_address()
    with LocalKvd(*KVD, "--metrics", metrics, workdir=tmp_path) as kvd:
        scheduler = vc.KvdConnector(vllm_config(kvd.target, extra={
            "kvd_lookup_again_s": again_s}), KVConnectorRole.SCHEDULER)
        request = Waiting("r0")  # 64 tokens: blocks h0 and h1, the last token computed
        ns = vc.namespace(scheduler.model, scheduler.block_size, scheduler.kv_dtype, "")
        with Client(kvd.target) as other:  # another engine stored h0
            other.admit("w", prompt_tokens=32)
            other.store("w", ns, [b"h0"])
            other.commit("w", ns, [b"h0"])
            other.release("w")
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, False)
        looked = rpc_counts(metrics, "Lookup")
        # Steps of 10 ms for two seconds, vLLM without room for the request at each.
        asks, until = 0, time.monotonic() + 2.0
        while time.monotonic() < until:
            assert scheduler.get_num_new_matched_tokens(request, 0) == (32, False)
            asks += 1
            time.sleep(0.01)
        waiting = rpc_counts(metrics, "Lookup") - looked
        # vLLM gives it blocks, then preempts it: asked again, kvd is asked at once.
        scheduler.update_state_after_alloc(
            request, types.SimpleNamespace(get_block_ids=lambda: ([7, 8],)), 32)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, False)
        resumed = rpc_counts(metrics, "Lookup") - looked - waiting
        scheduler.request_finished(request, [])
        scheduler.client.close()
    print(f"\n{asks} asks in 2 s without room: {waiting} lookups")
    assert asks > 4 * (2 / again_s)  # the test asked far more often than the period
    assert waiting <= 2 / again_s + 1
    assert resumed == 1


def test_an_engine_short_of_memory_asks_kvd_about_its_waiting_requests_at_a_pace(tmp_path):
    # The same in a real engine: 14 blocks of its own, and requests of 10 blocks each (200
    # prompt tokens, 100 output), so one runs while the next waits at the head of vLLM's
    # queue. Asked at every step, kvd served 1,111 lookups for the 12 requests.
    from kvd_client.vllm_connector import LOOKUP_AGAIN_S

    n = 12
    metrics = free_address()
    long = [[(i * 7 + j) % 500 + 10 for j in range(200)] for i in range(n)]
    with LocalKvd(*KVD, "--metrics", metrics, workdir=tmp_path) as kvd:
        engine = Engine(kvd.target, [{"prompts": long, "max_tokens": 100}],
                        max_model_len=320, gpu_blocks=14)
        try:
            run = engine.result()
        finally:
            engine.close()
        lookups = rpc_counts(metrics, "Lookup")
    print(f"\nrun: {run['run_s']:.1f} s, {lookups} lookups for {n} requests")
    assert all(len(t) == 100 for t in run["tokens"])
    # Each request once as it comes and once each time it is scheduled again (preempted),
    # and the request waiting at the head of the queue once a period while it waits.
    assert lookups <= 2 * n + run["run_s"] / LOOKUP_AGAIN_S + 1


def subscribed(scheduler) -> None:
    """Wait until kvd has subscribed the scheduler's stream of admission events (it starts
    with the scheduler)."""
    deadline = time.monotonic() + 10
    while not scheduler.watch_subscribed:
        assert time.monotonic() < deadline, "kvd's admission events were never followed"
        time.sleep(0.01)


# The connector's queue poll in the tests of how soon it hears kvd's word: its fallback
# (every QUEUE_FALLBACK_POLLS polls, 10 s) is far enough that a stall of this machine (2.5 s
# seen) cannot make hearing the word look like waiting for the fallback.
QUEUE_POLL_S = 0.5
POLLED = {"kvd_queue_poll_s": QUEUE_POLL_S}


# One request of 64 prompt tokens (2 pages) at a time for tenant "default".
ONE_SHORT = LIMITED.replace('name = "engine"', 'name = "default"').replace("limit = 5",
                                                                             "limit = 2")


def test_a_request_kvd_admits_from_its_queue_runs_without_waiting_for_a_poll(tmp_path):
    # The connector asks after a queued request only about once a second once kvd's
    # admission events reach it: what tells it at once that kvd admitted one is the event.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    metrics = free_address()
    config = tmp_path / "kvd.toml"
    config.write_text(ONE_SHORT)
    with LocalKvd("--config", str(config), "--metrics", metrics, workdir=tmp_path) as kvd:
        scheduler = vc.KvdConnector(vllm_config(kvd.target, extra=POLLED),
                                    KVConnectorRole.SCHEDULER)
        first, second = Waiting("r0"), Waiting("r1")
        subscribed(scheduler)  # the engine runs a while before requests queue
        assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
        assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)  # queued
        # Steps of 10 ms for two seconds, vLLM asking about the queued request at each.
        until = time.monotonic() + 2.0
        while time.monotonic() < until:
            assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)
            time.sleep(0.01)
        polls = rpc_counts(metrics, "Store")
        scheduler.request_finished(first, [])  # kvd admits the second from its queue
        released = time.monotonic()
        while scheduler.get_num_new_matched_tokens(second, 0) == (None, False):
            assert time.monotonic() - released < 5
            time.sleep(0.01)
        noticed_s = time.monotonic() - released
        asked = rpc_counts(metrics, "Store") - polls
        scheduler.request_finished(second, [])
        scheduler.client.close()
    print(f"\n{polls} questions in 2 s queued; noticed the admission after "
          f"{noticed_s * 1000:.0f} ms, {asked} more")
    assert polls <= 2 / (vc.QUEUE_FALLBACK_POLLS * QUEUE_POLL_S) + 1  # not one a poll
    assert noticed_s < 4  # not the fallback poll's 10 s
    assert asked == 1  # only once kvd said it had admitted it


def test_a_request_kvd_admits_before_its_events_are_followed_is_not_left_to_the_fallback(
        tmp_path, monkeypatch):
    # The connector took its stream of admission events for subscribed a second after it
    # started it, and from then on asked after a queued request only at the fallback poll
    # (10 s here). Where kvd took longer (a busy machine), a request it admitted meanwhile
    # was never heard of and waited for that poll. The stream is made late here: it starts
    # two seconds after the connector asks for it.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    follow = Client.follow

    def late(client, *args, **kwargs) -> Future:
        threading.Timer(2.0, follow, (client, *args), kwargs).start()
        return Future()  # under way, as far as the connector can tell

    monkeypatch.setattr(Client, "follow", late)
    config = tmp_path / "kvd.toml"
    config.write_text(ONE_SHORT)
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        scheduler = vc.KvdConnector(vllm_config(kvd.target, extra=POLLED),
                                    KVConnectorRole.SCHEDULER)
        first, second = Waiting("r0"), Waiting("r1")
        time.sleep(1.2)  # past the second the connector once gave the stream
        assert not getattr(scheduler, "watch_subscribed", False)
        assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
        assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)  # queued
        scheduler.request_finished(first, [])  # kvd admits the second, unheard
        released = time.monotonic()
        while scheduler.get_num_new_matched_tokens(second, 0) == (None, False):
            assert time.monotonic() - released < 5, "left to the fallback poll"
            time.sleep(0.01)
        noticed_s = time.monotonic() - released
        subscribed(scheduler)  # and the stream, once late, is followed
        scheduler.request_finished(second, [])
        scheduler.client.close()
    print(f"\nnoticed the admission after {noticed_s * 1000:.0f} ms")
    assert noticed_s <= QUEUE_POLL_S + 1


@pytest.mark.parametrize("rid", ["r1", "queued-r1"])
def test_a_request_kvd_rejects_from_its_queue_is_served_without_kvd_at_once(tmp_path, rid):
    # A quota lowered under a queued request: kvd rejects the request from its queue and
    # says so in its admission events. The connector heard only the admissions there, and
    # told vLLM to wait until its next fallback poll, about a second later; and it took a
    # request as still queued when kvd's answer had "queued" anywhere in it, the request's
    # own id included (whose id is the API client's to choose): that one waited for ever.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    config = tmp_path / "kvd.toml"
    config.write_text(ONE_SHORT)
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        scheduler = vc.KvdConnector(vllm_config(kvd.target, extra=POLLED),
                                    KVConnectorRole.SCHEDULER)
        first, second = Waiting("r0"), Waiting(rid)
        subscribed(scheduler)  # the engine runs a while before requests queue
        assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
        assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)  # queued
        with Client(kvd.target) as admin:  # under the 2 pages the queued request needs
            admin.set_quota("default", limit_pages=1)
        lowered = time.monotonic()
        while (answer := scheduler.get_num_new_matched_tokens(second, 0)) == (None, False):
            assert time.monotonic() - lowered < 5, "still told to wait"
            time.sleep(0.01)
        noticed_s = time.monotonic() - lowered
        scheduler.request_finished(second, [])
        scheduler.request_finished(first, [])
        scheduler.client.close()
    print(f"\nnoticed the rejection after {noticed_s * 1000:.0f} ms")
    assert answer == (0, False)  # served without kvd
    assert noticed_s < 4  # not the fallback poll's 10 s


def test_the_connector_leaves_kvd_holding_only_what_it_knows_whatever_calls_fail(tmp_path):
    # Random requests started, finished and stepped through the scheduler side (kvd taken
    # for away after a call it did not answer, and waited out at times), each Admit and
    # Release answering normally, not delivered (UNAVAILABLE) or delivered with its
    # answer lost (DEADLINE_EXCEEDED). After every operation, each request kvd holds is one
    # the connector knows it may hold (running, queued, unanswered or owed a release); once
    # all have finished and kvd has been back a while, kvd holds none of them.
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvd_client import DeadlineExceededError, NotFoundError, UnavailableError
    from kvd_client import vllm_connector as vc
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    faults = ("none", "undelivered", "lost")
    retry_s = 0.05
    with LocalKvd(*KVD, workdir=tmp_path) as kvd, Client(kvd.target, lease="") as observer:
        config = vllm_config(kvd.target, extra={"kvd_retry_s": retry_s})
        scheduler = vc.KvdConnector(config, KVConnectorRole.SCHEDULER)
        injected = {"admit": "none", "release": "none"}

        def failing(name, call):
            def faulty(*args, **kwargs):
                fault, injected[name] = injected[name], "none"
                if fault == "undelivered":
                    raise UnavailableError("connection broke")
                reply = call(*args, **kwargs)
                if fault == "lost":
                    raise DeadlineExceededError("Deadline Exceeded")
                return reply
            return faulty

        scheduler.client.admit = failing("admit", scheduler.client.admit)
        scheduler.client.release = failing("release", scheduler.client.release)
        examples = iter(range(10**9))

        def held(rids) -> set[str]:
            out = set()
            for rid in rids:
                try:
                    if observer.explain(rid).active:
                        out.add(rid)
                except NotFoundError:
                    pass
            return out

        @settings(max_examples=int(os.environ.get("KVD_RELEASE_EXAMPLES", "200")),
                  deadline=None, database=None)
        @given(st.lists(st.tuples(st.sampled_from(("start", "finish", "step", "wait")),
                                  st.integers(0, 1),
                                  st.sampled_from(("none",) * 4 + faults[1:])), max_size=30))
        def run(ops):
            prefix = f"e{next(examples)}-"
            running, seen = set(), set()
            time.sleep(max(0.0, scheduler._away_until - time.monotonic()))  # kvd back
            for op, i, fault in ops:
                rid = prefix + str(i)
                if op == "start" and rid not in seen:
                    injected["admit"] = fault
                    seen.add(rid)
                    running.add(rid)
                    scheduler.get_num_new_matched_tokens(Waiting(rid), 0)
                elif op == "finish" and rid in running:
                    injected["release"] = fault
                    running.discard(rid)
                    scheduler.request_finished(Waiting(rid), [])
                elif op == "wait":  # until kvd is taken for back
                    time.sleep(max(0.0, scheduler._away_until - time.monotonic()))
                else:
                    scheduler.build_connector_meta(IDLE_STEP)
                injected.update(admit="none", release="none")
                known = (set(scheduler.tracked) | set(scheduler.queued)
                         | scheduler.unsure | set(scheduler.owed))
                assert held(seen) <= known, (op, rid, fault)
            for rid in sorted(running):
                scheduler.request_finished(Waiting(rid), [])
            for _ in range(40):  # kvd back a while: the steps send what is owed
                if not held(seen):
                    break
                time.sleep(retry_s)
                scheduler.build_connector_meta(IDLE_STEP)
            assert held(seen) == set()

        run()
        scheduler.client.close()


def test_an_engine_shutting_down_releases_what_it_holds_in_kvd(tmp_path):
    # vLLM shuts the connector down when the engine stops (its Scheduler.shutdown). The
    # connector had no shutdown: the requests it held stayed admitted in kvd, and those kvd
    # queued stayed queued, until its lease lapsed (30 s by default), and a restarted engine
    # of the same tenant found its budget spent meanwhile.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import vllm_connector as vc

    config = tmp_path / "kvd.toml"
    config.write_text(ONE_SHORT)
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        scheduler = vc.KvdConnector(vllm_config(kvd.target), KVConnectorRole.SCHEDULER)
        worker = vc.KvdConnector(vllm_config(kvd.target), KVConnectorRole.WORKER)
        assert scheduler.get_num_new_matched_tokens(Waiting("r0"), 0) == (0, False)
        assert scheduler.get_num_new_matched_tokens(Waiting("r1"), 0) == (None, False)
        with Client(kvd.target, lease="") as observer:
            held = observer.pool_stats("default").pools[0]
            scheduler.shutdown()
            worker.shutdown()
            left = observer.pool_stats("default").pools[0]
        # A new engine's request is admitted at once: the tenant's two pages are free.
        restarted = vc.KvdConnector(vllm_config(kvd.target), KVConnectorRole.SCHEDULER)
        assert restarted.get_num_new_matched_tokens(Waiting("s0"), 0) == (0, False)
        restarted.shutdown()
    assert (held.num_requests, held.num_queued) == (1, 1)
    assert (left.num_requests, left.num_queued) == (0, 0)
    assert scheduler.client.closed and worker.client.closed


# A scheduler step that schedules nothing (what build_connector_meta reads of vLLM's
# SchedulerOutput).
IDLE_STEP = types.SimpleNamespace(
    num_scheduled_tokens={}, scheduled_new_reqs=[],
    scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[],
                                                resumed_req_ids=set(),
                                                num_computed_tokens=[]))


def test_a_release_kvd_did_not_take_is_sent_again(tmp_path):
    # A request that finished while kvd was away (a call had just waited out the timeout:
    # kvd stalled, say) was never released in kvd, nor one whose Admit kvd took but whose
    # answer was lost (the same timeout). The engine's lease, renewed while it runs, never
    # lapsed: kvd held their pages and the tenant's budget for as long as the engine ran.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd_client import DeadlineExceededError, NotFoundError
    from kvd_client import vllm_connector as vc

    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        config = vllm_config(kvd.target, extra={"kvd_retry_s": 3.0})
        scheduler = vc.KvdConnector(config, KVConnectorRole.SCHEDULER)
        first, second, third = Waiting("r0"), Waiting("r1"), Waiting("r2")
        assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)  # admitted
        assert scheduler.get_num_new_matched_tokens(third, 0) == (0, False)  # admitted
        admit = scheduler.client.admit

        def answer_lost(*args, **kwargs):  # kvd admits it; its answer is lost on the way
            admit(*args, **kwargs)
            raise DeadlineExceededError("Deadline Exceeded")

        scheduler.client.admit = answer_lost
        # No answer: served without kvd, and kvd away for kvd_retry_s.
        assert scheduler.get_num_new_matched_tokens(second, 0) == (0, False)
        scheduler.client.admit = admit
        scheduler.request_finished(first, [])  # while kvd is away
        scheduler.request_finished(second, [])
        with Client(kvd.target, lease="") as observer:
            def active(rid: str) -> bool:
                try:
                    return observer.explain(rid).active
                except NotFoundError:
                    return False

            held = {rid for rid in ("r0", "r1", "r2") if active(rid)}
            deadline = time.monotonic() + 10  # kvd_retry_s, and then some
            while time.monotonic() < deadline:  # the scheduler's steps, the third running
                scheduler.build_connector_meta(IDLE_STEP)
                left = {rid for rid in ("r0", "r1", "r2") if active(rid)}
                if left == {"r2"}:
                    break
                time.sleep(0.05)
        scheduler.request_finished(third, [])
        scheduler.client.close()
    print(f"\nheld in kvd while it was away: {held}; after 10 s: {left}")
    assert left == {"r2"}  # the running one only


@pytest.mark.timeout(600)
def test_an_engine_started_before_kvd_serves_and_then_uses_kvd(tmp_path):
    # kvd is a cache beside the engine: an engine that starts while kvd does not answer
    # (started first, or kvd restarting at that moment) must start and serve, and use kvd
    # once it answers. The worker asked kvd for its arenas while vLLM set up its KV cache,
    # and the engine failed to start. A kvd whose pages do not fit the engine's blocks (its
    # configuration changed under a running engine) is not used; the engine serves on.
    def phase(kvd):
        with kvd:  # started here, and stopped however the phase ends
            time.sleep(3.5)  # the client's reconnect backoff (2 s), the connector's pause
            engine.go()
            served = engine.result()
            with Client(kvd.target) as c:
                used = c.pool_stats().pools[0].tiers[0].used_pages
        return served, used

    misfit = (*KVD[:1], str(PAGE_BYTES // 2), *KVD[2:])
    engine = Engine(f"unix://{tmp_path}/kvd.sock",  # nothing there yet
                    [{"prompts": prompts(n)} for n in (150, 200, 250)], pause=True)
    try:
        alone = engine.result()
        misfit_run, misfit_used = phase(LocalKvd(*misfit, workdir=tmp_path))
        fit_run, fit_used = phase(LocalKvd(*KVD, workdir=tmp_path))
    finally:
        engine.close()
    print(f"\nwithout kvd: {alone}\nbeside a misfit kvd: {misfit_run}\nwith kvd: {fit_run}")
    assert all(len(t) == 8 for t in alone["tokens"] + misfit_run["tokens"] + fit_run["tokens"])
    assert misfit_used == 0  # nothing stored in pages of another size
    assert fit_used == 5  # the last batch's blocks were stored in kvd
