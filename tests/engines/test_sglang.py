"""kvd as SGLang's HiCache L3 store, through SGLang's own classes on the CPU: the real device
and host KV pools (MHATokenToKVPool, MHATokenToKVPoolHost in the page-first layout its
zero-copy path needs) and the real StorageBackendFactory loading kvd's backend as a
"dynamic" backend, against a real kvd process. The full SGLang engine needs CUDA; these
are the classes it drives the backend through.

SGLang imports torchvision, whose registry builds cannot load beside the CPU PyTorch of
this tier: a stand-in module (stand_ins/torchvision) is put first on the path before SGLang
is imported. Nothing used here calls it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent / "stand_ins"))
warnings.filterwarnings("ignore", message="Only CUDA")
torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvd.core.policies import policy_names  # noqa: E402
from kvd_client import Client  # noqa: E402
from kvd_loadgen.local import LocalKvd  # noqa: E402

PAGE_TOKENS, HEADS, HEAD_DIM, LAYERS = 16, 2, 32, 2
# One SGLang page: K and V, every layer, 16 tokens x 2 heads x 32 x bf16.
PAGE_BYTES = 2 * LAYERS * PAGE_TOKENS * HEADS * HEAD_DIM * 2


def kvd(tmp_path, device_pages=32, host_pages=64, page_bytes=PAGE_BYTES):
    return LocalKvd("--page-bytes", str(page_bytes), "--block-tokens", str(PAGE_TOKENS),
                    "--device-pages", str(device_pages), "--host-pages", str(host_pages),
                    workdir=tmp_path)


def host_pool(pages: int = 32, dtype=torch.bfloat16) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(pages * PAGE_TOKENS, PAGE_TOKENS, dtype, HEADS,
                              HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0,
                                PAGE_TOKENS, "page_first", pin_memory=False,
                                device_capacity_tokens=device.size, start_layer=0,
                                end_layer=LAYERS)


def backend(target: str, pool: MHATokenToKVPoolHost, model: str = "tiny", v1: bool = True,
            extra: dict | None = None, **ranks):
    """kvd's backend as SGLang's cache controller makes it: the factory, then the pool.
    `extra`: more of its extra config; `ranks`: HiCacheStorageConfig's parallel fields,
    where not those of one GPU."""
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                  is_mla_model=False)
    config = HiCacheStorageConfig(
        **{**fields, **ranks}, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model,
        extra_config={"backend_name": "kvd", "module_path": "kvd_client.sglang_backend",
                      "class_name": "KvdStorage", "interface_v1": int(v1),
                      "kvd_target": target, **(extra or {})})
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def written_pages(pool: MHATokenToKVPoolHost, num_pages: int, seed: int) -> torch.Tensor:
    """Host indices of num_pages new pages, filled with distinct random bytes."""
    indices = pool.alloc(num_pages * PAGE_TOKENS)
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.view(torch.int16)[:, indices] = torch.randint(
        -2**15, 2**15, pool.kv_buffer[:, indices].shape, generator=gen, dtype=torch.int16)
    return indices


def page(pool: MHATokenToKVPoolHost, indices: torch.Tensor, i: int) -> bytes:
    start = int(indices[i * PAGE_TOKENS])
    return pool.get_data_page(start, flat=True).view(torch.uint8).numpy().tobytes()


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def assert_read_back(storage, pool: MHATokenToKVPoolHost, names: list[str],
                     src: torch.Tensor, who: str = "") -> None:
    """One read of these pages finds them all, each holding the bytes stored from `src`."""
    dst = pool.alloc(len(names) * PAGE_TOKENS)
    assert storage.batch_get_v1(names, dst) == [True] * len(names)
    for i in range(len(names)):
        assert page(pool, dst, i) == page(pool, src, i), f"{who}page {i} came back wrong"


def test_pages_round_trip_through_kvd_zero_copy_and_generic(tmp_path):
    with kvd(tmp_path) as k:
        pool = host_pool()
        storage = backend(k.target, pool)
        src = written_pages(pool, 4, seed=1)
        names = keys("a", 4)
        assert storage.batch_exists(names) == 0
        assert storage.batch_set_v1(names, src) == [True] * 4
        assert storage.batch_exists(names) == 4
        assert_read_back(storage, pool, names, src)
        # The generic path reads the same bytes as one flat page, and writes what v1 reads.
        flat = storage.get(names[2], pool.get_dummy_flat_data_page())
        assert flat.view(torch.uint8).numpy().tobytes() == page(pool, src, 2)
        more = written_pages(pool, 1, seed=2)
        assert storage.set("b0000", pool.get_data_page(int(more[0]), flat=True))
        again = pool.alloc(PAGE_TOKENS)
        assert storage.batch_get_v1(["b0000"], again) == [True]
        assert page(pool, again, 0) == page(pool, more, 0)
        # Pages kvd has are not written twice: storing them again changes nothing.
        with Client(k.target) as c:
            used = c.pool_stats().pools[0].tiers[0].used_pages
            assert storage.batch_set_v1(names, src) == [True] * 4
            assert c.pool_stats().pools[0].tiers[0].used_pages == used == 5
        storage.close()


def test_a_run_of_hits_stops_at_the_first_page_kvd_lacks(tmp_path):
    with kvd(tmp_path) as k:
        pool = host_pool()
        storage = backend(k.target, pool)
        names = keys("a", 3)
        storage.batch_set_v1(names, written_pages(pool, 3, seed=3))
        asked = names[:2] + ["missing"] + names[2:]
        assert storage.batch_exists(asked) == 2
        dst = pool.alloc(4 * PAGE_TOKENS)
        assert storage.batch_get_v1(asked, dst) == [True, True, False, False]
        assert not storage.exists("missing") and storage.exists(names[2])
        storage.close()


def test_pages_kvds_policy_let_go_are_misses(tmp_path):
    # 8 device and 8 host pages: three batches of 8 pages cannot all stay.
    with kvd(tmp_path, device_pages=8, host_pages=8) as k:
        pool = host_pool(64)
        storage = backend(k.target, pool)
        batches = [keys(f"{b}-", 8) for b in "xyz"]
        for n, names in enumerate(batches):
            assert storage.batch_set_v1(names, written_pages(pool, 8, seed=10 + n)) == [True] * 8
        assert storage.batch_exists(batches[-1]) == 8  # the newest stay
        assert storage.batch_exists(batches[0]) == 0  # the oldest went first
        dst = pool.alloc(8 * PAGE_TOKENS)
        assert storage.batch_get_v1(batches[0], dst) == [False] * 8
        storage.close()


def test_two_sglang_instances_share_prefixes_through_kvd(tmp_path):
    with kvd(tmp_path) as k:
        pool_a, pool_b = host_pool(), host_pool()
        a, b = backend(k.target, pool_a), backend(k.target, pool_b, v1=False)
        src = written_pages(pool_a, 5, seed=4)
        names = keys("shared", 5)
        assert a.batch_set_v1(names, src) == [True] * 5
        assert b.batch_exists(names) == 5  # the other instance sees them
        got = b.batch_get(names, [pool_b.get_dummy_flat_data_page() for _ in names])
        for i, flat in enumerate(got):
            assert flat.view(torch.uint8).numpy().tobytes() == page(pool_a, src, i)
        # Another model is another namespace: nothing is shared with it.
        assert backend(k.target, host_pool(), model="other").batch_exists(names) == 0
        a.close()
        b.close()


def test_a_kvd_whose_pages_do_not_fit_sglangs_says_the_right_size(tmp_path):
    with kvd(tmp_path, page_bytes=4096) as k:
        with pytest.raises(ValueError, match=f"page_bytes = {PAGE_BYTES}"):
            backend(k.target, host_pool())


def test_a_wrong_setting_stops_the_backends_start_with_its_name():
    # int() took a slice of -5 pages (every store and load then went through no slice:
    # nothing stored, nothing found), float() a timeout of 0 (every call failed).
    for extra, says in (({"kvd_slice_pages": -5}, "kvd_slice_pages: Input should be"),
                        ({"kvd_timeout_s": 0}, "kvd_timeout_s: Input should be greater"),
                        ({"kvd_slice_page": 8}, "kvd_slice_page: not a setting")):
        with pytest.raises(ValueError, match=f"hicache storage extra_config: {says}"):
            backend("unix:///nowhere", host_pool(), extra=extra)


def test_a_read_while_another_thread_stores_gets_the_bytes_it_asked_for(tmp_path):
    # SGLang's cache controller calls its storage from threads of its own at once: prefetch
    # reads (batch_get_v1) while the backup thread stores (batch_set_v1). A page kvd hands
    # out stays the caller's until the caller's next call; were both threads one caller,
    # the store would end the read's claim while its bytes were still being copied out,
    # and kvd could give the read's pages to the store to write into. Here the read stops
    # after its Load until the other thread's store is done (or has waited a while), and
    # every page it says it read must hold what was stored under its key. (It waits less than
    # kvd's hold_s, after which kvd takes back pages a caller never came back about.)
    import threading

    with kvd(tmp_path, device_pages=8, host_pages=16) as k:
        pool = host_pool(64)
        storage = backend(k.target, pool)
        names, others = keys("p", 8), keys("q", 8)
        src = written_pages(pool, 8, seed=20)
        assert storage.batch_set_v1(names, src) == [True] * 8
        more = written_pages(pool, 8, seed=21)
        loaded, stored = threading.Event(), threading.Event()
        copy = storage._copy
        reader = threading.current_thread()

        def copy_after_the_store(arena, handle, segments, into_kvd):
            if not into_kvd and threading.current_thread() is reader and not loaded.is_set():
                loaded.set()
                stored.wait(timeout=0.5)
            copy(arena, handle, segments, into_kvd)

        storage._copy = copy_after_the_store
        results = {}

        def store():
            loaded.wait(timeout=30)
            results["store"] = storage.batch_set_v1(others, more)
            stored.set()

        writer = threading.Thread(target=store)
        writer.start()
        dst = pool.alloc(8 * PAGE_TOKENS)
        got = storage.batch_get_v1(names, dst)
        writer.join(timeout=60)
        print(f"\nread: {got}\nstore: {results.get('store')}")
        assert loaded.is_set() and any(got)
        for i, ok in enumerate(got):
            if ok:
                assert page(pool, dst, i) == page(pool, src, i), f"page {i}: another's bytes"
        storage.close()


def test_two_threads_starting_kvd_requests_at_once_both_go_on(tmp_path, monkeypatch):
    # Each call names its kvd request from an id generator the storage's threads share. A
    # generator runs in one thread at a time, and making an id let go of the GIL (a fresh
    # uuid, read from the OS): a thread that asked for an id meanwhile got "generator
    # already executing", out of SGLang's own prefetch or backup thread. Here one thread's
    # id is held up while it is being made (where it is made when the call asks) and the
    # other thread stores meanwhile.
    import threading
    import uuid

    from kvd_client import sglang_backend

    with kvd(tmp_path) as k:
        pool = host_pool()
        storage = backend(k.target, pool)
        src = {"a": written_pages(pool, 2, seed=97), "b": written_pages(pool, 2, seed=98)}
        inside, tried = threading.Event(), threading.Event()
        warmed, ready = threading.Barrier(3), threading.Barrier(3)
        results: dict[str, object] = {}
        make_uuid = uuid.uuid4

        def held_up_uuid():
            if threading.current_thread().name == "a" and not inside.is_set():
                inside.set()
                tried.wait(timeout=5)
            return make_uuid()

        def store(name: str) -> None:
            storage.batch_exists(["warm-up"])  # the thread's own client, made first
            warmed.wait(timeout=30)
            ready.wait(timeout=30)
            if name == "b":
                inside.wait(timeout=2)  # while "a" is making its id, if it makes one now
            try:
                results[name] = storage.batch_set_v1(keys(name, 2), src[name])
            except Exception as exc:  # noqa: BLE001 - what SGLang's thread would have got
                results[name] = exc
            finally:
                if name == "b":
                    tried.set()

        threads = [threading.Thread(target=store, args=(n,), name=n) for n in "ab"]
        for t in threads:
            t.start()
        warmed.wait(timeout=30)
        monkeypatch.setattr(sglang_backend.uuid, "uuid4", held_up_uuid)
        ready.wait(timeout=30)
        for t in threads:
            t.join(timeout=30)
        assert results == {"a": [True] * 2, "b": [True] * 2}
        for name in "ab":
            assert_read_back(storage, pool, keys(name, 2), src[name])
        storage.close()


@pytest.mark.parametrize("shards", [
    [dict(is_mla_model=True, pp_size=2, pp_rank=r) for r in range(2)],
    [dict(attn_cp_size=2, attn_cp_rank=r) for r in range(2)],
    [dict(is_mla_model=True, tp_size=2, tp_rank=r, dcp_size=2, dcp_rank=r,
          logical_page_size=2 * PAGE_TOKENS) for r in range(2)],
    [dict(tp_size=2, tp_rank=r) for r in range(2)],
], ids=["mla-pipeline", "context-parallel", "mla-decode-context-parallel", "tensor-parallel"])
@pytest.mark.parametrize("given", [None, "my-model"], ids=["named-by-model", "kvd_namespace"])
def test_ranks_holding_different_shards_of_a_page_each_get_back_their_own(tmp_path, shards,
                                                                          given):
    # Ranks of one SGLang server name a page by the same hash but hold different bytes of
    # it where they split the model (pipeline stages their layers, context-parallel ranks
    # their tokens, tensor-parallel ranks their heads of an MHA model). Named alike in kvd,
    # the second rank's store found the first's page and wrote nothing, and it loaded the
    # first rank's bytes back (an MLA model's pipeline stages and every context-parallel
    # split shared names). A `kvd_namespace`, the same for every rank of a server, stood
    # for the whole name: the ranks shared it.
    with kvd(tmp_path) as k:
        ranks = []
        for seed, shard in enumerate(shards):
            pool = host_pool()
            storage = backend(k.target, pool, extra={"kvd_namespace": given} if given else None,
                              **shard)
            src = written_pages(pool, 3, seed=30 + seed)
            assert storage.batch_set_v1(keys("s", 3), src) == [True] * 3
            ranks.append((pool, storage, src))
        for i, (pool, storage, src) in enumerate(ranks):
            assert_read_back(storage, pool, keys("s", 3), src, who=f"rank {i}: ")
            storage.close()


def tries():
    """Every 0.2 s for 10 s at most: the client reconnects within 2 s, and a call that failed
    leaves kvd alone for kvd_retry_s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        yield
        time.sleep(0.2)


