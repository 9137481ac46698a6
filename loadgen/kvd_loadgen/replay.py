"""`kvd-loadgen replay-intents`: play intent-event traces through a live kvd, as an engine
would, and compare policies with the reference simulator and with Belady's MIN."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from rich.console import Console

from kvd_client import AsyncClient, KvdClientError, eventloop, pb
from kvd_loadgen.belady import belady_min
from kvd_loadgen.data import INTENT_PROFILES, resolve_intent_trace
from kvd_loadgen.intent_trace import IntentEvent, read_intent_trace
from kvd_loadgen.scenario import local_kvd
from kvd_loadgen.scenario_report import ScenarioReport, finish

KVD_POLICIES = ("lru", "regret", "reuse", "intent", "deadline", "fair:intent")
BLOCK_TOKENS = 16

# shared/data/INTENT_TRACE_FORMAT.md: the reference simulator's decode-critical misses on these
# exact files with 128 HBM blocks and 4096 DRAM blocks.
REFERENCE_MISSES = {
    "balanced": {"LRU": 76, "HotCold": 76, "PredictiveHotness": 49, "IntentAware": 8,
                 "DeadlineAware": 10},
    "deadline_pressure": {"LRU": 96, "HotCold": 96, "PredictiveHotness": 96, "IntentAware": 6,
                          "DeadlineAware": 6},
    "rag_mixed_priority": {"LRU": 73, "HotCold": 73, "PredictiveHotness": 40, "IntentAware": 7,
                           "DeadlineAware": 8},
    "speculative_decode": {"LRU": 76, "HotCold": 76, "PredictiveHotness": 49, "IntentAware": 8,
                           "DeadlineAware": 10},
    "long_context_extreme": {"LRU": 70, "HotCold": 70, "PredictiveHotness": 31,
                             "IntentAware": 4, "DeadlineAware": 6},
}
REFERENCE_DEVICE_PAGES = 128

_PRIORITY = {"COLD": pb.PRIORITY_COLD, "WARM": pb.PRIORITY_WARM, "HOT": pb.PRIORITY_HOT,
             "DECODE_CRITICAL": pb.PRIORITY_DECODE_CRITICAL}
_PHASE = {name: getattr(pb, f"PHASE_{name}") for name in
          ("PREFILL", "DECODE", "VERIFY", "ROLLBACK", "DONE", "IDLE")}
_ALL_FIELDS = ("phase", "priority", "deadline_us", "slack_us", "recompute_cost_us",
               "spill_cost_us", "request_priority", "recency_score", "target_decode_step",
               "expected_reuse_window_tokens", "is_draft", "is_committed", "compression_ok",
               "recompute_ok", "prefetch_ok", "pin_requested")
# What each event hands the memory manager (INTENT_TRACE_FORMAT.md, "How the reference
# simulator applies events").
_EVENT_FIELDS = {
    "ALLOCATED": _ALL_FIELDS,
    "MARKED_DECODE_CRITICAL": ("deadline_us", "slack_us", "target_decode_step",
                               "expected_reuse_window_tokens", "request_priority",
                               "recency_score"),
    "MARKED_COLD": ("phase", "deadline_us", "slack_us", "compression_ok", "recompute_ok",
                    "prefetch_ok", "recency_score"),
    "ACCESSED": ("phase", "priority", "deadline_us", "slack_us", "target_decode_step",
                 "expected_reuse_window_tokens", "pin_requested", "prefetch_ok"),
}
# Events the simulator itself produced (its own decisions), which an engine does not send.
_OBSERVATIONS = frozenset({"SPILLED", "MISS", "EVICTED"})


def event_intent(event: IntentEvent) -> pb.MemoryIntent:
    """The MemoryIntent an engine would send for this event."""
    src = event.intent
    fields = {}
    for name in _EVENT_FIELDS.get(event.event_type, ()):
        value = src.get(name)
        if value is None:
            continue
        if name == "priority":
            value = _PRIORITY[value]
        elif name == "phase":
            value = _PHASE[value]
        elif name == "request_priority":
            value = max(0, min(100, int(value)))
        elif name == "recency_score":
            value = max(0.0, min(1.0, float(value)))
        fields[name] = value
    if event.event_type == "MARKED_DECODE_CRITICAL":
        fields["priority"] = pb.PRIORITY_DECODE_CRITICAL
    elif event.event_type == "MARKED_COLD":
        fields["priority"] = pb.PRIORITY_COLD
    elif event.event_type == "COMMITTED":
        fields.update(is_committed=True, is_draft=False)
    return pb.MemoryIntent(**fields)


@dataclass(slots=True)
class ReplayResult:
    profile: str
    policy: str
    decode_critical_accesses: int | None
    decode_critical_misses: int | None
    deadline_misses: int | None
    evictions: int | None
    peak_device_pages: int | None
    device_pages: int
    wall_s: float | None
    promotions: int | None = None
    prefetches: int | None = None
    bytes_moved: int | None = None
    page_bytes: int | None = None
    trace_block_bytes: int | None = None
    pins_refused: int | None = None
    source: str = "kvd"  # kvd | reference-simulator | belady-min | belady-placed
    # Every block brought to the device tier (kvd: promotions, prefetches included; MIN:
    # its misses, each a fetch): what the policies are compared on against the optimum.
    fetches: int | None = None


class TraceTooBig(ValueError):
    """The trace has a request larger than the device tier: kvd would refuse it."""


def peak_live_blocks(events: list[IntentEvent]) -> dict[str, int]:
    """Each request's most blocks alive at once: what it asks admission for."""
    live: Counter[str] = Counter()
    peak: dict[str, int] = {}
    for e in events:
        if e.event_type == "ALLOCATED":
            live[e.request_id] += 1
            peak[e.request_id] = max(peak.get(e.request_id, 0), live[e.request_id])
        elif e.event_type == "FREED":
            live[e.request_id] -= 1
    return peak


