"""The report plots say what they show: axes labelled, the device's capacity drawn, the steps
that never stalled visible, bars of 0 still there (labelled), labels in words."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvd_loadgen.request_trace_report import _occupancy, _stall_cdf  # noqa: E402
from kvd_loadgen.scenario_report import label_bars  # noqa: E402


def _result(policy: str) -> dict:
    return {"policy": policy,
            "classes": [{"tenant": "short", "step_stall_ms": [0.0] * 6 + [0.5, 2.0, 3.0, 9.0]},
                        {"tenant": "long", "step_stall_ms": [0.0, 1.0]}],
            "occupancy": [{"t": float(t), "tenants": {"short": (10 + t, 50),
                                                     "long": (90 - t, 50)}}
                          for t in range(5)]}


def test_occupancy_has_its_unit_and_the_device_capacity():
    fig = _occupancy(plt, [_result("lru"), _result("fair")], ["long", "short"], 120)
    for ax in fig.axes:
        assert ax.get_ylabel() == "device pages"
        capacity = [line for line in ax.get_lines() if "capacity" in line.get_label()]
        assert len(capacity) == 1 and set(capacity[0].get_ydata()) == {120}
        assert ax.get_ylim()[0] == 0
    plt.close(fig)


def test_the_stall_cdf_shows_the_steps_that_never_stalled():
    fig = _stall_cdf(plt, [_result("fair")])
    (ax,) = fig.axes
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert "fair / short (60% of steps never stalled)" in labels
    assert "fair / long (50% of steps never stalled)" in labels
    # The jump at 0 is inside the axes, and marked at its height.
    assert ax.get_xlim()[0] < 0
    markers = [tuple(line.get_ydata()) for line in ax.get_lines() if line.get_marker() == "o"]
    assert (0.6,) in markers and (0.5,) in markers
    plt.close(fig)


def test_a_bar_of_zero_is_labelled():
    fig, ax = plt.subplots()
    label_bars(ax, ax.bar([0, 1, 2], [0, 5, 12]))
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["0", "5", "12"]
    plt.close(fig)


def test_every_subcommands_help_shows_its_defaults_in_users_words():
    from kvd_loadgen.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.choices and "demo" in a.choices]
    assert "seed" not in parser.format_help().lower()
    for name, command in sub.choices.items():
        text = " ".join(command.format_help().split())
        assert "seed 0" not in text.lower(), name
        for action in command._actions:
            if action.option_strings and action.default not in (None, False, "", [],
                                                                 "==SUPPRESS=="):
                assert f"(default: {action.default})" in text, (name, action.dest)
    trace = " ".join(sub.choices["request-trace"].format_help().split())
    assert "--device-pages DEVICE_PAGES (default: 1200)" in trace
