"""An operator's mistakes: a bad config or a start-up that cannot work is one line on stderr
and exit code 2 (never a traceback, never shared memory left behind); a bad file on SIGHUP
keeps the running config."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvd.memory.cuda import gpu_available
from kvd_client import AsyncClient, Client, pb
from kvd_loadgen.local import LocalKvd

from .conftest import reload_config


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


def test_a_socket_kvd_cannot_make_is_one_line_and_leaves_nothing(tmp_path):
    # Each of these ended kvd's start in a traceback (exit 1), or in grpc's "cannot listen"
    # that named no reason, with the socket file left behind.
    one_line(kvd(config='[server]\nsocket = "a\\u0000b.sock"\n', tmp_path=tmp_path),
             "a path may not hold a NUL character")
    long = tmp_path / ("d" * (106 - len(str(tmp_path)) - len("/kvd.sock")))
    one_line(kvd("--socket", f"{long}x/kvd.sock", tmp_path=tmp_path),
             "a unix socket's path holds at most 107 bytes, this one is 108")
    one_line(kvd("--socket", "k.sock", config="[server]\nsocket_group = 'no-such-group'\n",
                 tmp_path=tmp_path), "socket_group 'no-such-group': no such group")
    # A path or address whose bytes are not UTF-8 (a surrogate in Python's words): grpc's
    # UnicodeEncodeError as kvd bound it, after the arenas were made.
    one_line(kvd("--socket", "\udcffk.sock", tmp_path=tmp_path),
             "gRPC takes a socket's path as UTF-8 text, and this one is not")
    one_line(kvd("--socket", "k.sock", "--tcp", "h\udcff:5000", tmp_path=tmp_path),
             "tcp: an address is UTF-8 text, and this one is not")
    assert not (tmp_path / "k.sock").exists()
    assert not left_behind()


async def test_a_socket_path_of_the_most_bytes_a_socket_holds_serves(tmp_path):
    workdir = tmp_path / ("d" * (107 - len(str(tmp_path)) - len("//kvd.sock")))
    workdir.mkdir()
    with LocalKvd("--model", "tiny", workdir=workdir) as proc:
        assert len(os.fsencode(proc.socket)) == 107
        async with AsyncClient(proc.target) as c:
            assert (await c.admit("r", 16)).decision == pb.DECISION_ADMITTED


def test_pem_files_grpc_cannot_use_are_one_line_naming_the_file(tmp_path):
    # grpc took any bytes as the listener's certificate and then failed to bind with "the
    # address is in use, not permitted, or not this host's"; a peer's were read at its first
    # handoff, whose call then failed inside kvd.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from .test_tls import _cert

    key = ec.generate_private_key(ec.SECP256R1())
    other = ec.generate_private_key(ec.SECP256R1())
    cert = _cert("kvd", key, None, key, ip="127.0.0.1")
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for name, k in (("key.pem", key), ("other.pem", other)):
        (tmp_path / name).write_bytes(k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    server = ("[server]\nsocket = 'k.sock'\ntcp = '127.0.0.1:0'\ntls_cert = '{}'\n"
              "tls_key = '{}'\n")
    one_line(kvd(config=server.format("junk.pem", "key.pem"), tmp_path=tmp_path),
             "tls_cert {0}/junk.pem and tls_key {0}/key.pem are not a PEM certificate and "
             "the unencrypted key that goes with it".format(tmp_path))
    one_line(kvd(config=server.format("cert.pem", "other.pem"), tmp_path=tmp_path),
             "KEY_VALUES_MISMATCH")
    one_line(kvd(config=server.format("cert.pem", "key.pem") + "tls_client_ca = 'junk.pem'\n",
                 tmp_path=tmp_path), f"tls_client_ca {tmp_path}/junk.pem holds no PEM")
    assert not (tmp_path / "k.sock").exists()
    peer = "[[peer]]\nname = 'east'\naddress = '10.0.0.2:7000'\ntls_ca = '{}'\n"
    one_line(kvd(config=peer.format("junk.pem"), tmp_path=tmp_path),
             f"[[peer]] 'east': tls_ca {tmp_path}/junk.pem holds no PEM certificate")
    one_line(kvd(config=peer.format("gone.pem"), tmp_path=tmp_path),
             f"[[peer]] 'east': cannot read tls_ca {tmp_path}/gone.pem")
    one_line(kvd(config=peer.format("cert.pem") + "tls_cert = 'cert.pem'\n"
                 "tls_key = 'other.pem'\n", tmp_path=tmp_path), "KEY_VALUES_MISMATCH")
    assert not left_behind()
    # The same files, good, start: the checks refuse only what grpc cannot use.
    (tmp_path / "good.toml").write_text(
        server.format("cert.pem", "key.pem") + "tls_client_ca = 'cert.pem'\n"
        + peer.format("cert.pem") + "tls_cert = 'cert.pem'\ntls_key = 'key.pem'\n"
        + "[[pool]]\nmodel = 'tiny'\ndevice_pages = 8\nhost_pages = 8\n")
    with LocalKvd("--config", str(tmp_path / "good.toml"), workdir=tmp_path) as proc:
        with Client(proc.target) as c:
            assert c.health() == "SERVING"


def test_ctrl_c_while_kvd_starts_stops_it_in_one_line_and_leaves_nothing(tmp_path):
    # Ctrl-C while kvd made its arenas (a large pool takes a while) ended in a
    # KeyboardInterrupt traceback, the arenas left to Python's resource tracker ("leaked
    # shared_memory objects"). Sent as soon as the arenas appear: most tries land while kvd
    # starts, the others once it serves (it then drains, and exits 0).
    interrupted = 0
    for attempt in range(5):
        sock = tmp_path / f"k{attempt}.sock"
        proc = subprocess.Popen([sys.executable, "-m", "kvd", "--socket", str(sock), "--metrics",
                                 "", "--page-bytes", str(2**20), "--device-pages", "64",
                                 "--host-pages", "64"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=tmp_path)
        STARTED.append(proc.pid)
        watchdog = threading.Timer(60, proc.kill)
        watchdog.start()
        try:
            while proc.poll() is None and not any(
                    n.startswith(f"kvd-{proc.pid}-") for n in os.listdir("/dev/shm")):
                time.sleep(0.0005)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            watchdog.cancel()
            proc.kill()
        assert "Traceback" not in err and "leaked" not in err, err
        if proc.returncode == 130:
            assert "kvd: interrupted while starting; stopped" in err, err
            interrupted += 1
        else:
            assert proc.returncode == 0, err
        assert not sock.exists()
        assert not left_behind()
    assert interrupted, "no Ctrl-C landed while kvd started"


def test_page_tables_larger_than_kvds_memory_are_refused_in_one_line(tmp_path):
    # Pages of one byte fit /dev/shm by the billion: kvd took the config, then built the
    # page table of two billion pages (about 49 bytes each) and was killed for memory with
    # the host's other processes (found by the config properties' wild values: the hunt's
    # pytest process went to 24 GB and the kernel's OOM killer).
    # Pages of one byte, half again as many as this machine's memory holds page tables of.
    from kvd.daemon import PAGE_TABLE_BYTES, _memory_available

    available = _memory_available("/proc/meminfo", "/sys/fs/cgroup", "/proc/self/cgroup")
    if available is None:
        pytest.skip("this host says nothing of its memory")
    pages = available // PAGE_TABLE_BYTES * 3 // 2
    if pages > shutil.disk_usage("/dev/shm").free:
        pytest.skip("/dev/shm is too small for pages enough to outgrow this host's memory")
    one_line(kvd("--socket", "k.sock", "--page-bytes", "1", "--device-pages", str(pages),
                 "--host-pages", "0", tmp_path=tmp_path),
             f"the pools' {pages} pages need about")
    assert not left_behind()


def test_the_memory_kvd_may_take_is_the_least_its_host_and_cgroups_leave(tmp_path):
    from kvd.daemon import _memory_available

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    cgroups = tmp_path / "cgroup"
    root = tmp_path / "fs"
    # v2: one unified hierarchy; its limit leaves 1 GiB.
    (root / "kubepods" / "pod1").mkdir(parents=True)
    (root / "kubepods" / "pod1" / "memory.max").write_text(f"{4 * 2**30}\n")
    (root / "kubepods" / "pod1" / "memory.current").write_text(f"{3 * 2**30}\n")
    cgroups.write_text("0::/kubepods/pod1\n")
    assert _memory_available(str(meminfo), str(root), str(cgroups)) == 2**30
    (root / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert _memory_available(str(meminfo), str(root), str(cgroups)) == 20000000 * 1024
    # v1: the memory controller's own hierarchy.
    (root / "memory" / "docker" / "c1").mkdir(parents=True)
    (root / "memory" / "docker" / "c1" / "memory.limit_in_bytes").write_text(f"{2**31}\n")
    (root / "memory" / "docker" / "c1" / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    cgroups.write_text("5:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n0::/\n")
    assert _memory_available(str(meminfo), str(root), str(cgroups)) == 2**30
    assert _memory_available(str(tmp_path / "none"), str(root), str(tmp_path / "none")) is None


async def test_a_bad_reload_keeps_the_running_config(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text('[[pool]]\nmodel = "tiny"\ndevice_pages = 8\nhost_pages = 8\n'
                      '[[tenant]]\nname = "a"\nweight = 2\n')
    with LocalKvd("--config", str(config), workdir=tmp_path) as proc:
        await reload_config(proc, config, config.read_text().replace("weight = 2", 'weight = "3"'),
                            "reload failed; keeping the running config")
        assert "weight: Input should be a valid number" in proc.log()
        assert "Traceback" not in proc.log()
        async with AsyncClient(proc.target) as c:
            (a,) = [t for t in await c.list_tenants() if t.tenant == "a"]
            assert a.weight == 2.0
            assert (await c.admit("r", 16)).decision == pb.DECISION_ADMITTED
        assert proc.proc.poll() is None


async def test_a_reload_whose_quotas_do_not_fit_the_running_pools_changes_nothing(tmp_path):
    # Pools need a restart; tenants are reloaded, against the pools kvd runs. A file that
    # also made the pages 4096 times bigger had a limit that fit its own pages (6.4 million
    # of 16 MiB) but not kvd's (26.8 billion of 4 KiB, past what kvd counts in): the reload
    # raised half-way, a traceback in the log, the weight's change and every later
    # reload's tenants taken for applied and never applied, and systemd told "reloading"
    # and never "ready" again.
    config = tmp_path / "kvd.toml"
    pool = '[[pool]]\nmodel = "tiny"\npage_bytes = {}\ndevice_pages = 8\nhost_pages = 8\n'
    config.write_text(pool.format(4096) + '[[tenant]]\nname = "a"\nlimit = 4\n')

    with LocalKvd("--config", str(config), workdir=tmp_path) as proc:
        await reload_config(proc, config, pool.format(2**24) + '[[tenant]]\nname = "a"\n'
                            'limit = "100TiB"\nweight = 3\n',
                            "reload failed; keeping the running config")
        assert "26843545600 pages of 4096 bytes" in proc.log()
        assert "Traceback" not in proc.log()
        async with AsyncClient(proc.target) as c:
            (a,) = [t for t in await c.list_tenants() if t.tenant == "a"]
            assert (a.limit_pages, a.weight) == (4, 1.0)
        # The running config is whole: the next good file applies.
        await reload_config(proc, config,
                            pool.format(4096) + '[[tenant]]\nname = "a"\nlimit = 6\n',
                            "config reloaded")
        async with AsyncClient(proc.target) as c:
            (a,) = [t for t in await c.list_tenants() if t.tenant == "a"]
            assert a.limit_pages == 6
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


def _private_shm() -> bool:
    return subprocess.run(["unshare", "-m", "true"], capture_output=True,
                          check=False).returncode == 0


def _in_private_shm(script: str, tmp_path) -> str:
    """Run a Python script (argv[1]: tmp_path) in a mount namespace of its own whose /dev/shm
    is a 64 MiB tmpfs: what the script's kvds leave there, or find, is theirs alone (the
    suite's other kvds, in parallel, share the real one). Returns its stdout."""
    mount = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1" "$2"'
    result = subprocess.run(["unshare", "-m", "sh", "-c", mount, sys.executable, script,
                             str(tmp_path)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


needs_private_shm = pytest.mark.skipif(not _private_shm(),
                                       reason="needs a mount namespace (unshare -m: root)")

# A kvd killed with its process group (its resource tracker with it), bytes written into its
# arenas first, as engines write; then the next kvd starts, and a third while that one lives.
_KILLED_WHOLE = r"""
import mmap, os, signal, subprocess, sys, time
from pathlib import Path
from kvd_client import Client, pb
from kvd_loadgen.local import LocalKvd

def arenas(pid):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvd-{pid}-"))

tmp = Path(sys.argv[1])
killed = subprocess.Popen(
    [sys.executable, "-m", "kvd", "--socket", str(tmp / "killed.sock"), "--metrics", "",
     "--model", "tiny", "--device-pages", "8", "--host-pages", "8"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
while len(arenas(killed.pid)) < 2 or not (tmp / "killed.sock").exists():
    time.sleep(0.05)
leaked = arenas(killed.pid)
for name in leaked:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    with mmap.mmap(fd, os.fstat(fd).st_size) as memory:
        memory[:] = b"\x07" * len(memory)
    os.close(fd)
os.killpg(killed.pid, signal.SIGKILL)
killed.wait()
time.sleep(0.5)  # a resource tracker that outlived it would have unlinked them by now
print("left", len(arenas(killed.pid)))
for sub in ("live", "next"):
    (tmp / sub).mkdir()
args = ("--model", "tiny", "--device-pages", "8", "--host-pages", "8")
with LocalKvd(*args, workdir=tmp / "live") as live:
    print("after_start", len(arenas(killed.pid)))
    print("logged", "removed the arenas of kvd processes that are gone" in live.log()
          and all(name in live.log() for name in leaked))
    mine = arenas(live.proc.pid)
    with LocalKvd(*args, workdir=tmp / "next") as after:
        print("live_kept", arenas(live.proc.pid) == mine and len(mine) == 2)
        print("next_removed_nothing", "removed the arenas" not in after.log())
    with Client(live.target) as c:
        c.admit("r", 16)
        print("live_serves", len(c.allocate("r", 1).handles))
"""


@needs_private_shm
def test_a_kvd_killed_whole_leaves_arenas_that_the_next_start_removes(tmp_path):
    """A container or unit killed whole (Python's resource tracker with it) leaves its kvd's
    arenas in /dev/shm, holding their RAM; the next kvd removes them, and leaves a live
    kvd's alone."""
    out = dict(line.split() for line in _in_private_shm(_KILLED_WHOLE, tmp_path).splitlines())
    assert out == {"left": "2", "after_start": "0", "logged": "True", "live_kept": "True",
                   "next_removed_nothing": "True", "live_serves": "1"}


# A kvd with 48 MiB of arenas; then another process (an engine's own segments) asks for 40 MiB;
# then an engine allocates past the device tier, so kvd writes its host tier's pages
# (demotions).
_SHM_FILLS_UP = r"""
import subprocess, sys
from kvd_client import Client, pb
from kvd_loadgen.local import LocalKvd

with LocalKvd("--page-bytes", str(1 << 20), "--device-pages", "16", "--host-pages", "32",
              "--admission", "reservation", workdir=sys.argv[1]) as kvd:
    other = subprocess.run(["dd", "if=/dev/zero", "of=/dev/shm/other", "bs=1M", "count=40"],
                           capture_output=True)
    with Client(kvd.target, timeout_s=10) as c:
        for i in range(40):
            c.admit(f"r{i}", 16)
            c.allocate(f"r{i}", 1)
        (pool,) = c.pool_stats().pools
        demoted = sum(t.used_pages for t in pool.tiers if t.tier == pb.TIER_HOST)
    print("other", other.returncode, "kvd", kvd.proc.poll(), "host_pages_used", demoted)
"""


@needs_private_shm
def test_shm_filling_up_after_the_start_cannot_kill_kvd(tmp_path):
    """kvd's arenas hold their pages from the start: another process that fills /dev/shm
    later is refused its space, where kvd's first write to a page of its own would otherwise
    be a SIGBUS, the end of kvd and of every engine's cache."""
    _, other, _, kvd_exit, _, used = _in_private_shm(_SHM_FILLS_UP, tmp_path).split()
    assert other != "0"  # dd: no space left for it
    assert kvd_exit == "None"  # kvd still running
    assert int(used) >= 24  # 40 blocks over 16 device pages: the rest on the host tier
