"""Where the server listens: a port another process holds is refused (never shared), IPv6
addresses work on both protocols, and a bad or foreign --host is a clear start-up error. And how
many ranks the CPU default starts on a host of few cores."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import socket
import subprocess
import sys

import httpx
import pytest
import safetensors.torch
import tritonclient.grpc as grpcclient

from service.api.address import grpc_addresses, host_port, listen_socket
from service.config import Settings
from service.server import EXIT_CANNOT_LISTEN
from tests.api.common import check, inputs
from tests.api.test_e2e import triton_inputs
from tests.helpers import side_by_side
from tests.serverproc import ServerProcess, free_port, ipv6_loopback

FAIL_TIMEOUT_S = 120.0  # a server that cannot listen exits before its rank group starts (~2-5 s here)


def _not_this_host() -> str | None:
    """An address this host cannot bind (EADDRNOTAVAIL), from the documentation ranges (RFC 5737),
    asked here: a VM may be on one of them (this one is 192.0.2.2), and a host with ip_nonlocal_bind
    or a local route binds any; None if every candidate binds."""
    for candidate in ("203.0.113.77", "198.51.100.77", "192.0.2.77"):
        with socket.socket() as s:
            try:
                s.bind((candidate, 0))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    return candidate
    return None


NOT_THIS_HOST = _not_this_host()


def _holder(port: int) -> socket.socket:
    """A listener on 127.0.0.1:port with SO_REUSEPORT, as every grpc server binds by default (the
    other moe-serve of the user's trial): a second socket with SO_REUSEPORT of the same user would
    share the port silently."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


PROTOCOLS = ["grpc", "http", "metrics"]
GRPC_HELD = [("localhost", "127.0.0.1", "127.0.0.1"), ("localhost", "::1", "::1"),
             ("0.0.0.0", "::1", "::")]  # (host, held, checked): :: dual-stack holds ::1 too
MALFORMED_HOSTS = ["not a host", "[::1", "1.2.3.4:80", "999.1.1.1"]


def _start(log_path, env: dict[str, str], flags: tuple[str, ...], hold=None) -> tuple[int | None, str]:
    """Start `python -m service` with `flags` in `env` (its loopback ports, picked in the test's thread:
    free_port is not for threads) while `hold()`'s listening socket, if any, is open, and wait up to
    FAIL_TIMEOUT_S for it to exit: (its exit code, None if it did not, and its log)."""
    with hold() if hold else contextlib.nullcontext():
        proc = ServerProcess([sys.executable, "-m", "service", *flags], log_path, env=env)
        try:
            code = proc.proc.wait(FAIL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            proc.stop()
    return code, proc.log()


def _refused_weights(folder) -> tuple[int | None, str]:
    """test_weights_a_rank_refuses_exit_2_naming_the_expert's start: a NaN in expert 3's weights."""
    from service.config import preset
    from service.moe.weights import write_synthetic_checkpoint

    path = folder / "w.safetensors"
    write_synthetic_checkpoint(path, preset("cpu"), seed=3)
    tensors = safetensors.torch.load_file(path)
    key = next(k for k in sorted(tensors) if ".3." in k and "gate" in k)
    tensors[key][0, 0] = float("nan")
    safetensors.torch.save_file(tensors, path)
    return _start(folder / "weights.log", ServerProcess.loopback_env(dict(os.environ)), ("--weights", str(path)))


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    """Every start of this module that must fail (~2-5 s each, most of it one core importing torch),
    run side by side once the first test asks (tests.helpers.side_by_side); each test checks its own.
    Key -> (the port held or None, Future of what the start returned)."""
    folder = tmp_path_factory.mktemp("starts")
    jobs, ports = {}, {}

    def start(key, flags: tuple[str, ...], hold=None, port: int | None = None) -> None:
        env = ServerProcess.loopback_env(dict(os.environ))
        jobs[key], ports[key] = functools.partial(_start, folder / f"server{len(jobs)}.log", env, flags, hold), port

    for protocol in PROTOCOLS:
        port = free_port()
        start(("port", protocol), (f"--{protocol}-port", str(port)), functools.partial(_holder, port), port)
    if ipv6_loopback():  # (test_a_grpc_port_held_on_one_of_its_addresses_is_refused is skipped otherwise)
        for host, held, _ in GRPC_HELD:
            port = free_port()
            family = socket.AF_INET6 if ":" in held else socket.AF_INET
            start(("grpc", host, held), ("--host", host, "--grpc-port", str(port)),
                  functools.partial(socket.create_server, (held, port), family=family), port)
    if NOT_THIS_HOST is not None:
        start("not this host", ("--host", NOT_THIS_HOST))
    for host in MALFORMED_HOSTS:
        jobs[("malformed", host)] = functools.partial(
            subprocess.run, [sys.executable, "-m", "service", "--host", host], capture_output=True, text=True,
            timeout=60)
    jobs["weights"] = functools.partial(_refused_weights, folder)
    with side_by_side(jobs) as futures:
        yield {key: (ports.get(key), future) for key, future in futures.items()}


def _cannot_listen(started) -> str:
    """A start of `starts`: it must have exited with EXIT_CANNOT_LISTEN and no traceback. Its log."""
    code, log = started.result()
    assert code == EXIT_CANNOT_LISTEN, f"exit code {code}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
    return log


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_port_another_server_holds_is_refused(starts, protocol):
    port, started = starts[("port", protocol)]
    log = _cannot_listen(started)
    name = {"grpc": "gRPC", "http": "HTTP", "metrics": "metrics"}[protocol]
    assert f"the {name} server cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use" in log, log


def test_grpc_binds_every_address_of_its_host():
    """grpc binds each address of --host and starts if any one binds: the addresses it binds are
    the ones checked for another server (0.0.0.0 is also its dual-stack `::`; localhost both
    loopbacks, whatever /etc/hosts says)."""
    assert grpc_addresses("0.0.0.0") == ["0.0.0.0", "::"]
    assert grpc_addresses("127.0.0.1") == ["127.0.0.1"] and grpc_addresses("::1") == ["::1"]
    assert {"127.0.0.1", "::1"} <= set(grpc_addresses("localhost"))


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize("host,held,checked", GRPC_HELD)
def test_a_grpc_port_held_on_one_of_its_addresses_is_refused(starts, host, held, checked):
    """Another server on one of the addresses grpc binds for --host (the user's trial, again: grpc
    started on the others, and that address's clients reached the other server)."""
    port, started = starts[("grpc", host, held)]
    log = _cannot_listen(started)
    assert f"the gRPC server cannot listen on {host}:{port}: another socket holds {host_port(checked, port)}" in log, \
        log[-3000:]


@pytest.mark.skipif(NOT_THIS_HOST is None, reason="this host binds every candidate address (ip_nonlocal_bind?)")
def test_an_address_not_of_this_host_is_refused(starts):
    log = _cannot_listen(starts["not this host"][1])
    assert f"cannot listen on {NOT_THIS_HOST}:" in log and "Cannot assign requested address" in log, log


@pytest.mark.parametrize("host", MALFORMED_HOSTS)
def test_a_malformed_host_exits_2_naming_the_flag(starts, host):
    r = starts[("malformed", host)][1].result()
    assert r.returncode == 2, r.stderr
    assert "--host: Value error, must be an IP address" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_hosts_are_normalized_and_written_with_brackets():
    assert Settings(host="[::1]").host == "::1" and Settings(host="::").host == "::"
    assert Settings(host="localhost").host == "localhost" and Settings(host="0.0.0.0").host == "0.0.0.0"
    assert host_port("::1", 8001) == "[::1]:8001" and host_port("fd00::2", 1) == "[fd00::2]:1"
    assert host_port("127.0.0.1", 8001) == "127.0.0.1:8001" and host_port("localhost", 80) == "localhost:80"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "::"])
