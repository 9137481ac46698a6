"""What an operator deploys is checked here: the Kubernetes manifests against the API's own
schema (strict, a current version), the pod's promises (one GPU both containers share,
probes, hardening, memory that covers /dev/shm), the image's config, the Dockerfile
(hadolint), the Prometheus alert rules (promtool check and unit tests) and the Grafana
dashboard (every query parses and names a metric kvd exports)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvd.config import config_from_dict
from kvd_loadgen.local import LocalKvd
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.37"  # the newest the validator knows; DRA (resource.k8s.io/v1) is GA
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = ("no promtool: `make test` installs Debian's prometheus package where it runs "
               "as root with apt; elsewhere install it (it ships promtool)")


def _documents(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()))


def _pod() -> dict:
    (pod,) = [d for name in ("pod.yaml",) for d in _documents(name) if d["kind"] == "Pod"]
    return pod


@pytest.mark.parametrize("name", ["pod.yaml", "configmap.yaml"])
def test_the_manifests_are_valid_kubernetes_objects(name):
    for document in _documents(name):
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)


def test_the_validator_is_strict_enough_to_catch_a_misspelt_field():
    pod = copy.deepcopy(_pod())
    pod["spec"]["initContainers"][0]["securityContex"] = pod["spec"]["initContainers"][0].pop(
        "securityContext")
    with pytest.raises(kubernetes_validate.ValidationError, match="securityContex"):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_the_pod_runs_kvd_and_the_engine_on_one_shared_gpu():
    pod = _pod()
    spec = pod["spec"]
    (kvd,) = spec["initContainers"]
    (engine,) = spec["containers"]
    assert kvd["restartPolicy"] == "Always"  # a native sidecar: up before the engine
    # One claim, one device, named by both containers; no per-container device-plugin GPUs.
    (claim,) = spec["resourceClaims"]
    (template,) = [d for d in _documents("pod.yaml") if d["kind"] == "ResourceClaimTemplate"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["count"] == 1
    for container in (kvd, engine):
        assert container["resources"]["claims"] == [{"name": claim["name"]}]
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert spec["shareProcessNamespace"] is True  # CUDA IPC checks the peer's PID


def test_the_pod_is_hardened_and_probed():
    spec = _pod()["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in (*spec["initContainers"], *spec["containers"]):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["capabilities"] == {"drop": ["ALL"]}, container["name"]
    (kvd,) = spec["initContainers"]
    config = tomllib.loads((DEPLOY / "container.toml").read_text())
    health_port = int(config["server"]["health"].rsplit(":", 1)[1])
    metrics_port = int(config["server"]["metrics"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in kvd["ports"]}
    assert ports == {"metrics": metrics_port, "grpc-health": health_port}
    assert kvd["startupProbe"]["grpc"] == {"port": health_port}
    assert kvd["readinessProbe"]["grpc"] == {"port": health_port}
    assert kvd["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)?", quantity).groups()
    return int(number) * {"Gi": 2**30, "Mi": 2**20, None: 1}[unit]


def test_memory_limits_account_for_the_host_arena_in_dev_shm():
    """Memory-backed /dev/shm is RAM charged to the container that writes it: kvd's limit
    holds its host arena, and the volume's size limit holds it and the engine's share."""
    spec = _pod()["spec"]
    config = config_from_dict(tomllib.loads((DEPLOY / "container.toml").read_text()))
    pool = config.pools[0]
    arena = pool.host_pages * pool.resolved_page_bytes
    (kvd,) = spec["initContainers"]
    (engine,) = spec["containers"]
    for container in (kvd, engine):
        resources = container["resources"]
        assert resources["limits"]["memory"] == resources["requests"]["memory"]
    kvd_limit = _bytes(kvd["resources"]["limits"]["memory"])
    assert arena + 2 * 2**30 <= kvd_limit  # the arena and kvd's own few GiB
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    assert arena < _bytes(dshm["emptyDir"]["sizeLimit"])
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in (kvd, engine)}
    assert mounts["kvd"]["dshm"] == mounts["engine"]["dshm"] == "/dev/shm"
    assert mounts["kvd"]["kvd-run"] == mounts["engine"]["kvd-run"] == "/run/kvd"


def test_the_pod_and_the_image_run_the_same_config_and_kvd_accepts_it():
    (configmap,) = _documents("configmap.yaml")
    text = (DEPLOY / "container.toml").read_text()
    assert configmap["data"]["kvd.toml"] == text
    config = config_from_dict(tomllib.loads(text))
    assert config.socket == "/run/kvd/kvd.sock" and config.health and config.metrics
    assert "COPY deploy/container.toml /etc/kvd/kvd.toml" in (DEPLOY / "Dockerfile").read_text()


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).with_name(
        "hadolint"))
    result = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^USER \d+:\d+$", (DEPLOY / "Dockerfile").read_text(), re.M)


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_the_alert_rules_check_and_their_unit_tests_pass():
    rules = DEPLOY / "prometheus"
    check = subprocess.run([PROMTOOL, "check", "rules", "kvd-alerts.yml"], cwd=rules,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 9 rules found" in check.stdout
    tested = subprocess.run([PROMTOOL, "test", "rules", "kvd-alerts.test.yml"], cwd=rules,
                            capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


# ---------------------------------------------------------------- the names queries use

def _selectors(node) -> set[str]:
    """The metric names a PromQL expression's selectors name."""
    names = set()
    if type(node).__name__ == "VectorSelector" and node.name:
        names.add(node.name)
    for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attr, None)
        if child is not None:
            names |= _selectors(child)
    for arg in getattr(node, "args", None) or ():
        names |= _selectors(arg)
    return names