def stored(storage, names, src) -> bool:
    """Whether the pages were stored, tried until they are (see tries)."""
    return any(all(storage.batch_set_v1(names, src)) for _ in tries())


def read(storage, pool, names, src) -> bool:
    """Whether the pages were read whole, tried until they are (see tries); every page a try
    says it read must hold what was stored under its key."""
    dst = pool.alloc(len(names) * PAGE_TOKENS)
    for _ in tries():
        got = storage.batch_get_v1(names, dst)
        for i, ok in enumerate(got):
            if ok:
                assert page(pool, dst, i) == page(pool, src, i), \
                    f"page {i}: not the bytes stored under its key"
        if all(got):
            return True
    return False


def test_across_a_kvd_restart_no_page_is_copied_to_or_from_the_old_kvds_arenas(tmp_path):
    # kvd restarts under a running SGLang: the new kvd's arenas are new shared memory, while
    # the backend still maps the old kvd's. Copying through that mapping, a read returned the
    # old kvd's bytes for pages the new one handed out, and a store put its bytes where the
    # new kvd never looks and committed the keys all the same (pages of zeros, served to
    # every instance as hits). The first calls after a restart may fail (kvd was away, or
    # the backend maps the new arenas): each is tried again (see tries), and what one says it
    # read or stored must be right.
    k = kvd(tmp_path).start()
    try:
        pool = host_pool(64)
        reader, writer = backend(k.target, pool), backend(k.target, pool)
        assert writer.batch_set_v1(keys("old", 2), written_pages(pool, 2, seed=40)) == [True] * 2
        assert reader.batch_exists(keys("old", 2)) == 2
        k.stop()
        k = kvd(tmp_path).start()  # a new, empty kvd on the same socket
        fresh = backend(k.target, pool)  # an instance that started after the restart
        theirs = written_pages(pool, 2, seed=41)
        assert stored(fresh, keys("theirs", 2), theirs)
        # Each old instance's first calls since the restart: reads for one, stores for the
        # other.
        assert read(reader, pool, keys("theirs", 2), theirs)
        mine = written_pages(pool, 2, seed=42)
        assert stored(writer, keys("mine", 2), mine)
        assert read(fresh, pool, keys("mine", 2), mine)
        for storage in (reader, writer, fresh):
            storage.close()
    finally:
        k.stop()


