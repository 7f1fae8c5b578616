"""`moe-serve` flags: one per Settings field, overriding MOE_* variables; bad values exit 2."""

from __future__ import annotations

import subprocess
import sys

from service.config import Settings
from service.server import build_parser, parse_settings


def test_one_flag_per_setting():
    flags = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert flags == set(Settings.model_fields)


def test_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("MOE_QUEUE_TOKENS", "5")
    monkeypatch.setenv("MOE_MODEL_NAME", "from-env")
    s = parse_settings(["--queue-tokens", "7", "--batch-delay-ms", "0.5"])
    assert s.queue_tokens == 7 and s.model_name == "from-env" and s.batch_delay_ms == 0.5


def test_bad_values_exit_2_naming_the_flag():
    for argv, needle in ((["--http-port", "70000"], "--http-port"), (["--device", "tpu"], "--device"),
                         (["--preset", "huge"], "--preset")):
        r = subprocess.run([sys.executable, "-m", "service", *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (argv, r.stderr)
        assert needle in r.stderr, r.stderr


def test_unreadable_weights_exit_nonzero():
    r = subprocess.run([sys.executable, "-m", "service", "--weights", "/nonexistent.safetensors",
                        "--http-port", "0", "--grpc-port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "nonexistent" in r.stderr
