"""Shared-memory arenas: reserved whole when made, and removed by the next kvd when the kvd
that made them is gone (and only then, whichever pid namespace it is in)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvd.core.errors import ResourceExhausted
from kvd.memory.arena import SHM_DIR, ShmArena, _own, sweep_stale

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR),
                                reason="POSIX shared memory in /dev/shm")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_arenas_of_dead_unlocked_kvds_are_removed(tmp_path):
    dead = _dead_pid()
    names = {
        "stale": f"kvd-{dead}-default-host-0a1b2c3d",
        "alive": f"kvd-{os.getpid()}-default-host-0a1b2c3d",
        # A dead pid here, but locked: a live kvd in another pid namespace.
        "elsewhere": f"kvd-{dead}-default-dev-4e5f6a7b",
        "not_kvd": f"psm_{dead}",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"\x01" * 8192)
    held = _own(names["elsewhere"], shm_dir=str(tmp_path))
    try:
        removed = sweep_stale(str(tmp_path))
    finally:
        os.close(held)
    assert [name for name, _ in removed] == [names["stale"]]
    assert removed[0][1] >= 8192  # the memory it held, which its removal gives back
    assert sorted(os.listdir(tmp_path)) == sorted(
        [names["alive"], names["elsewhere"], names["not_kvd"]])
    # Its lock gone (the process holding it died), the other one goes too.
    assert [name for name, _ in sweep_stale(str(tmp_path))] == [names["elsewhere"]]


def test_an_arena_holds_its_pages_from_the_start():
    """Every page is taken from /dev/shm when the arena is made, not when first written (a
    write to a page /dev/shm no longer has room for is a SIGBUS)."""
    arena = ShmArena(16, 4096, label="t")
    try:
        assert os.stat(f"{SHM_DIR}/{arena.shm_name}").st_blocks * 512 >= 16 * 4096
    finally:
        arena.close()


def test_an_arena_shm_cannot_hold_is_refused_and_leaves_nothing(monkeypatch):
    """/dev/shm without room for it (the kernel's ENOSPC, stood in for here: on a machine
    whose /dev/shm is its RAM, asking for more is an OOM kill first)."""
    import errno

    def no_space(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(ResourceExhausted, match="cannot reserve 1 MiB of shared memory for "
                                                "the too-big arena: No space left on device"):
        ShmArena(256, 4096, label="too-big")
    assert [n for n in set(os.listdir(SHM_DIR)) - before if "too-big" in n] == []
