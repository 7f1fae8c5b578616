"""Child processes started ahead of the tests that wait on them, at the lowest CPU priority.

A few tests wait on one long child process whose work depends on nothing else in the session: a
module's Triton-interpreter cases (tests/interp.py, 3-60 s each on the 2-core CI machine), the
image recipe's replay (tests/deploy/test_image_recipe.py, ~50 s), g++ over csrc/bindings.cpp
(~5 s a variant). Most other tests leave a core idle while they wait on servers, ranks and
subprocesses starting, so once collection ends (tests/conftest.py) the session starts these
children one after another at niceness 19, where they get only the CPU time the tests leave; the
test that needs one then finds it done, or waits for it. A child the queue has not reached when its
test asks is started by the test at normal priority, as before. It is the same command either way.
At the session's end (pytest_sessionfinish, also after Ctrl-C or -x) the children still running
are killed with their own children (each leads a process group) and the scratch folders
removed; a pytest killed outright leaves them to finish alone.

A module lists its children in `background_jobs()`, which returns `Job`s; the test gets the
result with `result(job)`. Only the key names a job: the child runs as it was queued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

NICENESS = 19  # the lowest priority: the children take a core only where the tests leave it idle


@dataclasses.dataclass(frozen=True)
class Job:
    """One child process: `argv` in `cwd` with `env` (None: this process's); at most `timeout_s`
    from the moment a test asks for it. `scratch`: a folder the child writes into, removed at the
    session's end if its test has not removed it."""

    key: str
    argv: tuple[str, ...]
    timeout_s: float
    env: tuple[tuple[str, str], ...] | None = None
    cwd: str | None = None
    scratch: str | None = None

    @staticmethod
    def of(key: str, argv: list[str], timeout_s: float, *, env: dict[str, str] | None = None,
           cwd: str | Path | None = None, scratch: str | Path | None = None) -> Job:
        return Job(key, tuple(argv), timeout_s, None if env is None else tuple(sorted(env.items())),
                   None if cwd is None else str(cwd), None if scratch is None else str(scratch))


class _Run:
    """A job's child: not started (proc None), running, or done; its output in files (a pipe nobody
    reads yet would stall a child that writes more than the pipe holds)."""

    def __init__(self, job: Job):
        self.job = job
        self.proc: subprocess.Popen | None = None
        self.out = tempfile.TemporaryFile()
        self.err = tempfile.TemporaryFile()

    def start(self, background: bool) -> None:
        nice = ["nice", "-n", str(NICENESS)] if background and shutil.which("nice") else []
        # A process group of its own: kill() ends the child's own children too (pip under the image
        # recipe's replay, cc1plus under g++), which outlive a killed child otherwise. Not a session of
        # its own: with the kernel's autogroup scheduling (sched_autogroup_enabled, on by default in
        # most distributions' kernels) each new session gets its own task group, which the scheduler
        # gives as much CPU as the whole test session's group, and a nice value counts only within
        # its group. Niceness 19 in a session of its own took a core of the two from the tests
        # (test_background checks the child stays in the tests' group).
        self.proc = subprocess.Popen([*nice, *self.job.argv], stdin=subprocess.DEVNULL, stdout=self.out,
                                     stderr=self.err, env=None if self.job.env is None else dict(self.job.env),
                                     cwd=self.job.cwd, process_group=0)

    def kill(self) -> None:
        """Kill the child's whole process group (it leads one) and reap the child."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def completed(self) -> subprocess.CompletedProcess:
        outputs = []
        for f in (self.out, self.err):
            f.seek(0)
            outputs.append(f.read().decode(errors="replace"))
            f.close()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, *outputs)


class Queue:
    """Jobs run one after another in the background; any of them taken by a test at any time."""

    def __init__(self):
        self._lock = threading.Lock()  # guards _runs, _stopping and every _Run.proc (the queue and a test race)
        self._runs: dict[str, _Run] = {}
        self._scratch: set[str] = set()  # every job's scratch folder, removed by stop()
        self._stopping = False

    def _run_of(self, job: Job) -> _Run:
        with self._lock:
            if job.scratch is not None:
                self._scratch.add(job.scratch)
            return self._runs.setdefault(job.key, _Run(job))

    def _take(self, run: _Run, background: bool) -> bool:
        """Start `run` unless it has been started (the queue: or the session is ending); whether
        this call started it."""
        with self._lock:
            if run.proc is not None or (background and self._stopping):
                return False
            run.start(background)
            return True

    def _work(self, runs: list[_Run]) -> None:
        for run in runs:
            if self._take(run, background=True):
                run.proc.wait()

    def start(self, jobs: list[Job]) -> threading.Thread:
        """Queue `jobs` (in the order the tests will need them) and start the first one now; the
        thread that works through them."""
        worker = threading.Thread(target=self._work, args=([self._run_of(job) for job in jobs],),
                                  name="background-jobs", daemon=True)
        worker.start()
        return worker

    def result(self, job: Job) -> subprocess.CompletedProcess:
        """The job's finished child (returncode, stdout and stderr as text), started here if the queue
        has not started it; waits up to job.timeout_s from now (then kills it and raises TimeoutExpired).
        A second call runs the child again."""
        run = self._run_of(job)
        self._take(run, background=False)
        try:
            run.proc.wait(job.timeout_s)
        except BaseException:  # TimeoutExpired, or the test interrupted (pytest-timeout, Ctrl-C): no child left
            run.kill()
            raise
        finally:
            with self._lock:
                self._runs.pop(job.key, None)
        return run.completed()

    def stop(self) -> None:
        """Kill the children still running, start no more, and remove the scratch folders."""
        with self._lock:
            self._stopping = True
            runs = list(self._runs.values())
        for run in runs:
            if run.proc is not None and run.proc.poll() is None:  # (not reaped yet: its group id is still its)
                run.kill()
        for folder in self._scratch:
            shutil.rmtree(folder, ignore_errors=True)


SESSION = Queue()  # the session's queue: started and stopped by tests/conftest.py


def result(job: Job) -> subprocess.CompletedProcess:
    """`job`'s finished child, from the session's queue (Queue.result)."""
    return SESSION.result(job)


def session_jobs(modules) -> list[Job]:
    """The jobs of `modules` (each module's `background_jobs()`, where it has one), in order."""
    jobs: list[Job] = []
    for module in modules:
        make = getattr(module, "background_jobs", None)
        if make is not None:
            jobs += make()
    return jobs
