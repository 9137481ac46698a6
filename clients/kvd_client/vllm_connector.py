"""kvd as the KV tier below vLLM's own cache: a vLLM KV connector (KVConnectorBase_V1).

Load it with

    KVTransferConfig(kv_connector="KvdConnector",
                     kv_connector_module_path="kvd_client.vllm_connector", kv_role="kv_both",
                     kv_connector_extra_config={"kvd_target": "unix:///run/kvd/kvd.sock"})

(`pip install '<kvd checkout>[vllm]'`). Extra config: `kvd_target`, `kvd_token` (or its file,
`kvd_token_file`), `kvd_pool` ("default"), `kvd_tenant` (the tenant of requests that name
none), `kvd_tenants` (the tenants a request may name, see below), `kvd_load_failure_policy`
("recompute", see below), `kvd_queue_poll_s` (how often kvd is asked whether it admitted a
request it queued, while the connector cannot hear kvd's admissions: 0.05; see below),
`kvd_lookup_again_s` (how long a lookup's answer stands for a request vLLM has not been able
to schedule yet: 0.5; see below), `kvd_save_output` (false; see below).

Scheduler side: every request is admitted in kvd with its prompt and expected output; its
prefix blocks, named by vLLM's own block hashes within a namespace of the model, block size,
KV dtype and the request's cache salt (see `namespace`), are looked up in kvd and their
tokens reported as an external hit. With `kvd_save_output`, the blocks of a request's output
are stored too, as they fill: a conversation's next turn, whose prompt holds this answer,
finds it in kvd, and so does a request vLLM preempted (it resumes without computing its
output again). Without it only prompts are stored: in a workload of single-turn requests an
answer is never read again, and its blocks would take kvd pages from the prompts that are.
While vLLM's own cache has no room for a request, its scheduler asks about it again at every
step: kvd is asked again only once the last answer is `kvd_lookup_again_s` old (an engine
short of memory would otherwise make one more call to kvd at every step, waited for by every
running request), and afresh once vLLM has given the request blocks (to be asked again after
a preemption). An answer kvd has since changed is a miss (computed), or a hit the worker
cannot load (recomputed, see below). A request admitted by no one (kvd's budget for its
tenant is spent) is told to wait: the connector answers None until kvd admits it. vLLM asks
about every waiting request at every step; rather than ask kvd after each (a tenant that
floods the engine with requests kvd queues would have the scheduler call kvd thousands of
times a second, and every running request wait on those calls), the connector follows kvd's
admission events on a stream of its own, from the engine's start, and asks kvd after a
queued request only every QUEUE_FALLBACK_POLLS x `kvd_queue_poll_s` (every
`kvd_queue_poll_s` until kvd has subscribed the stream and while it is down, and at once
for all of them when kvd says the stream lost events). On finish the request is released
in kvd (one aborted while kvd still queued it too, and one whose Admit got no answer, which
kvd may have taken); a release kvd does not take (it is away, or does not answer) is sent
again at the next steps.
The blocks it stored stay there for the next request with that prefix. While it holds
requests in kvd, the scheduler renews its lease every third of kvd's lease TTL (at its next
step; one that failed, a sixth of the TTL later): a request decoding for longer than the TTL
is not taken for one whose engine died. An engine that stops releases in kvd what it still
held there (vLLM's shutdown of the connector). Tenant and intent come from the request:
`kv_transfer_params={"kvd": {"tenant": ..., "priority": ..., "pin": ..., "deadline_ms":
...}}`, the priority falling back to vLLM's own; a pin holds the request's prefix blocks in
kvd's device tier while it runs, a deadline says when it needs them. Whoever sends a request
to vLLM's API server writes its kv_transfer_params, so they are checked like any input from
outside: a request may name only a tenant listed in `kvd_tenants` (a list, or "*" for any: a
front end that sets the field itself), else it runs as `kvd_tenant`, and a field of the
wrong type or range is ignored; each is logged. Without that, one client could name
another's tenant, or a new tenant per request, each with a fair share of its own, and one
malformed field would stop the engine.

Worker side: the KV layout is learnt from register_kv_caches; one kvd page holds one vLLM
block of every layer, layer after layer. An engine of several workers (tensor, context or
pipeline parallel) shards its KV cache: each worker keeps its shard of a block under its own
namespace (the request's, then `|tpR/T|pcpC/P|ppS/N`), and a block counts as a hit only
while kvd holds every worker's shard. Hit blocks are copied from kvd's pages into vLLM's
KV tensors before the forward pass; blocks the pass computed are copied into pages kvd
stores under their hash, then committed. Both are byte copies between the engine's tensors
and kvd's mapped arenas (kvd_client.block_copy); on a GPU they run on a CUDA stream of their
own, through page-locked staging for pages in host memory.

kvd going away never stops the engine: a failed call is logged and the request is served
without kvd (recomputed). An engine started while kvd does not answer starts without it, and
maps kvd's arenas once it does (if their pages fit its blocks). A prefix the scheduler found
in kvd that the worker then cannot load (kvd let it go meanwhile, or went away) is recomputed
too: the connector sets vLLM's `kv_load_failure_policy` to "recompute" (vLLM's own default,
"fail", ends such a request with an error; `kvd_load_failure_policy = "fail"` keeps that).
While kvd does not answer, the connector leaves it alone for a second at a time
(`kvd_retry_s`) rather than stall the scheduler, or a worker's step, on every request. A kvd
that restarted has new arenas: the worker maps them, and bytes copied while it could not
tell which kvd answered are neither committed nor used (see `_check_kvd`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvd_client import (
    UNANSWERED,
    AlreadyExistsError,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    KvdClientError,
    NotFoundError,
    pb,
)
from kvd_client.adapter_settings import VllmSettings, read_settings
from kvd_client.arena import MappedPool, arena_names
from kvd_client.block_copy import BlockCopier, as_tensor

log = logging.getLogger("kvd.vllm")


@dataclass
class _Transfer:
    """Blocks of one request to load from or save to kvd: their keys and vLLM block ids."""

    request_id: str
    namespace: str
    keys: list[bytes]
    block_ids: list[int]
    intent: pb.MemoryIntent | None = None  # the request's pin and deadline for them


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request the scheduler side follows: its namespace, block keys, block ids, how many
    of its blocks are in kvd (loaded or saved), and vLLM's request."""

    namespace: str
    keys: list[bytes]  # the prompt's full blocks; with save_output the output's as they fill
    request: Any = None  # whose block_hashes grow with its output (see save_output)
    intent: pb.MemoryIntent | None = None
    block_ids: list[int] = field(default_factory=list)
    num_in_kvd: int = 0
    pending_load: _Transfer | None = None
    # The last lookup's hit (blocks) and until when it stands, while vLLM has not scheduled
    # the request since (see KvdConnector.lookup_again_s).
    hit: int = 0
    hit_until: float = 0.0


