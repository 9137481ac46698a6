"""argparse types shared by kvctl and kvd-loadgen: a bad number is argparse's own one-line
error (exit 2), not a traceback from deep in a call or a run."""

from __future__ import annotations

import argparse
import math


# The most a uint32 field of the API holds (page counts, listing limits).
UINT32_MAX = 2**32 - 1


def number(kind, least: float = 0, *, strictly: bool = False, most: float | None = None):
    """A finite `kind` (int or float) of at least `least` (above it when `strictly`) and at
    most `most` (where given: what the API's field holds)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number (got {text})")
        if value < least or (strictly and value == least):
            raise argparse.ArgumentTypeError(
                f"must be {'more than' if strictly else 'at least'} {least} (got {text})")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most} (got {text})")
        return value

    return parse
