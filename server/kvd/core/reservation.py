"""Handoff reservations (DESIGN.md, "What kvd decides": prefill and decode): a request
admitted to a prefill pool with a handoff pool is admitted only together with a reservation
of its decode pages there, so no prefill is spent on a request decode cannot hold.

The prefill pool asks through a `Reserver`, given at its construction; `PoolReserver` is
the one kvd runs, reserving in the pools of the same node.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvd.core.blocks import Request

if TYPE_CHECKING:
    from kvd.core.pool import Pool


class Verdict(enum.Enum):
    """Whether a reservation can be made: now, later (after others finish), or never."""

    OK = "ok"
    WAIT = "wait"
    NEVER = "never"


class Reserver(Protocol):
    """What a prefill pool asks of its requests' handoff pools."""

    def state(self, req: Request) -> tuple[Verdict, str]:
        """Whether req's decode reservation could be made, and if not why."""

    def reserve(self, req: Request) -> None:
        """Make req's decode reservation (its state was OK just before)."""


class PoolReserver:
    """Reserves a prefill request's decode pages in its handoff pool, found by name with
    `pool_of` (the node's pools)."""

    def __init__(self, pool_of: Callable[[str], Pool], ttl_s: float) -> None:
        self.pool_of = pool_of
        self.ttl_s = ttl_s

    def state(self, req: Request) -> tuple[Verdict, str]:
        target = self.pool_of(req.handoff_pool)
        projected = target.projected_pages(req.prompt_tokens, req.output_tokens)
        return target.reservation_state(req.tenant, projected,
                                        req.prompt_tokens + req.output_tokens)

    def reserve(self, req: Request) -> None:
        self.pool_of(req.handoff_pool).reserve(
            req.request_id, req.tenant, prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens, priority=req.priority, ttl_s=self.ttl_s)
