"""Training data: manifests -> cached log-mel features (with speed perturbation) and character token ids."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np
import soxr
import torch
from tqdm import tqdm

from ..audio import load_audio
from ..manifest import Utterance, read_manifest
from ..models.tokenizer import normalize_transcript

SPEEDS = (0.9, 1.0, 1.1)


@dataclass
class Example:
    """One training utterance.

    Attributes:
        id: utterance id.
        features: one float16 ``[n_mels, T]`` log-mel array per speed factor in :data:`SPEEDS` order.
        text: normalized transcript (see :func:`~rayspec.models.tokenizer.normalize_transcript`).
    """

    id: str
    features: list[np.ndarray]
    text: str


def perturb_speed(audio: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """Speed perturbation (tempo and pitch, as Kaldi/ESPnet's sp): ``audio`` played ``speed`` times faster
    (float32 ``[S]`` -> ``[S / speed]`` at the same ``sample_rate``)."""
    return audio if speed == 1.0 else soxr.resample(audio, sample_rate, sample_rate / speed)


def _features_one(args) -> list[np.ndarray]:
    path, fe_dict, speeds = args
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(**fe_dict)
    audio = load_audio(path, fe.sampling_rate)
    out = []
    for s in speeds:
        f = fe(perturb_speed(audio, fe.sampling_rate, s), sampling_rate=fe.sampling_rate, padding="longest", truncation=False, return_tensors="np")
        out.append(f["input_features"][0].astype(np.float16))
    return out


def load_examples(
    utterances: list[Utterance], feature_extractor, cache_dir: str, speeds=SPEEDS, workers: int = 2
) -> list[Example]:
    """Compute (or load from ``cache_dir``) features for ``utterances`` at every speed in ``speeds``.

    The cache key covers the utterance ids, audio paths, speeds and the feature extractor's settings, so a changed
    setting recomputes. The cache holds float16 tensors only and is read with ``torch.load(weights_only=True)``
    (no pickled code runs when a cache file is loaded).
    """
    fe_dict = {k: v for k, v in feature_extractor.to_dict().items() if k in
               ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value")}
    key = hashlib.sha1(json.dumps([[u.id, u.audio] for u in utterances] + [list(speeds), fe_dict],
                                  sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"features-{key}.v2.pt")
    if os.path.exists(path):
        feats = [[t.numpy() for t in per_speed] for per_speed in torch.load(path, weights_only=True)]
    else:
        os.makedirs(cache_dir, exist_ok=True)
        jobs = [(u.audio, fe_dict, tuple(speeds)) for u in utterances]
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            feats = list(tqdm(pool.map(_features_one, jobs, chunksize=8), total=len(jobs), desc="features"))
        tmp = path + ".tmp"
        torch.save([[torch.from_numpy(f) for f in per_speed] for per_speed in feats], tmp)
        os.replace(tmp, path)
    return [Example(u.id, f, normalize_transcript(u.text or "")) for u, f in zip(utterances, feats)]


def split_manifests(paths: list[str], dev_fraction: float, seed: int) -> tuple[list[Utterance], list[Utterance]]:
    """Read manifests and hold out a dev split for early stopping and checkpoint selection.

    AN4-style ids (``an<N>-<speaker>-b``) are split by speaker, so dev speakers are unseen in training; other corpora
    hold out their last ``dev_fraction`` of rows (LJSpeech: the last clips of the reading).
    """
    rng = np.random.default_rng(seed)
    train, dev = [], []
    for p in paths:
        rows = [u for u in read_manifest(p) if u.text]
        speakers = sorted({u.id.split("-")[1] for u in rows if u.id.startswith("an") and u.id.count("-") == 2})
        if speakers:
            n = max(1, round(len(speakers) * dev_fraction))
            held = set(rng.choice(speakers, size=n, replace=False).tolist())
            for u in rows:
                (dev if u.id.split("-")[1] in held else train).append(u)
        else:
            n = max(1, round(len(rows) * dev_fraction))
            train += rows[:-n]
            dev += rows[-n:]
    return train, dev


def teacher_batch(device: str) -> int:
    """Utterances per teacher-pass batch of the drafter recipes on ``device``: 64 on a GPU, 16 on a CPU."""
    return 16 if device == "cpu" else 64


def frozen_teacher(target_dir: str, manifests: list[str], work_dir: str, dev_fraction: float, seed: int,
                   threads: int, max_utterances: Optional[int] = None, device: str = "cpu",
                   encoder_dtype: Optional[torch.dtype] = None):
    """The opening of a recipe that learns from a frozen target (Medusa heads, a draft decoder): torch threads and
    seed set, ``work_dir`` created, the target loaded (on ``device``, its encoder in ``encoder_dtype`` if given) with
    gradients off, the manifests split as
    :func:`split_manifests` does.

    Returns:
        ``(target, train utterances, dev utterances)``; ``max_utterances`` (smoke runs) keeps the first N training
        utterances and a quarter as many dev ones (at least 2).
    """
    from ..models.whisper import WhisperASR

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    os.makedirs(work_dir, exist_ok=True)
    target = WhisperASR.from_pretrained(target_dir, device, encoder_dtype=encoder_dtype)
    target.model.requires_grad_(False)
    train_utts, dev_utts = split_manifests(manifests, dev_fraction, seed)
    if max_utterances:
        train_utts, dev_utts = train_utts[:max_utterances], dev_utts[: max(2, max_utterances // 4)]
    return target, train_utts, dev_utts
