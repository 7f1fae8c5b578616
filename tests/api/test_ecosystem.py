"""What tools around the service see, against one real CPU server: Triton's model configuration
and statistics calls, NVIDIA's perf_analyzer run unchanged over HTTP and gRPC (the binary comes
from `.ci/install-tools`), a Prometheus scrape, the start log, and the README's commands."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.openmetrics import parser as openmetrics
from tritonclient.utils import InferenceServerException

from service.config import Settings
from tests.api.common import CFG, check, inputs
from tests.helpers import external_tool
from tests.serverproc import ServerProcess

README = Path(__file__).parents[2] / "README.md"
MODEL = "moe"
PERF_ANALYZER_TIMEOUT_S = 150
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess.serving(tmp_path_factory.mktemp("ecosystem") / "server.log") as proc:
        yield proc


def stats(server) -> dict:
    """The model's statistics over HTTP, durations as {"count", "ns"} ints."""
    (model,) = httpx.get(f"{server.url}/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"]
    return model


def grpc_stats(server) -> dict:
    """The same over gRPC with tritonclient; its JSON writes uint64 as strings (made ints here) and
    leaves out empty lists."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        (model,) = client.get_inference_statistics(MODEL, as_json=True)["model_stats"]
    model["inference_stats"] = {k: {f: int(v.get(f, 0)) for f in ("count", "ns")}
                                for k, v in model["inference_stats"].items()}
    for key in ("last_inference", "inference_count", "execution_count"):
        model[key] = int(model.get(key, 0))
    model.setdefault("batch_stats", [])
    return model


def difference(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("inference_count", "execution_count")}
    for name in DURATIONS:
        for field in ("count", "ns"):
            out[f"{name}.{field}"] = after["inference_stats"][name][field] - before["inference_stats"][name][field]
    return out


def test_a_normal_cpu_start_logs_no_warning(server):
    """Before: each of the four ranks logged the expected serial fallback as a WARNING."""
    lines = [line for line in server.log().splitlines() if " WARNING " in line or "Warning:" in line]
    assert not lines, "\n".join(lines)


def test_metrics_exposition(server):
    """OpenMetrics when asked for, the standard collectors, no `_created` series, and no series of
    the backend that is not running (a CPU replica runs serial)."""
    plain = httpx.get(f"{server.url}/metrics", timeout=10)
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    om = httpx.get(f"{server.url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                   timeout=10)
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    names = {family.name for family in openmetrics.text_string_to_metric_families(om.text)}  # parses
    assert {"moe_requests", "moe_request_duration_seconds"} <= names, names
    for text in (plain.text, om.text):
        assert "process_cpu_seconds_total" in text and "python_info" in text
        assert "_created" not in text
        assert 'backend="serial"' in text and 'backend="fused"' not in text
        assert 'stage="gemm1"' in text and 'stage="kernel1"' not in text
        assert 'le="30.0"' in text and 'le="60.0"' in text


# ---- the configuration -------------------------------------------------------------------------


def test_config_over_http_and_grpc(server):
    with httpclient.InferenceServerClient(server.http_hostport) as client:
        config = client.get_model_config(MODEL)
        meta = client.get_model_metadata(MODEL)
        assert client.get_model_config(MODEL, model_version="1") == config
        with pytest.raises(InferenceServerException, match="version"):
            client.get_model_config(MODEL, model_version="2")
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.get_model_config("other")
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        grpc_config = client.get_model_config(MODEL, as_json=True)["config"]
        with pytest.raises(InferenceServerException) as err:
            client.get_model_config("other")
        assert err.value.status() == "StatusCode.NOT_FOUND"
    assert config["name"] == MODEL and meta["versions"] == ["1"]
    # The token dimension is Triton's batch dimension: left out of dims, bounded by max_batch_size.
    assert config["max_batch_size"] == int(grpc_config["max_batch_size"]) > 0
    for kind, tensors in (("input", meta["inputs"]), ("output", meta["outputs"])):
        declared = {t["name"]: ("TYPE_" + t["datatype"], t["shape"][1:]) for t in tensors}
        assert {t["name"]: (t["data_type"], t["dims"]) for t in config[kind]} == declared
        assert {t["name"]: (t["data_type"], [int(d) for d in t["dims"]]) for t in grpc_config[kind]} == declared
    assert meta["inputs"][0]["shape"] == [-1, CFG.H]
    batching = config["dynamic_batching"]
    assert batching["preferred_batch_size"] == [CFG.tokens_per_step]
    delay = batching["max_queue_delay_microseconds"]
    assert int(grpc_config["dynamic_batching"]["max_queue_delay_microseconds"]) == delay
    assert delay == round(Settings.model_fields["batch_delay_ms"].default * 1000)  # ms -> us
    extensions = httpx.get(f"{server.url}/v2", timeout=10).json()["extensions"]
    assert {"model_configuration", "statistics"} <= set(extensions)


# ---- the statistics ----------------------------------------------------------------------------


def test_statistics_count_what_the_front_end_did(server):
    before = stats(server)
    assert grpc_stats(server) == before, "HTTP and gRPC report different statistics"
    sizes = (1, 5, CFG.tokens_per_step + 37)  # the last one takes two steps
    with httpclient.InferenceServerClient(server.http_hostport) as client:
        for T in sizes[:2]:
            x, ids, w = inputs(T, seed=100 + T)
            tensors = []
            for name, value, dt in (("hidden_states", x, "FP32"), ("topk_ids", ids.to(torch.int32), "INT32"),
                                    ("topk_weights", w, "FP32")):
                t = httpclient.InferInput(name, list(value.shape), dt)
                t.set_data_from_numpy(value.numpy())
                tensors.append(t)
            check(client.infer(MODEL, tensors).as_numpy("output"), x, ids, w)
    one_step = difference(before, stats(server))  # the two requests of one step each
    x, ids, w = inputs(sizes[2], seed=7)
    response = httpx.post(f"{server.url}/moe/forward", timeout=60,
                          json={"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()})
    assert response.status_code == 200, response.text
    check(response.json()["output"], x, ids, w)
    bad = httpx.post(f"{server.url}/moe/forward", timeout=60,  # expert id E: refused before the queue
                     json={"hidden_states": x[:2].tolist(), "topk_ids": [[CFG.E] * CFG.K] * 2,
                           "topk_weights": w[:2].tolist()})
    assert bad.status_code == 400, bad.text
    after = stats(server)
    d = difference(before, after)
    n = len(sizes)
    assert d["success.count"] == n and d["fail.count"] == 1, d
    assert d["inference_count"] == sum(sizes), d  # tokens, as Triton counts batch items
    assert d["execution_count"] >= n + 1, d       # the largest request ran in two steps
    assert d["queue.count"] == n, d               # the refused one never queued
    for phase in ("compute_input", "compute_infer", "compute_output"):
        assert d[f"{phase}.count"] == n and d[f"{phase}.ns"] > 0, d
    # A request of one step: its time in the server covers its queueing and its step. (Not so for
    # one of two steps: compute_infer adds up both steps' group.run, which overlap when the second
    # waits in the ranks' pipes behind the first, so with a fast decode it can exceed the request's time.)
    assert one_step["success.count"] == 2, one_step
    assert one_step["success.ns"] > one_step["queue.ns"] + one_step["compute_infer.ns"] > 0, one_step
    assert d["success.ns"] > d["queue.ns"] > 0 and d["compute_infer.ns"] > 0, d
    assert after["last_inference"] >= before["last_inference"] and after["last_inference"] > 0
    assert grpc_stats(server) == after


# ---- perf_analyzer -----------------------------------------------------------------------------


def perf_analyzer_env() -> dict[str, str]:
    """perf_analyzer links libcudart.so.12 (no GPU needed): the nvidia-cuda-runtime-cu12 wheel's."""
    import nvidia.cuda_runtime

    libs = [os.path.join(p, "lib") for p in nvidia.cuda_runtime.__path__]
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([*libs, os.environ.get("LD_LIBRARY_PATH", "")])}