# How the replay holds the trace's pins: as written (a decode-critical block stays pinned for
# the rest of the trace: the traces never unpin), or until the block's read (the engine pins a
# block for the step that reads it, then lets it go: it stays HOT).
PIN_MODES = ("trace", "until-read")


class _Steps:
    """A trace as Step messages, and what kvd's replies to them ask for: a pin kvd refuses
    is counted, and the other intent fields of its message are sent again without it."""

    def __init__(self, events: list[IntentEvent], profile: str, prefix: str,
                 pins: str = "trace") -> None:
        if pins not in PIN_MODES:
            raise ValueError(f"pins must be one of {', '.join(PIN_MODES)}, not {pins!r}")
        self.events = events
        self.profile = profile
        self.prefix = prefix
        self.pins = pins
        self.refused: Counter = Counter()
        self.fixes: list[pb.IntentUpdate] = []  # updates to send again, without their pins
        self.unpins: list[pb.IntentUpdate] = []  # pins to let go once their read is sent
        self._sent: list[list[IntentEvent]] = []  # each message's events, until its reply

    def messages(self):
        for group, step in self._steps():
            self._sent.append(group)
            yield step

    def _steps(self):
        """One Step message per logical step of the trace; a step is split only where an
        event touches a block allocated earlier in it (kvd applies intents before
        allocations within a message)."""
        index: dict[str, tuple[str, int]] = {}
        next_index: Counter[str] = Counter()
        group: list[IntentEvent] = []
        step = pb.StepRequest()
        fresh: set[str] = set()  # objects allocated in the current message
        for event in self.events:
            kind = event.event_type
            if kind in _OBSERVATIONS or (kind != "ALLOCATED" and event.object_id not in index):
                continue  # the simulator's own outputs, or a block never allocated
            if group and (event.step != group[0].step or event.object_id in fresh):
                yield group, step
                group, step, fresh = [], pb.StepRequest(), set()
            if not group:
                step.intents.extend(self.fixes)
                step.intents.extend(self.unpins)
                self.fixes.clear()
                self.unpins.clear()
            group.append(event)
            rid = self.prefix + event.request_id
            if kind == "ALLOCATED":
                step.allocations.append(pb.AllocateRequest(request_id=rid, num_blocks=1,
                                                           intent=event_intent(event)))
                index[event.object_id] = (rid, next_index[rid])
                next_index[rid] += 1
                fresh.add(event.object_id)
                continue
            rid, block = index[event.object_id]
            if kind == "FREED":
                step.frees.append(pb.FreeRequest(request_id=rid, block_indices=[block]))
                del index[event.object_id]
                continue
            step.intents.append(pb.IntentUpdate(request_id=rid, block_index=block,
                                                intent=event_intent(event),
                                                prefetch=kind == "PREFETCHED"))
            if kind == "ACCESSED":
                step.accesses.append(pb.AccessRequest(request_id=rid, block_indices=[block]))
                if self.pins == "until-read":  # applied in the next message, after the read
                    self.unpins.append(pb.IntentUpdate(
                        request_id=rid, block_index=block,
                        intent=pb.MemoryIntent(pin_requested=False,
                                               priority=pb.PRIORITY_HOT)))
        if group:
            yield group, step

    def on_reply(self, step: pb.StepRequest, reply: pb.StepResponse) -> None:
        group = self._sent.pop(0)
        for err in reply.errors:
            if err.section != "intents" or err.code != grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                raise RuntimeError(f"{self.profile} lines {group[0].line}-{group[-1].line}: "
                                   f"{err.section}: {err.message}")
            self.refused["pin"] += 1  # the pin would overcommit the device tier
            for update in step.intents:
                fixed = pb.IntentUpdate()
                fixed.CopyFrom(update)
                fixed.intent.ClearField("pin_requested")
                if fixed.intent.priority == pb.PRIORITY_DECODE_CRITICAL:
                    fixed.intent.ClearField("priority")
                self.fixes.append(fixed)


