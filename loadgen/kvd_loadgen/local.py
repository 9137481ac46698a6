"""Start a real kvd process on a private unix socket (for the load generator and tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvd_client import Client, KvdClientError


class KvdStartError(RuntimeError):
    """kvd refused its options or config, or did not come up: `line` says why."""

    def __init__(self, message: str, line: str) -> None:
        super().__init__(message)
        self.line = line


def _why(log: str) -> str:
    """kvd's own one-line reason (its last line that is not a JSON log record)."""
    lines = [line for line in log.splitlines() if line.strip() and not line.startswith("{")]
    return lines[-1] if lines else "see its log"


class LocalKvd:
    """`with LocalKvd("--device-pages", "64") as kvd: Client(kvd.target)...`"""

    def __init__(self, *args: str, workdir: str | Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        if "--metrics" not in self.args:  # many daemons per machine: no fixed metrics port
            self.args += ["--metrics", ""]
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvd-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.socket = self.workdir / "kvd.sock"
        self.log_path = self.workdir / "kvd.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 30.0) -> LocalKvd:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd", "--socket", str(self.socket), "--log-format", "json",
             *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                raise KvdStartError(f"kvd exited with {self.proc.returncode}:\n{log}", _why(log))
            if self.socket.exists():
                try:
                    with Client(self.target, timeout_s=2) as client:
                        if client.health() == "SERVING":
                            return self
                except KvdClientError:
                    pass
            time.sleep(0.05)
        self.stop(signal.SIGKILL)
        log = self.log()
        raise KvdStartError(f"kvd did not become SERVING in {timeout_s}s:\n{log}",
                            f"kvd did not become SERVING in {timeout_s}s")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> LocalKvd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