class KvdConnector(KVConnectorBase_V1):
    """vLLM's KV connector onto kvd (see the module's docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = read_settings(VllmSettings,
                                 self._kv_transfer_config.kv_connector_extra_config,
                                 "kv_connector_extra_config")
        self.save_output = settings.kvd_save_output
        self.tenants = allowed_tenants(settings.kvd_tenants)
        self.client = Client(settings.kvd_target, token=settings.token(),
                             timeout_s=settings.kvd_timeout_s)
        self.retry_s = settings.kvd_retry_s
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler reads the policy once its connector is made: a block kvd lost
            # between lookup and load is a miss in a cache, not the request's failure.
            self._kv_transfer_config.kv_load_failure_policy = (
                settings.kvd_load_failure_policy)
        self._away_until = 0.0  # kvd did not answer: calls skipped until then
        self.pool = settings.kvd_pool
        self.default_tenant = settings.kvd_tenant
        self._warned: set[str] = set()  # the problems with requests' params logged so far
        self.block_size = vllm_config.cache_config.block_size
        self.model = model_identity(vllm_config.model_config)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.kv_dtype = kv_dtype(vllm_config)
        # Parallel engines shard the KV cache: each worker's blocks hold its heads (tensor,
        # context parallel) or its layers (pipeline), so each stores and loads them under a
        # namespace of its own shard (see shard_suffix).
        parallel = vllm_config.parallel_config
        self.sizes = (parallel.tensor_parallel_size,
                      getattr(parallel, "prefill_context_parallel_size", 1),
                      parallel.pipeline_parallel_size)
        self.shards = all_shards(self.sizes)  # every worker's, for lookups
        self.shard = ""  # this worker's, once register_kv_caches knows its ranks
        # Scheduler side.
        self.tracked: dict[str, _Tracked] = {}
        # Requests kvd queued (its tenant's budget spent), and when kvd is next asked whether
        # it admitted each: released should they finish (a client that went away) before kvd
        # admits them, or kvd admits them for nobody.
        self.queued: dict[str, float] = {}
        self.queue_poll_s = settings.kvd_queue_poll_s
        self.lookup_again_s = settings.kvd_lookup_again_s
        # Requests whose Admit got no answer (kvd may hold them), and releases kvd has not
        # taken yet (it was away, or did not answer): sent again at the next steps. The
        # lease, renewed while the engine runs, would keep them in kvd for as long.
        # At most OWED_KEPT owed (oldest first, dropped past it): a kvd away for good would
        # have them grow without end, and its leases have long lapsed by then.
        self.unsure: set[str] = set()
        self.owed: dict[str, None] = {}
        # kvd's admission events, followed from the scheduler's start (_follow_admissions),
        # and the ids kvd admitted lately, filled on the client's thread.
        self._watch: Future | None = None
        self._watch_again_at = 0.0
        self._watch_failed = False
        # Whether kvd has subscribed the stream (its events reach the connector from then
        # on): set on the client's thread, once a stream is, and cleared at each new one.
        self.watch_subscribed = False
        self._heard = _RecentIds(ADMISSIONS_KEPT)
        if role == KVConnectorRole.SCHEDULER:
            self._follow_admissions()  # subscribed before requests queue, if kvd answers now
        self._loads: list[_Transfer] = []  # planned since the last step's metadata
        # The lease's renewal in flight (see _renew_lease), when it was sent, and when the
        # next one is due.
        self._renewal: Future | None = None
        self._renewed = self._renew_at = 0.0
        self._lease_ttl_s = float("inf")  # kvd's, once a renewal says it
        # Worker side.
        self.copier: BlockCopier | None = None
        self.arena: MappedPool | None = None
        self.load_errors: set[int] = set()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        rid = request.request_id
        tracked = self.tracked.get(rid)
        if tracked is None:
            if rid in self.queued:
                # vLLM asks at every step about every request it could not schedule: kvd is
                # asked only when its events said it admitted the request, or the next
                # fallback poll is due.
                if not self._heard.take(rid) and time.monotonic() < self.queued[rid]:
                    return None, False
                admitted = self._admitted_since(request)
            else:
                self._follow_admissions()
                admitted = self._admit(request)
            if admitted is None:
                self.queued[rid] = time.monotonic() + self._poll_period()
                return None, False  # kvd queued it: vLLM asks again later
            if not admitted:  # served without kvd (if kvd queued it, released at the end)
                return 0, False
            self.queued.pop(rid, None)
            tracked = self.tracked[rid]
        # The tokens kvd may hold blocks of: the prompt's, and with save_output those of
        # the output so far (a request resumed after a preemption).
        tokens = (request.num_tokens if self.save_output
                  else len(request.prompt_token_ids or ()))
        now = time.monotonic()
        if now < tracked.hit_until:  # asked again: vLLM had no room for it
            hit = tracked.hit
        else:
            try:
                hit = self._lookup(tracked)
            except KvdClientError as exc:
                log.warning("kvd lookup failed, computing %s: %s", rid, exc)
                self._note_failure(exc)
                return 0, False
            tracked.hit, tracked.hit_until = hit, now + self.lookup_again_s
        # vLLM computes at least the prompt's last token itself.
        hit_tokens = min(hit * self.block_size, (tokens - 1) // self.block_size
                         * self.block_size)
        first = num_computed_tokens // self.block_size
        last = hit_tokens // self.block_size
        if last <= first:
            return 0, False
        tracked.pending_load = _Transfer(rid, tracked.namespace, tracked.keys[first:last],
                                         list(range(first, last)), tracked.intent)
        return hit_tokens - num_computed_tokens, False

    def _lookup(self, tracked: _Tracked) -> int:
        """The leading run of the request's blocks kvd holds for every worker's shard."""
        hit = len(self._keys(tracked))
        for suffix in self.shards:
            if not hit:
                break
            hit = min(hit, self.client.lookup(tracked.namespace + suffix, tracked.keys[:hit],
                                              pool=self.pool).num_hit)
        return hit

    def _admit(self, request: Any) -> bool | None:
        """Admit the request in kvd: True, False (kvd cannot take it: serve it without), or
        None (queued: wait)."""
        rid = request.request_id
        params = self._params(request, warn=True)
        prompt = len(request.prompt_token_ids or ())
        sampling = getattr(request, "sampling_params", None)
        # No request outgrows the model's context, whatever max_tokens says (a number past
        # AdmitRequest's uint32 raised in the scheduler and stopped the engine).
        output = min(getattr(sampling, "max_tokens", None) or 0,
                     max(0, self.max_model_len - prompt))
        if self._away():
            return False
        priority = params.priority
        if priority is None:
            priority = getattr(request, "priority", 0) or 0
        try:
            reply = self.client.admit(rid, prompt_tokens=prompt, output_tokens=output,
                                      tenant=params.tenant, pool=self.pool,
                                      priority=clamp_priority(priority))
        except AlreadyExistsError:  # queued before: is it in now?
            return self._admitted_since(request)
        except KvdClientError as exc:
            log.warning("kvd admission failed, serving %s without kvd: %s", rid, exc)
            if isinstance(exc, UNANSWERED):
                self.unsure.add(rid)  # kvd may have taken it: released at its end all the same
            self._note_failure(exc)
            return False
        if reply.decision == pb.DECISION_QUEUED:
            return None
        if reply.decision != pb.DECISION_ADMITTED:
            return False
        self._track(request)
        return True

    def _params(self, request: Any, warn: bool = False) -> KvdParams:
        """The request's kvd params (see kvd_params); with warn, what was wrong with them is
        logged, each kind of problem once (a client repeating it is not worth a line per
        request)."""
        params = kvd_params(request.kv_transfer_params, self.default_tenant, self.tenants)
        for problem in params.problems if warn else ():
            kind = problem.partition(":")[0]
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("request %s: %s (logged once)", request.request_id, problem)
        return params

    def _away(self) -> bool:
        """kvd did not answer a moment ago: leave it alone until `retry_s` has passed."""
        return time.monotonic() < self._away_until

    def _note_failure(self, exc: KvdClientError) -> None:
        if isinstance(exc, UNANSWERED):
            self._away_until = time.monotonic() + self.retry_s

    def _poll_period(self) -> float:
        """How long a queued request waits before kvd is asked after it again: long while
        kvd's admission events reach the connector, short while they do not."""
        watch = self._watch
        if watch is not None and not watch.done() and self.watch_subscribed:
            return self.queue_poll_s * QUEUE_FALLBACK_POLLS
        return self.queue_poll_s

    def _follow_admissions(self) -> None:
        """Follow kvd's admission events from the engine's start, for as long as it runs:
        a stream started only once requests queue would not be subscribed in time to hear
        their admissions. Started again (at a new request, at most every `retry_s`) when it
        ended: kvd went away or restarted."""
        watch = self._watch
        if watch is not None and not watch.done():
            return
        now = time.monotonic()
        if now < self._watch_again_at or self._away():
            return
        if watch is not None and not watch.cancelled() and not self._watch_failed:
            self._watch_failed = True  # said once: kvd restarting ends the stream too
            log.warning("kvd's admission events stopped (%s): asking after queued requests "
                        "every kvd_queue_poll_s until they are followed again",
                        watch.exception() or "the stream ended")
        self._watch_again_at = now + self.retry_s
        self.watch_subscribed = False  # what kvd admits before it is, is not heard
        self._watch = self.client.follow(
            "watch_events", self._on_event, kinds=["admission"],
            pools=[self.pool] if self.pool else [], on_subscribed=self._on_subscribed)

    def _on_subscribed(self) -> None:
        """On the client's thread: kvd's admission events reach the connector from now on
        (what it admitted before, its queued requests' polls until now have asked)."""
        self.watch_subscribed = True

    def _on_event(self, event: pb.Event) -> None:
        """On the client's thread: note what kvd admitted from its queue, or rejected from
        it (a quota lowered under it): either way the request is due, and asked after at
        once. A gap (always sent: the stream lost events, kvd publishing faster than the
        connector reads) makes every queued request due."""
        if event.kind == "gap":
            self._heard.lost = True
        elif event.detail.get("decision") in _DECIDED:
            self._heard.add(event.request_id)

    def _admitted_since(self, request: Any) -> bool | None:
        """A request kvd queued: admitted now (tracked from here), still waiting (None), or
        False (kvd rejected it from its queue, or does not answer: served without it)."""
        if self._away():
            return False
        # A Store of no keys: FAILED_PRECONDITION while queued, INVALID_ARGUMENT once
        # admitted, NOT_FOUND once rejected. Told apart by the code first: the details name
        # the request, whose id is the API client's to choose.
        try:
            self.client.store(request.request_id, "", [])
        except NotFoundError:  # rejected from the queue (a quota lowered): nothing to release
            self.queued.pop(request.request_id, None)
            return False
        except KvdClientError as exc:
            if (isinstance(exc, FailedPreconditionError)
                    and "is queued for admission" in exc.details):
                return None
            if not (isinstance(exc, InvalidArgumentError) and "no block keys" in exc.details):
                self._note_failure(exc)
                return False
        self._track(request)
        return True

    def _track(self, request: Any) -> None:
        salt = getattr(request, "cache_salt", None) or ""
        self.tracked[request.request_id] = _Tracked(
            request=request,
            namespace=namespace(self.model, self.block_size, self.kv_dtype, salt),
            keys=[bytes(h) for h in request.block_hashes], intent=self._params(request).intent)

    def _keys(self, tracked: _Tracked) -> list[bytes]:
        """The request's block keys: its prompt's, and with save_output its output's too, as
        vLLM hashes each block it fills."""
        if self.save_output:
            hashes, keys = tracked.request.block_hashes, tracked.keys
            keys.extend(bytes(h) for h in hashes[len(keys):])
        return tracked.keys

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        tracked = self.tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = list(blocks.get_block_ids()[0])
        tracked.hit_until = 0.0  # scheduled: asked afresh should it wait again (preempted)
        load, tracked.pending_load = tracked.pending_load, None
        if load is not None and num_external_tokens > 0:
            positions = load.block_ids[:num_external_tokens // self.block_size]
            load.keys = load.keys[:len(positions)]
            load.block_ids = [tracked.block_ids[i] for i in positions]
            tracked.num_in_kvd = positions[-1] + 1 if positions else tracked.num_in_kvd
            self._loads.append(load)

    def _check_queue(self) -> None:
        """Once a step: admission events lost make every queued request due."""
        if self._heard.lost:
            self._heard.lost = False
            for rid in self.queued:
                self.queued[rid] = 0.0

    def _renew_lease(self) -> None:
        """kvd releases the requests of a client silent past its lease TTL (one that died).
        The scheduler calls kvd as requests come and go, not while they decode: while it
        holds requests, it renews its lease every third of the TTL kvd gives it. The
        renewal is sent without waiting for kvd's answer (read at a later step), so a kvd
        that hangs never holds up a step with it."""
        if not (self.tracked or self.queued):
            return
        renewal = self._renewal
        if renewal is not None:
            if not renewal.done():
                return
            self._renewal = None
            try:
                self._lease_ttl_s = renewal.result().lease_ttl_s
                self._renew_at = self._renewed + self._lease_ttl_s / 3
            except KvdClientError as exc:
                # Sent again well within the lease: kvd_retry_s may be as long as the lease.
                log.warning("kvd lease renewal failed: %s", exc)
                self._renew_at = self._renewed + min(self.retry_s, self._lease_ttl_s / 6)
        now = time.monotonic()
        if now >= self._renew_at:
            self._renewed = now
            self._renewal = self.client.start("keep_alive")

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._renew_lease()  # the scheduler builds metadata every step
        self._check_queue()
        if self.owed:
            self._send_releases()
        meta = KvdConnectorMetadata(loads=list(self._loads))
        self._loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_save(meta, new.req_id, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracked = self.tracked.get(rid)
            new_ids = cached.new_block_ids[i]
            if tracked is not None and new_ids is not None:
                if rid in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            self._plan_save(meta, rid, cached.num_computed_tokens[i] + scheduled[rid])
        return meta

    def _plan_save(self, meta: KvdConnectorMetadata, rid: str, computed: int) -> None:
        """Save the blocks this step completes that kvd does not have yet: the prompt's, and
        with save_output the output's."""
        tracked = self.tracked.get(rid)
        if tracked is None:
            return
        keys = self._keys(tracked)
        full = min(computed // self.block_size, len(keys), len(tracked.block_ids))
        if full > tracked.num_in_kvd:
            positions = range(tracked.num_in_kvd, full)
            meta.saves.append(_Transfer(rid, tracked.namespace,
                                        [keys[i] for i in positions],
                                        [tracked.block_ids[i] for i in positions],
                                        tracked.intent))
            tracked.num_in_kvd = full

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        tracked = self.tracked.pop(rid, None)
        queued = self.queued.pop(rid, None) is not None
        if rid in self.unsure or queued or tracked is not None:
            self.unsure.discard(rid)
            self._owe(rid)
            self._send_releases()
        return False, None

    def _owe(self, *rids: str) -> None:
        for rid in rids:
            self.owed[rid] = None
        while len(self.owed) > OWED_KEPT:
            del self.owed[next(iter(self.owed))]

    def _send_releases(self) -> None:
        """Release in kvd the requests owed (see `owed`), unless kvd is away. One kvd did
        not answer stays owed; one kvd refuses for another reason is given up, logged."""
        for rid in list(self.owed):
            if self._away():
                return
            try:
                self.client.release(rid)
            except NotFoundError:  # released meanwhile (its lease, a queue rejection)
                pass
            except KvdClientError as exc:
                log.warning("kvd release of %s failed: %s", rid, exc)
                self._note_failure(exc)
                if isinstance(exc, UNANSWERED):
                    return  # kvd is away now: sent again at a later step
            del self.owed[rid]

    # ------------------------------------------------------------------ both sides

    def shutdown(self) -> None:
        """vLLM stops the engine. The scheduler side releases in kvd the requests it still
        holds there (running, or queued by kvd): their pages come back now, not once its
        lease lapses (kvd's lease_ttl_s, 30 s by default), while a restarted engine of the
        same tenant finds its budget spent. A kvd away is not waited for (its lease
        reclaims them). Then either side closes its client."""
        self._owe(*self.tracked, *self.queued, *self.unsure)
        self.tracked.clear()
        self.queued.clear()
        self.unsure.clear()
        self._send_releases()
        self.client.close()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.copier = BlockCopier([kv_caches[name] for name in sorted(kv_caches)])
        self.shard = shard_suffix(self._ranks(), self.sizes)
        self._arena_names = ()
        try:
            export = self.client.export_pool(self.pool)
        except KvdClientError as exc:
            # The engine starts all the same, and maps kvd's arenas once kvd answers.
            log.warning("kvd does not answer; starting without it: %s", exc)
            self._note_failure(exc)
            return
        if problem := self._misfit(export):
            raise ValueError(problem)
        self.arena, self._arena_names = MappedPool(export), arena_names(export)

    def _misfit(self, export: pb.ExportPoolResponse) -> str:
        """Why the engine cannot use this kvd's pages ("" when it can)."""
        block_bytes = self.copier.block_bytes
        if export.page_bytes == block_bytes:
            return ""
        return (f"kvd pool {self.pool or 'default'!r} has pages of {export.page_bytes} bytes; "
                f"one vLLM block of every layer is {block_bytes}: start kvd with "
                f"page_bytes = {block_bytes}")

    def _ranks(self) -> tuple[int, int, int]:
        """This worker's tensor, prefill-context and pipeline parallel ranks."""
        if self.sizes == (1, 1, 1):
            return 0, 0, 0
        from vllm.distributed import parallel_state as ps

        pcp = ps.get_pcp_group().rank_in_group if self.sizes[1] > 1 else 0
        return ps.get_tensor_model_parallel_rank(), pcp, ps.get_pp_group().rank_in_group

    def _check_kvd(self) -> bool | None:
        """Whether the kvd answering now is the one whose arenas are mapped: True; False when
        kvd restarted (its new arenas are mapped now, but what the caller did since its last
        check, pages handed out or bytes copied, may belong to either); None when kvd does
        not answer."""
        if self._away():
            return None
        try:
            export = self.client.export_pool(self.pool)
        except KvdClientError as exc:
            self._note_failure(exc)
            return None
        names = arena_names(export)
        if names == self._arena_names:
            return True
        if problem := self._misfit(export):  # a kvd started since with other pages
            log.error("not using kvd: %s", problem)
            self._away_until = time.monotonic() + self.retry_s
            return None
        log.warning("kvd restarted: mapping its new arenas" if self.arena is not None
                    else "kvd answers: mapping its arenas")
        if self.arena is not None:
            self.arena.close()
        self.arena, self._arena_names = MappedPool(export), names
        return False

    def _page(self, handle: pb.PageHandle) -> torch.Tensor:
        return as_tensor(self.arena.page(handle))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        # Bytes copied from kvd's arenas count only if the same kvd answered before the
        # loads and after the copies (a kvd that restarted between has other arenas).
        answered = self._check_kvd() is not None
        copied = []
        for load in meta.loads:
            handles = []
            if answered and not self._away():
                try:
                    handles = list(self.client.load(load.request_id,
                                                    load.namespace + self.shard,
                                                    load.keys, load.intent).handles)
                except KvdClientError as exc:
                    log.warning("kvd load for %s failed, recomputing: %s", load.request_id,
                                exc)
                    self._note_failure(exc)
            self.copier.load([(self._page(handle), block_id)
                              for handle, block_id in zip(handles, load.block_ids)])
            copied.extend(load.block_ids[:len(handles)])
            self.load_errors.update(load.block_ids[len(handles):])
        if copied and self._check_kvd() is not True:
            self.load_errors.update(copied)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save copies whole blocks once every layer is computed

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        if self._check_kvd() is None:
            return  # kvd is away: these blocks go unsaved
        for save in meta.saves:
            if self._away():
                return  # kvd stopped answering: the rest go unsaved
            try:
                namespace = save.namespace + self.shard
                reply = self.client.store(save.request_id, namespace, save.keys, save.intent)
                fresh = [(key, block_id, handle) for handle, is_fresh, key, block_id
                         in zip(reply.handles, reply.fresh, save.keys, save.block_ids)
                         if is_fresh]
                self.copier.save([(block_id, self._page(handle))
                                  for _, block_id, handle in fresh])
                written = [key for key, _, _ in fresh]
                # Committed only if the kvd that handed out the pages is the one mapped:
                # else the bytes went to the arenas of a kvd that is gone.
                if written and self._check_kvd() is True:
                    self.client.commit(save.request_id, namespace, written)
            except KvdClientError as exc:
                log.warning("kvd save for %s failed: %s", save.request_id, exc)
                self._note_failure(exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors


# The longest namespace the connector names before a worker's shard suffix: kvd takes 256
# characters, and a suffix is at most about 40.
MAX_NAMESPACE = 200


def namespace(model: str, block_size: int, dtype: str, salt: str) -> str:
    """Where a request's prefix blocks are named in kvd: vLLM's block hashes name tokens (and
    the cache salt, LoRA, media), not the bytes an engine keeps for them, which also depend on
    the model (its weights: see model_identity), the block size and the KV dtype. A name
    past MAX_NAMESPACE (a long path or salt) is its digest."""
    name = f"{model}|{block_size}|{dtype}|{salt}"
    if len(name) <= MAX_NAMESPACE:
        return name
    return "vllm-sha256:" + hashlib.sha256(name.encode()).hexdigest()


def model_identity(model_config: Any) -> str:
    """The weights an engine's KV is computed with, as its namespace names them: the model
    (a path or a hub name), and its revision and quantization where given. Engines of one
    model name at another revision, or quantized otherwise, compute other bytes for the same
    tokens: named alike, each loaded the other's blocks as its own."""
    name = str(model_config.model)
    if revision := getattr(model_config, "revision", None):
        name += f"@{revision}"
    if quantization := getattr(model_config, "quantization", None):
        name += f"+{quantization}"
    return name


def kv_dtype(vllm_config: Any) -> str:
    """The dtype of an engine's KV cache: the cache's own (an fp8 format), else the model's."""
    cache = str(vllm_config.cache_config.cache_dtype)
    if cache == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return "fp8_e4m3" if cache == "fp8" else cache  # vLLM's "fp8" is e4m3


def shard_suffix(ranks: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    """What a worker adds to a namespace: its tensor, prefill-context and pipeline parallel
    ranks out of their sizes (decode context parallel is a split of tensor parallel), none
    for an engine of one worker. Two workers of one engine hold different bytes for the same
    block: sharing a name, one would load the other's heads or layers."""
    if all(size == 1 for size in sizes):
        return ""
    return "".join(f"|{name}{rank}/{size}"
                   for name, rank, size in zip(("tp", "pcp", "pp"), ranks, sizes))


def all_shards(sizes: tuple[int, ...]) -> list[str]:
    """Every worker's shard_suffix, for an engine of these sizes."""
    return [shard_suffix(ranks, sizes) for ranks in itertools.product(*map(range, sizes))]


ANY_TENANT = "*"
# While kvd's admission events reach the connector, a queued request is asked after only
# every this many kvd_queue_poll_s (in case its admission was missed).
QUEUE_FALLBACK_POLLS = 20
# Releases kvd has not taken yet kept for sending again (see KvdConnector.owed).
OWED_KEPT = 65536
# How long a lookup's answer stands for a request vLLM has no room for (kvd_lookup_again_s).
LOOKUP_AGAIN_S = VllmSettings.model_fields["kvd_lookup_again_s"].default
ADMISSIONS_KEPT = 4096  # admitted ids heard and not yet asked about (an admin hears all)
# The decisions on a queued request that its admission events tell (Decision's values).
_DECIDED = frozenset({"admitted", "rejected"})


class _RecentIds:
    """The last `size` request ids heard admitted (added on the client's thread, taken on
    the scheduler's): an admin connector hears every engine's admissions on the pool, so
    the oldest go. `lost`: kvd said the stream lost events."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lost = False
        self._ids: dict[str, None] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        with self._lock:
            self._ids[request_id] = None
            if len(self._ids) > self.size:
                del self._ids[next(iter(self._ids))]

    def take(self, request_id: str) -> bool:
        """Whether the id was heard (and is forgotten now)."""
        with self._lock:
            if request_id not in self._ids:
                return False
            del self._ids[request_id]
            return True


PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # AdmitRequest.priority is an int32
MAX_DEADLINE_MS = 10**9  # about eleven days: far enough for any request


def allowed_tenants(setting: Any) -> frozenset[str] | None:
    """`kvd_tenants` as the set of tenants a request may name; None: any ("*")."""
    if setting is None or setting == "":
        return frozenset()
    if setting == ANY_TENANT:
        return None
    names = setting.split(",") if isinstance(setting, str) else setting
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(
            isinstance(n, str) for n in names):
        raise ValueError(f'kvd_tenants must be a list of tenant names, a comma-separated '
                         f'string of them, or "*"; got {setting!r}')
    return frozenset(n.strip() for n in names if n.strip())


@dataclass(frozen=True)
class KvdParams:
    """What a request's `kvd` transfer params say kvd should make of it: its tenant, its
    priority (None: vLLM's own) and its blocks' intent; `problems`: what was ignored."""

    tenant: str
    priority: int | None = None
    intent: pb.MemoryIntent | None = None
    problems: tuple[str, ...] = ()


def kvd_params(transfer: Any, default_tenant: str, allowed: frozenset[str] | None
               ) -> KvdParams:
    """A request's kv_transfer_params, as anyone who sends vLLM a request may write them:
    the tenant only if `allowed` lists it (None: any), else the engine's `default_tenant`;
    a priority that is an integer within int32; a pin that is true or false; a deadline
    that is a finite number of milliseconds from 0 to MAX_DEADLINE_MS. Anything else is
    ignored and said in `problems`."""
    problems: list[str] = []
    params = transfer.get("kvd") if isinstance(transfer, dict) else None
    if params is None:
        return KvdParams(default_tenant)
    if not isinstance(params, dict):
        return KvdParams(default_tenant, problems=(
            f"kv_transfer_params: 'kvd' must be an object, not {type(params).__name__}",))
    tenant = default_tenant
    named = params.get("tenant")
    if named is not None and named != default_tenant:
        if not isinstance(named, str):
            problems.append(f"tenant: must be a string, not {type(named).__name__}")
        elif allowed is None or named in allowed:
            tenant = named
        else:
            problems.append(f"tenant: {named[:64]!r} is not in kvd_tenants; running as "
                            f"{default_tenant or 'the connection tenant'!r}")
    priority = params.get("priority")
    if priority is not None and (type(priority) is not int
                                 or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]):
        problems.append(f"priority: must be an integer within int32, not {priority!r:.64}")
        priority = None
    fields: dict[str, Any] = {}
    pin = params.get("pin")
    if pin is not None:
        if isinstance(pin, bool):
            if pin:
                fields["pin_requested"] = True
        else:
            problems.append(f"pin: must be true or false, not {pin!r:.64}")
    deadline = params.get("deadline_ms")
    if deadline is not None:
        if (isinstance(deadline, (int, float)) and not isinstance(deadline, bool)
                and 0 <= deadline <= MAX_DEADLINE_MS):  # NaN fails the range too
            fields["deadline_us"] = int(deadline * 1000)
        else:
            problems.append(f"deadline_ms: must be a number of milliseconds from 0 to "
                            f"{MAX_DEADLINE_MS}, not {deadline!r:.64}")
    return KvdParams(tenant, priority, pb.MemoryIntent(**fields) if fields else None,
                     tuple(problems))


def clamp_priority(priority: int) -> int:
    """vLLM's own priority (any Python int) within AdmitRequest's int32."""
    return max(PRIORITY_RANGE[0], min(PRIORITY_RANGE[1], int(priority)))


def block_intent(params: dict) -> pb.MemoryIntent | None:
    """A request's `kvd` transfer params as the intent for its prefix blocks in kvd: `pin`
    (held in kvd's device tier while the request runs) and `deadline_ms` (when it needs
    them); fields it cannot use are left out (see kvd_params)."""
    return kvd_params({"kvd": params}, "", None).intent
