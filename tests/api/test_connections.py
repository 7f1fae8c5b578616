"""The descriptor limit is raised to fit both protocols' connection caps, or the shortfall is logged;
the HTTP protocol is httptools or h11 (--http-impl), both with the same bounds (their behaviour on a
real server: tests/api/test_hardening.py, on each)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap

import pytest

from service.api.connections import ConnectionBounds, DirectBody, bounded_protocol
from service.cli import parse_settings

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
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # (only root may raise it: the probe lowers it)
    hard = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if hard < 1256:
        pytest.skip(f"this process's hard descriptor limit ({hard}) is under the 1256 the case needs")
    out = probe(hard=hard, max_connections=500)
    assert "soft 1256" in out and "WARNING" not in out, out  # 2 x 500 + the reserve


def test_a_hard_limit_too_low_is_reported():
    out = probe(hard=300, max_connections=500)
    assert "soft 300" in out and "WARNING max_connections=500 per protocol needs about 1256" in out, out


# Runs with httptools made unimportable (a None entry in sys.modules fails its import).
WITHOUT_HTTPTOOLS = textwrap.dedent("""
    import sys
    sys.modules["httptools"] = None
    from service.cli import main, parse_settings
    if sys.argv[1:] == ["default"]:
        print("http_impl", parse_settings([]).http_impl, flush=True)
    else:
        sys.exit(main(sys.argv[1:]))
""")


def without_httptools(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOE_HTTP_IMPL"}
    return subprocess.run([sys.executable, "-c", WITHOUT_HTTPTOOLS, *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_http_impl_defaults_to_httptools_when_installed(monkeypatch):
    monkeypatch.delenv("MOE_HTTP_IMPL", raising=False)
    assert parse_settings([]).http_impl == "httptools"
    assert parse_settings(["--http-impl", "h11"]).http_impl == "h11"
    monkeypatch.setenv("MOE_HTTP_IMPL", "h11")
    assert parse_settings([]).http_impl == "h11"


def test_without_httptools_the_default_is_h11():
    proc = without_httptools("default")
    assert proc.returncode == 0 and "http_impl h11" in proc.stdout, proc.stdout + proc.stderr


def test_an_explicit_httptools_without_the_package_is_a_start_error():
    proc = without_httptools("--http-impl", "httptools")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--http-impl: Value error, httptools is not installed" in proc.stderr, proc.stderr


def test_an_unknown_http_impl_is_refused():
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--http-impl", "uvloop"])
    assert exc.value.code == 2


@pytest.mark.parametrize("http_impl,base,mixins", [
    ("httptools", "HttpToolsProtocol", ["DirectBody", "ConnectionBounds"]),
    ("h11", "H11Protocol", ["ConnectionBounds"]),
])
def test_both_protocols_carry_the_same_bounds(http_impl, base, mixins):
    cls = bounded_protocol(http_impl, max_body_bytes=1 << 20)
    assert [c.__name__ for c in cls.__mro__[1:len(mixins) + 2]] == [*mixins, base]
    for name in ("connection_made", "connection_lost", "on_response_complete", "busy"):
        # ConnectionBounds' own, or DirectBody's, which ends in super() and so reaches it
        owner = next(c for c in cls.__mro__ if name in vars(c))
        assert owner in (ConnectionBounds, DirectBody), (name, owner)
