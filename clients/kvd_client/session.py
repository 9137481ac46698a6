"""EngineSession: what an engine holds in kvd, kept on the engine's side so that when kvd
restarts (configuration and quotas survive; requests and page contents do not) the engine can
re-register its running requests in one call and learn which blocks it must recompute."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from kvd_api.v1 import kvd_pb2 as pb
from kvd_client.client import AsyncClient
from kvd_client.errors import AlreadyExistsError, KvdClientError


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

    async def admit(self, request_id: str, prompt_tokens: int, output_tokens: int = 0,
                    **options) -> pb.AdmitResponse:
        reply = await self.client.admit(request_id, prompt_tokens, output_tokens, **options)
        if reply.decision != pb.DECISION_REJECTED:
            self.held[request_id] = _Held(prompt_tokens, output_tokens, options)
        return reply

    async def allocate(self, request_id: str, num_blocks: int) -> pb.AllocateResponse:
        reply = await self.client.allocate(request_id, num_blocks)
        self.held[request_id].blocks += [h.block_index for h in reply.handles]
        return reply

    async def free(self, request_id: str, blocks: list[int]) -> pb.FreeResponse:
        reply = await self.client.free(request_id, blocks)
        gone = set(blocks)
        held = self.held[request_id]
        held.blocks = [i for i in held.blocks if i not in gone]
        return reply

    async def release(self, request_id: str) -> pb.ReleaseResponse:
        reply = await self.client.release(request_id)
        self.held.pop(request_id, None)
        return reply

    async def recover(self) -> Recovery:
        """Admit every held request again and allocate as many blocks as it held. A request
        kvd still has (it did not restart) is left as it is. One kvd queues holds no block
        (the engine allocates once it is admitted); one whose blocks kvd cannot give back
        now (a smaller or busier kvd came back) is released again and refused, and the
        others are recovered all the same."""
        out = Recovery()
        for request_id, held in list(self.held.items()):
            try:
                reply = await self.client.admit(request_id, held.prompt_tokens,
                                                held.output_tokens, **held.options)
            except AlreadyExistsError:
                continue  # kvd still knows it
            except KvdClientError as exc:
                out.refused[request_id] = str(exc)
                continue
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
                        await self.client.release(request_id)
                    continue
            out.admitted[request_id] = dict(zip(held.blocks, handles))
            held.blocks = [h.block_index for h in handles]
        return out
