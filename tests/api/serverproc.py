"""A real `python -m service` process on free ports, for the end-to-end tests and the benchmark."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

START_TIMEOUT_S = 180.0  # 4 rank processes on 2 CPU cores start in ~10-20 s; leave room for slow CI
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class ServerProcess:
    def __init__(self, log_path: str, *flags: str, env: dict | None = None):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.http_hostport = f"127.0.0.1:{self.http_port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--http-port", str(self.http_port),
               "--grpc-port", str(self.grpc_port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-5000:]}")
            if self.ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready within {timeout} s:\n{self.log()[-5000:]}")

    def rank_pids(self) -> list[int]:
        """The rank processes: the spawned children (not multiprocessing's resource tracker)."""
        return [p for p in descendants(self.pid) if "spawn_main" in cmdline(p)]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
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

