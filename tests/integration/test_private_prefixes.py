"""A tenant whose prefix blocks are its own (`share_prefixes = false`), over real gRPC, each
engine writing its own bytes through its mapping of kvd's arenas and checking them on every
load.

Prefix blocks are shared by name: a tenant reads the bytes another stored under the same
name, and two engines storing a name at once both write its page. Any tenant that can name
a popular prefix (its block hashes follow from its tokens) could store wrong bytes under it
for every other tenant to load. A tenant kvd keeps apart shares nothing, both ways; the
tenants that share go on sharing.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd_client import AsyncClient, InvalidArgumentError
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

from .conftest import TOKENS_ONLY, reload_config

CONFIG = """
[server]
grace_s = 2
""" + TOKENS_ONLY + """
[[pool]]
name = "default"
model = "tiny"
device_pages = 16
host_pages = 32

[[tenant]]
name = "chat"
token = "chat-token"

[[tenant]]
name = "rag"
token = "rag-token"

[[tenant]]
name = "guest"
token = "guest-token"
share_prefixes = {share}
"""

NS = "tiny|"
SYSTEM = [hashlib.sha256(b"system prompt %d" % i).digest() for i in range(3)]


def _bytes(size: int, writer: str, key: bytes) -> np.ndarray:
    seed = hashlib.sha256(writer.encode() + key).digest()
    return np.frombuffer((seed * (size // len(seed) + 1))[:size], np.uint8)


async def _store(client, arena, writer: str, rid: str, keys) -> list[bool]:
    """Store the keys for rid, writing the writer's own bytes in the pages kvd says are
    fresh, then commit; which were fresh."""
    reply = await client.store(rid, NS, keys)
    for handle, fresh, key in zip(reply.handles, reply.fresh, keys):
        if fresh:
            arena.write(handle, _bytes(arena.page_bytes, writer, key))
    await client.commit(rid, NS, keys)
    return list(reply.fresh)


async def _loaded_from(client, arena, rid: str, keys, writers) -> list[str | None]:
    """Whose bytes each page a load of the keys hands out holds."""
    reply = await client.load(rid, NS, keys)
    found = []
    for handle, key in zip(reply.handles, keys):
        data = arena.read(handle)
        found.append(next((w for w in writers
                           if np.array_equal(data, _bytes(arena.page_bytes, w, key))), None))
    return found


@pytest.fixture
def private_kvd(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(share="false"))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        kvd.config = config
        yield kvd
        assert kvd.proc.poll() is None, f"kvd died during the test:\n{kvd.log()}"


async def test_a_tenant_kept_apart_can_neither_poison_nor_read_the_others_prefixes(
        private_kvd):
    target = private_kvd.target
    async with AsyncClient(target, token="chat-token") as chat, \
            AsyncClient(target, token="rag-token") as rag, \
            AsyncClient(target, token="guest-token") as guest:
        arena = MappedPool(await chat.export_pool())
        try:
            writers = ("chat", "rag", "guest")
            # The guest gets there first: it stores the popular system prompt's blocks with
            # bytes of its own, and leaves the last one written but not committed.
            await guest.admit("g1", prompt_tokens=16 * 3)
            assert await _store(guest, arena, "guest", "g1", SYSTEM[:2]) == [True, True]
            reply = await guest.store("g1", NS, SYSTEM[2:])
            arena.write(reply.handles[0], _bytes(arena.page_bytes, "guest", SYSTEM[2]))
            # chat sees none of them, and writes the whole prompt into pages of its own.
            assert (await chat.lookup(NS, SYSTEM)).num_hit == 0
            await chat.admit("c1", prompt_tokens=16 * 3)
            assert await _store(chat, arena, "chat", "c1", SYSTEM) == [True] * 3
            # rag shares chat's, as tenants that share do.
            assert (await rag.lookup(NS, SYSTEM)).num_hit == 3
            await rag.admit("r1", prompt_tokens=16 * 3)
            assert await _loaded_from(rag, arena, "r1", SYSTEM, writers) == ["chat"] * 3
            # The guest finishes its write: it commits into its own space, nobody else's.
            await guest.commit("g1", NS, SYSTEM[2:])
            assert await _loaded_from(chat, arena, "c1", SYSTEM, writers) == ["chat"] * 3
            assert await _loaded_from(rag, arena, "r1", SYSTEM, writers) == ["chat"] * 3
            # And reads its own bytes, never chat's.
            await guest.admit("g2", prompt_tokens=16 * 3)
            assert await _loaded_from(guest, arena, "g2", SYSTEM, writers) == ["guest"] * 3
            # Its own space is not a name it can spell from outside, nor may another.
            for client in (guest, chat):
                with pytest.raises(InvalidArgumentError, match="NUL"):
                    await client.lookup("\0guest/" + NS, SYSTEM)
                with pytest.raises(InvalidArgumentError, match="NUL"):
                    await client.store("c1" if client is chat else "g1", "\0guest/" + NS,
                                       SYSTEM)
            # Both spaces' blocks stay kvd's to keep or let go: after every request ends,
            # each space still finds its own.
            for client, rid in ((guest, "g1"), (guest, "g2"), (chat, "c1"), (rag, "r1")):
                await client.release(rid)
            await guest.admit("g3", prompt_tokens=16 * 3)
            assert await _loaded_from(guest, arena, "g3", SYSTEM, writers) == ["guest"] * 3
            await chat.admit("c2", prompt_tokens=16 * 3)
            assert await _loaded_from(chat, arena, "c2", SYSTEM, writers) == ["chat"] * 3
        finally:
            arena.close()
    async with AsyncClient(target, token="root-token") as admin:
        check = await admin.self_check()
        assert check.ok, list(check.problems)


async def _private(kvd) -> dict[str, bool]:
    """Which tenants keep their prefixes apart, as ListTenants says and kvctl shows it."""
    async with AsyncClient(kvd.target, token="root-token") as admin:
        listed = {t.tenant: t.private_prefixes for t in await admin.list_tenants()
                  if t.tenant != "default"}
    shown = subprocess.run(
        [str(Path(sys.executable).with_name("kvctl")), "--target", kvd.target, "tenants"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "KVD_TOKEN": "root-token", "COLUMNS": "300"}).stdout
    assert {t: f"{t} (own prefixes)" in shown for t in listed} == listed, shown
    return listed


async def test_a_reload_that_lets_the_tenant_share_again_shares_from_then_on(private_kvd):
    target = private_kvd.target
    async with AsyncClient(target, token="chat-token") as chat, \
            AsyncClient(target, token="guest-token") as guest:
        arena = MappedPool(await chat.export_pool())
        try:
            await chat.admit("c1", prompt_tokens=16 * 3)
            await _store(chat, arena, "chat", "c1", SYSTEM)
            assert (await guest.lookup(NS, SYSTEM)).num_hit == 0
            assert await _private(private_kvd) == {"chat": False, "rag": False, "guest": True}
            await reload_config(private_kvd, private_kvd.config, CONFIG.format(share="true"),
                                "config reloaded")
            assert (await guest.lookup(NS, SYSTEM)).num_hit == 3
            assert await _private(private_kvd) == {"chat": False, "rag": False, "guest": False}
            await guest.admit("g1", prompt_tokens=16 * 3)
            assert await _loaded_from(guest, arena, "g1", SYSTEM, ("chat",)) == ["chat"] * 3
        finally:
            arena.close()


DISAGG = TOKENS_ONLY + """
[[pool]]
name = "prefill"
model = "tiny"
device_pages = 8
host_pages = 16
admission = "reservation"

