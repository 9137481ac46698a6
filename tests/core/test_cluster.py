"""The cluster arithmetic: every node computes its part from the same picture, and the parts
add up to what the cluster quota allows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.cluster import ClusterQuota, NodeReport, entitlements

TENANTS = ("a", "b", "c")


@st.composite
def pictures(draw):
    nodes = draw(st.integers(1, 4))
    reports = []
    for i in range(nodes):
        capacity = draw(st.integers(0, 500))
        reserved = {t: draw(st.integers(0, 300)) for t in TENANTS if draw(st.booleans())}
        queued = {t: draw(st.integers(0, 300)) for t in TENANTS if draw(st.booleans())}
        demand = {t: reserved.get(t, 0) + queued.get(t, 0) + draw(st.integers(0, 50))
                  for t in set(reserved) | set(queued)}
        smallest = {t: draw(st.integers(1, n)) for t, n in queued.items() if n}
        reports.append(NodeReport(f"n{i}", capacity, reserved, queued, demand, smallest))
    quotas = {t: ClusterQuota(weight=draw(st.sampled_from([0.5, 1.0, 3.0])),
                              guaranteed=draw(st.integers(0, 200)),
                              limit=draw(st.one_of(st.none(), st.integers(0, 900))))
              for t in TENANTS if draw(st.booleans())}
    quotas = {t: q if q.limit is None or q.limit >= q.guaranteed
              else ClusterQuota(q.weight, q.guaranteed, q.guaranteed) for t, q in quotas.items()}
    return reports, quotas


@settings(max_examples=400, deadline=None)
@given(pictures())
def test_the_nodes_parts_add_up_to_the_cluster_quota(picture):
    reports, quotas = picture
    per_node = {r.node: entitlements(r.node, reports, quotas) for r in reports}
    for tenant, quota in quotas.items():
        parts = [per_node[r.node][tenant] for r in reports]
        reserved = sum(r.reserved.get(tenant, 0) for r in reports)
        assert all(p.reserved == reserved for p in parts)  # one picture, one figure
        if quota.limit is not None:
            # What the nodes may reserve together: the limit, or what is reserved already
            # (a node never takes back what it reserved; it only stops adding).
            total = sum(p.may_reserve for p in parts)
            assert total <= max(quota.limit, reserved)
            assert quota.limit - total < len(reports) + 1 or reserved > quota.limit  # rounding
            for r, p in zip(reports, parts):
                assert p.may_reserve >= r.reserved.get(tenant, 0)
            assert parts[0].share <= quota.limit + 1e-6
        else:
            assert all(p.may_reserve is None for p in parts)
        for r, p in zip(reports, parts):
            assert 0 <= p.guaranteed <= r.capacity  # never past a node's own capacity
            if not r.demand.get(tenant):
                assert p.guaranteed == 0  # no demand here, nothing held for it here
        assert sum(p.guaranteed for p in parts) <= parts[0].share + 1e-6


def test_a_tenant_gets_its_cluster_share_where_its_demand_is():
    reports = [NodeReport("a", 100, {"t": 10}, {"t": 50}, {"t": 60}),
               NodeReport("b", 100, {"t": 20}, {}, {"t": 20}),
               NodeReport("c", 100, {"u": 150}, {}, {"u": 150})]
    quotas = {"t": ClusterQuota(weight=1.0, guaranteed=0, limit=50)}
    a, b, c = (entitlements(n, reports, quotas)["t"] for n in "abc")
    assert a.share == b.share == 50  # its limit: it wants 80 of 300 pages
    assert (a.guaranteed, b.guaranteed, c.guaranteed) == (37, 12, 0)  # 50 split 60:20:0
    # 20 of its 50 are unreserved: a, where 50 pages wait, gets most of them.
    assert (a.may_reserve, b.may_reserve, c.may_reserve) == (10 + 19, 20 + 0, 0 + 0)


def test_a_small_queue_beside_a_large_one_gets_room_for_its_request():
    """Split by pages waiting alone, a's 250 pages of queue took all but 2 of the 40 free
    pages, and c, with one 30-page request waiting, never got enough for it."""
    reports = [NodeReport("a", 256, {"t": 200}, {"t": 250}, {"t": 450}, {"t": 16}),
               NodeReport("b", 256, {"t": 60}, {}, {"t": 60}),
               NodeReport("c", 256, {}, {"t": 30}, {"t": 30}, {"t": 30})]
    quotas = {"t": ClusterQuota(limit=300)}
    parts = {n: entitlements(n, reports, quotas)["t"].may_reserve - r.reserved.get("t", 0)
             for n, r in zip("abc", reports)}
    assert parts["c"] >= 30  # c, served least (none of its 30 pages), admits its request
    assert sum(parts.values()) <= 40
    # Once c holds its 30 pages, a (200 of 450) comes first.
    reports[2] = NodeReport("c", 256, {"t": 30}, {"t": 30}, {"t": 60}, {"t": 30})
    reports[0] = NodeReport("a", 256, {"t": 200}, {"t": 250}, {"t": 450}, {"t": 6})
    parts = {n: entitlements(n, reports, quotas)["t"].may_reserve - r.reserved.get("t", 0)
             for n, r in zip("abc", reports)}
    assert parts["a"] >= 6 and sum(parts.values()) <= 10


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**20) | st.text(max_size=3)
    | st.sampled_from([1.5, float("inf"), float("-inf"), float("nan"), -0.0, 1e300]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["pools", "default", "capacity", "reserved", "queued", "demand",
                         "smallest", "chat"]), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=500, deadline=None)
@given(JSON, st.sampled_from([b"/kvd/nodes/n1", b"/kvd/nodes/\xff", b"nodes"]))
def test_a_node_entry_reads_as_figures_or_is_refused(value, key):
    # Whatever sits under the nodes' prefix: figures of finite, non-negative pages, or
    # ValueError / KeyError (left out); never another error (the reconcile would fail and
    # the node take etcd for away).
    import json

    from kvd.cluster import read_node

    try:
        name, reports = read_node(key, json.dumps(value).encode())
    except (ValueError, KeyError):
        return
    assert name == key.decode().rsplit("/", 1)[-1]
    for report in reports.values():
        for n in (report.capacity, *report.reserved.values(), *report.queued.values(),
                  *report.demand.values(), *report.smallest.values()):
            assert type(n) is int and n >= 0


@settings(max_examples=200, deadline=None)
@given(pictures())
def test_a_node_entry_reads_back_as_published(picture):
    import json

    from kvd.cluster import read_node

    reports, _ = picture
    for report in reports:
        value = json.dumps({"pools": {"default": report.to_json()}, "at": 0.0}).encode()
        assert read_node(f"/kvd/nodes/{report.node}".encode(), value) == (
            report.node, {"default": report})
