"""An etcd member on loopback with a data directory of its own, for the cluster scenario and
the tests: Debian's etcd-server (`make test` installs it where it can)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class LocalEtcd:
    """One etcd member; stop() and start() keep its data (a restart)."""

    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        self.binary = binary or etcd_binary()
        if self.binary is None:
            raise RuntimeError("no etcd on PATH (Debian: apt-get install etcd-server)")
        self.data = Path(workdir) / "etcd-data"
        self.client_port, self.peer_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.client_port}"
        self.log = Path(workdir) / "etcd.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> LocalEtcd:
        url, peer = f"http://{self.address}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [self.binary, "--name", "kvd-local", "--data-dir", str(self.data),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvd-local={peer}"],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited:\n{self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"etcd did not start:\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