async def replay_events(target: str, pool: str, profile: str, events: list[IntentEvent],
                        prefix: str = "", window: int = 16, pins: str = "trace"
                        ) -> ReplayResult:
    """Play one trace into one pool of a live kvd: each event is one logical step, sent as one
    Step message (ALLOCATED -> allocation carrying the intent, ACCESSED -> intent + access,
    MARKED_* and COMMITTED -> intent updates, PREFETCHED -> hint, FREED -> free).

    Events of one logical step go in one message. Steps are pipelined (up to `window` in
    flight; kvd applies them in order). kvd numbers a request's blocks in allocation order,
    so the replayer knows each block's index without waiting. A pin kvd refuses (it would
    overcommit the device tier) is counted and the block's other intent fields are re-sent
    without it, `window` steps later at most. pins: see PIN_MODES."""
    blocks_per_request = peak_live_blocks(events)
    steps = _Steps(events, profile, prefix, pins)
    started = time.perf_counter()
    async with AsyncClient(target, timeout_s=60) as kvd:
        before = (await kvd.pool_stats(pool)).pools[0]
        for request_id, num_blocks in blocks_per_request.items():
            reply = await kvd.admit(prefix + request_id, num_blocks * BLOCK_TOKENS, pool=pool,
                                    tenant="replay")
            if reply.decision != pb.DECISION_ADMITTED:
                raise RuntimeError(f"{profile}: {request_id} not admitted: {reply.reason}")
        async with kvd.step_stream() as stream:
            await stream.pipeline(steps.messages(), steps.on_reply, window=window)
            if steps.fixes or steps.unpins:
                await _send(stream, pb.StepRequest(intents=steps.fixes + steps.unpins),
                            strict=True)
        for request_id in blocks_per_request:
            await kvd.release(prefix + request_id)
        after = (await kvd.pool_stats(pool)).pools[0]
    return ReplayResult(
        profile=profile,
        policy=after.policy,
        decode_critical_accesses=after.num_decode_critical_accesses
        - before.num_decode_critical_accesses,
        decode_critical_misses=after.num_decode_critical_misses
        - before.num_decode_critical_misses,
        deadline_misses=after.num_deadline_misses - before.num_deadline_misses,
        evictions=after.num_evictions - before.num_evictions,
        peak_device_pages=after.peak_device_pages,
        device_pages=after.tiers[0].capacity_pages,
        wall_s=time.perf_counter() - started,
        promotions=after.num_promotions - before.num_promotions,
        prefetches=after.num_prefetches - before.num_prefetches,
        bytes_moved=after.bytes_moved - before.bytes_moved,
        page_bytes=after.page_bytes,
        trace_block_bytes=events[0].intent["size_bytes"] if events else None,
        pins_refused=sum(steps.refused.values()),
        fetches=after.num_promotions - before.num_promotions,
    )


async def _send(stream, step: pb.StepRequest, strict: bool = False) -> pb.StepResponse:
    reply = await stream.send(step)
    if strict and reply.errors:
        raise RuntimeError(f"kvd refused a replay step: {list(reply.errors)}")
    return reply


def _config(policies, device_pages: int, host_pages: int, page_bytes: int) -> str:
    pools = "".join(
        f'[[pool]]\nname = "{p}"\npolicy = "{p}"\npage_bytes = {page_bytes}\n'
        f"block_tokens = {BLOCK_TOKENS}\ndevice_pages = {device_pages}\n"
        f'host_pages = {host_pages}\nadmission = "reservation"\n\n'
        for p in policies
    )
    return "[server]\ngrace_s = 2\n\n" + pools


