"""The load generator's engine keeps each Step message within kvd's bound on items: a step
that names more running requests than one message may sends the rest of its reads in
messages of their own, and every request is still read every step."""

from __future__ import annotations

from kvd_client import AsyncClient
from kvd_loadgen import engine
from kvd_loadgen.engine import Engine, SimRequest
from kvd_loadgen.local import LocalKvd


async def test_a_step_with_more_requests_than_a_message_may_name_is_split(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(engine, "MAX_ITEMS", 4)
    config = tmp_path / "kvd.toml"
    config.write_text("[server]\nmax_items_per_call = 4\n\n[[pool]]\nmodel = \"tiny\"\n"
                      "block_tokens = 16\ndevice_pages = 64\nhost_pages = 64\n")
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=30) as client:
            sim = Engine(client, block_tokens=16, step_s=0.001)
            for i in range(10):  # ten running requests: a step names 10 reads and more
                await sim.arrive(SimRequest(f"r{i}", prompt_tokens=32, output_tokens=64))
            stats = await sim.run(steps=6)
            assert len(stats.steps) == 6
            assert not any(s.errors for s in stats.steps), stats.steps
            tenants = await client.list_tenants()
            # Every request's blocks were read on every step after its prefill: 10 requests x
            # at least 2 blocks x 5 steps.
            assert sum(t.bytes_read for t in tenants) >= 10 * 2 * 5 * 16 * 1024


def test_chunks_halve_once_a_step_and_grow_back_once_kvd_refuses_nothing():
    # Three reads refused in one step halve the read chunk once, not three times over; and
    # once steps go through again the chunks double back to where they started. (Halving
    # for every refusal, and never growing, left a run that hit one burst of refusals
    # reading a block a message to its end: the same trace ran 2-3x slower by chance.)
    sim = Engine(None, block_tokens=16, step_s=0.02, chunk_blocks=64)
    step = engine.pb.StepRequest(read_all=["a", "b", "c"])
    reply = engine.pb.StepResponse(errors=[
        engine.pb.StepError(section="read_all", item_index=i, code=8, message="no room")
        for i in range(3)])
    assert sim._absorb_errors(step, reply, [], [], []) == {"a", "b", "c"}
    assert (sim.chunk_blocks, sim.alloc_chunk) == (32, 64)
    assert sim._absorb_errors(step, reply, [], [], []) and sim.chunk_blocks == 16
    for _ in range(engine.GROW_AFTER - 1):
        sim.resize_chunks(False, False)
    assert sim.chunk_blocks == 16  # not before GROW_AFTER clean steps
    sizes = []
    for _ in range(3 * engine.GROW_AFTER):
        sim.resize_chunks(False, False)
        sizes.append(sim.chunk_blocks)
    assert sizes[0] == 32 and sizes[engine.GROW_AFTER] == 64 and sizes[-1] == 64
