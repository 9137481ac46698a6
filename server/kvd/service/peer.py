"""The Peer service: what another node's kvd asks of this one for a handoff across nodes
(kvd.peers). Callers present this kvd's admin identity."""

from __future__ import annotations

import time

import grpc

from kvd.core import errors
from kvd.metrics import observe_rpc
from kvd.node import Node
from kvd.peers import receive_here, reserve_here
from kvd.service.auth import Authenticator, Caller
from kvd.service.gate import CallGate
from kvd.service.register import refuse
from kvd.service.status import status_of
from kvd.service.unary import unary
from kvd_api.v1 import kvd_pb2 as pb
from kvd_api.v1 import kvd_pb2_grpc as pb_grpc


class PeerService(pb_grpc.PeerServicer):
    def __init__(self, node: Node, auth: Authenticator) -> None:
        self.node = node
        self.auth = auth
        self.gate = CallGate(0)  # peers are few, and each is the admin

    @unary
    async def Reserve(self, request: pb.PeerReserveRequest,
                      caller: Caller) -> pb.PeerReserveResponse:
        self.auth.require_admin(caller)
        return reserve_here(self.node, request)

    @unary
    async def Unreserve(self, request: pb.PeerUnreserveRequest,
                        caller: Caller) -> pb.PeerUnreserveResponse:
        self.auth.require_admin(caller)
        return pb.PeerUnreserveResponse(
            released=self.node.handoffs.drop_reservation(request.pool, request.request_id))

    async def Receive(self, request_iterator, context) -> pb.PeerReceiveResponse:
        started = time.perf_counter()
        code = "OK"
        try:
            try:
                self.auth.require_admin(self.auth.identify(context))
            except errors.KvdError as exc:
                code = status_of(exc).name
                await refuse(request_iterator, context, status_of(exc), str(exc))
            return pb.PeerReceiveResponse(blocks=await receive_here(self.node,
                                                                    request_iterator))
        except errors.KvdError as exc:
            code = status_of(exc).name
            await context.abort(status_of(exc), str(exc))
        except grpc.RpcError:
            code = "CANCELLED"
            raise
        finally:
            observe_rpc("Receive", code, time.perf_counter() - started)