async def replay_profile(path: Path, profile: str, policies, *, device_pages: int,
                         host_pages: int, page_bytes: int, target: str | None = None,
                         pins: str = "trace") -> list[ReplayResult]:
    """Every policy on one trace, each in its own fresh pool of one kvd (or, with target, in
    the existing kvd's pools named after the policies)."""
    events = read_intent_trace(path)
    largest = max(peak_live_blocks(events).values(), default=0)
    if largest > device_pages:
        raise TraceTooBig(f"{profile}: a request holds {largest} blocks at once, more than "
                          f"the {device_pages} device pages (kvd admits no request the "
                          "device cannot hold whole)")
    results = []
    if target is None:
        async with local_kvd(_config(policies, device_pages, host_pages, page_bytes),
                             prefix="kvd-replay-") as (kvd, _):
            for policy in policies:
                results.append(await replay_events(kvd.target, policy, profile, events,
                                                   pins=pins))
    else:
        for policy in policies:
            results.append(await replay_events(target, policy, profile, events,
                                               prefix=f"{profile}-{time.time_ns()}-",
                                               pins=pins))
    mn = belady_min(events, device_pages)
    results.append(ReplayResult(profile, "belady-min", mn.decode_critical_accesses,
                                mn.decode_critical_misses, None, None, None, device_pages, None,
                                source="belady-min", fetches=mn.misses))
    # The optimum kvd can be held to: every allocated, accessed or prefetched block placed (no
    # bypass), as kvd's intent-aware policies place them.
    placed = belady_min(events, device_pages, must_place=True, prefetches=True)
    results.append(ReplayResult(profile, "belady-placed", placed.decode_critical_accesses,
                                placed.decode_critical_misses, None, None, None, device_pages,
                                None, source="belady-placed", fetches=placed.fetches))
    if profile in REFERENCE_MISSES and device_pages == REFERENCE_DEVICE_PAGES:
        for name, misses in REFERENCE_MISSES[profile].items():
            results.append(ReplayResult(profile, f"ref:{name}", mn.decode_critical_accesses,
                                        misses, None, None, None, device_pages, None,
                                        source="reference-simulator"))
    return results


def build_report(results: list[ReplayResult], page_bytes: int) -> ScenarioReport:
    r = ScenarioReport(
        "replay-intents", "Intent-trace replay through a live kvd",
        f"Every policy plays each trace's steps over the Step stream of a live kvd. Pages are "
        f"scaled to {page_bytes} B (page counts decide misses). belady-min is the offline "
        "optimum on the same accesses; ref: rows are the reference simulator's published "
        "counts (INTENT_TRACE_FORMAT.md).")
    r.data = {"results": [asdict(x) for x in results]}

    def fmt(value, spec=""):
        return "-" if value is None else format(value, spec)

    rows = []
    for x in results:
        peak = "-" if x.peak_device_pages is None else f"{x.peak_device_pages}/{x.device_pages}"
        rows.append([x.profile, x.policy, fmt(x.decode_critical_accesses),
                     fmt(x.decode_critical_misses), fmt(x.deadline_misses), fmt(x.evictions),
                     fmt(x.promotions), fmt(x.prefetches), peak, fmt(x.wall_s, ".2f")])
    r.table("Per trace and policy",
            ["profile", "policy", "dc acc", "dc miss", "dl miss", "evict", "promo",
             "prefetch", "peak/cap", "wall s"], rows)
    kvd = [x for x in results if x.source == "kvd"]
    _against_min(r, results)
    if kvd:
        peak_ok = all(x.peak_device_pages is None or x.peak_device_pages <= x.device_pages
                      for x in kvd)
        r.target("device pages never above capacity", peak_ok,
                 f"{sum(1 for x in kvd if x.peak_device_pages is not None)} runs checked")

    def misses(pyplot):
        profiles = sorted({x.profile for x in results})
        policies = [p for p in dict.fromkeys(x.policy for x in results)]
        fig, ax = pyplot.subplots(figsize=(max(7, 1.2 * len(profiles) * 2), 3.8))
        width = 0.8 / max(len(policies), 1)
        for i, policy in enumerate(policies):
            ys = [next((x.decode_critical_misses for x in results
                        if x.profile == prof and x.policy == policy), 0) or 0
                  for prof in profiles]
            ax.bar([j + i * width for j in range(len(profiles))], ys, width, label=policy)
        ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(profiles))])
        ax.set_xticklabels(profiles, fontsize=8)
        ax.set_ylabel("decode-critical misses")
        ax.set_yscale("symlog")
        ax.legend(fontsize=7, ncol=2)
        return fig

    r.figure("misses", "Decode-critical misses per trace and policy", misses)
    return r


# The best policy's fetches may be this many times the optimum's, where the optimum's are
# not zero.
FETCHES_VS_MIN = 1.2


