"""A real moe-serve process on free loopback ports, its output in a log file: for the API's
end-to-end tests (`python -m service` with flags) and the deployment tests (the image's entrypoint)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

START_TIMEOUT_S = 180.0  # 4 rank processes on 2 CPU cores start in ~10-20 s; leave room for slow CI
STOP_TIMEOUT_S = 60.0
POLL_S = 0.2


_GIVEN: set[int] = set()  # every port free_port() has handed out in this process


def free_port() -> int:
    """A loopback port nothing is bound to, never one this process was given before: the kernel
    hands a just-closed port out again (1 in ~20,000 calls here returned the previous call's port),
    so a server's HTTP and gRPC ports, or a module's metrics port picked at import and a later
    server's, could otherwise be the same."""
    for _ in range(10_000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no loopback port left that this process was not given before ({len(_GIVEN)} given)")


def ipv6_loopback() -> bool:
    """Whether this machine can listen on ::1 (a container or VM may have no IPv6)."""
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time process `pid` has used so far (all its threads, user + system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of process `pid`, from /proc; field="VmHWM": its peak so far."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


LOOPBACK = ("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")  # how `ss` shows a loopback address


def listening(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets that processes `pids` listen on (`ss -ltnp`, iproute2)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def comm(pid: int) -> str:
    """The process's name (/proc/PID/comm)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class ServerProcess:
    """`cmd` with `env`, whose MOE_HTTP_PORT / MOE_GRPC_PORT name its ports (see `loopback_env`)."""

    def __init__(self, cmd: list[str], log_path: str | Path, *, env: dict[str, str], cwd: Path | None = None):
        self.http_port, self.grpc_port = int(env["MOE_HTTP_PORT"]), int(env["MOE_GRPC_PORT"])
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.http_hostport = f"127.0.0.1:{self.http_port}"
        self.metrics_port: int | None = None  # a fixture that passes --metrics-port sets it
        self.log_path = Path(log_path)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    @classmethod
    def module(cls, log_path: str | Path, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        """`python -m service` with `flags`, in this environment plus `env`, on free loopback ports."""
        return cls([sys.executable, "-m", "service", *flags], log_path,
                   env=cls.loopback_env({**os.environ, **(env or {})}))

    @classmethod
    @contextlib.contextmanager
    def serving(cls, log_path: str | Path, *flags: str, env: dict[str, str] | None = None):
        """`module(...)`, ready; on exit stopped, and its exit code must be 0 (a clean drain)."""
        proc = cls.module(log_path, *flags, env=env)
        try:
            proc.wait_ready()
            yield proc
        finally:
            code = proc.stop()
            assert code == 0, f"exit code {code}:\n{proc.log()[-3000:]}"

    @staticmethod
    def loopback_env(base: dict[str, str]) -> dict[str, str]:
        """`base` with MOE_HOST on loopback and free MOE_HTTP_PORT / MOE_GRPC_PORT; MOE_WORLD_SIZE 4
        unless `base` names one: on the CPU the default R follows the usable cores (service.config),
        and the tests' servers serve the preset's shape (tests/api/common.py's CFG) on any machine."""
        return {"MOE_WORLD_SIZE": "4", **base, "MOE_HOST": "127.0.0.1", "MOE_HTTP_PORT": str(free_port()),
                "MOE_GRPC_PORT": str(free_port())}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        """Ready, in the owner process's word too: with --frontends N each new connection reaches any
        process, and a front end turns ready milliseconds before the owner, which turns ready last,
        once every front end serves (service.fleet.Fleet.attach); a client told "ready" by a front
        end could be answered 503 by the owner. moe_ready is the owner's whichever process answers
        the scrape (service.metrics.FIRST_ONLY_PREFIXES); with one process, its own."""
        try:
            if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code != 200:
                return False
            scraped = httpx.get(self.url + "/metrics", timeout=10).text  # (above the fleet's 2 s collect)
        except httpx.HTTPError:
            return False
        return "\nmoe_ready 1.0\n" in scraped

    def wait_ready(self, ready: Callable[[], bool] | None = None, timeout: float = START_TIMEOUT_S) -> None:
        """Poll `ready()` (default: `self.ready`, readiness in the owner's word) until it is true; fail with the log if
        the process exits or time runs out."""
        ready = ready or self.ready
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moe-serve exited with {self.proc.returncode}:\n{self.log()[-5000:]}")
            if ready():
                return
            time.sleep(POLL_S)
        raise TimeoutError(f"moe-serve was not ready within {timeout} s:\n{self.log()[-5000:]}")

    def rank_pids(self) -> list[int]:
        """The rank processes: the spawned children (not multiprocessing's resource tracker, nor
        the other front-end processes of --frontends, named moe-frontend<i>)."""
        return [p for p in descendants(self.pid)
                if "spawn_main" in cmdline(p) and not comm(p).startswith("moe-frontend")]

    def frontend_pids(self) -> list[int]:
        """The front-end processes 1..N-1 of --frontends N (service.fleet)."""
        return [p for p in descendants(self.pid) if comm(p).startswith("moe-frontend")]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait (the drain path); SIGKILL the whole tree if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in descendants(self.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