def test_instances_whose_pages_hold_other_dtypes_or_long_names_keep_apart(tmp_path):
    # SGLang's page hashes name tokens, not the bytes an instance keeps for them: an
    # instance whose KV cache is fp16 and one whose cache is bf16 have pages of one size,
    # and each would load the other's as its own. And a model name past what kvd takes
    # made every call fail.
    with kvd(tmp_path) as k:
        bf16, fp16 = host_pool(), host_pool(dtype=torch.float16)
        a, b = backend(k.target, bf16), backend(k.target, fp16)
        assert a.batch_set_v1(keys("k", 2), written_pages(bf16, 2, seed=50)) == [True] * 2
        assert b.batch_exists(keys("k", 2)) == 0
        assert backend(k.target, host_pool()).batch_exists(keys("k", 2)) == 2  # bf16 shares
        long = [backend(k.target, host_pool(), model=c * 300) for c in "xy"]
        src = written_pages(bf16, 2, seed=51)
        assert long[0].batch_set_v1(keys("m", 2), src) == [True] * 2
        assert long[0].batch_exists(keys("m", 2)) == 2 and long[1].batch_exists(keys("m", 2)) == 0
        for storage in (a, b, *long):
            storage.close()


def test_an_instance_started_before_kvd_stores_and_reads_once_kvd_answers(tmp_path):
    # The backend asked kvd for its arenas when SGLang registered its host pool, and SGLang
    # gives up on a storage backend that raises there: started while kvd did not answer,
    # the server had no L3 cache (or did not start). It now starts without kvd, misses
    # meanwhile, and maps kvd's arenas once kvd answers (if its pages fit SGLang's).
    k = kvd(tmp_path)  # not started
    pool = host_pool(64)
    storage = backend(k.target, pool)
    src = written_pages(pool, 2, seed=60)
    assert storage.batch_set_v1(keys("early", 2), src) == [False] * 2
    assert storage.batch_exists(keys("early", 2)) == 0
    # A kvd whose pages do not fit SGLang's is not used, and breaks nothing.
    with kvd(tmp_path, page_bytes=2 * PAGE_BYTES) as misfit:
        storage.client.wait_ready(10)  # past the client's reconnect backoff
        assert storage.batch_set_v1(keys("early", 2), src) == [False] * 2
        with Client(misfit.target) as c:
            assert c.pool_stats().pools[0].tiers[0].used_pages == 0
    k.start()
    try:
        assert stored(storage, keys("early", 2), src), "kvd answers; the backend does not use it"
        assert_read_back(backend(k.target, pool), pool, keys("early", 2), src)
        storage.close()
    finally:
        k.stop()