@pytest.mark.parametrize("reuse_port", [False, True])
def test_the_http_socket_answers_without_nagle(host, reuse_port):
    """The connections the HTTP server accepts on listen_socket send at once (TCP_NODELAY): asyncio
    (uvicorn's transport) sets it only on sockets of proto IPPROTO_TCP, and a socket of proto 0
    held every small answer (a shared-memory reply, T=8: 48 ms p50 against 4 ms) for the client's
    delayed ACK."""
    if ":" in host and not ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1)")
    nodelay: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            sock = transport.get_extra_info("socket")
            nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one():
        loop = asyncio.get_running_loop()
        sock = listen_socket(host, 0, reuse_port=reuse_port)
        server = await loop.create_server(Probe, sock=sock)  # as uvicorn serves the sockets it is given
        port = sock.getsockname()[1]
        async with server:
            _, writer = await asyncio.open_connection("::1" if ":" in host else host, port)
            for _ in range(200):
                if nodelay:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(accept_one())
    assert nodelay and nodelay[0] != 0, nodelay


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize("host", ["::1", "[::]"])
def test_an_ipv6_host_serves_both_protocols(tmp_path, host):
    """`--host ::1` and `--host '[::]'` (every interface, dual-stack): HTTP and gRPC answer on
    [::1]; `::` also on 127.0.0.1, as gRPC's own `[::]` bind does."""
    proc = ServerProcess.module(tmp_path / "server.log", "--host", host)
    proc.url = f"http://[::1]:{proc.http_port}"
    try:
        proc.wait_ready()
        x, ids, w = inputs(5, seed=41)
        blob = safetensors.torch.save({"hidden_states": x, "topk_ids": ids, "topk_weights": w})
        urls = [proc.url] + ([f"http://127.0.0.1:{proc.http_port}"] if host == "[::]" else [])
        for url in urls:
            r = httpx.post(url + "/moe/forward", content=blob, timeout=60,
                           headers={"Content-Type": "application/x-safetensors"})
            assert r.status_code == 200, (url, r.text)
            check(safetensors.torch.load(r.content)["output"], x, ids, w)
        grpc_urls = [f"[::1]:{proc.grpc_port}"] + ([f"127.0.0.1:{proc.grpc_port}"] if host == "[::]" else [])
        for url in grpc_urls:
            client = grpcclient.InferenceServerClient(url)
            result = client.infer("moe", triton_inputs(grpcclient, x, ids, w), client_timeout=60)
            check(result.as_numpy("output").copy(), x, ids, w)
        assert f"gRPC on [{host.strip('[]')}]:{proc.grpc_port}" in proc.log(), proc.log()[-3000:]
    finally:
        code = proc.stop()
    assert code == 0, f"exit code {code}:\n{proc.log()[-3000:]}"


