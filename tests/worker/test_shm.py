"""Shared-memory slots: nothing is left in /dev/shm once the ranks are up, stale files are removed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from service.config import LayerConfig
from service.worker.group import WorkerGroup
from service.worker.shm import _shm_dir, create_slots, remove_stale_slots

SMALL = LayerConfig(E=4, H=16, I=32, K=2, R=2, C=4, dtype=torch.float32)


def test_slot_files_are_unlinked_once_the_ranks_are_up():
    with WorkerGroup(SMALL) as g:
        paths = [s.path for s in g._slots]
        assert paths and not any(os.path.exists(p) for p in paths)
        out = g.forward(torch.randn(3, SMALL.H), torch.zeros(3, SMALL.K, dtype=torch.int32), torch.ones(3, SMALL.K))
        assert torch.isfinite(out).all()  # the mappings still work


def test_files_of_dead_front_ends_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # that process has exited
    stale = os.path.join(_shm_dir(), f"moe-slot-{pid}-deadbeef-0")
    mine = create_slots(SMALL, 1)[0]  # this live process's file must stay
    open(stale, "wb").close()
    try:
        remove_stale_slots()
        assert not os.path.exists(stale)
        assert os.path.exists(mine.path)
    finally:
        for p in (stale, mine.path):
            if os.path.exists(p):
                os.unlink(p)


def test_killed_front_end_leaves_no_slot_files(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal, torch
        from service.config import LayerConfig
        from service.worker.group import WorkerGroup
        if __name__ == "__main__":
            g = WorkerGroup(LayerConfig(E=4, H=16, I=32, K=2, R=2, C=4, dtype=torch.float32))
            g.start()
            print(os.getpid(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    script = tmp_path / "front.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pid = proc.stdout.strip()
    assert pid, proc.stderr
    assert not [n for n in os.listdir(_shm_dir()) if n.startswith(f"moe-slot-{pid}-")]
