"""kvd installed from its wheel, as `pip install .` and the container image install it (not
editable, no checkout beside it), carries what it reads at run time: the load generator's
traces and kvd.v1's .proto (for clients in other languages, and the generated code's check)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json
from kvd_loadgen.data import data_dir, resolve_intent_trace
from kvd_loadgen.request_trace import read_request_trace
from kvd_api.generate import PROTO_FILE, PROTO_ROOT, stale_files
import kvd_loadgen
traces = data_dir()
requests = read_request_trace(traces / "request-traces" / "sample_request_trace.jsonl")
print(json.dumps({
    "package": kvd_loadgen.__file__,
    "traces": str(traces),
    "files": sorted(str(p.relative_to(traces)) for p in traces.rglob("*") if p.is_file()),
    "profile": str(resolve_intent_trace("balanced")),
    "requests": len(requests),
    "proto": (PROTO_ROOT / PROTO_FILE).is_file(),
    "stale": stale_files(),
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from this checkout's sources and unpacked into a folder of its own. Built
    from a copy: setuptools builds in the source tree, and leaves its build/ there."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for part in ("proto", "server", "clients", "loadgen"):
        shutil.copytree(ROOT / part, source / part, ignore=junk)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp / "dist"), str(source)],
        capture_output=True, text=True, cwd=tmp, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp / "dist").glob("kvd-*.whl")
    target = tmp / "site"
    unpacked = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert unpacked.returncode == 0, unpacked.stderr
    return target


def test_the_installed_package_finds_its_traces_and_its_proto(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVD_DATA_DIR"}
    env["PYTHONPATH"] = str(installed)  # before the checkout's editable install
    # From a folder with no shared/ above it, so only the installed copy can answer.
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr.strip().splitlines()[-1:]
    found = json.loads(probe.stdout)
    assert found["package"].startswith(str(installed))
    assert found["traces"].startswith(str(installed))
    committed = ROOT / "loadgen" / "kvd_loadgen" / "traces"
    assert found["files"] == sorted(str(p.relative_to(committed))
                                    for p in committed.rglob("*") if p.is_file())
    assert found["profile"].startswith(found["traces"])
    assert found["requests"] > 0
    assert found["proto"] and found["stale"] == []