[[pool]]
name = "decode"
model = "tiny"
device_pages = 8
host_pages = 16
admission = "reservation"

[[link]]
source = "prefill"
target = "decode"

[[tenant]]
name = "chat"
token = "chat-token"

[[tenant]]
name = "guest"
token = "guest-token"
share_prefixes = false
"""


async def test_a_handoff_takes_a_tenants_own_prefix_along_into_its_own_space(tmp_path):
    # The guest prefills on its own prefix and hands the request off to decode: the
    # prefix goes along under the guest's space, where the decode engine loads it back;
    # chat, which stored the same names in decode with its own bytes, keeps its own.
    config = tmp_path / "kvd.toml"
    config.write_text(DISAGG)
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, token="chat-token") as chat, \
                AsyncClient(kvd.target, token="guest-token") as guest:
            prefill = MappedPool(await guest.export_pool("prefill"))
            decode = MappedPool(await guest.export_pool("decode"))
            try:
                await chat.admit("c1", prompt_tokens=16 * 3, pool="decode")
                assert await _store(chat, decode, "chat", "c1", SYSTEM) == [True] * 3
                await guest.admit("g1", prompt_tokens=16 * 3, output_tokens=16,
                                  pool="prefill", handoff_pool="decode")
                assert await _store(guest, prefill, "guest", "g1", SYSTEM) == [True] * 3
                await guest.handoff_all("g1")
                assert (await guest.lookup(NS, SYSTEM, pool="decode")).num_hit == 3
                writers = ("chat", "guest")
                assert (await _loaded_from(guest, decode, "g1", SYSTEM, writers)
                        == ["guest"] * 3)
                assert (await _loaded_from(chat, decode, "c1", SYSTEM, writers)
                        == ["chat"] * 3)
            finally:
                prefill.close()
                decode.close()
        async with AsyncClient(kvd.target, token="root-token") as admin:
            assert (await admin.self_check()).ok
