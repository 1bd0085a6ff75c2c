"""Encoder-decoder ASR adapter over transformers' Whisper family.

:class:`WhisperASR` loads ``WhisperForConditionalGeneration`` with its feature extractor, tokenizer and generation
config from a local directory (``from_pretrained(path)``), so an openai/whisper-* checkpoint directory runs unchanged,
and exposes what speculative decoders need:

* :meth:`WhisperASR.features` / :meth:`WhisperASR.encode`: log-mel features and encoder states of a padded batch;
* :meth:`WhisperASR.new_cache`: a :class:`~rayspec.models.cache.DecoderCache` with the cross-attention keys/values;
* :meth:`WhisperASR.decode`: the decoder over ``Q`` new tokens per row, at per-row positions, under a causal or token
  tree mask, returning logits and leaving the new keys/values pending in the cache.

The decoder forward is written here over the checkpoint's own modules (embeddings, projections, layer norms) because
transformers' caches hold one length for the whole batch, while speculative rows advance by different amounts.

Batch invariance. transformers' ``WhisperEncoder`` only takes exactly ``2 * max_source_positions`` frames and ignores
attention masks. Checkpoints trained that way (real Whisper) are run the same way: every utterance padded to the
fixed window (``encoder_masking = False``). Checkpoints trained by rayspec's recipes set ``rayspec_encoder_masking``
in their config: features are computed per utterance (``rayspec_frame_stack`` consecutive log-mel frames stacked
into one, and normalized per bin with the training statistics stored in the config, if any), the conv front-end output is zeroed past each utterance's length, and encoder
self-attention and decoder cross-attention mask padded positions. Either way an utterance's
result does not depend on its batch-mates.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..decoding.options import MEL_PADDINGS
from ..runner.attention import decode_attention
from .cache import DecoderCache, write_slots
from .errors import ModelLoadError
from .features import log_mel, stack_frames, supports
from . import invariant
from .linear import (REDUCTION_BLOCK, Float16RowLinear, Int8Linear, PackedLinear, linear, linear_in_blocks,
                     linear_layer, pack_linears, quantize_linears)
from .registry import cache_dir
from . import whisper_layers as layers
from .whisper_loading import load_parts
from ..spec_decode.timestamps import TimestampTokens
from .encoded import EncoderOutput


def _in_row_blocks(product, x: torch.Tensor) -> torch.Tensor:
    """``product`` (``[N, in]`` -> ``[N, out]``) over the rows of ``x`` ``[..., in]`` in blocks of at most
    :data:`ROW_BLOCK` rows: ``[..., out]``."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([product(r) for r in rows.split(ROW_BLOCK)])
    return out.reshape(*x.shape[:-1], out.shape[-1])


INT8_CACHE_FORMAT = 1
"""Version of the int8 weight cache (:meth:`WhisperASR.pack_for_inference`): raised whenever the quantization or the
fusion changes, so that older entries are not read."""


CPU_ENCODER_POSITIONS = 1500  # encoder positions per call on a CPU (see WhisperASR.encode)
SHORT_WINDOW_MARGIN_S = 2.0  # padding kept after a batch's longest row in a short encoder window (short_window)
SHORTLIST_TOKENS = 4096  # token ids whose logits bound a row's largest one in lazy greedy verification
ROW_BLOCK = 32
"""Most rows (batch x new tokens) per decoder product in batch-invariant decoding (:attr:`WhisperASR.batch_invariant`):
oneDNN's bfloat16 products round a row differently once more rows share the call (measured on whisper-base's decoder
shapes, 2 threads, an AMX host: every row count up to 32 gives a row its one-row result; 33 or 37 rows on, depending
on the weight, do not), so a verification pass over 16 rows x 9 tokens would not give a row what its one-token steps
give it."""
KEY_BLOCK = 64
"""Batch-invariant decoding (:attr:`WhisperASR.batch_invariant`) reads self-attention keys in blocks of this many
slots: a row's attention then sums over the same key count (its own, then masked ones that add exact zeros), whatever
the batch's longest row and the number of new tokens. Without it bfloat16's sums differ in the last bit between a
one-token step and a multi-token pass often enough to flip a greedy choice now and then."""


