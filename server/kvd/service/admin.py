"""kvd.v1.Admin: policies, invariant checks, drain."""

from __future__ import annotations

from kvd.core.policies import policy_names
from kvd.daemon import Daemon
from kvd.service.status import unary
from kvd_api.v1 import kvd_pb2 as pb
from kvd_api.v1 import kvd_pb2_grpc as pb_grpc


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, daemon: Daemon, drain) -> None:
        self.daemon = daemon
        self._drain = drain

    @unary
    async def SetPolicy(self, request, context):
        previous = await self.daemon.set_policy(request.pool, request.policy)
        return pb.SetPolicyResponse(previous_policy=previous)

    @unary
    async def ListPolicies(self, request, context):
        return pb.ListPoliciesResponse(policies=policy_names())

    @unary
    async def SelfCheck(self, request, context):
        problems = await self.daemon.self_check()
        return pb.SelfCheckResponse(ok=not problems, problems=problems)

    @unary
    async def Drain(self, request, context):
        self._drain()
        return pb.DrainResponse()
