"""The token-budget batcher: requests in, steps of at most R*C tokens out.

T tokens of a request, H hidden, K top-k; `budget` = R*C tokens per step.

Requests queue in arrival order. A step takes rows from the head of the queue until the
budget is full; a request larger than what is left is split, its remaining rows lead the
next step, and its answer is reassembled row by row into its own output tensor (rows of
different requests never share an output). The batcher waits up to `delay_s` after the
oldest queued request arrived for more rows (Triton's max_queue_delay: a full budget
dispatches at once), but only while another step is running unless `idle_wait`: when the group
is idle, waiting adds latency and gains nothing (at concurrency 1 every request would pay the whole
delay), and under load the rows that arrive while a step runs fill the next one. At most `slots`
steps are in flight: while one runs, the next is filled.

A step runs in a worker thread: it copies the rows into the group's shared-memory slot views
(slot.x[:T] ...), converting them to the group's dtype on the way (the one copy in: the request's
tensors are views of its wire bytes), checks each request's rows there (`codecs.rows_error`: a
request whose hidden_states hold NaN, infinity or values past the slot's dtype fails alone with its
400, its rows in the slot zeroed, its batch-mates' answers unchanged), calls the blocking
`group.run`, copies slot.out into each request's answer in the request's dtype (the one copy out:
into the response's own buffer where the caller passes one, which the encoders then send as it
is) and releases the slot, so the event loop stays free. With `slots` >= 2 several steps are in flight:
the group overlaps one step's copies with another's compute (service.worker.group). With
`copy_threads` N > 1 a piece's copy in (and its check) and its copy out are split into min(N, rows)
row ranges when the piece is SPLIT_MIN_BYTES (1 MiB) or more in the slot's dtype, run by the step
thread and N-1 helper threads (`RowSplit`); a smaller piece stays whole.

Admission is bounded in tokens: a request that would push the queued tokens past
`queue_tokens` fails at once with Overloaded. A request past its deadline fails with
DeadlineExceeded; its rows that were not yet sent to a slot are dropped. Once a request has its
answer or its error (or its caller is cancelled: a disconnect, a gRPC cancel), no step writes into
its output any more (`_Job.abandoned`), before any response is sent: a step already running computes
its rows and discards them. A request of several steps that fails may have had its earlier steps'
rows written (its output's bytes are then unspecified, as Triton's).

Direct pieces (`--shm-direct`, a group whose `direct_regions` is true): a piece whose hidden_states
lie in a client's shared-memory region and whose answer goes into one, both in the slot's dtype, is
not copied at all here: its ids and w go into the slot as any piece's, and the step carries a
*source* naming its slot rows, the input object and byte, the output object and byte, and both
regions as registered (service.worker.direct: a rank maps a region's bytes, not its object); each
rank reads its rows of it from the object, checks them (a row with NaN or infinity is zeroed there,
and the request gets the same 400 as `codecs.rows_error` gives, naming its row) and writes their
answer into the output object during `group.run`. A v2 binary request received into the wire arena
(service.api.arena, `--wire-arena-mib`), whose answer has a block there too, is a direct piece the
same way, whatever `direct_regions` says (the arena is the server's own memory: a rank that cannot
use it fails that request with 503, and the arena's pieces take the copies until the next group). Everything
else (other wire requests, regions of another dtype, a request whose rows already failed, a region
larger than DIRECT_MAX_BYTES, a piece whose regions would take the step's past the ranks' bounds,
MAX_OBJECTS regions and MAX_BYTES mapped) takes the copies above, in the same step. A step whose pieces
are all direct, on a group that runs steps on the event loop (`run_async`: a front end i >= 1's, whose
owner runs them, service.replica; front end 0's WorkerGroup, when no other step is in flight), has no
copy to make: it runs on the loop itself, with no step thread between the loop and the ranks or the
owner (`_execute_on_loop`). Since the answer
lands in the client's region (or the arena's block) during `group.run`, a request with a direct
piece in a step (`_Job.direct`, counted under its lock from before the descriptor is made until that
step returned) is not answered, nor failed (its deadline, a cancel), before that step has returned:
`submit` waits for it (`_Job.settled`) without blocking the loop. Its one visible difference: a
request that fails (a bad row, its deadline; a gRPC client's own deadline may pass while its step
still writes) may have had its output region written; once its answer or error is sent, nothing is.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

import torch

from service.api.arena import Place, WireArena
from service.api.codecs import nonfinite_error, rows_error
from service.api.regions import RegionRows, Rows, copy_rows
from service.errors import DeadlineExceeded, GroupUnavailable, InvalidInput, MoEError, Overloaded, WorkerError
from service.metrics import Metrics
from service.worker.direct import DIRECT_MAX_BYTES, MAX_BYTES, MAX_OBJECTS, entry_key

log = logging.getLogger(__name__)


_REJECT_LOCK = threading.Lock()  # guards a request's bad-row mark, set by step threads
# a range's copy in: None (its rows are fine), (the request's first bad row, its error), or its read's error
RangeCheck = tuple[int, InvalidInput] | InvalidInput | None
# a smaller piece (counted in the slot's dtype) stays whole: a hand-off to a helper costs ~20-50 us, a MiB ~70
SPLIT_MIN_BYTES = 1 << 20


class RowSplit:
    """A front end's big copies in parallel, without OpenMP: `run(fn, n, piece_bytes)` calls fn(lo, hi)
    over `threads` contiguous row ranges of [0, n), the first in the calling thread, the others in
    helper threads of this process, and returns their results in row order. The process keeps one
    torch thread (service.fleet.set_frontend_threads), so each range is one single-threaded copy, and
    idle helpers block on the pool's queue: nothing spins. (OMP_WAIT_POLICY=passive would do it with
    torch's own threads, but libgomp reads it once, when torch is first imported, in every process the
    owner spawns too: bench/NOTES.md, issue 11q.) A helper never waits for anything, so a caller
    waiting for its ranges always gets them, however many step threads share the helpers."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="moe-copy") \
            if threads > 1 else None

    def run(self, fn: Callable[[int, int], object], n: int, piece_bytes: int) -> list:
        """fn over [0, n) in min(threads, n) ranges when the piece is SPLIT_MIN_BYTES or more, else in one.
        Every range has finished when this returns or raises (the first error in row order): a range
        still running after its step released the slot would write into the next step's rows."""
        parts = min(self.threads, n) if piece_bytes >= SPLIT_MIN_BYTES else 1
        if self._pool is None or parts == 1:
            return [fn(0, n)]
        bounds = [n * i // parts for i in range(parts + 1)]
        rest = [self._pool.submit(fn, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)]
        try:
            first = fn(bounds[0], bounds[1])
        finally:
            concurrent.futures.wait(rest)
        return [first, *(f.result() for f in rest)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@dataclasses.dataclass(eq=False)
class _Job:
    """One request: its tensors, its answer and how far its rows have got."""

    x: Rows            # [T, H] as sent (or in its shared-memory region); converted to the group's dtype in the slot
    ids: torch.Tensor  # [T, K] int32
    w: torch.Tensor    # [T, K] float32
    out: Rows          # [T, H] the answer in the request's dtype (or its output region), filled piece by piece
    future: asyncio.Future
    arrival: float
    deadline: float
    sent: int = 0      # rows handed to a step so far
    done: int = 0      # rows answered so far
    in_steps: int = 0  # its pieces in steps that have not returned (the loop's count)
    # seconds of the steps its rows ran in, by phase: copy in, layer, copy out
    compute: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])
    dropped: bool = False
    # set by a step thread when the request's rows fail their check in the slot (never cleared: its
    # pieces may be checked by several step threads at once); the loop fails it
    invalid: MoEError | None = None  # a 400 (InvalidInput), or the wire arena's 503 (`_source_error`)
    invalid_row: int = -1
    # set by `_forget` (the request has its answer or its error) under `lock`, under which a step
    # thread writes each piece of the answer: nothing is written into `out` once the caller may
    # send a response (a client that got its error may reuse its output region at once)
    abandoned: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # direct pieces of it (--shm-direct) in a step that has not returned (under `lock`: a step thread
    # counts one only while the request is not abandoned); `settled` is set once the last returns
    # after it was abandoned, which `submit` waits for before its caller may answer
    direct: int = 0
    settled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def T(self) -> int:
        return self.x.shape[0]

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    def reject(self, row: int, err: MoEError) -> None:
        """Mark the request invalid (a step thread), naming its first bad row over all its pieces."""
        with _REJECT_LOCK:
            if self.invalid is None or row < self.invalid_row:
                self.invalid_row = row  # (first: a step thread reads `invalid`, then the row, without the lock)
                self.invalid = err


