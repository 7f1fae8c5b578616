"""One real server, attacked: what it listens on, an adversarial corpus over every protocol, abusive
gRPC messages, idle and slow connections, client disconnects, quiet 404s, strict JSON, and last a
stopped rank; deadlines that count the body's arrival. Each test failed on the code before its fix
(issue 14, and two adversarial passes: see bench/RESULTS.md and bench/NOTES.md)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import safetensors.torch
import torch

from service.api.proto import grpc_predict_v2_pb2 as pb
from service.api.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from tests.api import corpus
from tests.api.common import CFG, check, http_answers, inputs
from tests.serverproc import LOOPBACK, ServerProcess, cpu_seconds, descendants, listening, rss_bytes

IDLE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 32
GRPC_MAX_MESSAGE_BYTES = 64 << 20


def _serving(tmp_path_factory, http_impl: str):
    with ServerProcess.serving(tmp_path_factory.mktemp(f"hardening-{http_impl}") / "server.log",
                               "--http-impl", http_impl,
                               "--idle-timeout-s", str(IDLE_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
                               "--max-request-bytes", str(4 << 20),
                               "--grpc-max-message-bytes", str(GRPC_MAX_MESSAGE_BYTES),
                               # The RSS bounds below are on what the front end keeps of a request, not
                               # on the freed memory malloc_keep_mib keeps for the next ones
                               "--malloc-keep-mib", "0") as proc:
        assert f"serving HTTP ({http_impl})" in proc.log(), proc.log()[-3000:]
        yield proc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _serving(tmp_path_factory, "httptools")


@pytest.fixture(scope="module")
def h11_server(tmp_path_factory):
    """A second server on h11, started only for the connection tests: they run on both protocols."""
    yield from _serving(tmp_path_factory, "h11")


@pytest.fixture(params=["httptools", "h11"])
def http_server(request):
    return request.getfixturevalue("server" if request.param == "httptools" else "h11_server")


def answers_correctly(server) -> None:
    x, ids, w = inputs(7, seed=31)
    blob = safetensors.torch.save({"hidden_states": x, "topk_ids": ids, "topk_weights": w})
    r = httpx.post(server.url + "/moe/forward", content=blob, headers={"Content-Type": "application/x-safetensors"},
                   timeout=30)
    assert r.status_code == 200, r.text
    check(safetensors.torch.load(r.content)["output"], x, ids, w)


def metric(server, protocol: str, status: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    key = f'moe_requests_total{{protocol="{protocol}",status="{status}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def test_nothing_listens_beyond_loopback(server):
    pids = {server.pid, *descendants(server.pid)}
    addresses = listening(pids)
    assert len(addresses) >= 3, addresses  # HTTP, gRPC and the rank group's store at least
    assert all(a.startswith(LOOPBACK) for a in addresses), addresses


def test_adversarial_corpus(server):
    bad = []
    all_cases = corpus.cases()
    for name, protocol, send in all_cases:
        status, text = send(server)
        if not corpus.acceptable(protocol, status, text):
            bad.append((protocol, name, status, text[:200]))
    assert not bad, bad
    assert len(all_cases) >= 100  # the corpus did not shrink by accident
    assert httpx.get(server.url + "/v2/health/ready", timeout=5).status_code == 200
    assert metric(server, "http_json", "500") == metric(server, "grpc", "500") == 0
    answers_correctly(server)


def test_json_answers_are_strict_json(server):
    """Finite inputs near the float32 limit overflow in the layer: JSON says so (400), binary
    formats carry the IEEE values."""
    x = torch.full((2, CFG.H), 3e38) * torch.where(torch.rand(2, CFG.H) < 0.5, -1.0, 1.0)
    ids = torch.stack([torch.randperm(CFG.E)[:CFG.K] for _ in range(2)])
    w = torch.rand(2, CFG.K)
    body = {"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()}
    r = httpx.post(server.url + "/moe/forward", json=body, timeout=30)
    assert r.status_code == 400 and "float32 answer holds NaN or infinity: the layer overflowed" in r.json()["error"], \
        r.text
    blob = safetensors.torch.save({"hidden_states": x, "topk_ids": ids, "topk_weights": w})
    r = httpx.post(server.url + "/moe/forward", content=blob, headers={"Content-Type": "application/x-safetensors"})
    assert r.status_code == 200 and not torch.isfinite(safetensors.torch.load(r.content)["output"]).all()


def test_grpc_contents_beyond_the_declared_shape_cost_nothing(server):
    """Messages that declare [1, H] and carry 48 MiB of typed values: refused by count before any
    conversion, the event loop stays free, and the front end does not keep them."""
    from service.api.proto import grpc_predict_v2_pb2 as pb

    values = np.random.default_rng(5).standard_normal(12 << 20).astype(np.float32)  # 48 MiB
    req = corpus._grpc_request(raw=False)
    req.inputs[0].shape[:] = [1, CFG.H]
    req.inputs[0].contents.fp32_contents[:] = values
    data = req.SerializeToString()
    sends = 12
    live_s: list[float] = []
    stop = threading.Event()

    def convert() -> tuple[float, float]:
        """What converting one message's values costs here, now (wall, CPU seconds): what the front
        end would spend per message converting before counting (~0.7 s CPU), holding its loop."""
        t0, c0 = time.monotonic(), time.process_time()
        np.asarray(pb.ModelInferRequest.FromString(data).inputs[0].contents.fp32_contents, dtype=np.float32)
        return time.monotonic() - t0, time.process_time() - c0

    def probe():
        while not stop.is_set():
            t0 = time.monotonic()
            httpx.get(server.url + "/v2/health/live", timeout=30)
            live_s.append(time.monotonic() - t0)
            time.sleep(0.05)

    convert_s, convert_cpu_s = convert()
    before, cpu_before = rss_bytes(server.pid), cpu_seconds(server.pid)
    prober = threading.Thread(target=probe)
    prober.start()
    try:
        for _ in range(sends):
            code, text = corpus.grpc_send(server.grpc_url, data)
            assert code == "INVALID_ARGUMENT" and "values; shape" in text, (code, text)
    finally:
        stop.set()
        prober.join()
    spent = cpu_seconds(server.pid) - cpu_before
    convert_s = max(convert_s, convert()[0])  # the load may have changed meanwhile
    time.sleep(0.5)
    grown = rss_bytes(server.pid) - before
    assert grown < 150 << 20, f"the front end grew by {grown >> 20} MiB"
    # CPU time does not depend on how loaded the machine is (a wall-clock bound on the probes
    # did: 0.62 s for a GET at load 9): receiving and parsing the 12 messages took 1.5-2.4 s here;
    # converting them would add 12 x ~0.7 s.
    assert spent < sends * convert_cpu_s / 2, f"the front end spent {spent:.1f} s of CPU on {sends} messages " \
        f"(converting half of them costs {sends * convert_cpu_s / 2:.1f} s)"
    # A probe queued behind a conversion on the loop waits for what is left of it: up to a whole one,
    # half of one on average, so about half the probes would take over half a conversion. Here they
    # take 0.16-0.22 s against a 0.9 s conversion; a quarter of them are let pass for the stalls of a
    # loaded 2-core machine (a GET can take 0.6 s there).
    slow = [round(t, 2) for t in live_s if t >= convert_s / 2]
    assert len(live_s) >= 4 and len(slow) <= len(live_s) // 4, \
        f"/v2/health/live took {slow} s of {len(live_s)} probes (a conversion: {convert_s:.2f} s)"
    answers_correctly(server)


def unread_heads(port: int) -> int:
    """Established connections to `port` whose bytes the server has not read yet (Recv-Q > 0 on the
    server's side, `ss -tn`, iproute2)."""
    import subprocess

    out = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if int(line.split()[0]) > 0)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the peer closes `sock` within `seconds` (recv sees EOF or a reset)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_idle_and_slow_connections_are_bounded(http_server):
    log_before = len(http_server.log().splitlines())
    idle = [socket.create_connection(("127.0.0.1", http_server.http_port)) for _ in range(3 * MAX_CONNECTIONS)]
    grpc_idle = [socket.create_connection(("127.0.0.1", http_server.grpc_port)) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        t0 = time.monotonic()
        assert httpx.get(http_server.url + "/v2/health/live", timeout=5).json() == {"live": True}
        assert time.monotonic() - t0 < 2
        slow = socket.create_connection(("127.0.0.1", http_server.http_port))
        slow.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        for _ in range(int(IDLE_TIMEOUT_S / 0.25) + 4):  # a header byte every 0.25 s
            time.sleep(0.25)
            try:
                slow.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                break
        assert _closed_within(slow, IDLE_TIMEOUT_S), "a client trickling its headers was not cut off"
        assert all(_closed_within(s, IDLE_TIMEOUT_S + 3) for s in idle), "idle HTTP connections stay open"
        assert all(_closed_within(s, IDLE_TIMEOUT_S + 5) for s in grpc_idle), "idle gRPC connections stay open"
    finally:
        for s in idle + grpc_idle:
            s.close()
    with grpc.insecure_channel(http_server.grpc_url) as channel:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    new_lines = http_server.log().splitlines()[log_before:]
    assert len(new_lines) < 40, "\n".join(new_lines[-40:])
    answers_correctly(http_server)


def test_a_body_slower_than_the_deadline_gets_408(http_server):
    with socket.create_connection(("127.0.0.1", http_server.http_port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /moe/forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Timeout: 1\r\nContent-Length: 100000\r\n\r\n{")
        answer = s.recv(65536)
        took = time.monotonic() - t0
        while b"}" not in answer:  # the JSON body may follow the head in a second segment
            answer += s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer
    assert took < 3


@pytest.mark.parametrize("sent", [1000, 70000])  # under and over the 64 KiB of the one-buffer read (httptools)
def test_a_408_before_the_body_is_in_closes_the_connection_and_counts_the_bytes(http_server, sent):
    """The rest of the body would be read as the next request on a kept-alive connection: the 408
    says Connection: close and the server closes it; its message counts the bytes that did arrive."""
    with socket.create_connection(("127.0.0.1", http_server.http_port), timeout=10) as s:
        s.sendall(b"POST /moe/forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Timeout: 1\r\nContent-Length: 100000\r\n\r\n" + b"[" * sent)
        answer = b""
        while b"}" not in answer:
            answer += s.recv(65536)
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert answer.startswith(b"HTTP/1.1 408") and f"({sent} bytes read)".encode() in answer, answer
        assert head.count(b"connection: close") == 1, head
        try:  # then nothing more: the server has closed its end
            s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536) == b""
        except ConnectionResetError:
            pass


def test_an_early_answer_either_says_close_or_keeps_the_connection_whole(http_server):
    """A 415 (the wrong Content-Type) answered before its 2 MB body has arrived. Either the answer says
    Connection: close and the server closes (httptools' one-buffer read), or, once the client sends
    the rest of the body, the connection answers the next request (h11 reads the rest). Before:
    httptools closed without saying so, and a client keeping the connection got a reset."""
    with socket.create_connection(("127.0.0.1", http_server.http_port), timeout=10) as s:
        s.sendall(b"POST /moe/forward HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
                  b"Content-Length: 2000000\r\n\r\n" + b"x" * 100_000)
        answer = b""
        while b"}" not in answer:
            chunk = s.recv(65536)
            assert chunk, answer
            answer += chunk
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert answer.startswith(b"HTTP/1.1 415"), answer
        closes = b"connection: close" in head
        try:
            s.sendall(b"x" * 1_900_000 + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            rest = b""
            while b"}" not in rest and (chunk := s.recv(65536)):
                rest += chunk
        except (ConnectionResetError, BrokenPipeError):
            rest = b""
    if closes:
        assert rest == b"", rest  # (a reset or the end: the server said it would close)
    else:
        assert rest.startswith(b"HTTP/1.1 200") and b'"live":true' in rest.replace(b" ", b""), (head, rest)


def test_client_gone_mid_body_is_not_a_server_error(http_server):
    log_before = len(http_server.log().splitlines())
    gone_before = {protocol: metric(http_server, protocol, "499") for protocol in ("http_json", "v2_json")}
    for path in ("/moe/forward", "/v2/models/moe/infer"):
        with socket.create_connection(("127.0.0.1", http_server.http_port)) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 100000\r\n\r\n".encode() + b"[" * 1000)
            time.sleep(0.2)

    def gone() -> dict[str, float]:
        return {protocol: metric(http_server, protocol, "499") - n for protocol, n in gone_before.items()}

    deadline = time.monotonic() + 20  # until the server has seen both go (on a loaded machine, later)
    while gone() != {"http_json": 1, "v2_json": 1}:
        assert time.monotonic() < deadline, gone()
        time.sleep(0.05)
    new = "\n".join(http_server.log().splitlines()[log_before:])
    assert "ERROR" not in new and "Traceback" not in new, new
    assert metric(http_server, "http_json", "500") == metric(http_server, "v2_json", "500") == 0


def test_at_the_cap_with_every_connection_busy_the_new_one_is_answered_503(http_server):
    busy = []
    try:
        for _ in range(MAX_CONNECTIONS):  # each with a request in flight: its body still to come
            s = socket.create_connection(("127.0.0.1", http_server.http_port))
            s.sendall(b"POST /moe/forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"X-Request-Timeout: 20\r\nContent-Length: 100000\r\n\r\n{")
            busy.append(s)
        # The server has read (and so parsed) every head before the newcomer connects: a head still
        # in a socket's receive queue would make that connection look idle, and it would be the one
        # closed (a fixed pause per connection raced a loaded machine).
        deadline = time.monotonic() + 20
        while unread_heads(http_server.http_port):
            assert time.monotonic() < deadline, "the server did not read the heads"
            time.sleep(0.02)
        newcomer = socket.create_connection(("127.0.0.1", http_server.http_port), timeout=10)
        with newcomer:  # its request (a body too, as a client sends it) gets the refusal, then the close
            newcomer.sendall(b"POST /moe/forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 200000\r\n\r\n" + b" " * 200000)
            answer = b""
            while chunk := newcomer.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), answer
        assert json.loads(body) == {"error": "too many connections (max_connections): every one has a "
                                             "request in flight"}, body
        assert not any(_closed_within(s, 0.01) for s in busy), "a busy connection was closed for the newcomer"
    finally:
        for s in busy:
            s.close()
    t0 = time.monotonic()
    while True:  # the server sees the busy ones go; then a new connection is answered again
        try:
            assert httpx.get(http_server.url + "/v2/health/live", timeout=5).json() == {"live": True}
            break
        except httpx.TransportError:
            assert time.monotonic() - t0 < 5, "no connection accepted after the busy ones closed"
            time.sleep(0.1)
    answers_correctly(http_server)


def test_404_on_model_routes_is_quiet(server):
    log_before = len(server.log().splitlines())
    for path in ("/v2/models/nope", "/v2/models/nope/ready", "/v2/models/moe/versions/2"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 404 and ("nope" in r.json()["error"] or "no version" in r.json()["error"]), r.text
    r = httpx.post(server.url + "/v2/models/nope/infer", json={}, timeout=10)
    assert r.status_code == 404
    time.sleep(0.3)
    new = "\n".join(server.log().splitlines()[log_before:])
    assert "Traceback" not in new and "ERROR" not in new, new


# ---- last: it restarts the group -----------------------------------------------------------


def test_stopped_rank_turns_readiness_false_and_the_group_restarts(server):
    pids = server.rank_pids()
    assert len(pids) == CFG.R, pids
    os.kill(pids[2], signal.SIGSTOP)
    t0 = time.monotonic()
    while httpx.get(server.url + "/v2/health/ready", timeout=5).status_code == 200:
        assert time.monotonic() - t0 < 8, "still ready 8 s after a rank stopped"
        time.sleep(0.1)
    detected = time.monotonic() - t0
    assert detected < 5, detected
    while httpx.get(server.url + "/v2/health/ready", timeout=5).status_code != 200:
        assert time.monotonic() - t0 < 90, "no recovery:\n" + server.log()[-3000:]
        time.sleep(0.2)
    answers_correctly(server)
    assert not set(server.rank_pids()) & set(pids)
    with pytest.raises(ProcessLookupError):  # the stopped rank was reaped, not left behind
        os.kill(pids[2], 0)


def _v2_binary_request(T: int, seed: int) -> bytes:
    """A whole v2 binary inference request (head and body) of T fp32 rows."""
    x, ids, w = (t.numpy() for t in inputs(T, seed=seed))
    blobs = [x.tobytes(), ids.astype(np.int32).tobytes(), w.tobytes()]
    header = json.dumps({"inputs": [
        {"name": name, "datatype": dt, "shape": list(a.shape), "parameters": {"binary_data_size": len(b)}}
        for name, dt, a, b in zip(("hidden_states", "topk_ids", "topk_weights"), ("FP32", "INT32", "FP32"),
                                  (x, ids, w), blobs, strict=True)]}).encode()
    body = header + b"".join(blobs)
    return (f"POST /v2/models/moe/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\nX-Request-Timeout: 60\r\n\r\n").encode() + body


def _gauge(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def _reset(s: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a killed client's kernel does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@contextlib.contextmanager
def _group_busy(server, T: int = 20000):
    """A gRPC call of T rows (~T/512 steps of the CPU preset) in flight for the body of the `with`: the
    requests sent inside it queue behind it for as long as its steps take, not for as long as a
    request under the HTTP body limit takes, a window a fast machine (or a slow poll) can miss."""
    x, ids, w = inputs(T, seed=44)
    message = corpus._grpc_request(x.numpy(), ids.numpy().astype(np.int32), w.numpy()).SerializeToString()
    with grpc.insecure_channel(server.grpc_url, options=[("grpc.max_send_message_length", 64 << 20),
                                                         ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer").future(message, timeout=120)
        _wait_in_flight(server, 1, "the call that keeps the group busy never was in flight")
        yield T
        answer = pb.ModelInferResponse.FromString(call.result(timeout=120))
        check(torch.frombuffer(bytearray(answer.raw_output_contents[0]), dtype=torch.float32).view(x.shape), x, ids, w)


def _wait_in_flight(server, n: int, what: str) -> None:
    deadline = time.monotonic() + 20
    while _gauge(server, "moe_inflight_requests") < n:
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_client_gone_after_its_whole_body_is_not_computed_nor_answered(http_server):
    """A request whose client leaves once its body is in (queued behind others) is dropped with a 499:
    its rows are never computed, nothing counts it as answered, and the request ahead is answered."""
    T = 3500  # 7 steps of the CPU preset's 512 tokens; ~3.7 MB, under the fixture's 4 MiB body limit
    log_before = len(http_server.log().splitlines())
    gone_before, ok_before = metric(http_server, "v2_binary", "499"), metric(http_server, "v2_binary", "200")
    tokens_before = _gauge(http_server, "moe_tokens_total")
    with _group_busy(http_server) as busy:
        ahead = socket.create_connection(("127.0.0.1", http_server.http_port), timeout=60)
        behind = socket.create_connection(("127.0.0.1", http_server.http_port), timeout=60)
        try:
            ahead.sendall(_v2_binary_request(T, seed=41))
            _wait_in_flight(http_server, 2, "the request ahead never was in flight behind the busy call")
            behind.sendall(_v2_binary_request(T, seed=42))
            _wait_in_flight(http_server, 3, "the request behind never was in flight with the one ahead")
            _reset(behind)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += ahead.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        finally:
            ahead.close()
    deadline = time.monotonic() + 20
    while metric(http_server, "v2_binary", "499") - gone_before < 1:
        assert time.monotonic() < deadline, "the client that left was never counted as gone (499)"
        time.sleep(0.05)
    while _gauge(http_server, "moe_inflight_requests") or _gauge(http_server, "moe_queued_tokens"):
        assert time.monotonic() < deadline, "rows of the request whose client left stay queued"
        time.sleep(0.05)
    assert metric(http_server, "v2_binary", "200") - ok_before == 1
    # The busy call and the one ahead in full; of the one behind at most the steps it shared before the
    # reset was seen
    assert _gauge(http_server, "moe_tokens_total") - tokens_before < busy + 2 * T - 512
    new = "\n".join(http_server.log().splitlines()[log_before:])
    assert "ERROR" not in new and "Traceback" not in new, new
    answers_correctly(http_server)


def test_a_cancelled_grpc_call_is_counted_as_gone(server):
    """grpc cancels the handler of a call its client cancelled: the books count it (499), not nothing."""
    gone_before = metric(server, "grpc", "499")
    x, ids, w = (t.numpy() for t in inputs(3500, seed=43))
    message = corpus._grpc_request(x, ids.astype(np.int32), w).SerializeToString()
    with grpc.insecure_channel(server.grpc_url) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with _group_busy(server):
            calls = [infer.future(message, timeout=60) for _ in range(2)]  # both wait behind the busy call
            _wait_in_flight(server, 3, "the two calls never were in flight together")
            calls[1].cancel()
            assert calls[0].result(timeout=60)
    deadline = time.monotonic() + 20
    while metric(server, "grpc", "499") - gone_before < 1:
        assert time.monotonic() < deadline, "the cancelled call was never counted"
        time.sleep(0.05)
    answers_correctly(server)


BODY_DELAY_S = 1.5  # how long a deadline test's client holds back the rest of its body


def v2_json_body(T: int, seed: int, **doc) -> tuple[bytes, tuple]:
    x, ids, w = inputs(T, seed=seed)
    tensors = (("hidden_states", x, "FP32"), ("topk_ids", ids, "INT64"), ("topk_weights", w, "FP32"))
    body = {"inputs": [{"name": n, "datatype": dt, "shape": list(t.shape), "data": t.reshape(-1).tolist()}
                       for n, t, dt in tensors], **doc}
    return json.dumps(body).encode(), (x, ids, w)


def post_slowly(server, path: str, body: bytes, headers: dict[str, str], hold_s: float) -> tuple[int, bytes]:
    """POST `body` on a socket of its own: the headers and its first bytes at once, the rest after
    `hold_s` seconds; the answer (status, body)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.settimeout(60)
        sock.sendall(head.encode() + body[:100])
        time.sleep(hold_s)
        sock.sendall(body[100:])
        return http_answers(sock, 1)[0]


def test_a_deadline_counts_from_the_first_byte_not_from_the_body_s_end(http_server):
    """Before (a second adversarial pass): a request's deadline started once its body was in and
    decoded, so a v2 request with `"timeout": 500000` (0.5 s) whose body took 1.5 s to arrive was
    computed and answered 200 a second past its deadline (and an X-Request-Timeout of 0.5 s, whose body
    gets 1 s to arrive, the same at 0.8 s), although the body's own bound and the books count from the
    first byte. Now the body's time spends the deadline: 504 once the body is in. A deadline the body
    leaves room for still answers."""
    server = http_server
    body, _ = v2_json_body(3, seed=1, parameters={"timeout": 500_000})
    status, text = post_slowly(server, "/v2/models/moe/infer", body, {}, BODY_DELAY_S)
    assert status == 504, text
    assert "deadline of 0.5 s passed before it was queued" in json.loads(text)["error"], text
    body, tensors = v2_json_body(3, seed=2, parameters={"timeout": 60_000_000})
    status, text = post_slowly(server, "/v2/models/moe/infer", body, {}, BODY_DELAY_S)
    assert status == 200, text
    check([json.loads(text)["outputs"][0]["data"][i * CFG.H:(i + 1) * CFG.H] for i in range(3)], *tensors)


def test_grpc_model_metadata_is_http_s(server):
    """Before (a second adversarial pass): gRPC ModelMetadata left `versions` out (HTTP's /v2/models/moe says ["1"]), so
    tritonclient.grpc's get_model_metadata("moe").versions was empty. Every field of the two answers
    now agrees."""
    http = httpx.get(server.url + "/v2/models/moe", timeout=30).json()
    with grpc.insecure_channel(server.grpc_url) as channel:
        answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelMetadata(pb.ModelMetadataRequest(name="moe"),
                                                                         timeout=30)

    def tensors(ts) -> list:
        return [(t.name, t.datatype, list(t.shape)) for t in ts]

    assert (answer.name, list(answer.versions), answer.platform) == (http["name"], http["versions"], http["platform"])
    assert tensors(answer.inputs) == [(t["name"], t["datatype"], t["shape"]) for t in http["inputs"]]
    assert tensors(answer.outputs) == [(t["name"], t["datatype"], t["shape"]) for t in http["outputs"]]
    assert set(http) == {"name", "versions", "platform", "inputs", "outputs"}, http
