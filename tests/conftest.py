"""Markers: `gpu` tests need a CUDA device, `multigpu` several; both are skipped otherwise. The
selected modules' background jobs start once collection ends (tests/background.py). Proxy variables
are dropped from the environment."""

import os

import pytest
import torch

from tests import background
from tests.helpers import OUTSIDE_PROXIES

# Every server the tests start is on this host: a proxy named in the environment (a CI runner's, say)
# must not get their requests. urllib, httpx and grpc read these; the servers and clients the tests
# start as processes inherit their absence. The one child that reaches outside (the image recipe's
# pip) gets them back from OUTSIDE_PROXIES.
for _name in [n for n in os.environ if n.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")]:
    OUTSIDE_PROXIES[_name] = os.environ.pop(_name)


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {gpus}"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def pytest_collection_finish(session):
    # pytest-xdist: every worker collects every test but runs a share; its tests start their own jobs
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return
    modules = dict.fromkeys(item.module for item in session.items if isinstance(item, pytest.Function))
    background.SESSION.start(background.session_jobs(modules))


def pytest_sessionfinish(session):
    background.SESSION.stop()


@pytest.fixture
def split_every_piece(monkeypatch):
    """The batcher splits every piece over its copy threads, also the tests' tiny ones (the threshold,
    batcher.SPLIT_MIN_BYTES, is 1 MiB)."""
    import service.api.batcher as batcher_mod

    monkeypatch.setattr(batcher_mod, "SPLIT_MIN_BYTES", 1)
