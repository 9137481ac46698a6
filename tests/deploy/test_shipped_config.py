"""The shipped config runs as written: its token files are created at first start (beside
the config, or in systemd's StateDirectory when the config's directory is read-only), kept
at the next start, and work for the callers they name; tokens may come from the
environment instead (a Kubernetes Secret)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvd_client import Client, PermissionDeniedError
from kvd_loadgen.local import LocalKvd
from tests.conftest import ROOT

SHIPPED = ROOT / "deploy" / "kvd.toml"
# The shipped pools describe an 80 GB GPU node; the flags size the first pool to this machine.
SMALL = ("--device-pages", "32", "--host-pages", "64")
KVCTL = str(Path(sys.executable).with_name("kvctl"))


def _kvctl(kvd: LocalKvd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVCTL, "--target", kvd.target, *args], capture_output=True,
                          text=True, timeout=60)


def test_the_shipped_config_starts_as_written_and_creates_its_tokens(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    config = etc / "kvd.toml"
    shutil.copy(SHIPPED, config)
    with LocalKvd("--config", str(config), *SMALL, workdir=tmp_path) as kvd:
        tokens = {name: (etc / f"{name}.token") for name in ("chat", "rag", "admin")}
        for name, path in tokens.items():
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o600 if name == "admin" else 0o640), (name, oct(mode))
            assert len(path.read_text().strip()) >= 43
        first = {name: path.read_text() for name, path in tokens.items()}
        assert '"created a token file at first start' in kvd.log()
        # Each token names its caller: chat's admits as chat; admin's reads every tenant.
        with Client(kvd.target, token=first["chat"].strip()) as chat:
            chat.admit("r", 16)
            with pytest.raises(PermissionDeniedError):
                chat.list_tenants()
        listed = _kvctl(kvd, "--token-file", str(tokens["admin"]), "--json", "tenants")
        assert listed.returncode == 0, listed.stderr
        assert {"chat", "rag"} <= {t["tenant"] for t in __import__("json").loads(listed.stdout)}
    with LocalKvd("--config", str(config), *SMALL, workdir=tmp_path) as kvd:
        assert {name: path.read_text() for name, path in tokens.items()} == first


def test_where_the_config_directory_refuses_new_tokens_they_go_to_the_state_directory(
        tmp_path):
    """Under systemd /etc/kvd is read-only (ProtectSystem=strict) and StateDirectory=kvd is
    kvd's own. Here "tokens" beside the config is a file, so nothing can be created under it
    (as root too)."""
    etc, state = tmp_path / "etc", tmp_path / "state"
    etc.mkdir()
    state.mkdir()
    (etc / "tokens").write_text("not a directory")
    (etc / "kvd.toml").write_text('[auth]\nunix_tenant = ""\n'
                                  'admin_token_file = "tokens/admin.token"\n'
                                  '[[tenant]]\nname = "chat"\ntoken_file = "tokens/chat.token"\n')
    argv = [sys.executable, "-m", "kvd", "--config", str(etc / "kvd.toml"), "--model", "tiny",
            "--device-pages", "8", "--host-pages", "8", "--socket", str(tmp_path / "k.sock"),
            "--metrics", ""]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "STATE_DIRECTORY"})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "[[tenant]] 'chat': token_file" in refused.stderr
    assert "does not exist and kvd cannot create it" in refused.stderr
    with LocalKvd("--config", str(etc / "kvd.toml"), "--model", "tiny", "--device-pages", "8",
                  "--host-pages", "8", workdir=tmp_path, env={"STATE_DIRECTORY": str(state)}):
        token = (state / "tokens" / "chat.token").read_text()
    # The next start finds it there, and keeps it.
    with LocalKvd("--config", str(etc / "kvd.toml"), "--model", "tiny", "--device-pages", "8",
                  "--host-pages", "8", workdir=tmp_path, env={"STATE_DIRECTORY": str(state)}):
        assert (state / "tokens" / "chat.token").read_text() == token


def test_tokens_from_the_environment(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text('[auth]\nunix_tenant = ""\nadmin_token_env = "KVD_ADMIN_TOKEN"\n'
                      '[[tenant]]\nname = "chat"\ntoken_env = "KVD_CHAT_TOKEN"\n')
    env = {"KVD_ADMIN_TOKEN": "admin-secret-0123456789", "KVD_CHAT_TOKEN": "chat-secret-0123"}
    with LocalKvd("--config", str(config), "--model", "tiny", "--device-pages", "8",
                  "--host-pages", "8", workdir=tmp_path, env=env) as kvd:
        with Client(kvd.target, token="chat-secret-0123") as chat:
            chat.admit("r", 16)
        assert _kvctl(kvd, "--token", "admin-secret-0123456789", "tenants").returncode == 0
    unset = subprocess.run([sys.executable, "-m", "kvd", "--config", str(config)],
                           capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")})
    assert unset.returncode == 2 and "Traceback" not in unset.stderr
    assert "[[tenant]] 'chat': token_env: the environment variable KVD_CHAT_TOKEN is not " \
        "set" in unset.stderr
