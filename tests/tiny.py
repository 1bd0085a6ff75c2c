"""Tiny random Whisper-architecture models for tests (built on the fly, saved to a temp dir)."""

from __future__ import annotations

import numpy as np
import torch
from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

from rayspec.models.tokenizer import SPECIAL_TOKENS, build_char_tokenizer
from rayspec.models.whisper import WhisperASR


def make_tiny(path, d_model=64, layers=2, seed=0, masked=True, std=0.35, max_source_positions=125, hop=320,
              timestamps=0):
    """Write a tiny random Whisper model with the zoo's character tokenizer to ``path`` and load it; ``timestamps``:
    that many timestamp tokens ``<|0.00|>, <|0.02|>, ...`` after ``<|notimestamps|>``, as in Whisper's vocabulary."""
    torch.manual_seed(seed)
    tok = build_char_tokenizer(str(path), timestamps)
    ids = dict(zip(SPECIAL_TOKENS, tok.convert_tokens_to_ids(SPECIAL_TOKENS)))
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    space = tok.convert_tokens_to_ids("\u0120")
    cfg = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model, max_source_positions=max_source_positions, max_target_positions=128,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot,
        init_std=std, dropout=0.0, tie_word_embeddings=True,
    )
    cfg.rayspec_encoder_masking = masked
    model = WhisperForConditionalGeneration(cfg)
    gen = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        no_timestamps_token_id=ids["<|notimestamps|>"], is_multilingual=False,
        suppress_tokens=sorted(set(ids.values()) - {eot}), begin_suppress_tokens=[space, eot],
    )
    model.generation_config = gen
    model.save_pretrained(str(path))
    gen.save_pretrained(str(path))
    chunk = 2 * max_source_positions * hop // 16000  # whole seconds: the extractor pads to chunk * rate samples
    WhisperFeatureExtractor(feature_size=80, hop_length=hop, chunk_length=chunk).save_pretrained(str(path))
    return WhisperASR.from_pretrained(str(path))


def random_audio(n, seed=0, min_s=0.4, max_s=2.5, rate=16000):
    """``n`` noise-and-tone waveforms of random lengths (float32 mono)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = np.arange(int(rng.uniform(min_s, max_s) * rate)) / rate
        f = rng.uniform(100, 2000)
        out.append((0.3 * np.sin(2 * np.pi * f * t) + 0.1 * rng.standard_normal(t.size)).astype(np.float32))
    return out


def make_noisy_copy(source: WhisperASR, path, noise=0.05, seed=1) -> WhisperASR:
    """A draft that partly agrees with ``source``: its weights plus Gaussian noise (relative std ``noise``)."""
    import shutil

    shutil.copytree(source.model.name_or_path, str(path), dirs_exist_ok=True)
    copy = WhisperASR.from_pretrained(str(path))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp(min=1e-3))
    return copy


def hf_greedy(asr: WhisperASR, audio, max_new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` (GenerationMixin) for one utterance, prompt and EOS stripped."""
    from transformers import GenerationMixin
    from transformers.modeling_outputs import BaseModelOutput

    feats, lengths = asr.features([audio])
    with torch.no_grad():
        if asr.encoder_masking:
            kwargs = {"encoder_outputs": BaseModelOutput(last_hidden_state=asr.encode(feats, lengths).states)}
        else:
            kwargs = {"input_features": feats}
        prompt = torch.tensor([asr.prompt_ids])
        out = GenerationMixin.generate(
            asr.model, decoder_input_ids=prompt, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
            suppress_tokens=asr.suppress_tokens, begin_suppress_tokens=asr.begin_suppress_tokens,
            eos_token_id=asr.eos_token_id, pad_token_id=asr.eos_token_id, **kwargs,
        )
    ids = out[0, len(asr.prompt_ids):].tolist()
    return ids[: ids.index(asr.eos_token_id)] if asr.eos_token_id in ids else ids


def poison_drafter(monkeypatch, bad_id):
    """Make ``Drafter.encode_parts`` (and so ``Drafter.encode``) raise "poisoned row" for any batch holding utterance
    ``bad_id``; returns the original ``encode_parts``."""
    from rayspec.pipeline import Drafter

    encode_parts = Drafter.encode_parts

    def poisoned(self, batch, audios=None, part_rows=None):
        if any(u.id == bad_id for u in batch):
            raise RuntimeError("poisoned row")
        yield from encode_parts(self, batch, audios, part_rows)

    monkeypatch.setattr(Drafter, "encode_parts", poisoned)
    return encode_parts
