"""The rank group: R rank processes started, fed, watched and stopped by one parent.

    parent                                   rank r (service.worker.rank)
      TCPStore on a free port  ------------>   process group (gloo / NCCL), weights slice
      slots in /dev/shm        <----------->   reads rows [start_r, start_r + n_r), writes out
      ("step", seq, slot, T,   ------------>   layer step (and the rows of `sources` from and
        sources)                                   to clients' objects: service.worker.direct)
                               <------------   ("done", rank, seq, stats) | ("error", rank, tb)
                                                   | ("refused", rank, why, "backend" | "weights") at start

Every wait on the ranks is bounded and also watches the processes' sentinels, so a rank that
dies, raises or stalls turns into a `WorkerError` carrying its traceback, never a hang; a rank
that refuses its settings (`backend="fused"` where fused cannot run) into `BackendUnavailable`.
After an error the group is dead: `close()` it and start a new one.

With `direct_regions` (--shm-direct; the server decides, service.fleet.direct_regions: by default on
where the ranks are CUDA) the batcher may pass `sources` to `run`: rows of the step that
the ranks read from a client's shared-memory object and whose answer they write into another, in
place of the slot's (service.worker.direct); their report (a bad row, an object that changed) comes
back merged over the ranks in StepStats.sources.

A stopped rank (SIGSTOP, a livelock) is alive but silent, so the bounds are tight: a step gets
`step_deadline_s()` (10x the slowest recent step, at least 5 s, at most step_timeout_s), and an
idle group is pinged by `heartbeat()` (every rank must answer within 2 s).

Nothing listens beyond loopback: the rendezvous store serves a socket bound to 127.0.0.1 here
(TCPStore's own server binds every interface whatever host it is given), and the ranks' gloo
and NCCL sockets use the loopback interface (service.worker.rank).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import itertools
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import wait

import torch

from service.config import LayerConfig, usable_cpus
from service.errors import BackendUnavailable, GroupUnavailable, InvalidInput, MoEError, WeightsError, WorkerError
from service.metrics import STEP_PHASES
from service.moe.hostcomm import HostPeers
from service.moe.layer import BACKENDS
from service.worker.direct import Report, Source, merge
from service.worker.rank import RankOptions, now, rank_main
from service.worker.shm import Slot, SlotPool, create_slots, remove_slots, remove_stale_slots, unlink_slots

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # how long close() waits for ranks to exit before killing them
# A step's deadline once steps have been measured: STEP_DEADLINE_FACTOR x the slowest of the
# last STEP_HISTORY steps, never below STEP_DEADLINE_FLOOR_S (a busy 2-core CI box slows a
# 30 ms CPU step a few times over, a GPU step is milliseconds) nor above step_timeout_s.
STEP_DEADLINE_FACTOR = 10.0
STEP_DEADLINE_FLOOR_S = 5.0
STEP_HISTORY = 64
EXIT_WAIT_S = 1.0  # how long a rank whose pipe closed is given to be reaped, to name how it ended
HEARTBEAT_TIMEOUT_S = 2.0  # an idle rank answers a ping in well under a millisecond
STOPPED_STATES = ("T", "t")  # /proc/PID/stat: stopped by a signal, stopped by a tracer


def _process_state(pid: int | None) -> str:
    """The kernel's one-letter state of process `pid` (R, S, T, ...); "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]  # the name before ")" may hold spaces
    except (OSError, IndexError):
        return ""


def _exit(proc) -> str:
    """How a rank's process ended, once the kernel has said: its pipe closes a moment before the
    process can be reaped, so wait for that briefly ("exit code None" said nothing)."""
    proc.join(timeout=EXIT_WAIT_S)
    code = proc.exitcode
    if code is None:
        return "its pipe closed; the process has not exited yet"
    if code < 0:
        try:
            return f"killed by signal {-code}, {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _poll(conn) -> bool:
    """conn.poll(), False once the pipe is closed (by _kill in another thread)."""
    try:
        return conn.poll()
    except OSError:
        return False


