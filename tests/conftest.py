import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

from tiny import make_noisy_copy, make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny_target"), d_model=64, layers=2, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target, tmp_path_factory):
    return make_noisy_copy(tiny_target, tmp_path_factory.mktemp("tiny_draft"), noise=0.15)


@pytest.fixture(scope="session")
def tiny_fixed(tmp_path_factory):
    """A fixed-window model (no encoder masking), as real Whisper checkpoints run."""
    return make_tiny(tmp_path_factory.mktemp("tiny_fixed"), masked=False, seed=2)


@pytest.fixture(scope="session")
def samples_manifest():
    from importlib import resources

    return str(resources.files("rayspec").joinpath("samples", "an4", "manifest.jsonl"))
