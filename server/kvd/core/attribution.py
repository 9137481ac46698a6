"""SLO attribution: who evicted whom, and whose eviction a stall was spent on."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from kvd.core.transfer import Reason

# The cause of an eviction the engine asked for itself (Evict), or of a prefetch's room.
NO_REQUEST = ""
# A request's account names at most this many other requests per counter (causes of its
# stalls, evictions suffered, evictions caused); the rest are summed under OTHERS. Without a
# bound, a long-lived request that evicts thousands of others holds a key for each, and the
# accounts kept for Explain grow without limit in bytes though not in number.
MAX_NAMED = 32
OTHERS = ("", "(others)")


@dataclass(slots=True, frozen=True)
class EvictionRecord:
    """One eviction in the ledger: victim and evictor (tenant, request), the reason of the plan that
    made it, and the policy that chose it."""
    at: float
    pool: str
    victim_request: str
    victim_tenant: str
    block_index: int
    evictor_request: str  # NO_REQUEST when no request caused it
    evictor_tenant: str
    reason: Reason  # what made the plan that evicted it
    policy: str


@dataclass(slots=True)
class RequestAccount:
    """What one request went through: stalls by cause, evictions suffered and caused."""

    request_id: str
    tenant: str
    stall_s: float = 0.0
    num_stalls: int = 0
    # Blocks dropped and handed back for the engine to recompute.
    num_recomputes: int = 0
    # Keys are (tenant, request) of the cause.
    stall_s_by_cause: Counter = field(default_factory=Counter)
    evictions_suffered: Counter = field(default_factory=Counter)
    evictions_caused: Counter = field(default_factory=Counter)


class Attribution:
    """A bounded ledger of evictions, per-request accounts, and per-tenant counters."""

    def __init__(self, ledger_size: int = 20_000, finished_size: int = 2_000) -> None:
        self.ledger: deque[EvictionRecord] = deque(maxlen=ledger_size)
        self.active: dict[str, RequestAccount] = {}
        self.finished: OrderedDict[str, RequestAccount] = OrderedDict()
        self._finished_size = finished_size
        self.evictions_suffered: Counter[str] = Counter()
        self.evictions_caused: Counter[str] = Counter()
        # (victim tenant, causing tenant) -> seconds of stall
        self.stall_s_by_cause: Counter[tuple[str, str]] = Counter()
        # (victim tenant, causing tenant, policy) -> evictions
        self.evictions_by_pair: Counter[tuple[str, str, str]] = Counter()

    def open(self, request_id: str, tenant: str) -> RequestAccount:
        """Start a request's account (at admission or reservation)."""
        account = RequestAccount(request_id, tenant)
        self.active[request_id] = account
        self.finished.pop(request_id, None)
        return account

    def close(self, request_id: str) -> None:
        """The request ended: its account is kept a while for Explain, then forgotten."""
        account = self.active.pop(request_id, None)
        if account is None:
            return
        self.finished[request_id] = account
        while len(self.finished) > self._finished_size:
            self.finished.popitem(last=False)

    def account(self, request_id: str) -> RequestAccount | None:
        """A request's account, active or recently closed (None: unknown)."""
        return self.active.get(request_id) or self.finished.get(request_id)

    def evicted(self, record: EvictionRecord) -> None:
        """Record evictions: who lost the pages, who caused it, why, under which policy."""
        self.ledger.append(record)
        self.evictions_suffered[record.victim_tenant] += 1
        self.evictions_caused[record.evictor_tenant] += 1
        self.evictions_by_pair[(record.victim_tenant, record.evictor_tenant, record.policy)] += 1
        cause = (record.evictor_tenant, record.evictor_request)
        victim = self.active.get(record.victim_request)
        if victim is not None:
            _count(victim.evictions_suffered, cause, 1)
        evictor = self.active.get(record.evictor_request)
        if evictor is not None:
            _count(evictor.evictions_caused, (record.victim_tenant, record.victim_request), 1)

    def stalled(self, request_id: str, causes: list[EvictionRecord | None], seconds: float
                ) -> None:
        """An access of request_id waited `seconds` to promote blocks put out by `causes`
        (None: never evicted, e.g. dropped at start); the stall is shared among them."""
        account = self.active.get(request_id)
        if account is None or not causes:
            return
        account.stall_s += seconds
        account.num_stalls += 1
        share = seconds / len(causes)
        for record in causes:
            key = ((record.evictor_tenant, record.evictor_request) if record is not None
                   else ("", "unknown"))
            _count(account.stall_s_by_cause, key, share)
            self.stall_s_by_cause[(account.tenant, key[0])] += share


def _count(counter: Counter, key: tuple[str, str], amount: float) -> None:
    """counter[key] += amount, under OTHERS once MAX_NAMED keys are taken."""
    if key not in counter and len(counter) >= MAX_NAMED:
        key = OTHERS
    counter[key] += amount
