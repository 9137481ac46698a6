"""Any config an operator may write: kvd takes it, or says what is wrong in one line; and a
running kvd reloading any file either applies its tenants or keeps what it runs, never
stops half-way. (In process: the config loader and the daemon's reload, over a node of
small arenas; the subprocess tests in test_startup show the one line reaching stderr.)"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvd.config import (
    AuthConfig,
    ClusterConfig,
    Config,
    EngineEventsConfig,
    LinkConfig,
    PeerConfig,
    PoolConfig,
    TenantConfig,
    config_from_dict,
)
from kvd.core.errors import InvalidArgument
from kvd.daemon import (Daemon, StartupError, check_gpu_memory, check_page_tables,
                        check_shared_memory)
from kvd.node import Node
from kvd.service.auth import Authenticator

EXAMPLES = int(os.environ.get("KVD_CONFIG_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture])


def keys(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# What TOML can hold: numbers of any size, floats (nan and inf too), booleans, strings
# (sizes, names, addresses, junk), dates and times, and arrays and tables of them.
SCALARS = (st.integers(-3, 10) | st.integers(-2**70, 2**70)
           | st.sampled_from([2**32, 2**63, 2**64])
           | st.floats(allow_nan=True, allow_infinity=True) | st.booleans()
           | st.sampled_from([5e-324, 1e-300, 1e-9, 1e300, 1.7e308])  # the edges of a double
           | st.sampled_from(["", "auto", "1GiB", "0.5", "-1", "1e309", "nan", "10MiB/s",
                              "0MiB/s", "lru", "fair", "fifo", "tiny", "default", "decode", "a",
                              "127.0.0.1:0", "x" * 300, "100TiB", "\x00"])
           | st.text(max_size=4)
           | st.sampled_from([datetime.date(2026, 1, 1), datetime.time(1, 2),
                              datetime.datetime(2026, 1, 1)]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["default", "decode", "limit", "weight", "guaranteed", "x"]), inner,
    max_size=3), max_leaves=6)
SERVER_KEYS = [k for k in keys(Config) if k not in (
    "pools", "tenants", "links", "engines", "auth", "path", "cluster", "peers")]


def table(cls, extra: tuple[str, ...] = ()):
    return st.dictionaries(st.sampled_from([*keys(cls), *extra, "typo"]), VALUES, max_size=5)


DOCUMENTS = st.fixed_dictionaries({}, optional={
    "server": table(Config).map(lambda t: {k: v for k, v in t.items() if k in SERVER_KEYS}),
    "pool": st.lists(table(PoolConfig), max_size=3) | VALUES,
    "tenant": st.lists(table(TenantConfig, ("token_env", "token_file")), max_size=3),
    "link": st.lists(table(LinkConfig), max_size=2),
    "engine": st.lists(table(EngineEventsConfig), max_size=2),
    "peer": st.lists(table(PeerConfig), max_size=2),
    "auth": table(AuthConfig, ("admin_token_env",)),
    "bogus": VALUES,
})

# Mostly quotas a pool can hold; now and then one past what kvd counts in some pool's pages.
SMALL_QUOTA = st.sampled_from([0, 1, 4, "4KiB", "1MiB"])
BIG_QUOTA = st.sampled_from([2**31, "5TiB", "100TiB"])
QUOTA = st.one_of(SMALL_QUOTA, SMALL_QUOTA, SMALL_QUOTA, BIG_QUOTA)
PAGE_BYTES = st.sampled_from([1024, 4096, 2**20, 2**24])
POOL = st.fixed_dictionaries(
    {"name": st.sampled_from(["default", "decode"]), "model": st.just("tiny"),
     "device_pages": st.integers(1, 16), "host_pages": st.integers(0, 16),
     "link_bandwidth": st.just("1GiB/s")},
    optional={"policy": st.sampled_from(["lru", "fair", "intent", "fair:deadline"]),
              "page_bytes": PAGE_BYTES,
              "admission": st.sampled_from(["working_set", "reservation"])})


def quota_table(quota) -> st.SearchStrategy:
    """A quota's table: a tenant's override in one pool, or its quota over the cluster."""
    return st.fixed_dictionaries({}, optional={
        "limit": quota, "guaranteed": quota, "weight": st.sampled_from([0.5, 2])})


# Over a cluster, big ones more often: the local quotas must let the config through first.
CLUSTER_QUOTA = quota_table(SMALL_QUOTA | BIG_QUOTA)


def tenant_table(quota) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"name": st.sampled_from(["a", "b", "c"])},
        optional={"weight": st.sampled_from([0.5, 1, 3]), "guaranteed": quota,
                  "limit": quota, "max_request_pages": st.integers(0, 10),
                  "max_request_fraction": st.sampled_from([0, 0.5, 1]),
                  "pools": st.dictionaries(st.sampled_from(["default", "decode"]),
                                           quota_table(quota), max_size=2)})


TENANT = tenant_table(QUOTA)
# In an edited file, big ones more often: they are what may fit its pools and not kvd's.
EDITED_TENANT = tenant_table(SMALL_QUOTA | BIG_QUOTA)


@st.composite
def near_valid(draw, wild: bool = True) -> dict:
    """A config an operator may well write: pools, tenants, a link, and now and then a
    value or two gone wild."""
    return draw(near_valid_with_wild(wild))[0]


@st.composite
def near_valid_with_wild(draw, wild: bool = True, least: int = 0
                         ) -> tuple[dict, list[tuple]]:
    """near_valid(), and its values gone wild: (section, index, key, value) each."""
    doc = {"pool": draw(st.lists(POOL, min_size=1, max_size=2, unique_by=lambda p: p["name"])),
           "tenant": draw(st.lists(TENANT, max_size=3, unique_by=lambda t: t["name"]))}
    if draw(st.booleans()):  # quotas over a cluster of kvds too
        doc["cluster"] = {"etcd": "127.0.0.1:2379"}
        for tenant in doc["tenant"]:
            tenant["cluster"] = draw(CLUSTER_QUOTA)
    if len(doc["pool"]) == 2 and draw(st.booleans()):
        doc["link"] = [{"source": doc["pool"][0]["name"], "target": doc["pool"][1]["name"],
                        "bandwidth": "1GiB/s"}]
    if draw(st.booleans()):  # an engine whose KV events kvd follows
        doc["engine"] = [{"name": "e", "endpoint": "tcp://127.0.0.1:5557"}]
    changed = {}
    for _ in range(draw(st.integers(least, 2)) if wild else 0):
        section = draw(st.sampled_from(sorted(WILD)))
        cls, keys_of = WILD[section]
        value = draw(VALUES | CONFUSERS)
        key = draw(st.sampled_from(keys_of))
        if cls is None:  # a table of its own
            doc.setdefault(section, {})[key] = value
            changed[(section, 0, key)] = value
        elif doc.get(section):
            index = draw(st.integers(0, len(doc[section]) - 1))
            doc[section][index][key] = value
            changed[(section, index, key)] = value
    return doc, [(*where, value) for where, value in changed.items()]


# Where near_valid() puts a wild value: lists of tables (their class), and tables (None).
WILD = {"pool": (PoolConfig, keys(PoolConfig)), "tenant": (TenantConfig, keys(TenantConfig)),
        "link": (LinkConfig, keys(LinkConfig)), "engine": (EngineEventsConfig,
                                                            keys(EngineEventsConfig)),
        "server": (None, SERVER_KEYS), "auth": (None, keys(AuthConfig)),
        "cluster": (None, keys(ClusterConfig))}


def _one_line_or_config(doc: dict) -> Config | None:
    try:
        return config_from_dict(doc)
    except InvalidArgument as exc:
        assert str(exc) and "\n" not in str(exc), repr(str(exc))
        return None


@SETTINGS
@given(DOCUMENTS | near_valid() | near_valid(wild=False))
def test_any_config_document_is_taken_or_refused_in_one_line(doc):
    config = _one_line_or_config(doc)
    event("taken" if config else "refused")
    if config is None:
        return
    config.validate()
    # What kvd then makes of it in every pool, locally and over the cluster.
    for pool in config.pools:
        for tenant in config.tenants:
            quota = tenant.quota_for(pool.name, pool.resolved_page_bytes)
            assert quota.limit is None or quota.guaranteed <= quota.limit
            cluster = tenant.cluster_quota(pool.resolved_page_bytes)
            assert cluster is None or cluster.limit is None or (
                cluster.guaranteed <= cluster.limit)


@settings(SETTINGS, max_examples=max(1, EXAMPLES // 3))
@given(near_valid_with_wild(least=1))
@example(({"pool": [{"name": "default", "model": "tiny", "device_pages": 4, "host_pages": 4,
                     "link_bandwidth": "1GiB/s", "link_aging_ms": 5e-324}]},
          [("pool", 0, "link_aging_ms", 5e-324)]))
def test_a_config_kvd_takes_it_can_run(case):
    # A value the config takes must be one kvd's parts can run with: a link's aging step
    # of 5e-324 ms was taken, came to 0 s, and kvd's start stopped with a traceback.
    doc, _ = case
    config = _one_line_or_config(doc)
    if config is None:
        return
    config = dataclasses.replace(config, socket="", tcp="127.0.0.1:0", metrics="")
    try:  # kvd's checks before it builds its node: what they refuse never runs
        for check in (check_shared_memory, check_gpu_memory, check_page_tables):
            check(config)
    except StartupError as exc:
        assert "\n" not in str(exc)
        return

    async def run() -> None:
        node = Node(config)
        await node.aclose()

    asyncio.run(run())


# Values a lax reader takes for another kind: a flag for a number, a word for a flag, a
# number in a string for a number.
CONFUSERS = st.sampled_from([True, False, 0, 1, "no", "yes", "true", "off", "0", "10", "0.5"])


def _number_like(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@settings(SETTINGS, max_examples=EXAMPLES * 4)  # cheap, and each example tries one or two
@given(near_valid_with_wild(least=1))
def test_a_value_kvd_takes_is_taken_as_what_it_is(case):
    # A value of the wrong kind is refused, never read as another: "no" is not false, 0
    # is not false, true is not one byte, "0.5" is not a half.
    doc, wild = case
    config = _one_line_or_config(doc)
    if config is None:
        return
    for section, index, key, value in wild:
        entry = {"server": config, "auth": config.auth, "cluster": config.cluster}.get(
            section) or getattr(config, {"pool": "pools", "tenant": "tenants", "link": "links",
                                         "engine": "engines"}[section])[index]
        stored = getattr(entry, key)
        what = f"{section} {key} = {value!r} taken as {stored!r}"
        assert isinstance(stored, bool) == isinstance(value, bool), what
        if isinstance(value, str) and _number_like(value):
            assert not isinstance(stored, (int, float)), what


def _toml(doc: dict) -> str:
    """The document as TOML (the few kinds of values near_valid() writes without wild ones)."""
    def value(v):
        if isinstance(v, str):
            return '"' + v + '"'
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        return repr(v)

    lines = []
    if "cluster" in doc:
        lines += ["[cluster]", *(f"{k} = {value(v)}" for k, v in doc["cluster"].items())]
    for section in ("pool", "tenant", "link"):
        for entry in doc.get(section, []):
            lines.append(f"[[{section}]]")
            lines += [f"{k} = {value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


@st.composite
def edited(draw) -> tuple[dict, dict]:
    """A running config, and the file an operator then edits it into: other tenants, and
    now and then a pool changed (which takes a restart), added or gone."""
    running = draw(near_valid(wild=False))
    # Its pools with their page sizes drawn again (the same or not), or, one time in
    # four, other pools.
    pools = [{**p, "page_bytes": draw(PAGE_BYTES)} for p in running["pool"]]
    if draw(st.integers(0, 3)) == 0:
        pools = draw(st.lists(POOL, min_size=1, max_size=2, unique_by=lambda p: p["name"]))
    file = {"pool": pools, "tenant": draw(st.lists(EDITED_TENANT, max_size=3,
                                                   unique_by=lambda t: t["name"]))}
    if "cluster" in running:
        file["cluster"] = running["cluster"]
        for tenant in file["tenant"]:
            tenant["cluster"] = draw(CLUSTER_QUOTA)
    return running, file


@SETTINGS
@given(edit=edited())
def test_a_reload_applies_the_files_tenants_or_keeps_the_running_ones(tmp_path, edit):
    running, file = edit
    config = _one_line_or_config(running)
    if config is None:
        return
    path = tmp_path / "kvd.toml"  # the file the running config came from, as load_config says
    config = dataclasses.replace(config, path=str(path), socket="", tcp="127.0.0.1:0",
                                 metrics="")

    async def reload() -> None:
        daemon = Daemon(config)
        daemon.node = Node(config)
        daemon.auth = Authenticator(config, daemon.node.leases)
        try:
            before = _quotas(daemon.node)
            path.write_text(_toml(file))
            daemon.reload()  # never raises: applied, or refused and logged
            if daemon.config is config:  # refused: nothing changed
                event("kept")
                assert _quotas(daemon.node) == before
            else:
                event("applied")
                fresh = config_from_dict(file)
                assert daemon.config.tenants == fresh.tenants
                for tenant in fresh.tenants:
                    for name, rt in daemon.node.pools.items():
                        assert rt.pool.tenancy.quota(tenant.name) == tenant.quota_for(
                            name, rt.pool.page_bytes)
        finally:
            await daemon.node.aclose()

    asyncio.run(reload())


def _quotas(node: Node) -> dict:
    return {name: dict(rt.pool.tenancy.quotas) for name, rt in node.pools.items()}
