"""The service in front of a stand-in rank group as fast as one H200: what the front ends alone deliver.

    python bench/standin_serve.py [--step-ms 1.4] [moe-serve flags, e.g. --frontends 2 --preset seed
        --world-size 1 --device cpu --http-port 18000 --grpc-port 18001]

Runs `service.server.Server` (every front end, as `python -m service` would) with a group whose
steps take --step-ms each, one at a time (one device), and copy x into out (an echo: the answer's
bytes are real). Its slots are real shared memory, so --frontends N > 1 runs as it does over a
real group. No warm-up check (the echo is not the layer). Load it with bench/serve_load.py
--url/--grpc --no-direct and the same layer flags; SIGTERM stops it.

Sources (the wire arena's pieces, and clients' regions with --shm-direct) are echoed as the ranks
would move them: from the input object's bytes to the output object's, through mappings of the objects
(service.worker.direct.source_path) in the step, where a GPU rank's two DMAs would be.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import mmap
import os
import sys
import threading
import time

from service.cli import parse_settings
from service.server import Server
from service.worker.direct import source_path
from service.worker.group import StepStats
from service.worker.shm import SlotPool, create_slots, remove_slots


class StandInGroup:
    """A rank group of no ranks: each step sleeps `step_s` (steps never overlap) and echoes x."""

    backend = "serial"

    def __init__(self, cfg, slots: int, step_s: float):
        self.cfg, self.num_slots, self.step_s = cfg, slots, step_s
        self.alive, self.seq, self.pids = False, 0, []
        self.slots: list = []
        self._free = SlotPool()
        self._device = threading.Lock()  # one step at a time, as on one GPU
        self._mapped: dict[str, mmap.mmap] = {}  # sources' objects, by key
        self._seq = threading.Lock()

    def start(self) -> None:
        self.slots = create_slots(self.cfg, self.num_slots)
        self._free = SlotPool(self.slots)
        self.alive = True

    def close(self) -> None:
        self.alive = False
        remove_slots(self.slots)

    def poll(self) -> bool:
        return self.alive

    def heartbeat(self, timeout: float = 2.0) -> bool:
        return True

    def acquire_slot(self, timeout=None):
        return self._free.get(timeout, alive=self.alive)

    def release(self, slot) -> None:
        self._free.put(slot)

    def run(self, slot, T: int, sources=()) -> StepStats:
        with self._seq:
            self.seq += 1
            seq = self.seq
        with self._device:
            t0 = time.perf_counter()
            time.sleep(self.step_s)
            row_bytes = slot.x.shape[1] * slot.x.element_size()
            at = 0  # the slot's rows between sources are echoed in the slot; a source's, object to object
            for row, rows, in_key, _, in_at, out_key, _, out_at, _, _ in sorted(sources):
                slot.out[at:row].copy_(slot.x[at:row])
                n = rows * row_bytes
                src, dst = memoryview(self._mapping(in_key)), memoryview(self._mapping(out_key))
                dst[out_at:out_at + n] = src[in_at:in_at + n]
                at = row + rows
            slot.out[at:T].copy_(slot.x[at:T])
            layer_s = time.perf_counter() - t0
        return StepStats(seq=seq, tokens=T, backend=self.backend, layer_s=layer_s, stages={"gemm1": layer_s},
                         exposed_comm_s=0.0)

    def _mapping(self, key: str) -> mmap.mmap:
        """The whole object behind a source's key, mapped once (the stand-in trusts its front ends)."""
        if key not in self._mapped:
            fd = os.open(source_path(key), os.O_RDWR)
            try:
                self._mapped[key] = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        return self._mapped[key]


class StandInServer(Server):
    def _warm_up(self, group) -> None:  # the echo is not the layer: nothing to check
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=1.4, help="the stand-in's time per step (H200, T=512: 1.4)")
    args, flags = p.parse_known_args()
    settings = parse_settings(flags)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = StandInServer(settings)
    server.group_factory = lambda: StandInGroup(server.cfg, settings.slots * server.frontends, args.step_ms / 1e3)
    return asyncio.run(server.serve())


if __name__ == "__main__":
    sys.exit(main())
