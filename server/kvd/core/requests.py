"""A pool's request table: its requests by id, and the lookups every engine operation starts
with (the request in the state the call needs, the blocks the call names)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvd.core.blocks import Block, Request, RequestState
from kvd.core.errors import BlocksInTransit, FailedPrecondition, InvalidArgument, NotFound


class RequestTable(dict[str, Request]):
    """Request id -> Request, for one pool (a dict: the hot paths look ids up directly)."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.pool = pool

    def find(self, request_id: str) -> Request:
        """The request, or NotFound."""
        try:
            return self[request_id]
        except KeyError:
            raise NotFound(f"no request {request_id!r} in pool {self.pool!r}") from None

    def admitted(self, request_id: str, queue: Mapping[str, Request]) -> Request:
        """The request, if it may use pages now; else the error that says why not."""
        req = self.find(request_id)
        if req.state is RequestState.RESERVED:
            raise FailedPrecondition(
                f"request {request_id!r} has pages reserved in pool {self.pool!r} but is not "
                "handed off yet; call Handoff once its prefill is done"
            )
        if req.state is RequestState.QUEUED:
            position = list(queue).index(request_id) + 1
            raise FailedPrecondition(
                f"request {request_id!r} is queued for admission (position {position}); "
                "it may allocate once admitted"
            )
        return req


def resolve(req: Request, indices: Sequence[int] | None) -> list[Block]:
    """The request's blocks at these indices (None: every live block), or the error that
    says which index is bad."""
    if indices is None:
        return req.live_blocks()
    blocks = []
    num = len(req.blocks)
    for i in indices:
        if i < 0 or i >= num:
            raise InvalidArgument(
                f"block {i} out of range for request {req.request_id!r} "
                f"(it has blocks 0..{num - 1})" if num else
                f"request {req.request_id!r} has no blocks yet; allocate first"
            )
        block = req.blocks[i]
        if block is None:
            raise NotFound(f"block {i} of request {req.request_id!r} was freed")
        blocks.append(block)
    if len(set(indices)) != len(indices):
        raise InvalidArgument(f"duplicate block indices for request {req.request_id!r}")
    return blocks


def check_still(blocks: list[Block]) -> None:
    """BlocksInTransit (naming them, for the caller to wait on) if any block is moving."""
    busy = [b for b in blocks if b.moving]
    if busy:
        raise BlocksInTransit(busy)
