"""Shared-memory slots: nothing is left in /dev/shm once the ranks are up, stale files (and only
those) are removed, ranks never create a file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from service.config import LayerConfig
from service.worker.group import WorkerGroup
from service.worker.shm import Slot, create_slots, remove_slots, remove_stale_slots

SMALL = LayerConfig(E=4, H=16, I=32, K=2, R=2, C=4, dtype=torch.float32)


def test_slot_files_are_unlinked_once_the_ranks_are_up():
    with WorkerGroup(SMALL) as g:
        paths = [s.path for s in g._slots]
        assert paths and not any(os.path.exists(p) for p in paths)
        out = g.forward(torch.randn(3, SMALL.H), torch.zeros(3, SMALL.K, dtype=torch.int32), torch.ones(3, SMALL.K))
        assert torch.isfinite(out).all()  # the mappings still work


def _unshare_pid_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0


CREATE_AND_WAIT = textwrap.dedent("""
    import sys, time, torch
    from service.config import LayerConfig
    from service.worker.shm import create_slots
    slots = create_slots(LayerConfig(E=4, H=16, I=32, K=2, R=2, C=4, dtype=torch.float32), 1)
    print(slots[0].path, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(60)
""")


def test_files_are_removed_exactly_when_their_creator_is_gone():
    """Liveness is the creator's lock, not a pid: a file whose creator runs in another PID
    namespace (its pid means nothing here) stays; one whose creator exited goes."""
    dead = subprocess.run([sys.executable, "-c", CREATE_AND_WAIT, "exit"], capture_output=True, text=True)
    stale = dead.stdout.strip()
    assert stale and os.path.exists(stale), dead.stderr
    mine = create_slots(SMALL, 1)[0]
    prefix = ["unshare", "--pid", "--fork", "--kill-child"] if _unshare_pid_works() else []
    other = subprocess.Popen([*prefix, sys.executable, "-c", CREATE_AND_WAIT, "wait"], stdout=subprocess.PIPE,
                             text=True)
    try:
        theirs = other.stdout.readline().strip()
        assert theirs and os.path.exists(theirs)
        remove_stale_slots()
        assert not os.path.exists(stale)
        assert os.path.exists(mine.path) and os.path.exists(theirs)
    finally:
        other.kill()
        other.wait()
        remove_slots([mine])
    deadline = time.monotonic() + 10  # the killed creator's lock goes with its last process
    while os.path.exists(theirs) and time.monotonic() < deadline:
        remove_stale_slots()
        time.sleep(0.05)
    assert not os.path.exists(theirs)


def test_a_rank_never_creates_a_slot_file(tmp_path):
    missing = tmp_path / "moe-slot-missing"
    with pytest.raises(FileNotFoundError):
        Slot.open(SMALL, 0, str(missing))
    assert not missing.exists()
    short = tmp_path / "moe-slot-short"
    short.write_bytes(b"\0" * 64)
    with pytest.raises(RuntimeError, match="has 64 bytes"):
        Slot.open(SMALL, 0, str(short))


def test_killed_front_end_leaves_no_slot_files(tmp_path):
    code = textwrap.dedent("""
        import os, signal, torch
        from service.config import LayerConfig
        from service.worker.group import WorkerGroup
        if __name__ == "__main__":
            g = WorkerGroup(LayerConfig(E=4, H=16, I=32, K=2, R=2, C=4, dtype=torch.float32))
            g.start()
            print(" ".join(s.path for s in g._slots), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    script = tmp_path / "front.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    paths = proc.stdout.split()
    assert paths, proc.stderr
    assert not [p for p in paths if os.path.exists(p)]
