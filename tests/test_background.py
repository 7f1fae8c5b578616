"""The session's background jobs (tests/background.py): a queued child runs at the lowest priority
and its test waits for it; a child asked for before the queue reaches it runs at once, at the test's
priority, and only once; a queued child leads a process group in the tests' session (their
scheduling group); a timed-out wait and the session's end leave no child behind."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from tests.background import NICENESS, Job, Queue

# The child prints its niceness, after appending a line to `log` (how many times it ran).
PRINT_NICENESS = "import os, sys; open(sys.argv[1], 'a').write('ran\\n'); print(os.nice(0))"

needs_nice = pytest.mark.skipif(shutil.which("nice") is None, reason="no nice(1) here: the queue runs children as is")


def niceness_job(key: str, log) -> Job:
    return Job.of(key, [sys.executable, "-c", PRINT_NICENESS, str(log)], timeout_s=60)


@needs_nice
def test_a_queued_child_runs_at_the_lowest_priority_and_its_result_waits_for_it(tmp_path):
    queue = Queue()
    job = niceness_job("queued", tmp_path / "log")
    queue.start([job])
    done = queue.result(job)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == min(19, os.nice(0) + NICENESS)
    assert (tmp_path / "log").read_text() == "ran\n"


def test_a_child_asked_for_before_the_queue_reaches_it_runs_at_once_at_the_tests_priority(tmp_path):
    queue = Queue()
    go = tmp_path / "go"  # the child ahead runs until the test has its answer (60 s at most)
    wait_for_go = (f"import os, time\nfor _ in range(6000):\n"
                   f"    if os.path.exists({str(go)!r}): break\n    time.sleep(0.01)")
    ahead = Job.of("ahead", [sys.executable, "-c", wait_for_go], timeout_s=120)
    asked = dataclasses.replace(niceness_job("asked", tmp_path / "log"), timeout_s=20)  # < the 60 s ahead
    worker = queue.start([ahead, asked])
    try:  # (had it waited for the child ahead, which waits for `go`, this would time out)
        done = queue.result(asked)
    finally:
        go.touch()
    assert done.returncode == 0 and int(done.stdout) == os.nice(0), (done.stdout, done.stderr)
    assert queue.result(ahead).returncode == 0
    worker.join(60)
    assert not worker.is_alive()
    assert (tmp_path / "log").read_text() == "ran\n", "the queue ran the child a test had taken"


def test_a_wait_past_the_timeout_kills_the_child(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    job = Job.of("slow", [sys.executable, "-c", code], timeout_s=4)  # (the child's start: ~0.1-1 s)
    with pytest.raises(subprocess.TimeoutExpired):
        Queue().result(job)
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(pid_file.read_text()), 0)


def test_stop_kills_the_running_child_starts_no_more_and_removes_the_scratch(tmp_path):
    scratch, started = tmp_path / "scratch", tmp_path / "started"
    scratch.mkdir()
    running = Job.of("running", [sys.executable, "-c", f"open({str(started)!r}, 'w'); import time; time.sleep(60)"],
                     timeout_s=60, scratch=scratch)
    queued = niceness_job("queued", tmp_path / "log")
    queue = Queue()
    worker = queue.start([running, queued])
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline, "the queue did not start its first child"
        time.sleep(0.01)
    t0 = time.monotonic()
    queue.stop()
    worker.join(30)
    assert not worker.is_alive() and time.monotonic() - t0 < 10, "stop() waited for the child instead of killing it"
    assert not (tmp_path / "log").exists(), "the queue started a child after stop()"
    assert not scratch.exists()


def test_a_killed_child_takes_its_own_children_with_it(tmp_path):
    """The image recipe's replay runs pip, g++ runs cc1plus: a timed-out job must not leave them running."""
    pid_file = tmp_path / "grandchild"
    grandchild = "import time; time.sleep(60)"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    job = Job.of("parent", [sys.executable, "-c", code], timeout_s=4)  # (two starts: ~0.2-2 s)
    with pytest.raises(subprocess.TimeoutExpired):
        Queue().result(job)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while True:  # killed at once; reaped by init once its parent is gone: wait for the pid to vanish
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as stat:  # a zombie awaiting its reaper is dead already
            if stat.read().split(")")[-1].split()[0] == "Z":
                break
        assert time.monotonic() < deadline, "the job's own child outlived the job's kill"
        time.sleep(0.05)


def autogroup() -> str:
    """This process's autogroup as the kernel shows it: '-' without the file, and '-' when it is empty,
    as the kernel leaves it for a task in the default autogroup (the root task group; seen in CI)."""
    path = "/proc/self/autogroup"
    if not os.path.exists(path):
        return "-"
    with open(path) as f:
        return (f.read().split() or ["-"])[0]


# The child prints its session, its process group, itself and its autogroup, read as the tests read theirs.
PRINT_GROUPS = ("import os\n" + textwrap.dedent(inspect.getsource(autogroup))
                + "print(os.getsid(0), os.getpgid(0), os.getpid(), autogroup())\n")


def test_a_queued_child_leads_its_own_process_group_in_the_tests_session(tmp_path):
    """Its own process group (kill() takes its children along), but the tests' session: with autogroup
    scheduling a new session is a task group of its own, as heavy as the tests' whole group whatever
    its niceness, and a niceness-19 child then took a core of the two from the tests."""
    queue = Queue()
    job = Job.of("groups", [sys.executable, "-c", PRINT_GROUPS], timeout_s=60)
    queue.start([job])
    done = queue.result(job)
    assert done.returncode == 0, done.stderr
    sid, pgid, pid, child_autogroup = done.stdout.split()
    assert int(sid) == os.getsid(0), (sid, os.getsid(0))
    assert int(pgid) == int(pid), (pgid, pid)
    assert child_autogroup == autogroup(), child_autogroup  # the tests' own, or '-' on both sides
