"""Lyra v2 as rayspec's speech tokenizer: 16 kHz audio <-> residual-VQ codes at 50 frames/s.

Lyra v2 (google/lyra, Apache-2.0) is a SoundStream encoder (320 samples -> a 64-d latent per 20 ms frame), a residual
vector quantizer with up to 46 codebooks of 16 codes, and the LyraGAN decoder (latent -> 320 samples). The three
TFLite models are streaming and stateful, so each utterance runs on fresh interpreters (8 ms to create).

rayspec's speech-token stream (chosen by the intelligibility of Lyra resyntheses of LJSpeech, below): the first
two codebooks combined are one *coarse* token (``16 * c1 + c2``, 256 values), generated autoregressively and
speculated; codebooks 3..16 are *fine* codes, produced by the target's depth head on accepted frames. 16 codebooks resynthesise LJSpeech at 33.9% WER by pocketsphinx (real recordings: 28.5%).
"""

from __future__ import annotations

import os
from functools import cached_property

import numpy as np

SAMPLE_RATE = 16000  # Hz
FRAME_SAMPLES = 320  # samples per codec frame (20 ms)
FRAMES_PER_SECOND = SAMPLE_RATE // FRAME_SAMPLES  # 50
CODES_PER_BOOK = 16
MAX_CODEBOOKS = 46


class CodecError(RuntimeError):
    """The codec's model files are missing or its runtime (``ai-edge-litert``, the ``tts`` extra) is not installed."""


def coarse_tokens(codes: np.ndarray) -> np.ndarray:
    """Combine codebooks 1 and 2 into one coarse token: int64 ``[T]`` in ``0..255`` from int ``[T, Q >= 2]``."""
    return codes[:, 0].astype(np.int64) * CODES_PER_BOOK + codes[:, 1]


