"""kvd as SGLang's HiCache L3 store: a HiCacheStorage backend (`pip install '<kvd checkout>[sglang]'`).

Start SGLang with

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvd",
        "module_path": "kvd_client.sglang_backend", "class_name": "KvdStorage",
        "interface_v1": 1, "kvd_target": "unix:///run/kvd/kvd.sock"}'

Extra config: `kvd_target`, `kvd_token` (or its file, `kvd_token_file`), `kvd_pool`
("default"), `kvd_tenant` (when kvd identifies tenants by name rather than by token),
`kvd_namespace` (in place of the model and the host pool's KV dtype in the name of the
pages; the shard of its KV this rank holds is added either way: see `namespace`),
`kvd_timeout_s` (5 s), `kvd_retry_s` (how long calls miss at once after kvd did not answer
one: 1 s), `kvd_slice_pages` (see below); each typed and range-checked.

SGLang names each page of its host pool by a chained hash of its tokens; those names are kvd's
shared prefix blocks, one kvd page per SGLang page (kvd's page_bytes must equal the bytes of
one host page: the backend says the right figure if not). With `interface_v1` the copies are
zero-copy in SGLang's sense: straight between the host pool's pages (their addresses from
`get_page_buffer_meta`) and kvd's mapped arenas, segment after segment (K then V for an MHA
model), the same bytes the generic get/set path moves as one flat page, so either path reads
what the other wrote. Pages SGLang backs up stay in kvd after the call for any instance with
the same namespace; kvd's policy decides which go when memory is short, and a page it let go
is a miss for SGLang (batch_exists counts the leading run kvd still holds).

Each thread SGLang calls the backend from is a kvd client of its own: the pages kvd hands one
thread stay its own until that thread's next call, whatever the others do meanwhile.

A backend that starts while kvd does not answer starts all the same, and maps kvd's arenas
once it does (if their pages fit SGLang's). A kvd that restarted has new arenas. Each call
checks, once its copies are done, that the kvd answering is still the one whose arenas are
mapped (before a store commits anything); if not, it maps the new ones and the call counts
as failed, so that no page is committed with bytes the new kvd never saw, nor read from the
old kvd's memory (see `_same_kvd`). After a call kvd did not answer, calls miss at once for
`kvd_retry_s`.

Only page keys reach a backend, no request: each call is made under short-lived kvd requests
of the configured tenant, one for each slice of at most `kvd_slice_pages` pages (by default an
eighth of kvd's device tier, up to 256: kvd admits no request larger than its device tier),
which kvd admits (or refuses while the tenant's budget is spent: the call then fails from that
slice on, and SGLang recomputes or keeps those pages on its host tier).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvd_client import (
    UNANSWERED,
    Client,
    KvdClientError,
    NotFoundError,
    pb,
)
from kvd_client.adapter_settings import SglangSettings, read_settings
from kvd_client.arena import MappedPool, arena_names

log = logging.getLogger("kvd.sglang")

# The longest namespace kvd takes.
MAX_NAMESPACE = 256
# Keys one Lookup asks after at most (SGLang's keys are 64-character hashes: 270 KB a call).
LOOKUP_SLICE = 4096
# Releases kvd has not taken kept per thread for sending again (see _request).
OWED_KEPT = 4096
# A page's bytes in kvd, as (address, size) segments of the host pool.
Segments = list[tuple[int, int]]


class _NotAdmitted(Exception):
    """kvd queued or refused the call's request."""