def input_data(path, rows: int = 4, seed: int = 0) -> None:
    """perf_analyzer's --input-data file: valid expert ids (its random default sends ids out of
    range, which the server refuses), fresh random hidden states, weights summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(rows):
        ids = torch.randperm(CFG.E, generator=gen)[:CFG.K]
        w = torch.rand(CFG.K, generator=gen)
        data.append({"hidden_states": torch.randn(CFG.H, generator=gen).tolist(), "topk_ids": ids.tolist(),
                     "topk_weights": (w / w.sum()).tolist()})
    path.write_text(json.dumps({"data": data}))


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_unchanged(server, protocol, tmp_path):
    binary = external_tool("perf_analyzer")
    data, report = tmp_path / "input.json", tmp_path / "report.csv"
    input_data(data)
    before = stats(server)
    url = server.http_hostport if protocol == "http" else server.grpc_url
    cmd = [binary, "-m", MODEL, "-u", url, "-i", protocol, "-b", "1", "--input-data", str(data),
           "--measurement-mode", "count_windows", "--measurement-request-count", "10",
           "--stability-percentage", "1000", "--max-trials", "3", "-f", str(report)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=PERF_ANALYZER_TIMEOUT_S,
                         env=perf_analyzer_env())
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    d = difference(before, stats(server))
    sent = int(re.search(r"Client:\s+Request count: (\d+)", out).group(1))
    server_count = int(re.search(r"Server:.*?Successful request count: (\d+)", out, re.S).group(1))
    assert 0 < sent <= server_count <= d["success.count"], out
    assert d["fail.count"] == 0, d
    (row,) = list(csv.DictReader(report.open()))
    assert float(row["Inferences/Second"]) > 0 and int(row["Server Compute Infer"]) > 0, row


# ---- the README's commands, as a user pastes them ------------------------------------------------


def readme_python(marker: str) -> str:
    """Run the README's `python3 -c '...'` line that contains `marker`; its standard output."""
    lines = [ln.strip() for ln in README.read_text().splitlines()]
    (line,) = [ln for ln in lines if ln.startswith("python3 -c") and marker in ln]
    argv = shlex.split(line.split(" | ")[0].split(" > ")[0].rstrip(" \\"))
    assert argv[:2] == ["python3", "-c"], argv
    return subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, check=True, timeout=60).stdout


def test_readme_curl_body_is_valid_and_answered(server):
    body = json.loads(readme_python('"hidden_states": [['))
    x, ids, w = (torch.tensor(body[k]) for k in ("hidden_states", "topk_ids", "topk_weights"))
    assert x.shape == (1, CFG.H) and ids.shape == w.shape == (1, CFG.K)
    response = httpx.post(f"{server.url}/moe/forward", content=json.dumps(body),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text
    check(response.json()["output"], x, ids, w)


def test_readme_perf_analyzer_rows_fit_the_model(server):
    config = httpx.get(f"{server.url}/v2/models/{MODEL}/config", timeout=10).json()
    dims = {t["name"]: t["dims"] for t in config["input"]}
    rows = json.loads(readme_python('"data"'))["data"]
    assert rows
    for row in rows:
        assert {k: [len(v)] for k, v in row.items()} == dims
        assert len(set(row["topk_ids"])) == CFG.K and all(0 <= e < CFG.E for e in row["topk_ids"])