def test_a_hung_kvd_holds_up_each_sglang_thread_once_a_retry_period(tmp_path):
    # A kvd that hangs (stopped: its socket takes calls, nothing answers) makes each call
    # wait out the backend's timeout. SGLang's prefetch and backup threads call one batch
    # after another: the first timeout marks kvd away for kvd_retry_s, and until then the
    # calls miss at once rather than wait again. The timeout (4 s) is long against a stall of
    # this machine (2.5 s seen): three calls and a stall take less than one more timeout.
    import os
    import signal

    with kvd(tmp_path) as k:
        pool = host_pool()
        storage = backend(k.target, pool, extra={"kvd_timeout_s": 4.0, "kvd_retry_s": 60})
        src = written_pages(pool, 2, seed=70)
        assert storage.batch_set_v1(keys("h", 2), src) == [True] * 2
        os.kill(k.proc.pid, signal.SIGSTOP)
        try:
            took = []
            for call in (lambda: storage.batch_exists(keys("h", 2)),
                         lambda: storage.batch_get_v1(keys("h", 2), pool.alloc(2 * PAGE_TOKENS)),
                         lambda: storage.batch_set_v1(keys("i", 2), src),
                         lambda: storage.batch_exists(keys("h", 2))):
                started = time.monotonic()
                result = call()
                took.append(time.monotonic() - started)
                assert not any(result) if isinstance(result, list) else result == 0
        finally:
            os.kill(k.proc.pid, signal.SIGCONT)
        storage.close()
    print(f"\ncalls against a hung kvd took {took} s")
    assert took[0] >= 3.9 and sum(took[1:]) < 3.5