class WhisperASR:
    """A Whisper-architecture ASR model ready for batched (speculative) decoding.

    Args:
        model: a ``WhisperForConditionalGeneration``, or a decoder-only ``WhisperForCausalLM`` (a draft that reads
            its target's encoder states); eval mode unless training.
        feature_extractor: its ``WhisperFeatureExtractor`` (None for a decoder-only model).
        tokenizer: its Whisper tokenizer (for ``decode_text``); may be None for tokenizer-free uses.
        generation_config: the model's ``GenerationConfig`` (decoder prompt, EOS, suppress lists).
    """

    def __init__(self, model, feature_extractor, tokenizer, generation_config, name: str = "") -> None:
        self.model = model
        self._dtype = model.model.decoder.embed_tokens.weight.dtype
        self._decoder_only = not hasattr(model.model, "encoder")  # WhisperForCausalLM (before any release)
        self.feature_extractor = feature_extractor
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.name = name
        cfg = model.config
        self.config = cfg
        self.encoder_masking = bool(getattr(cfg, "rayspec_encoder_masking", False))
        self.frame_stack = int(getattr(cfg, "rayspec_frame_stack", 1))
        mean, std = getattr(cfg, "rayspec_feature_mean", None), getattr(cfg, "rayspec_feature_std", None)
        self.feature_mean = None if mean is None else torch.tensor(mean, dtype=model.dtype, device=model.device)[:, None]
        self.feature_std = None if std is None else torch.tensor(std, dtype=model.dtype, device=model.device)[:, None]
        self.num_heads = cfg.decoder_attention_heads
        self.head_dim = cfg.d_model // cfg.decoder_attention_heads
        self.max_target_positions = cfg.max_target_positions
        self.vocab_size = cfg.vocab_size
        gc = generation_config
        self.eos_token_id = int(gc.eos_token_id if gc.eos_token_id is not None else cfg.eos_token_id)
        self.prompt_ids = self.prompt_for()
        self.no_speech_token_id = self._no_speech_token()
        self.suppress_tokens = [t for t in (gc.suppress_tokens or []) if t < self.vocab_size]
        self.begin_suppress_tokens = [t for t in (gc.begin_suppress_tokens or []) if t < self.vocab_size]
        self._suppress = self._suppress_bias(self.suppress_tokens)
        self._begin_suppress = self._suppress_bias(self.begin_suppress_tokens)
        self._shortlist = None  # (what it was made from, weight [S, D], bias [S] or None): see shortlist_bound
        # A drafter's trained vocabulary (its config's rayspec_vocabulary): sorted token ids, or None for all of them
        ids = getattr(cfg, "rayspec_vocabulary", None)
        self.vocabulary = None if not ids else sorted({int(t) for t in ids if int(t) < self.vocab_size}
                                                      | {self.eos_token_id})
        self._readout = None  # (what it was made from, ids [S], weight [S, D], bias [S] or None): see readout_logits
        # the static-shape decoder step (rayspec.runner.static_step.StaticSteps) when one is attached: it owns
        # preallocated KV slots and, on CUDA, the captured graphs; None: every step runs at its own shapes
        self.static_steps = None
        self.int8 = False  # the linear layers run in int8 (pack_for_inference(int8=True))
        self._checkpoint = None  # the safetensors file from_pretrained loaded the weights from (int8 cache key)
        self._half_projection = None  # the output projection's Float16RowLinear when self.int8 (see project)
        self._on_cpu: Optional[bool] = None  # the device's type, read once (batch_invariant is read per product)

    @property
    def batch_invariant(self) -> bool:
        """Whether the decoder runs its batch-invariant arithmetic: a row's logits are bitwise the same whether it
        takes a one-token step or sits in a multi-token draft verification, and whatever the other rows' lengths, so
        every exact method equals ``ar`` at the same batch size. On for bfloat16 / float16 decoders on a CPU, where
        the kernels' last-bit differences are large enough to flip greedy choices: the decoder's products run in
        blocks of at most :data:`ROW_BLOCK` rows and :data:`~rayspec.models.linear.REDUCTION_BLOCK` inputs
        (:func:`~rayspec.models.linear.linear_in_blocks`; the packed decoder is packed in those input blocks),
        attention runs :func:`~rayspec.models.invariant.attention` over keys read in :data:`KEY_BLOCK` blocks.
        PyTorch's own kernels were row-invariant within those row blocks on an Intel Xeon with AMX but not on a 2-core
        AMD EPYC with AVX-512 BF16 and no AMX, where oneDNN's product over 2,048 inputs and the CPU flash attention
        rounded a row by the call's row count (``ctc-draft``, ``draft`` and ``medusa`` then matched ``ar`` on 96 of 99
        held-out clips; with these kernels 99/99: ``bench/methods-bf16``). float32 keeps PyTorch's kernels (the exact
        reference; its last-bit differences have not flipped a choice in the exactness tests). On too for int8
        decoders (:attr:`int8`), whose linear layers and output projection are batch-invariant by construction
        (:class:`~rayspec.models.linear.Int8Linear`, :class:`~rayspec.models.linear.Float16RowLinear`) and whose
        float32 attention runs in fixed blocks of query rows (:func:`~rayspec.models.invariant.attention`: PyTorch's
        float32 flash kernel, even given a second row for a one-token query, rounded a row by the call's row count on
        the AMD EPYC from 3 rows on, and a last-bit difference can move an activation across a rounding boundary of
        the next layer's int8 quantization)."""
        if not (self._dtype in (torch.bfloat16, torch.float16) or self.int8):
            return False
        if self._on_cpu is None:  # the model's device is found by walking its parameters: once, not per product
            self._on_cpu = self.device.type == "cpu"
        return self._on_cpu

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
        encoder_dtype: Optional[torch.dtype] = None, lean: bool = False,
    ) -> "WhisperASR":
        """Load model, feature extractor, tokenizer and generation config from a model name or local directory
        (:func:`~rayspec.models.registry.resolve_model`: ``whisper-base``, ``whisper-tiny.en``, a transformers
        ``save_pretrained`` directory, or a CTranslate2 / faster-whisper directory, converted once and cached).

        A ``WhisperForCausalLM`` checkpoint (a decoder that reads another model's encoder states, as distil-whisper's
        assistant decoders do) loads without a feature extractor: :attr:`has_encoder` is False and it can only
        decode over a target's :class:`~rayspec.models.encoded.EncoderOutput`. One whose config names ``rayspec_embedding_from`` (rayspec's
        draft decoders) takes its token embedding, tokenizer and generation config from that model.

        Raises:
            ModelLoadError: an unknown name, a model package missing or failing its checksum, a missing directory or
                files, or a tokenizer that loads empty (transformers returns an empty tokenizer instead of raising
                when files are missing offline).

        Args:
            dtype: the model's dtype (the decoder's: KV caches, logits); float32 is the exact reference.
            encoder_dtype: run the encoder in this dtype instead (e.g. bfloat16 on a CPU with AVX-512 BF16: features +
                encoder of Whisper base 116 vs 378 ms per utterance here, batch 1, 2 threads); its states are cast back to ``dtype`` for the decoder, so
                every method stays exact against AR at the same setting, while the transcript may differ from
                ``dtype``'s (a lossy compute type: measure its WER).
            lean: hold the weights in :mod:`rayspec.models.whisper_modules`' plain module tree (inference only: no
                ``generate()``, no training) and read the config, generation config, tokenizer and feature extractor
                with :mod:`rayspec.models.lean_files`, each where the checkpoint allows, else through transformers:
                seconds less start-up, as a checkpoint with the usual files loads without importing transformers.
        """
        parts = load_parts(path, device, dtype, encoder_dtype, lean)
        asr = cls(parts.model, parts.feature_extractor, parts.tokenizer, parts.generation_config, name=parts.name)
        asr._checkpoint = parts.checkpoint
        return asr

    @property
    def has_encoder(self) -> bool:
        """False for a decoder-only checkpoint (``WhisperForCausalLM``), which decodes over a target's encoder."""
        return not self._decoder_only

    @property
    def has_decoder(self) -> bool:
        """False once :meth:`release` freed the decoder (a drafter actor only encodes)."""
        return getattr(self.model.model, "decoder", None) is not None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype: the decoder's (features, encoder states and caches are handed over in it)."""
        return self._dtype

    @property
    def encoder_dtype(self) -> torch.dtype:
        """The dtype the encoder computes in (:attr:`dtype` unless loaded with ``encoder_dtype``)."""
        return self._half("encoder").conv1.weight.dtype

    @property
    def sample_rate(self) -> int:
        self._need_encoder()
        return int(self.feature_extractor.sampling_rate)

    def _need_encoder(self) -> None:
        if self._decoder_only:
            raise RuntimeError("a decoder-only checkpoint has no feature extractor or encoder: it reads its target's "
                               "encoder states")

    @property
    def frames_per_second(self) -> float:
        """Encoder input frames per second of audio (log-mel frames after stacking)."""
        return self.sample_rate / self.feature_extractor.hop_length / self.frame_stack

    @property
    def max_frames(self) -> int:
        """Input window of the encoder in log-mel frames (2 x ``max_source_positions``)."""
        return 2 * self.config.max_source_positions

    @property
    def max_audio_seconds(self) -> float:
        return self.max_frames / self.frames_per_second

    @property
    def multilingual(self) -> bool:
        """Whether the decoder prompt names a language and a task (multilingual checkpoints; ``*.en`` do not): the
        generation config's ``is_multilingual``, else openai/whisper's rule (a vocabulary of 51,865 ids or more)."""
        flag = getattr(self.generation_config, "is_multilingual", None)
        return bool(flag) if flag is not None else self.vocab_size >= 51865

    @functools.cached_property
    def languages(self) -> dict[str, int]:
        """Language code -> its token id (``{"en": 50259, ...}``): the generation config's ``lang_to_id``, else the
        ``<|code|>`` tokens the tokenizer has; empty for an English-only model. Computed once."""
        if not self.multilingual:
            return {}
        table = getattr(self.generation_config, "lang_to_id", None)
        if table:
            return {k.strip("<|>"): int(v) for k, v in table.items()}
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        ids = {code: self.tokenizer.convert_tokens_to_ids(f"<|{code}|>") for code in LANGUAGES} if self.tokenizer else {}
        return {c: i for c, i in ids.items() if isinstance(i, int) and i != self.tokenizer.unk_token_id}

    def _no_speech_token(self) -> Optional[int]:
        """Id of ``<|nospeech|>`` (``<|nocaptions|>`` in older vocabularies), or None if the tokenizer has neither."""
        if self.tokenizer is None:
            return None
        for token in ("<|nospeech|>", "<|nocaptions|>"):
            i = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(i, int) and i != self.tokenizer.unk_token_id and 0 <= i < self.vocab_size:
                return i
        return None

    def prompt_for(self, language: Optional[str] = None, task: str = "transcribe", timestamps: bool = False
                   ) -> list[int]:
        """Whisper's decoder prompt: ``<|startoftranscript|> [<|lang|> <|task|>] <|notimestamps|>``.

        Args:
            language: a language code ("en", "fr", ...) for multilingual models (default: the generation config's,
                else "en"); an English-only model takes None or "en".
            task: "transcribe" or "translate" (to English; multilingual models only).
            timestamps: decode with timestamp tokens: the prompt without ``<|notimestamps|>`` (the verify loop then
                applies Whisper's timestamp rules, :mod:`rayspec.spec_decode.timestamps`).

        Raises:
            ModelLoadError: a language or task this model does not have (e.g. "fr" on an English-only model).
        """
        gc = self.generation_config
        if task not in ("transcribe", "translate"):
            raise ModelLoadError(f"unknown task {task!r}: transcribe or translate")
        prompt = [int(gc.decoder_start_token_id)]
        if self.multilingual:
            lang = (language or (getattr(gc, "language", None) or "en")).strip("<|>")
            if lang not in self.languages:
                raise ModelLoadError(f"{self.name or 'the model'} has no language {lang!r}; it knows "
                                     f"{', '.join(sorted(self.languages))}")
            task_ids = getattr(gc, "task_to_id", None) or {t: self.tokenizer.convert_tokens_to_ids(f"<|{t}|>")
                                                          for t in ("transcribe", "translate")}
            prompt += [self.languages[lang], int(task_ids[task])]
        elif language not in (None, "en") or task != "transcribe":
            raise ModelLoadError(f"{self.name or 'the model'} is English-only: --language {language} --task {task} "
                                 "needs a multilingual model (e.g. whisper-base)")
        if timestamps and self.timestamp_tokens is None:
            raise ModelLoadError(f"{self.name or 'the model'} has no timestamp tokens")
        if getattr(gc, "no_timestamps_token_id", None) is not None and not timestamps:
            prompt.append(int(gc.no_timestamps_token_id))
        return prompt

    @functools.cached_property
    def timestamp_tokens(self):
        """The :class:`~rayspec.spec_decode.timestamps.TimestampTokens` of this vocabulary (timestamps follow
        ``<|notimestamps|>``, as in every Whisper vocabulary), or None for a model without them."""
        no_ts = getattr(self.generation_config, "no_timestamps_token_id", None)
        if no_ts is None or int(no_ts) + 1 >= self.vocab_size:
            return None
        return TimestampTokens(int(no_ts), int(no_ts) + 1, self.eos_token_id, self.vocab_size)

    def no_speech_probability(self, sot_logits: torch.Tensor) -> Optional[torch.Tensor]:
        """Float32 ``[B]`` probability of ``<|nospeech|>`` at ``<|startoftranscript|>`` (openai/whisper's
        ``no_speech_prob``: softmax of the raw logits, before suppression), from ``sot_logits`` ``[B, V]``; None for
        a vocabulary without that token."""
        i = self.no_speech_token_id
        return None if i is None else torch.softmax(sot_logits.float(), dim=-1)[:, i]

    @torch.inference_mode()
    def detect_language(self, enc: EncoderOutput, task: str = "transcribe") -> tuple[list[str], list[list[int]]]:
        """Each row's most likely language from one decoder pass over ``<|startoftranscript|>`` (openai/whisper's
        ``detect_language``: the argmax of the language tokens' logits at that position).

        Args:
            enc: the rows' encoder output (``B`` rows).

        Returns:
            ``(codes, prompts)``: ``B`` language codes and the ``B`` decoder prompts with them and ``task``.

        Raises:
            ModelLoadError: an English-only model (it has no language tokens).
        """
        if not self.multilingual:
            raise ModelLoadError(f"{self.name or 'the model'} is English-only: --language auto needs a multilingual "
                                 "model")
        codes, ids = zip(*self.languages.items())
        cache = self.new_cache(enc, 1)
        sot = torch.full((enc.states.shape[0], 1), int(self.generation_config.decoder_start_token_id),
                         dtype=torch.long, device=self.device)
        logits = self.decode(cache, sot)[:, 0]  # [B, V]
        best = logits[:, torch.tensor(ids, device=self.device)].argmax(-1).tolist()
        found = [codes[i] for i in best]
        return found, [self.prompt_for(c, task) for c in found]

    def _suppress_bias(self, tokens: Sequence[int]) -> Optional[torch.Tensor]:
        if not tokens:
            return None
        bias = torch.zeros(self.vocab_size, dtype=self.dtype, device=self.device)
        bias[list(tokens)] = float("-inf")
        return bias

    # ------------------------------------------------------------------ encoder
    def features(self, audios: Sequence[np.ndarray], map_fn=map, mel_padding: str = "silence"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features of a batch, each utterance computed on its own (so padding never leaks into them).

        Args:
            audios: float32 mono waveforms at :attr:`sample_rate` Hz.
            map_fn: maps the per-utterance computation over ``audios`` (e.g. a thread pool's ``map``).
            mel_padding: a fixed-window model's window after the audio (:data:`~rayspec.decoding.options.
                MEL_PADDINGS`): "silence", the log-mel of the audio padded with silence to the window (transformers'
                ``WhisperFeatureExtractor``); "zeros", those features with every frame from the audio's end on
                (``samples // hop_length``) set to 0, as openai/whisper's ``transcribe()`` (its window of
                ``log_mel_spectrogram(audio, padding=N_SAMPLES)`` cut to the audio's frames, then ``pad_or_trim``)
                and faster-whisper fill it. Masking models ignore it (their padding is masked).

        Returns:
            ``(features, frame_lengths)``: features ``[B, n_mels * frame_stack, T]`` in the model dtype (``T`` in
            stacked frames, see :func:`~rayspec.models.features.stack_frames`), zero-padded to the longest
            row (masking models) or to :attr:`max_frames` (fixed-window models); frame_lengths int64 ``[B]``, the
            real (unpadded) frames of each row.

        Raises:
            ValueError: an utterance longer than :attr:`max_audio_seconds`, or an unknown ``mel_padding``.
        """
        self._need_encoder()
        if mel_padding not in MEL_PADDINGS:
            raise ValueError(f"unknown mel_padding {mel_padding!r}: {' or '.join(MEL_PADDINGS)}")
        feats, lengths = self._features(audios, map_fn)
        if mel_padding == "zeros" and not self.encoder_masking:
            hop = self.feature_extractor.hop_length * self.frame_stack
            for i, audio in enumerate(audios):
                feats[i, :, len(audio) // hop :] = 0
        return feats, lengths

    def _features(self, audios: Sequence[np.ndarray], map_fn) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`features` with ``mel_padding`` "silence"."""
        fe = self.feature_extractor
        for audio in audios:
            if len(audio) > self.max_audio_seconds * self.sample_rate:
                raise ValueError(
                    f"audio of {len(audio) / self.sample_rate:.1f} s exceeds the model's {self.max_audio_seconds:.1f} s"
                )
        if self.device.type == "cuda" and not self.encoder_masking and self.frame_stack == 1 and supports(fe):
            return self.features_on_device(audios)
        padding = dict(padding="longest", truncation=False) if self.encoder_masking else dict(padding="max_length")

        def one(audio):
            out = fe(audio, sampling_rate=self.sample_rate, return_tensors="np", **padding)
            return stack_frames(out["input_features"][0], self.frame_stack)

        feats = list(map_fn(one, audios))
        # Real frames per row; fixed-window features are padded to the window, their real length is the audio's.
        lengths = [f.shape[1] for f in feats] if self.encoder_masking else self._window_frames(audios)
        width = max(lengths) if self.encoder_masking else self.max_frames
        batch = np.zeros((len(feats), feats[0].shape[0], width), dtype=np.float32)
        for i, f in enumerate(feats):
            batch[i, :, : f.shape[1]] = f
        return (
            torch.from_numpy(batch).to(self.device, self.dtype),
            torch.tensor(lengths, dtype=torch.long, device=self.device),
        )

    def features_on_device(self, audios: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`features` of a fixed-window model computed on its device, the batch at once
        (:func:`~rayspec.models.features.log_mel`: ``torch.stft``); what :meth:`features` runs on a CUDA device.
        Same result to float32 rounding; lengths as :meth:`features`'. A CPU keeps the extractor's per-utterance
        path (no faster there)."""
        feats = log_mel(self.feature_extractor, audios, self.device)
        return feats.to(self.dtype), torch.tensor(self._window_frames(audios), dtype=torch.long, device=self.device)

    def _window_frames(self, audios: Sequence[np.ndarray]) -> list[int]:
        """Real (unpadded) frames of each waveform's fixed-window features: ``ceil(samples / (hop_length *
        frame_stack))``, at most :attr:`max_frames` (the window)."""
        hop = self.feature_extractor.hop_length * self.frame_stack
        return [min(self.max_frames, -(-len(a) // hop)) for a in audios]

    def encode(self, features: torch.Tensor, frame_lengths: torch.Tensor) -> EncoderOutput:
        """Run the encoder over a padded batch.

        On a CPU the batch runs in slices of at most :data:`CPU_ENCODER_POSITIONS` encoder positions (one 30 s
        window of a stock Whisper): a CPU gains nothing from more rows per matrix product once a row has 1,500
        positions, and the larger activations fall out of its caches (whisper-tiny.en, 1 thread, 16 windows:
        0.65 s per window one at a time, 0.87 s as one batch of 16). The rows' results do not depend on the slicing.

        Args:
            features: ``[B, n_mels, T]`` log-mel features (``T`` = :attr:`max_frames` for fixed-window models, or
                fewer: :meth:`short_window`).
            frame_lengths: int64 ``[B]``, real frames per row.

        Returns:
            :class:`~rayspec.models.encoded.EncoderOutput` with ``ceil(T / 2)`` positions. Dropout applies when the model is in train mode.
        """
        b, t = features.shape[0], features.shape[-1]
        rows = max(1, CPU_ENCODER_POSITIONS // max(1, (t + 1) // 2))
        if self.device.type != "cpu" or rows >= b or torch.is_grad_enabled():
            return self._encode(features, frame_lengths)
        parts = [self._encode(features[s : s + rows], frame_lengths[s : s + rows]) for s in range(0, b, rows)]
        return EncoderOutput(torch.cat([p.states for p in parts]), torch.cat([p.lengths for p in parts]),
                             parts[0].masked)

    def _encode(self, features: torch.Tensor, frame_lengths: torch.Tensor) -> EncoderOutput:
        enc = self._half("encoder")
        edt = enc.conv1.weight.dtype
        t = features.shape[-1]
        if not self.encoder_masking:
            # the whole window, or a short one (short_window): no mask either way
            states = self._encoder_layers(enc, features.to(edt))
            # The decoder attends to the whole window (as the checkpoint was trained); ``lengths`` still counts the
            # real positions, so frame-level consumers (the CTC gate) skip the padding.
            real = ((frame_lengths + 1) // 2).clamp(max=states.shape[1])
            return EncoderOutput(states, real, masked=False)
        frame_mask = (torch.arange(t, device=features.device)[None, :] < frame_lengths[:, None]).to(features.dtype)
        if self.feature_mean is not None:  # global per-mel-bin normalization (training statistics); padding -> 0
            features = (features - self.feature_mean) / self.feature_std * frame_mask[:, None, :]
        lengths = (frame_lengths + 1) // 2
        return EncoderOutput(self._encoder_layers(enc, features.to(edt), frame_mask.to(edt), lengths), lengths,
                             masked=True)

    def _encoder_layers(self, enc, features: torch.Tensor, frame_mask: Optional[torch.Tensor] = None,
                        lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The encoder run layer by layer: features ``[B, n_mels, T]`` in the encoder's dtype -> states
        ``[B, ceil(T / 2), D]`` in the model dtype. With ``frame_mask`` ``[B, T]`` and ``lengths`` int64 ``[B]`` (masked
        models) padded frames are zeroed after the first convolution and padded positions masked in attention;
        without them every position is seen (a stock Whisper, its whole window or a short one)."""
        x = F.gelu(enc.conv1(features))
        if frame_mask is not None:
            x = x * frame_mask[:, None, :]
        x = F.gelu(enc.conv2(x)).permute(0, 2, 1)
        s = x.shape[1]
        # contiguous [B, S, D]: the sum would keep the permuted strides, and every later residual sum follows its
        # input's, so each product would copy its input and no residual add could run as the product's post-op
        # (whisper-base, 2 threads: ~12% of the float32 encoder window, ~8% of the bfloat16 one; the same values)
        x = F.dropout((x + enc.embed_positions.weight[:s]).contiguous(), p=enc.dropout, training=enc.training)
        bias = None
        if lengths is not None:
            keep = torch.arange(s, device=x.device)[None, :] < lengths[:, None]
            bias = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, torch.finfo(x.dtype).min)
            bias = bias[:, None, None, :]
        for layer in enc.layers:
            x = layers.encoder_layer(layer, x, bias)
        return layers.layer_norm(enc.layer_norm, x).to(self.dtype)

    def short_window(self, features: torch.Tensor, frame_lengths: torch.Tensor, min_seconds: float) -> torch.Tensor:
        """Cut fixed-window features to a shorter encoder window (lossy; whisper.cpp's ``audio_ctx``, chosen per
        batch): the batch's longest row plus :data:`SHORT_WINDOW_MARGIN_S` of its padding, at least ``min_seconds``,
        rounded up to whole seconds, at most the model's window. The encoder's cost falls with the window (its
        attention quadratically); the model, trained on 30 s windows, may transcribe differently: in a 3 s window
        Whisper base repeated a 1.9 s LJSpeech clip's text to the token cap, and in 10 s windows it misheard
        speechocean762's 2-5 s sentences far more often than in 30 s ones (docs/benchmarks/whisper.md, "Short encoder
        window").

        Args:
            features: ``[B, n_mels, T]`` from :meth:`features`; frame_lengths: int64 ``[B]``, real frames per row.
            min_seconds: the shortest window in seconds; 0 leaves the features as they are.

        Returns:
            ``features[..., :T']`` (a view), or ``features`` for ``min_seconds <= 0`` or a masking model (whose
            features are already cut to the longest row).
        """
        if min_seconds <= 0 or self.encoder_masking:
            return features
        fps = self.frames_per_second
        longest = float(frame_lengths.max()) / fps
        seconds = math.ceil(max(min_seconds, longest + SHORT_WINDOW_MARGIN_S))
        return features[..., : min(features.shape[-1], int(seconds * fps))]

    # ------------------------------------------------------------------ decoder
    def new_cache(self, encoder_output: EncoderOutput, capacity: int, cross: bool = True,
                  shared: bool = False) -> DecoderCache:
        """An empty decoder cache for a batch, with cross-attention keys/values precomputed.

        Args:
            encoder_output: from :meth:`encode`.
            capacity: most decoder positions any row will hold (prompt + tokens + pending draft positions).
            cross: False leaves the cross-attention keys/values uncomputed (uninitialised memory) for
                :meth:`fill_cross` to fill, row by row, before a row is decoded: a draft that will draft for few of
                the rows (``--speculate-max-rows``) computes them for those rows only.
            shared: with ``encoder_output.cross`` (see :class:`~rayspec.models.encoded.EncoderOutput`), use the kept keys/values themselves
                rather than copies: for a caller that never drops, moves or writes rows of the cache.
        """
        if self.static_steps is not None:  # KV slots of the static-shape step, when free and large enough
            cache = self.static_steps.new_cache(encoder_output, capacity, cross)
            if cache is not None:
                return cache
        dec = self._half("decoder")
        states = encoder_output.states
        b, s, _ = states.shape
        if self.batch_invariant:  # whole key blocks (see attention_layout's key_block)
            capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        cross_k, cross_v, self_k, self_v = [], [], [], []
        memo = encoder_output.cross if cross else None
        if memo is not None and id(self) not in memo:
            memo[id(self)] = [self.cross_attention_kv(states, i) for i in range(len(dec.layers))]
        for i in range(len(dec.layers)):
            if memo is not None:  # the decoder drops and moves cache rows in place: it gets copies
                k, v = memo[id(self)][i] if shared else (t.clone() for t in memo[id(self)][i])
            elif cross:
                k, v = self.cross_attention_kv(states, i)
            else:
                k, v = (states.new_empty((b, self.num_heads, s, self.head_dim)) for _ in range(2))
            cross_k.append(k)
            cross_v.append(v)
            self_k.append(states.new_zeros((b, self.num_heads, capacity, self.head_dim)))
            self_v.append(states.new_zeros((b, self.num_heads, capacity, self.head_dim)))
        cross_mask, real = None, None
        if encoder_output.masked:
            real = encoder_output.lengths.tolist()  # the one device read per batch: rows' real encoder positions
            if min(real) < s:
                cross_mask = (torch.arange(s, device=states.device)[None, :] < encoder_output.lengths[:, None])[
                    :, None, None, :
                ]
        return DecoderCache.empty(self_k, self_v, cross_k, cross_v, cross_mask, states.device, real)

    def fill_cross(self, cache: DecoderCache, rows: Sequence[int], states: torch.Tensor) -> None:
        """Compute the cross-attention keys/values of cache rows ``rows`` (``[R]`` host indices) from their encoder
        states ``[R, S', D]`` (``S'`` at most the cache's encoder positions) and write them in place (a cache made
        with ``new_cache(..., cross=False)``)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=cache.device)
        for i, (ck, cv) in enumerate(zip(cache.cross_k, cache.cross_v)):
            k, v = self.cross_attention_kv(states, i)
            ck[:, :, : states.shape[1]].index_copy_(0, index, k.to(ck.dtype))
            cv[:, :, : states.shape[1]].index_copy_(0, index, v.to(cv.dtype))

    def cross_attention_kv(self, states: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``layer``'s cross-attention keys and values of encoder states ``[B, S, D]``: two contiguous
        ``[B, H, S, Dh]`` tensors in the decoder's dtype (what :meth:`new_cache` holds per layer)."""
        attn = self._half("decoder").layers[layer].encoder_attn
        # contiguous [B, H, S, Dh]: attention of a few new tokens over S positions reads the keys/values of
        # one head as one block (tiny.en, batch 8, 1,500 positions: 0.93 vs 1.94 ms per layer as a strided view)
        k, v = layers.cross_inputs(attn, states)
        return self._heads(k).contiguous(), self._heads(v).contiguous()

    def decode(
        self,
        cache: DecoderCache,
        tokens: torch.Tensor,
        ancestors: Optional[torch.Tensor] = None,
        depths: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """:meth:`decode_hidden`, then the output projection: float logits ``[B, Q, V]`` (suppress lists not
        applied; see :meth:`suppress`). Arguments and errors as :meth:`decode_hidden`."""
        return self.project(self.decode_hidden(cache, tokens, ancestors, depths))

    def decode_hidden(
        self,
        cache: DecoderCache,
        tokens: torch.Tensor,
        ancestors: Optional[torch.Tensor] = None,
        depths: Optional[torch.Tensor] = None,
        hidden_from: int = 0,
        cross_heads: Optional[dict[int, list[int]]] = None,
        cross_out: Optional[list] = None,
    ) -> torch.Tensor:
        """Run the decoder over ``Q`` new tokens per row; their keys/values become pending in ``cache``.

        New token ``i`` of row ``b`` sits at decoder position ``cache.lengths[b] + depths[i]`` and attends to the
        row's committed positions plus the new tokens ``j`` with ``ancestors[i, j]`` (itself included). A chain is
        the default (``ancestors`` lower-triangular, ``depths = arange(Q)``); a token tree gives each node its
        root-path (SpecInfer's tree attention, SpecASR IV.C). Padding tokens past a row's real ones are harmless:
        nothing real attends to them and :meth:`DecoderCache.commit` drops them.

        Args:
            cache: from :meth:`new_cache`; must have no pending positions.
            tokens: int64 ``[B, Q]``.
            ancestors: bool ``[Q, Q]`` or ``[B, Q, Q]``; default causal.
            depths: int64 ``[Q]`` or ``[B, Q]``; default ``arange(Q)``.
            hidden_from: return the states of new tokens ``hidden_from ..`` only.
            cross_heads, cross_out: ``{layer: [head, ...]}``; for each such layer (in order) the cross-attention
                logits of those heads (scaled query . key, before the softmax; float ``[B, h, Q, S]``) are appended to
                the list ``cross_out`` (word timestamps read the alignment heads, :mod:`rayspec.timing`).

        Returns:
            Float ``[B, Q - hidden_from, D]``: the last decoder layer's states after the final layer norm, what the
            output projection (:meth:`project`) reads.

        Raises:
            ValueError: the cache has pending positions, or positions beyond its capacity.
        """
        if cross_heads is None and self.static_steps is not None and self.static_steps.accepts(cache, tokens.shape):
            return self.static_steps.decode_hidden(cache, tokens, ancestors, depths, hidden_from)
        q = tokens.shape[1]
        # Callers cap real tokens below max_target_positions; only padding may reach past it, and is clamped.
        positions, slots, top, visible = cache.attention_layout(q, ancestors, depths, self.max_target_positions,
                                                                KEY_BLOCK if self.batch_invariant else 1)
        cross_k, cross_v, cross_mask = cache.cross()
        with decode_attention(tokens.device):
            hidden = self.decoder_layers(tokens, positions, slots, visible, cache.self_k, cache.self_v, top, cross_k,
                                         cross_v, cross_mask, cross_heads, cross_out)
        cache.pending = q
        return hidden[:, hidden_from:]

    def decoder_layers(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       visible: torch.Tensor, self_k: list[torch.Tensor], self_v: list[torch.Tensor], top: int,
                       cross_k: list[torch.Tensor], cross_v: list[torch.Tensor],
                       cross_mask: Optional[torch.Tensor], cross_heads: Optional[dict[int, list[int]]] = None,
                       cross_out: Optional[list] = None) -> torch.Tensor:
        """The decoder's layers over new tokens at given positions, shapes fixed by the arguments alone (no device
        read, no branch on tensor values): what :meth:`decode_hidden` and the static-shape step
        (:mod:`rayspec.runner.static_step`) run.

        Args:
            tokens, positions, slots: int64 ``[B, Q]``: the new tokens, their decoder positions and the key/value
                slots they are written to (:func:`~rayspec.models.cache.write_slots` into ``self_k`` / ``self_v``, in
                place).
            visible: bool ``[B, 1, Q, top]``, which key slots each new token attends to.
            self_k, self_v: per layer ``[B, H, C, Dh]`` self-attention keys/values (``C >= top``).
            cross_k, cross_v: per layer ``[B, H, S, Dh]``; cross_mask: bool ``[B, 1, 1, S]`` or None.
            cross_heads, cross_out: as :meth:`decode_hidden` (the alignment heads' cross-attention logits).

        Returns:
            Float ``[B, Q, D]``, the last layer's states after the final layer norm.
        """
        dec = self._half("decoder")
        x = dec.embed_tokens(tokens) * dec.embed_scale + dec.embed_positions.weight[positions]
        x = layers.apply_dropout(x, dec.dropout, dec.training)
        # Layers are run through their weights (linear_layer / F.layer_norm), not their modules' __call__: the same
        # arithmetic, without the module-call overhead that dominates a CPU decoder step of a small model at batch 1,
        # and with the products through packed weights on a CPU (rayspec.models.linear).
        for i, layer in enumerate(dec.layers):
            attn = layer.self_attn
            qh, kh, vh = layers.attention_inputs(attn, layers.layer_norm(layer.self_attn_layer_norm, x), self._linear)
            qh = self._heads(qh * attn.scaling)
            write_slots(self_k[i], slots, self._heads(kh))
            write_slots(self_v[i], slots, self._heads(vh))
            k = self_k[i][:, :, :top]
            v = self_v[i][:, :, :top]
            drop = layer.dropout if layer.training else 0.0
            x = self._attend(attn, qh, k, v, visible, residual=x, dropout=drop)

            cross = layer.encoder_attn
            h = layers.layer_norm(layer.encoder_attn_layer_norm, x)
            qh = self._heads(self._linear(cross.q_proj, h) * cross.scaling)
            if cross_heads is not None and i in cross_heads:
                pick = torch.tensor(cross_heads[i], device=qh.device)
                cross_out.append(qh.index_select(1, pick) @ cross_k[i].index_select(1, pick).transpose(-1, -2))
            x = self._attend(cross, qh, cross_k[i], cross_v[i], cross_mask, residual=x, dropout=drop)

            h = self._activation_product(layer, layers.layer_norm(layer.final_layer_norm, x))
            h = layers.apply_dropout(h, layer.activation_dropout, layer.training)
            x = self._add_product(layer.fc2, h, x, drop)
        return layers.layer_norm(dec.layer_norm, x)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, q, _ = x.shape
        return x.view(b, q, self.num_heads, self.head_dim).transpose(1, 2)

    def _attend(self, attn, q, k, v, mask, residual: Optional[torch.Tensor] = None, dropout: float = 0.0
                ) -> torch.Tensor:
        """Attention of ``q`` ``[B, H, N, Dh]`` over ``k``, ``v`` ``[B, H, S, Dh]`` (``mask``: bool, broadcast to
        ``[B, H, N, S]``, or None) through ``attn.out_proj``: ``[B, N, D]``; with ``residual`` ``[B, N, D]``:
        ``residual + dropout(that)`` (:meth:`_add_product`). Row-invariant attention where :attr:`batch_invariant`
        (:func:`~rayspec.models.invariant.attention`; an int8 decoder's in float32), else PyTorch's."""
        p = attn.dropout if attn.training else 0.0
        n = q.shape[2]
        if self.batch_invariant and not p:
            out = invariant.attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0)
        out = out.transpose(1, 2).reshape(out.shape[0], n, -1)
        if residual is None:
            return self._linear(attn.out_proj, out)
        return self._add_product(attn.out_proj, out, residual, dropout)

    @property
    def _row_blocked(self) -> bool:
        """Whether the decoder's products run in row and input blocks (:meth:`_linear`): a :attr:`batch_invariant`
        decoder not in int8 (whose products are exact integer sums)."""
        return self.batch_invariant and not self.int8

    def _add_product(self, layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor, dropout: float = 0.0
                     ) -> torch.Tensor:
        """``residual + dropout(self._linear(layer, x))``: :func:`~rayspec.models.whisper_layers.add_product` where the
        products are not row-blocked."""
        if self._row_blocked:
            return residual + layers.apply_dropout(self._linear(layer, x), dropout, True)
        return layers.add_product(layer, x, residual, dropout)

    def _activation_product(self, layer, h: torch.Tensor) -> torch.Tensor:
        """``layer.activation_fn(self._linear(layer.fc1, h))`` of a decoder layer: the module's
        :func:`~rayspec.models.whisper_layers.activation_product` where the products are not row-blocked."""
        if self._row_blocked:
            return layer.activation_fn(self._linear(layer.fc1, h))
        return layers.activation_product(layer, h)

    def _linear(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A decoder product, :func:`~rayspec.models.linear.linear_layer` (``[..., in]`` -> ``[..., out]``), in blocks
        of at most :data:`ROW_BLOCK` rows and :data:`~rayspec.models.linear.REDUCTION_BLOCK` inputs where the decoder
        is :attr:`_row_blocked` (an int8 decoder's products are row-invariant by construction)."""
        if not self._row_blocked:
            return linear_layer(layer, x)
        if x.numel() > ROW_BLOCK * x.shape[-1]:
            return _in_row_blocks(lambda rows: linear_in_blocks(layer, rows), x)
        return linear_in_blocks(layer, x)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output projection: decoder hidden states ``[..., D]`` -> logits ``[..., V]`` in the model's dtype.

        Through :func:`~rayspec.models.linear.linear`: on a CPU without autograd the ``[V, D]`` weight is read in
        oneDNN's packed layout, at about the same cost for 1 to 16 rows (whisper-base, 51,865 x 512, 2 threads:
        4.3 ms for one row, 4.5 ms for 10; MKL on the stored weight: 9.8 and 21.7 ms). A :attr:`batch_invariant`
        decoder projects at most :data:`ROW_BLOCK` rows per product (oneDNN's bfloat16 product over this weight
        rounds a row otherwise from 37 rows on). An int8 model (:attr:`int8`) projects through a float16 copy of the
        weight, row by row (:class:`~rayspec.models.linear.Float16RowLinear`: half float32's bytes to read per step).
        """
        if self._half_projection is not None:  # batch-invariant by construction
            return self._half_projection(hidden)
        proj = self.model.proj_out
        if self.batch_invariant and hidden.numel() > ROW_BLOCK * hidden.shape[-1]:
            return _in_row_blocks(lambda rows: linear(rows, proj.weight, proj.bias), hidden)
        return linear(hidden, proj.weight, proj.bias)

    def token_logits(self, hidden: torch.Tensor, tokens: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The logits of given tokens alone, suppression applied (what ``suppress(project(hidden), first)`` holds at
        ``tokens``, up to the rounding of another order of summation): hidden ``[..., D]``, tokens int64 ``[...]``,
        first bool ``[...]`` (``begin_suppress_tokens`` apply) -> float ``[...]``."""
        proj = self.model.proj_out
        out = (hidden * proj.weight[tokens]).sum(-1)
        if proj.bias is not None:
            out = out + proj.bias[tokens]
        if self._suppress is not None:
            out = out + self._suppress[tokens]
        if self._begin_suppress is not None:
            out = torch.where(first, out + self._begin_suppress[tokens], out)
        return out

    def timestamp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the timestamp tokens alone (no suppression): hidden ``[..., D]`` -> float ``[..., T]``, a
        ``T``-row slice of the output projection (whisper-base: 1,501 of 51,865 rows).

        Raises:
            RuntimeError: a model without timestamp tokens.
        """
        tt = self.timestamp_tokens
        if tt is None:
            raise RuntimeError(f"{self.name or 'this model'} has no timestamp tokens")
        proj = self.model.proj_out
        return F.linear(hidden, proj.weight[tt.begin:], None if proj.bias is None else proj.bias[tt.begin:])

    def shortlist_bound(self, hidden: torch.Tensor) -> torch.Tensor:
        """A lower bound of each row's largest suppressed logit, from a fraction of the projection: the largest
        logit over the first :data:`SHORTLIST_TOKENS` token ids (BPE ids are in merge order, so the common tokens
        come first) that neither suppress list bans, timestamp tokens excluded. hidden ``[..., D]`` -> float ``[...]``. Greedy verification uses
        it to skip the full projection where a draft token cannot be the argmax
        (:func:`rayspec.spec_decode.acceptance.score_greedy_lazily`)."""
        proj = self.model.proj_out
        key = (proj.weight, self._suppress, self._begin_suppress)
        if self._shortlist is None or any(a is not b for a, b in zip(self._shortlist[0], key)):
            banned = torch.zeros(self.vocab_size, dtype=torch.bool, device=proj.weight.device)
            for bias in key[1:]:
                if bias is not None:
                    banned |= torch.isinf(bias)
            tt = self.timestamp_tokens  # timestamps are left out: the timestamp rules ban them at most positions
            ids = torch.arange(min(SHORTLIST_TOKENS, self.vocab_size if tt is None else tt.begin), device=banned.device)
            ids = ids[~banned[ids]]
            self._shortlist = (key, proj.weight[ids].contiguous(),
                               None if proj.bias is None else proj.bias[ids].contiguous())
        _, weight, bias = self._shortlist
        return linear(hidden, weight, bias).amax(-1)

    def readout_logits(self, hidden: torch.Tensor, first: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Suppressed logits over :attr:`vocabulary` alone, from an ``[S, D]`` product
        instead of the ``[V, D]`` one: a drafter's readout over the tokens it was trained to propose (FR-Spec: Zhao et
        al. 2025, arXiv:2502.14856, section 3.2, a draft's output layer cut to a frequency-ranked vocabulary; here the
        tokens of the target's transcripts of the drafter's training audio). The projection is memory-bound for a few
        rows on a CPU, so its cost falls with ``S`` (whisper-base: 51,865 rows, 106 MB in float32).

        Args:
            hidden: float ``[R, D]``; first: bool ``[R]`` on the host, where ``begin_suppress_tokens`` apply.

        Returns:
            (logits float ``[R, S]``, ids int64 ``[S]``: the token id of each logit column).

        Raises:
            ValueError: the model has no :attr:`vocabulary`.
        """
        if self.vocabulary is None:
            raise ValueError(f"{self.name or 'this model'} lists no vocabulary of its own (rayspec_vocabulary)")
        proj = self.model.proj_out
        key = (proj.weight, proj.bias, self.vocabulary)
        if self._readout is None or any(a is not b for a, b in zip(self._readout[0], key)):
            ids = torch.tensor(self.vocabulary, dtype=torch.long, device=proj.weight.device)
            self._readout = (key, ids, proj.weight[ids].contiguous(), None if proj.bias is None else proj.bias[ids])
        _, ids, weight, bias = self._readout
        return self.suppress(linear(hidden, weight, bias), first, ids), ids

    def suppressed_logits(self, hidden: torch.Tensor, first: torch.Tensor | np.ndarray | bool = False) -> torch.Tensor:
        """``suppress(project(hidden), first)``: hidden ``[..., D]`` -> logits ``[..., V]``. Where the projection is one
        float product of a weight without a bias (a float32 CPU decoder, not :attr:`batch_invariant`, not int8), the
        suppress list is that product's bias: the same numbers (adding 0 or -inf to a sum is exact wherever it is
        done) without another pass over the logits."""
        proj = self.model.proj_out
        if (self._suppress is None or proj.bias is not None or self._half_projection is not None or self.batch_invariant
                or hidden.device.type != "cpu"):
            return self.suppress(self.project(hidden), first)
        return self.suppress(linear(hidden, proj.weight, self._suppress), first, listed=True)

    def suppress(self, logits: torch.Tensor, first: torch.Tensor | np.ndarray | bool = False,
                 ids: Optional[torch.Tensor] = None, listed: bool = False) -> torch.Tensor:
        """Apply Whisper's suppress lists to logits ``[..., V]`` (returns a new tensor, or ``logits`` where nothing
        applies).

        Args:
            first: where the position is the first generated token (``begin_suppress_tokens`` apply): a bool, a
                numpy bool array (checked on the host) or a bool tensor (checked with one device read), broadcastable
                to ``logits.shape[:-1]``.
            ids: int64 ``[S]``, the token id of each column when ``logits`` ``[..., S]`` cover only those tokens (a
                readout over :attr:`vocabulary`); None: all ``V``.
            listed: the ``suppress_tokens`` list is already applied (:meth:`suppressed_logits`): begin-suppression
                only.
        """
        suppress, begin = (None if listed else self._suppress), self._begin_suppress
        if ids is not None:
            suppress, begin = (None if b is None else b[ids] for b in (suppress, begin))
        if suppress is not None:
            logits = logits + suppress
        if begin is not None:
            if isinstance(first, torch.Tensor):
                any_first = bool(first.any())
            else:
                any_first = bool(np.any(first))
                first = torch.as_tensor(first).to(logits.device, non_blocking=True)
            if any_first:
                logits = torch.where(first[..., None], logits + begin, logits)
        return logits

    def set_ignore_eos(self, ignore: bool) -> None:
        """Ban or allow EOS (vLLM's ``ignore_eos``). With EOS banned every row generates exactly its token cap, so a
        throughput benchmark makes every engine emit the same number of tokens per utterance."""
        self._suppress = self._suppress_bias(self.suppress_tokens + ([self.eos_token_id] if ignore else []))

    def release(self, part: str) -> None:
        """Free the weights of the half this process never runs: "encoder" (a target actor only decodes) or
        "decoder" (a drafter actor only encodes). A real Whisper large-v3 holds 0.6B encoder + 0.9B decoder
        parameters, so on separate GPUs each actor keeps about half.

        Raises:
            ValueError: ``part`` is neither "encoder" nor "decoder".
        """
        if part == "encoder":
            self.model.model.encoder = None
        elif part == "decoder":
            self.model.model.decoder = None
            self.model.proj_out = None  # tied to the decoder's token embedding
        else:
            raise ValueError(f"part must be 'encoder' or 'decoder', not {part!r}")

    def _half(self, part: str):
        module = getattr(self.model.model, part, None)
        if module is None:
            why = "does not exist (a decoder-only checkpoint reads its target's encoder states)" if (
                self._decoder_only and part == "encoder") else "was released (it runs on another actor)"
            raise RuntimeError(f"this model's {part} {why}")
        return module

    def _pack_linears(self) -> int:
        """:func:`~rayspec.models.linear.pack_linears` over the model, the decoder's in blocks of
        :data:`~rayspec.models.linear.REDUCTION_BLOCK` inputs where its products are row-blocked; returns how many
        layers were packed."""
        decoder = getattr(self.model.model, "decoder", None)
        blocks = REDUCTION_BLOCK if self._row_blocked else None
        if decoder is None or blocks is None:
            return pack_linears(self.model.model)
        return pack_linears(decoder, blocks) + pack_linears(self.model.model)

    def decode_text(self, ids: Sequence[int]) -> str:
        """Text of generated ids (special and timestamp tokens dropped)."""
        tt = self.timestamp_tokens
        ids = [i for i in ids if i < tt.begin] if tt is not None else list(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def count_parameters(self) -> int:
        packed = sum(m.in_features * m.out_features for m in self.model.modules()
                     if isinstance(m, (PackedLinear, Int8Linear)))
        return packed + sum(p.numel() for p in self.model.parameters())

    def _int8_cache(self) -> Optional[str]:
        """The int8 weight cache folder of this model's checkpoint (see :meth:`pack_for_inference`), or None for a
        model not loaded from a safetensors file by :meth:`from_pretrained`."""
        file = self._checkpoint
        try:
            st = os.stat(file) if file else None
        except OSError:
            st = None
        if st is None:
            return None
        key = hashlib.sha256(f"{os.path.realpath(file)}:{st.st_size}:{st.st_mtime_ns}:{INT8_CACHE_FORMAT}".encode())
        return os.path.join(cache_dir(), "int8", f"{self.name or 'model'}-{key.hexdigest()[:16]}")

    def pack_for_inference(self, int8: bool = False) -> "WhisperASR":
        """Hold the encoder's and decoder layers' linear weights only in oneDNN's packed layout
        (:func:`~rayspec.models.linear.pack_linears`): the products a decoder step runs on a few rows go at memory
        speed, and the packed copies replace the float32 originals instead of doubling them (whisper-base: ~180 MB).
        The output projection stays a dense weight (tied to the token embedding; it is packed on first use). For
        inference only (rayspec's engine): no gradients flow through packed layers, and their ``state_dict`` lacks
        the weights. A no-op off the CPU. Returns ``self``.

        ``int8`` (compute type ``int8``, a float32 model on a CPU): those layers become
        :class:`~rayspec.models.linear.Int8Linear` instead (weights per channel, activations per row in int8; a
        quarter of float32's weight memory; an attention's input products fused,
        :data:`~rayspec.models.whisper_layers.INT8_FUSED`), and the output
        projection gets a float16 copy beside the float32 token embedding it is tied to (:meth:`project`); the
        embeddings, the convolutions and attention stay float32. A model loaded by :meth:`from_pretrained` from a
        safetensors checkpoint keeps its quantized weights in a cache folder (``$RAYSPEC_CACHE/int8``, keyed by the
        checkpoint file's path, size and modification time and :data:`INT8_CACHE_FORMAT`): later processes read them
        there instead of reading and quantizing the float32 weights (whisper-base, 2 threads, held to AVX2: ~0.3 s of
        start-up). Call it on the model as loaded: weights changed in memory are not seen by the cache's key.

        Raises:
            ValueError: ``int8`` on a model that is not float32 on a CPU.
        """
        if int8:
            if self.device.type != "cpu" or self.dtype != torch.float32:
                raise ValueError(f"int8 takes a float32 model on a CPU, not {self.dtype} on {self.device}")
            if getattr(self.model, "proj_out", None) is not None:  # packed in a thread while the rest loads
                self._half_projection = Float16RowLinear(self.model.proj_out, background=True)
            self.int8 = quantize_linears(self.model.model, layers.int8_fuse, self._int8_cache()) > 0
        if self.device.type == "cpu" and (self._pack_linears() or self.int8):
            # The weights left (embeddings, norms, biases, convolutions) may still be views into the checkpoint file's
            # memory map, which then stays mapped with the replaced weights' pages: copy them out so it is released.
            with torch.no_grad():
                for t in (*self.model.parameters(), *self.model.buffers()):
                    t.data = t.data.clone()
        return self
