"""systemd's notify protocol (sd_notify), without libsystemd: one datagram per state change
to the socket named by $NOTIFY_SOCKET (an abstract socket when it starts with '@')."""

from __future__ import annotations

import asyncio
import os
import socket


def notify(state: str) -> bool:
    """Send e.g. "READY=1"; False when not run by systemd (no NOTIFY_SOCKET) or it failed."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval_s() -> float | None:
    """Half of WatchdogSec (from $WATCHDOG_USEC), when systemd asks for keep-alives."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2


async def watchdog_forever(interval_s: float) -> None:
    """WATCHDOG=1 every interval, from the event loop: a stuck loop stops the pings."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)