def test_a_release_kvd_did_not_take_is_sent_again(tmp_path):
    # Each call's kvd request was released once, in the call: a release that failed (kvd
    # did not answer), or an Admit kvd took whose answer was lost, left the request in kvd,
    # and the thread's lease, renewed by its next calls, never lapsed: kvd held its pages
    # and the tenant's budget for as long as SGLang ran. The failures are the test's (the
    # client's calls answer with an error once); kvd is real.
    from kvd_client import DeadlineExceededError, UnavailableError

    with kvd(tmp_path) as k:
        pool = host_pool()
        storage = backend(k.target, pool, extra={"kvd_retry_s": 0.5})
        src = written_pages(pool, 2, seed=71)
        client = storage.client  # this thread's
        admit, release = client.admit, client.release

        def release_fails(*args, **kwargs):
            client.release = release
            raise UnavailableError("connection broke")

        def answer_lost(*args, **kwargs):
            client.admit = admit
            admit(*args, **kwargs)
            raise DeadlineExceededError("Deadline Exceeded")

        client.release = release_fails
        stored = storage.batch_set_v1(keys("h", 2), src)  # not released
        time.sleep(0.6)  # kvd_retry_s
        client.admit = answer_lost
        missed = storage.batch_get_v1(keys("h", 2), pool.alloc(2 * PAGE_TOKENS))
        with Client(k.target, lease="") as observer:
            held = observer.pool_stats().pools[0].num_requests
            time.sleep(0.6)
            got = storage.batch_get_v1(keys("h", 2), pool.alloc(2 * PAGE_TOKENS))  # the next
            left = observer.pool_stats().pools[0].num_requests
        storage.close()
    print(f"\nkvd requests held after the failures: {held}; after the next call: {left}")
    assert left == 0
    assert missed == [False] * 2 and got == [True] * 2
    assert stored == [True] * 2  # committed: the release is not the store's


