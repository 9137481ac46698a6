"""kvctl, the real command, against a running kvd: tables, --json, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "host-standin" in status.stdout and "lru" in status.stdout
    data = json.loads(kvctl(busy_kvd.target, "status", "--json").stdout)
    (pool,) = data["pools"]
    assert [t["used_pages"] for t in pool["tiers"]] == [8, 4]
    assert data["version"] and data["uptime_s"] > 0
    tenants = json.loads(kvctl(busy_kvd.target, "tenants", "--json").stdout)
    by_name = {t["tenant"]: t for t in tenants}
    assert by_name["t1"]["reserved_pages"] == 8 and by_name["t2"]["reserved_pages"] == 4
    table = kvctl(busy_kvd.target, "tenants").stdout
    assert "t1" in table and "fair share" in table


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
    assert explain["tenant"] == "t1" and int(explain["num_stalls"]) == 1  # uint64: a string
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
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=3)  # it runs until stopped, as top does
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert out.count("busiest requests") >= 2, out  # a view every refresh
