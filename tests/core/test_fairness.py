"""Water-filling fair shares and Jain's index."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.core.fairness import TenantQuota, effective_guarantees, water_fill


def test_equal_weights_split_evenly_and_unused_share_flows():
    assert water_fill(100, {"a": 100, "b": 100}, {}) == pytest.approx({"a": 50, "b": 50})
    # b wants only 20: the rest flows to a; and comes back when b asks for it.
    assert water_fill(100, {"a": 100, "b": 20}, {}) == pytest.approx({"a": 80, "b": 20})
    assert water_fill(100, {"a": 100, "b": 0}, {}) == pytest.approx({"a": 100, "b": 0})


def test_weights():
    quotas = {"a": TenantQuota(weight=3), "b": TenantQuota(weight=1)}
    assert water_fill(100, {"a": 100, "b": 100}, quotas) == pytest.approx({"a": 75, "b": 25})


def test_guarantees_come_first_then_weights_share_the_rest():
    quotas = {"a": TenantQuota(guaranteed=60), "b": TenantQuota()}
    assert water_fill(100, {"a": 100, "b": 100}, quotas) == pytest.approx({"a": 60, "b": 40})
    # A guarantee is not a reservation: unused, it flows to others.
    assert water_fill(100, {"a": 10, "b": 100}, quotas) == pytest.approx({"a": 10, "b": 90})


def test_limits_cap_a_share():
    quotas = {"a": TenantQuota(limit=30)}
    assert water_fill(100, {"a": 100, "b": 40}, quotas) == pytest.approx({"a": 30, "b": 40})


def test_overcommitted_guarantees_scale_down_proportionally():
    quotas = {"a": TenantQuota(guaranteed=150), "b": TenantQuota(guaranteed=50)}
    assert effective_guarantees(quotas, 100) == pytest.approx({"a": 75, "b": 25})
    assert water_fill(100, {"a": 200, "b": 200}, quotas) == pytest.approx({"a": 75, "b": 25})


@given(st.dictionaries(st.sampled_from("abcde"), st.integers(0, 500), min_size=1),
       st.dictionaries(st.sampled_from("abcde"),
                       st.tuples(st.integers(1, 5), st.integers(0, 80),
                                 st.none() | st.integers(0, 300))))
def test_water_fill_properties(demand, raw):
    quotas = {t: TenantQuota(weight=w, guaranteed=g, limit=l) for t, (w, g, l) in raw.items()}
    shares = water_fill(200, demand, quotas)
    assert sum(shares.values()) <= 200 + 1e-6
    for t, share in shares.items():
        q = quotas.get(t, TenantQuota())
        assert -1e-9 <= share <= demand[t] + 1e-6
        if q.limit is not None:
            assert share <= q.limit + 1e-6
    # Work-conserving: capacity is left over only when every demand (up to limits) is met.
    if sum(shares.values()) < 200 - 1e-6:
        for t, share in shares.items():
            q = quotas.get(t, TenantQuota())
            top = demand[t] if q.limit is None else min(demand[t], q.limit)
            assert share >= top - 1e-6
