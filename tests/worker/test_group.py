"""The rank group on CPU (R = 1, 2, 4 rank processes; shared-memory collectives for R > 1) against
the fp32 reference, and its failure modes."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from service.config import LayerConfig
from service.errors import GroupUnavailable, InvalidInput, WeightsError, WorkerError
from service.moe.reference import full_weights, moe_reference
from service.worker import group as group_mod
from service.worker.group import WorkerGroup
from service.worker.rank import rank_range
from tests.helpers import rel_err, routing, tolerance
from tests.serverproc import LOOPBACK, cpu_seconds, listening

SEED = 3

# (E, K, H, I, C, dtype): several shapes; C small enough that a few hundred tokens need several steps.
SHAPES = {
    "e8k2-fp32": LayerConfig(E=8, H=64, I=128, K=2, R=4, C=16, dtype=torch.float32),
    "e16k4-bf16": LayerConfig(E=16, H=96, I=64, K=4, R=4, C=32, dtype=torch.bfloat16),
    "e5k1-fp32": LayerConfig(E=5, H=32, I=48, K=1, R=4, C=8, dtype=torch.float32),
    "e7k3-r2-fp32": LayerConfig(E=7, H=40, I=32, K=3, R=2, C=13, dtype=torch.float32),
    "e6k2-r1-fp32": LayerConfig(E=6, H=24, I=20, K=2, R=1, C=27, dtype=torch.float32),
}


def check_batch(group: WorkerGroup, ref_weights, T: int, kind: str, gen: torch.Generator,
                x_dtype: torch.dtype = torch.float32) -> None:
    cfg = group.cfg
    x = torch.randn(T, cfg.H, generator=gen).to(x_dtype)
    ids, w = routing(T, cfg.E, cfg.K, kind, gen)
    out = group.forward(x, ids.to(torch.int32), w)
    assert out.shape == (T, cfg.H) and out.dtype == x_dtype
    ref = moe_reference(x.float(), ids, w, *ref_weights)
    tol = tolerance(cfg.dtype, x_dtype)  # the batch and every shard alike
    err = rel_err(out, ref)
    assert err <= tol, (T, kind, err, tol)
    # Every rank's shard, not just the whole: each rank's rows must match on their own.
    for r in range(cfg.R):
        for lo in range(0, T, cfg.tokens_per_step):
            Tstep = min(cfg.tokens_per_step, T - lo)
            start, n = rank_range(Tstep, cfg.R, r)
            rows = slice(lo + start, lo + start + n)
            if n:
                err = rel_err(out[rows], ref[rows])
                assert err <= tol, (T, kind, r, rows, err, tol)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def group(request):
    cfg = SHAPES[request.param]
    with WorkerGroup(cfg, seed=SEED, slots=2) as g:
        yield g, full_weights(cfg, SEED)


@pytest.mark.parametrize("kind,seed", [("balanced", 21), ("skewed", 22), ("empty_expert", 23)])
def test_layer_matches_reference(group, kind, seed):
    g, ref_weights = group
    gen = torch.Generator().manual_seed(seed)
    R, C = g.cfg.R, g.cfg.C
    for T in (1, 3, R * C - 1, R * C, 2 * R * C + 5):  # T=1, T % R != 0, exactly full, several steps
        check_batch(g, ref_weights, T, kind, gen)


def test_sequence_numbers_advance_and_buffers_are_reused(group):
    g, ref_weights = group
    gen = torch.Generator().manual_seed(11)
    seq0 = g.seq
    slots_before = {s.path for s in g._slots}
    for i in range(6):
        check_batch(g, ref_weights, 1 + i * 5, "balanced", gen, x_dtype=torch.bfloat16 if i % 2 else torch.float32)
    assert g.seq == seq0 + 6
    assert {s.path for s in g._slots} == slots_before


def test_a_steps_phases_add_up_to_its_wall(group):
    """StepStats.phases (rank 0's host timestamps and the owner's, one clock): every phase, none
    negative, in sum the group's wall; the rank's own phases its wall; the CPU layer's stages lie
    inside its launch phase (forward computes there); T=1 and a full step; the answer still right."""
    from service.metrics import STEP_PHASES

    g, ref_weights = group
    cfg = g.cfg
    gen = torch.Generator().manual_seed(31)
    for T in (1, cfg.tokens_per_step):
        x = torch.randn(T, cfg.H, generator=gen)
        ids, w = routing(T, cfg.E, cfg.K, "skewed", gen)
        slot = g.acquire_slot()
        try:
            slot.x[:T].copy_(x)
            slot.ids[:T].copy_(ids)
            slot.w[:T].copy_(w)
            stats = g.run(slot, T)
            out = slot.out[:T].float()
        finally:
            g.release(slot)
        assert rel_err(out, moe_reference(x, ids, w, *ref_weights)) <= tolerance(cfg.dtype, torch.float32)
        assert list(stats.phases) == list(STEP_PHASES)
        assert min(stats.phases.values()) >= 0.0, stats.phases
        assert sum(stats.phases.values()) == pytest.approx(stats.wall_s, rel=1e-9, abs=1e-9)
        rank_part = ("copy_in", "launch", "device", "copy_out", "checks")
        assert sum(stats.phases[p] for p in rank_part) == pytest.approx(stats.rank_wall_s, rel=1e-9, abs=1e-9)
        assert 0.0 < stats.layer_s <= stats.phases["launch"] < stats.wall_s
        assert stats.phases["device"] == 0.0  # no device to wait for on the CPU


def test_bad_batches_are_rejected_before_reaching_a_rank(group):
    g, _ = group
    cfg = g.cfg
    x = torch.randn(4, cfg.H)
    ids = torch.zeros(4, cfg.K, dtype=torch.int32)
    w = torch.ones(4, cfg.K)
    with pytest.raises(InvalidInput, match=r"topk_ids must lie in \[0, "):
        g.forward(x, ids + cfg.E, w)
    with pytest.raises(InvalidInput, match="hidden_states must be"):
        g.forward(torch.randn(4, cfg.H + 1), ids, w)
    with pytest.raises(InvalidInput, match="must be"):
        g.forward(x, ids[:3], w)
    with pytest.raises(InvalidInput, match="empty"):
        g.forward(x[:0], ids[:0], w[:0])
    assert g.alive  # the group is untouched
    check_batch(g, full_weights(cfg, SEED), 5, "balanced", torch.Generator().manual_seed(1))


def test_uneven_split_helper():
    for T in range(0, 40):
        for R in (1, 3, 4):
            parts = [rank_range(T, R, r) for r in range(R)]
            assert sum(n for _, n in parts) == T
            assert max(n for _, n in parts) - min(n for _, n in parts) <= 1
            assert all(parts[r][0] + parts[r][1] == parts[r + 1][0] for r in range(R - 1))


SMALL = LayerConfig(E=4, H=16, I=32, K=2, R=4, C=4, dtype=torch.float32)


def test_rank_exception_reaches_parent_with_traceback():
    with WorkerGroup(SMALL) as g:
        slot = g.acquire_slot()
        slot.x[:4].normal_()
        slot.ids[:4] = 1_000_000  # bypasses forward()'s validation: the rank itself must fail
        slot.w[:4] = 0.5
        with pytest.raises(WorkerError) as info:
            g.run(slot, 4)
        assert info.value.traceback and "Traceback" in info.value.traceback
        assert not g.alive
        with pytest.raises((WorkerError, GroupUnavailable)):
            g.run(slot, 4)


def test_killed_rank_fails_the_step_without_hanging():
    with WorkerGroup(SMALL, step_timeout_s=30) as g:
        os.kill(g.pids[2], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rank 2 died"):
            g.forward(torch.randn(3, SMALL.H), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2))
        assert time.monotonic() - t0 < 10


def test_a_killed_rank_is_named_with_its_signal():
    """Before: "rank 1 died (exit code None)": the pipe closes before the process can be reaped."""
    with WorkerGroup(SMALL, step_timeout_s=30) as g:
        os.kill(g.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="rank 1 died \\(killed by signal 9, SIGKILL\\)"):
            g.forward(*_batch(3, 2))


def test_sigint_to_the_ranks_changes_nothing():
    """A terminal's Ctrl-C reaches every process of the group: the ranks ignore it (the owner stops
    them). Before: each rank raised KeyboardInterrupt and the step in flight failed (user's trial 4)."""
    with WorkerGroup(SMALL, step_timeout_s=30) as g:
        x, ids, w = _batch(5, 4)
        before = g.forward(x, ids, w)
        for pid in g.pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert g.heartbeat() is True and g.poll()
        assert torch.equal(g.forward(x, ids, w), before)


def test_rank_killed_mid_step_fails_it_and_its_peers_do_not_spin():
    """Rank 1 stopped, a step sent: its peers publish their rows and wait in the step's first barrier
    (asleep: no CPU time while they wait); rank 1 killed: the step fails at once, nothing hangs."""
    import concurrent.futures

    with WorkerGroup(SMALL, step_timeout_s=60) as g:
        g.forward(*_batch(5, 3))
        os.kill(g.pids[1], signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            step = pool.submit(g.forward, *_batch(SMALL.tokens_per_step, 4))
            peers = [g.pids[r] for r in (0, 2, 3)]
            # Once the other ranks reach the barrier they sleep in the kernel: a second passes with
            # hardly any CPU time spent. How soon they get there depends on the machine's load, so
            # look at successive seconds until two in a row are quiet. Asleep they spend 0.00-0.01 s
            # of CPU a second (a wake-up per barrier slice); a rank spinning at the barrier gets far
            # more than 0.05 s even on a loaded machine (0.28-0.38 s at load 3), so it never passes.
            deadline, quiet = time.monotonic() + 30, 0
            while quiet < 2:
                cpu0 = [cpu_seconds(p) for p in peers]
                time.sleep(1.0)
                spent = [cpu_seconds(p) - c for p, c in zip(peers, cpu0, strict=True)]
                quiet = quiet + 1 if max(spent) < 0.05 else 0
                assert time.monotonic() < deadline, f"the waiting ranks spin: {spent} s of CPU in 1 s"
            assert not step.done()
            t0 = time.monotonic()
            os.kill(g.pids[1], signal.SIGKILL)
            with pytest.raises(WorkerError, match="rank 1 died"):
                step.result(timeout=30)
            assert time.monotonic() - t0 < 10
        assert not g.alive
    for pid in g.pids:  # every rank reaped, the waiting ones too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_stalled_rank_times_out():
    with WorkerGroup(SMALL, step_timeout_s=3) as g:
        os.kill(g.pids[1], signal.SIGSTOP)  # alive but silent: only the step timeout can tell
        with pytest.raises(WorkerError, match="rank 1 is stopped .* did not answer within 3 s"):
            g.forward(torch.randn(3, SMALL.H), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2))
    for pid in g.pids:  # close() reaped every rank
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_silent_ranks_are_explained(monkeypatch):
    """Which ranks a timeout names: the stopped one where the kernel says so; those that did not
    answer while the others did; or the whole group, saying why all are listed. The deadline is
    written as it was set (before: "within 0 s" for step_timeout_s=0.001)."""
    g = WorkerGroup(SMALL)
    g._conns = [object()] * 4

    class Proc:
        def __init__(self, pid):
            self.pid = pid

    stopped = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while group_mod._process_state(stopped.pid) not in group_mod.STOPPED_STATES:
            assert time.monotonic() < deadline, "SIGSTOP did not take"
            time.sleep(0.01)
        g._procs = [Proc(os.getpid()), Proc(os.getpid()), Proc(stopped.pid), Proc(os.getpid())]
        assert g._silence([0, 1, 2, 3], "step 7", 0.001) == (
            "step 7: rank 2 is stopped (SIGSTOP or a debugger), and ranks [0, 1, 2, 3] did not answer within 0.001 s")
    finally:
        stopped.kill()
        stopped.wait()
    g._procs = [Proc(os.getpid())] * 4
    assert g._silence([1, 3], "heartbeat after step 2", 2.0) == (
        "heartbeat after step 2: ranks [1, 3] did not answer within 2 s (the others did)")
    assert "within 1200 s" in g._silence([0, 1, 2, 3], "start", 1200.0)  # (not 1.2e+03)
    text = g._silence([0, 1, 2, 3], "step 9", 12.5)
    assert text.startswith("step 9: the group did not answer within 12.5 s; all ranks [0, 1, 2, 3] are listed")
    assert "one stalled rank holds every one" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA, where a CUDA rank raises")
def test_a_rank_that_raises_at_start_is_a_failure_with_its_traceback():
    """Not a refusal (a backend or weights): the group's start fails with WorkerError (the serve command's
    exit 1) carrying the rank's traceback."""
    with pytest.raises(WorkerError, match="start: rank . raised") as info:
        WorkerGroup(SMALL, device="cuda", start_timeout_s=60).start()
    assert "Traceback" in str(info.value) and "cuda" in str(info.value)


def test_weights_a_rank_refuses_are_reported_as_such(tmp_path):
    """A rank that cannot load its weights refuses them (WeightsError, the serve command's exit 2), naming
    the file, as a rank refuses a backend: not a failure of the group."""
    bad = tmp_path / "missing.safetensors"
    with pytest.raises(WeightsError) as info:
        WorkerGroup(SMALL, weights=str(bad), start_timeout_s=60).start()
    assert "missing.safetensors" in str(info.value)


def test_a_rank_that_cannot_be_spawned_reports_its_own_error(monkeypatch):
    """The second rank's process fails to start: start() raises that error (not an assertion from
    joining a process that never started), and the rank already started is stopped."""
    import multiprocessing.context

    started = []
    real_start = multiprocessing.context.SpawnProcess.start

    def start(proc):
        if started:
            raise OSError("no more processes")
        real_start(proc)
        started.append(proc)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    group = WorkerGroup(SMALL, start_timeout_s=60)
    with pytest.raises(OSError, match="no more processes"):
        group.start()
    assert len(started) == 1 and not started[0].is_alive() and started[0].exitcode is not None
    assert not group.alive


def _batch(T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids, w = routing(T, SMALL.E, SMALL.K, "balanced", gen)
    return torch.randn(T, SMALL.H, generator=gen), ids.to(torch.int32), w


def test_stopped_rank_fails_the_heartbeat_of_an_idle_group():
    with WorkerGroup(SMALL, step_timeout_s=60) as g:
        assert g.heartbeat() is True  # every rank answers
        os.kill(g.pids[3], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="heartbeat.*rank 3 is stopped.*ranks \\[3\\] did not answer"):
            g.heartbeat()
        assert time.monotonic() - t0 < 5
        assert not g.alive and not g.poll()
        with pytest.raises((WorkerError, GroupUnavailable)):
            g.forward(*_batch(3, 1))


def test_step_deadline_follows_the_measured_steps():
    """After a few measured steps a stopped rank fails the step in seconds, not step_timeout_s."""
    with WorkerGroup(SMALL, step_timeout_s=60) as g:
        assert g.step_deadline_s() == 60  # nothing measured yet
        for seed in range(4):
            g.forward(*_batch(2 * SMALL.tokens_per_step - 3, seed))
        assert g.step_deadline_s() < 10
        os.kill(g.pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rank 0 is stopped .* did not answer within"):
            g.forward(*_batch(5, 9))
        assert time.monotonic() - t0 < 10


def test_rank_group_listens_on_loopback_only():
    with WorkerGroup(SMALL) as g:
        addresses = listening({os.getpid(), *g.pids})
        assert addresses, "the group's store should be listening"
        assert all(a.startswith(LOOPBACK) for a in addresses), addresses
        g.forward(*_batch(3, 2))  # the ranks rendezvoused through it


def test_steps_of_several_threads_overlap_and_keep_their_rows(group):
    """Two threads on the two slots: steps are sent while the other's runs (group.run holds no lock
    across a step), answers reach their own thread, every batch matches the reference."""
    import concurrent.futures

    g, ref_weights = group
    seq0 = g.seq

    def worker(i: int) -> None:
        gen = torch.Generator().manual_seed(40 + i)
        for T in (1, g.cfg.tokens_per_step, 7, 2 * g.cfg.tokens_per_step + 3):
            check_batch(g, ref_weights, T, ("balanced", "skewed")[i], gen)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(worker, i) for i in range(2)]:
            f.result()
    assert g.seq == seq0 + 2 * (1 + 1 + 1 + 3) and g._in_flight == 0 and not g._answers


def test_closing_while_a_failing_step_kills_the_ranks(monkeypatch):
    """The supervisor closes the group as soon as any step reports it not running, which may be while
    the thread whose step saw the rank die is still killing the others: both closed the same pipes,
    and close() raised (TypeError or EBADF: the server's supervision then died). Closing a pipe is
    slowed here so that the two always meet."""
    import multiprocessing.connection as mpc

    slow = mpc.Connection._close

    def slow_close(conn):
        time.sleep(0.05)
        slow(conn)

    monkeypatch.setattr(mpc.Connection, "_close", slow_close)
    g = WorkerGroup(LayerConfig(E=8, H=64, I=128, K=2, R=2, C=16, dtype=torch.float32), seed=SEED, slots=3)
    g.start()
    errors: list[BaseException] = []

    def steps():
        try:
            while True:
                slot = g.acquire_slot(5)
                try:
                    g.run(slot, 16)
                finally:
                    g.release(slot)
        except BaseException as exc:  # noqa: BLE001  what each thread ends with is checked below
            errors.append(exc)

    threads = [threading.Thread(target=steps) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.05)
        os.kill(g.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while g.alive:  # the failing step's thread has begun its kill
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        g.close()
    finally:
        for t in threads:
            t.join(10)
        g.close()
    assert len(errors) == 3 and not any(t.is_alive() for t in threads)
    assert all(isinstance(e, (WorkerError, GroupUnavailable)) for e in errors), errors
    assert any("rank 1 died (killed by signal 9, SIGKILL)" in str(e) for e in errors), errors
