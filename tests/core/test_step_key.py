"""The Step handler tells a repeated read by the message's bytes without its step_id."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvd.service.step import _reads_key
from kvd_api.v1 import kvd_pb2 as pb

IDS = st.lists(st.text(min_size=1, max_size=8), max_size=6)


@given(a=st.integers(0, 2**64 - 1), b=st.integers(0, 2**64 - 1), ids=IDS, other=IDS)
def test_steps_differing_only_in_their_ids_share_a_key(a, b, ids, other):
    def key(step_id, read_all):
        return _reads_key(pb.StepRequest(step_id=step_id, read_all=read_all).SerializeToString())

    assert key(a, ids) == key(b, ids)
    assert (key(a, ids) == key(b, other)) == (ids == other)


def test_a_step_with_other_sections_keys_them_too():
    read = pb.StepRequest(step_id=7, read_all=["x"])
    busier = pb.StepRequest(step_id=7, read_all=["x"], frees=[pb.FreeRequest(request_id="x")])
    assert _reads_key(read.SerializeToString()) != _reads_key(busier.SerializeToString())
