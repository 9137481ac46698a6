"""Integration fixtures: a real kvd process on a unix socket in a temp dir."""

from __future__ import annotations

import pytest

from kvd_client import AsyncClient
from kvd_loadgen.local import LocalKvd

SMALL = ("--model", "tiny", "--block-tokens", "16", "--device-pages", "8", "--host-pages", "32")


@pytest.fixture
def kvd(tmp_path):
    """A running kvd with 8 device and 32 host pages of 16 KiB."""
    with LocalKvd(*SMALL, workdir=tmp_path) as proc:
        yield proc
        assert proc.proc.poll() is None, f"kvd died during the test:\n{proc.log()}"


@pytest.fixture
async def client(kvd):
    async with AsyncClient(kvd.target, timeout_s=10) as c:
        yield c
    # Every test leaves a consistent daemon behind.
    async with AsyncClient(kvd.target, timeout_s=10) as c:
        check = await c.self_check()
        assert check.ok, list(check.problems)
