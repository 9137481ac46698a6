"""Eviction policies, by name. `make_policy("lru", clock)`; an unknown name lists the choices."""

from __future__ import annotations

from kvd.core.clock import Clock
from kvd.core.errors import InvalidArgument
from kvd.core.policies.base import EvictionPolicy
from kvd.core.policies.deadline import DeadlinePolicy
from kvd.core.policies.fair import FairPolicy
from kvd.core.tenancy import Tenancy
from kvd.core.policies.intent import IntentPolicy
from kvd.core.policies.lru import LruPolicy
from kvd.core.policies.regret import RegretPolicy
from kvd.core.policies.reuse import ReusePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (LruPolicy, IntentPolicy, DeadlinePolicy, RegretPolicy, ReusePolicy)
}


def policy_names() -> list[str]:
    """Every distinct policy: the base policies, and fair over each of them."""
    return sorted(POLICIES) + ["fair"] + [f"fair:{b}" for b in sorted(POLICIES) if b != FAIR_BASE]


def accepted_policy_names() -> list[str]:
    """Every name make_policy accepts: the distinct policies, and "fair:reuse", which is
    "fair" spelt out."""
    return policy_names() + [f"fair:{FAIR_BASE}"]


# fair's default page order inside a request: the learned next use, which suits attention's
# read-every-block-each-step pattern (LRU is the worst order for such a cyclic scan).
FAIR_BASE = "reuse"


def make_policy(name: str, clock: Clock, tenancy: Tenancy | None = None) -> EvictionPolicy:
    """A new, empty policy. "fair" is fair over reuse; "fair:BASE" fair over another base."""
    fair = name == "fair" or name.startswith("fair:")
    base = FAIR_BASE if name == "fair" else name.removeprefix("fair:")
    cls = POLICIES.get(base)
    if cls is None:
        raise InvalidArgument(
            f"unknown eviction policy {name!r}; choose one of {', '.join(accepted_policy_names())}"
        )
    if not fair:
        return cls(clock)
    if tenancy is None:
        raise InvalidArgument(f"policy {name!r} needs a pool's tenancy")
    return FairPolicy(clock, tenancy, cls)