def _against_min(r: ScenarioReport, results: list[ReplayResult]) -> None:
    """Every block each policy brought in, beside the optimum's misses on the same accesses
    (Belady MIN placing every block, as kvd must), and the best policy's ratio to it."""
    rows = []
    for profile in sorted({x.profile for x in results}):
        mn = next((x for x in results
                   if x.profile == profile and x.source == "belady-placed"), None)
        runs = [x for x in results if x.profile == profile and x.source == "kvd"
                and x.fetches is not None]
        if mn is None or not runs:
            continue
        best = min(runs, key=lambda x: x.fetches)
        ratio = best.fetches / mn.fetches if mn.fetches else None
        rows.append([profile, str(mn.device_pages), str(mn.fetches),
                     " / ".join(f"{x.policy} {x.fetches}" for x in runs), best.policy,
                     "-" if ratio is None else f"{ratio:.2f}x"])
        if ratio is not None:
            r.target(f"{profile} at {mn.device_pages} pages: the best policy's fetches <= "
                     f"{FETCHES_VS_MIN}x the optimum's", ratio <= FETCHES_VS_MIN,
                     f"{best.policy}: {best.fetches} vs {mn.fetches} ({ratio:.2f}x)")
    if rows:
        r.table("Blocks brought to the device (every promotion, prefetches included) against "
                "the optimum's (Belady MIN placing every block, as kvd must)",
                ["profile", "device pages", "MIN", "each policy", "best", "best / MIN"], rows)


# The harder settings the comparison with MIN is made at (at the traces' 128 pages MIN is
# zero on every profile); a profile whose requests are larger than a setting is played at the
# smallest device that holds its largest request.
AGAINST_MIN_PAGES = (64, 96)


async def against_min(pages=AGAINST_MIN_PAGES, policies=KVD_POLICIES) -> dict:
    """Every profile under every policy at each setting, pins held until read (the traces never
    let a pin go, and below 96 pages their pins alone would fill the device): each policy's
    fetches and the optimum's, per profile and device size."""
    out: dict = {}
    for profile in INTENT_PROFILES:
        path = resolve_intent_trace(profile)
        events = read_intent_trace(path)
        largest = max(peak_live_blocks(events).values())
        for n in sorted({max(n, largest) for n in pages}):
            rows = await replay_profile(path, profile, policies, device_pages=n,
                                        host_pages=4096, page_bytes=4096, pins="until-read")
            out.setdefault(profile, {})[n] = {
                "min": next(x.fetches for x in rows if x.source == "belady-placed"),
                # The optimum not asked to honour the engine's prefetch hints (for reference).
                "min_without_prefetches": belady_min(events, n, must_place=True).fetches,
                "policies": {x.policy: x.fetches for x in rows if x.source == "kvd"}}
    return out


def against_min_targets(out: dict) -> dict[str, dict]:
    """Where the optimum fetches anything: the best policy's fetches within FETCHES_VS_MIN of
    it (its bound, the measured ratio, met)."""
    targets = {}
    for profile, settings in out.items():
        for n, row in settings.items():
            if not row["min"]:
                continue
            best = min(row["policies"].values())
            ratio = best / row["min"]
            targets[f"min_{profile}_{n}p_best_fetches_vs_min"] = {
                "op": "<=", "value": FETCHES_VS_MIN, "measured": round(ratio, 3),
                "met": ratio <= FETCHES_VS_MIN}
    return targets


def run_replay_cli(args) -> int:
    names = []
    for name in args.trace:
        names.extend(INTENT_PROFILES if name == "all" else [name])
    policies = KVD_POLICIES if args.policy == "all" else tuple(args.policy.split(","))
    try:  # every name before the first replay: a typo in the last is not found minutes in
        paths = [resolve_intent_trace(name) for name in names]
    except FileNotFoundError as exc:
        print(f"kvd-loadgen replay-intents: {exc} (the profiles: "
              f"{', '.join(INTENT_PROFILES)}, or 'all')", file=sys.stderr)
        return 2
    console = Console(width=max(Console().width, 110))
    results: list[ReplayResult] = []
    started = time.perf_counter()
    for path in paths:
        profile = path.name.split(".")[0]
        with console.status(f"replaying {profile} under {', '.join(policies)}"):
            try:
                results += eventloop.run(replay_profile(
                    path, profile, policies, device_pages=args.device_pages,
                    host_pages=args.host_pages, page_bytes=args.page_bytes,
                    target=args.target, pins=args.pins))
            except TraceTooBig as exc:
                console.print(f"[yellow]{profile} skipped: {exc}")
            except KvdClientError as exc:
                console.print(f"[red]kvd refused the replay of {profile}: {exc}")
                return 1
    console.print(f"{len(names)} trace(s) x {len(policies)} policies")
    return finish(build_report(results, args.page_bytes), console, args.json,
                  getattr(args, "report", None), started)
