"""A Whisper checkpoint's configuration, generation configuration, tokenizer and log-mel feature extractor read
from its files without importing transformers.

``import transformers`` alone costs 1.1-1.9 s on a 2-core Xeon and its ``AutoTokenizer`` another 0.5 s: most of what
a ``rayspec transcribe`` process spent before its first transcription call beyond PyTorch's own import. What the
decoding reads of these objects is small, and each reader here reproduces transformers' result exactly for the
checkpoints it accepts (tests compare them: token ids, decoded texts, bitwise-equal features); where a checkpoint's
files ask for something a reader does not implement, the reader returns None and
:meth:`~rayspec.models.whisper.WhisperASR.from_pretrained` loads that part through transformers.

* :func:`read_model_config`: ``config.json`` as attributes (a Whisper whose fields the decoder reads are all there);
* :func:`read_generation_config`: ``generation_config.json`` as attributes;
* :class:`WhisperTokens` (:func:`load_tokenizer`): ``tokenizer.json`` through the ``tokenizers`` library, with
  transformers' ``WhisperTokenizer`` decoding rules (prompt stripping, timestamp tokens removed from the text);
* :class:`LogMelExtractor` (:func:`load_feature_extractor`): ``WhisperFeatureExtractor``'s log-mel features.
"""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace
from typing import Iterable, Optional, Sequence

import numpy as np

MODEL_KEYS = ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "decoder_layers",
              "decoder_attention_heads", "decoder_ffn_dim", "max_source_positions", "max_target_positions",
              "num_mel_bins", "vocab_size", "pad_token_id", "eos_token_id", "decoder_start_token_id")
"""``config.json`` fields read without a default (transformers' ``WhisperConfig`` would fill in its own where one is
missing): :func:`read_model_config` returns None unless all are present."""

GENERATION_DEFAULTS = {"decoder_start_token_id": None, "eos_token_id": None, "suppress_tokens": None,
                       "begin_suppress_tokens": None, "no_timestamps_token_id": None}
"""``GenerationConfig`` attributes the decoding reads directly, with transformers' defaults (None) where the file
lacks them."""

TOKENIZER_CLASSES = ("WhisperTokenizer", "WhisperTokenizerFast")
TIMESTAMP_TEXT = re.compile(r"<\|(\d+\.\d+)\|>")  # transformers' WhisperTokenizer.timestamp_pat


