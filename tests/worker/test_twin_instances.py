"""Two instances sharing /dev/shm but not a PID namespace (containers with `ipc: host`): neither
may delete the other's slot files, and each must answer its own requests correctly.

Everything runs inside a private mount namespace with its own tmpfs on /dev/shm (`unshare
--mount`, as root), so the host's /dev/shm is never touched. Instance A runs in the test's PID
namespace, instance B in a new one (`unshare --pid`), where A's pids mean nothing; B also runs
the stale-file cleanup in a loop while both start, as instances starting beside A would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROUNDS = 2  # group starts per instance

INSTANCE = textwrap.dedent("""
    import sys, threading, time, torch
    from service.config import LayerConfig
    from service.moe.reference import full_weights, moe_reference
    from service.worker.group import WorkerGroup
    from service.worker.shm import remove_stale_slots

    if __name__ == "__main__":
        name, rounds = sys.argv[1], int(sys.argv[2])
        cfg = LayerConfig(E=6, H=24, I=40, K=2, R=2, C=5, dtype=torch.float32)
        stop = threading.Event()
        def janitor():  # what instances starting beside this one do
            while not stop.is_set():
                remove_stale_slots()
                time.sleep(0.002)
        if name == "B":
            threading.Thread(target=janitor, daemon=True).start()
        gen = torch.Generator().manual_seed(7 if name == "A" else 8)
        weights = full_weights(cfg, 0)
        for r in range(rounds):
            with WorkerGroup(cfg) as g:
                T = 9
                x = torch.randn(T, cfg.H, generator=gen)
                ids = torch.randint(0, cfg.E, (T, cfg.K), generator=gen)
                w = torch.rand(T, cfg.K, generator=gen)
                out = g.forward(x, ids, w)
                ref = moe_reference(x, ids, w, *weights)
                err = float((out - ref).norm() / ref.norm())
                print(f"{name} round {r}: relative error {err:.2e}", flush=True)
                assert err < 1e-5, f"instance {name} round {r}: relative error {err:.2e}"
        stop.set()
        print(f"{name} ok", flush=True)
""")

DRIVER = textwrap.dedent("""
    import subprocess, sys
    script, rounds = sys.argv[1], sys.argv[2]
    b = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, script, "B", rounds])
    a = subprocess.run([sys.executable, script, "A", rounds])
    sys.exit(a.returncode or b.wait())
""")


def _namespaces_permitted() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(["unshare", "--mount", "--pid", "--fork", "sh", "-c",
                            "mount -t tmpfs probe /dev/shm && touch /dev/shm/probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"private mount/PID namespaces are not permitted here: {probe.stderr.strip()}"
    return None


def test_two_instances_sharing_dev_shm_across_pid_namespaces(tmp_path):
    why = _namespaces_permitted()
    if why:
        pytest.skip(why)
    instance, driver = tmp_path / "instance.py", tmp_path / "driver.py"
    instance.write_text(INSTANCE)
    driver.write_text(DRIVER)
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f'mount -t tmpfs -o size=64m,mode=1777 moe-twin /dev/shm && exec "{sys.executable}" "{driver}" '
           f'"{instance}" {ROUNDS}']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "A ok" in proc.stdout and "B ok" in proc.stdout, proc.stdout