def _names(expr: str) -> set[str]:
    # Grafana's variables, as Grafana would fill them in.
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    return _selectors(promql_parser.parse(expr))


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every series name a running kvd exposes (families with no samples yet included)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # With an etcd, as a cluster member: its cluster series too.
    from tests.integration.test_cluster import ETCD, Etcd

    workdir = Path(tempfile.mkdtemp(prefix="kvd-exported-"))
    etcd = Etcd(workdir).start() if ETCD else None
    config = workdir / "kvd.toml"
    config.write_text('[[pool]]\nname = "default"\nmodel = "tiny"\ndevice_pages = 8\n'
                      'host_pages = 8\n' + (
                          f'[cluster]\netcd = "{etcd.address}"\nnode = "n"\n'
                          '[[tenant]]\nname = "t"\n[tenant.cluster]\nlimit = 4\n'
                          if etcd else ""))
    try:
        with LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}",
                      workdir=workdir):
            for _ in range(100):  # the cluster's series once it has a picture
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                              timeout=10).read()
                if not etcd or b"kvd_cluster_tenant_share_pages{" in text:
                    break
                time.sleep(0.05)
    finally:
        if etcd:
            etcd.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "info": ("_info",), "gauge": ("",), "summary": ("", "_sum", "_count")}
    for family in text_string_to_metric_families(text.decode()):
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names | {"up"}  # Prometheus's own, per scrape target


def test_the_python_walker_finds_every_selector():
    assert _names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="$y"}[5m]))) '
                  '/ on () group_left b + max(c) and -(d) + max_over_time(e[5m:1m])') == {
        "a_bucket", "b", "c", "d", "e"}


def test_every_dashboard_query_names_metrics_kvd_exports(exported):
    dashboard = json.loads((DEPLOY / "grafana" / "kvd-dashboard.json").read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            queries.append((panel["title"], target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*), \w+\)", variable["definition"]).group(1)
            queries.append((f"${variable['name']}", inner))
    assert len(queries) >= 25
    for title, expr in queries:
        names = _names(expr)
        assert names, (title, expr)
        if "kvd_cluster_nodes" not in exported:  # no etcd here: no cluster series to compare
            names = {n for n in names if not n.startswith("kvd_cluster_")}
        assert names <= exported, (title, names - exported)
    titles = " / ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("fair share", "evictions by victim and cause", "stall", "link utilisation",
                  "admission queue", "working set"):
        assert topic in titles, topic


def test_every_alert_names_metrics_kvd_exports(exported):
    rules = yaml.safe_load((DEPLOY / "prometheus" / "kvd-alerts.yml").read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert {"KvdDown", "KvdTenantGuaranteeStarved", "KvdStallP99High", "KvdLeaseReaps",
            "KvdSelfCheckFailing", "KvdEventLoopLagging"} <= set(alerts)
    for alert, expr in alerts.items():
        names = _names(expr)
        assert names, (alert, expr)
        if "kvd_cluster_nodes" not in exported:  # no etcd here: no cluster series to compare
            names = {n for n in names if not n.startswith("kvd_cluster_")}
        assert names <= exported, (alert, names - exported)


def test_every_metric_kvd_exports_is_documented(exported):
    table = (DEPLOY / "README.md").read_text().split("## Metrics", 1)[1]
    documented = set(re.findall(r"^\| `([a-z_]+)", table, re.M))
    ours = {n for n in exported if n.startswith("kvd_")}
    bases = {re.sub(r"_(bucket|sum|count)$", "", n) for n in ours}
    missing = {n for n in bases if n not in documented and n + "_total" not in documented
               and n.removesuffix("_total") not in documented}
    assert not missing, sorted(missing)
    unexported = {n for n in documented if n.startswith("kvd_")} - bases - {
        n + "_total" for n in bases}
    if "kvd_cluster_nodes" not in ours:  # no etcd here: no cluster series to compare
        unexported = {n for n in unexported if not n.startswith("kvd_cluster_")}
    assert not unexported, "documented but not exported"
