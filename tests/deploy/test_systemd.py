"""The systemd unit verifies, and kvd speaks the notify protocol (READY, WATCHDOG, STOPPING)."""

from __future__ import annotations

import shutil
import re
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


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_the_unit_is_hardened_to_ok(tmp_path):
    """`systemd-analyze security` rates the unit OK (exposure <= 3.9 of 10) and names no
    dangerous capability, system call group or namespace left open."""
    kvd = Path(sys.executable).with_name("kvd")
    unit = tmp_path / "kvd.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/kvd", str(kvd)))
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                             "--threshold=39", str(unit)], capture_output=True, text=True)
    report = result.stdout + result.stderr
    score = re.search(r"Overall exposure level for kvd.service: ([0-9.]+) (\w+)", report)
    assert score is not None, report
    assert float(score.group(1)) <= 3.9, report
    assert result.returncode == 0, report  # --threshold: systemd's own check of the same
    failing = {line.split()[1] for line in report.splitlines() if line.startswith("✗")}
    for setting in ("CapabilityBoundingSet=~CAP_SYS_ADMIN", "SystemCallFilter=~@privileged",
                    "RestrictNamespaces=~user", "ProtectClock=", "ProtectKernelLogs=",
                    "ProtectHostname="):
        assert setting not in failing, report
    assert "DeviceAllow=char-nvidia-caps r" in UNIT.read_text()  # MIG instances


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
