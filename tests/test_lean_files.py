"""rayspec.models.lean_files reads a checkpoint's config, generation config, tokenizer and feature extractor without
transformers and gives transformers' results: the same token ids and decoded texts, bitwise-equal features; the
default ``rayspec transcribe`` path then never imports transformers."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from rayspec.models import lean_files
from rayspec.models.errors import ModelLoadError
from rayspec.models.registry import resolve_model

ROOT = os.path.join(os.path.dirname(__file__), "..")
TEXTS = [
    "", " ", "Hello world.", " Hello world.", "  two  spaces  ", "Under the conditions referred to in the previous "
    "chapter,", "they each contained four small rooms or \"cabins\" seven feet square,", "It's 3:45 p.m.; $12.50!",
    "naïve café, résumé — déjà vu", "Grüße aus Köln", "Привет, как дела?", "你好，世界", "こんにちは世界",
    "مرحبا بالعالم", "नमस्ते दुनिया", "😀 emoji 🎉", "tabs\tand\nnewlines", "<|endoftext|>", "a<|notimestamps|>b",
    " <|0.00|> Hello<|1.20|>", "<|startofprev|> prompt text<|startoftranscript|>", "<|en|><|transcribe|>",
    "UPPER CASE WORDS", "don't won't shouldn't", "e.g. i.e. etc.", "1234567890", "\u00a0non-breaking",
]


def _installed(name):
    try:
        return resolve_model(name)
    except ModelLoadError:
        return None


MODELS = [n for n in ("whisper-base", "whisper-tiny.en") if _installed(n)]
pytestmark = pytest.mark.skipif(not MODELS, reason="no Whisper model installed")


def _id_sequences(tok, n, seed):
    """Random id sequences over the whole vocabulary, specials and timestamps included, some with a prompt."""
    rng = random.Random(seed)
    size = len(tok)
    added = sorted(tok.backend.get_added_tokens_decoder())
    prev, sot = tok.convert_tokens_to_ids("<|startofprev|>"), tok.convert_tokens_to_ids("<|startoftranscript|>")
    seqs = [[], [sot], [prev], [prev, 100, 200], [prev, 100, sot, 300, 400], added[:40], added[-40:]]
    for _ in range(n):
        ids = [rng.randrange(size) if rng.random() < 0.3 else rng.randrange(min(size, 50257))
               for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.3:
            ids = [prev] + ids[:5] + [sot] + ids[5:]
        seqs.append(ids)
    return seqs


@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_gives_transformers_ids_and_texts(name):
    from transformers import AutoTokenizer

    path = resolve_model(name)
    lean, full = lean_files.load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(lean, lean_files.WhisperTokens)
    assert len(lean) == len(full)
    for attr in ("unk_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(lean, attr) == getattr(full, attr), attr
    for text in TEXTS:
        for special in (False, True):
            assert lean(text, add_special_tokens=special).input_ids == \
                full(text, add_special_tokens=special).input_ids, (text, special)
    tokens = ["<|startofprev|>", "<|nospeech|>", "<|nocaptions|>", "<|fr|>", "<|0.02|>", "<|30.00|>", "Ġthe",
              "not a token", "<|notimestamps|>"]
    assert [lean.convert_tokens_to_ids(t) for t in tokens] == [full.convert_tokens_to_ids(t) for t in tokens]
    assert lean.convert_tokens_to_ids(tokens) == full.convert_tokens_to_ids(tokens)
    everything = list(range(len(full)))
    assert lean.convert_ids_to_tokens(everything) == full.convert_ids_to_tokens(everything)
    assert lean.convert_ids_to_tokens(50257) == full.convert_ids_to_tokens(50257)
    for ids in _id_sequences(lean, 300, seed=len(name)):
        for skip in (False, True):
            assert lean.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip), ids
        assert lean.decode(ids, clean_up_tokenization_spaces=False) == \
            full.decode(ids, clean_up_tokenization_spaces=False)
        assert lean.decode(np.array(ids, dtype=np.int64), skip_special_tokens=True) == \
            full.decode(ids, skip_special_tokens=True)
    text_ids = full(" Hello world.", add_special_tokens=False).input_ids
    assert lean.decode(text_ids[0]) == full.decode(text_ids[0])


def test_character_tokenizer_of_the_test_models_matches_transformers(tiny_target):
    from transformers import AutoTokenizer

    path = tiny_target.model.config._name_or_path  # loaded through transformers (lean=False)
    lean, full = lean_files.load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(lean, lean_files.WhisperTokens) and len(lean) == len(full)
    for text in ["HELLO WORLD", " A B", "", "<|endoftext|>"]:
        assert lean(text, add_special_tokens=False).input_ids == full(text, add_special_tokens=False).input_ids
    for ids in _id_sequences(lean, 100, seed=3):
        ids = [i % len(full) for i in ids]
        assert lean.decode(ids, skip_special_tokens=True) == full.decode(ids, skip_special_tokens=True)
        assert lean.decode(ids) == full.decode(ids)


def _audios():
    rng = np.random.default_rng(0)
    from rayspec.audio import load_audio

    clip = load_audio(os.path.join(ROOT, "rayspec", "samples", "ljspeech", "LJ002-0092.flac"), 16000)
    return [clip, rng.standard_normal(16000).astype(np.float32) * 0.1, np.zeros(800, dtype=np.float32),
            rng.standard_normal(16000 * 31).astype(np.float32) * 0.05,  # longer than the window: cut
            (rng.standard_normal(4000) * 0.3).astype(np.float64), np.full(300, 0.5, dtype=np.float32)]


@pytest.mark.parametrize("name", MODELS[:1])
def test_feature_extractor_is_bitwise_transformers(name):
    from transformers import WhisperFeatureExtractor

    path = resolve_model(name)
    lean, full = lean_files.load_feature_extractor(path), WhisperFeatureExtractor.from_pretrained(path)
    assert isinstance(lean, lean_files.LogMelExtractor)
    assert lean.mel_filters.dtype == full.mel_filters.dtype and np.array_equal(lean.mel_filters, full.mel_filters)
    for attr in ("feature_size", "sampling_rate", "hop_length", "n_fft", "n_samples", "nb_max_frames", "dither"):
        assert getattr(lean, attr) == getattr(full, attr), attr
    for audio in _audios():
        for padding in (dict(padding="max_length"), dict(padding="longest", truncation=False)):
            got = lean(audio, sampling_rate=16000, return_tensors="np", **padding)["input_features"]
            want = full(audio, sampling_rate=16000, return_tensors="np", **padding)["input_features"]
            assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
            assert np.array_equal(got, want), (len(audio), padding)
    big = lean_files.slaney_mel_filters(201, 128, 16000, 8000.0)  # large-v3's 128 bins
    assert np.array_equal(big, WhisperFeatureExtractor(feature_size=128).mel_filters)
    with pytest.raises(ValueError, match="16000 Hz"):
        lean(_audios()[0], sampling_rate=8000)


@pytest.mark.parametrize("name", MODELS)
def test_configs_read_as_transformers_reads_them(name):
    from transformers import AutoConfig, GenerationConfig

    path = resolve_model(name)
    config, full = lean_files.read_model_config(path), AutoConfig.from_pretrained(path)
    for key in lean_files.MODEL_KEYS + ("architectures",):
        assert getattr(config, key) == getattr(full, key), key
    # read with these defaults where config.json lacks them (whisper_modules.supports, LeanWhisper)
    for key, default in {"scale_embedding": False, "activation_function": "gelu", "tie_word_embeddings": True}.items():
        assert getattr(config, key, default) == getattr(full, key), key
    gen, full_gen = lean_files.read_generation_config(path), GenerationConfig.from_pretrained(path)
    for key in tuple(lean_files.GENERATION_DEFAULTS) + ("is_multilingual", "lang_to_id", "task_to_id",
                                                        "alignment_heads", "language"):
        assert getattr(gen, key, None) == getattr(full_gen, key, None), key


def test_files_the_lean_readers_do_not_take_load_through_transformers(tmp_path):
    """A directory whose tokenizer names another class, whose config lacks a field and which has no preprocessor
    config loads each of those through transformers, with the same transcript."""
    import torch

    from rayspec.audio import load_audio
    from rayspec.models.whisper import WhisperASR
    from rayspec.pipeline import DecodeOptions, decode_batch

    src = resolve_model(MODELS[-1])
    for f in os.listdir(src):
        if f not in ("config.json", "tokenizer_config.json"):
            os.symlink(os.path.join(src, f), tmp_path / f)
    config = json.load(open(os.path.join(src, "config.json")))
    del config["num_mel_bins"]  # WhisperConfig's default (80) applies
    json.dump(config, open(tmp_path / "config.json", "w"))
    tok_config = json.load(open(os.path.join(src, "tokenizer_config.json")))
    json.dump({**tok_config, "tokenizer_class": "PreTrainedTokenizerFast"}, open(tmp_path / "tokenizer_config.json", "w"))
    assert lean_files.read_model_config(str(tmp_path)) is None and lean_files.load_tokenizer(str(tmp_path)) is None
    audio = [load_audio(os.path.join(ROOT, "rayspec", "samples", "ljspeech", "LJ002-0092.flac"), 16000)]
    both = [WhisperASR.from_pretrained(p, lean=True) for p in (src, str(tmp_path))]
    assert isinstance(both[0].tokenizer, lean_files.WhisperTokens)
    assert not isinstance(both[1].tokenizer, lean_files.WhisperTokens)
    assert type(both[1].config).__name__ == "WhisperConfig" and type(both[0].config).__name__ == "SimpleNamespace"
    with torch.inference_mode():
        texts = [m.decode_text(decode_batch(m, DecodeOptions("ar"), audio, [len(audio[0]) / 16000])[0].tokens) for m in both]
    assert texts[0] == texts[1] and texts[0]


def test_the_default_transcribe_process_imports_no_transformers(tmp_path):
    """``rayspec transcribe`` with no model flags (whisper-base, method ar) runs without importing transformers:
    1.1-1.9 s of its start-up."""
    if "whisper-base" not in MODELS:
        pytest.skip("whisper-base is not installed")
    manifest = tmp_path / "one.jsonl"
    clip = os.path.abspath(os.path.join(ROOT, "rayspec", "samples", "ljspeech", "LJ002-0092.flac"))
    manifest.write_text(json.dumps({"id": "a", "audio": clip}) + "\n")
    code = f"""
import sys
from rayspec.cli import main
assert main(["transcribe", {str(manifest)!r}, "-o", {str(tmp_path / "out.parquet")!r}, "-q", "--max-batch", "1"]) == 0
heavy = sorted(m for m in ("transformers", "ray", "scipy") if m in sys.modules)
assert not heavy, heavy
"""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "out.parquet").to_pylist()[0]["text"]
