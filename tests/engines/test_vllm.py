"""A real vLLM engine (CPU build, tiny random-weight Llama) uses kvd through its KV connector.

Each engine run is a process of its own, so the second run starts with vLLM's own prefix
cache empty: whatever prefix it does not compute came from kvd.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvd_client import Client, pb
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

pytest.importorskip("vllm")

RUNNER = Path(__file__).resolve().parent / "run_vllm.py"
# One vLLM block (32 tokens) of both layers: 2 x 32 tokens x 1 KV head x (K+V) 128 x 2 bytes.
PAGE_BYTES = 2 * 32 * 128 * 2
KVD = ("--page-bytes", str(PAGE_BYTES), "--block-tokens", "32", "--device-pages", "64",
       "--host-pages", "128")
SHARED = list(range(10, 74))  # two blocks every prompt shares
PROMPTS = [SHARED + list(range(100 + 40 * i, 140 + 40 * i)) for i in range(3)]


def engine_run(target: str, prompts, params=None) -> dict:
    args = [sys.executable, str(RUNNER), target, json.dumps(prompts)]
    if params is not None:
        args.append(json.dumps(params))
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    results = [line for line in done.stdout.splitlines() if line.startswith("KVD_RESULT ")]
    assert results, (done.stdout + done.stderr)[-4000:]
    return json.loads(results[-1].removeprefix("KVD_RESULT "))


@pytest.mark.timeout(600)  # three engine starts of ~30 s each
def test_a_fresh_engine_takes_its_prefix_from_kvd_and_computes_the_same_tokens(tmp_path):
    with LocalKvd(*KVD, workdir=tmp_path) as kvd:
        first = engine_run(kvd.target, PROMPTS)
        with Client(kvd.target) as c:
            tenants = {t.tenant: t for t in c.list_tenants()}
            stats = c.pool_stats().pools[0]
        # Every prompt's three full blocks were stored once: the shared two and one each.
        assert stats.tiers[0].used_pages == 2 + 3
        assert tenants["engine"].device_pages == 5
        second = engine_run(kvd.target, PROMPTS)
        # The control: the same prefix with its bytes in kvd spoiled must change the output,
        # else equal outputs would prove nothing.
        with Client(kvd.target) as c:
            arena = MappedPool(c.export_pool())
            arena.tiers[pb.TIER_DEVICE][:] ^= 0x55
            arena.close()
        spoiled = engine_run(kvd.target, PROMPTS)
    print(f"\nrun 1: {first}\nrun 2: {second}\nspoiled: {spoiled}")
    # All but the last (partial) block of each 104-token prompt came from kvd.
    assert second["cached"] == [96, 96, 96]
    assert second["tokens"] == first["tokens"]
    assert spoiled["cached"] == [96, 96, 96] and spoiled["tokens"] != first["tokens"]
