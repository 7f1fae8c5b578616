"""Several front-end processes feeding one rank group (`--frontends N`), the owner's side.

One Python process cannot feed one GPU: its event loop saturates moving 8 MB per request
(bench/NOTES.md, issue 11). So N processes serve the same HTTP and gRPC ports (SO_REUSEPORT:
the kernel spreads connections over them), each with its own batcher and its own `slots` slots
of the one rank group, and every step still goes through the one sequencer, `group.run` in the
owner:

    owner = front end 0 (service.server)                front end i = 1..N-1 (service.replica)
      the rank group; group.run numbers the steps         HTTP + gRPC on the same ports, a batcher,
      control channel, one per front end   <---------->   its slots of the group (mapped through
        ("regions",) + the registry's fd (shm on),          the descriptors the owner sends)
        ("attach", gen, backend, count, direct) + the slots' fds (direct: the group's direct_regions),
        ("detach", why), ("drain",), ("collect", id),      ("started", pid), ("listening", pid),
        ("scraped", id, [Snapshot])                        ("attached", gen), ("scrape", id),
                                                             ("collected", id, Snapshot)
      one step connection per slot of a front end <--->   ("step", gen, n, T[, sources]) -> ("done", n, StepStats)
        (a thread here calls group.run on that slot)        | ("failed", n, kind, text)

- The group's slots: `slots * N`; front end i owns [i*slots, (i+1)*slots). A front end writes its
  rows into its slot, sends ("step", gen, n, T[, sources]); the slot's thread here runs `group.run` and
  answers (sources: the rows the ranks read from and write into clients' objects, --shm-direct:
  service.worker.direct). One hop more than front end 0's own steps (measured in bench/RESULTS.md, issue 11b).
- gen numbers the attached groups: a step of a front end that has not yet seen a restart (its
  rows are in the old group's memory) is refused ("failed", ..., "unavailable"), never run.
- Supervision: a front end that dies is restarted (its slots' threads are joined first, so no
  step of the dead one still runs on memory the new one writes). A front end sees its control
  channel close when the owner exits and stops at once (no orphans). drain() asks every front
  end to drain (not ready, new requests 503, in-flight ones finish) and exit.
- Metrics: every process keeps its own registry; gather() asks every front end for its Snapshot
  (service.metrics.merge adds them up), so /metrics and the statistics of any process are the
  server's.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recvfds, sendfds

import torch

from service.config import LayerConfig, Settings
from service.errors import ConfigError, GroupUnavailable, MoEError, WorkerError
from service.metrics import Snapshot
from service.worker.direct import MAX_BYTES
from service.worker.shm import SlotPool, remove_stale_slots

log = logging.getLogger("moe-serve.fleet")

FRONTEND_START_TIMEOUT_S = 120.0  # a front end imports torch, FastAPI and grpc, binds, answers
FRONTEND_STOP_GRACE_S = 5.0       # past the drain, how long a front end may take to exit
COLLECT_TIMEOUT_S = 2.0           # a front end's answer to "collect" (a scrape waits this at most)
ATTACH_TIMEOUT_S = 3.0            # attach() waits this long for every front end to serve
RESTART_BACKOFF_S = 1.0           # a dead front end is restarted after this, doubling up to MAX_BACKOFF_S
# Supervision, of the rank group (service.server) and of the front ends alike:
WATCH_INTERVAL_S = 0.5            # how often idle processes are checked
MAX_BACKOFF_S = 30.0              # a restart's back-off doubles up to this
HEALTHY_RESET_S = 60.0            # a process that served this long resets its back-off
PR_SET_NAME = 15                  # prctl option: the thread's name, shown in /proc/PID/comm


def direct_regions(settings: Settings, device: str) -> tuple[bool, str]:
    """Whether the ranks (on `device`) read and write clients' shared-memory regions themselves
    (Settings.shm_direct), and why: unset, on CUDA ranks only (on CPU ranks it would only move the
    front end's preadv into every rank: CPU ranks of one host each read every row)."""
    if settings.shared_memory != "system":
        return False, "no system shared memory"
    if settings.shm_direct is not None:
        return settings.shm_direct, f"shm_direct={str(settings.shm_direct).lower()} was asked for"
    if device == "cuda":
        return True, "shm_direct unset: on, the ranks are CUDA"
    return False, "shm_direct unset: off, the ranks are CPU"


WIRE_ARENA_DEFAULT_MIB = 256  # a front end's wire arena where the ranks are CUDA (Settings.wire_arena_mib)
WIRE_ARENA_MAX_MIB = MAX_BYTES // 2 // (1 << 20)  # every front end's arena together: a rank page-locks each
                                                  # (half its bound on mapped regions; the rest is clients')


def wire_arena_mib(settings: Settings, device: str, frontends: int) -> tuple[int, str]:
    """Each front end's wire arena in MiB (Settings.wire_arena_mib; 0: none), and why: unset, on where
    the ranks are CUDA (they DMA the rows from it; WIRE_ARENA_DEFAULT_MIB, or the front ends' share of
    WIRE_ARENA_MAX_MIB when smaller), off on CPU ranks (there it would only move the front end's copy
    of the rows into every rank). ConfigError when a size asked for makes the front ends' arenas
    together more than a rank keeps page-locked for sources."""
    if settings.wire_arena_mib is None:  # (with many front ends each gets its share of the bound)
        mib, why = (min(WIRE_ARENA_DEFAULT_MIB, WIRE_ARENA_MAX_MIB // frontends), "unset: on, the ranks are CUDA") \
            if device == "cuda" else (0, "unset: off, the ranks are CPU")
    else:
        mib, why = settings.wire_arena_mib, f"wire_arena_mib={settings.wire_arena_mib} was asked for"
    if mib * frontends > WIRE_ARENA_MAX_MIB:
        raise ConfigError(f"wire_arena_mib={mib} with {frontends} front-end processes is {mib * frontends} MiB of "
                          f"arenas, which every rank page-locks; at most {WIRE_ARENA_MAX_MIB} MiB in all: lower "
                          f"wire_arena_mib or frontends")
    return mib, why


def backoff_s(base: float, failures: int) -> float:
    """The wait before a restart after `failures` failed ones: `base`, doubling, at most MAX_BACKOFF_S."""
    return min(MAX_BACKOFF_S, base * 2 ** failures)


def set_frontend_threads() -> None:
    """Torch threads of a front-end process: one, on every device. A front end only copies and checks
    rows, in several step threads at once, and each calling thread's parallel region gets an OpenMP
    team of its own, whose workers spin after it: with a share of the cores per process (16 // 4 on
    an H200 host) 4 front ends ran at 290-373 % CPU each and served 95-113k tokens/s at concurrency
    16, against 237-263k with one thread (bench/NOTES.md issue 11h; bench/RESULTS.md, the fourth
    session of 2026-12-01, calls 3-4). One thread copies a 512-row
    bf16 request in ~0.3 ms and screens it in ~0.2 ms."""
    torch.set_num_threads(1)


def name_process(name: str) -> None:
    """Set /proc/PID/comm (what ps and top show), so a front end is told from a rank at a glance."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Channel:
    """A duplex Connection whose sends are serialized (several threads send); a message may be
    followed by descriptors (SCM_RIGHTS), read by the one reader right after the message."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple, fds: list[int] | None = None) -> bool:
        """False if the other end is gone."""
        try:
            with self._lock:
                self.conn.send(msg)
                if fds:
                    import socket

                    with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                        sendfds(sock, fds)
            return True
        except OSError:
            return False

    def recv_fds(self, count: int) -> list[int]:
        import socket

        with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            return recvfds(sock, count)


class SlotShare:
    """A rank group seen through some of its slots: what front end 0's batcher runs its steps on
    while the other front ends use the rest (acquire_slot / run / release, as WorkerGroup)."""

    def __init__(self, group, slots: list):
        self.group = group
        self.direct_regions = getattr(group, "direct_regions", False)
        self._free = SlotPool(slots)

    def acquire_slot(self, timeout: float | None = None):
        return self._free.get(timeout, alive=self.group.alive)

    def release(self, slot) -> None:
        self._free.put(slot)

    def run(self, slot, T: int, sources=()):
        return self.group.run(slot, T, sources)

    async def run_async(self, slot, T: int, sources=(), executor=None):
        return await self.group.run_async(slot, T, sources, executor)


class _Member:
    """One front-end process i >= 1 as the owner sees it."""

    def __init__(self, index: int, proc, ctl: Channel, steps: list[Connection]):
        self.index, self.proc, self.ctl, self.steps = index, proc, ctl, steps
        self.threads: list[threading.Thread] = []
        self.started = time.monotonic()
        self.listened = threading.Event()  # it bound its ports (after it was told the group's state)
        self.attached = 0       # the last generation it confirmed serving ("attached", gen)

    @property
    def listening(self) -> bool:
        return self.listened.is_set()


class Fleet:
    """Front ends 1..N-1: spawned, fed with steps, told the group's state, restarted, drained."""

    def __init__(self, settings: Settings, cfg: LayerConfig, count: int,
                 own_snapshot: Callable[[], Snapshot], on_failure: Callable[[object, BaseException], None],
                 regions_fd: int | None = None):
        self.settings, self.cfg, self.count = settings, cfg, count
        self.regions_fd = regions_fd  # the shared-memory registry's file (service.api.regions), if on
        self.own_snapshot, self.on_failure = own_snapshot, on_failure
        self.slots = settings.slots
        self.http_port = self.grpc_port = 0
        self._members: dict[int, _Member] = {}
        self._lock = threading.Lock()          # guards _group, _gen, _members
        self._acks = threading.Condition(self._lock)  # a front end confirmed an attach
        self._group = None
        self._gen = 0
        self._why = "the rank group is starting"
        self._stopping = False
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}  # collect id -> its answer
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="moe-fleet")  # scrapes asked by front ends
        self._failures: dict[int, int] = {}
        self._spawning = threading.Lock()      # held while a front end is being started

    # ---- life cycle ------------------------------------------------------------------------

    def start(self, http_port: int, grpc_port: int) -> None:
        """Spawn front ends 1..N-1 on these (bound) ports and wait until each listens; MoEError if
        one does not (a first start that fails is a configuration problem)."""
        self.http_port, self.grpc_port = http_port, grpc_port
        for i in range(1, self.count):
            if self._stopping:
                return
            self._spawn(i)
        threading.Thread(target=self._watch, name="moe-fleet-watch", daemon=True).start()

    def _spawn(self, i: int) -> None:
        with self._spawning:  # stop() waits for a start in progress (it would miss its process)
            if not self._stopping:  # (stop() may have come since the caller looked)
                self._spawn_one(i)

    def _spawn_one(self, i: int) -> None:
        from service.replica import replica_main

        ctx = mp.get_context("spawn")
        ctl_here, ctl_there = ctx.Pipe()
        pairs = [ctx.Pipe() for _ in range(self.slots)]
        proc = ctx.Process(target=replica_main, name=f"moe-frontend{i}", daemon=False,
                           args=(i, self.settings, self.cfg, ctl_there, [b for _, b in pairs],
                                 self.http_port, self.grpc_port))
        proc.start()
        ctl_there.close()
        for _, b in pairs:
            b.close()
        deadline = time.monotonic() + FRONTEND_START_TIMEOUT_S
        member = _Member(i, proc, Channel(ctl_here), [a for a, _ in pairs])
        if self._expect_started(member, deadline):  # imported, reading its control channel
            # From here on it may send anything (a scrape asked by a client of its gRPC port, bound
            # before its HTTP one, can come before "listening"): one reader takes every message.
            reader = threading.Thread(target=self._read, args=(member,), daemon=True, name=f"moe-fe{i}-ctl")
            reader.start()
            member.threads.append(reader)
            with self._lock:  # held across the send: detach() (and so the group's close) cannot come in between
                self._members[i] = member
                self._send_state(member)
            # It binds its listeners now that it knows the group's state: it never listens unattached
            # while the group is up (it would answer 503 beside front ends that serve).
            while not member.listened.wait(WATCH_INTERVAL_S / 5):
                if not proc.is_alive() or time.monotonic() > deadline:
                    break
        if not member.listening:
            with self._lock:
                self._members.pop(i, None)
            proc.kill()
            proc.join(5)
            for t in member.threads:  # the reader ends at the closed channel's EOF
                t.join(5)
            for conn in (ctl_here, *member.steps):
                conn.close()
            if self._stopping:
                return
            raise MoEError(f"front end {i} did not start (exit code {proc.exitcode}); see its log above")
        for j, conn in enumerate(member.steps):
            t = threading.Thread(target=self._serve_slot, args=(member, j, conn), daemon=True,
                                 name=f"moe-fe{i}-slot{j}")
            t.start()
            member.threads.append(t)
        log.info("front end %d listening (pid %d)", i, proc.pid)

    def stop(self) -> None:
        """Stop every front end (drained already, or not): ask, then kill what is left."""
        self.drain()
        # A start in progress ends soon: its front end, registered after drain() looked, is sent
        # ("drain",) with its state (_send_state) and exits, listening or not.
        if self._spawning.acquire(timeout=FRONTEND_STOP_GRACE_S + 5):
            self._spawning.release()
        with self._lock:
            members = list(self._members.values())
        deadline = time.monotonic() + FRONTEND_STOP_GRACE_S
        for m in members:
            m.proc.join(max(0.0, deadline - time.monotonic()))
            if m.proc.is_alive():
                log.warning("front end %d did not exit; killing it", m.index)
                m.proc.kill()
                m.proc.join(5)
            m.ctl.conn.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def drain(self) -> None:
        """Ask every front end to drain and exit (SIGTERM of the server); they are not restarted."""
        self._stopping = True
        with self._lock:
            members = list(self._members.values())
        for m in members:
            m.ctl.send(("drain",))

    def wait_exit(self, timeout: float) -> bool:
        """Wait for every front end to exit; False if one is still running after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            members = list(self._members.values())
        for m in members:
            m.proc.join(max(0.0, deadline - time.monotonic()))
        return not any(m.proc.is_alive() for m in members)

    def _watch(self) -> None:
        """Restart a front end that died (back-off doubling while it keeps dying), until stop."""
        while not self._stopping:
            with self._lock:
                members = list(self._members.values())
            wait([m.proc.sentinel for m in members], timeout=WATCH_INTERVAL_S)
            for m in members:
                if m.proc.is_alive() or self._stopping:
                    continue
                log.error("front end %d (pid %d) exited with %s; restarting it", m.index, m.proc.pid, m.proc.exitcode)
                with self._lock:
                    del self._members[m.index]
                for t in m.threads:  # a step of the dead one still in group.run ends within its deadline
                    t.join()
                for conn in (m.ctl.conn, *m.steps):
                    conn.close()
                remove_stale_slots()  # its wire arena (its lock died with it); the ranks let it go at a prune
                failures = 0 if time.monotonic() - m.started > HEALTHY_RESET_S else self._failures.get(m.index, 0)
                while not self._stopping:
                    time.sleep(backoff_s(RESTART_BACKOFF_S, failures))
                    failures += 1
                    self._failures[m.index] = failures
                    if self._stopping:
                        return
                    try:
                        self._spawn(m.index)
                        break
                    except MoEError as err:
                        log.error("%s; trying again", err)

    # ---- the group's state -----------------------------------------------------------------

    def attach(self, group, gen: int) -> SlotShare:
        """Serve every front end with `group` (started, warmed up) as generation `gen`; front end 0's
        share of its slots. Returns once every front end serves it (each confirms with ("attached",
        gen); one that does not within ATTACH_TIMEOUT_S is logged and serves when it does), so the
        owner turns ready last: a client told "ready" by the owner is not answered 503 by another
        process (the owner serves its share, `share(group)`, during this wait already: Frontend.accept).
        Blocking: call it in a thread."""
        with self._lock:
            self._group, self._gen = group, gen
            members = list(self._members.values())
        for m in members:
            self._send_attach(m, group, gen)
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        with self._acks:
            while True:
                late = [m for m in members if m.attached < gen and m.proc.is_alive()
                        and self._members.get(m.index) is m]  # (listening or not: each reads its channel)
                left = deadline - time.monotonic()
                if not late or left <= 0 or self._stopping:
                    break
                self._acks.wait(min(left, WATCH_INTERVAL_S))
        for m in late:
            log.warning("front end %d did not confirm the rank group within %.0f s; it serves once it does",
                        m.index, ATTACH_TIMEOUT_S)
        return self.share(group)

    def share(self, group) -> SlotShare:
        """Front end 0's (the owner's) share of the group's slots."""
        return SlotShare(group, group.slots[:self.slots])

    def _send_attach(self, m: _Member, group, gen: int) -> None:
        mine = group.slots[m.index * self.slots:(m.index + 1) * self.slots]
        m.ctl.send(("attach", gen, group.backend, len(mine), bool(getattr(group, "direct_regions", False))),
                   fds=[s.owner_fd for s in mine])

    def _send_state(self, m: _Member) -> None:
        """The group's state to a front end that has just started (under the lock)."""
        if self._stopping:  # stop() began while it started (drain() may not have seen it): the
            m.ctl.send(("drain",))  # drain alone, so it never learns a state and never binds
            return
        if self.regions_fd is not None:  # before the state: it binds its ports only after that
            m.ctl.send(("regions",), fds=[self.regions_fd])
        if self._group is not None:
            self._send_attach(m, self._group, self._gen)
        else:
            m.ctl.send(("detach", self._why))

    @staticmethod
    def _expect_started(m: _Member, deadline: float) -> bool:
        """Wait for front end m's ("started", pid) (its first message) until `deadline`; False if it
        exits, fails or is late."""
        conn = m.ctl.conn
        if conn not in wait([conn, m.proc.sentinel], timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return False
        return bool(msg) and msg[0] == "started"

    def detach(self, why: str) -> None:
        with self._lock:
            self._group, self._why = None, why
            members = list(self._members.values())
        for m in members:
            m.ctl.send(("detach", why))

    # ---- steps -----------------------------------------------------------------------------

    def _serve_slot(self, m: _Member, j: int, conn: Connection) -> None:
        """Front end m's slot j: run each step it asks for on the group's slot m*slots + j."""
        index = m.index * self.slots + j
        while True:
            try:
                _, gen, n, T, *more = conn.recv()  # (sources follow T when there are any)
                sources = more[0] if more else ()
            except (EOFError, OSError):
                return
            with self._lock:
                group = self._group if gen == self._gen else None
                why = self._why if self._group is None else "the rank group was restarted"
            if group is None:
                reply: tuple = ("failed", n, "unavailable", why)
            else:
                try:
                    reply = ("done", n, group.run(group.slots[index], T, sources))
                except (WorkerError, GroupUnavailable) as exc:
                    reply = ("failed", n, "worker" if isinstance(exc, WorkerError) else "unavailable", str(exc))
                    self.on_failure(group, exc)
                except Exception as exc:  # noqa: BLE001  any failure of a step fails the group
                    reply = ("failed", n, "unavailable", f"the step failed: {type(exc).__name__}: {exc}")
                    self.on_failure(group, exc)
            try:
                conn.send(reply)
            except OSError:
                return

    # ---- control messages and metrics ------------------------------------------------------

    def _read(self, m: _Member) -> None:
        while True:
            try:
                msg = m.ctl.conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "listening":
                m.listened.set()
            elif msg[0] == "attached":
                with self._acks:
                    m.attached = max(m.attached, msg[1])
                    self._acks.notify_all()
            elif msg[0] == "collected":
                future = self._pending.pop(msg[1], None)
                if future is not None:
                    future.set_result(msg[2])
            elif msg[0] == "scrape":  # not in this thread: gathering waits for this reader's own answers
                try:
                    self._pool.submit(self._answer_scrape, m, msg[1])
                except RuntimeError:  # stopping: the pool is shut down
                    return

    def _answer_scrape(self, m: _Member, request_id: int) -> None:
        m.ctl.send(("scraped", request_id, self.gather()))

    def gather(self) -> list[Snapshot]:
        """Every front end's snapshot, the owner's first; one that does not answer in
        COLLECT_TIMEOUT_S is left out (logged)."""
        with self._lock:
            members = [m for m in self._members.values() if m.listening]
        asked = []
        for m in members:
            request_id = next(self._ids)
            future: Future = Future()
            self._pending[request_id] = future
            if m.ctl.send(("collect", request_id)):
                asked.append((m, request_id, future))
            else:
                self._pending.pop(request_id, None)
        snapshots = [self.own_snapshot()]
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        for m, request_id, future in asked:
            try:
                snapshots.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                self._pending.pop(request_id, None)
                log.warning("front end %d sent no metrics within %.0f s; left out of this scrape",
                            m.index, COLLECT_TIMEOUT_S)
        return snapshots
