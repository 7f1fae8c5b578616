"""Per-stage timing of one layer step, on the CPU (host clock) or on a CUDA stream (events)."""

from __future__ import annotations

import itertools
import time

import torch


class StageTimer:
    """Marks stage boundaries in order; `seconds()` returns {stage: seconds} after the step.

    On CUDA the marks are events on the current stream, so the figures are device time and
    reading them synchronizes once per step (after the step's work, not between stages). The
    events are made once and reused by the next step this timer times: a caller with several
    steps in flight (service.worker.rank) keeps one timer per step in flight.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self._events: list[torch.cuda.Event] = []  # CUDA: the marks' events, reused step after step
        self._seconds: dict[str, float] | None = None  # seconds() of the step timed last, once read

    def _now(self):
        if self.cuda:
            i = len(self.marks)
            if i == len(self._events):
                self._events.append(torch.cuda.Event(enable_timing=True))
            event = self._events[i]
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks, self._seconds = [], None
        self.marks.append(("", self._now()))

    def mark(self, stage: str) -> None:
        """Close the stage that ran since the previous mark."""
        self._seconds = None
        self.marks.append((stage, self._now()))

    def seconds(self) -> dict[str, float]:
        if self._seconds is not None:
            return dict(self._seconds)
        if self.cuda:
            self.marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, t0), (stage, t1) in itertools.pairwise(self.marks):
            dt = t0.elapsed_time(t1) / 1e3 if self.cuda else t1 - t0
            out[stage] = out.get(stage, 0.0) + dt
        self._seconds = out
        return dict(out)
