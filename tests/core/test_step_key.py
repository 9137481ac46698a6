"""The Step handler tells a repeated read by the bytes from where the message's read_all
begins: equal bytes there must mean an equal read_all, however the message was written."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvd.service.step import _MAX_WALK, _read_all_start
from kvd_api.v1 import kvd_pb2 as pb

IDS = st.lists(st.text(min_size=1, max_size=8), max_size=6)
RIDS = st.text(max_size=300)


def _tail(data: bytes) -> bytes | None:
    start = _read_all_start(data)
    return None if start is None else data[start:]


@st.composite
def steps(draw, read_all=IDS):
    """A StepRequest with any of its sections."""
    rid = draw(RIDS)
    return pb.StepRequest(
        step_id=draw(st.integers(0, 2**64 - 1)),
        intents=[pb.IntentUpdate(request_id=rid, block_index=i,
                                 intent=pb.MemoryIntent(request_priority=i))
                 for i in range(draw(st.integers(0, 3)))],
        frees=[pb.FreeRequest(request_id=rid, block_indices=draw(st.lists(
            st.integers(0, 2**31), max_size=4)))] * draw(st.integers(0, 2)),
        releases=[pb.ReleaseRequest(request_id=rid)] * draw(st.integers(0, 2)),
        allocations=[pb.AllocateRequest(request_id=rid, num_blocks=draw(
            st.integers(1, 2**20)))] * draw(st.integers(0, 2)),
        accesses=[pb.AccessRequest(request_id=rid, all_blocks=True)] * draw(
            st.integers(0, 2)),
        read_all=draw(read_all))


@given(a=steps(), b=steps())
def test_steps_written_by_protobuf_share_a_key_exactly_when_their_reads_are_equal(a, b):
    ka, kb = _tail(a.SerializeToString()), _tail(b.SerializeToString())
    assert ka is not None and kb is not None  # a handful of sections: always found
    assert (ka == kb) == (list(a.read_all) == list(b.read_all))


@given(step=steps())
def test_the_key_parses_to_the_whole_read_all(step):
    tail = _tail(step.SerializeToString())
    assert list(pb.StepRequest.FromString(tail).read_all) == list(step.read_all)


@st.composite
def shuffled(draw):
    """A message written in any field order (as another serializer, or a hostile client,
    may): each field of a protobuf-written step as bytes of its own, the read_all entries
    among the others."""
    fields = []
    step = draw(steps())
    for name in ("intents", "frees", "releases", "allocations", "accesses"):
        for item in getattr(step, name):
            fields.append(pb.StepRequest(**{name: [item]}).SerializeToString())
    fields += [pb.StepRequest(read_all=[r]).SerializeToString() for r in step.read_all]
    fields.append(pb.StepRequest(step_id=step.step_id).SerializeToString())
    return b"".join(draw(st.permutations(fields)))


@given(a=shuffled(), b=shuffled())
def test_equal_keys_mean_equal_reads_whatever_the_field_order(a, b):
    ka, kb = _tail(a), _tail(b)
    if ka is not None and kb is not None and ka == kb:
        assert (list(pb.StepRequest.FromString(a).read_all)
                == list(pb.StepRequest.FromString(b).read_all))
    if ka is not None:
        assert (list(pb.StepRequest.FromString(ka).read_all)
                == list(pb.StepRequest.FromString(a).read_all))


def test_a_message_with_too_many_fields_before_its_reads_has_no_key():
    many = pb.StepRequest(frees=[pb.FreeRequest(request_id="x")] * (_MAX_WALK + 1),
                          read_all=["x"]).SerializeToString()
    assert _read_all_start(many) is None
    few = pb.StepRequest(frees=[pb.FreeRequest(request_id="x")] * (_MAX_WALK - 1),
                         read_all=["x"]).SerializeToString()
    assert few[_read_all_start(few):] == pb.StepRequest(read_all=["x"]).SerializeToString()
