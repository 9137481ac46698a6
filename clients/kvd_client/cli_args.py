"""argparse types shared by kvctl and kvd-loadgen: a bad number is argparse's own one-line
error (exit 2), not a traceback from deep in a call or a run."""

from __future__ import annotations

import argparse
import math


def number(kind, least: float = 0, *, strictly: bool = False):
    """A finite `kind` (int or float) of at least `least`, or above it when `strictly`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < least or (strictly and value == least):
            raise argparse.ArgumentTypeError(
                f"must be {'more than' if strictly else 'at least'} {least} (got {text})")
        return value

    return parse
