"""Markers: `gpu` tests need a CUDA device, `multigpu` several; both are skipped otherwise. The
selected modules' background jobs start once collection ends (tests/background.py)."""

import pytest
import torch

from tests import background


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
