"""structlog set up the production way: filtering bound logger, cached, context merged, JSON
out (console renderer when a person is watching a terminal)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=lambda *args: DroppingLogger(sys.stderr),
        cache_logger_on_first_use=True,
    )


class DroppingLogger(structlog.PrintLogger):
    """Drops a line that cannot be written (the log's reader went away: journald restarted,
    the pipe kvd logs into closed) instead of raising: a log call sits in the middle of what
    kvd does (reaping a lapsed lease, draining at SIGTERM), and the error would end that
    instead. Counted in kvd_log_lines_dropped_total."""

    dropped = 0  # lines dropped, by every logger of the process

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except OSError:
            DroppingLogger.dropped += 1

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg
