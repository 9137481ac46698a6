"""`kvd-loadgen demo` under every policy and device size: every byte the engine wrote comes
back, whatever kvd moved meanwhile. (Under `fair`, the refill of its free reserve once
demoted blocks an engine had been handed but not yet written: they came back as zeros.)"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvd.core.policies import policy_names
from kvd_client import AsyncClient
from kvd_loadgen.demo import run_demo
from kvd_loadgen.local import LocalKvd

SIZES = (64, 128, 256, 512, 1024)


@pytest.mark.parametrize("device_pages", SIZES)
async def test_demo_keeps_bytes_intact_under_every_policy(tmp_path, device_pages):
    # One kvd per size; the policies take turns in it (the demo releases what it admitted).
    with LocalKvd("--model", "tiny", "--block-tokens", "16",
                  "--device-pages", str(device_pages), "--host-pages", str(4 * device_pages),
                  "--admission", "reservation", workdir=tmp_path) as kvd:
        for policy in policy_names():
            async with AsyncClient(kvd.target, timeout_s=30) as admin:
                await admin.set_policy(policy)
            summary = await run_demo(kvd.target, console=Console(file=io.StringIO()))
            assert summary["policy"].startswith(policy.split(":")[0])
            assert summary["evictions"] > 0, "the demo put no pressure on the device tier"
            assert summary["all_intact"], f"{policy} at {device_pages} pages lost bytes"
        async with AsyncClient(kvd.target, timeout_s=30) as admin:
            assert (await admin.self_check()).ok


@pytest.mark.parametrize("policy", ["lru", "fair"])
async def test_under_working_set_admission_the_demo_waits_instead_of_paging(tmp_path, policy):
    """kvd's default: half the demo's requests wait for room with kvd's reason and run when
    the first ones end; nothing pages, every byte comes back."""
    with LocalKvd("--model", "tiny", "--block-tokens", "16", "--device-pages", "64",
                  "--host-pages", "256", "--policy", policy, workdir=tmp_path) as kvd:
        out = io.StringIO()
        summary = await run_demo(kvd.target, console=Console(file=out, width=200))
        assert summary["admission"] == "working_set"
        assert summary["queued"] == 3 and summary["evictions"] == 0, summary
        assert summary["all_intact"]
        assert "working sets hold" in out.getvalue()
        assert out.getvalue().count("queued, then admitted") == 3
        async with AsyncClient(kvd.target, timeout_s=30) as admin:
            stats = (await admin.pool_stats()).pools[0]
            assert stats.num_requests == 0 and stats.num_queued == 0
            assert (await admin.self_check()).ok


def test_the_demo_runs_against_a_kvd_that_wants_tokens_and_beside_another_demo(tmp_path):
    """`kvd-loadgen demo --token-file`: the tenant its token names; two demos at once each
    finish (their request ids do not collide) and say so; a refused token is one line."""
    import subprocess
    import sys
    from pathlib import Path

    config = tmp_path / "kvd.toml"
    (tmp_path / "demo.token").write_text("demo-token-0123456789\n")
    config.write_text('[auth]\nunix_tenant = ""\n[[tenant]]\nname = "demo"\n'
                      'token_file = "demo.token"\n')
    loadgen = str(Path(sys.executable).with_name("kvd-loadgen"))
    with LocalKvd("--config", str(config), "--model", "tiny", "--device-pages", "64",
                  "--host-pages", "512", "--admission", "reservation",
                  workdir=tmp_path) as kvd:
        demos = [subprocess.Popen([loadgen, "demo", "--target", kvd.target, "--token-file",
                                   str(tmp_path / "demo.token")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        for demo in demos:
            out, err = demo.communicate(timeout=120)
            assert demo.returncode == 0, err
            assert "Traceback" not in err
        refused = subprocess.run([loadgen, "demo", "--target", kvd.target, "--token", "nope"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert refused.stderr.startswith("kvd-loadgen demo: kvd refused: UNAUTHENTICATED")



def test_make_run_serves_from_a_checkout_whose_path_holds_a_space(tmp_path):
    """The Makefile split the socket's path at a space in the checkout's (kvd then served
    at a path that was not the one make demo and the hint named), and the showcase's line
    for the user's shell (`export KVD_TARGET=...`) split it too."""
    import shlex
    import subprocess
    from pathlib import Path

    from kvd_loadgen.showcase import reach_hint

    checkout = tmp_path / "my checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("")  # what make's set-up target depends on
    makefile = Path(__file__).parents[2] / "Makefile"
    plan = subprocess.run(["make", "-n", "-C", str(checkout), "-f", str(makefile), "run",
                           "demo"], capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    lines = [shlex.split(line) for line in plan.stdout.splitlines()
             if "kvd_loadgen.showcase" in line or "kvd-loadgen demo" in line]
    assert [words[words.index("--socket") + 1] for words in lines if "--socket" in words] == [
        f"{checkout}/run/kvd.sock"]
    assert [words[words.index("--target") + 1] for words in lines if "--target" in words] == [
        f"unix://{checkout}/run/kvd.sock"]
    (export,) = [line for line in reach_hint(f"unix://{checkout}/run/kvd.sock").splitlines()
                 if "export" in line]
    assert shlex.split(export) == ["export", f"KVD_TARGET=unix://{checkout}/run/kvd.sock"]
