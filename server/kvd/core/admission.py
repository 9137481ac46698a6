"""Admission (DESIGN.md, "What kvd decides": who gets in): a request is admitted when its
projected pages fit the pool now, queued when they can fit later, rejected when they never
can. The pool decides (Pool.admit) with its tenancy; this module holds the decision's
vocabulary and the per-request budgets a tenant's quota gives at admission.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvd.core.bandwidth import TokenBucket
from kvd.core.blocks import Request
from kvd.core.fairness import TenantQuota


class Decision(enum.StrEnum):
    ADMITTED = "admitted"
    QUEUED = "queued"  # waits in the pool's queue, in fair order across tenants
    REJECTED = "rejected"  # can never fit: bigger than the device tier, a cap or a limit


@dataclass(slots=True)
class AdmitResult:
    decision: Decision
    reason: str  # why it waits or was rejected ("" when admitted)
    queue_position: int  # 1-based, in fair order; 0 when not queued
    projected_pages: int  # prompt plus expected output, in pages


def budget(req: Request, quota: TenantQuota, page_bytes: int, now: float) -> None:
    """Give a request the bandwidth buckets its tenant's quota asks for: a cap on its
    transfers, and a read budget (a second's worth of reads may come at once)."""
    if quota.request_bandwidth_cap:
        rate = quota.request_bandwidth_cap
        req.transfer_cap = TokenBucket(rate, max(rate / 10, page_bytes), now)
    if quota.read_budget:
        req.read_bucket = TokenBucket(quota.read_budget, max(quota.read_budget, page_bytes),
                                      now)
