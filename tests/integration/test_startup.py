"""An operator's mistakes: a bad config or a start-up that cannot work is one line on stderr
and exit code 2 (never a traceback, never shared memory left behind); a bad file on SIGHUP
keeps the running config."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvd.memory.cuda import gpu_available
from kvd_client import AsyncClient, Client, pb
from kvd_loadgen.local import LocalKvd


def kvd(*args: str, config: str | None = None, tmp_path=None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvd", "--metrics", "", "--model", "tiny", *args]
    if config is not None:
        path = tmp_path / "kvd.toml"
        path.write_text(config)
        argv += ["--config", str(path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    out, err = proc.communicate(timeout=60)
    STARTED.append(proc.pid)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


STARTED: list[int] = []  # the pids of the kvds these tests started


def one_line(result: subprocess.CompletedProcess, expect: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("kvd: ")]
    assert len(ours) == 1 and expect in ours[0], result.stderr


# What /dev/shm held before these tests: a kvd killed long ago leaves its arenas, and a kvd
# started here may be given the same pid.
BEFORE = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def left_behind() -> list[str]:
    """Shared memory of the kvds these tests started (their names carry the pid)."""
    return [n for n in os.listdir("/dev/shm") if n not in BEFORE
            and any(n.startswith(f"kvd-{pid}-") for pid in STARTED)]


@pytest.mark.parametrize("server, expect", [
    ('lease_ttl_s = "30"', "lease_ttl_s: Input should be a valid number"),
    ('workers = "2"', "workers: Input should be a valid integer"),
    ('log_level = "verbose"', "log_level: Input should be"),
    ("eviction_ledger = -1", "eviction_ledger"),
    ('grace_s = "10s"', "grace_s: Input should be a valid number"),
    ("grace_s = -1", "grace_s"),
    ("lease_ttl_s = 0", "lease_ttl_s"),
    ("socket_mode = 660", "write it in octal"),
    ('tcp = "0.0.0.0"', "not HOST:PORT"),
])
def test_bad_config_values_are_one_line_and_exit_2(tmp_path, server, expect):
    one_line(kvd(config=f"[server]\nsocket = 'k.sock'\n{server}\n", tmp_path=tmp_path), expect)


@contextlib.contextmanager
def busy_port():
    """A loopback port something else is listening on."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        yield busy.getsockname()[1]
    finally:
        busy.close()


def test_start_up_failures_are_one_line_and_exit_2(tmp_path):
    with busy_port() as port:
        one_line(kvd("--socket", "", "--tcp", f"127.0.0.1:{port}", "--device-pages", "4",
                     "--host-pages", "4", tmp_path=tmp_path), "cannot listen on")
    (tmp_path / "file").write_text("")
    one_line(kvd("--socket", str(tmp_path / "file" / "k.sock"), tmp_path=tmp_path),
             "cannot create the socket's directory")
    one_line(kvd("--socket", str(tmp_path / "file"), tmp_path=tmp_path), "is not a socket")
    if not gpu_available():
        one_line(kvd("--socket", "k.sock", "--device-backend", "cupy", tmp_path=tmp_path),
                 "device_backend=cupy but no GPU")
    one_line(kvd("--socket", "k.sock", "--metrics", "127.0.0.1:99999", tmp_path=tmp_path),
             "not HOST:PORT")
    # More memory than the device tier's home has (/dev/shm, or the GPU with CuPy): refused
    # before a page is mapped.
    one_line(kvd("--socket", "k.sock", "--device-pages", str(2**31), tmp_path=tmp_path),
             "of GPU 0's memory" if gpu_available() else "of shared memory but /dev/shm has")
    assert not left_behind()


async def test_a_bad_reload_keeps_the_running_config(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text('[[pool]]\nmodel = "tiny"\ndevice_pages = 8\nhost_pages = 8\n'
                      '[[tenant]]\nname = "a"\nweight = 2\n')
    with LocalKvd("--config", str(config), workdir=tmp_path) as proc:
        config.write_text(config.read_text().replace("weight = 2", 'weight = "3"'))
        proc.proc.send_signal(signal.SIGHUP)
        for _ in range(100):
            if "reload failed" in proc.log():
                break
            await asyncio.sleep(0.05)
        assert "reload failed; keeping the running config" in proc.log()
        assert "weight: Input should be a valid number" in proc.log()
        assert "Traceback" not in proc.log()
        async with AsyncClient(proc.target) as c:
            (a,) = [t for t in await c.list_tenants() if t.tenant == "a"]
            assert a.weight == 2.0
            assert (await c.admit("r", 16)).decision == pb.DECISION_ADMITTED
        assert proc.proc.poll() is None


def test_kvd_says_its_version():
    from kvd import __version__

    result = subprocess.run([sys.executable, "-m", "kvd", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"kvd {__version__}"


def test_every_policy_the_config_accepts_is_a_choice_of_the_flag():
    """`fair:reuse` (what `fair` is) is accepted by the config and by --policy alike."""
    from kvd.cli import build_parser
    from kvd.config import config_from_dict

    config = config_from_dict({"pool": [{"name": "p", "policy": "fair:reuse"}]})
    assert config.pools[0].policy == "fair:reuse"
    assert build_parser().parse_args(["--policy", "fair:reuse"]).policy == "fair:reuse"


def _arenas(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvd-{pid}-"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory in /dev/shm")
def test_a_kvd_killed_whole_leaves_arenas_that_the_next_start_removes(tmp_path):
    """A container or unit killed whole (Python's resource tracker with it) leaves its kvd's
    arenas in /dev/shm, holding their RAM; the next kvd removes them, and leaves a live
    kvd's alone."""
    import mmap

    sock = tmp_path / "killed.sock"
    killed = subprocess.Popen(
        [sys.executable, "-m", "kvd", "--socket", str(sock), "--metrics", "", "--model",
         "tiny", "--device-pages", "8", "--host-pages", "8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    STARTED.append(killed.pid)
    try:
        for _ in range(600):
            if sock.exists() and len(_arenas(killed.pid)) == 2:
                break
            time.sleep(0.05)
        leaked = _arenas(killed.pid)
        assert len(leaked) == 2  # its device stand-in and its host tier
        for name in leaked:  # bytes in them, as an engine writes: RAM they hold
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            with mmap.mmap(fd, os.fstat(fd).st_size) as memory:
                memory[:] = b"\x07" * len(memory)
            os.close(fd)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # kvd and its resource tracker at once
        killed.wait()
    time.sleep(0.5)  # a resource tracker that outlived it would have unlinked them by now
    assert _arenas(killed.pid) == leaked
    (tmp_path / "live").mkdir()
    (tmp_path / "next").mkdir()
    with LocalKvd("--model", "tiny", "--device-pages", "8", "--host-pages", "8",
                  workdir=tmp_path / "live") as live:
        STARTED.append(live.proc.pid)
        assert _arenas(killed.pid) == []
        assert "removed the arenas of kvd processes that are gone" in live.log()
        assert all(name in live.log() for name in leaked)
        mine = _arenas(live.proc.pid)
        assert len(mine) == 2
        with LocalKvd("--model", "tiny", "--device-pages", "8", "--host-pages", "8",
                      workdir=tmp_path / "next") as after:
            STARTED.append(after.proc.pid)
            assert _arenas(live.proc.pid) == mine  # a live kvd's arenas stay
            assert "removed the arenas" not in after.log()
        with Client(live.target) as c:
            assert c.admit("r", 16).decision == pb.DECISION_ADMITTED
            assert len(c.allocate("r", 1).handles) == 1
