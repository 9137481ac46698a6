"""The load generator's measures."""

import pytest

from kvd_loadgen.measures import jain_index


def test_jain_index():
    assert jain_index([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
