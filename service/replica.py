"""A front-end process i >= 1 of `--frontends N` (spawned by service.fleet; the protocol is there).

It serves HTTP and gRPC on the server's ports (SO_REUSEPORT) with its own batcher, and runs its
steps on its share of the owner's rank group through `RemoteGroup`: the rows go into the slot
(mapped from the descriptor the owner sent), ("step", gen, n, T[, sources]) goes to the owner, whose
thread calls group.run and answers (sources: --shm-direct's rows in clients' objects, which the ranks
read and answer into themselves, service.worker.direct). It binds its listeners only after the
owner's first ("attach", ...) or ("detach", why), so that a restarted front end never takes
connections it would refuse while the others serve; readiness then follows those messages.
("drain",) or SIGTERM drains and exits 0; the control channel closing (the owner exited) stops the
process at once, failing what it still holds with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Executor
from multiprocessing.connection import Connection

from service.api.regions import Regions, RegionTable
from service.config import LayerConfig, Settings
from service.errors import GroupUnavailable, WorkerError
from service.fleet import FRONTEND_STOP_GRACE_S, Channel, name_process, set_frontend_threads
from service.worker.group import readable
from service.worker.malloc import keep_freed_memory
from service.worker.shm import Slot, SlotPool

log = logging.getLogger("moe-serve.frontend")

# Past step_timeout_s: the owner bounds every step by it, so a longer wait means the owner hangs.
STEP_ANSWER_MARGIN_S = 10.0


class RemoteGroup:
    """This front end's slots of the owner's rank group (acquire_slot / run / release, as WorkerGroup)."""

    def __init__(self, gen: int, backend: str, slots: list[Slot], conns: list[Connection], sent: list[int],
                 timeout_s: float, direct_regions: bool = False, busy: list[threading.Lock] | None = None):
        self.gen, self.backend = gen, backend
        self.direct_regions = direct_regions  # the owner's group reads and writes sources (--shm-direct)
        self.alive = True
        self._conns = conns
        self._timeout_s = timeout_s
        self._free = SlotPool(slots)
        # Steps sent per slot connection, kept by the connection's owner across groups: an answer an
        # earlier group gave up waiting for carries a smaller number and is skipped, never taken.
        self._n = sent
        # One step at a time per slot connection, also across groups (kept with `sent`): held from the send
        # until its answer is taken or given up on, so two waiting steps never read one connection
        self._busy = busy if busy is not None else [threading.Lock() for _ in conns]

    def acquire_slot(self, timeout: float | None = None) -> Slot:
        return self._free.get(timeout, alive=self.alive)

    def release(self, slot: Slot) -> None:
        self._free.put(slot)

    def run(self, slot: Slot, T: int, sources=()):
        """One step on rows [0, T) of the slot, run by the owner; the answer is in slot.out[:T] (but for
        the rows of `sources`: in the objects they name). Blocks (a step thread's)."""
        with self._busy[slot.index]:
            conn, n, deadline = self._send(slot, T, sources)
            try:
                while True:
                    if not conn.poll(max(0.0, deadline - time.monotonic())):
                        raise self._silent()
                    reply = conn.recv()
                    if reply[1] >= n:
                        return self._result(reply, n, slot)
            except (EOFError, OSError):
                raise self._gone() from None

    async def run_async(self, slot: Slot, T: int, sources=(), executor: Executor | None = None):
        """`run` on the event loop: the step is sent from the loop and the owner's answer wakes the loop
        itself (a reader on the slot's connection), with no step thread between. At one client each of a
        thread's two hand-offs cost ~0.07-0.3 ms on a GPU host whose idle threads wake slowly (bench/NOTES.md,
        twenty-first session). A step cancelled meanwhile leaves its answer in the connection, which the
        slot's next step skips (its number is smaller), as it skips any answer an earlier group gave up on.
        While another step still waits on the slot's connection (an earlier group's), this one waits in a
        thread of `executor` behind it (`run`)."""
        loop = asyncio.get_running_loop()
        busy = self._busy[slot.index]
        if not busy.acquire(blocking=False):
            return await loop.run_in_executor(executor, self.run, slot, T, sources)
        try:
            return await self._run_on_loop(slot, T, sources)
        finally:
            busy.release()

    async def _run_on_loop(self, slot: Slot, T: int, sources):
        conn, n, deadline = self._send(slot, T, sources)
        try:
            while True:
                if not conn.poll(0) and not await readable([conn.fileno()], [], deadline):
                    raise self._silent()
                reply = conn.recv()  # (a whole message: the owner writes its small reply at once)
                if reply[1] >= n:
                    return self._result(reply, n, slot)
        except (EOFError, OSError):
            raise self._gone() from None

    def _send(self, slot: Slot, T: int, sources) -> tuple[Connection, int, float]:
        """Ask the owner for the step on `slot`: its connection, the step's number on it, the deadline."""
        if not self.alive:
            raise GroupUnavailable("the rank group is not running")
        conn = self._conns[slot.index]
        self._n[slot.index] += 1
        n = self._n[slot.index]
        deadline = time.monotonic() + self._timeout_s
        try:
            conn.send(("step", self.gen, n, T, tuple(sources)) if sources else ("step", self.gen, n, T))
        except OSError:
            raise self._gone() from None
        return conn, n, deadline

    def _silent(self) -> GroupUnavailable:
        self.alive = False
        return GroupUnavailable(f"the owner process did not answer step within {self._timeout_s:.0f} s")

    def _gone(self) -> GroupUnavailable:
        self.alive = False
        return GroupUnavailable("the owner process is gone")

    def _result(self, reply: tuple, n: int, slot: Slot):
        """The owner's answer to step n (smaller numbers are skipped by the callers: the late answers to steps
        an earlier group gave up on): its StepStats, or its failure raised."""
        if reply[1] != n:  # unreachable unless the protocol breaks
            self.alive = False
            raise GroupUnavailable(f"answer {reply[1]} for step {n} of slot {slot.index}")
        if reply[0] == "done":
            return reply[2]
        _, _, kind, text = reply
        raise WorkerError(text) if kind == "worker" else GroupUnavailable(text)


class Replica:
    def __init__(self, index: int, settings: Settings, cfg: LayerConfig, ctl: Connection, steps: list[Connection]):
        from service.server import Endpoint

        self.index, self.settings, self.cfg = index, settings, cfg
        self.ctl = Channel(ctl)
        self.steps = steps
        self.sent = [0] * len(steps)  # steps sent per slot connection, for every group in turn (RemoteGroup)
        self.busy = [threading.Lock() for _ in steps]  # a step waits on the slot connection (RemoteGroup)
        self.endpoint = Endpoint(settings, cfg, settings.slots)
        self.fe, self.batcher = self.endpoint.fe, self.endpoint.batcher
        self.fe.gather = self._gather
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop  # the running loop, set by serve()
        self._stop = asyncio.Event()
        self._known = asyncio.Event()  # set by the owner's first attach or detach
        self._draining = False
        self._scrapes: dict[int, tuple[threading.Event, list]] = {}
        self._scrape_ids = iter(range(1, sys.maxsize))

    async def serve(self, http_port: int, grpc_port: int) -> int:
        s = self.settings
        self._loop = loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, self.drain)
        # Listen only once the group's state is known: a process that accepted connections before
        # its first ("attach", ...) would answer them 503 while the other front ends serve.
        threading.Thread(target=self._read, name="moe-ctl", daemon=True).start()
        self.ctl.send(("started", os.getpid()))
        known, stop = asyncio.ensure_future(self._known.wait()), asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([known, stop], return_when=asyncio.FIRST_COMPLETED)
        known.cancel()
        if self._stop.is_set():  # drained or orphaned before listening: never bind
            stop.cancel()
            return self.exit_code
        if not await self.endpoint.start(http_port, grpc_port, reuse_port=True):
            stop.cancel()
            return 1
        self.ctl.send(("listening", os.getpid()))
        await stop
        drain_end = time.monotonic() + (s.drain_timeout_s if self._draining else 0.0)
        if self._draining:
            drained = await self.batcher.wait_idle(s.drain_timeout_s)
            log.info("drain %s", "complete" if drained else f"timed out with {self.batcher.pending} requests left")
        await self.endpoint.stop(drain_end)
        log.info("stopped")
        return self.exit_code

    def drain(self) -> None:
        if not self._draining:
            log.info("draining %d requests in flight (up to %.1f s)", self.batcher.pending,
                     self.settings.drain_timeout_s)
        self._draining = True
        self.fe.set_ready(False, "the server is shutting down")
        self.batcher.refuse(GroupUnavailable("the server is shutting down"))
        self._stop.set()

    def _owner_gone(self) -> None:
        log.error("the owner process has exited; stopping")
        self.exit_code = 1
        why = GroupUnavailable("the server is shutting down (its owner process exited)")
        self.fe.set_ready(False, str(why))
        self.batcher.detach(why)
        self._draining = False
        self._stop.set()

    def _attach(self, group: RemoteGroup) -> None:
        self.endpoint.metrics.use_backend(group.backend)
        self.batcher.attach(group)
        if not self._draining:
            self.fe.set_ready(True)
        self._known.set()
        self.ctl.send(("attached", group.gen))  # the owner turns ready once every front end has

    def _detach(self, why: str) -> None:
        self.fe.set_ready(False, why)
        self.batcher.detach(GroupUnavailable(why))
        self._known.set()

    # ---- the control channel (a thread: reads block) ---------------------------------------

    def _read(self) -> None:
        loop = self._loop

        def call(fn, *args) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: serve() has returned
                loop.call_soon_threadsafe(fn, *args)

        while True:
            try:
                msg = self.ctl.conn.recv()
            except (EOFError, OSError):
                call(self._owner_gone)
                return
            kind = msg[0]
            if kind == "attach":
                _, gen, backend, count, direct = msg  # (direct: the owner's group reads and writes sources)
                fds = self.ctl.recv_fds(count)
                slots = []
                for j, fd in enumerate(fds):
                    slots.append(Slot.open(self.cfg, j, f"/proc/self/fd/{fd}"))
                    os.close(fd)
                group = RemoteGroup(gen, backend, slots, self.steps, self.sent,
                                    self.settings.step_timeout_s + STEP_ANSWER_MARGIN_S,
                                    direct_regions=direct, busy=self.busy)
                call(self._attach, group)
            elif kind == "regions":  # the shared-memory registry (before the group's state)
                self.fe.regions = Regions(RegionTable(self.ctl.recv_fds(1)[0]))
            elif kind == "detach":
                call(self._detach, msg[1])
            elif kind == "drain":
                call(self.drain)
            elif kind == "collect":
                self.ctl.send(("collected", msg[1], self.fe.snapshot()))
            elif kind == "scraped":
                waiting = self._scrapes.get(msg[1])
                if waiting is not None:
                    waiting[1].extend(msg[2])
                    waiting[0].set()

    def _gather(self) -> list:
        """Every front end's snapshot, from the owner (blocking; the Frontend calls it in a thread)."""
        request_id = next(self._scrape_ids)
        done: tuple[threading.Event, list] = (threading.Event(), [])
        self._scrapes[request_id] = done
        try:
            if not self.ctl.send(("scrape", request_id)) or not done[0].wait(FRONTEND_STOP_GRACE_S):
                log.warning("no metrics from the owner process; answering this process's own")
                return [self.fe.snapshot()]
            return done[1]
        finally:
            self._scrapes.pop(request_id, None)


def replica_main(index: int, settings: Settings, cfg: LayerConfig, ctl: Connection, steps: list[Connection],
                 http_port: int, grpc_port: int) -> None:
    """Entry point of front-end process `index` (spawned by service.fleet.Fleet)."""
    from service import logfilter
    from service.api.connections import ensure_file_limit

    name_process(f"moe-frontend{index}")
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s frontend{index} %(levelname)s %(name)s: %(message)s")
    logfilter.install()
    ensure_file_limit(settings.max_connections)
    set_frontend_threads()
    keep_freed_memory(settings.malloc_keep_mib)
    replica = Replica(index, settings, cfg, ctl, steps)
    sys.exit(asyncio.run(replica.serve(http_port, grpc_port)))