def split_coarse(coarse: np.ndarray) -> np.ndarray:
    """Inverse of :func:`coarse_tokens`: int64 ``[T, 2]`` codebook-1 and -2 codes from ``[T]`` coarse tokens."""
    coarse = np.asarray(coarse, dtype=np.int64)
    return np.stack([coarse // CODES_PER_BOOK, coarse % CODES_PER_BOOK], axis=1)


class LyraCodec:
    """Encode 16 kHz mono float32 audio to RVQ codes and decode codes back to audio.

    Args:
        path: folder with ``soundstream_encoder.tflite``, ``quantizer.tflite`` and ``lyragan.tflite``.
        num_codebooks: codebooks kept per frame (1..46; rayspec's TTS uses 16).

    Raises:
        CodecError: a model file is missing or ``ai-edge-litert`` is not installed.
    """

    def __init__(self, path: str, num_codebooks: int = 16) -> None:
        if not 1 <= num_codebooks <= MAX_CODEBOOKS:
            raise ValueError(f"num_codebooks must be 1..{MAX_CODEBOOKS}, got {num_codebooks}")
        for name in ("soundstream_encoder", "quantizer", "lyragan"):
            if not os.path.isfile(os.path.join(path, f"{name}.tflite")):
                raise CodecError(f"Lyra v2 codec not found: {os.path.join(path, name + '.tflite')} is missing")
        self.path = path
        self.num_codebooks = num_codebooks

    @cached_property
    def _interpreter_class(self):
        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError as e:  # pragma: no cover - an install problem, not a code path
            from ..extras import extra_hint

            raise CodecError(extra_hint("tts", "the Lyra codec (ai-edge-litert)")) from e
        return Interpreter

    def _runner(self, name: str, signature: str | None = None):
        interpreter = self._interpreter_class(model_path=os.path.join(self.path, f"{name}.tflite"))
        return interpreter.get_signature_runner(signature) if signature else interpreter.get_signature_runner()

    def encode(self, audio: np.ndarray) -> np.ndarray:
        """Codes of 16 kHz audio: int64 ``[T, num_codebooks]``, ``T = len(audio) // 320`` (a partial last frame
        is dropped)."""
        encoder = self._runner("soundstream_encoder")
        quantize = self._runner("quantizer", "encode")
        audio = np.asarray(audio, dtype=np.float32)
        frames = len(audio) // FRAME_SAMPLES
        codes = np.zeros((frames, self.num_codebooks), dtype=np.int64)
        n = np.int32(self.num_codebooks)
        for t in range(frames):
            latent = encoder(input_audio=audio[None, t * FRAME_SAMPLES:(t + 1) * FRAME_SAMPLES])["output_0"]
            codes[t] = quantize(input_frames=latent, num_quantizers=n)["output_0"][:self.num_codebooks, 0, 0]
        return codes

    @cached_property
    def codebooks(self) -> np.ndarray:
        """float32 ``[46, 16, 64]``: every codebook's vectors, read once through the quantizer's decoder (a frame's
        latent is the sum of its codebooks' vectors, as the decoder computes it)."""
        dequantize = self._runner("quantizer", "decode")
        index = np.full((MAX_CODEBOOKS, 1, 1), -1, dtype=np.int32)
        out = np.zeros((MAX_CODEBOOKS, CODES_PER_BOOK, 64), dtype=np.float32)
        for k in range(MAX_CODEBOOKS):
            for v in range(CODES_PER_BOOK):
                index[k, 0, 0] = v
                out[k, v] = dequantize(encoding_indices=index)["output_0"][0, 0]
            index[k, 0, 0] = -1
        return out

    def latents(self, codes: np.ndarray) -> np.ndarray:
        """float32 ``[T, 64]`` latents of int ``[T, Q]`` codes (``Q <= 46``), summed book by book in order.

        Raises:
            ValueError: ``codes`` not of shape ``[T, Q]`` with ``Q <= 46``.
        """
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] > MAX_CODEBOOKS:
            raise ValueError(f"codes must be [T, <= {MAX_CODEBOOKS}], got shape {codes.shape}")
        out = np.zeros((len(codes), 64), dtype=np.float32)
        for k in range(codes.shape[1]):
            out += self.codebooks[k, codes[:, k]]
        return out

    def coarse_vectors(self) -> np.ndarray:
        """float32 ``[256, 64]``: the latent each coarse token stands for (codebook-1 vector + codebook-2 vector).
        PCG's acoustic similarity groups can be built from these."""
        return self.latents(split_coarse(np.arange(CODES_PER_BOOK ** 2)))

    def decoder(self) -> "LyraDecoder":
        """A streaming decoder for one utterance (see :class:`LyraDecoder`)."""
        return LyraDecoder(self)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """16 kHz float32 audio ``[T * 320]`` of a whole utterance from int ``[T, Q]`` codes (``Q <= 46``; missing
        codebooks unused): one fresh :class:`LyraDecoder`."""
        return self.decoder().decode(codes)


class LyraDecoder:
    """LyraGAN decoding one utterance piece by piece: LyraGAN is stateful (a frame's audio depends on the frames
    before it), so the pieces of one utterance must go through one decoder, in order. Pieces decoded this way join
    into exactly the audio of decoding the utterance at once; a fresh decoder per piece would not (measured: up to
    0.16 amplitude apart in the frames after a cut, still 0.03 twelve frames later, on random codes' audio of
    RMS 0.12).

    Not thread-safe: one thread at a time (it may be a different thread for each call).
    """

    def __init__(self, codec: LyraCodec) -> None:
        self.codec = codec
        self._vocoder = codec._runner("lyragan")

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """The next piece: 16 kHz float32 audio ``[T * 320]`` from int ``[T, Q]`` codes, one 20 ms frame per
        LyraGAN call."""
        latents = self.codec.latents(codes)
        out = np.zeros(len(latents) * FRAME_SAMPLES, dtype=np.float32)
        for t, latent in enumerate(latents):
            frame = self._vocoder(input_audio=latent[None, None])["output_0"][0]
            out[t * FRAME_SAMPLES:(t + 1) * FRAME_SAMPLES] = frame
        return out