def test_a_batch_larger_than_kvds_device_tier_is_stored_and_read_back_whole(tmp_path):
    # SGLang backs up and prefetches a prefix's pages in one call, and a long prompt has more
    # pages than kvd's device tier (with SGLang's default page of one token, many more). One
    # kvd request for all of them could never be admitted: kvd refused it, and no page of a
    # long prefix was ever stored. The backend goes in slices that fit.
    with kvd(tmp_path, device_pages=32, host_pages=64) as k:
        pool = host_pool(128)
        storage = backend(k.target, pool)
        src = written_pages(pool, 48, seed=80)
        assert storage.batch_set_v1(keys("long", 48), src) == [True] * 48
        assert storage.batch_exists(keys("long", 48)) == 48
        assert_read_back(storage, pool, keys("long", 48), src)
        storage.close()


def test_a_lookup_naming_a_key_twice_counts_the_run_before_the_repeat(tmp_path):
    # A run of pages is one chain of hashes, so a key named twice ends it (reads stop
    # there). kvd refuses a lookup that names a key twice: the backend sent such a batch
    # whole, and counted no hit at all where a read of the same keys found their run.
    with kvd(tmp_path) as k:
        pool = host_pool()
        storage = backend(k.target, pool)
        names = keys("a", 3)
        assert storage.batch_set_v1(names, written_pages(pool, 3, seed=95)) == [True] * 3
        asked = [*names[:2], names[0], names[2]]
        assert storage.batch_exists(asked) == 2
        assert storage.batch_get_v1(asked, pool.alloc(4 * PAGE_TOKENS)) == [True] * 2 + [
            False] * 2
        storage.close()


def test_a_lookup_of_more_keys_than_one_kvd_call_takes_counts_the_run(tmp_path):
    # A long prompt at SGLang's default page of one token names more pages than one kvd call
    # takes (65,536 block keys, and 4 MiB a message): the whole lookup was refused and
    # counted as no hit at all. The backend asks in slices, as far as the run goes.
    with kvd(tmp_path) as k:
        pool = host_pool()
        storage = backend(k.target, pool)
        names = keys("run", 70_000)
        assert storage.batch_set_v1(names[:4], written_pages(pool, 4, seed=90)) == [True] * 4
        assert storage.batch_exists(names) == 4
        storage.close()


