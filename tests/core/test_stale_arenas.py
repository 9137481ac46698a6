"""sweep_stale: a dead kvd's arenas go, a live one's stay, whichever pid namespace it is in."""

from __future__ import annotations

import os
import subprocess
import sys

from kvd.memory.arena import _own, sweep_stale


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
    held = _own(names["elsewhere"], str(tmp_path))
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
