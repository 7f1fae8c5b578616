"""A log that cannot be flooded: repeated warnings and errors from one place are rate-limited.

A client (or the OS: accept() failing at the file limit) can make one line of code log
hundreds of thousands of times. `RepeatLimit` lets `burst` records from one call site (logger,
level, file, line) through per `interval_s`, drops the rest, and appends the count of dropped
ones to the next record it lets through. Records below WARNING pass untouched.
"""

from __future__ import annotations

import logging
import time

BURST = 10
INTERVAL_S = 60.0


class RepeatLimit(logging.Filter):
    def __init__(self, burst: int = BURST, interval_s: float = INTERVAL_S, clock=time.monotonic):
        super().__init__()
        self.burst, self.interval_s, self.clock = burst, interval_s, clock
        self._sites: dict[tuple, list] = {}  # call site -> [window start, records let through, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, record.pathname, record.lineno)
        now = self.clock()
        site = self._sites.setdefault(key, [now, 0, 0])
        if now - site[0] >= self.interval_s:
            site[0], site[1] = now, 0
        if site[1] >= self.burst:
            site[2] += 1
            return False
        site[1] += 1
        if site[2]:
            record.msg, record.args = f"{record.getMessage()} [{site[2]} more like this suppressed]", None
            site[2] = 0
        return True


def install(logger: logging.Logger | None = None) -> RepeatLimit:
    """Put one RepeatLimit on every handler of `logger` (the root logger by default)."""
    limit = RepeatLimit()
    for handler in (logger or logging.getLogger()).handlers:
        handler.addFilter(limit)
    return limit
