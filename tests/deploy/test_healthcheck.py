"""deploy/docker/healthcheck.py asks where the service listens: MOE_HOST and MOE_HTTP_PORT, an
address of every interface on loopback. Run as the image runs it, against a stand-in server."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.serverproc import ipv6_loopback

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"
ONLY_HERE = "127.0.0.3"  # a loopback address besides 127.0.0.1: a server bound to it alone is not on 127.0.0.1


class _Ready(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802  (http.server's naming)
        self.send_response(self.status if self.path == "/v2/health/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def stand_in(host: str, status: int = 200):
    """A server on host (an IPv6 one dual-stack when it is ::), a free port, answering the readiness
    route with `status`; its port."""
    v6 = ":" in host

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if v6 else socket.AF_INET

        def server_bind(self):
            if v6:
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host == "::" else 1)
            super().server_bind()

    handler = type("Handler", (_Ready,), {"status": status})
    server = Server((host, 0), handler)
    # (shutdown() waits for the loop to look at its flag: every 0.5 s by default, most of each test)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def healthcheck(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("MOE_HOST", "MOE_HTTP_PORT")}
    return subprocess.run([sys.executable, str(SCRIPT)], env={**base, **env}, capture_output=True, text=True,
                          timeout=30)


def test_it_asks_the_address_moe_host_names():
    """The reviewer's case: MOE_HOST set to an address other than 127.0.0.1, the server ready, the
    check failing because it asked 127.0.0.1."""
    with stand_in(ONLY_HERE) as port:
        r = healthcheck(MOE_HOST=ONLY_HERE, MOE_HTTP_PORT=str(port))
        assert r.returncode == 0, r.stderr
        r = healthcheck(MOE_HTTP_PORT=str(port))  # the default host, 0.0.0.0, is asked on 127.0.0.1: not there
        assert r.returncode == 1 and "not ready: http://127.0.0.1:" in r.stderr, r.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", None])
def test_every_interface_is_asked_on_loopback(host):
    with stand_in("0.0.0.0") as port:
        env = {"MOE_HTTP_PORT": str(port)} | ({"MOE_HOST": host} if host else {})
        assert healthcheck(**env).returncode == 0


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize("bound, moe_host", [("::1", "::1"), ("::1", "[::1]"), ("::", "::"), ("::", "[::]")])
def test_ipv6_hosts(bound, moe_host):
    with stand_in(bound) as port:
        r = healthcheck(MOE_HOST=moe_host, MOE_HTTP_PORT=str(port))
        assert r.returncode == 0, r.stderr


def test_not_ready_and_nothing_listening_fail():
    with stand_in("127.0.0.1", status=503) as port:
        r = healthcheck(MOE_HOST="127.0.0.1", MOE_HTTP_PORT=str(port))
        assert r.returncode == 1 and "503" in r.stderr, r.stderr
    r = healthcheck(MOE_HOST="127.0.0.1", MOE_HTTP_PORT=str(port))  # (its server is gone)
    assert r.returncode == 1 and "not ready" in r.stderr, r.stderr


def test_a_proxy_in_the_environment_is_not_used():
    """A container whose environment names a proxy (a dead one here): the check still asks the
    service directly, as it did before the proxy was set."""
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))  # bound, never listening: a connection to it is refused
        proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
        with stand_in(ONLY_HERE) as port:
            for name in ("http_proxy", "HTTP_PROXY"):  # (urllib reads these two for http://)
                r = healthcheck(MOE_HOST=ONLY_HERE, MOE_HTTP_PORT=str(port), **{name: proxy, "no_proxy": ""})
                assert r.returncode == 0, (name, r.stderr)