def _read_json(path: str) -> Optional[dict]:
    """``path``'s JSON object, or None where the file is missing or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_model_config(path: str) -> Optional[SimpleNamespace]:
    """``path/config.json`` as attributes, or None where it is not a Whisper config holding every field of
    :data:`MODEL_KEYS` (the caller then loads transformers' ``AutoConfig``). Fields read with ``getattr`` defaults
    (``scale_embedding``, ``activation_function``, ``tie_word_embeddings``, rayspec's own) default as
    ``WhisperConfig`` does."""
    config = _read_json(os.path.join(path, "config.json"))
    if config is None or config.get("model_type") != "whisper" or not all(k in config for k in MODEL_KEYS):
        return None
    return SimpleNamespace(**config)


def read_generation_config(path: str) -> Optional[SimpleNamespace]:
    """``path/generation_config.json`` as attributes (:data:`GENERATION_DEFAULTS` where it lacks them), or None
    where there is no such file (the caller then derives one from the model config through transformers)."""
    config = _read_json(os.path.join(path, "generation_config.json"))
    return None if config is None else SimpleNamespace(**{**GENERATION_DEFAULTS, **config})


class Encoding(SimpleNamespace):
    """What calling a tokenizer returns: ``input_ids``, a list of token ids."""


class WhisperTokens:
    """A Whisper tokenizer over ``tokenizers``' ``Tokenizer`` (a checkpoint's ``tokenizer.json``) that encodes and
    decodes as transformers' ``WhisperTokenizer`` loaded from the same directory: the same ids and texts for the
    calls below (checked against transformers in the tests), without importing transformers.

    Args:
        backend: the ``tokenizers.Tokenizer``; special: the special token strings by role (``unk_token``,
            ``bos_token``, ``eos_token``, ``pad_token``).
    """

    def __init__(self, backend, special: dict) -> None:
        self.backend = backend
        self.special = special
        self.unk_token_id = backend.token_to_id(special["unk_token"])
        self.bos_token_id = backend.token_to_id(special["bos_token"])
        self.eos_token_id = backend.token_to_id(special["eos_token"])
        self.pad_token_id = backend.token_to_id(special["pad_token"])
        self._prompt_id = backend.token_to_id("<|startofprev|>")
        self._start_id = backend.token_to_id("<|startoftranscript|>")

    def __len__(self) -> int:
        """Ids in all, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        """``text``'s token ids (``.input_ids``); ``add_special_tokens``: with the checkpoint's decoder prompt before
        them and ``<|endoftext|>`` after (its ``tokenizer.json`` post-processor, as transformers saves it)."""
        return Encoding(input_ids=self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        """A token's id (:attr:`unk_token_id` for a token not in the vocabulary), or a list of them."""
        if isinstance(tokens, str):
            i = self.backend.token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> Optional[str] | list[Optional[str]]:
        """An id's token string (None for an id outside the vocabulary), or a list of them."""
        if isinstance(ids, (int, np.integer)):
            return self.backend.id_to_token(int(ids))
        return [self.backend.id_to_token(int(i)) for i in ids]

    def decode(self, token_ids: int | Iterable[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: Optional[bool] = None) -> str:
        """The text of ``token_ids`` (an id, or a sequence of ids: a list, a NumPy array, a 1-D tensor), as
        transformers' ``WhisperTokenizer.decode`` gives it: with ``skip_special_tokens`` a leading prompt
        (``<|startofprev|> ... <|startoftranscript|>``) is dropped and special tokens are left out; timestamp tokens
        never appear in the text. ``clean_up_tokenization_spaces`` is accepted and, as transformers does for
        byte-level BPE vocabularies, ignored."""
        ids = [int(token_ids)] if isinstance(token_ids, (int, np.integer)) else [int(i) for i in token_ids]
        if skip_special_tokens and ids and ids[0] == self._prompt_id:
            ids = ids[ids.index(self._start_id):] if self._start_id in ids else []
        return TIMESTAMP_TEXT.sub("", self.backend.decode(ids, skip_special_tokens=skip_special_tokens))


def load_tokenizer(path: str) -> Optional[WhisperTokens]:
    """``path``'s Whisper tokenizer as :class:`WhisperTokens`, or None where transformers' must load it: no
    ``tokenizer.json``, a ``tokenizer_config.json`` naming another class, asking for the BPE clean-up transformers
    applies only on request, or declaring added tokens ``tokenizer.json`` does not hold as it declares them."""
    file = os.path.join(path, "tokenizer.json")
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    if not os.path.isfile(file) or config is None or config.get("tokenizer_class") not in TOKENIZER_CLASSES:
        return None
    if config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(file)
    added = backend.get_added_tokens_decoder()
    for i, declared in (config.get("added_tokens_decoder") or {}).items():
        have = added.get(int(i))
        if have is None or have.content != declared.get("content") or have.special != declared.get("special"):
            return None
    special = {role: config.get(role) or "<|endoftext|>" for role in ("unk_token", "bos_token", "eos_token",
                                                                       "pad_token")}
    if any(not isinstance(t, str) or backend.token_to_id(t) is None for t in special.values()):
        return None
    return WhisperTokens(backend, special)


def slaney_mel_filters(n_freqs: int, n_mels: int, sample_rate: int, f_max: float) -> np.ndarray:
    """Slaney's mel filter bank (M. Slaney, "Auditory Toolbox", Interval Research Technical Report 1998-010; as
    librosa's ``filters.mel(htk=False, norm="slaney")``): ``n_mels`` triangular filters with centres evenly spaced
    on Slaney's mel scale (linear below 1 kHz, logarithmic above) from 0 Hz to ``f_max``, each scaled to unit area
    (2 / its width in Hz), over ``n_freqs`` FFT bins from 0 to ``sample_rate // 2``. Float64 ``[n_freqs, n_mels]``:
    what transformers' ``WhisperFeatureExtractor`` holds as ``mel_filters`` (bitwise: a test compares them)."""
    f_break, mel_break = 1000.0, 15.0  # the scale's linear/log break: 1 kHz is mel 15 (3 mels per 200 Hz below)
    mels_per_log = 27.0 / np.log(6.4)  # above it, 27 mels per factor 6.4 in frequency
    mel_max = 3.0 * f_max / 200.0
    if f_max >= f_break:
        mel_max = mel_break + np.log(f_max / f_break) * mels_per_log
    mels = np.linspace(0.0, mel_max, n_mels + 2)
    centres = 200.0 * mels / 3.0
    log_part = mels >= mel_break
    centres[log_part] = f_break * np.exp(np.log(6.4) / 27.0 * (mels[log_part] - mel_break))
    bins = np.linspace(0, sample_rate // 2, n_freqs)
    widths = np.diff(centres)
    slopes = np.expand_dims(centres, 0) - np.expand_dims(bins, 1)  # [n_freqs, n_mels + 2]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    filters = np.maximum(np.zeros(1), np.minimum(rising, falling))
    filters *= np.expand_dims(2.0 / (centres[2: n_mels + 2] - centres[:n_mels]), 0)
    return filters


class LogMelExtractor:
    """Whisper's log-mel features of one waveform as transformers' ``WhisperFeatureExtractor`` computes them with
    PyTorch (bitwise: a test compares them), from a ``preprocessor_config.json`` it accepts
    (:func:`load_feature_extractor`). The recipe is :func:`~rayspec.models.features.log_mel_power` (Radford et al.
    2022, arXiv:2212.04356, section 2.2).

    Attributes:
        feature_size: mel bins; sampling_rate: Hz; hop_length, n_fft: samples; chunk_length: the window in seconds;
        n_samples: samples per window; nb_max_frames: frames per window; mel_filters: float64
        ``[n_fft // 2 + 1, feature_size]`` (:func:`slaney_mel_filters` up to 8 kHz); dither: 0; padding_value: 0.
    """

    def __init__(self, feature_size: int = 80, sampling_rate: int = 16000, hop_length: int = 160,
                 chunk_length: int = 30, n_fft: int = 400) -> None:
        self.feature_size, self.sampling_rate = int(feature_size), int(sampling_rate)
        self.hop_length, self.chunk_length, self.n_fft = int(hop_length), int(chunk_length), int(n_fft)
        self.n_samples = self.chunk_length * self.sampling_rate
        self.nb_max_frames = self.n_samples // self.hop_length
        self.dither, self.padding_value = 0.0, 0.0
        self.mel_filters = slaney_mel_filters(1 + self.n_fft // 2, self.feature_size, self.sampling_rate, 8000.0)

    def __call__(self, raw_speech: np.ndarray, sampling_rate: Optional[int] = None, return_tensors: str = "np",
                 padding: str = "max_length", truncation: bool = True, max_length: Optional[int] = None) -> dict:
        """Features of one mono waveform: ``{"input_features": float32 [1, feature_size, frames]}``.

        Args:
            raw_speech: 1-D samples at :attr:`sampling_rate`; padding: ``"max_length"`` (zeros up to ``max_length``
                samples, default :attr:`n_samples`) or ``"longest"`` (no padding: one waveform); truncation: cut a
                longer waveform to ``max_length`` samples first; return_tensors: ``"np"`` (the only kind).

        Raises:
            ValueError: another sampling rate, a waveform that is not 1-D, another padding or tensor kind.
        """
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(f"the feature extractor takes {self.sampling_rate} Hz audio, not {sampling_rate} Hz")
        if padding not in ("max_length", "longest") or return_tensors not in ("np", None):
            raise ValueError(f"padding {padding!r} / return_tensors {return_tensors!r}: max_length or longest, np")
        wave = np.asarray(raw_speech, dtype=np.float32)
        if wave.ndim != 1:
            raise ValueError(f"one mono waveform expected, got shape {wave.shape}")
        limit = max_length or self.n_samples
        if truncation:
            wave = wave[:limit]
        if padding == "max_length" and len(wave) < limit:
            wave = np.pad(wave, (0, limit - len(wave)))
        import torch

        from .features import log_mel_power, window_and_filters

        window, filters = window_and_filters(self, "cpu")
        feats = log_mel_power(torch.from_numpy(wave)[None], self.n_fft, self.hop_length, window, filters)
        return {"input_features": feats.numpy()}


def load_feature_extractor(path: str) -> Optional[LogMelExtractor]:
    """``path/preprocessor_config.json``'s Whisper feature extractor as :class:`LogMelExtractor`, or None where
    transformers' must load it (no such file, another extractor, dither, normalisation, non-zero or left padding)."""
    c = _read_json(os.path.join(path, "preprocessor_config.json"))
    if c is None or c.get("feature_extractor_type") != "WhisperFeatureExtractor":
        return None
    if c.get("dither", 0.0) or c.get("do_normalize") or c.get("padding_value", 0.0) or \
            c.get("padding_side", "right") != "right" or c.get("return_attention_mask"):
        return None
    keys = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft")
    return LogMelExtractor(**{k: c[k] for k in keys if k in c})
