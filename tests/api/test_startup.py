"""Where the server listens: a port another process holds is refused (never shared), IPv6
addresses work on both protocols, and a bad or foreign --host is a clear start-up error."""

from __future__ import annotations

import asyncio
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
from tests.serverproc import ServerProcess, free_port, ipv6_loopback

FAIL_TIMEOUT_S = 120.0  # a server that cannot listen exits before its rank group starts (~2-5 s here)
NOT_THIS_HOST = "192.0.2.77"  # TEST-NET-1 (RFC 5737): on no interface of this VM (192.0.2.2 is)


def _holder(port: int) -> socket.socket:
    """A listener on 127.0.0.1:port with SO_REUSEPORT, as every grpc server binds by default (the
    other moe-serve of the user's trial): a second socket with SO_REUSEPORT of the same user would
    share the port silently."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _start_fails(tmp_path, *flags: str) -> str:
    """Start `python -m service` with `flags` on free loopback ports; it must exit with
    EXIT_CANNOT_LISTEN and no traceback. Its log."""
    proc = ServerProcess.module(tmp_path / "server.log", *flags)
    try:
        code = proc.proc.wait(FAIL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        proc.stop()
    log = proc.log()
    assert code == EXIT_CANNOT_LISTEN, f"exit code {code}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
    return log


@pytest.mark.parametrize("protocol", ["grpc", "http", "metrics"])
def test_a_port_another_server_holds_is_refused(tmp_path, protocol):
    port = free_port()
    with _holder(port):
        log = _start_fails(tmp_path, f"--{protocol}-port", str(port))
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
@pytest.mark.parametrize("host,held,checked", [("localhost", "127.0.0.1", "127.0.0.1"), ("localhost", "::1", "::1"),
                                               ("0.0.0.0", "::1", "::")])  # (:: dual-stack holds ::1 too)
def test_a_grpc_port_held_on_one_of_its_addresses_is_refused(tmp_path, host, held, checked):
    """Another server on one of the addresses grpc binds for --host (the user's trial, again: grpc
    started on the others, and that address's clients reached the other server)."""
    port = free_port()
    with socket.create_server((held, port), family=socket.AF_INET6 if ":" in held else socket.AF_INET):
        log = _start_fails(tmp_path, "--host", host, "--grpc-port", str(port))
    assert f"the gRPC server cannot listen on {host}:{port}: another socket holds {host_port(checked, port)}" in log, \
        log[-3000:]


def test_an_address_not_of_this_host_is_refused(tmp_path):
    log = _start_fails(tmp_path, "--host", NOT_THIS_HOST)
    assert f"cannot listen on {NOT_THIS_HOST}:" in log and "Cannot assign requested address" in log, log


@pytest.mark.parametrize("host", ["not a host", "[::1", "1.2.3.4:80", "999.1.1.1"])
def test_a_malformed_host_exits_2_naming_the_flag(host):
    r = subprocess.run([sys.executable, "-m", "service", "--host", host], capture_output=True, text=True, timeout=60)
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


def test_weights_a_rank_refuses_exit_2_naming_the_expert(tmp_path):
    """A NaN in one expert's weights is refused by the rank that loads it: the server exits 2 (the README's
    "the weights refused"), not 1 as a failed start, and says which expert."""
    import safetensors.torch

    from service.config import preset
    from service.moe.weights import write_synthetic_checkpoint

    path = tmp_path / "w.safetensors"
    write_synthetic_checkpoint(path, preset("cpu"), seed=3)
    tensors = safetensors.torch.load_file(path)
    key = next(k for k in sorted(tensors) if ".3." in k and "gate" in k)
    tensors[key][0, 0] = float("nan")
    safetensors.torch.save_file(tensors, path)
    proc = ServerProcess.module(tmp_path / "server.log", "--weights", str(path))
    try:
        code = proc.proc.wait(FAIL_TIMEOUT_S)
    finally:
        proc.stop()
    assert code == 2, f"exit code {code}:\n{proc.log()[-3000:]}"
    assert "expert 3" in proc.log() and "NaN or infinity" in proc.log(), proc.log()[-3000:]