async def readable(fds: list[int], ends: list[int], deadline: float) -> bool:
    """On the running event loop: wait until every descriptor of `fds` is readable (True), or one of
    `ends` is (a process's sentinel) or time.monotonic() passes `deadline` (False). Nothing stays
    registered with the loop on return, cancelled or not."""
    loop = asyncio.get_running_loop()
    waiting = set(fds)
    done = loop.create_future()

    def ready(fd: int) -> None:
        loop.remove_reader(fd)
        waiting.discard(fd)
        if not waiting and not done.done():
            done.set_result(True)

    def ended() -> None:
        if not done.done():
            done.set_result(False)

    added: list[int] = []
    try:
        for fd in fds:
            loop.add_reader(fd, ready, fd)
            added.append(fd)
        for fd in ends:
            loop.add_reader(fd, ended)
            added.append(fd)
        try:
            async with asyncio.timeout_at(loop.time() + max(0.0, deadline - time.monotonic())):
                return await done
        except TimeoutError:
            return False
    finally:
        for fd in added:
            loop.remove_reader(fd)


@dataclasses.dataclass
class StepStats:
    """What one step cost, as measured on rank 0."""

    seq: int
    tokens: int
    backend: str
    layer_s: float                 # sum of the stages: the layer on the device
    stages: dict[str, float]       # stage -> seconds
    exposed_comm_s: float          # communication not hidden by compute (see the backend)
    wall_s: float = 0.0            # parent's view: send to last answer
    rank_wall_s: float = 0.0       # rank 0's view: step message received to answer ready to send
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # STEP_PHASES -> seconds; sum = wall_s
    behind: bool = False           # rank 0 enqueued it while the step before was in flight (rank lookahead)
    overlapped: bool = False       # ... and the step before's layer was still running on the device then
    # per source of the step (by index): its first row not finite, or why it could not be used
    sources: dict[int, Report] = dataclasses.field(default_factory=dict)


def step_phases(sent: float, stamps: list[tuple[float, ...]], collected: float, returned: float) -> dict[str, float]:
    """A step's wall cut at its timestamps (service.metrics.STEP_PHASES): the owner's send, rank 0's
    six stamps (service.worker.rank), the last rank's answer, the owner holding every answer, run's return."""
    cuts = (sent, *stamps[0], max(s[-1] for s in stamps), collected, returned)
    return {phase: b - a for phase, (a, b) in zip(STEP_PHASES, itertools.pairwise(cuts), strict=True)}


def cpu_host_peers(ctx, cfg: LayerConfig, device: str, timeout_s: float) -> HostPeers | None:
    """CPU ranks (R > 1) share one scratch region and R semaphores, made here before they spawn
    (service.moe.hostcomm: their collectives through shared memory); None on CUDA (NCCL) or R = 1."""
    return HostPeers.create(ctx, cfg, timeout_s) if device == "cpu" and cfg.R > 1 else None


