"""kvctl, the real command, against a running kvd: tables, --json, exit codes."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvd.memory.cuda import gpu_available
from kvd_client import Client

KVCTL = str(Path(sys.executable).with_name("kvctl"))


def kvctl(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVCTL, "--target", target, *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def busy_kvd(kvd):
    with Client(kvd.target, lease="") as client:
        for rid, tenant in (("a", "t1"), ("b", "t1"), ("c", "t2")):
            client.admit(rid, 64, tenant=tenant)
            client.allocate(rid, 4)
        client.access("a")
    return kvd


def test_status_and_tenants_as_tables_and_json(busy_kvd):
    status = kvctl(busy_kvd.target, "status")
    assert status.returncode == 0, status.stderr
    backend = "cupy" if gpu_available() else "host-standin"  # kvd's default: auto
    assert backend in status.stdout and "lru" in status.stdout
    data = json.loads(kvctl(busy_kvd.target, "status", "--json").stdout)
    (pool,) = data["pools"]
    assert [t["used_pages"] for t in pool["tiers"]] == [8, 4]
    assert data["version"] and data["uptime_s"] > 0
    tenants = json.loads(kvctl(busy_kvd.target, "tenants", "--json").stdout)
    by_name = {t["tenant"]: t for t in tenants}
    assert by_name["t1"]["reserved_pages"] == 8 and by_name["t2"]["reserved_pages"] == 4
    table = kvctl(busy_kvd.target, "tenants").stdout
    assert "t1" in table and "fair share" in table
    with Client(busy_kvd.target, lease="") as client:  # the prefix blocks engines found
        client.store("a", "ns|", [b"k" * 32])
        client.commit("a", "ns|", [b"k" * 32])
        assert client.lookup("ns|", [b"k" * 32, b"l" * 32]).num_hit == 1
    shown = kvctl(busy_kvd.target, "status").stdout
    assert "prefix hits" in shown and "1 / 2" in shown


def test_links(busy_kvd):
    (link,) = json.loads(kvctl(busy_kvd.target, "links", "--json").stdout)
    assert link["link"] == "default:device<->host" and link["scheduling"] == "fair"
    by_tenant = {t["tenant"]: int(t["bytes"]) for t in link["tenants"]}
    # c's allocation demoted a's blocks (c pays); a's access promoted them back (a pays).
    assert by_tenant["t2"] > 0 and by_tenant["t1"] > 0
    assert int(link["bytes_total"]) == sum(by_tenant.values())
    table = kvctl(busy_kvd.target, "links").stdout
    assert "device<->host" in table and "fair" in table


def test_requests_top_and_explain(busy_kvd):
    reqs = json.loads(kvctl(busy_kvd.target, "requests", "--json").stdout)
    assert {r["request_id"] for r in reqs} == {"a", "b", "c"}
    assert reqs[0]["device_blocks"] >= reqs[-1]["device_blocks"]
    top = kvctl(busy_kvd.target, "top", "--count", "1")
    assert top.returncode == 0 and "busiest requests" in top.stdout
    explain = json.loads(kvctl(busy_kvd.target, "explain", "a", "--json").stdout)
    assert explain["tenant"] == "t1" and explain["num_stalls"] == 1
    causes = {s["cause"]["request_id"] for s in explain["stalls_by_cause"]}
    assert causes == {"c"}  # c's allocation pushed a out; reading a back stalled on it
    assert "because of" in kvctl(busy_kvd.target, "explain", "a").stdout


def test_changes_and_exit_codes(busy_kvd):
    changed = kvctl(busy_kvd.target, "set-policy", "fair")
    assert changed.returncode == 0 and "lru -> fair" in changed.stdout
    quota = kvctl(busy_kvd.target, "set-quota", "t2", "--weight", "3", "--limit", "20")
    assert quota.returncode == 0, quota.stderr
    tenants = json.loads(kvctl(busy_kvd.target, "tenants", "--json").stdout)
    t2 = next(t for t in tenants if t["tenant"] == "t2")
    assert (t2["weight"], t2["limit_pages"]) == (3.0, 20)
    assert kvctl(busy_kvd.target, "set-quota", "t2").returncode == 2  # nothing to change
    for bad in ("nan", "inf", "-1", "lots"):
        refused = kvctl(busy_kvd.target, "set-quota", "t2", "--weight", bad)
        assert refused.returncode == 2 and "weight" in refused.stderr, refused.stderr
    # Counts past the API's uint32 fields ran into a traceback from protobuf.
    for args in (("set-quota", "t2", "--limit", "5000000000"),
                 ("set-quota", "t2", "--max-request-pages", "5000000000"),
                 ("requests", "--limit", "5000000000")):
        refused = kvctl(busy_kvd.target, *args)
        assert refused.returncode == 2 and "at most 4294967295" in refused.stderr, \
            refused.stderr
        assert "Traceback" not in refused.stderr
    refused = kvctl(busy_kvd.target, "explain", "nope")
    assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr
    bad_policy = kvctl(busy_kvd.target, "set-policy", "belady")
    assert bad_policy.returncode == 1 and "choose one of" in bad_policy.stderr
    gone = kvctl("unix:///nonexistent/kvd.sock", "status")
    assert gone.returncode == 3 and "cannot reach kvd" in gone.stderr


def test_explain_says_what_shared_prefixes_cost(kvd):
    with Client(kvd.target, lease="") as client:
        client.admit("w", 64, tenant="x")
        client.store("w", "ns", [b"k1", b"k2"])
        client.commit("w", "ns", [b"k1", b"k2"])
        client.admit("r", 64, tenant="y")
        client.load("r", "ns", [b"k1", b"k2"])
        shown = kvctl(kvd.target, "explain", "r").stdout
        assert "it uses 2 shared prefix block(s), 2 of them" in " ".join(shown.split()), shown
        assert "charged 1.00 device page(s), 1.00 saved" in " ".join(shown.split()), shown
        client.release("w")
        client.release("r")


def test_json_before_the_command_token_file_and_a_misspelt_pool(kvd, tmp_path):
    status = kvctl(kvd.target, "--json", "status")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["pools"][0]["pool"] == "default"
    token = tmp_path / "token"
    token.write_text("not-a-token\n")
    # The file's token is sent: this kvd knows no tokens, so it is refused, not ignored.
    refused = kvctl(kvd.target, "--token-file", str(token), "status")
    assert refused.returncode != 0 and "token" in refused.stderr.lower(), refused.stderr
    missing = kvctl(kvd.target, "--token-file", str(tmp_path / "none"), "status")
    assert missing.returncode == 2 and "cannot read --token-file" in missing.stderr
    events = kvctl(kvd.target, "events", "--pool", "nopool", "--count", "1")
    assert events.returncode == 1 and "nopool" in events.stderr, events.stderr


def test_top_without_a_terminal_prints_its_view(busy_kvd):
    # Piped (no terminal), `kvctl top` printed nothing unless given --count.
    proc = subprocess.Popen([KVCTL, "--target", busy_kvd.target, "top", "--interval-s", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # It runs until stopped, as top does: read its views as they come, and stop it after
    # the second (or after 30 s, however slowly a busy machine starts it).
    watchdog = threading.Timer(30, proc.kill)
    watchdog.start()
    out = []
    views = 0
    try:
        while views < 2 and (line := proc.stdout.readline()):
            out.append(line)
            views += "busiest requests" in line
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert views >= 2, out  # a view every refresh


@pytest.mark.parametrize("command", ["top", "events"])
def test_ctrl_c_stops_kvctls_watching_commands_without_a_traceback(busy_kvd, command):
    # Both run until stopped, as top does; Ctrl-C stopped each with a traceback (events:
    # two, the second from the client library closing the stream under a read).
    proc = subprocess.Popen([KVCTL, "--target", busy_kvd.target, command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(30, proc.kill)
    watchdog.start()
    try:
        if command == "top":
            while (line := proc.stdout.readline()) and "busiest requests" not in line:
                pass
        else:
            assert "watching" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err


# Request ids any tenant may choose that rich's markup reads as its own: a closing tag
# (kvctl stopped with a traceback on every table listing it) and a link (shown as "xy").
MARKUP_IDS = ("[/]", "x[link=http://evil]y", "[bold red]ok[/bold red]")


def test_a_request_id_is_shown_as_written_whatever_it_looks_like(kvd):
    with Client(kvd.target, lease="") as client:
        for rid in MARKUP_IDS:
            client.admit(rid, 16, tenant="t1")
    for args in (("requests",), ("top", "--count", "1")):
        shown = kvctl(kvd.target, *args)
        assert shown.returncode == 0, shown.stderr
        assert all(rid in shown.stdout for rid in MARKUP_IDS), shown.stdout
    for rid in MARKUP_IDS:
        explained = kvctl(kvd.target, "explain", rid)
        assert explained.returncode == 0, explained.stderr
        assert explained.stdout.lstrip().startswith(rid), explained.stdout


def test_control_characters_from_kvd_reach_the_terminal_escaped():
    # kvd refuses ids and names with control characters, but kvctl may talk to a kvd that
    # took them (an older one), and an ESC written raw drives the operator's terminal: a
    # title set, the screen cleared, a line hidden.
    import io

    from kvd_client import pb
    from kvd_client.kvctl import Shown, explain_table, requests_table

    rid = "a\x1b]0;pwned\x07b\x1b[2J\u202ec"
    out = io.StringIO()
    console = Shown(file=out, width=200, force_terminal=True)
    console.print(requests_table([pb.RequestInfo(request_id=rid, tenant="t\x1b[8m")], "x"))
    console.print(explain_table(pb.ExplainResponse(request_id=rid, tenant="t")))
    text = out.getvalue()
    assert "\x07" not in text and "\u202e" not in text
    # Rich's own styles are ESC [ ... m; nothing else may start with an ESC.
    assert not re.search("\x1b(?!\\[[0-9;]*m)", text), repr(text)
    assert "\\x1b]0;pwned\\x07b\\x1b[2J\\u202ec" in text
    assert "t\\x1b[8m" in text


def test_json_gives_64_bit_integers_as_numbers_not_strings(busy_kvd):
    """protobuf's JSON mapping writes int64 and uint64 as strings; jq would compare them
    as text."""
    explain = json.loads(kvctl(busy_kvd.target, "explain", "a", "--json").stdout)
    assert type(explain["num_stalls"]) is int and type(explain["num_recomputes"]) is int
    assert explain["evictions_suffered"]
    assert all(type(e["count"]) is int for e in explain["evictions_suffered"])
    (link,) = json.loads(kvctl(busy_kvd.target, "--json", "links").stdout)
    assert type(link["bytes_total"]) is int and link["bytes_total"] > 0
    assert all(type(t["bytes"]) is int for t in link["tenants"])
    status = json.loads(kvctl(busy_kvd.target, "status", "--json").stdout)
    assert type(status["pools"][0]["num_evictions"]) is int


def test_set_quota_refuses_a_misspelt_tenant_and_takes_sizes_with_units(busy_kvd):
    typo = kvctl(busy_kvd.target, "set-quota", "t22", "--weight", "2")
    assert typo.returncode == 1 and "no tenant 't22' (known: t1, t2)" in typo.stderr
    tenants = json.loads(kvctl(busy_kvd.target, "tenants", "--json").stdout)
    assert "t22" not in {t["tenant"] for t in tenants}
    created = kvctl(busy_kvd.target, "set-quota", "t3", "--weight", "2", "--create")
    assert created.returncode == 0, created.stderr
    page = json.loads(kvctl(busy_kvd.target, "status", "--json").stdout)["pools"][0][
        "page_bytes"]
    sized = kvctl(busy_kvd.target, "--json", "set-quota", "t2", "--guaranteed", "3KiB",
                  "--limit", "1MiB", "--bandwidth-cap", "8GiB/s")
    assert sized.returncode == 0, sized.stderr
    (t2,) = json.loads(sized.stdout)
    assert t2["guaranteed_pages"] == -(-3 * 1024 // page)  # rounded up to whole pages
    assert t2["limit_pages"] == -(-(2**20) // page)
    assert t2["bandwidth_cap_bytes_per_s"] == 8 * 2**30
    bad = kvctl(busy_kvd.target, "set-quota", "t2", "--guaranteed", "8 gigs")
    assert bad.returncode == 2 and "e.g. 4096 pages, or 8GiB" in bad.stderr


def test_a_runtime_quota_outlives_a_reload_until_reset(tmp_path):
    import signal
    import time

    from kvd_loadgen.local import LocalKvd

    config = tmp_path / "kvd.toml"
    config.write_text('[[pool]]\nname = "default"\nmodel = "tiny"\ndevice_pages = 16\n'
                      'host_pages = 16\n[[tenant]]\nname = "chat"\nweight = 2\n')
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        def weight() -> float:
            tenants = json.loads(kvctl(kvd.target, "tenants", "--json").stdout)
            return next(t["weight"] for t in tenants if t["tenant"] == "chat")

        assert kvctl(kvd.target, "set-quota", "chat", "--weight", "5").returncode == 0
        kvd.proc.send_signal(signal.SIGHUP)
        for _ in range(100):
            if '"config reloaded"' in kvd.log():
                break
            time.sleep(0.05)
        assert '"runtime quota change kept over the config"' in kvd.log()
        assert weight() == 5.0  # the reload did not silently revert it
        reset = kvctl(kvd.target, "set-quota", "chat", "--reset")
        assert reset.returncode == 0, reset.stderr
        assert weight() == 2.0  # the config's again
        kvd.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert weight() == 2.0


def test_self_check(busy_kvd):
    checked = kvctl(busy_kvd.target, "self-check")
    assert checked.returncode == 0 and "sound" in checked.stdout
    assert json.loads(kvctl(busy_kvd.target, "self-check", "--json").stdout) == {"problems": []}


@pytest.mark.parametrize("args, says", [
    (["requests", "--limit", "-3"], "argument --limit: must be at least 1"),
    (["set-quota", "t1", "--max-request-pages", "-4"], "--max-request-pages: must be at least 0"),
    (["events", "--count", "-2"], "argument --count: must be at least 1"),
    (["top", "--count", "0"], "argument --count: must be at least 1"),
    (["--timeout-s", "0", "status"], "argument --timeout-s: must be more than 0"),
    (["top", "--interval-s", "-1", "--count", "1"], "argument --interval-s: must be"),
    # Polled kvd as fast as it answered: a walk of every request each time.
    (["top", "--interval-s", "1e-9", "--count", "1"],
     "argument --interval-s: must be at least 0.1"),
])
def test_a_bad_number_is_one_line_and_exit_2(kvd, args, says):
    """A negative --limit or page count reached protobuf as a traceback; a negative --count
    never stopped; a timeout of 0 read DEADLINE_EXCEEDED, as if kvd were slow."""
    out = kvctl(kvd.target, *args)
    assert out.returncode == 2, out
    assert says in out.stderr and "Traceback" not in out.stderr


def test_a_tls_file_or_socket_path_no_channel_can_use_is_one_line_and_exit_2(tmp_path):
    """A missing --tls-ca was a traceback; a file that holds no certificate went to grpc,
    whose every call then failed (UNAVAILABLE, or "cannot reach kvd" where nothing
    listened); a socket path longer than a socket's address holds was grpc's UNKNOWN,
    exit 1, as if kvd had refused."""
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    for args, says in (
            (["--tls-ca", str(tmp_path / "gone.pem")], f"cannot read tls_ca {tmp_path}/gone"),
            (["--tls-ca", str(tmp_path / "junk.pem")], "junk.pem holds no PEM certificate"),
            (["--tls-ca", "", "--tls-cert", str(tmp_path / "junk.pem"), "--tls-key",
              str(tmp_path / "junk.pem")], "are not a PEM certificate and the unencrypted")):
        out = kvctl("127.0.0.1:1", *args, "status")
        assert (out.returncode, out.stdout) == (2, ""), out
        assert out.stderr.startswith("kvctl: ") and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    path = f"/tmp/{'s' * 98}.sock"  # 108 bytes
    out = kvctl(f"unix://{path}", "status")
    assert out.returncode == 2 and "holds at most 107 bytes, this one is 108" in out.stderr, out
    for target in ("unix:///tmp/\udcff.sock", "h\udcffst:5000"):  # bytes that are not UTF-8
        out = kvctl(target, "status")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out
        assert "gRPC takes a target as UTF-8 text, and this one is not" in out.stderr, out
