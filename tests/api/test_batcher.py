"""The batcher against a fake rank group (same API: acquire_slot / run / release on slot views)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import types

import pytest
import torch

from service.api.batcher import Batcher
from service.config import LayerConfig
from service.errors import DeadlineExceeded, GroupUnavailable, InvalidInput, Overloaded, WorkerError
from service.metrics import Metrics
from service.moe.reference import moe_reference
from service.worker.group import StepStats
from tests.helpers import TOL, rel_err, routing

CFG = LayerConfig(E=5, H=8, I=12, K=2, R=2, C=4, dtype=torch.float32)  # budget R*C = 8 tokens
BUDGET = CFG.tokens_per_step


class FakeGroup:
    """Slots of plain tensors; run() computes the fp32 reference on rows [0, T) of the slot."""

    def __init__(self, cfg: LayerConfig, slots: int = 2, fail_at_step: int | None = None, step_s: float = 0.0,
                 dtype: torch.dtype = torch.float32):
        gen = torch.Generator().manual_seed(0)
        self.cfg = cfg
        self.gate = torch.randn(cfg.E, cfg.I, cfg.H, generator=gen) / cfg.H ** 0.5  # [E, I, H]
        self.up = torch.randn(cfg.E, cfg.I, cfg.H, generator=gen) / cfg.H ** 0.5    # [E, I, H]
        self.down = torch.randn(cfg.E, cfg.H, cfg.I, generator=gen) / cfg.I ** 0.5  # [E, H, I]
        N = cfg.tokens_per_step
        self.free: queue.Queue = queue.Queue()
        for i in range(slots):
            self.free.put(types.SimpleNamespace(
                index=i, x=torch.zeros(N, cfg.H, dtype=dtype), ids=torch.zeros(N, cfg.K, dtype=torch.int32),
                w=torch.zeros(N, cfg.K), out=torch.zeros(N, cfg.H, dtype=dtype)))
        self.nonfinite_steps = 0  # steps whose rows held a NaN or an infinity (the batcher lets none in)
        self.steps: list[int] = []
        self.entered: list[int] = []       # T of each step as it enters run(), before it waits for `resume`
        self.resume = threading.Event()    # cleared by a test: steps wait in run() (still computing) until set
        self.resume.set()
        self.fail_at_step, self.step_s = fail_at_step, step_s
        self.lock = threading.Lock()
        self.alive = True
        self.pids: list[int] = []

    def ref(self, x, ids, w):
        return moe_reference(x, ids, w, self.gate, self.up, self.down)

    def acquire_slot(self, timeout=None):
        return self.free.get(timeout=timeout)

    def release(self, slot):
        self.free.put(slot)

    def run(self, slot, T):
        assert 1 <= T <= self.cfg.tokens_per_step
        self.entered.append(T)
        assert self.resume.wait(10), "the test never resumed the step"
        with self.lock:
            self.steps.append(T)
            if self.fail_at_step is not None and len(self.steps) > self.fail_at_step:
                self.alive = False
                raise WorkerError("rank 1 died (exit code -9)", rank=1)
            time.sleep(self.step_s)
            self.nonfinite_steps += not bool(torch.isfinite(slot.x[:T]).all())
            slot.out[:T] = self.ref(slot.x[:T].float(), slot.ids[:T], slot.w[:T])
            slot.out[T:] = float("nan")  # rows past T must never be read
        return StepStats(seq=len(self.steps), tokens=T, backend="serial", layer_s=1e-3,
                         stages={"gemm1": 5e-4, "gemm2": 5e-4}, exposed_comm_s=0.0, wall_s=self.step_s)


def batch(T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, CFG.H, generator=gen)
    ids, w = routing(T, CFG.E, CFG.K, "balanced", gen)
    return x, ids.to(torch.int32), w


def run(coro):
    return asyncio.run(coro)


async def until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Poll `condition` on the event loop (other tasks run meanwhile) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.001)


async def started(group, **kw) -> Batcher:
    kw = {"budget": BUDGET, "delay_s": 0.002, "queue_tokens": 1000, "slots": 2, "metrics": Metrics(), **kw}
    b = Batcher(**kw)
    b.start()
    b.attach(group)
    return b


def test_split_reassemble_and_no_mixing():
    group = FakeGroup(CFG)
    sizes = [1, 3, 8, 13, 20, 2, 7, 17]

    async def main():
        b = await started(group)
        reqs = [batch(T, seed) for seed, T in enumerate(sizes)]
        outs = await asyncio.gather(*(b.submit(*r, timeout_s=10) for r in reqs))
        await b.close()
        return reqs, outs

    reqs, outs = run(main())
    for (x, ids, w), out in zip(reqs, outs, strict=True):
        assert out.shape == x.shape
        assert rel_err(out, group.ref(x, ids, w)) < TOL[torch.float32]
    assert sum(group.steps) == sum(sizes)
    assert max(group.steps) <= BUDGET
    assert len(group.steps) == -(-sum(sizes) // BUDGET), "steps should be full while requests wait"


def _solo(group, x, ids, w):
    """The answer of a request in steps of its own (a fresh batcher, nothing else queued)."""
    async def main():
        b = await started(group, delay_s=0.0)
        out = await b.submit(x, ids, w, timeout_s=10)
        await b.close()
        return out
    return run(main())


@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.float16])
def test_bad_rows_fail_alone_and_batch_mates_equal_solo_runs(slot_dtype):
    """Requests of odd sizes (T=1, split over steps), mixed wire dtypes, some with a bad row (NaN,
    infinity, a value past the slot's float16 range) in their first or a later piece, merged into
    shared steps: each bad one gets its own InvalidInput naming the row, no step's rows hold a
    non-finite value, every good one equals its solo run."""
    group = FakeGroup(CFG, dtype=slot_dtype, step_s=0.002)
    sizes = [1, 13, 3, 20, 7, 1, 9, 5, 17]
    bad = {1: (10, float("nan")), 3: (2, float("inf")), 6: (4, -7e4)}  # request: (row, value)
    wire = (torch.float32, torch.bfloat16, torch.float16)

    async def main():
        b = await started(group, delay_s=0.01)
        reqs = []
        for i, T in enumerate(sizes):
            x, ids, w = batch(T, 70 + i)
            x = x.to(wire[i % 3] if i not in bad else torch.float32)
            if i in bad:
                row, value = bad[i]
                x[row, i % CFG.H] = value
            reqs.append((x, ids, w))
        outs = await asyncio.gather(*(b.submit(*r, timeout_s=10) for r in reqs), return_exceptions=True)
        await b.close()
        return reqs, outs

    reqs, outs = run(main())
    assert group.nonfinite_steps == 0
    assert len(group.steps) < sum(-(-T // BUDGET) for T in sizes), "the requests should have shared steps"
    for i, ((x, ids, w), out) in enumerate(zip(reqs, outs, strict=True)):
        if i in bad:
            row, value = bad[i]
            if value == -7e4 and slot_dtype == torch.float32:  # fits a float32 slot: a good request
                assert not isinstance(out, BaseException), out
                continue
            assert isinstance(out, InvalidInput), (i, out)
            what = "outside the range of float16" if value == -7e4 else "NaN or infinity"
            assert f"{what} (row {row})" in str(out), (i, out)
            continue
        assert not isinstance(out, BaseException), (i, out)
        assert out.dtype == x.dtype and out.shape == x.shape
        solo = _solo(FakeGroup(CFG, dtype=slot_dtype), x, ids, w)
        assert rel_err(out.float(), solo.float()) <= TOL[x.dtype], i


def test_a_bad_piece_checked_while_a_good_piece_of_the_same_request_is_never_answered(monkeypatch):
    """Request J is split over two steps in flight at once; the thread of the step holding its bad
    piece checks it while the other step's thread is still checking J's good piece. The mark must
    stay: J gets its 400 naming the bad row (an overwritten mark answered it 200, with rows the
    layer computed from zeros or never copied out)."""
    import service.api.batcher as batcher_mod

    real = batcher_mod.rows_error
    bad_checked = threading.Event()

    def rows_error(rows, sent, first=0):
        if first == 0 and sent.shape[0] == 2:  # J's good first piece: finish after the bad one
            assert bad_checked.wait(5)
            result = real(rows, sent, first)
            time.sleep(0.01)
            return result
        result = real(rows, sent, first)
        if first == 2:  # J's bad second piece
            bad_checked.set()
        return result

    monkeypatch.setattr(batcher_mod, "rows_error", rows_error)
    group = FakeGroup(CFG, step_s=0.05)

    async def main():
        b = await started(group, delay_s=0.01)
        mate, J = batch(6, 1), batch(6, 2)  # mate: rows 0..5 of step A; J: 0..1 in A, 2..5 in B
        J[0][3, 0] = float("nan")
        res = await asyncio.gather(b.submit(*mate, timeout_s=10), b.submit(*J, timeout_s=10),
                                   return_exceptions=True)
        await b.close()
        return mate, res

    mate, (mate_out, j_out) = run(main())
    assert sorted(group.steps) == [4, 8], group.steps  # (B may run first: A waits for its check)
    assert isinstance(j_out, InvalidInput) and "row 3" in str(j_out), j_out
    assert rel_err(mate_out, group.ref(*mate)) < TOL[torch.float32]
    assert group.nonfinite_steps == 0


def test_the_answer_lands_in_the_callers_buffer():
    """submit(out=...) writes the answer there (the response's own bytes: one copy out of the slot)
    and returns it; a buffer of another shape or dtype is refused before anything is queued."""
    group = FakeGroup(CFG)
    x, ids, w = batch(11, 90)  # two steps
    buf = torch.full((11, CFG.H), float("nan"), dtype=torch.bfloat16)

    async def main():
        b = await started(group)
        got = await b.submit(x, ids, w, timeout_s=10, out_dtype=torch.bfloat16, out=buf)
        with pytest.raises(ValueError, match="out is"):
            await b.submit(x, ids, w, timeout_s=10, out_dtype=torch.bfloat16, out=buf[:10])
        await b.close()
        return got

    got = run(main())
    assert got.data_ptr() == buf.data_ptr()
    assert rel_err(buf.float(), group.ref(x, ids, w)) < TOL[torch.bfloat16]
    assert sorted(group.steps) == [3, 8]  # two steps; in flight at once on the two slots, either may run first


def test_a_failure_to_record_metrics_does_not_hold_answers_back(caplog):
    """The books fail after a step (a bug in them): the step's requests are answered at once, correct,
    the failure is logged, and the next requests are served too."""
    group = FakeGroup(CFG)

    class BrokenBooks(Metrics):
        def observe_step(self, stats):
            raise AttributeError("no such field")

    async def main():
        b = await started(group, metrics=BrokenBooks())
        reqs = [batch(T, 40 + T) for T in (3, 9)]
        t0 = time.monotonic()
        outs = [await b.submit(*r, timeout_s=5) for r in reqs]
        elapsed = time.monotonic() - t0
        await b.close()
        return reqs, outs, elapsed

    reqs, outs, elapsed = run(main())
    assert elapsed < 2.0, elapsed  # not the 5 s deadline
    for (x, ids, w), out in zip(reqs, outs, strict=True):
        assert rel_err(out, group.ref(x, ids, w)) < TOL[torch.float32]
    assert "recording the metrics of step" in caplog.text


def test_the_answer_wakes_its_caller_before_the_steps_books():
    """The step's books (metrics) are recorded after the callers it answered have run: each request
    sees its answer with the books of its step still unwritten, and they are written right after."""
    group = FakeGroup(CFG)
    seen = []

    class Books(Metrics):
        def observe_step(self, stats):
            seen.append(("books", stats.seq))
            super().observe_step(stats)

    async def main():
        metrics = Books()
        b = await started(group, metrics=metrics, delay_s=0.0)
        for i, T in enumerate((3, 8)):
            x, ids, w = batch(T, 60 + T)
            out = await b.submit(x, ids, w, timeout_s=5)
            seen.append(("answer", T))
            assert rel_err(out, group.ref(x, ids, w)) < TOL[torch.float32]
            await until(lambda i=i: len(seen) == 2 * (i + 1), f"{seen}: the books of step {i + 1} are missing", 2.0)
        await b.close()
        return metrics

    metrics = run(main())
    assert seen == [("answer", 3), ("books", 1), ("answer", 8), ("books", 2)]
    assert metrics.steps._value.get() == 2


def test_a_deadline_during_the_step_answers_at_the_deadline_and_the_next_request_is_served():
    """The step holding a request's rows outlives its deadline: DeadlineExceeded at the deadline, not at
    the step's end; the step still ends cleanly and the next request gets its own answer."""
    group = FakeGroup(CFG)
    group.resume.clear()  # the step stays in run() until the test resumes it

    async def main():
        b = await started(group, delay_s=0.0)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"deadline \(0.2 s were left of it when it was queued\)"):
            await b.submit(*batch(5, 70), timeout_s=0.2)
        waited = time.monotonic() - t0
        assert group.entered == [5], "the step never reached group.run"
        group.resume.set()
        x, ids, w = batch(4, 71)
        out = await b.submit(x, ids, w, timeout_s=5)
        await b.close()
        return waited, out, (x, ids, w)

    waited, out, (x, ids, w) = run(main())
    assert 0.15 < waited < 2.0, waited
    assert rel_err(out, group.ref(x, ids, w)) < TOL[torch.float32]
    assert sorted(group.steps) == [4, 5]  # (on two slots: the held step may end after the next)


def test_queue_delay_and_full_budget():
    group = FakeGroup(CFG)
    delay_s = 0.5

    async def main():
        b = await started(group, delay_s=delay_s)
        t0 = time.monotonic()
        await b.submit(*batch(BUDGET, 1), timeout_s=10)  # a full budget does not wait
        full = time.monotonic() - t0
        t0 = time.monotonic()
        await b.submit(*batch(2, 2), timeout_s=10)  # a partial one waits for company
        partial = time.monotonic() - t0
        await b.close()
        return full, partial

    full, partial = run(main())
    # A full budget that waited for company would take the delay at least (the batcher's clock is
    # this one); a loaded machine only lengthens both.
    assert full < delay_s and partial >= delay_s - 0.01, (full, partial)


def test_an_idle_group_takes_a_step_at_once_and_busy_ones_batch():
    """Without idle_wait a partial step goes at once when no step runs; requests that arrive while
    one runs share the next step (the delay still bounds how long they wait for company)."""
    group = FakeGroup(CFG)
    delay_s = 0.5

    async def main():
        b = await started(group, delay_s=delay_s, idle_wait=False)
        t0 = time.monotonic()
        await b.submit(*batch(2, 1), timeout_s=10)  # idle: taken at once, not after the delay
        alone = time.monotonic() - t0
        # The next steps stay in run() (on the device) until resumed: the first one runs while the
        # latecomers come (a 50 ms sleep beside a 0.2 s step assumed it).
        group.resume.clear()
        first = asyncio.create_task(b.submit(*batch(3, 2), timeout_s=10))
        await until(lambda: len(group.entered) == 2, "the first step did not reach group.run")
        rest = [asyncio.create_task(b.submit(*batch(1, 4), timeout_s=10))]
        await asyncio.sleep(0.01)  # the batcher has seen it: taken alone now, were the group idle
        rest.append(asyncio.create_task(b.submit(*batch(4, 7), timeout_s=10)))  # well within its delay
        await until(lambda: len(group.entered) == 3, "the latecomers' step did not reach group.run")
        group.resume.set()
        outs = await asyncio.gather(first, *rest)
        await b.close()
        return alone, outs

    alone, outs = run(main())
    assert alone < delay_s, alone  # waiting for company while idle takes the delay at least
    assert group.entered == [2, 3, 5], group.entered  # the two latecomers in one step
    for (T, seed), out in zip([(3, 2), (1, 4), (4, 7)], outs, strict=True):
        assert rel_err(out, group.ref(*batch(T, seed))) < TOL[torch.float32]


def test_overload_is_immediate_and_accepted_requests_finish():
    group = FakeGroup(CFG)

    async def main():
        b = await started(group, delay_s=60, queue_tokens=10)
        first = asyncio.create_task(b.submit(*batch(6, 1), timeout_s=10))
        # first is queued, waiting for company (a 0.3 s delay and a 10 ms sleep let a stalled loop
        # send it alone before the second came)
        await until(lambda: b._queued == 6, "the first request was not queued")
        # At once: submit raises before it first suspends (it never waits for room in the queue); a
        # 50 ms wall-clock bound judged the machine's load as much as the batcher.
        rejected = b.submit(*batch(6, 2), timeout_s=10)
        with pytest.raises(Overloaded, match="queue is full"):
            rejected.send(None)
        filler = asyncio.create_task(b.submit(*batch(2, 3), timeout_s=10))  # 6 + 2 fill the budget: the step goes
        outs = await asyncio.gather(first, filler)
        await b.close()
        return outs

    assert [tuple(out.shape) for out in run(main())] == [(6, CFG.H), (2, CFG.H)]


def test_deadline_in_queue_drops_the_work():
    group = FakeGroup(CFG)
    metrics = Metrics()

    async def main():
        b = await started(group, delay_s=0.2, metrics=metrics)
        with pytest.raises(DeadlineExceeded):
            await b.submit(*batch(3, 1), timeout_s=0.05)
        await asyncio.sleep(0.3)
        await b.close()

    run(main())
    assert group.steps == []
    assert metrics.queued_tokens._value.get() == 0 and metrics.inflight._value.get() == 0


def test_failed_step_fails_its_requests_and_reports_once():
    group = FakeGroup(CFG, fail_at_step=0)
    failures = []

    async def main():
        b = await started(group, on_failure=lambda g, e: failures.append((g, e)))
        with pytest.raises(WorkerError):
            await b.submit(*batch(5, 1), timeout_s=10)
        await b.close()

    run(main())
    assert len(failures) == 1 and failures[0][0] is group


def test_detach_fails_pending_and_refuses_new():
    group = FakeGroup(CFG)
    group.resume.clear()  # the steps stay in run() until the detach (a 0.2 s step and a 50 ms sleep assumed it)

    async def main():
        b = await started(group, delay_s=0.0)
        pending = [asyncio.create_task(b.submit(*batch(8, i), timeout_s=10)) for i in range(4)]
        await until(lambda: group.entered, "no step reached group.run")
        b.detach(GroupUnavailable("restarting"))
        group.resume.set()
        results = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(r, GroupUnavailable) for r in results), results
        with pytest.raises(GroupUnavailable, match="restarting"):
            await b.submit(*batch(1, 9), timeout_s=10)
        assert b.pending == 0
        await b.close()

    run(main())