class KvdStorage(HiCacheStorage):
    """SGLang's HiCache storage on kvd's shared prefix blocks (see the module's docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None
                 ) -> None:
        settings = read_settings(SglangSettings, storage_config.extra_config,
                                 "hicache storage extra_config")
        token = settings.token()
        self._connect = lambda: Client(settings.kvd_target, token=token,
                                       timeout_s=settings.kvd_timeout_s)
        # A client (a kvd lease) per calling thread: see `client`.
        self._local = threading.local()
        self._clients: list[Client] = []
        self._clients_lock = threading.Lock()
        self.pool = settings.kvd_pool
        # kvd did not answer a moment ago: calls miss at once until then (see _note_failure).
        self.retry_s = settings.kvd_retry_s
        self._away_until = 0.0
        self.tenant = settings.kvd_tenant
        # Named once the host pool says its dtype (register_mem_pool_host).
        self._namespace = settings.kvd_namespace
        self._config = storage_config
        self.namespace = ""
        # Request ids: this storage's prefix, then a number. SGLang's threads take numbers
        # at once: itertools.count's next() is one C call under the GIL, where a generator
        # runs in one thread at a time and refuses the others ("already executing").
        self._id_prefix = f"sglang-{uuid.uuid4().hex[:12]}-"
        self._numbers = itertools.count()
        self.arena: MappedPool | None = None
        self._arena_names: tuple[bytes, ...] = ()
        # Calls copying through each mapping: one a restart replaced is closed once no call
        # copies through it any more (see _mapped).
        self._copying: dict[int, int] = {}
        self._arena_lock = threading.Lock()
        self.page_tokens = 0
        # Pages one kvd request stores or loads at most (see _slice_pages).
        self._slice_pages_given = settings.kvd_slice_pages
        self.slice_pages = self._slice_pages_given or 64
        self.page_bytes = 0

    @property
    def client(self) -> Client:
        """The calling thread's own kvd client. SGLang's cache controller calls its storage
        from several threads at once (prefetch reads beside backup stores), and kvd keeps
        the pages it hands a caller for the caller until the caller's next call: were the
        threads one caller, one thread's call would end another's claim on pages it is
        still copying, and kvd could hand those pages to a store to write into."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._connect()
            with self._clients_lock:
                self._clients.append(client)
        return client

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.namespace = namespace(
            self._config, str(getattr(mem_pool_host, "dtype", "")).removeprefix("torch."),
            self._namespace)
        self.page_tokens = mem_pool_host.page_size
        first = torch.arange(self.page_tokens, dtype=torch.int64)
        self.page_bytes = sum(size for _, size in self._segments(first)[0])
        try:
            export = self.client.export_pool(self.pool)
        except KvdClientError as exc:
            # SGLang starts all the same; the backend maps kvd's arenas once kvd answers.
            log.warning("kvd does not answer; starting without it: %s", exc)
            return
        if problem := self._misfit(export):
            raise ValueError(problem)
        self.arena, self._arena_names = MappedPool(export), arena_names(export)
        self.slice_pages = self._slice_pages(export)

    def _misfit(self, export: pb.ExportPoolResponse) -> str:
        """Why this backend cannot use a kvd's pages ("" when it can)."""
        if export.page_bytes == self.page_bytes:
            return ""
        return (f"kvd pool {self.pool or 'default'!r} has pages of {export.page_bytes} bytes; "
                f"one SGLang host page is {self.page_bytes}: start kvd with "
                f"page_bytes = {self.page_bytes}")

    def _slice_pages(self, export: pb.ExportPoolResponse) -> int:
        """Pages one kvd request of a call stores or loads at most: `kvd_slice_pages`, else an
        eighth of kvd's device tier (up to 256). kvd admits no request larger than its device
        tier, and a prefix of SGLang's (one page a token, by default) can be far larger."""
        if self._slice_pages_given:
            return self._slice_pages_given
        device = [t.num_pages for t in export.tiers if t.tier == pb.TIER_DEVICE]
        return max(1, min(256, (device[0] if device else 64) // 8))

    def _arenas(self) -> bool:
        """Whether kvd's arenas are mapped here: mapped now if kvd answers and they were not
        (the backend started while kvd did not answer)."""
        if self.arena is None:
            try:
                self._same_kvd(None)
            except KvdClientError as exc:
                self._note_failure(exc)
        return self.arena is not None

    def _away(self) -> bool:
        return time.monotonic() < self._away_until

    def _note_failure(self, exc: Exception) -> None:
        """A call kvd did not answer (it is gone, or hangs and the call timed out): SGLang's
        threads call batch after batch, and each would wait out the timeout again. Until
        kvd_retry_s has passed, calls miss at once."""
        if isinstance(exc, UNANSWERED):
            self._away_until = time.monotonic() + self.retry_s

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[MappedPool]:
        """The arenas mapped now, for one call's copies: SGLang's threads call at once, and a
        mapping one of them replaces (kvd restarted) stays open until the others are done
        copying through it."""
        with self._arena_lock:
            arena = self.arena
            self._copying[id(arena)] = self._copying.get(id(arena), 0) + 1
        try:
            yield arena
        finally:
            with self._arena_lock:
                left = self._copying[id(arena)] - 1
                if left:
                    self._copying[id(arena)] = left
                else:
                    del self._copying[id(arena)]
                    if arena is not self.arena:
                        arena.close()

    def _same_kvd(self, arena: MappedPool | None) -> bool:
        """Whether the kvd answering now is the one whose arenas `arena` maps: then it answered
        every call since they were mapped (a kvd that stopped never comes back, and each start
        makes new arenas). If not, the new kvd's arenas are mapped for the calls to come
        (unless its pages do not fit SGLang's)."""
        export = self.client.export_pool(self.pool)
        names = arena_names(export)
        if arena is not None and names == self._arena_names and arena is self.arena:
            return True
        with self._arena_lock:
            if names != self._arena_names:
                if problem := self._misfit(export):  # a kvd started since with other pages
                    log.error("not using kvd: %s", problem)
                    return False
                log.warning("kvd answers: mapping its arenas" if self.arena is None
                            else "kvd restarted: mapping its new arenas")
                old, self.arena = self.arena, MappedPool(export)
                self._arena_names = names
                self.slice_pages = self._slice_pages(export)
                if old is not None and id(old) not in self._copying:
                    old.close()
        return False

    def _segments(self, host_indices: torch.Tensor) -> list[Segments]:
        """Each page's (address, size) segments in the host pool, in page order."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        num_pages = len(host_indices) // self.page_tokens
        per_page = len(ptrs) // max(num_pages, 1)
        return [list(zip(ptrs[i * per_page:(i + 1) * per_page],
                         sizes[i * per_page:(i + 1) * per_page]))
                for i in range(num_pages)]

    # ------------------------------------------------------------------ kvd

    @contextlib.contextmanager
    def _request(self, num_pages: int) -> Iterator[str]:
        """A kvd request for one call's pages, released after it. A release kvd does not
        take (it does not answer), and an Admit whose answer is lost (kvd may have taken
        it), are owed: sent again before the thread's next request. The thread's lease,
        renewed by its calls, would keep them in kvd for as long as SGLang runs."""
        self._send_releases()
        rid = f"{self._id_prefix}{next(self._numbers)}"
        try:
            reply = self.client.admit(rid, prompt_tokens=num_pages * self.page_tokens,
                                      tenant=self.tenant, pool=self.pool)
        except UNANSWERED:
            self._owed.append(rid)
            raise
        if reply.decision == pb.DECISION_REJECTED:  # kvd keeps no such request
            raise _NotAdmitted(reply.reason)
        try:
            if reply.decision != pb.DECISION_ADMITTED:
                raise _NotAdmitted(reply.reason or pb.Decision.Name(reply.decision))
            yield rid
        finally:
            self._owed.append(rid)
            self._send_releases()

    @property
    def _owed(self) -> collections.deque[str]:
        """The calling thread's releases kvd has not taken (the last OWED_KEPT)."""
        owed = getattr(self._local, "owed", None)
        if owed is None:
            owed = self._local.owed = collections.deque(maxlen=OWED_KEPT)
        return owed

    def _send_releases(self) -> None:
        """Release the thread's owed requests, unless kvd is away; one kvd does not answer
        stays owed (and kvd is away a while), one it refuses otherwise is given up."""
        owed = self._owed
        while owed and not self._away():
            try:
                self.client.release(owed[0])
            except NotFoundError:  # released meanwhile (its lease lapsed)
                pass
            except KvdClientError as exc:
                log.warning("kvd: releasing %s failed: %s", owed[0], exc)
                self._note_failure(exc)
                if isinstance(exc, UNANSWERED):
                    return
            owed.popleft()

    def _copy(self, arena: MappedPool, handle: pb.PageHandle, segments: Segments,
              into_kvd: bool) -> None:
        """Copy one page between kvd's arena and the host pool's segments."""
        page = arena.page(handle)
        kvd_ptr = page.ctypes.data if hasattr(page, "ctypes") else page.data.ptr
        copy = ctypes.memmove if hasattr(page, "ctypes") else _cuda_copy
        offset = 0
        for ptr, size in segments:
            if into_kvd:
                copy(kvd_ptr + offset, ptr, size)
            else:
                copy(ptr, kvd_ptr + offset, size)
            offset += size

    def _set(self, keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        """Store each page under its key (pages kvd has already are not written again), in
        slices of at most `slice_pages`: until one fails, the rest with it."""
        if not keys:
            return []
        if self._away() or not self._arenas():
            return [False] * len(keys)
        first = _first_of_each(keys)
        stored: set[str] = set()
        for start in range(0, len(first), self.slice_pages):
            part = first[start:start + self.slice_pages]
            if not self._set_slice([keys[i] for i in part], [pages[i] for i in part]):
                break
            stored.update(keys[i] for i in part)
        return [k in stored for k in keys]

    def _set_slice(self, keys: Sequence[str], pages: Sequence[Segments]) -> bool:
        """Store these pages (their keys distinct) under one kvd request."""
        try:
            with self._request(len(keys)) as rid, self._mapped() as arena:
                reply = self.client.store(rid, self.namespace, [k.encode() for k in keys])
                fresh = [(handle, i) for i, (handle, is_fresh)
                         in enumerate(zip(reply.handles, reply.fresh)) if is_fresh]
                copied = self._copies(arena, [(h, pages[i]) for h, i in fresh], into_kvd=True)
                # Committed only into the arenas of the kvd that handed out the pages.
                if fresh and not (self._same_kvd(arena) and copied):
                    return False
                if fresh:
                    self.client.commit(rid, self.namespace, [keys[i].encode() for _, i in fresh])
        except (KvdClientError, _NotAdmitted) as exc:
            log.warning("kvd: storing %d page(s) failed: %s", len(keys), exc)
            self._note_failure(exc)
            return False
        return True

    def _get(self, keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        """Copy the leading run of keys kvd holds into their pages, in slices of at most
        `slice_pages`: the run ends in the first slice kvd does not hold whole."""
        if not keys:
            return []
        if self._away() or not self._arenas():
            return [False] * len(pages)
        # A run is one chain: it ends at a repeat.
        n = min(_leading_distinct(keys), len(pages))
        found = 0
        for start in range(0, n, self.slice_pages):
            end = min(start + self.slice_pages, n)
            got = self._get_slice(keys[start:end], pages[start:end])
            found += got
            if got < end - start:
                break
        return [i < found for i in range(len(pages))]

    def _get_slice(self, keys: Sequence[str], pages: Sequence[Segments]) -> int:
        """Copy the leading run of these keys kvd holds (one kvd request): how many."""
        try:
            with self._request(len(keys)) as rid, self._mapped() as arena:
                reply = self.client.load(rid, self.namespace, [k.encode() for k in keys])
                handles = reply.handles[:len(pages)]
                copied = self._copies(arena, list(zip(handles, pages)), into_kvd=False)
                # Read only from the arenas of the kvd that handed out the pages.
                return (len(handles) if not handles or (self._same_kvd(arena) and copied)
                        else 0)
        except (KvdClientError, _NotAdmitted) as exc:
            log.warning("kvd: loading %d page(s) failed: %s", len(keys), exc)
            self._note_failure(exc)
            return 0

    def _copies(self, arena: MappedPool, pages: list[tuple[pb.PageHandle, Segments]],
                into_kvd: bool) -> bool:
        """Copy each page between kvd's arena and its host segments; False when a handle
        names a page the arenas mapped here do not have (they are another kvd's)."""
        try:
            for handle, segments in pages:
                self._copy(arena, handle, segments, into_kvd)
        except LookupError as exc:
            log.warning("kvd: a page handle outside the mapped arenas: %s", exc)
            return False
        return True

    # ------------------------------------------------------------------ zero-copy (v1)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        pages = self._segments(host_indices)
        return self._get(keys, pages) + [False] * (len(keys) - len(pages))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        return self._set(keys, self._segments(host_indices))

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The leading run of keys kvd holds, asked LOOKUP_SLICE keys at a time (one call
        takes at most 65,536 keys and 4 MiB, and a long prompt of one-token pages names more)
        as far as the run goes. A run is one chain: it ends at a repeat, as a read's does
        (and kvd refuses a lookup that names a key twice)."""
        keys = keys[:_leading_distinct(keys)]
        hit = 0
        for start in range(0, len(keys), LOOKUP_SLICE):
            if self._away():
                break
            part = keys[start:start + LOOKUP_SLICE]
            try:
                found = self.client.lookup(self.namespace, [k.encode() for k in part],
                                           pool=self.pool).num_hit
            except KvdClientError as exc:
                log.warning("kvd: lookup failed, counting misses: %s", exc)
                self._note_failure(exc)
                break
            hit += found
            if found < len(part):
                break
        return hit

    # ------------------------------------------------------------------ generic

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: list[torch.Tensor] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = [t if t is not None else self.mem_pool_host.get_dummy_flat_data_page()
                   for t in (target_locations or [None] * len(keys))]
        found = self._get(keys, [_flat(t) for t in targets])
        return [t if ok else None for t, ok in zip(targets, found)]

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: list[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        values = [v.contiguous() for v in values or ()]
        return all(self._set(keys, [_flat(v) for v in values]))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()


def namespace(config: HiCacheStorageConfig, dtype: str, given: str | None = None) -> str:
    """Where this rank's pages are named in kvd: SGLang's page hashes name tokens, not the
    bytes a rank keeps for them, which also depend on the model, the KV dtype (of the host
    pool: fp16 and bf16 pages are one size) and the rank's shard. `kvd_namespace`, when
    given, stands for the model and the dtype; the shard is the rank's whatever it says
    (given alike to every rank, it had them all load each other's bytes). A name longer
    than kvd takes (a long model path) is its digest."""
    base = given if given is not None else f"sglang|{config.model_name or ''}|{dtype}"
    name = f"{base}{shard_suffix(config)}"
    if len(name) <= MAX_NAMESPACE:
        return name
    return "sglang-sha256:" + hashlib.sha256(name.encode()).hexdigest()


def shard_suffix(config: HiCacheStorageConfig) -> str:
    """The part of a page's bytes this rank holds, as it names them in kvd. Tensor-parallel
    ranks hold their heads of an MHA model's pages (an MLA model's latent KV is the same on
    each); pipeline stages hold their layers, attention context-parallel and (MLA) decode
    context-parallel ranks their share of the tokens, whatever the model: ranks whose bytes
    differ must not share a name, or one loads another's."""
    parts = []
    if not config.is_mla_model:
        parts += [f"|tp{config.tp_rank}/{config.tp_size}",
                  f"|pp{config.pp_rank}/{config.pp_size}"]
    elif config.pp_size > 1:
        parts.append(f"|pp{config.pp_rank}/{config.pp_size}")
    if getattr(config, "attn_cp_size", 1) > 1:
        parts.append(f"|cp{config.attn_cp_rank}/{config.attn_cp_size}")
    if config.is_mla_model and getattr(config, "dcp_size", 1) > 1:
        parts.append(f"|dcp{config.dcp_rank}/{config.dcp_size}")
    return "".join(parts)


def _flat(tensor: torch.Tensor) -> Segments:
    """A whole flat page tensor as one segment."""
    if not tensor.is_contiguous():
        raise ValueError("kvd needs a contiguous page tensor")
    return [(tensor.data_ptr(), tensor.numel() * tensor.element_size())]


def _first_of_each(keys: Sequence[str]) -> list[int]:
    """The positions of each key's first occurrence (kvd takes each key once a call)."""
    seen: set[str] = set()
    first = []
    for i, k in enumerate(keys):
        if k not in seen:
            seen.add(k)
            first.append(i)
    return first


def _leading_distinct(keys: Sequence[str]) -> int:
    """How many keys come before the first repeated one."""
    seen: set[str] = set()
    for i, k in enumerate(keys):
        if k in seen:
            return i
        seen.add(k)
    return len(keys)


def _cuda_copy(dst: int, src: int, size: int) -> None:
    """A copy where one side is kvd's GPU arena (CUDA works out the direction)."""
    import cupy

    cupy.cuda.runtime.memcpy(dst, src, size, cupy.cuda.runtime.memcpyDefault)
