"""`moe-serve` flags: one per Settings field, overriding MOE_* variables; bad values exit 2."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import typing

import pytest
import torch
from safetensors.torch import save_file

from service import server
from service.cli import build_parser, main, parse_settings
from service.config import Settings, default_text, preset
from tests.helpers import routing, run_at_once, side_by_side


def test_one_flag_per_setting():
    flags = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert flags == set(Settings.model_fields)


def test_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("MOE_QUEUE_TOKENS", "5")
    monkeypatch.setenv("MOE_MODEL_NAME", "from-env")
    s = parse_settings(["--queue-tokens", "7", "--batch-delay-ms", "0.5"])
    assert s.queue_tokens == 7 and s.model_name == "from-env" and s.batch_delay_ms == 0.5


BOOLS = [name for name, f in Settings.model_fields.items() if bool in (f.annotation, *typing.get_args(f.annotation))]


def test_a_boolean_flag_alone_means_true_and_still_takes_a_value():
    """Before: `--shm-direct` alone exited 2 ("expected one argument"), though the README wrote the
    booleans as switches. Now a bare flag is true, before another flag or at the end, and a value
    given parses as it did (as the MOE_* variable would)."""
    assert set(BOOLS) == {"batch_idle_wait", "rank_copy_streams", "shm_direct", "wire_arena_grpc"}, BOOLS
    base = ["--shared-memory", "system"]  # (shm_direct true needs it)
    for name in BOOLS:
        flag = "--" + name.replace("_", "-")
        assert getattr(parse_settings([*base, flag]), name) is True, flag
        s = parse_settings([flag, "--queue-tokens", "7", *base])
        assert getattr(s, name) is True and s.queue_tokens == 7, flag
        for value in ("true", "false", "1", "0", "yes", "off"):
            expected = getattr(Settings(shared_memory="system", **{name: value}), name)
            assert getattr(parse_settings([*base, flag, value]), name) is expected, (flag, value)
            assert getattr(parse_settings([*base, f"{flag}={value}"]), name) is expected, (flag, value)


def test_only_boolean_flags_are_switches(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_settings(["--queue-tokens"])
    assert exit_.value.code == 2 and "expected one argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        parse_settings(["--batch-idle-wait", "maybe"])
    assert exit_.value.code == 2 and "--batch-idle-wait:" in capsys.readouterr().err


BAD_VALUES = ((["--http-port", "70000"], "--http-port"), (["--device", "tpu"], "--device"),
              (["--preset", "huge"], "--preset"))


def _backend_fused_runs(folder):
    """test_backend_fused_where_it_cannot_run_exits_2_saying_why's commands: serve and forward (and the
    folder of forward's input and output)."""
    cfg = preset("cpu")
    gen = torch.Generator().manual_seed(1)
    ids, w = routing(2, cfg.E, cfg.K, "balanced", gen)
    save_file({"hidden_states": torch.randn(2, cfg.H, generator=gen), "topk_ids": ids, "topk_weights": w},
              str(folder / "in.safetensors"))
    return *run_at_once([
        [sys.executable, "-m", "service", "--device", "cpu", "--backend", "fused", "--host", "127.0.0.1",
         "--http-port", "0", "--grpc-port", "0"],
        [sys.executable, "-m", "service.cli", "forward", "--input", str(folder / "in.safetensors"),
         "--output", str(folder / "out.safetensors"), "--device", "cpu", "--backend", "fused"],
    ], timeout=180), folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The commands of the tests below that start `python -m service` and expect it to exit (~2-5 s
    each, most of it one core importing torch), run side by side once the first test asks
    (tests.helpers.side_by_side); each test checks its own. Key -> Future of what they returned."""
    run = functools.partial(subprocess.run, capture_output=True, text=True)
    jobs = {
        "bad values": functools.partial(run_at_once, [[sys.executable, "-m", "service", *argv]
                                                      for argv, _ in BAD_VALUES], timeout=60),
        "unreadable weights": functools.partial(run, [sys.executable, "-m", "service", "--weights",
                                                      "/nonexistent.safetensors", "--http-port", "0", "--grpc-port",
                                                      "0"], timeout=60),
        "backend fused": functools.partial(_backend_fused_runs, tmp_path_factory.mktemp("fused")),
        "slots": functools.partial(run, [sys.executable, "-m", "service", "--capacity", "100000000", "--http-port",
                                         "0", "--grpc-port", "0"], timeout=120),
    }
    with side_by_side(jobs) as futures:
        yield futures


def test_bad_values_exit_2_naming_the_flag(runs):
    for (argv, needle), r in zip(BAD_VALUES, runs["bad values"].result(), strict=True):
        assert r.returncode == 2, (argv, r.stderr)
        assert needle in r.stderr, (argv, r.stderr)


def test_a_bad_variable_exits_2_naming_the_variable_without_the_usage(monkeypatch, capsys):
    """MOE_HTTP_PORT=abc names the variable and its value, not --http-port, and prints no usage
    (the command line was fine); a bad flag beside it still gets the usage."""
    monkeypatch.setenv("MOE_HTTP_PORT", "abc")
    with pytest.raises(SystemExit) as exit_:
        parse_settings([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "MOE_HTTP_PORT='abc' (environment)" in err, err
    assert "usage:" not in err and "--http-port" not in err, err
    with pytest.raises(SystemExit) as exit_:
        parse_settings(["--grpc-port", "x"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage:" in err and "--grpc-port:" in err and "MOE_HTTP_PORT" in err, err


def test_unreadable_weights_exit_nonzero(runs):
    r = runs["unreadable weights"].result()
    assert r.returncode == 2, r.stderr
    assert "nonexistent" in r.stderr


def test_log_level_is_checked_and_any_case(monkeypatch, capsys):
    assert parse_settings(["--log-level", "debug"]).log_level == "DEBUG"
    for argv, env, named in ((["--log-level", "verbose"], None, "--log-level"), ([], "verbose", "MOE_LOG_LEVEL")):
        if env:
            monkeypatch.setenv("MOE_LOG_LEVEL", env)
        with pytest.raises(SystemExit) as exit_:
            main(argv)  # before the fix: a traceback from logging.basicConfig
        assert exit_.value.code == 2
        assert named in capsys.readouterr().err


def test_help_names_the_offline_commands():
    text = " ".join(build_parser().format_help().split())
    assert "moe-serve forward" in text and "moe-serve write-checkpoint" in text
    assert "moe-serve forward --help" in text


def test_help_renders_a_percent_sign_in_a_setting_s_description():
    """argparse %-formats every help string: a description's "+5 % group steps/s" made --help raise
    (TypeError: must be real number, not dict) until cli escaped it; it shows as written."""
    text = build_parser().format_help()
    described = [f.description for f in Settings.model_fields.values() if f.description and "%" in f.description]
    assert described, "no description has a % sign: this test checks nothing (give it one of its own)"
    assert text.count("%") >= sum(d.count("%") for d in described), text


def test_help_shows_unset_not_none_for_host_dependent_defaults(capsys):
    """Before: `--http-impl` said "default httptools when it is installed ..." then "(default: None)";
    now the word DEPLOY.md's table uses, from the same helper (service.config.default_text)."""
    from service.cli import FORWARD_SETTINGS
    from tests.deploy import settings_docs

    assert settings_docs.default_text is default_text
    unset = [name for name, f in Settings.model_fields.items() if f.default is None]
    assert {"frontends", "http_impl", "wire_arena_mib", "shm_direct", "preset"} <= set(unset)
    with pytest.raises(SystemExit):
        main(["forward", "--help"])
    forward_help = capsys.readouterr().out
    for help_text, names in ((build_parser().format_help(), Settings.model_fields), (forward_help, FORWARD_SETTINGS)):
        text = " ".join(help_text.split())
        assert "(default: None)" not in text
        for name in unset:
            if name in names:
                after = text.split(f"--{name.replace('_', '-')} ")[-1]
                assert after.split("(default: ")[1].startswith("unset)"), (name, after[:300])
    text = " ".join(build_parser().format_help().split())
    assert "(default: 268435456 (256 MiB))" in text and '(default: "")' in text


