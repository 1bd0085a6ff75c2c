"""Quality measures of synthesised speech: an independent recogniser, mel-cepstral distortion, offline acceptance.

* Intelligibility: word error rate of the audio as transcribed by pocketsphinx (CMU's HMM recogniser with its en-us
  acoustic model and generic trigram LM): a judge trained on none of rayspec's data and sharing no model with it.
* Mel-cepstral distortion (MCD, dB) between synthesised and real speech after dynamic time warping (Kubichek 1993,
  the usual TTS measure), on 24 mel-cepstra from transformers' log-mel spectrogram (c0, the energy, excluded).
* Offline acceptance (PCG paper, section 4 "acceptance estimation"): with the target's and the draft's
  teacher-forced distributions on real token sequences, the acceptance probability of each rule per position
  (``sum min(p, q)`` for ``sd``; ``sum_G min(P_c(G), Q_c(G))`` over groups for ``pcg``), and the expected tokens per
  target pass for lookahead ``g``: ``(1 - a^(g+1)) / (1 - a)`` (Leviathan et al. 2023, eq. 1).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..spec_decode.sampling import GroupRatio


class PocketsphinxJudge:
    """Transcribe 16 kHz float32 audio with pocketsphinx's default en-us models."""

    def __init__(self) -> None:
        from ..extras import require

        self._decoder = require("pocketsphinx", "tts", "the pocketsphinx judge").Decoder(samprate=16000,
                                                                                          loglevel="FATAL")

    def transcribe(self, audio: np.ndarray) -> str:
        """pocketsphinx's transcript of float ``[S]`` audio at 16 kHz (clipped to -1..1)."""
        pcm = (np.clip(audio, -1, 1) * 32767).astype(np.int16).tobytes()
        d = self._decoder
        d.start_utt()
        d.process_raw(pcm, full_utt=True)
        d.end_utt()
        hyp = d.hyp()
        return hyp.hypstr if hyp is not None else ""


@lru_cache(maxsize=1)
def _mel_basis():
    from transformers.audio_utils import mel_filter_bank, window_function

    mel = mel_filter_bank(num_frequency_bins=201, num_mel_filters=40, min_frequency=0.0, max_frequency=8000.0,
                          sampling_rate=16000, norm="slaney", mel_scale="slaney")
    n = 40
    dct = np.cos(np.pi / n * (np.arange(n)[:, None] + 0.5) * np.arange(n)[None, :]) * np.sqrt(2.0 / n)
    return mel, window_function(400, "hann"), dct


def mel_cepstra(audio: np.ndarray, n: int = 24) -> np.ndarray:
    """float ``[frames, n]`` mel-cepstra c1..cn (25 ms windows, 10 ms hop) of 16 kHz audio."""
    from transformers.audio_utils import spectrogram

    mel, window, dct = _mel_basis()
    log_mel = spectrogram(audio.astype(np.float64), window, frame_length=400, hop_length=160, power=1.0,
                          mel_filters=mel, log_mel="log", mel_floor=1e-10)  # [40, frames]
    return (log_mel.T @ dct)[:, 1:n + 1]


def dtw_path_cost(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Dynamic time warping of two feature sequences ``[N, D]`` and ``[M, D]`` (Euclidean frame distance): the
    total cost of the best monotonic path and its length. Vectorised over anti-diagonals."""
    cost = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    steps = np.zeros((n + 1, m + 1))
    acc[0, 0] = 0.0
    for k in range(2, n + m + 1):
        i = np.arange(max(1, k - m), min(n, k - 1) + 1)
        j = k - i
        prev = np.stack([acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]])
        arg = prev.argmin(0)
        acc[i, j] = cost[i - 1, j - 1] + prev[arg, np.arange(len(i))]
        steps[i, j] = np.choose(arg, [steps[i - 1, j - 1], steps[i - 1, j], steps[i, j - 1]]) + 1
    return float(acc[n, m]), int(steps[n, m])


def mcd(synth: np.ndarray, real: np.ndarray) -> float:
    """Mel-cepstral distortion in dB of float ``[S]`` audio against float ``[S']`` audio, both at 16 kHz, after DTW
    over their mel-cepstra (:func:`mel_cepstra`): ``10 / ln 10 * sqrt(2) * mean frame distance`` on the path."""
    total, length = dtw_path_cost(mel_cepstra(synth), mel_cepstra(real))
    return 10.0 / np.log(10.0) * np.sqrt(2.0) * total / max(length, 1)


def acceptance_rates(target_probs: torch.Tensor, draft_probs: torch.Tensor, ratio: GroupRatio | None) -> torch.Tensor:
    """Per-position acceptance probability float ``[N]`` of one draft token from ``[N, V]`` distributions: token
    level without ``ratio`` (``sum_x min(p, q)``), else group level (``sum_G min(P_c(G), Q_c(G))``)."""
    if ratio is None:
        return torch.minimum(target_probs, draft_probs).sum(-1)
    return torch.minimum(ratio.coarse(target_probs), ratio.coarse(draft_probs)).sum(-1)


def expected_tokens_per_pass(alpha: float, lookahead: int) -> float:
    """``(1 - alpha^(g+1)) / (1 - alpha)``: tokens emitted per target pass with i.i.d. acceptance ``alpha``."""
    return float(lookahead + 1) if alpha >= 1 else (1 - alpha ** (lookahead + 1)) / (1 - alpha)
