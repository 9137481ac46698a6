"""EngineSession: what an engine holds in kvd, kept on the engine's side so that when kvd
restarts (configuration and quotas survive; requests and page contents do not) the engine can
re-register its running requests in one call and learn which blocks it must recompute.

A call kvd did not answer (it was away, or the answer was lost: UNANSWERED), or that the
caller cancelled while it waited for the answer, may or may not have been done. The session
keeps what the engine asked for: a request released or blocks freed are no longer the
engine's whatever kvd answered, and a request whose Admit went unanswered may be in kvd
without the engine's knowing. recover() (and, for an Admit, the next admit of the same id)
settles these with kvd first, so kvd never goes on holding what the engine let go of."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from kvd_api.v1 import kvd_pb2 as pb
from kvd_client.client import AsyncClient
from kvd_client.errors import UNANSWERED, AlreadyExistsError, KvdClientError, NotFoundError

# A call whose answer the engine did not hear: kvd did not answer, or the caller cancelled
# the call (a timeout around it) after it may have gone. Either way kvd may have done it.
UNHEARD = (*UNANSWERED, asyncio.CancelledError)


@dataclass
class _Held:
    prompt_tokens: int
    output_tokens: int
    options: dict
    blocks: list[int] = field(default_factory=list)  # the engine's live block indices


@dataclass
class Recovery:
    """What recover() did: requests admitted again with their blocks (old index -> new
    handle; the bytes are gone, the engine recomputes them), queued, or refused."""

    admitted: dict[str, dict[int, pb.PageHandle]] = field(default_factory=dict)
    queued: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


class EngineSession:
    """Wraps an AsyncClient's admit / allocate / free / release and remembers the requests."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.held: dict[str, _Held] = {}
        # What kvd may hold that the engine does not: requests released, or admitted by an
        # Admit, that kvd did not answer; block indices freed, a list per unanswered Free
        # (kvd frees a call's blocks all or none).
        self.owed_releases: set[str] = set()
        self.owed_frees: dict[str, list[list[int]]] = {}

    async def admit(self, request_id: str, prompt_tokens: int, output_tokens: int = 0,
                    **options) -> pb.AdmitResponse:
        if request_id in self.owed_releases:  # an Admit of it went unanswered: kvd may have it
            await self._settle_release(request_id)
        try:
            reply = await self.client.admit(request_id, prompt_tokens, output_tokens,
                                            **options)
        except UNHEARD:
            self.owed_releases.add(request_id)
            raise
        if reply.decision != pb.DECISION_REJECTED:
            self.held[request_id] = _Held(prompt_tokens, output_tokens, options)
        return reply

    async def allocate(self, request_id: str, num_blocks: int) -> pb.AllocateResponse:
        reply = await self.client.allocate(request_id, num_blocks)
        self.held[request_id].blocks += [h.block_index for h in reply.handles]
        return reply

    async def free(self, request_id: str, blocks: list[int]) -> pb.FreeResponse:
        """Free blocks of a request. Once kvd refuses (answers with an error), they are
        still the request's; unanswered, they are not, and the free is owed."""
        held = self.held[request_id]
        gone = set(blocks)
        left = [i for i in held.blocks if i not in gone]
        try:
            reply = await self.client.free(request_id, blocks)
        except UNHEARD:
            self.owed_frees.setdefault(request_id, []).append(list(blocks))
            held.blocks = left
            raise
        held.blocks = left
        return reply

    async def release(self, request_id: str) -> pb.ReleaseResponse:
        """Give the request back. One kvd does not know (it restarted since) holds nothing:
        that is not an error here."""
        self.held.pop(request_id, None)
        self.owed_frees.pop(request_id, None)
        self.owed_releases.discard(request_id)
        try:
            return await self.client.release(request_id)
        except NotFoundError:
            return pb.ReleaseResponse()
        except UNHEARD:
            self.owed_releases.add(request_id)
            raise

    async def _settle_release(self, request_id: str) -> None:
        """Send an owed release again (raising, and still owing it, if kvd does not answer)."""
        try:
            await self.client.release(request_id)
        except NotFoundError:
            pass
        self.owed_releases.discard(request_id)

    async def _settle_frees(self, request_id: str) -> None:
        """Send a request's owed frees again, one per call as the engine made them: a free
        kvd did before its answer was lost finds its blocks gone (NOT_FOUND)."""
        owed = self.owed_frees.get(request_id, [])
        while owed:
            try:
                await self.client.free(request_id, owed[0])
            except NotFoundError:
                pass
            owed.pop(0)
        self.owed_frees.pop(request_id, None)

    async def recover(self) -> Recovery:
        """Admit every held request again and allocate as many blocks as it held. A request
        kvd still has (it did not restart) is left as it is. One kvd queues holds no block
        (the engine allocates once it is admitted); one whose blocks kvd cannot give back
        now (a smaller or busier kvd came back) is released again and refused, and the
        others are recovered all the same.

        First the calls kvd did not answer are settled: owed releases sent again, and owed
        frees for the requests kvd still has. A call that still goes unanswered raises, and
        stays owed for the next recover()."""
        out = Recovery()
        for request_id in sorted(self.owed_releases):
            await self._settle_release(request_id)
        for request_id, held in list(self.held.items()):
            try:
                reply = await self.client.admit(request_id, held.prompt_tokens,
                                                held.output_tokens, **held.options)
            except AlreadyExistsError:
                await self._settle_frees(request_id)  # kvd still knows it
                continue
            except KvdClientError as exc:
                if isinstance(exc, UNANSWERED):  # kvd may have it: released before it goes again
                    self.owed_releases.add(request_id)
                out.refused[request_id] = str(exc)
                continue
            self.owed_frees.pop(request_id, None)  # a new kvd: nothing of it to free there
            if reply.decision == pb.DECISION_REJECTED:
                out.refused[request_id] = reply.reason
                del self.held[request_id]
                continue
            if reply.decision == pb.DECISION_QUEUED:
                out.queued.append(request_id)
                held.blocks = []
                continue
            handles = []
            if held.blocks:
                try:
                    handles = list((await self.client.allocate(request_id,
                                                               len(held.blocks))).handles)
                except KvdClientError as exc:
                    out.refused[request_id] = str(exc)
                    del self.held[request_id]
                    with contextlib.suppress(KvdClientError):
                        await self.release(request_id)  # owed if kvd does not answer
                    continue
            out.admitted[request_id] = dict(zip(held.blocks, handles))
            held.blocks = [h.block_index for h in handles]
        return out