def test_help_lists_the_presets():
    """Before: `--preset PRESET` with "layer preset; default seed on GPU, cpu otherwise" (user's trial 4)."""
    from service.config import PRESETS

    text = " ".join(build_parser().format_help().split()).split("--preset PRESET")[-1][:200]
    assert all(name in text for name in PRESETS), text


def test_write_checkpoint_help_describes_every_argument(capsys):
    """Before: `write-checkpoint --help` had no description, and output, --preset and --seed no help
    text nor their defaults (user's trial 4)."""
    with pytest.raises(SystemExit) as exit_:
        main(["write-checkpoint", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Hugging Face" in text and "the safetensors file to write" in text
    for flag, default in (("--preset", "cpu"), ("--seed", "0"), ("--naming", "hf")):
        assert f"(default: {default})" in text.split(flag)[-1], (flag, text)


def test_docstring_gives_the_exit_status_of_bad_weights():
    doc = " ".join(server.__doc__.split())
    assert "unreadable weights file" in doc and "status 2" in doc  # test_unreadable_weights_exit_nonzero


def test_backend_fused_where_it_cannot_run_exits_2_saying_why(runs):
    """Before: the ranks fell back to serial with a WARNING and the service ran, contradicting the flag."""
    serve, forward, folder = runs["backend fused"].result()
    err = serve.stderr
    assert serve.returncode == 2, err[-3000:]
    assert "--backend fused cannot run here" in err and "not CUDA" in err, err[-3000:]
    assert "Traceback" not in err and " ready (" not in err, err[-3000:]
    # refused before any server listens or any rank starts (before: ~4 s later, after both)
    assert "serving HTTP" not in err and "rank group" not in err, err[-3000:]
    err = forward.stderr
    assert forward.returncode == 2, err[-3000:]
    assert "--backend fused cannot run here" in err and "Traceback" not in err, err[-3000:]
    assert not (folder / "out.safetensors").exists()


FLOATS = [name for name, f in Settings.model_fields.items() if float in (f.annotation, *typing.get_args(f.annotation))]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_a_float_setting_must_be_finite(value, monkeypatch, capsys):
    """Before: `--idle-timeout-s inf` passed `gt=0` and the server died at start with an OverflowError
    traceback (exit 1, grpc's int(idle_timeout_s * 1000)); `--request-timeout-s inf` or
    `--batch-delay-ms inf` started, and /v2/models/moe/config then answered 500 (round(inf))."""
    assert {"batch_delay_ms", "request_timeout_s", "idle_timeout_s", "step_timeout_s"} <= set(FLOATS), FLOATS
    for name in FLOATS:
        flag = "--" + name.replace("_", "-")
        with pytest.raises(SystemExit) as exit_:
            parse_settings([flag, value])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"{flag}:" in err, (flag, err)
    monkeypatch.setenv("MOE_REQUEST_TIMEOUT_S", value)
    with pytest.raises(SystemExit) as exit_:
        parse_settings([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "MOE_REQUEST_TIMEOUT_S=" in err, err


TIMES = {"request_timeout_s": "s", "step_timeout_s": "s", "start_timeout_s": "s", "drain_timeout_s": "s",
         "restart_backoff_s": "s", "idle_timeout_s": "s", "batch_delay_ms": "ms"}


def test_settings_past_their_bound_exit_2_and_at_it_serve(tmp_path, capsys):
    """Before: `--idle-timeout-s 1e7` died at start with an OverflowError traceback (grpc's idle option is
    a C int of ms), as did `--grpc-max-message-bytes 4294967296` and `--max-connections 40000000` (grpc's
    C ints); `--start-timeout-s 1e300` exited 1 with "Python int too large to convert to C int",
    `--step-timeout-s 1e300` with "timestamp too large to convert to C _PyTime_t". Now a value past
    its bound exits 2 naming the flag, and a server with each of these settings at its bound starts,
    answers its model configuration on HTTP and gRPC, and serves."""
    import grpc
    import httpx

    from service.api.proto import grpc_predict_v2_pb2 as pb
    from service.api.proto import grpc_predict_v2_pb2_grpc as pb_grpc
    from service.config import MAX_CONNECTIONS, MAX_GRPC_MESSAGE_BYTES, MAX_SECONDS
    from tests.api.common import check, inputs
    from tests.serverproc import ServerProcess

    assert set(TIMES) == set(FLOATS) - {"rank_idle_spin_ms"}, FLOATS
    bound = {name: MAX_SECONDS * (1000 if unit == "ms" else 1) for name, unit in TIMES.items()}
    bound.update(grpc_max_message_bytes=MAX_GRPC_MESSAGE_BYTES, max_connections=MAX_CONNECTIONS)
    for name, top in bound.items():
        flag = "--" + name.replace("_", "-")
        with pytest.raises(SystemExit) as exit_:
            parse_settings([flag, str(top + 1)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"{flag}:" in err, (flag, err)
    flags = [a for name, top in bound.items() for a in ("--" + name.replace("_", "-"), str(top))]
    with ServerProcess.serving(tmp_path / "server.log", *flags) as proc:
        r = httpx.get(proc.url + "/v2/models/moe/config", timeout=30)
        assert r.status_code == 200, r.text
        policy = r.json()["dynamic_batching"]["default_queue_policy"]
        assert policy["default_timeout_microseconds"] == MAX_SECONDS * 10**6, policy
        with grpc.insecure_channel(proc.grpc_url) as channel:
            config = pb_grpc.GRPCInferenceServiceStub(channel).ModelConfig(pb.ModelConfigRequest(name="moe"),
                                                                            timeout=30).config
        assert config.dynamic_batching.default_queue_policy.default_timeout_microseconds == MAX_SECONDS * 10**6
        x, ids, w = inputs(3, seed=5)
        r = httpx.post(proc.url + "/moe/forward", timeout=60,
                       json={"hidden_states": x.tolist(), "topk_ids": ids.tolist(), "topk_weights": w.tolist()})
        assert r.status_code == 200, r.text
        check(r.json()["output"], x, ids, w)


def test_slots_larger_than_dev_shm_exit_2_before_anything_starts(runs):
    """Before: `--capacity 100000000` (a typo) started; its slot files are sparse, so they were made,
    and the owner's warm-up then allocated a step's 400 GB of rows, growing to 16 GB of RAM within a
    minute and never exiting (SIGTERM waited for it). Now the slots' size is checked against /dev/shm
    first: exit 2 naming what to lower."""
    r = runs["slots"].result()
    assert r.returncode == 2, r.stderr[-3000:]
    assert "lower capacity" in r.stderr and not re.search(r"started \d+ ranks", r.stderr), r.stderr[-3000:]
