import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# float32, the exact reference, is the tests' compute type (their expected transcripts were made in it), whatever the
# host's auto type; tests of other types ask for them (test_compute_type.py)
os.environ["RAYSPEC_COMPUTE_TYPE"] = "float32"
torch.set_num_threads(2)

from tiny import make_noisy_copy, make_tiny  # noqa: E402


@pytest.fixture(autouse=True)
def speculate_at_any_batch_size(monkeypatch):
    """In-process decoding speculates in every round and at every batch size, so the tests exercise batched
    verification (by default the cost rule decides, rayspec.spec_decode.rule: test_rule tests it; the CPU's row cap,
    still the SSD gate's and the beam search's, is lifted too; test_continuous tests a fixed cap)."""
    import rayspec.spec_decode.loop

    monkeypatch.setattr(rayspec.spec_decode.loop, "COST_RULE", False)
    monkeypatch.setattr(rayspec.spec_decode.loop, "CPU_SPECULATE_MAX_ROWS", 0)


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


@pytest.fixture(scope="session")
def tiny_en():
    """The installed whisper-tiny.en (skips where it is not installed)."""
    from rayspec.models.errors import ModelLoadError
    from rayspec.models.whisper import WhisperASR

    try:
        return WhisperASR.from_pretrained("whisper-tiny.en")
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tiny_en_drafters(tmp_path_factory):
    """Drafter directories for the installed whisper-tiny.en (skips where it is not installed): ``(draft, ctc)``, a
    decoder-only draft of its first and last decoder layers (untrained, distil-whisper's initialisation) and a
    random CTC head over its single-letter tokens. Exactness holds for any drafter."""
    from rayspec.models.ctc import CTCHead
    from rayspec.models.errors import ModelLoadError
    from rayspec.models.whisper import WhisperASR
    from rayspec.train.draft_decoder import new_draft_decoder

    try:
        target = WhisperASR.from_pretrained("whisper-tiny.en")
    except ModelLoadError as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("tiny_en_drafters")
    draft = new_draft_decoder(target, layers=2, dropout=0.0)
    for part in (draft.model, draft.generation_config, draft.tokenizer):
        part.save_pretrained(root / "draft")
    torch.manual_seed(0)
    vocab = target.tokenizer.get_vocab()
    letters = [vocab[c] for c in "abcdefghijklmnopqrstuvwxyz"] + [vocab["\u0120" + c] for c in "abcdefghijklmnopqrstuvwxyz"]
    CTCHead(target.config.d_model, letters).save_pretrained(str(root / "ctc"))
    return str(root / "draft"), str(root / "ctc")
