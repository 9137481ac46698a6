"""The systemd unit verifies, and kvd speaks the notify protocol (READY, WATCHDOG, STOPPING)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvd_loadgen.local import LocalKvd
from tests.conftest import ROOT

SMALL = ("--model", "tiny", "--device-pages", "8", "--host-pages", "32")
UNIT = ROOT / "deploy" / "systemd" / "kvd.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_the_unit_verifies(tmp_path):
    kvd = Path(sys.executable).with_name("kvd")  # the unit's /usr/bin/kvd, as installed here
    unit = tmp_path / "kvd.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/kvd", str(kvd)))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Unknown" not in result.stderr, result.stderr
    text = UNIT.read_text()
    for line in ("Type=notify", "RuntimeDirectory=kvd", "ExecReload=/bin/kill -HUP $MAINPID",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes",
                 "PrivateTmp=yes", "User=kvd", "LimitMEMLOCK=infinity",
                 "DeviceAllow=/dev/nvidiactl rw"):
        assert line in text, line


def test_ready_watchdog_and_stopping_are_sent(tmp_path):
    address = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind(str(address))
        sink.settimeout(10)
        kvd = LocalKvd(*SMALL, workdir=tmp_path,
                       env={"NOTIFY_SOCKET": str(address), "WATCHDOG_USEC": "200000"}).start()
        try:
            messages = [sink.recv(4096).decode()]
            assert messages[0].startswith("READY=1")
            assert f"MAINPID={kvd.proc.pid}" in messages[0]
            messages.append(sink.recv(4096).decode())  # at half of WatchdogSec
            assert messages[-1] == "WATCHDOG=1"
            kvd.proc.send_signal(signal.SIGTERM)
            while not messages[-1].startswith("STOPPING=1"):
                messages.append(sink.recv(4096).decode())
            assert kvd.proc.wait(20) == 0
        finally:
            kvd.stop()
