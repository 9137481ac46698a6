"""Eviction policies, by name. `make_policy("lru", clock)`; an unknown name lists the choices."""

from __future__ import annotations

from kvd.core.clock import Clock
from kvd.core.errors import InvalidArgument
from kvd.core.policies.base import EvictionPolicy
from kvd.core.policies.deadline import DeadlinePolicy
from kvd.core.policies.intent import IntentPolicy
from kvd.core.policies.lru import LruPolicy
from kvd.core.policies.regret import RegretPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LruPolicy, IntentPolicy, DeadlinePolicy, RegretPolicy)
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(name: str, clock: Clock) -> EvictionPolicy:
    """A new, empty policy of the given name."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown eviction policy {name!r}; choose one of {', '.join(policy_names())}"
        ) from None
    return cls(clock)


__all__ = ["EvictionPolicy", "POLICIES", "make_policy", "policy_names"]
