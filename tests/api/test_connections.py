"""The descriptor limit is raised to fit both protocols' connection caps, or the shortfall is logged."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import logging, resource, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, int(sys.argv[1])))
    from service.api.connections import ensure_file_limit
    print("soft", ensure_file_limit(int(sys.argv[2])), flush=True)
""")


def probe(hard: int, max_connections: int) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(hard), str(max_connections)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_soft_limit_raised_to_fit_both_caps():
    out = probe(hard=4096, max_connections=500)
    assert "soft 1256" in out and "WARNING" not in out, out  # 2 x 500 + the reserve


def test_a_hard_limit_too_low_is_reported():
    out = probe(hard=300, max_connections=500)
    assert "soft 300" in out and "WARNING max_connections=500 per protocol needs about 1256" in out, out
