"""Leases: a client that disappears without releasing its requests gets them released.

A client names its lease in call metadata (`kvd-lease`; the Python client sends one per
client instance). Every call renews the lease, and an open Step stream holds it. A lease that
has been silent longer than its TTL with no stream open is expired: its requests are
released, their pages go back to the free lists, and kvd logs and counts it.

Only a lease that holds something (requests admitted under it, or open streams) is kept: a
client may name a new lease on every call, and leases holding nothing would pile up for a
TTL each, in memory and in every look for silent ones.

A request handed off to another pool is the decode engine's from then on: the first call
under another lease that names it makes it that lease's (`adopt`), so the decode engine that
runs it holds it as if it had admitted it, and the prefill engine's going away no longer
releases it. Handed off within the node (`handed`), it stays its lease's until then. One
that arrives from a peer's handoff was admitted under no lease here: it is held by a lease of
its own (`arrived`) until a client takes it up, and released like any lapsed lease's if none
does within the TTL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from kvd.core.clock import Clock

log = structlog.get_logger("kvd.leases")

LEASE_METADATA = "kvd-lease"
# A lapsed lease's release still waiting after this long is logged (and waited for).
RELEASE_SLOW_S = 5.0
# The lease of a request that arrived from a peer, until a client takes it up (no client's
# lease starts so: the client library's are host-pid-hex, and kvd's own holders "kvd:").
ARRIVAL = "kvd:arrived:"


@dataclass(slots=True)
class Lease:
    lease_id: str
    tenant: str
    last_seen: float
    open_streams: int = 0
    requests: set[str] = field(default_factory=set)


class LeaseTable:
    def __init__(self, clock: Clock, ttl_s: float) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.leases: dict[str, Lease] = {}
        self._lease_of: dict[str, str] = {}  # request id -> the lease it was admitted under
        # Requests handed off (from a peer, or between this node's pools) that no other
        # client has taken up yet (see adopt).
        self._untaken: set[str] = set()
        self.num_expired = 0
        self.num_requests_released = 0

    def renew(self, lease_id: str) -> None:
        """A call under the lease: it is not silent (if kept: see the module's docstring)."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.last_seen = self.clock.now()

    def _held(self, lease_id: str, tenant: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            lease = self.leases[lease_id] = Lease(lease_id, tenant, self.clock.now())
        else:
            lease.last_seen = self.clock.now()
        return lease

    def _forget_if_empty(self, lease: Lease) -> None:
        if not lease.requests and lease.open_streams <= 0:
            del self.leases[lease.lease_id]

    def attach(self, lease_id: str, tenant: str, request_id: str) -> None:
        if lease_id:
            self._held(lease_id, tenant).requests.add(request_id)
            self._lease_of[request_id] = lease_id

    def arrived(self, request_id: str, tenant: str) -> None:
        """The request came here from a peer's handoff: held by a lease of its own until a
        client's call names it (adopt), released if none does within the TTL."""
        self.attach(ARRIVAL + request_id, tenant, request_id)
        self._untaken.add(request_id)

    def handed(self, request_id: str) -> None:
        """The request was handed off to another pool of this node: its lease holds it
        until a call under another lease names it (adopt)."""
        self._untaken.add(request_id)

    @property
    def unclaimed(self) -> bool:
        """Whether some request handed off awaits its decode engine (see adopt)."""
        return bool(self._untaken)

    def adopt(self, request_ids: Iterable[str], lease_id: str, tenant: str) -> None:
        """A call under lease_id named these requests: those handed off that no other
        client has taken up yet are the lease's from now on (a call under the lease that
        holds one already changes nothing)."""
        if not self._untaken or not lease_id:
            return
        for request_id in request_ids:
            if (request_id in self._untaken
                    and self._lease_of.get(request_id) != lease_id):
                self.detach(request_id)
                self.attach(lease_id, tenant, request_id)

    def detach(self, request_id: str) -> None:
        """The request is gone (released, or its lease's requests are being released)."""
        self._untaken.discard(request_id)
        lease = self.leases.get(self._lease_of.pop(request_id, ""))
        if lease is not None:
            lease.requests.discard(request_id)
            self._forget_if_empty(lease)

    def stream_opened(self, lease_id: str, tenant: str) -> None:
        if lease_id:
            self._held(lease_id, tenant).open_streams += 1

    def stream_closed(self, lease_id: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.open_streams -= 1
            lease.last_seen = self.clock.now()
            self._forget_if_empty(lease)

    def expired(self) -> list[Lease]:
        """Leases silent for longer than the TTL with no stream open; removed from the table."""
        now = self.clock.now()
        gone = [lease for lease in self.leases.values()
                if lease.open_streams <= 0 and now - lease.last_seen > self.ttl_s]
        for lease in gone:
            del self.leases[lease.lease_id]
        return gone

    async def reap_forever(self, release, period_s: float, events=None,
                           end_holds=None) -> None:
        """Every period, release the requests of expired leases with `release(request_id)`,
        after ending what the lease's client was handed with `end_holds(lease_id)`: a client
        silent past its TTL is gone, and the pages kept for it (see Holds.keep) are free.
        Silence is judged on what clients sent, not on when kvd got round to reading it: a
        tick that comes late (kvd's loop was busy, or the process was stopped) credits every
        lease with the lost time, since their calls may be waiting unread meanwhile.

        Each expired lease's requests are released in a task of its own, each as long as it
        takes: a request whose blocks are in transit (a promotion over a slow or capped
        link may take seconds) is released when the transfer ends. Given up, it would stay
        admitted for ever with no lease left to reap it; waited for here, every other lease
        would wait for the one release. Stopping the reaper stops those tasks."""
        releasing: set[asyncio.Task] = set()
        last = self.clock.now()
        try:
            while True:
                await asyncio.sleep(period_s)
                now = self.clock.now()
                late = now - last - period_s
                last = now
                if late > period_s:
                    for lease in self.leases.values():
                        lease.last_seen = min(now, lease.last_seen + late)
                for lease in self.expired():
                    self.num_expired += 1
                    if end_holds is not None:
                        end_holds(lease.lease_id)
                    task = asyncio.ensure_future(self._release(lease, release, events))
                    releasing.add(task)
                    task.add_done_callback(releasing.discard)
        except asyncio.CancelledError:
            # kvd stops: so do the releases. (Those of a reaper that failed go on while it
            # is started again.)
            for task in releasing:
                task.cancel()
            raise

    async def _release(self, lease: Lease, release, events) -> None:
        """Release an expired lease's requests, together; log and count what was."""
        outcomes = await asyncio.gather(*(self._release_one(release, request_id, lease)
                                          for request_id in sorted(lease.requests)))
        released = sum(outcomes)
        self.num_requests_released += released
        if events is not None:
            events.publish("lease", tenant=lease.tenant, count=released,
                           lease=lease.lease_id)
        (log.warning if released else log.debug)(
            "lease expired: released its requests", lease=lease.lease_id,
            tenant=lease.tenant, num_requests=released,
            silent_s=round(self.clock.now() - lease.last_seen, 3))

    @staticmethod
    async def _release_one(release, request_id: str, lease: Lease) -> bool:
        """Release one request; whether it was (False: gone already, released by its owner).
        One still waiting after RELEASE_SLOW_S (its blocks in transit) is logged, and
        waited for."""
        task = asyncio.ensure_future(release(request_id))
        try:
            done, _ = await asyncio.wait((task,), timeout=RELEASE_SLOW_S)
            if not done:
                log.warning("lease release waits for the request's blocks in transit",
                            request_id=request_id[:64], lease=lease.lease_id,
                            waited_s=RELEASE_SLOW_S)
            await task
            return True
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as exc:  # already released, or released by its owner
            log.debug("lease release skipped", request_id=request_id, error=str(exc))
            return False