# Random sequences of SGLang's storage calls, from two instances sharing kvd.
SGLANG_EXAMPLES = int(os.environ.get("KVD_SGLANG_EXAMPLES", "12"))
UNIVERSE = 10  # the page keys the instances name


def key_page(pool: MHATokenToKVPoolHost, n: int) -> torch.Tensor:
    """The bytes of page key n (a page's key is its tokens' hash: whoever writes it writes
    the same), as SGLang's flat data page."""
    dummy = pool.get_dummy_flat_data_page()
    gen = torch.Generator().manual_seed(1000 + n)
    data = torch.randint(0, 256, (dummy.numel() * dummy.element_size(),), generator=gen,
                         dtype=torch.uint8)
    return data.view(dummy.dtype).reshape(dummy.shape)


_OP = st.tuples(st.sampled_from(("set", "get", "exists", "set_generic", "get_generic")),
                st.integers(0, 1), st.lists(st.integers(0, UNIVERSE - 1), min_size=1,
                                            max_size=6))


def _call(storage, pool: MHATokenToKVPoolHost, pages: list, op: str, batch: list[int]
          ) -> tuple[int | list[bool], list | None]:
    """One of SGLang's storage calls on these keys (pages: each key's bytes, written into
    the host pool first for a zero-copy store): what it answered, and for a read the pages
    it read into."""
    names = [f"key{n}" for n in batch]
    if op == "exists":
        return storage.batch_exists(names), None
    if op == "set_generic":
        return [storage.batch_set(names, [pages[n] for n in batch])] * len(batch), None
    if op == "get_generic":
        got = storage.batch_get(names, [pool.get_dummy_flat_data_page().clone()
                                        for _ in batch])
        return [g is not None for g in got], got
    indices = pool.alloc(len(batch) * PAGE_TOKENS)
    starts = [int(indices[i * PAGE_TOKENS]) for i in range(len(batch))]
    try:
        if op == "set":
            for start, n in zip(starts, batch):
                pool.set_from_flat_data_page(start, pages[n])
            return storage.batch_set_v1(names, indices), None
        done = storage.batch_get_v1(names, indices)
        return done, [pool.get_data_page(start) for start in starts]
    finally:
        pool.free(indices)


def _distinct(batch: list[int]) -> int:
    """How many keys come before the first one named twice (where a run ends)."""
    return next((i for i, n in enumerate(batch) if n in batch[:i]), len(batch))


def _check_found(op: str, batch: list[int], answer, got, pages: list, stored: set[int]
                 ) -> int:
    """Check a read's or a lookup's answer (the hits a leading run that ends at a repeated
    key, each key found one that some store has stored or begun, each page read holding its
    key's bytes); how many it found."""
    distinct = _distinct(batch)
    if op == "exists":
        hit = answer
    else:
        assert len(answer) == len(batch)
        hit = sum(answer)
        assert answer == [True] * hit + [False] * (len(batch) - hit), \
            f"{op}: hits are not a leading run: {answer}"
    assert hit <= distinct, f"{op}: a run went past a repeated key"
    for i in range(hit):
        n = batch[i]
        assert n in stored, f"{op}: key{n} found, never stored"
        if got is not None:
            assert torch.equal(got[i].view(torch.uint8).flatten(),
                               pages[n].view(torch.uint8).flatten()), \
                f"{op}: key{n} came back with other bytes"
    return hit


def _sglang_kvd(tmp: str, policy: str, device: int, host: int) -> LocalKvd:
    return LocalKvd("--page-bytes", str(PAGE_BYTES), "--block-tokens", str(PAGE_TOKENS),
                    "--device-pages", str(device), "--host-pages", str(host),
                    "--policy", policy, workdir=Path(tmp))


def _storages(target: str, pools: list, slices: int) -> list:
    """Two instances' storages, the first zero-copy, the second generic; `slices`: the kvd
    request's pages at most (kvd_slice_pages), 0 for the backend's default."""
    extra = {"kvd_slice_pages": slices} if slices else None
    return [backend(target, pools[0], extra=extra),
            backend(target, pools[1], v1=False, extra=extra)]


