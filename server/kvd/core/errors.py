"""Domain errors. The gRPC layer maps each class to one status code (kvd.service.status)."""

from __future__ import annotations


class KvdError(Exception):
    """Base of every error kvd reports to a caller."""


class InvalidArgument(KvdError):
    """The request is malformed: a negative count, an empty id, an unknown enum."""


class NotFound(KvdError):
    """A request, block or pool that does not exist."""


class AlreadyExists(KvdError):
    """A request id that is already in use."""


class ResourceExhausted(KvdError):
    """Not enough memory (or queue room) now; the message says what is full and who holds it."""


class FailedPrecondition(KvdError):
    """The call is valid but not in this state, e.g. allocating for a queued request."""


class PermissionDenied(KvdError):
    """The caller may not touch this request, pool or setting."""


class Aborted(KvdError):
    """The operation failed part-way and was undone (e.g. a handoff whose copy failed)."""


class Unauthenticated(KvdError):
    """The caller has no identity kvd accepts."""


class HostShort(ResourceExhausted):
    """Making room needs more host pages than are free and nothing is in transit to free
    them: only `possible` blocks can be brought in now (a swap that must go in rounds)."""

    def __init__(self, message: str, possible: int) -> None:
        super().__init__(message)
        self.possible = possible


class BlocksInTransit(Exception):
    """Internal: the operation touches blocks whose bytes are being copied; retry after them.

    Raised before anything changed, so the caller can wait for the transfers and call again.
    """

    def __init__(self, blocks: list) -> None:
        super().__init__(f"{len(blocks)} block(s) in transit")
        self.blocks = blocks


class NoVictims(BlocksInTransit):
    """Internal: the policy has no victim to offer now, and may have once copies finish or
    engines' holds end; the caller waits for room as for blocks in transit."""

    def __init__(self) -> None:
        super().__init__([])


def untraced(exc: BaseException):
    """exc without its traceback, to keep past its except clause (waited on, raised again
    later). Its traceback holds the frames it passed through, the one keeping it too: a cycle
    only Python's collector frees, with everything those frames hold (a call's blocks, its
    plan), and kvd's collections may not walk it for minutes (kvd.gcwalk)."""
    return exc.with_traceback(None)


def short_repr(text: str, limit: int = 64) -> str:
    """A repr of text for an error message, at most about `limit` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


def check_printable(what: str, value: str) -> None:
    """InvalidArgument when an id or name holds a control character (NUL, ESC, DEL, C1, or
    a format character such as a right-to-left override): ids and names are shown to
    operators (kvctl, logs, events), where an ESC would drive their terminal and a format
    character would make one id read as another."""
    if value.isprintable():  # the space is (and is allowed); the check runs in C
        return
    c = next(c for c in value if not c.isprintable())
    raise InvalidArgument(f"{what} must not hold control characters (found "
                          f"{c.encode('unicode_escape').decode()})")
