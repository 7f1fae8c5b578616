"""RepeatLimit: one call site cannot flood the log; the count of what was dropped is reported."""

from __future__ import annotations

import logging

from service.logfilter import RepeatLimit


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_from_one_call_site_is_cut_and_counted():
    clock = Clock()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    handler.addFilter(RepeatLimit(burst=3, interval_s=10.0, clock=clock))
    log = logging.getLogger("test.flood")
    log.addHandler(handler)
    log.propagate = False
    def accept_failed(i):
        log.error("accept() failed: %d", i)  # one call site

    try:
        for i in range(1000):
            accept_failed(i)
        log.error("another call site")
        log.debug("below WARNING passes")
        log.setLevel(logging.DEBUG)
        log.debug("below WARNING passes")
        assert [r.getMessage() for r in records] == ["accept() failed: 0", "accept() failed: 1",
                                                    "accept() failed: 2", "another call site", "below WARNING passes"]
        clock.now = 10.0
        for i in range(2):
            accept_failed(i)
        assert records[-2].getMessage() == "accept() failed: 0 [997 more like this suppressed]"
        assert records[-1].getMessage() == "accept() failed: 1"
    finally:
        log.removeHandler(handler)
