"""The load generator's measures."""

import pytest

from kvd_loadgen.measures import jain_index


def test_jain_index():
    assert jain_index([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)


def test_soak_memory_growth_compares_like_with_like():
    """The last third against the middle third, means of each; RSS counts the arenas."""
    from kvd_loadgen.soak import thirds_growth

    # Heap warms up in the first third (20 -> 50), then sits at 50 with noise; the arenas'
    # resident part grows in the middle third only.
    rss = [(t, 20 + 30 * min(t, 30) / 30 + (1 if t % 2 else -1), min(t, 45))
           for t in range(0, 90)]
    heap, total = thirds_growth(rss, 90.0)
    assert abs(heap) < 0.01  # no growth once warm, whatever the first third did
    assert 0 < total < 0.15  # the arenas grew from the middle third to the last
    grow = [(t, 50 + t, 0.0) for t in range(90)]  # a leak: a page a second
    assert thirds_growth(grow, 90.0)[0] > 0.25


def test_the_soak_targets_judge_memory_and_what_is_left():
    """A short real soak: each target carries its measured value; a leak of heap or RSS, or
    a page left behind, is not met; the report line says the figures."""
    import uvloop

    from kvd_loadgen.bench_report import soak_markdown
    from kvd_loadgen.soak import GROWTH_TARGET, run_soak, targets

    out = uvloop.run(run_soak(4, 6.0, "fair", 2.0))
    judged = targets(out)
    assert set(judged) == {"soak_heap_growth_last_vs_middle_third_pct",
                           "soak_rss_growth_last_vs_middle_third_pct",
                           "soak_pages_requests_left_and_self_check_problems"}
    heap = judged["soak_heap_growth_last_vs_middle_third_pct"]
    assert heap["measured"] == pytest.approx(out["heap_growth_last_vs_middle_third"] * 100)
    assert judged["soak_pages_requests_left_and_self_check_problems"]["met"]
    leaky = {**out, "heap_growth_last_vs_middle_third": GROWTH_TARGET * 2,
             "rss_growth_last_vs_middle_third": GROWTH_TARGET + 0.001, "pages_leaked": 3}
    assert not any(t["met"] for t in targets(leaky).values())
    assert judged["soak_heap_growth_last_vs_middle_third_pct"]["met"] == (
        out["heap_growth_last_vs_middle_third"] <= GROWTH_TARGET)
    line = "\n".join(soak_markdown(leaky))
    assert "heap +10.0%" in line and "pages leaked 3" in line