class WorkerGroup:
    """R rank processes serving one MoE layer; see docs/CONTRACTS.md for the API."""

    def __init__(self, cfg: LayerConfig, *, device: str = "cpu", weights: str | None = None,
                 weights_prefix: str = "", seed: int = 0, backend: str = "serial", slots: int = 2,
                 step_timeout_s: float = 60.0, start_timeout_s: float = 300.0,
                 log_level: str | None = None, lookahead: int = 2, copy_streams: bool = False,
                 direct_regions: bool = False, malloc_keep_mib: int = 0, idle_spin_s: float = 0.0):
        if backend not in BACKENDS:
            raise InvalidInput(f"backend must be auto, serial or fused, got {backend!r}")
        self.requested_backend = backend  # the ranks decide (and log why); see service.worker.rank
        self.cfg, self.device = cfg, device
        self.weights, self.weights_prefix, self.seed = weights, weights_prefix, seed
        self.backend = "serial"  # what the ranks run, known once they are up
        self.step_timeout_s, self.start_timeout_s = step_timeout_s, start_timeout_s
        self.log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        if lookahead not in (1, 2):
            raise InvalidInput(f"lookahead must be 1 or 2, got {lookahead!r}")
        self.num_slots = slots
        self.requested_lookahead = lookahead  # CUDA ranks' steps in flight; `lookahead` is what they run
        self.lookahead = 1
        self.requested_copy_streams = copy_streams  # CUDA ranks' copies beside the layers; `copy_streams`: run
        self.copy_streams = False
        self.direct_regions = direct_regions  # the batcher may pass sources (--shm-direct)
        self.malloc_keep_mib = malloc_keep_mib  # each rank's freed memory kept for reuse (service.worker.malloc)
        if not idle_spin_s >= 0:
            raise InvalidInput(f"idle_spin_s must be >= 0, got {idle_spin_s!r}")
        self.idle_spin_s = idle_spin_s  # CUDA ranks: poll for the next step this long before blocking
        self.seq = 0
        self.alive = False
        self.pids: list[int] = []
        self._procs: list = []
        self._conns: list = []
        self._slots: list[Slot] = []
        self._free = SlotPool()
        self._send_lock = threading.Lock()     # seq order: steps are sent in the order of their seq
        self._answered = threading.Condition()  # guards _reading, _answers, _in_flight
        self._reading = False                   # a thread is reading the ranks' next answer
        self._answers: dict[int, tuple[list, float]] = {}  # seq -> the ranks' answers and when read, until taken
        self._in_flight = 0                     # steps sent and not yet taken by their thread
        self._store: torch.distributed.TCPStore | None = None  # the ranks' rendezvous, while started
        self._failure: WorkerError | None = None
        # close() and _kill() one at a time: a failing step's thread kills the ranks while the
        # supervisor, woken by another step's "not running", closes the group; two threads closing
        # the same pipes raised out of close() (and stopped the server's supervision for good).
        self._life = threading.RLock()
        self._step_walls: collections.deque[float] = collections.deque(maxlen=STEP_HISTORY)

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the ranks and wait until each has joined the group and loaded its weights.

        On any failure (a rank's, a timeout, or an exception here, KeyboardInterrupt included)
        everything started so far is stopped and removed before the exception propagates.
        """
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        import torch.distributed as dist

        cfg = self.cfg
        remove_stale_slots()
        # The parent hosts the rendezvous store on a socket it bound itself: TCPStore binds every
        # interface when it makes its own. Port 0 picks a free port without a race; the store
        # takes the descriptor over (and closes it).
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        self._store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True,
                                    timeout=datetime.timedelta(seconds=self.start_timeout_s),
                                    wait_for_workers=False, master_listen_fd=listener.detach())
        self._slots = create_slots(cfg, self.num_slots)
        for slot in self._slots:
            self._free.put(slot)
        threads = max(1, usable_cpus() // cfg.R)  # (a CUDA rank's host work: at most 4)
        threads = threads if self.device == "cpu" else min(4, threads)
        ctx = mp.get_context("spawn")
        opts = RankOptions(cfg=cfg, device=self.device, store_host="127.0.0.1",
                           store_port=port, slot_paths=tuple(s.path for s in self._slots),
                           weights=self.weights, weights_prefix=self.weights_prefix, seed=self.seed,
                           backend=self.requested_backend, timeout_s=self.start_timeout_s, threads=threads,
                           log_level=self.log_level, lookahead=self.requested_lookahead,
                           copy_streams=self.requested_copy_streams, malloc_keep_mib=self.malloc_keep_mib,
                           idle_spin_s=self.idle_spin_s,
                           host=cpu_host_peers(ctx, cfg, self.device, self.start_timeout_s))
        for rank in range(cfg.R):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, opts, child_end), daemon=True,
                               name=f"moe-rank{rank}")
            try:
                proc.start()
            except BaseException:  # only started ranks are tracked: close() joins what it holds
                parent_end.close()
                child_end.close()
                raise
            self._procs.append(proc)
            self._conns.append(parent_end)
            child_end.close()
        log.info("started %d ranks on %s (%s), waiting for them to load", cfg.R, self.device, cfg.describe())
        t0 = time.monotonic()
        infos = self._collect("ready", self.start_timeout_s, "start")
        # Every process has mapped the slots: unlink the files now, so nothing is left in
        # /dev/shm whatever happens to this process later (the mappings stay valid; the
        # descriptors stay open until close(), for the other front-end processes: `slots`).
        unlink_slots(self._slots)
        self.pids = [info["pid"] for info in infos]
        self.backend = infos[0]["backend"]
        self.lookahead = infos[0]["lookahead"]
        self.copy_streams = infos[0]["copy_streams"]
        self.alive = True
        log.info("rank group ready in %.1f s: %s", time.monotonic() - t0,
                 ", ".join(f"rank{r} pid {i['pid']} {i['device']}" for r, i in enumerate(infos)))

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the slots. Idempotent, and safe
        beside a step's thread that is killing the ranks (it waits for that kill)."""
        with self._life:
            was_alive, self.alive = self.alive, False
            if was_alive:
                for conn in self._conns:
                    try:
                        conn.send(("stop",))
                    except OSError:
                        pass
            deadline = time.monotonic() + (STOP_GRACE_S if was_alive else 0.0)
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill()
            remove_slots(self._slots)
            self._slots = []
            self._free = SlotPool()
            self._store = None

    @property
    def slots(self) -> list[Slot]:
        """Every slot, in index order; each one's `owner_fd` maps it in another process until close()."""
        return list(self._slots)

    def poll(self) -> bool:
        """True while the group runs and every rank process is alive (cheap; no message sent)."""
        return self.alive and all(proc.is_alive() for proc in self._procs)

    def _kill(self) -> None:
        """Kill the ranks and close their pipes (once, whichever thread comes first)."""
        self.alive = False
        with self._life:
            for proc in self._procs:
                if proc.is_alive():
                    proc.kill()
            for proc in self._procs:
                proc.join(timeout=5.0)
            for conn in self._conns:
                conn.close()
            self._procs, self._conns = [], []

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- steps -------------------------------------------------------------------------------
    def acquire_slot(self, timeout: float | None = None) -> Slot:
        return self._free.get(timeout, alive=self.alive)

    def release(self, slot: Slot) -> None:
        self._free.put(slot)

    def step_deadline_s(self) -> float:
        """How long the next step may take before the group is declared failed."""
        if not self._step_walls:
            return self.step_timeout_s
        derived = max(STEP_DEADLINE_FLOOR_S, STEP_DEADLINE_FACTOR * max(self._step_walls))
        return min(self.step_timeout_s, derived)

    def heartbeat(self, timeout: float = HEARTBEAT_TIMEOUT_S) -> bool:
        """Ping every rank unless a step is running (its deadline watches the ranks then).

        True when every rank answered, False when skipped; a rank that does not answer in
        `timeout` fails the group with WorkerError, as a failed step does."""
        if not self._send_lock.acquire(blocking=False):
            return False
        try:  # no step can be sent meanwhile; skip if one is still in flight (a pong would land among its answers)
            with self._answered:
                if self._in_flight:
                    return False
            if not self.alive:
                raise self._failure or GroupUnavailable("the rank group is not running")
            self._send(("ping", self.seq))
            self._collect_or_fail("pong", timeout, f"heartbeat after step {self.seq}")
        finally:
            self._send_lock.release()
        return True

    def _send(self, msg: tuple) -> None:
        for conn in self._conns:
            try:
                conn.send(msg)
            except OSError:
                pass  # a dead rank; _collect reports it with its exit code

    def _collect_or_fail(self, kind: str, timeout: float, what: str) -> list:
        """_collect; on failure the group is dead: remember why, kill the ranks, raise."""
        try:
            return self._collect(kind, timeout, what)
        except WorkerError as err:
            self._failure = err
            self._kill()
            raise

    def run(self, slot: Slot, T: int, sources: tuple[Source, ...] | list[Source] = ()) -> StepStats:
        """Run one step on rows [0, T) of the slot; the answer is in slot.out[:T] on return, but for the
        rows of `sources`, which the ranks read from and answer into the objects they name (on return
        every rank has written them; StepStats.sources says which failed).

        Several threads may run steps on different slots: each step is sent as soon as it is
        called (under a lock that only orders the seq numbers), so the next step's control message
        already waits in the ranks' pipes while they compute this one, and the ranks start it
        without a round trip through this process. Ranks answer in seq order; whichever waiting
        thread reads an answer that is not its own leaves it for its owner."""
        self._check_T(T)
        with self._send_lock:
            seq, sent = self._post(slot, T, sources)
        answers, collected = self._await(seq)
        return self._stats(seq, T, sent, answers, collected, sources)

    async def run_async(self, slot: Slot, T: int, sources: tuple[Source, ...] | list[Source] = (),
                        executor: concurrent.futures.Executor | None = None) -> StepStats:
        """`run` on the event loop, for a step sent while no other is in flight: the ranks' answer wakes the
        loop itself (readers on the pipes), with no thread between; at one client, a thread's two hand-offs
        cost ~0.07-0.3 ms each on a GPU host whose idle threads wake slowly (bench/NOTES.md, twenty-first
        session). Otherwise (another step in flight or its answer being read, a heartbeat under way) the
        step waits in a thread of `executor` (`run`; the caller's pool, sized to its steps: the loop's
        default executor is shared), as do steps sent while this one waits.

        The loop reads only what is already there (every pipe readable, no rank's process ended); a
        rank's "error" message read there kills the group from a thread. A rank's end or the deadline
        hands the read to a thread of its own (naming a dead rank joins it), which neither a cancel nor a
        busy executor can keep from running; a cancelled step, or one that fails, leaves a thread to take
        its answer, so the ranks' answers keep their order."""
        loop = asyncio.get_running_loop()
        self._check_T(T)
        posted = self._post_alone(slot, T, sources)
        if posted is None:
            return await loop.run_in_executor(executor, self.run, slot, T, sources)
        seq, sent = posted
        reading = True  # this step holds the reader's role (`_reading`) and nobody reads for it yet
        try:
            limit = self.step_deadline_s()
            deadline = time.monotonic() + limit
            if await self._answered_on_loop(deadline):
                reading = False  # (the read gives the role back, whatever happens)
                try:
                    self._read_next(seq, limit, max(deadline, time.monotonic() + 1.0), False)
                except WorkerError:
                    threading.Thread(target=self._kill, name="moe-kill-ranks", daemon=True).start()
                    raise
            else:
                read: concurrent.futures.Future = concurrent.futures.Future()
                read.set_running_or_notify_cancel()  # running: a cancel of the awaiting task cannot remove it
                threading.Thread(target=self._read_into, args=(read, seq, limit, deadline),
                                 name="moe-read-step", daemon=True).start()
                reading = False
                await asyncio.wrap_future(read)
        except BaseException:
            if reading:
                with self._answered:
                    self._reading = False
                    self._answered.notify_all()
            threading.Thread(target=self._drop, args=(seq,), name="moe-drop-answer", daemon=True).start()
            raise
        with self._answered:  # alone in flight: the ranks' next answer was this step's
            answers, collected = self._answers.pop(seq)
            self._in_flight -= 1
        return self._stats(seq, T, sent, answers, collected, sources)

    def _read_into(self, read: concurrent.futures.Future, seq: int, limit: float, deadline: float) -> None:
        """`_read_next` in a thread, its outcome in `read`."""
        try:
            self._read_next(seq, limit, deadline)
        except BaseException as exc:  # noqa: BLE001  the awaiting step raises it
            read.set_exception(exc)
        else:
            read.set_result(None)

    def _check_T(self, T: int) -> None:
        if not 1 <= T <= self.cfg.tokens_per_step:
            raise InvalidInput(f"a step takes 1..{self.cfg.tokens_per_step} tokens, got {T}")

    def _post(self, slot: Slot, T: int, sources) -> tuple[int, float]:
        """Send the step (the caller holds _send_lock); its seq and when it was sent."""
        if not self.alive:
            raise self._failure or GroupUnavailable("the rank group is not running")
        self.seq += 1
        seq = self.seq
        sent = now()
        self._send(("step", seq, slot.index, T, tuple(sources)))
        with self._answered:
            self._in_flight += 1
        return seq, sent

    def _post_alone(self, slot: Slot, T: int, sources) -> tuple[int, float] | None:
        """`_post` if no other step is in flight and nobody sends (a heartbeat may hold the lock for a
        ping's round trip: never wait for it on the loop), this step then holding the reader's role for
        its own answer, the next the ranks give; None otherwise."""
        if not self._send_lock.acquire(blocking=False):
            return None
        try:
            with self._answered:
                if self._in_flight or self._reading:
                    return None
                posted = self._post(slot, T, sources)
                self._reading = True
                return posted
        finally:
            self._send_lock.release()

    async def _answered_on_loop(self, deadline: float) -> bool:
        """Wait on the event loop until every rank's pipe is readable and no rank's process has ended
        (True), or one has ended or time.monotonic() passed `deadline` (False). The loop watches copies of
        the descriptors: a _kill in another thread closes the pipes, and a closed descriptor's number,
        reused meanwhile, must never stay registered with the loop. (The last look uses
        multiprocessing's wait, not select.select: a busy server's descriptors pass FD_SETSIZE.)"""
        pipes: list[int] = []
        ends: list[int] = []
        try:
            try:
                for conn in self._conns:
                    pipes.append(os.dup(conn.fileno()))
                for proc in self._procs:
                    ends.append(os.dup(proc.sentinel))
            except (OSError, ValueError):  # closed by _kill meanwhile: the thread's read tells why
                return False
            # (a rank that raised sends its traceback, then exits: once it has, naming it may join it)
            return bool(pipes) and await readable(pipes, ends, deadline) and not wait(ends, timeout=0)
        finally:
            for fd in pipes + ends:
                os.close(fd)

    def _drop(self, seq: int) -> None:
        """The answer of a run_async step whose caller will not take it (cancelled, or failed): taken when it
        comes, so that it is not left filed and counted in flight (a failure is the group's, kept there)."""
        with contextlib.suppress(MoEError):
            self._await(seq)

    def _stats(self, seq: int, T: int, sent: float, answers: list, collected: float, sources) -> StepStats:
        returned = now()
        wall = returned - sent
        if seq > 1:  # the first step (the warm-up) pays one-time costs: compiles, first touches
            self._step_walls.append(wall)
        stats = answers[0][1]
        stamps = [a[1]["stamps"] for a in answers]
        return StepStats(seq=seq, tokens=T, backend=self.backend, layer_s=stats["layer_s"],
                         stages=stats["stages"], exposed_comm_s=stats["exposed_comm_s"], wall_s=wall,
                         rank_wall_s=stamps[0][-1] - stamps[0][0],
                         phases=step_phases(sent, stamps, collected, returned), behind=stats["behind"],
                         overlapped=stats["overlapped"],
                         sources=merge([a[1].get("sources", {}) for a in answers]) if sources else {})

    def _await(self, seq: int) -> tuple[list, float]:
        """The ranks' answers to step `seq` and when they were all read. One waiting thread at a time
        reads the next answer (ranks answer in seq order), files it under its seq and wakes the
        others: an answer read by another step's thread is picked up by its owner at once."""
        while True:
            with self._answered:
                while seq not in self._answers and self._reading and self._failure is None:
                    self._answered.wait()
                if seq in self._answers:
                    self._in_flight -= 1
                    return self._answers.pop(seq)
                if self._failure is not None:
                    raise self._failure
                if not self.alive:
                    raise GroupUnavailable("the rank group is not running")
                self._reading = True
            self._read_next(seq)

    def _read_next(self, seq: int, timeout: float | None = None, deadline: float | None = None,
                   kill: bool = True) -> None:
        """As the reader (`_reading`, given up here): the ranks' next answer, filed under its seq. Any
        failure (within `timeout`, by default the step's deadline; until `deadline` where given) fails the
        group and kills it (unless not `kill`: the caller does). `seq`: the step whose thread reads, to name it."""
        answers = None
        try:
            timeout = self.step_deadline_s() if timeout is None else timeout
            answers = self._collect("done", timeout, f"step {seq}", deadline)
            collected = now()
            seqs = {a[0] for a in answers}
            if len(seqs) != 1:  # the ranks' own check makes this unreachable unless the protocol breaks
                raise WorkerError(f"ranks answered seqs {sorted(seqs)} for one step")
        except WorkerError as err:
            self._failure = err
            self.alive = False
            if kill:
                self._kill()
            raise
        finally:
            with self._answered:
                self._reading = False
                if self._failure is None and answers is not None:
                    self._answers[answers[0][0]] = (answers, collected)
                self._answered.notify_all()

    def _collect(self, kind: str, timeout: float, what: str, deadline: float | None = None) -> list:
        """One `kind` answer from every rank, in rank order, within `timeout` (until `deadline` where given:
        a wait begun earlier); WorkerError on anything else, and the group's failure (or GroupUnavailable)
        when another thread kills or closes it meanwhile."""
        procs, conns = self._procs, self._conns  # (_kill empties the lists: name ranks from these)
        if not conns:
            raise self._failure or GroupUnavailable("the rank group is not running")
        pending = dict(enumerate(conns))
        answers: dict[int, object] = {}
        if deadline is None:
            deadline = time.monotonic() + timeout
        while pending:
            sentinels = {procs[r].sentinel: r for r in pending}
            try:  # (past the deadline, one look all the same: a reader woken late, a stalled event loop's
                # thread, still takes the answers that came in time)
                ready = wait(list(pending.values()) + list(sentinels), timeout=max(0.0, deadline - time.monotonic()))
            except (OSError, ValueError):  # a pipe or sentinel closed by _kill in another thread
                if self.alive:
                    raise
                raise self._failure or GroupUnavailable("the rank group was stopped") from None
            if not ready:
                raise WorkerError(self._silence(sorted(pending), what, timeout, procs))
            for obj in ready:
                if obj in sentinels:
                    continue  # read the pipe first: a dying rank sends its traceback before exiting
                rank = next(r for r, c in pending.items() if c is obj)
                try:
                    msg = pending[rank].recv()
                except (EOFError, OSError):
                    if pending[rank].closed:  # closed here by _kill, not by the rank's death
                        raise self._failure or GroupUnavailable("the rank group was stopped") from None
                    raise WorkerError(f"{what}: rank {rank} died ({_exit(procs[rank])})", rank=rank) from None
                if msg[0] == "refused":  # (a 3-tuple from a rank of before the weights' refusal: the backend)
                    raise WeightsError(msg[2]) if msg[3:] == ("weights",) else BackendUnavailable(msg[2])
                if msg[0] == "error":
                    raise WorkerError(f"{what}: rank {msg[1]} raised", rank=msg[1], traceback=msg[2])
                if msg[0] != kind:
                    raise WorkerError(f"{what}: rank {rank} answered {msg[0]!r}, expected {kind!r}", rank=rank)
                answers[rank] = msg[2] if kind == "ready" else (msg[2], msg[3])
                del pending[rank]
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank in pending and not _poll(conns[rank]):
                    if conns[rank].closed:
                        raise self._failure or GroupUnavailable("the rank group was stopped")
                    raise WorkerError(f"{what}: rank {rank} died ({_exit(procs[rank])})", rank=rank)
        return [answers[r] for r in range(len(conns))]

    def _silence(self, pending: list[int], what: str, timeout: float, procs: list | None = None) -> str:
        """Why `pending` ranks did not answer. Ranks of a step wait on each other in its
        collectives, so one stalled rank holds them all: the one the kernel reports stopped is
        named; otherwise all silent ranks are listed, saying why. (`procs`: the ranks the caller
        waited on; the group's own by default.)"""
        procs = self._procs if procs is None else procs
        within = f"within {timeout:g} s"
        stopped = [r for r in pending if _process_state(procs[r].pid) in STOPPED_STATES]
        if stopped:
            who = f"rank {stopped[0]} is" if len(stopped) == 1 else f"ranks {stopped} are"
            return f"{what}: {who} stopped (SIGSTOP or a debugger), and ranks {pending} did not answer {within}"
        if len(pending) < len(procs):
            return f"{what}: ranks {pending} did not answer {within} (the others did)"
        return (f"{what}: the group did not answer {within}; all ranks {pending} are listed: a rank waits on the "
                "others (a step's collectives, the start's rendezvous), so one stalled rank holds every one")

    # -- convenience ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                progress=None) -> torch.Tensor:
        """The layer on a batch of any size: x [T, H], ids [T, K], w [T, K] -> [T, H] in x.dtype.

        Batches larger than R*C run as several steps; `progress(done_tokens, T)` is called
        after each.
        """
        cfg = self.cfg
        T = x.shape[0]
        if x.dim() != 2 or x.shape[1] != cfg.H:
            raise InvalidInput(f"hidden_states must be [T, {cfg.H}], got {list(x.shape)}")
        if ids.shape != (T, cfg.K) or w.shape != (T, cfg.K):
            raise InvalidInput(f"topk_ids and topk_weights must be [{T}, {cfg.K}], got "
                               f"{list(ids.shape)} and {list(w.shape)}")
        if T == 0:
            raise InvalidInput("the batch is empty (T = 0)")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.E:
            raise InvalidInput(f"topk_ids must lie in [0, {cfg.E})")
        out = torch.empty(T, cfg.H, dtype=x.dtype)
        step = cfg.tokens_per_step
        slot = self.acquire_slot(timeout=self.step_timeout_s)
        try:
            for lo in range(0, T, step):
                hi = min(T, lo + step)
                slot.x[:hi - lo].copy_(x[lo:hi])
                slot.ids[:hi - lo].copy_(ids[lo:hi])
                slot.w[:hi - lo].copy_(w[lo:hi])
                self.run(slot, hi - lo)
                out[lo:hi].copy_(slot.out[:hi - lo])
                if progress:
                    progress(hi, T)
        finally:
            self.release(slot)
        return out
