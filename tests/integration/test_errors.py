"""Bad input gets a clear status and message; state is unchanged; kvd keeps serving."""

from __future__ import annotations

import grpc
import pytest

from kvd_client import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    pb,
)
from kvd_client.client import intent_update


async def _state(client):
    s = (await client.pool_stats()).pools[0]
    return ([t.used_pages for t in s.tiers], s.num_requests, s.num_queued, s.reserved_pages)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda c: c.admit("", 10), InvalidArgumentError, "request_id must not be empty"),
        (lambda c: c.admit("z", 0, 0), InvalidArgumentError, "at least one"),
        (lambda c: c.admit("z", 10, pool="nope"), NotFoundError, "no pool 'nope'"),
        (lambda c: c.allocate("ghost", 1), NotFoundError, "no request 'ghost'"),
        (lambda c: c.allocate("r", 0), InvalidArgumentError, "num_blocks must be positive"),
        (lambda c: c.allocate("r", 9), InvalidArgumentError, "holds 8 pages"),
        (lambda c: c.access("r", [5]), InvalidArgumentError, "out of range"),
        (lambda c: c.access("r", [0, 0]), InvalidArgumentError, "duplicate"),
        (lambda c: c.free("r", []), InvalidArgumentError, "at least one block"),
        (lambda c: c.release("ghost"), NotFoundError, "no request"),
        (lambda c: c.evict(0), InvalidArgumentError, "num_pages must be positive"),
        (lambda c: c.evict(100), ResourceExhaustedError, "cannot free 100 device page"),
        (lambda c: c.export_pool("nope"), NotFoundError, "no pool"),
        (lambda c: c.set_policy("belady"), InvalidArgumentError, "choose one of"),
        (lambda c: c.update_intents([intent_update("r", 0, priority=9)]),
         InvalidArgumentError, "unknown priority"),
        (lambda c: c.update_intents([intent_update("r", 0, request_priority=500)]),
         InvalidArgumentError, "0..100"),
        (lambda c: c.update_intents([intent_update("r", 0, recompute_cost_us=-5)]),
         InvalidArgumentError, ">= 0"),
        # Ids and names are bounded where they enter, and errors never echo them whole.
        (lambda c: c.admit("x" * 20_000, 16), InvalidArgumentError,
         "request_id is longer than 256 characters"),
        (lambda c: c.release("x" * 20_000), InvalidArgumentError, "longer than 256"),
        (lambda c: c.admit("z", 16, tenant="t" * 300), InvalidArgumentError, "tenant is longer"),
        (lambda c: c.update_intents([intent_update("y" * 4096, 0)]), InvalidArgumentError,
         "updates.request_id is longer"),
        # Ids and names are shown to operators (kvctl, logs, events): none may hold a
        # control character, which would drive their terminal or make one id look like
        # another. kvd took all of these but the NUL.
        (lambda c: c.admit("z\x1b]0;pwned\x07", 16), InvalidArgumentError,
         r"request_id must not hold control characters (found \x1b)"),
        (lambda c: c.admit("z\x00", 16), InvalidArgumentError, "control characters"),
        (lambda c: c.admit("abc\u202edef", 16), InvalidArgumentError, r"(found \u202e)"),
        (lambda c: c.admit("z", 16, tenant="t\x1b[2J"), InvalidArgumentError,
         r"tenant must not hold control characters (found \x1b)"),
        (lambda c: c.set_quota("t\r", weight=2, create=True), InvalidArgumentError,
         r"tenant must not hold control characters (found \r)"),
        (lambda c: c.watch_events(buffer=10**9).__anext__(), InvalidArgumentError,
         "buffer is at most"),
        # Work per call is bounded.
        (lambda c: c.update_intents([intent_update("r", 0)] * 2000), InvalidArgumentError,
         "2000 intent updates in one call; at most 1024 (max_items_per_call)"),
        (lambda c: c.access("r", list(range(70000))), InvalidArgumentError,
         "at most 65536 (max_blocks_per_call)"),
        (lambda c: c.update_intents([intent_update("r", 0, priority=1)] * 600_000),
         ResourceExhaustedError, "larger than max"),
        # Quotas are finite numbers in range.
        (lambda c: c.set_quota("t", weight=float("nan")), InvalidArgumentError, "finite"),
        (lambda c: c.set_quota("t", weight=float("inf")), InvalidArgumentError, "finite"),
        (lambda c: c.set_quota("t", bandwidth_cap_bytes_per_s=float("nan")),
         InvalidArgumentError, "finite"),
        (lambda c: c.set_quota("t", read_budget_bytes_per_s=float("inf")),
         InvalidArgumentError, "finite"),
        (lambda c: c.set_quota("t", guaranteed_pages=6, limit_pages=4), InvalidArgumentError,
         "above limit"),
    ],
)
async def test_bad_input_is_refused_with_a_clear_status(client, call, error, words):
    await client.admit("r", 32)
    await client.allocate("r", 2)
    before = await _state(client)
    with pytest.raises(error) as info:
        await call(client)
    assert words in info.value.details
    assert len(info.value.details) < 400
    assert await _state(client) == before
    assert not [t for t in await client.list_tenants() if t.tenant == "t"]
    assert await client.health() == "SERVING"