@dataclasses.dataclass(eq=False)
class _Piece:
    job: _Job
    start: int  # first row of the job
    rows: int
    at: int     # first row in the slot


class Batcher:
    """Queue, step builder and dispatcher in front of one rank group at a time."""

    def __init__(self, *, budget: int, delay_s: float, queue_tokens: int, slots: int,
                 metrics: Metrics, on_failure: Callable[[object, BaseException], None] | None = None,
                 slot_timeout_s: float = 60.0, idle_wait: bool = True, copy_threads: int = 1):
        self.budget = budget
        self.delay_s = delay_s
        self.idle_wait = idle_wait
        self.queue_tokens = queue_tokens
        self.metrics = metrics
        self.on_failure = on_failure
        self.slot_timeout_s = slot_timeout_s
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued = 0  # tokens not yet sent to a step
        self._jobs: set[_Job] = set()  # accepted and not answered
        self._group = None
        self._refusal: BaseException | None = GroupUnavailable("the rank group is starting")
        self._slots = asyncio.Semaphore(slots)
        self._pool = concurrent.futures.ThreadPoolExecutor(slots, thread_name_prefix="moe-step")
        self._split = RowSplit(copy_threads)
        # The wire arena (service.api.arena), set by the endpoint: pieces whose rows and answer lie there
        # go to the ranks as sources, until a rank reports it cannot use it (`_arena_failed`)
        self.arena: WireArena | None = None
        self._arena_direct = True
        self._retired: list[torch.Tensor] = []  # arena rows of failed steps (`_retire`), until the next attach
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._steps: set[asyncio.Task] = set()
        self._closing = False  # set once close() stops waiting: steps not yet in group.run are dropped

    # ---- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="moe-batcher")

    async def close(self, timeout_s: float = 0.0) -> None:
        """Fail what is pending, let the steps in flight finish for up to `timeout_s`, then drop
        those that have not reached `group.run` and join the step threads: on return no thread
        is inside the group, so it may be closed. A step already in `group.run` is waited for
        (the group bounds it by its step timeout)."""
        self.detach(GroupUnavailable("the server is shutting down"))
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._steps:
            await asyncio.wait(set(self._steps), timeout=timeout_s)
        self._closing = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self._split.close()  # no step thread is left to use it
        await asyncio.gather(*self._steps, return_exceptions=True)

    def attach(self, group) -> None:
        """Serve requests with `group` (started and warmed up). A group is attached only after the one
        before it was closed (its ranks are gone): the arena blocks its failed steps held come back, and
        its ranks' failure to use the arena (`_arena_failed`) is forgotten."""
        self._group = group
        self._refusal = None
        self._retired.clear()
        self._arena_direct = True

    def detach(self, reason: BaseException) -> None:
        """Stop using the group: refuse new requests with `reason`, fail every accepted one."""
        self._group = None
        self._refusal = reason
        for job in list(self._jobs):
            self._drop(job)
            job.fail(reason)

    def refuse(self, reason: BaseException) -> None:
        """Refuse new requests with `reason`; accepted ones still run (draining)."""
        self._refusal = reason

    @property
    def group(self):
        return self._group

    @property
    def pending(self) -> int:
        """Requests accepted and not yet answered."""
        return len(self._jobs)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is pending; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, x: Rows, ids: torch.Tensor, w: torch.Tensor, timeout_s: float,
                     out_dtype: torch.dtype | None = None, out: Rows | None = None) -> Rows:
        """Answer one request (validated but for hidden_states' values, checked in the slot):
        [T, H] in `out_dtype` (default x's dtype), written into `out` when given (the response's
        buffer, or the client's shared-memory output region: the answer's one copy out of the slot
        lands where it is sent from). x may be rows in a shared-memory region (read in the step)."""
        if self._refusal is not None:
            raise self._refusal
        T = x.shape[0]
        if self._queued + T > self.queue_tokens:
            raise Overloaded(f"the queue is full ({self._queued} of {self.queue_tokens} tokens queued, "
                             f"this request has {T}); retry later")
        now = time.monotonic()
        if out is None:
            out = torch.empty(T, x.shape[1], dtype=out_dtype or x.dtype)  # [T, H]
        elif out.shape != x.shape or (out_dtype is not None and out.dtype != out_dtype):
            raise ValueError(f"out is {out.dtype} {list(out.shape)}, the request {out_dtype} {list(x.shape)}")
        loop = asyncio.get_running_loop()
        job = _Job(x, ids, w, out, loop.create_future(), arrival=now, deadline=now + timeout_s)
        self._queue.append(job)
        self._jobs.add(job)
        self._idle.clear()
        self._queued += T
        self._gauges()
        self._wakeup.set()
        # This task waits on the job's future itself: the step's set_result wakes it in the loop's next
        # turn, ahead of the step's books (`_record`), with no shield or wait_for between (a layer each).
        # Its deadline fails the future; a cancelled caller cancels it, as `_forget` would.
        expiry = loop.call_later(timeout_s, _expire, job, timeout_s)
        try:
            await job.future
            return job.out
        finally:
            expiry.cancel()
            self._forget(job)
            with job.lock:
                writing = job.direct > 0
            if writing:  # a step still writes its answer into the output region: no answer before it returned
                await asyncio.shield(job.settled.wait())
            # A failure raised here is the job's future's own exception, whose traceback now holds
            # this frame: without these locals it holds no request (nor a region's object) in a
            # cycle that only the cyclic collector would free.
            del job, x, out

    def _drop(self, job: _Job) -> None:
        """Never send the job's remaining rows to a slot."""
        if not job.dropped:
            job.dropped = True
            self._queued -= job.T - job.sent
            job.sent = job.T

    def _forget(self, job: _Job) -> None:
        """The request is done with (answered, failed, timed out, cancelled): before its caller
        answers, so that no step writes into its `out` after that (waits for a write under way:
        at most one piece's)."""
        with job.lock:
            job.abandoned = True
        self._drop(job)
        if not job.future.done():
            job.future.cancel()  # nobody waits for it any more
        self._jobs.discard(job)
        if not self._jobs:
            self._idle.set()
        self._gauges()

    def _arena_failed(self, err: MoEError) -> None:
        """A rank could not use the wire arena (it could not map or page-lock it: the host's memory, a
        bug): that request fails with 503 (`_source_error`), and the arena's pieces take the copies until
        the next group is attached (a step thread; said once)."""
        if self._arena_direct:
            self._arena_direct = False
            log.error("%s", err)

    def _gauges(self) -> None:
        self.metrics.queued_tokens.set(self._queued)
        self.metrics.inflight.set(len(self._jobs))

    # ---- steps -----------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            head = self._head()
            if head is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._slots.acquire()
            await self._fill(head)
            self._launch()

    def _launch(self) -> None:
        """Start the next step with the rows at the head of the queue (holding a slot). (A method
        of its own: the dispatch loop keeps no reference to a request while it waits, which would
        keep a shared-memory region's object open after its unregister.)"""
        pieces, T = self._take()
        group = self._group
        if not pieces:
            self._slots.release()
            return
        if group is None:
            self._slots.release()
            for p in pieces:
                p.job.fail(self._refusal or GroupUnavailable("the rank group is not running"))
            return
        task = asyncio.create_task(self._step(group, pieces, T))
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)

    def _head(self) -> _Job | None:
        while self._queue and self._queue[0].sent == self._queue[0].T:
            self._queue.popleft()
        return self._queue[0] if self._queue else None

    async def _fill(self, head: _Job) -> None:
        """Wait for a full budget, or until the oldest request has waited delay_s; not at all when
        no step is running, unless idle_wait."""
        if not self.idle_wait and not self._steps:
            return
        while self._queued < self.budget:
            left = head.arrival + self.delay_s - time.monotonic()
            if left <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> tuple[list[_Piece], int]:
        """Rows for one step from the head of the queue: [(job, first row, rows, slot row)]."""
        pieces: list[_Piece] = []
        T = 0
        now = time.monotonic()
        while T < self.budget and self._head() is not None:
            job = self._queue[0]
            if job.sent == 0 and now > job.deadline:
                self._drop(job)
                job.fail(DeadlineExceeded("the request's deadline passed while it was queued"))
                continue
            if job.sent == 0:
                self.metrics.queue_time.observe(now - job.arrival)
            rows = min(job.T - job.sent, self.budget - T)
            pieces.append(_Piece(job, job.sent, rows, T))
            job.sent += rows
            job.in_steps += 1
            self._queued -= rows
            T += rows
        self._gauges()
        return pieces, T

    async def _step(self, group, pieces: list[_Piece], T: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            direct = self._loop_sources(group, pieces)
            if direct is not None:
                # A task of its own, shielded: cancelling this one leaves the step to finish with its slot
                # and its pieces held until the owner answers, as a step thread's would
                inner = asyncio.create_task(self._execute_on_loop(group, pieces, T, *direct))
                self._steps.add(inner)
                inner.add_done_callback(self._steps.discard)
                inner.add_done_callback(_taken)
                stats, phases = await asyncio.shield(inner)
            else:
                stats, phases = await loop.run_in_executor(self._pool, self._execute, group, pieces, T)
        except BaseException as e:  # noqa: BLE001  any failure of a step fails the group
            # The jobs keep `e`; its traceback (this frame, the executor's) holds `pieces`, and so
            # the jobs and their regions' objects, in a cycle only the cyclic collector frees: a
            # client object's descriptor would stay open past its unregister. Nothing reads it.
            e.__traceback__ = None
            for p in pieces:  # a request whose rows failed their check keeps its own 400
                p.job.fail(p.job.invalid or (e if isinstance(e, (WorkerError, GroupUnavailable))
                           else GroupUnavailable(f"the step failed: {type(e).__name__}: {e}")))
            if self.on_failure and not self._closing and not isinstance(e, asyncio.CancelledError):
                self.on_failure(group, e)
            return
        finally:
            self._slots.release()
            for p in pieces:
                p.job.in_steps -= 1
        for job in {p.job for p in pieces}:
            job.compute = [a + b for a, b in zip(job.compute, phases, strict=True)]
            if job.invalid is not None:
                self._drop(job)
                if job.in_steps == 0:  # a step still holding another piece may find an earlier bad row
                    job.fail(job.invalid)
        answered = []
        for p in pieces:
            if p.job.invalid is not None:
                continue
            p.job.done += p.rows
            if p.job.done == p.job.T and not p.job.future.done():
                answered.append(p.job.compute)
                p.job.future.set_result(None)
        # The books in a later turn of the loop: the answered requests' tasks, woken above, run first
        loop.call_soon(self._record, stats, answered)

    def _record(self, stats, answered: list[list[float]]) -> None:
        """A step's books: its stats, and the compute phases of the requests it answered."""
        try:  # a failure to record a step must never hold its requests back
            self.metrics.observe_step(stats)
            for copy_in, layer, copy_out in answered:
                self.metrics.observe_request_compute((copy_in, layer, copy_out))
        except Exception:  # noqa: BLE001  a bug in the books, not in the answers: say it, keep serving
            log.exception("recording the metrics of step %s failed", stats.seq)

    def _execute(self, group, pieces: list[_Piece], T: int):
        """Worker thread: rows into the slot (each request's checked there; a request that fails
        is marked `invalid` and its rows zeroed, here and in any later step that already holds
        some), one step, answers out of the slot. Returns the step's stats and the seconds of those
        three phases."""
        held: list[_Piece] = []  # direct pieces: the ranks read and answer them (their jobs' `direct` counted)
        with self._holding(held):
            return self._run(group, pieces, T, held)

    @contextlib.contextmanager
    def _holding(self, held: list[_Piece]):
        """Around a step that appends its direct pieces to `held`: if it fails, their arena blocks are kept
        from reuse (`_retire`); whatever happens, each one's job is told the step returned (`_settle`)."""
        try:
            yield
        except BaseException:
            self._retire(held)
            raise
        finally:
            for p in held:
                _settle(p.job)

    def _loop_sources(self, group, pieces: list[_Piece]) -> tuple[object, list[tuple]] | None:
        """A free slot and every piece's source, when the step runs on the event loop: its group runs steps
        there (`run_async`; WorkerGroup's waits in a thread unless the step is alone in flight) and every
        piece is direct (its rows and answer where the ranks read and write them, its request without a bad
        row), so the loop has no copy to make, only ids and w into the slot. None otherwise: a step thread
        runs it (`_execute`)."""
        if getattr(group, "run_async", None) is None or self._closing \
                or any(p.job.invalid is not None for p in pieces):
            return None
        try:
            slot = group.acquire_slot(timeout=0)  # (the step holds a permit of `_slots`: one is free)
        except GroupUnavailable:
            return None
        regions = getattr(group, "direct_regions", False)
        arena = self.arena if self._arena_direct else None
        budget: dict[tuple, int] = {}
        sources: list[tuple] = []
        try:
            for p in pieces:
                source = _source(p, budget, slot.x.dtype, regions, arena)
                if source is None:
                    group.release(slot)
                    return None
                sources.append(source)
        except BaseException:
            group.release(slot)
            raise
        return slot, sources

    async def _execute_on_loop(self, group, pieces: list[_Piece], T: int, slot, candidates: list[tuple]):
        """`_execute` for a step of direct pieces (`_loop_sources`), on the event loop: ids and w into the slot,
        the group's `run_async`, the ranks' reports. A piece whose request was abandoned meanwhile is not
        direct: its rows are zeroed, computed harmlessly and answered to nobody."""
        held: list[_Piece] = []
        with self._holding(held):
            try:
                t0 = time.perf_counter()
                sources = []
                for p, source in zip(pieces, candidates, strict=True):
                    at = slice(p.at, p.at + p.rows)
                    if _hold(p.job):
                        held.append(p)
                        sources.append(source)
                        rows = slice(p.start, p.start + p.rows)
                        slot.ids[at].copy_(p.job.ids[rows])
                        slot.w[at].copy_(p.job.w[rows])
                        if not isinstance(p.job.x, RegionRows):
                            self.metrics.arena_rows.inc(p.rows)
                    else:
                        slot.x[at].zero_()
                        slot.ids[at].zero_()
                        slot.w[at].zero_()
                t1 = time.perf_counter()
                stats = await group.run_async(slot, T, sources, executor=self._pool)
                t2 = time.perf_counter()
                self._note_reports(stats, held)
                return stats, (t1 - t0, t2 - t1, time.perf_counter() - t2)
            finally:
                group.release(slot)

    def _note_reports(self, stats, held: list[_Piece]) -> None:
        """What the ranks found in the direct pieces' rows they read and wrote (`held`, in the sources' order)."""
        for i, p in enumerate(held):
            report = stats.sources.get(i)
            if report is not None:
                row, failure = _source_error(p, report)
                p.job.reject(row, failure)
                if not isinstance(failure, InvalidInput):
                    self._arena_failed(failure)

    def _retire(self, held: list[_Piece]) -> None:
        """A step with direct pieces failed: keep their wire arena blocks from reuse while its group may
        still run it (until the next `attach`: a new group comes only once the old one's ranks are
        gone). A front end i >= 1 gives up on the owner after step_timeout_s + 10 s and fails its
        requests while the owner may yet run the step, which would write another request's body or
        answer into a reused block: the arena's room is the price, never an answer (a client's region
        is the client's: only its own request's bytes are at stake there)."""
        arena = self.arena
        kept = [t for p in held for t in (p.job.x, p.job.out)
                if isinstance(t, torch.Tensor) and arena is not None and arena.place(t) is not None]
        if kept:
            self._retired.extend(kept)
            log.warning("a step with wire arena rows failed: their %d bytes of the arena are kept from reuse "
                        "until the next rank group (a rank might still write them)",
                        sum(t.numel() * t.element_size() for t in kept))

    def _run(self, group, pieces: list[_Piece], T: int, held: list[_Piece]):
        """`_execute`'s work; the direct pieces it holds are appended to `held` (released by the caller
        once the step has returned)."""
        slot = group.acquire_slot(timeout=self.slot_timeout_s)
        try:
            if self._closing:
                raise GroupUnavailable("the server is shutting down")
            t0 = time.perf_counter()
            row_bytes = slot.x.shape[1] * slot.x.element_size()  # a piece's size, in and out: in the slot's dtype
            regions = getattr(group, "direct_regions", False)  # clients' regions go direct (--shm-direct)
            arena = self.arena if self._arena_direct else None
            sources: list[tuple] = []  # one per direct piece, in `held`'s order
            budget: dict[tuple, int] = {}  # the regions the sources name: their mapped bytes
            for p in pieces:
                rows = slice(p.start, p.start + p.rows)
                at = slice(p.at, p.at + p.rows)
                job = p.job
                # Checked unless the request already has a bad row before this piece: another step's
                # thread may have found one after it (the later piece of a request split over steps,
                # copied first), and the 400 must name the request's first bad row.
                check = job.invalid is None or job.invalid_row >= p.start
                if job.invalid is None:
                    slot.ids[at].copy_(job.ids[rows])
                    slot.w[at].copy_(job.w[rows])
                    source = _source(p, budget, slot.x.dtype, regions, arena)
                    if source is not None and _hold(job):
                        held.append(p)
                        sources.append(source)
                        if not isinstance(job.x, RegionRows):
                            self.metrics.arena_rows.inc(p.rows)
                        continue
                if check:
                    bad = _piece_error(self._split.run(functools.partial(_copy_in, slot.x[at], job.x[rows], p.start),
                                                       p.rows, p.rows * row_bytes), p.start)
                    if bad is not None:
                        job.reject(*bad)
                # (another step's thread may have marked it meanwhile: the mark only ever goes on, so a
                # request with a bad row is never answered, and no bad row reaches a rank)
                if job.invalid is not None:  # rows the layer computes harmlessly, answered to nobody
                    slot.x[at].zero_()
                    slot.ids[at].zero_()
                    slot.w[at].zero_()
            t1 = time.perf_counter()
            stats = group.run(slot, T, sources) if sources else group.run(slot, T)
            t2 = time.perf_counter()
            self._note_reports(stats, held)
            answered = set(held)  # (their answers are in the output regions already)
            for p in pieces:
                job = p.job
                if job.invalid is not None or job.abandoned or p in answered:
                    continue
                dst, src = job.out[p.start:p.start + p.rows], slot.out[p.at:p.at + p.rows]
                if not isinstance(dst, RegionRows):  # the response's own buffer: nobody reads it once abandoned
                    self._split.run(functools.partial(_copy_out, dst, src), p.rows, p.rows * row_bytes)
                    continue
                # The client's output region: written under the request's lock, which `_forget` takes
                # before its caller answers; RowSplit.run returns only once every range has written, so
                # no range writes the region after that.
                with job.lock:
                    if job.abandoned:
                        continue
                    written = self._split.run(functools.partial(_write_out, dst, src), p.rows, p.rows * row_bytes)
                    err = next((e for e in written if e is not None), None)
                    if err is not None:  # its output region's object shrank since it was registered
                        job.reject(p.start, err)
            return stats, (t1 - t0, t2 - t1, time.perf_counter() - t2)
        finally:
            try:
                group.release(slot)
            except Exception:  # a failed group may refuse; the step's own error matters more
                log.debug("releasing a slot of a failed group", exc_info=True)


def _placed(rows: Rows, dtype: torch.dtype, regions: bool, arena: WireArena | None) -> Place | None:
    """Where rows of a piece lie for a rank that reads or writes them itself, or None (the copies
    serve them): rows of the slot's dtype (else the copies convert) in a client's region when
    `regions` (--shm-direct), or in the wire arena."""
    if rows.dtype != dtype:
        return None
    if isinstance(rows, RegionRows):
        return rows.place() if regions else None
    return arena.place(rows) if arena is not None else None


def _taken(task: asyncio.Task) -> None:
    """A shielded step's outcome, taken: once its caller was cancelled nobody awaits it (its requests have
    failed already), and asyncio would log an exception nobody took."""
    if not task.cancelled():
        task.exception()


def _expire(job: _Job, timeout_s: float) -> None:
    """The request's deadline passed before its answer (the loop's timer of `submit`)."""
    job.fail(DeadlineExceeded(f"no answer within the request's deadline ({timeout_s:.3g} s were left of it when it "
                              "was queued)"))


def _hold(job: _Job) -> bool:
    """Count a direct piece of the job in a step, unless the job is abandoned (its caller may answer)."""
    with job.lock:
        if job.abandoned:
            return False
        job.direct += 1
        return True


def _settle(job: _Job) -> None:
    """A step with a direct piece of the job has returned: wake `submit` when it waits for the last."""
    with job.lock:
        job.direct -= 1
        wake = job.direct == 0 and job.abandoned
    if wake:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            job.future.get_loop().call_soon_threadsafe(job.settled.set)


def _source(p: _Piece, budget: dict[tuple, int], dtype: torch.dtype, regions: bool,
            arena: WireArena | None) -> tuple | None:
    """The step's descriptor of a piece the ranks read and answer themselves (service.worker.direct.Source),
    or None when they cannot: its rows or its answer's are not `_placed`, a region is larger than
    DIRECT_MAX_BYTES, or the step's regions (`budget`: the mapped bytes of each, by entry key) would
    pass the ranks' bounds (MAX_OBJECTS, MAX_BYTES)."""
    rows = slice(p.start, p.start + p.rows)
    src, dst = (_placed(t[rows], dtype, regions, arena) for t in (p.job.x, p.job.out))
    if src is None or dst is None:
        return None
    in_key, in_id, in_at, in_region = src
    out_key, out_id, out_at, out_region = dst
    if max(in_region[1], out_region[1]) > DIRECT_MAX_BYTES:
        return None
    more = {}
    for ident, region in ((in_id, in_region), (out_id, out_region)):
        k = entry_key(ident, region)
        if k not in budget:
            more[k] = k[3] - k[2]
    if len(budget) + len(more) > MAX_OBJECTS or sum(budget.values()) + sum(more.values()) > MAX_BYTES:
        return None
    budget.update(more)
    return (p.at, p.rows, in_key, in_id, in_at, out_key, out_id, out_at, in_region, out_region)


def _source_error(p: _Piece, report) -> tuple[int, MoEError]:
    """A direct piece's (request row, error) from its ranks' report: its first bad row (a 400), or why
    the ranks could not use its input or output object (a client's region: the 400 the copies would
    give; the wire arena: the server's own memory, a 503)."""
    if isinstance(report, int):
        row = p.start + report
        return row, nonfinite_error(row)
    side, code, text = report
    rows = p.job.x if side == "in" else p.job.out
    if not isinstance(rows, RegionRows):
        return p.start, GroupUnavailable(f"the ranks could not use the wire arena for this request ({code}: {text}); "
                                         "retry: its requests take the front end's copies until the group restarts")
    if code == "truncated":
        return p.start, rows.truncated()
    if code == "replaced":
        return p.start, rows.replaced()
    return p.start, rows.refused(text)


def _copy_out(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """Rows lo..hi of an answer out of the slot (`src`) into the response's buffer, in its dtype."""
    dst[lo:hi].copy_(src[lo:hi])


def _write_out(dst: RegionRows, src: torch.Tensor, lo: int, hi: int) -> InvalidInput | None:
    """Rows lo..hi of an answer out of the slot (`src`) into its output region (`dst`), converted to its
    dtype on the way (per range: no intermediate of the whole piece): None, or the write's error (the
    region's object shrank since it was registered; the same message whichever range finds it)."""
    try:
        dst[lo:hi].write_from(src[lo:hi])
    except InvalidInput as err:
        return err
    return None


def _copy_in(dst: torch.Tensor, src: Rows, first: int, lo: int, hi: int) -> RangeCheck:
    """Rows lo..hi of a piece into the slot (`dst`, converted to its dtype) and their check: None, the
    request's first bad row among them and its error (rows_error; `first` is the piece's first row of
    the request), or the read's error when the rows come from a shared-memory object that shrank
    since it was registered (then nothing is checked)."""
    try:
        copy_rows(dst[lo:hi], src[lo:hi])
    except InvalidInput as err:
        return err
    return rows_error(dst[lo:hi], src[lo:hi], first + lo)


def _piece_error(results: list[RangeCheck], first: int) -> tuple[int, InvalidInput] | None:
    """A piece's error from its ranges' `_copy_in` results (in row order; `first` as there), as one
    whole copy reports it, so the copy threads never change which 400 a request gets: a failed read in
    any range is (first, that read's error) whatever the ranges before it found (the whole copy stops
    at the truncation and checks nothing; the first range whose read fails holds the truncation, so
    its message names the same byte); else the first bad row: the first range's that found one, as
    the ranges are in row order and each names its own first bad row (no min over rows needed)."""
    read = next((r for r in results if isinstance(r, InvalidInput)), None)
    if read is not None:
        return first, read
    return next((r for r in results if isinstance(r, tuple)), None)
