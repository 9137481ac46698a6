"""StepStream: the engine's hot path, one StepRequest per engine step on one stream."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from kvd_api.v1 import kvd_pb2 as pb
from kvd_client.errors import KvdClientError, UnavailableError, from_rpc_error, from_status

if TYPE_CHECKING:
    from kvd_client.client import AsyncClient


def access_request(request_id: str, blocks: Sequence[int] | None) -> pb.AccessRequest:
    """Read these blocks of a request (None: all of them)."""
    if blocks is None:
        return pb.AccessRequest(request_id=request_id, all_blocks=True)
    return pb.AccessRequest(request_id=request_id, block_indices=blocks)


# How long close() waits for the answer to its empty step.
CLOSE_WAIT_S = 2.0


class StepStream:
    """The engine's hot path: one StepRequest per engine step, one StepResponse back.

        async with kvd.step_stream() as stream:
            reply = await stream.step(accesses=[...], allocations=[...])
    """

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._call = None
        self._next_id = 0
        self._unread = 0  # steps sent whose replies were not read
        # A step was cancelled (a timeout around it, its task cancelled) where its message
        # may have gone and its reply not been read: the stream's next reply would be that
        # step's, read as the next step's (its handles, for another request's blocks), or
        # gRPC cancelled the whole call. The next step goes on a stream of its own.
        self._cut = False

    async def __aenter__(self) -> StepStream:
        self._open()
        return self

    def _open(self) -> None:
        self._call = self._client.memory.Step(metadata=self._client.metadata)
        self._unread = 0
        self._cut = False

    def _reopen(self) -> None:
        """A fresh stream in place of one a cancelled step left with a reply unread. kvd
        sees the old one end before its next message, and tells what its last reply told
        (pages moved, blocks lost) again at the next read, as after any stream cut short;
        the blocks the cancelled step allocated stay its request's."""
        self._call.cancel()
        self._open()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """End the stream. With every reply read, an empty step goes first: kvd learns the
        last reply was read. With a reply unread (a step cancelled mid-way) the stream is
        just ended, and kvd tells what that reply told (pages that moved, blocks to
        recompute) again at the next read."""
        call = self._call
        if call is None:
            return
        if not self._unread:
            try:
                await asyncio.wait_for(self.send(pb.StepRequest()), CLOSE_WAIT_S)
                await call.done_writing()
            except (KvdClientError, grpc.RpcError, asyncio.TimeoutError):
                pass
        call.cancel()
        self._call = None

    async def pipeline(self, requests, on_reply, window: int = 16) -> None:
        """Send many steps without waiting for each reply (at most `window` outstanding);
        on_reply(request, reply) is called for each, in order. Replies arrive in the order
        the steps were sent: kvd applies them one after another.

        A reply's handles stay put only until the stream's next message, and here the next
        messages go before the reply is read: kvd may move those pages while on_reply
        looks at them. For steps whose pages the caller reads or writes, use step()."""
        outstanding: asyncio.Queue = asyncio.Queue(window)

        async def read_replies():
            while True:
                request = await outstanding.get()
                if request is None:
                    return
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    raise UnavailableError("kvd closed the Step stream")
                self._unread -= 1
                result = on_reply(request, reply)
                if asyncio.iscoroutine(result):
                    await result

        self._ready()
        reader = asyncio.ensure_future(read_replies())
        try:
            for request in requests:
                if not request.step_id:
                    self._next_id += 1
                    request.step_id = self._next_id
                put = asyncio.ensure_future(outstanding.put(request))
                await asyncio.wait({put, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    put.cancel()
                    reader.result()  # raises what the reader raised
                    raise UnavailableError("Step stream reader stopped")
                self._unread += 1
                await self._call.write(request)
            await outstanding.put(None)
            await reader
        except (grpc.RpcError, asyncio.InvalidStateError) as err:
            raise await self._ended(err) from None
        except asyncio.CancelledError:
            self._cut = True
            raise
        finally:
            if not reader.done():
                reader.cancel()

    async def _ended(self, err: Exception) -> KvdClientError:
        """Why the stream ended. A write to a stream kvd already closed fails with grpc's
        own words ("RPC already finished", INTERNAL): the status kvd closed it with says
        why (kvd is draining, the stream was malformed...)."""
        if self._call.done():
            return from_status(await self._call.code(), await self._call.details() or "")
        if isinstance(err, grpc.RpcError):
            return from_rpc_error(err)
        return UnavailableError(str(err))

    def _ready(self) -> None:
        """Before a step: the stream is open, and not one a cancelled step cut (see _cut)."""
        if self._call is None:
            raise RuntimeError("this Step stream is not open: step inside `async with "
                               "client.step_stream() as stream:`")
        if self._cut:
            self._reopen()

    async def send(self, request: pb.StepRequest) -> pb.StepResponse:
        self._ready()
        if not request.step_id:
            self._next_id += 1
            request.step_id = self._next_id
        self._unread += 1
        try:
            await self._call.write(request)
            reply = await self._call.read()
        except (grpc.RpcError, asyncio.InvalidStateError) as err:
            raise await self._ended(err) from None
        except asyncio.CancelledError:
            self._cut = True
            raise
        self._unread -= 1
        if reply is grpc.aio.EOF:
            raise UnavailableError("kvd closed the Step stream")
        return reply

    async def step(self, *, intents=(), frees=(), releases=(), allocations=(), accesses=(),
                   read_all=()) -> pb.StepResponse:
        """Send one step. allocations: (request_id, n) pairs; accesses: (request_id, blocks or
        None for all) pairs; frees: (request_id, blocks); releases and read_all: request ids
        (read_all: every block of each is read, the fastest form)."""
        return await self.send(pb.StepRequest(
            read_all=list(read_all),
            intents=list(intents),
            frees=[pb.FreeRequest(request_id=r, block_indices=b) for r, b in frees],
            releases=[pb.ReleaseRequest(request_id=r) for r in releases],
            allocations=[pb.AllocateRequest(request_id=r, num_blocks=n) for r, n in allocations],
            accesses=[access_request(r, b) for r, b in accesses],
        ))
