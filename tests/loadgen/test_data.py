"""The traces committed in kvd_loadgen/traces are the shared ones (when the shared folder is there)."""

from __future__ import annotations

import pytest

from kvd_loadgen.data import COMMITTED_COPY, data_dir


def test_the_committed_copy_equals_the_shared_traces():
    source = data_dir()
    if source == COMMITTED_COPY:
        pytest.skip("no shared/data beside the project: the committed copy is the only one")
    copied = sorted(p.relative_to(COMMITTED_COPY) for p in COMMITTED_COPY.rglob("*") if p.is_file())
    assert copied, "kvd_loadgen/traces is empty"
    for rel in copied:
        assert (source / rel).read_bytes() == (COMMITTED_COPY / rel).read_bytes(), (
            f"kvd_loadgen/traces/{rel} differs from {source / rel}: copy it again")
