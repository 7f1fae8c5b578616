"""What the README tells a user, held against the code: units of the deadlines, the per-request
token cap. (Its commands are run against a server in tests/api/test_ecosystem.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from service.api import codecs, error_map
from service.config import Settings

README = (Path(__file__).parents[1] / "README.md").read_text()


def bullet(start: str) -> str:
    """The README's behaviour bullet that begins with `start`, sub-items included, as one line."""
    m = re.search(rf"^- \*\*{re.escape(start)}\*\*:(.*?)(?=^- \*\*|^\S)", README, re.S | re.M)
    assert m, f"no '{start}' bullet in the README"
    return " ".join(m.group(1).split())


def test_deadline_units_are_the_ones_the_code_uses():
    text = bullet("Deadlines")
    assert re.search(r"`X-Request-Timeout` header, in \*\*seconds\*\*", text), text
    assert re.search(r"`parameters\.timeout` integer, in \*\*microseconds\*\*", text), text
    example = re.search(r'"timeout": (\d+)\}` is ([\d.]+) s', text)
    assert example, text
    assert codecs.v2_timeout(int(example.group(1))) == pytest.approx(float(example.group(2)))
    assert codecs.parse_timeout_s("0.25", "X-Request-Timeout") == 0.25


def test_queue_tokens_is_documented_as_a_per_request_cap():
    text = bullet("Overload")
    assert "`--queue-tokens` also caps a single request" in text and "413" in text, text
    assert "most tokens one request may carry" in Settings.model_fields["queue_tokens"].description
    spec = codecs.ModelSpec(E=4, H=8, K=2, dtype=torch.float32, max_tokens=3)
    gen = torch.Generator().manual_seed(0)
    x, ids = torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4, 2), generator=gen)
    with pytest.raises(error_map.PayloadTooLarge, match="queue_tokens") as err:
        codecs.validate(x, ids, torch.rand(4, 2, generator=gen), spec)
    assert error_map.classify(err.value)[0] == 413


def test_ci_runs_the_readmes_test_command():
    """`.ci/run` runs exactly the README's test command (the second of the two at the top)."""
    commands = re.findall(r"^    (pip install .+)$", README, flags=re.M)[:2]
    assert len(commands) == 2 and commands[1].endswith("python -m pytest -q"), commands
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, f"{commands[1]!r} is not a line of .ci/run"


def test_failure_detection_numbers_are_the_code_s():
    """The step deadline is min(--step-timeout-s, max(5 s, 10x the slowest of the last 64 steps)) and
    an idle group is pinged every 0.5 s with 2 s to answer (before: "at least 5 s" without the cap,
    and the 2 s answer limit called the heartbeat's period)."""
    from service.fleet import WATCH_INTERVAL_S
    from service.worker import group

    text = bullet("Failures")
    default = Settings.model_fields["step_timeout_s"].default
    assert f"`--step-timeout-s`, {default:g} s by default" in text, text
    assert (f"max({group.STEP_DEADLINE_FLOOR_S:g} s, {group.STEP_DEADLINE_FACTOR:g}x the slowest of the last "
            f"{group.STEP_HISTORY} steps)") in text, text
    assert f"pinged every {WATCH_INTERVAL_S:g} s" in text and f"within {group.HEARTBEAT_TIMEOUT_S:g} s" in text, text
    described = Settings.model_fields["step_timeout_s"].description
    assert "smaller of this and max(5 s, 10x the slowest of the last 64 steps)" in described
