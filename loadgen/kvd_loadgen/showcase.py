"""`make run`: start kvd in the foreground on its embedded default, show it working once,
then keep serving until Ctrl-C (which drains kvd cleanly)."""

from __future__ import annotations


import argparse
import signal
import shlex
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from kvd_client import Client, KvdClientError, eventloop
from kvd_loadgen.demo import run_demo


def reach_hint(target: str) -> str:
    """How to reach the running kvd from another terminal, in words a shell takes as they
    are (the target quoted: a checkout's path may hold a space)."""
    return (f"Talk to it at {target}. In another terminal, from this directory:\n"
            "  make demo                                    # the demo again\n"
            "  . .venv/bin/activate                         # kvctl, kvd-loadgen\n"
            f"  export KVD_TARGET={shlex.quote(target)}\n"
            "  kvctl status; kvctl tenants; kvctl top\n"
            "Ctrl-C stops kvd cleanly.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("kvd_args", nargs="*", help="extra flags for kvd")
    args = parser.parse_args()
    socket = Path(args.socket)
    target = f"unix://{socket}"
    console = Console(stderr=True)
    proc = subprocess.Popen([sys.executable, "-m", "kvd", "--socket", str(socket),
                             "--log-format", "console", *args.kvd_args])
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                return proc.returncode
            if socket.exists():
                try:
                    with Client(target, timeout_s=2) as client:
                        if client.health() == "SERVING":
                            break
                except KvdClientError:
                    pass
            if time.monotonic() > deadline:
                console.print("kvd did not start in 60 s")
                proc.terminate()
                return 1
            time.sleep(0.1)
        console.rule(f"kvd is serving on {target}: a short demo")
        eventloop.run(run_demo(target, console=console))
        console.rule("kvd keeps serving")
        console.print(reach_hint(target), soft_wrap=True)
        return proc.wait()
    except KeyboardInterrupt:
        # The terminal sent SIGINT to kvd too; wait for its drain.
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            return 1


if __name__ == "__main__":
    sys.exit(main())
