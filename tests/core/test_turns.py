"""Turns at kvd's loop: a tenant is gated only while another tenant competes, quiet tenants
are forgotten, and each tenant's turns follow its weight."""

from __future__ import annotations

import asyncio

from kvd.service.gate import StepTurns


def test_a_tenant_alone_is_never_gated_and_quiet_ones_are_forgotten():
    turns = StepTurns(1)
    assert not turns.contended("a", 0.0)
    assert not turns.contended("a", 0.01)
    assert turns.contended("b", 0.02)  # a stepped 10 ms ago
    assert turns.contended("a", 0.03)
    assert not turns.contended("a", 0.2)  # b has been quiet for 180 ms
    assert list(turns._last) == ["a"]
    assert not StepTurns(0).contended("a", 0.0)  # 0: no turns at all


async def test_turns_follow_weights_and_pass_in_order():
    turns = StepTurns(2)
    turns.configure({"heavy": 2.0, "light": 0.1})
    assert turns.gate.limits == {"heavy": 4, "light": 1}
    gate = turns.gate
    assert gate.try_enter("light") and not gate.try_enter("light")
    assert gate.busy("light") and not gate.busy("heavy")
    order = []

    async def wait(n):
        await gate.wait("light")
        order.append(n)
        gate.leave("light")

    waiters = [asyncio.ensure_future(wait(n)) for n in range(3)]
    await asyncio.sleep(0)
    gate.leave("light")
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2] and not gate.busy("light")
