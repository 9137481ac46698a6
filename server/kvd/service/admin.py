"""kvd.v1.Admin: policies, tenants and quotas, invariant checks, drain. Admin identity only."""

from __future__ import annotations

from kvd import stats
from kvd.core import errors
from kvd.core.blocks import RequestState
from kvd.core.policies import policy_names
from kvd.node import Node
from kvd.service.auth import Authenticator, Caller
from kvd.service.convert import link_stats, tenant_info
from kvd.service.gate import CallGate
from kvd.service.unary import unary
from kvd_api.v1 import kvd_pb2 as pb
from kvd_api.v1 import kvd_pb2_grpc as pb_grpc

# ListRequests' state of a handoff's target entry while the copies run.
ARRIVING = "arriving"


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, node: Node, auth: Authenticator, drain,
                 gate: CallGate | None = None) -> None:
        self.node = node
        self.auth = auth
        self.gate = gate or CallGate(0)
        self._drain = drain

    @unary
    async def SetPolicy(self, request: pb.SetPolicyRequest, caller: Caller) -> pb.SetPolicyResponse:
        self.auth.require_admin(caller)
        previous = await self.node.set_policy(request.pool, request.policy)
        return pb.SetPolicyResponse(previous_policy=previous)

    @unary
    async def ListPolicies(self, request: pb.ListPoliciesRequest,
                           caller: Caller) -> pb.ListPoliciesResponse:
        return pb.ListPoliciesResponse(policies=policy_names())

    @unary
    async def SelfCheck(self, request: pb.SelfCheckRequest, caller: Caller) -> pb.SelfCheckResponse:
        self.auth.require_admin(caller)
        problems = await self.node.self_check()
        return pb.SelfCheckResponse(ok=not problems, problems=problems)

    @unary
    async def Drain(self, request: pb.DrainRequest, caller: Caller) -> pb.DrainResponse:
        self.auth.require_admin(caller)
        self._drain()
        return pb.DrainResponse()

    @unary
    async def ListTenants(self, request: pb.ListTenantsRequest,
                          caller: Caller) -> pb.ListTenantsResponse:
        self.auth.require_admin(caller)
        return pb.ListTenantsResponse(tenants=self._tenants(request.pool))

    @unary
    async def SetQuota(self, request: pb.SetQuotaRequest, caller: Caller) -> pb.SetQuotaResponse:
        self.auth.require_admin(caller)
        # Only the fields the caller set change; limit 0 means "no limit".
        fields = {"weight": "weight", "guaranteed_pages": "guaranteed",
                  "limit_pages": "limit", "max_request_pages": "max_request_pages",
                  "max_request_fraction": "max_request_fraction",
                  "bandwidth_cap_bytes_per_s": "bandwidth_cap",
                  "request_bandwidth_cap_bytes_per_s": "request_bandwidth_cap",
                  "read_budget_bytes_per_s": "read_budget",
                  "guaranteed_bytes": "guaranteed_bytes", "limit_bytes": "limit_bytes"}
        changes = {key: getattr(request, name) for name, key in fields.items()
                   if request.HasField(name)}
        for key in ("bandwidth_cap", "request_bandwidth_cap", "read_budget"):
            if key in changes and changes[key] < 0:
                raise errors.InvalidArgument(f"{key} must be >= 0 (0: no cap)")
        for key in ("limit", "max_request_pages", "max_request_fraction", "bandwidth_cap",
                    "request_bandwidth_cap", "read_budget"):
            if key in changes and not changes[key]:
                changes[key] = None
        self.node.set_quota(request.tenant, request.pool, create=request.create,
                            reset=request.reset, **changes)
        return pb.SetQuotaResponse(tenants=self._tenants(request.pool, request.tenant))

    @unary
    async def ListRequests(self, request: pb.ListRequestsRequest,
                           caller: Caller) -> pb.ListRequestsResponse:
        self.auth.require_admin(caller)
        runtimes = self.node.runtimes(request.pool)
        for rt in runtimes:
            rt.pool.snapshot()  # bytes_read includes the reads of the last steps
        reqs = [r for rt in runtimes for r in rt.pool.requests.values() if not r.keeper]

        def rt_of(r):
            return self.node.pools[r.pool]

        def state_of(r) -> str:
            """Its state; "arriving" for a handoff's target while it copies: the request is
            still its source's (a pool here, or a peer's), the entry holds the pages it is
            copied into."""
            if (r.state is RequestState.ADMITTED
                    and self.node.handoffs.arriving(r.request_id, rt_of(r))):
                return ARRIVING
            return r.state.value

        reqs.sort(key=lambda r: (-r.num_device_blocks, -r.num_live_blocks, r.request_id))
        return pb.ListRequestsResponse(requests=[
            pb.RequestInfo(
                request_id=r.request_id, tenant=r.tenant, pool=r.pool, state=state_of(r),
                num_blocks=r.num_live_blocks, device_blocks=r.num_device_blocks,
                reserved_pages=r.reserved_pages,
                stall_seconds=r.account.stall_s if r.account else 0.0,
                evictions_suffered=sum(r.account.evictions_suffered.values())
                if r.account else 0, bytes_moved=r.bytes_moved,
                bytes_read=r.blocks_read * rt_of(r).pool.page_bytes,
                handoff_pool=r.handoff_pool)
            for r in reqs[:request.limit or 100]])

    @unary
    async def ListLinks(self, request: pb.ListLinksRequest, caller: Caller) -> pb.ListLinksResponse:
        self.auth.require_admin(caller)
        return pb.ListLinksResponse(links=[link_stats(stats.link_figures(self.node, link))
                                           for link in self.node.links()])

    def _tenants(self, pool: str, tenant: str | None = None) -> list[pb.TenantInfo]:
        """Each pool's tenants (one pool's, and only `tenant` when given)."""
        infos = [tenant_info(t) for rt in self.node.runtimes(pool)
                 for t in stats.pool_figures(self.node, rt, tenant).tenants]
        for info in infos:
            info.private_prefixes = self.auth.private_prefixes(info.tenant)
        return infos

    @unary
    async def GetCluster(self, request: pb.GetClusterRequest,
                         caller: Caller) -> pb.GetClusterResponse:
        self.auth.require_admin(caller)
        if request.pool:
            self.node.runtime(request.pool)  # NOT_FOUND for a pool kvd does not have
        cluster = self.node.cluster
        if cluster is None:
            return pb.GetClusterResponse(enabled=False, detail="this kvd decides alone "
                                         "([cluster] names no etcd)")
        view = cluster.describe(request.pool)
        return pb.GetClusterResponse(
            enabled=True, node=view["node"], etcd=view["etcd"], etcd_up=view["etcd_up"],
            picture_age_s=view["picture_age_s"], detail=view["detail"],
            nodes=[pb.ClusterNode(**n) for n in view["nodes"]],
            tenants=[pb.ClusterTenant(**{k: v for k, v in t.items() if k != "nodes"},
                                      nodes=[pb.NodeEntitlement(**n) for n in t["nodes"]])
                     for t in view["tenants"]])
