"""A request's `live` (its blocks not freed, in index order) after frees of any blocks in
any order and number: what a list with those blocks taken out holds. Its long requests are
freed a slice at a time (the newest first, at a release; any slice at a free), each of
which takes out a few of many."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.blocks import Block, Request, RequestState, TierKind


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 300), gaps=st.booleans())
def test_a_request_keeps_the_live_blocks_a_list_would(data, n, gaps):
    req = Request("r", "t", "p", 0, n, RequestState.ADMITTED)
    step = 3 if gaps else 1  # a handoff keeps the indices its blocks had: gaps
    req.live = [Block(req, i * step, TierKind.DEVICE, i) for i in range(n)]
    model = list(req.live)
    while model:
        how = data.draw(st.sampled_from(["newest", "few", "any", "one"]))
        k = data.draw(st.integers(1, len(model)))
        if how == "newest":
            gone = model[-k:]
        elif how == "one":
            gone = [data.draw(st.sampled_from(model))]
        else:
            if how == "few":
                k = max(1, min(k, len(model) // 9))
            gone = data.draw(st.lists(st.sampled_from(model), min_size=k, max_size=k,
                                      unique_by=id))
            if data.draw(st.booleans()):
                gone.sort(key=lambda b: b.index)
        req.unlive(gone)
        going = {id(b) for b in gone}
        model = [b for b in model if id(b) not in going]
        assert len(req.live) == len(model)
        assert all(a is b for a, b in zip(req.live, model))
