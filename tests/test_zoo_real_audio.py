"""Exactness on real speech with the bundled zoo models (fp32, CPU): speculative and exact-SSD == AR greedy."""

import pytest
import torch

from rayspec.audio import load_audio
from rayspec.decoding.ar import greedy_decode
from rayspec.decoding.proposer import DraftProposer
from rayspec.decoding.speculative import SpeculationOptions, speculative_decode
from rayspec.decoding.ssd import SSDDecoder, SSDOptions, ctc_drafts
from rayspec.manifest import read_manifest
from rayspec.models.ctc import CTCHead
from rayspec.models.whisper import WhisperASR
from rayspec.pipeline import zoo_path

CONFIGS = {
    "fixed-8": SpeculationOptions(8, 0.0, recycle=False, tree=False),
    "fixed-16": SpeculationOptions(16, 0.0, recycle=False, tree=False),
    "default": SpeculationOptions(),
    "adaptive": SpeculationOptions(max_draft=24, recycle=False),
    "recycle": SpeculationOptions(max_draft=24),
    "tree": SpeculationOptions(max_draft=24, tree=True),
}


@pytest.fixture(scope="module")
def zoo(samples_manifest):
    target = WhisperASR.from_pretrained(zoo_path("target"))
    draft = WhisperASR.from_pretrained(zoo_path("draft"))
    ctc = CTCHead.from_pretrained(zoo_path("ctc"))
    audios = [load_audio(u.audio, target.sample_rate) for u in read_manifest(samples_manifest)]
    caps = [200] * len(audios)
    with torch.inference_mode():
        reference = [greedy_decode(target, _enc(target, [a]), [200])[0] for a in audios]
    return target, draft, ctc, audios, caps, reference


def _enc(model, audios):
    f, l = model.features(audios)
    return model.encode(f, l)


def _draft_enc(target, draft, audios):
    """The draft's encoder states: its own, or the target's for a decoder-only draft (the zoo's)."""
    return _enc(draft if draft.has_encoder else target, audios)


def test_zoo_models_transcribe_and_finish(zoo):
    target, _, _, _, _, reference = zoo
    assert all(h.finished for h in reference)  # EOS, not the cap
    assert sum(len(h.tokens) > 0 for h in reference) >= 8


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_speculative_equals_ar_on_real_audio(zoo, name, batch_size):
    target, draft, _, audios, caps, reference = zoo
    got = []
    with torch.inference_mode():
        for s in range(0, len(audios), batch_size):
            a = audios[s : s + batch_size]
            hyps = speculative_decode(target, _enc(target, a), draft, _draft_enc(target, draft, a),
                                      caps[s : s + batch_size], CONFIGS[name])
            got += hyps
    assert [h.tokens for h in got] == [h.tokens for h in reference]
    assert all(h.finished for h in got)
    assert sum(h.stats.target_forward_passes for h in got) < sum(h.stats.target_forward_passes for h in reference)


@pytest.mark.parametrize("fallback", ["ar", "draft"])
def test_exact_ssd_equals_ar_on_real_audio(zoo, fallback):
    target, draft, ctc, audios, caps, reference = zoo
    decoder = SSDDecoder(target, SSDOptions(tau_ctc=0.0, tau_slm=0.1, exact=True, fallback=fallback))
    with torch.inference_mode():
        enc = _enc(target, audios)
        hyps, parked = decoder.first_pass(enc, caps, ctc_drafts(ctc, target, enc))
        if parked:
            proposer = None
            if fallback == "draft":
                d = _draft_enc(target, draft, [audios[x.index] for x in parked])
                proposer = DraftProposer(draft, d, [x.cap for x in parked], SpeculationOptions())
            for x, h in zip(parked, decoder.fallback(enc, parked, proposer)):
                hyps[x.index] = h
    assert [h.tokens for h in hyps] == [h.tokens for h in reference]


@pytest.mark.parametrize("batch_size", [1, 16])
def test_ctc_draft_equals_ar_on_real_audio(zoo, batch_size):
    from rayspec.pipeline import DecodeOptions, decode_batch

    target, _, ctc, audios, _, reference = zoo
    options = DecodeOptions("ctc-draft", max_tokens_per_second=1000.0)  # caps far above the outputs
    got = []
    for s in range(0, len(audios), batch_size):
        a = audios[s : s + batch_size]
        got += decode_batch(target, options, a, [len(x) / target.sample_rate for x in a], ctc=ctc)
    assert [h.tokens for h in got] == [h.tokens for h in reference]
    assert options.mode == "exact" and {h.route for h in got} == {"ctc-draft"}
    assert sum(h.stats.target_forward_passes for h in got) < sum(h.stats.target_forward_passes for h in reference)


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_medusa_equals_ar_on_real_audio(zoo, batch_size, monkeypatch):
    import rayspec.spec.loop as loop
    from rayspec.pipeline import DecodeOptions, decode_batch

    target, _, _, audios, _, reference = zoo
    kept_eos = []
    accept = loop.accept_tree

    def recording(layout, scores):  # does some row keep an EOS draft node (finish inside the tree)?
        result = accept(layout, scores)
        for k, path in enumerate(result.paths):
            kept_eos.append(any(layout["tokens"][k, a] == target.eos_token_id for a in path))
        return result

    monkeypatch.setattr(loop, "accept_tree", recording)
    options = DecodeOptions("medusa", max_tokens_per_second=1000.0)
    got = []
    for s in range(0, len(audios), batch_size):
        a = audios[s : s + batch_size]
        got += decode_batch(target, options, a, [len(x) / target.sample_rate for x in a])
    assert [h.tokens for h in got] == [h.tokens for h in reference]
    assert all(h.finished for h in got) and any(kept_eos)
    assert sum(h.stats.target_forward_passes for h in got) < sum(h.stats.target_forward_passes for h in reference)