class TrackedGroup(FakeGroup):
    """A FakeGroup that counts the threads inside run() and refuses to be used once closed."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.inside = 0
        self.closed = False

    def run(self, slot, T):
        assert not self.closed, "run() on a closed group"
        self.inside += 1
        try:
            return super().run(slot, T)
        finally:
            self.inside -= 1


@pytest.mark.parametrize("timeout_s, steps", [(5.0, [BUDGET, BUDGET]), (0.05, [BUDGET])])
def test_close_joins_steps_in_flight(timeout_s, steps):
    """close() returns with no thread in group.run: steps in flight finish within the timeout;
    past it, a step that has not reached group.run (here: waiting for the one slot) is dropped."""
    group = TrackedGroup(CFG, slots=1, step_s=0.3)
    past_timeout = timeout_s < 1.0  # step 1 still runs when close() stops waiting: held until then

    async def resume_once_close_stops_waiting(b: Batcher) -> None:
        await until(lambda: b._closing, "close() never stopped waiting")
        group.resume.set()

    async def main():
        b = await started(group, delay_s=0.0, slots=2)
        if past_timeout:  # (a 0.3 s step assumed it: a loop stalled for 0.25 s ran step 2 too)
            group.resume.clear()
            opener = asyncio.create_task(resume_once_close_stops_waiting(b))
        pending = [asyncio.create_task(b.submit(*batch(BUDGET, i), timeout_s=10)) for i in range(2)]
        await until(lambda: group.inside, "no step reached group.run")  # (a thread start on a loaded box)
        await b.close(timeout_s=timeout_s)  # step 2 waits for the slot, or has not started
        if past_timeout:
            await opener
        assert group.inside == 0, "close() returned while a step thread was inside group.run"
        group.closed = True
        await asyncio.gather(*pending, return_exceptions=True)

    run(main())
    assert group.steps == steps


# ---- copies split over threads (RowSplit, --copy-threads) -------------------------------------


def test_row_split_runs_every_row_once_in_order_the_first_range_in_the_caller():
    from service.api.batcher import SPLIT_MIN_BYTES, RowSplit

    split = RowSplit(3)
    calls: list[tuple[int, int, threading.Thread]] = []

    def fn(lo, hi):
        calls.append((lo, hi, threading.current_thread()))
        return lo

    try:
        for n in (1, 2, 3, 7, 512):
            calls.clear()

            got = split.run(fn, n, SPLIT_MIN_BYTES)  # a piece of 1 MiB: split as far as the threads go
            ranges = sorted((lo, hi) for lo, hi, _ in calls)
            assert len(ranges) == min(3, n), (n, ranges)
            assert [lo for lo, _ in ranges] == got, "results in row order"
            assert ranges[0][0] == 0 and ranges[-1][1] == n and all(
                a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False)), ranges
            by_lo = {lo: t for lo, _, t in calls}
            assert by_lo[0] is threading.current_thread()
            assert all(t.name.startswith("moe-copy") for lo, t in by_lo.items() if lo), by_lo
    finally:
        split.close()
    one = RowSplit(1)
    assert one.run(lambda lo, hi: (lo, hi), 512, SPLIT_MIN_BYTES) == [(0, 512)]
    one.close()


def test_row_split_splits_a_piece_of_1_mib_or_more_into_as_many_ranges_as_threads():
    """The threshold is on the piece, not on each range: 1 MiB and more (1.5 MiB: between 1 and 2)
    splits into min(threads, rows) ranges; less stays whole, in the caller."""
    from service.api.batcher import SPLIT_MIN_BYTES, RowSplit

    split = RowSplit(3)
    try:
        for piece_bytes, lows in ((SPLIT_MIN_BYTES * 3 // 2, [0, 170, 341]), (SPLIT_MIN_BYTES, [0, 170, 341]),
                                  (2 * SPLIT_MIN_BYTES, [0, 170, 341]), (SPLIT_MIN_BYTES - 1, [0])):
            assert split.run(lambda lo, hi: lo, 512, piece_bytes) == lows, piece_bytes
        assert split.run(lambda lo, hi: lo, 2, SPLIT_MIN_BYTES * 3 // 2) == [0, 1]  # no more ranges than rows
    finally:
        split.close()


def test_a_piece_is_split_by_its_size_in_the_slots_dtype(monkeypatch):
    """copy_threads=3, a bf16 slot: a request of T=192 bf16 rows of H=4096 (1.5 MiB in the slot) is
    copied in and out in 3 ranges; T=96 sent and answered in fp32 (1.5 MiB on the wire, 0.75 MiB in the
    slot) stays whole both ways; both answers right."""
    import service.api.batcher as batcher_mod

    cfg = LayerConfig(E=5, H=4096, I=12, K=2, R=2, C=96, dtype=torch.bfloat16)  # budget 192
    group = FakeGroup(cfg, dtype=torch.bfloat16)
    ranges: list[tuple[str, int, int]] = []
    real_in, real_out = batcher_mod._copy_in, batcher_mod._copy_out

    def copy_in(dst, src, first, lo, hi):
        ranges.append(("in", lo, hi))
        return real_in(dst, src, first, lo, hi)

    def copy_out(dst, src, lo, hi):
        ranges.append(("out", lo, hi))
        real_out(dst, src, lo, hi)

    monkeypatch.setattr(batcher_mod, "_copy_in", copy_in)
    monkeypatch.setattr(batcher_mod, "_copy_out", copy_out)

    def request(T, seed, dtype):
        gen = torch.Generator().manual_seed(seed)
        ids, w = routing(T, cfg.E, cfg.K, "balanced", gen)
        return torch.randn(T, cfg.H, generator=gen).to(dtype), ids.to(torch.int32), w

    async def main():
        b = await started(group, budget=cfg.tokens_per_step, queue_tokens=1000, copy_threads=3)
        got = []
        for T, dtype in ((192, torch.bfloat16), (96, torch.float32)):
            ranges.clear()
            req = request(T, 500 + T, dtype)
            out = await b.submit(*req, timeout_s=10, out_dtype=dtype)
            got.append((req, out, sorted(ranges)))
        await b.close()
        return got

    (big, big_out, big_ranges), (small, small_out, small_ranges) = run(main())
    assert big_ranges == [(d, lo, hi) for d in ("in", "out") for lo, hi in ((0, 64), (64, 128), (128, 192))]
    assert small_ranges == [("in", 0, 96), ("out", 0, 96)]
    for (x, ids, w), out in ((big, big_out), (small, small_out)):
        assert out.dtype == x.dtype
        assert rel_err(out.float(), group.ref(x.to(torch.bfloat16).float(), ids, w)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("failing", [0, 1])
def test_row_split_returns_or_raises_only_after_every_range_finished(failing):
    """A range that raises (0: the caller's own, 1: a helper's) while the others still run: `run` raises
    that error only once every range has finished (a range still writing after its step released the
    slot would write into the next step's rows)."""
    from service.api.batcher import SPLIT_MIN_BYTES, RowSplit

    split = RowSplit(3)
    finished: list[int] = []

    def fn(lo, hi):
        if lo == failing:
            raise RuntimeError(f"range {lo} failed")
        if lo:
            time.sleep(0.2)
        finished.append(lo)

    try:
        with pytest.raises(RuntimeError, match=f"range {failing} failed"):
            split.run(fn, 3, SPLIT_MIN_BYTES)  # ranges [0, 1), [1, 2), [2, 3)
        assert sorted(finished) == sorted({0, 1, 2} - {failing}), finished
    finally:
        split.close()


def test_a_step_whose_copy_fails_releases_its_slot_after_its_helpers_wrote(split_every_piece, monkeypatch):
    """One slot, copy_threads=3: request A's copy in fails in the step thread's range while its helper
    range still copies; the slot is released only after that helper wrote, so request B, which takes
    the slot next, is answered from its own rows (the bug: B's row 1 computed from A's, rel err ~1)."""
    import service.api.batcher as batcher_mod

    group = FakeGroup(CFG, slots=1)
    xa, ida, wa = batch(2, 1)
    events: list[str] = []
    real_in, real_release = batcher_mod._copy_in, group.release

    def copy_in(dst, src, first, lo, hi):
        if src.untyped_storage().data_ptr() == xa.untyped_storage().data_ptr():
            if lo == 0:
                raise RuntimeError("A's copy failed in the step thread")
            time.sleep(0.1)
            real_in(dst, src, first, lo, hi)
            events.append("A's helper wrote the slot")
            return None
        return real_in(dst, src, first, lo, hi)

    def release(slot):
        events.append("slot released")
        real_release(slot)

    monkeypatch.setattr(batcher_mod, "_copy_in", copy_in)
    group.release = release
    xb, idb, wb = batch(BUDGET, 2)

    async def main():
        b = await started(group, slots=1, copy_threads=3, on_failure=lambda g, e: None)
        with pytest.raises(GroupUnavailable, match="A's copy failed"):
            await b.submit(xa, ida, wa, timeout_s=5)
        out = await b.submit(xb, idb, wb, timeout_s=5)
        await b.close()
        return out

    out = run(main())
    assert events == ["A's helper wrote the slot", "slot released", "slot released"], events
    ref = group.ref(xb, idb, wb)
    for r in range(BUDGET):
        assert rel_err(out[r:r + 1], ref[r:r + 1]) < TOL[torch.float32], r


def test_copies_split_over_threads_answer_bit_for_bit_and_name_the_first_bad_row(split_every_piece):
    """copy_threads=3: requests of odd sizes (T=1, split over steps) sharing steps get the same bits as
    with one thread; a request with bad rows in two of a piece's ranges gets the same 400 as with one
    thread, naming its first bad row: the ranges' results come back in row order, whichever range
    finishes first, and the first that found a bad row names it; its batch-mates are unaffected."""
    sizes = [20, 1, 13, 3, 7, 1, 9]
    bad = {0: (2, 6, 14)}  # request 0 (T=20; its first piece, rows 0..7, in ranges 0..1, 2..4, 5..7): NaN rows

    def serve(copy_threads):
        group = FakeGroup(CFG, step_s=0.002)

        async def main():
            b = await started(group, delay_s=0.01, copy_threads=copy_threads)
            reqs = []
            for i, T in enumerate(sizes):
                x, ids, w = batch(T, 300 + i)
                for row in bad.get(i, ()):
                    x[row, 1] = float("nan")
                reqs.append((x.to(torch.bfloat16), ids, w))
            outs = await asyncio.gather(*(b.submit(*r, timeout_s=10) for r in reqs), return_exceptions=True)
            await b.close()
            return reqs, outs, group

        return run(main())

    reqs, split_outs, group = serve(3)
    _, one_outs, _ = serve(1)
    assert group.nonfinite_steps == 0
    for i, ((x, ids, w), out, one) in enumerate(zip(reqs, split_outs, one_outs, strict=True)):
        if i in bad:
            assert isinstance(out, InvalidInput) and "row 2)" in str(out), out
            assert isinstance(one, InvalidInput) and str(one) == str(out)
            continue
        assert not isinstance(out, BaseException), (i, out)
        assert torch.equal(out, one), i
        assert rel_err(out.float(), group.ref(x.float(), ids, w)) < TOL[torch.bfloat16], i


def test_a_later_pieces_bad_row_found_first_still_names_the_first():
    """A request of 2 x BUDGET rows runs in two steps; the first step's thread is held back after it
    takes its slot, so the second step's thread checks the later piece (NaN at row BUDGET + 3) first.
    The 400 still names the request's first bad row (row 2, in the first piece): the earlier piece is
    checked although the request is already marked, and the 400 waits for the step that holds it (the
    first version named row 11 here, and the copy-threads test below did so by chance of threads)."""

    class LateFirstStep(FakeGroup):
        taken = 0

        def acquire_slot(self, timeout=None):
            slot = super().acquire_slot(timeout)
            LateFirstStep.taken += 1
            if LateFirstStep.taken == 1:
                time.sleep(0.3)  # the second step's thread copies and checks its piece meanwhile
            return slot

    group = LateFirstStep(CFG)

    async def main():
        b = await started(group, delay_s=0.01)
        x, ids, w = batch(2 * BUDGET, 990)
        x[2, 0] = float("nan")
        x[BUDGET + 3, 1] = float("inf")
        try:
            await b.submit(x, ids, w, timeout_s=10)
        finally:
            await b.close()

    with pytest.raises(InvalidInput, match=r"\(row 2\)"):
        run(main())
    assert LateFirstStep.taken == 2


# ---- the gRPC answer's bytes and the slot they were copied from -----------------------------------


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_grpc_answers_stay_right_when_the_next_steps_reuse_the_slot(copy_threads, split_every_piece):
    """The answer grpc sends is the response's own bytes (grpc_codec.grpc_response), never memory the
    slot shares: with ONE slot, reused by every step, answers of one step (T=1, 3, 4 together) and of
    a request split over two steps (T=11) are right, and still bit for bit the same when serialized
    after later steps have overwritten that slot with other requests' rows of the same sizes (what a
    zero-copy answer handing grpc a view of the slot gets wrong, grpc may send it after the next step
    ran; and so does a response buffer reused for a later request)."""
    import numpy as np

    from service.api import grpc_codec

    group = FakeGroup(CFG, slots=1)

    def response(x):
        req = types.SimpleNamespace(x=x, out_dtype=x.dtype, request_id="r", out_region=None)
        return grpc_codec.grpc_response(req, "moe")

    async def wave(b, sizes, seed):
        reqs = [batch(T, seed + i) for i, T in enumerate(sizes)]
        reqs = [(x.to(torch.bfloat16), ids, w) for x, ids, w in reqs]
        answers = [response(x) for x, _, _ in reqs]
        await asyncio.gather(*(b.submit(*r, timeout_s=10, out_dtype=torch.bfloat16, out=a.out)
                               for r, a in zip(reqs, answers, strict=True)))
        return reqs, answers

    async def main():
        b = await started(group, slots=1, delay_s=0.05, copy_threads=copy_threads)
        first = await wave(b, [1, 3, 4], 400)      # one step of 8
        split = await wave(b, [11], 410)           # steps of 8 and 3
        sent = [bytes(bytearray(a.data)) for a in first[1] + split[1]]  # what grpc would send now
        await wave(b, [4, 3, 1], 420)              # the slot overwritten by other requests' rows,
        await wave(b, [11], 430)                   # of the same sizes (the same rows of the slot)
        await b.close()
        return first[0] + split[0], first[1] + split[1], sent

    reqs, answers, sent = run(main())
    assert group.steps == [8, 8, 3, 8, 8, 3], group.steps
    slot = group.free.get_nowait()
    slot_memory = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (slot.x, slot.out)]
    for (x, ids, w), answer, before in zip(reqs, answers, sent, strict=True):
        wire = grpc_codec.serialize_grpc_response(answer)
        at = np.frombuffer(wire, dtype=np.uint8).ctypes.data
        assert all(at + len(wire) <= lo or at >= hi for lo, hi in slot_memory), "grpc would send the slot"
        assert wire == before, "the answer changed after its slot was reused"
        out = torch.frombuffer(bytearray(pb_raw(wire)), dtype=torch.bfloat16).view(x.shape)
        assert rel_err(out.float(), group.ref(x.float(), ids, w)) < TOL[torch.bfloat16]


def pb_raw(wire: bytes) -> bytes:
    """raw_output_contents[0] of a serialized ModelInferResponse."""
    from service.api.proto import grpc_predict_v2_pb2 as pb

    return pb.ModelInferResponse.FromString(wire).raw_output_contents[0]


def test_every_front_end_splits_with_the_copy_threads_setting():
    """`--copy-threads` reaches the batcher of each front end (the owner's and service.replica's are
    one Endpoint), and 1 (the default) keeps every copy in the step thread (no helper pool)."""
    from service.config import Settings
    from service.server import Endpoint

    for threads in (1, 3):
        endpoint = Endpoint(Settings(copy_threads=threads), CFG, slots=2)
        split = endpoint.batcher._split
        assert split.threads == threads and (split._pool is None) == (threads == 1)
        split.close()
    with pytest.raises(ValueError, match="copy_threads"):
        Settings(copy_threads=0)