async def test_a_quota_of_more_pages_than_kvd_counts_is_refused_and_changes_nothing(client):
    """A quota in bytes past what the API counts in pages (uint32) was taken, and from then
    on every listing of the tenant (ListTenants, SetQuota's reply) failed."""
    before = await client.list_tenants()
    for fields in ({"guaranteed_bytes": 2**53}, {"limit_bytes": 2**64 - 1},
                   {"limit_bytes": 2**63, "weight": 2.0}):
        with pytest.raises(InvalidArgumentError) as info:
            await client.set_quota("default", create=True, **fields)
        assert "at most 4294967295 pages" in info.value.details
    assert await client.list_tenants() == before
    assert (await client.pool_stats()).pools
    # The most it counts is taken, to the page: bytes are rounded up exactly.
    page_bytes = (await client.pool_stats()).pools[0].page_bytes
    [info] = await client.set_quota("default", limit_bytes=(2**32 - 1) * page_bytes,
                                    create=True)
    assert info.limit_pages == 2**32 - 1
    [info] = await client.set_quota("default", guaranteed_bytes=2**40 + 1, limit_bytes=0)
    assert info.guaranteed_pages == -(-(2**40 + 1) // page_bytes)


async def test_duplicate_and_queued_requests(client):
    # 8 device + 32 host pages, less 1 of transit headroom: four 8-page requests fit.
    for i in range(4):
        assert (await client.admit(f"big{i}", 16 * 8)).decision == pb.DECISION_ADMITTED
    with pytest.raises(AlreadyExistsError):
        await client.admit("big0", 16)
    reply = await client.admit("next", 16 * 8)
    assert reply.decision == pb.DECISION_QUEUED and reply.queue_position == 1
    assert "7 of 39 are unreserved" in reply.reason
    with pytest.raises(FailedPreconditionError, match="queued"):
        await client.allocate("next", 1)
    never = await client.admit("never", 16 * 9)
    assert never.decision == pb.DECISION_REJECTED and "never be resident" in never.reason
    with pytest.raises(NotFoundError):  # a rejected request is not kept
        await client.release("never")
    await client.release("big0")
    assert len((await client.allocate("next", 1)).handles) == 1  # admitted by the release
    for rid in ("big1", "big2", "big3", "next"):
        await client.release(rid)


async def test_pinning_past_capacity_is_refused(client):
    await client.admit("p", 16 * 8)
    await client.allocate("p", 8)
    crit = [intent_update("p", i, priority=pb.PRIORITY_DECODE_CRITICAL) for i in range(8)]
    await client.update_intents(crit)
    # An admitted request cannot grow into a device tier that is all pinned...
    with pytest.raises(ResourceExhaustedError, match="8 of 8 pinned"):
        await client.allocate("p", 1)
    # ...and a new request waits for room instead of being admitted into it.
    reply = await client.admit("q", 16)
    assert reply.decision == pb.DECISION_QUEUED and "8 of 8 pinned" in reply.reason
    await client.release("p")  # admits q
    assert len((await client.allocate("q", 1)).handles) == 1


async def test_a_step_over_the_item_bound_is_refused(client):
    await client.admit("r", 32)
    async with client.step_stream() as stream:
        with pytest.raises(InvalidArgumentError, match="at most 1024"):
            await stream.step(read_all=["r"] * 2000)
    assert await client.health() == "SERVING"


@pytest.mark.parametrize("section", ["read_all", "allocations", "frees", "intents", "accesses",
                                     "releases"])
async def test_a_step_naming_a_too_long_id_is_refused_whole(client, section):
    """However small the message, and in whichever section the id is: INVALID_ARGUMENT
    naming the section, and nothing of the step done (its allocation is not made)."""
    await client.admit("r", 32)
    await client.allocate("r", 1)
    before = await _state(client)
    long = "x" * 257
    items = {
        "read_all": {"read_all": [long]},
        "allocations": {"allocations": [("r", 1), (long, 1)]},
        "frees": {"frees": [(long, [0])]},
        "intents": {"intents": [intent_update(long, 0, priority=pb.PRIORITY_HOT)]},
        "accesses": {"accesses": [(long, [0])]},
        "releases": {"releases": [long]},
    }[section]
    async with client.step_stream() as stream:
        with pytest.raises(InvalidArgumentError, match=f"{section}: a request_id is longer"):
            await stream.step(**{"allocations": [("r", 1)], **items})
    assert await _state(client) == before
    assert len((await client.access("r", [0])).handles) == 1


def test_step_ids_are_its_only_strings():
    """The Step handler checks only request ids' lengths (register.py does not walk Step
    messages): a string field added to StepRequest, at any depth, must be checked too."""

    def strings(descriptor, path=""):
        for field in descriptor.fields:
            if field.type == field.TYPE_STRING:
                yield path + field.name
            elif field.type == field.TYPE_MESSAGE:
                yield from strings(field.message_type, f"{path}{field.name}.")

    assert sorted(strings(pb.StepRequest.DESCRIPTOR)) == sorted(
        ["read_all", "intents.request_id", "frees.request_id", "releases.request_id",
         "allocations.request_id", "accesses.request_id"])


async def test_a_stream_checks_each_message_that_differs_from_the_last_it_passed(client):
    """A Step stream passes a message equal to the last it checked (but for its step_id)
    without checking it again; anything else is checked: an id over the bound, and bytes
    that do not parse even where all but their step_id equal the last message's."""
    await client.admit("r", 32)
    await client.allocate("r", 1)
    call = client.channel.stream_stream("/kvd.v1.Memory/Step", request_serializer=None,
                                        response_deserializer=pb.StepResponse.FromString)()
    good = pb.StepRequest(step_id=1, read_all=["r"] * 40).SerializeToString()
    for step_id in (1, 2, 300):
        message = pb.StepRequest(step_id=step_id, read_all=["r"] * 40).SerializeToString()
        await call.write(message)
        reply = await call.read()
        assert reply.step_id == step_id and not reply.errors
    # The same bytes after field 1, but field 1 an eleven-byte varint: not a message.
    await call.write(b"\x08" + b"\x81" * 10 + b"\x01" + good[2:])
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with client.step_stream() as stream:
        await stream.step(read_all=["r"])
        with pytest.raises(InvalidArgumentError, match="longer than"):
            await stream.step(read_all=["r", "x" * 257])
    assert await client.health() == "SERVING"
    assert len((await client.access("r", [0])).handles) == 1


async def test_a_decode_step_is_answered_with_its_step_id_however_it_is_written(client):
    """A decode step (a step_id, then the batch the last message read) is answered from the
    read kept, with the step_id the message holds: canonical varints of every length, the
    field left out or written as zero, a varint padded with bytes that add nothing, and
    one whose tenth byte overflows 64 bits (protobuf keeps the low 64)."""
    await client.admit("r", 32)
    await client.allocate("r", 1)
    call = client.channel.stream_stream("/kvd.v1.Memory/Step", request_serializer=None,
                                        response_deserializer=pb.StepResponse.FromString)()
    batch = pb.StepRequest(read_all=["r"] * 40).SerializeToString()
    heads = [(pb.StepRequest(step_id=v).SerializeToString(), v)
             for v in (1, 0, 127, 128, 2**56, 2**63 - 1, 2**63, 2**64 - 1, 5)]
    heads += [(b"\x08\x00", 0), (b"\x08\x81\x80\x00", 1),
              (b"\x08" + b"\xff" * 9 + b"\x7f", 2**64 - 1), (b"\x08\x82\x80\x80\x00", 2)]
    for head, step_id in heads:
        await call.write(head + batch)
        reply = await call.read()
        assert (reply.step_id, list(reply.errors)) == (step_id, []), head.hex()
    await call.done_writing()
    stats = (await client.pool_stats()).pools[0]
    assert stats.num_accesses == 40 * len(heads)  # each step read the one block 40 times


async def test_a_step_id_after_the_reads_is_the_steps(client):
    """Protobuf keeps a field's last value: a Step message whose step_id comes again after its
    read_all is answered with that one, also when its bytes before the read_all are those
    of an engine's decode step (another step_id, then the batch the last message read)."""
    await client.admit("r", 32)
    await client.allocate("r", 1)
    call = client.channel.stream_stream("/kvd.v1.Memory/Step", request_serializer=None,
                                        response_deserializer=pb.StepResponse.FromString)()
    late = pb.StepRequest(step_id=7).SerializeToString()
    for step_id in (1, 2, 3):
        await call.write(pb.StepRequest(step_id=step_id, read_all=["r"] * 40)
                         .SerializeToString() + late)
        reply = await call.read()
        assert reply.step_id == 7 and not reply.errors
    await call.done_writing()
