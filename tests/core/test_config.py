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
    ({"link": [{"source": "default"}]}, "source and target"),
    ({"link": [{"source": "a", "target": "b", "speed": 1}]}, "unknown"),
    ({"pool": [{"link_scheduling": "lottery"}]}, "fair or fifo"),
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