def test_the_cpu_default_runs_as_many_ranks_as_its_cores(tmp_path):
    """`python -m service` (no --world-size) on fewer usable cores than the cpu preset's 4 ranks (its
    affinity here: the first one or two of this process's CPUs) runs that many ranks, each step's
    512 tokens unchanged (C = 512 / R), says so, and answers right over both protocols: a whole step
    and a request of several."""
    from service.config import usable_cpus

    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    R = min(len(cpus), usable_cpus())  # (a cgroup quota of one core caps it too); 512 % R == 0
    launch = f"import os, runpy; os.sched_setaffinity(0, {cpus}); runpy.run_module('service', run_name='__main__')"
    env = ServerProcess.loopback_env({**os.environ, "MOE_WORLD_SIZE": ""})  # unset: the tests' servers name 4
    proc = ServerProcess([sys.executable, "-c", launch], tmp_path / "server.log", env=env)
    try:
        proc.wait_ready()
        assert f"running R={R}, C={512 // R} (--world-size 4 to keep them)" in proc.log(), proc.log()[-3000:]
        assert f"started {R} ranks on cpu" in proc.log(), proc.log()[-3000:]
        client = grpcclient.InferenceServerClient(proc.grpc_url)
        for T, seed in ((512, 51), (1100, 52)):
            x, ids, w = inputs(T, seed=seed)
            blob = safetensors.torch.save({"hidden_states": x, "topk_ids": ids, "topk_weights": w})
            r = httpx.post(proc.url + "/moe/forward", content=blob, timeout=60,
                           headers={"Content-Type": "application/x-safetensors"})
            assert r.status_code == 200, r.text
            check(safetensors.torch.load(r.content)["output"], x, ids, w)
            result = client.infer("moe", triton_inputs(grpcclient, x, ids, w), client_timeout=60)
            check(result.as_numpy("output").copy(), x, ids, w)
    finally:
        code = proc.stop()
    assert code == 0, f"exit code {code}:\n{proc.log()[-3000:]}"


def test_weights_a_rank_refuses_exit_2_naming_the_expert(starts):
    """A NaN in one expert's weights is refused by the rank that loads it: the server exits 2 (the README's
    "the weights refused"), not 1 as a failed start, and says which expert."""
    code, log = starts["weights"][1].result()
    assert code == 2, f"exit code {code}:\n{log[-3000:]}"
    assert "expert 3" in log and "NaN or infinity" in log, log[-3000:]
