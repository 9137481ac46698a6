"""Config: sizes and rates with units, links, bandwidth quotas, and the shipped example."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvd.config import bytes_of, config_from_dict, load_config
from kvd.core.errors import InvalidArgument

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kvd.toml"


def test_bytes_of_units_and_rates():
    assert bytes_of(4096) == 4096
    assert bytes_of("200MiB/s") == 200 * 2**20
    assert bytes_of("1.5GB") == 1.5e9
    assert bytes_of("64 KiB / s") == 64 * 1024
    for bad in ("fast", "12 parsecs", -1, True, None):
        with pytest.raises(InvalidArgument):
            bytes_of(bad)


def test_links_and_bandwidth_quotas():
    config = config_from_dict({
        "pool": [{"name": "prefill", "model": "tiny", "link_bandwidth": "1GiB/s"},
                 {"name": "decode", "model": "tiny", "link_scheduling": "fifo"}],
        "link": [{"source": "prefill", "target": "decode", "bandwidth": "100MiB/s"}],
        "tenant": [{"name": "a", "bandwidth_cap": "10MiB/s", "read_budget": 1000,
                    "pools": {"decode": {"bandwidth_cap": "20MiB/s"}}}],
    })
    assert config.links[0].bandwidth == "100MiB/s"
    a = config.tenants[0]
    assert a.quota_for("prefill", 16384).bandwidth_cap == 10 * 2**20
    assert a.quota_for("decode", 16384).bandwidth_cap == 20 * 2**20
    assert a.quota_for("decode", 16384).read_budget == 1000
    assert a.quota_for("decode", 16384).request_bandwidth_cap is None


@pytest.mark.parametrize("data, message", [
    ({"link": [{"source": "default", "target": "nowhere"}]}, "no pool 'nowhere'"),
    ({"link": [{"source": "default", "target": "default"}]}, "joins two pools"),
    ({"link": [{"source": "default"}]}, r"\[\[link\]\] #1 target: Field required"),
    ({"link": [{"source": "a", "target": "b", "speed": 1}]}, "unknown"),
    ({"pool": [{"link_scheduling": "lottery"}]}, "'fair' or 'fifo'"),
    ({"pool": [{"link_bandwidth": "0MiB/s"}]}, "positive"),
    ({"pool": [{"link_aging_ms": 0}]}, "aging"),
    ({"server": {"handoff_ttl_s": 0}}, "handoff_ttl_s"),
    ({"tenant": [{"name": "a", "read_budget": "lots"}]}, "cannot read"),
])
def test_bad_link_config_is_refused(data, message):
    with pytest.raises(InvalidArgument, match=message):
        config_from_dict(data)


def test_the_shipped_example_config_loads(tmp_path):
    shutil.copy(DEPLOY, tmp_path / "kvd.toml")
    for name in ("admin", "chat", "rag"):
        (tmp_path / f"{name}.token").write_text(f"{name}-token\n")
    config = load_config(tmp_path / "kvd.toml")
    assert config.pools[0].link_scheduling == "fair"
    rag = next(t for t in config.tenants if t.name == "rag")
    assert rag.quota_for("default", config.pools[0].resolved_page_bytes).bandwidth_cap == 8 * 2**30


@pytest.mark.parametrize("data, message", [
    # Wrong types: one line naming the key, never a traceback.
    ({"server": {"lease_ttl_s": "30"}}, r"\[server\] lease_ttl_s: Input should be a valid number"),
    ({"server": {"workers": "2"}}, r"\[server\] workers: Input should be a valid integer"),
    ({"server": {"log_level": "verbose"}}, r"\[server\] log_level: Input should be 'debug'"),
    ({"server": {"eviction_ledger": -1}}, "eviction_ledger: Input should be greater than or"),
    ({"server": {"grace_s": "10s"}}, r"grace_s: Input should be a valid number \(got '10s'\)"),
    ({"tenant": [{"name": "a", "weight": "3"}]}, r"\[\[tenant\]\] #1 weight: Input should be"),
    # Nonsense that used to be accepted.
    ({"server": {"grace_s": -1}}, "grace_s: Input should be greater than or equal to 0"),
    ({"server": {"lease_ttl_s": 0}}, "lease_ttl_s: Input should be greater than 0"),
    ({"server": {"socket_mode": 660}}, "not a file mode; write it in octal"),
    ({"server": {"tcp": "0.0.0.0"}}, "not HOST:PORT"),
    ({"server": {"metrics": "127.0.0.1:99999"}}, "not HOST:PORT"),
    ({"tenant": [{"name": "a", "guaranteed": 64, "limit": 32}]}, "guaranteed .* above limit"),
    ({"tenant": [{"name": "a", "weight": float("nan")}]}, "finite number"),
    # Weights kvd's shares cannot be computed with (they overflowed or lost the others).
    ({"tenant": [{"name": "a", "weight": 1e308}]}, "weight: Input should be less than or"),
    ({"tenant": [{"name": "a", "weight": 1e-9}]}, "weight: Input should be greater than or"),
    ({"tenant": [{"name": "a", "cluster": {"weight": 1e7}}]}, "cluster.weight: Input should"),
    # An aging step that came to 0 s and stopped kvd's start with a traceback.
    ({"pool": [{"name": "p", "link_aging_ms": 5e-324}]}, "link_aging_ms: Input should be"),
    ({"tenant": [{"name": "a", "bandwidth_cap": float("inf")}]}, "finite number"),
    ({"tenant": [{"name": "a", "pools": {"default": {"wieght": 2}}}]}, "default.wieght: unknown"),
    ({"pool": [{"name": "a b"}]}, r"\[\[pool\]\] #1 name: String should match"),
    ({"pool": []}, "at least one"),
    ({"pool": {"name": "x"}}, "list of tables"),
    ({"server": {"pools": []}}, "unknown"),
    ({"server": {"tcp": "127.0.0.1:1", "tls_cert": "c.pem"}}, "go together"),
    ({"server": {"tls_cert": "c.pem", "tls_key": "k.pem"}}, "set tcp too"),
    ({"server": {"tcp": "127.0.0.1:1", "tls_client_ca": "ca.pem"}}, "needs tls_cert"),
    ({"server": {"allow_plaintext_tokens": "yes"}}, "allow_plaintext_tokens: Input should"),
    # Socket paths no socket can be bound at (kvd's start ended in a traceback, or in
    # grpc's "cannot listen" with no word of why).
    ({"server": {"socket": "/run/kvd/a\0b.sock"}}, "socket: a path may not hold a NUL"),
    ({"server": {"socket": "/run/" + "k" * 98 + ".sock"}}, "at most 107 bytes, this one is 108"),
    ({"peer": [{"name": "p", "address": "10.0.0.2:7000", "tls_cert": "c.pem",
                "tls_key": "k.pem"}]}, "peer 'p': tls_cert and tls_key are for TLS: set tls_ca"),
    # Values of another type that kvd read as something else ("no" as true or false, "10"
    # as ten seconds, true as one byte a second) are refused as the others are.
    ({"engine": [{"name": "e", "endpoint": "tcp://127.0.0.1:5557", "bind": "no"}]},
     r"\[\[engine\]\] #1 bind: Input should be a valid boolean \(got 'no'\)"),
    ({"tenant": [{"name": "a", "share_prefixes": "no"}]},
     r"\[\[tenant\]\] #1 share_prefixes: Input should be a valid boolean"),
    ({"cluster": {"etcd": "127.0.0.1:2379", "lease_ttl_s": "10"}},
     r"\[cluster\] lease_ttl_s: Input should be a valid number \(got '10'\)"),
    ({"cluster": {"etcd": "127.0.0.1:2379", "reconcile_s": True}},
     r"\[cluster\] reconcile_s: Input should be a valid number \(got True\)"),
    ({"tenant": [{"name": "a", "bandwidth_cap": True}]},
     r"bandwidth_cap.int: Input should be a valid integer \(got True\)"),
    ({"pool": [{"name": "a"}, {"name": "b"}],
      "link": [{"source": "a", "target": "b", "burst": True}]},
     r"\[\[link\]\] #1 burst.int: Input should be a valid integer \(got True\)"),
    # Quotas of more pages than kvd reports (uint32 in the API): every tenant listing and
    # pool's stats would fail.
    ({"tenant": [{"name": "a", "guaranteed": 2**32}]},
     "tenant 'a', pool 'default': a quota of 4294967296 pages: at most 4294967295"),
    ({"pool": [{"name": "default", "page_bytes": 4096}],
      "tenant": [{"name": "a", "pools": {"default": {"limit": "100TiB"}}}]},
     "a quota of 100TiB is 26843545600 pages of 4096 bytes: at most 4294967295"),
    ({"tenant": [{"name": "a", "max_request_pages": 2**32}]},
     "max_request_pages: Input should be less than or equal to 4294967295"),
    # A cluster quota is pages of each pool too, checked as the local one is (kvd took
    # these, and then failed applying the cluster's picture at every reconcile).
    ({"pool": [{"name": "default", "page_bytes": 4096}], "cluster": {"etcd": "127.0.0.1:2379"},
      "tenant": [{"name": "a", "cluster": {"limit": "100TiB"}}]},
     r"tenant 'a', pool 'default': \[tenant.cluster\] a quota of 100TiB is 26843545600 pages"),
    ({"cluster": {"etcd": "127.0.0.1:2379"},
      "tenant": [{"name": "a", "cluster": {"guaranteed": 10, "limit": 4}}]},
     r"tenant 'a', pool 'default': \[tenant.cluster\] guaranteed \(10 pages\) is above "
     r"limit \(4 pages\)"),
])
def test_bad_values_are_one_line_naming_the_key(data, message):
    with pytest.raises(InvalidArgument, match=message) as err:
        config_from_dict(data)
    assert "\n" not in str(err.value)


def test_sizes_and_modes_in_their_own_units_are_accepted():
    config = config_from_dict({
        "server": {"socket_mode": 0o600, "tcp": "127.0.0.1:0", "grace_s": 0},
        "tenant": [{"name": "a", "guaranteed": "1MiB", "limit": 512, "weight": 2}],
    })
    assert config.socket_mode == 0o600 and config.tenants[0].weight == 2.0