def _self_check(target: str) -> None:
    with Client(target) as c:
        check = c.self_check()
        assert check.ok, check.problems


@settings(max_examples=SGLANG_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(policy=st.sampled_from(policy_names()), roomy=st.booleans(),
       device=st.integers(2, 6), host=st.integers(2, 8), slices=st.integers(0, 6),
       ops=st.lists(_OP, min_size=1, max_size=24))
def test_every_page_two_instances_read_holds_its_keys_bytes(policy, roomy, device, host,
                                                            slices, ops):
    """Each instance stores and reads random runs of page keys (repeats included) through
    the zero-copy and the generic calls, with kvd's tiers tight (kvd lets pages go) or with
    room for every key, and kvd requests of one page or of several (`slices`, up to the
    device tier; 0: the backend's default). Every hit holds its key's bytes and hits are a
    leading run; a key is found only once stored; where every key fits kvd's tiers, a key
    once stored is never lost; and kvd's self-check holds at the end."""
    if roomy:
        host = max(host, UNIVERSE)
    with tempfile.TemporaryDirectory(prefix="kvd-sglang-") as tmp, \
            _sglang_kvd(tmp, policy, device, host) as k:
        pools = [host_pool(), host_pool()]
        storages = _storages(k.target, pools, slices and min(slices, device))
        pages = [key_page(pools[0], n) for n in range(UNIVERSE)]
        stored: set[int] = set()  # keys some store said it stored
        try:
            for op, who, batch in ops:
                # What a read must find where every key fits: the leading run of keys stored.
                run = next((i for i, n in enumerate(batch) if n not in stored), len(batch))
                answer, got = _call(storages[who], pools[who], pages, op, batch)
                if op.startswith("set"):
                    assert len(answer) == len(batch)
                    stored.update(n for n, ok in zip(batch, answer) if ok)
                    continue
                hit = _check_found(op, batch, answer, got, pages, stored)
                if roomy:
                    expected = min(run, _distinct(batch))
                    assert hit == expected, f"{op}: {hit} of a run of {expected} stored keys found"
            _self_check(k.target)
        finally:
            for storage in storages:
                storage.close()


@settings(max_examples=SGLANG_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(policy=st.sampled_from(policy_names()), device=st.integers(2, 6),
       host=st.integers(2, 12), slices=st.integers(0, 6),
       ops=st.lists(st.lists(_OP, min_size=1, max_size=16), min_size=3, max_size=3))
def test_pages_read_while_other_threads_store_hold_their_keys_bytes(policy, device, host,
                                                                     slices, ops):
    """SGLang's cache controller calls one storage from threads of its own at once (its
    prefetch and backup threads): two threads do on one instance, a third on another, each
    its own random calls. Every hit holds its key's bytes and hits are a leading run; a key
    is found only once a store of it has begun; every call answers; kvd's self-check holds
    at the end."""
    import threading

    with tempfile.TemporaryDirectory(prefix="kvd-sglang-") as tmp, \
            _sglang_kvd(tmp, policy, device, host) as k:
        pools = [host_pool(), host_pool()]
        storages = _storages(k.target, pools, slices and min(slices, device))
        pages = [key_page(pools[0], n) for n in range(UNIVERSE)]
        begun: set[int] = set()  # keys some store has begun to store
        lock = threading.Lock()
        start = threading.Barrier(3)
        failures: list[BaseException] = []

        def calls(who: int, mine: list) -> None:
            try:
                start.wait(timeout=30)
                for op, _, batch in mine:
                    if op.startswith("set"):
                        with lock:
                            begun.update(batch)
                    answer, got = _call(storages[who], pools[who], pages, op, batch)
                    if not op.startswith("set"):
                        with lock:
                            seen = set(begun)
                        _check_found(op, batch, answer, got, pages, seen)
            except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
                failures.append(exc)

        threads = [threading.Thread(target=calls, args=(who, mine), daemon=True)
                   for who, mine in zip((0, 0, 1), ops)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert not any(t.is_alive() for t in threads), "a storage call never answered"
            if failures:
                raise failures[0]
            _self_check(k.target)
        finally:
            for storage in storages:
                storage.close()
