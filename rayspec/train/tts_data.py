"""TTS training data: recordings + transcripts -> phones, phone durations and Lyra codes, cached.

Each clip is resampled to 16 kHz, encoded to 16 Lyra codebooks (:mod:`rayspec.tts.codec`) and force-aligned to its
transcript (:mod:`rayspec.tts.align`). The result is one ``.npz`` in the work directory, reused by every later run
(training the target, distilling the draft, offline acceptance estimates).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ..audio import load_audio
from ..manifest import read_manifest
from ..tts.codec import SAMPLE_RATE, LyraCodec

# The 30 LJSpeech clips the intelligibility floors of ../shared/notes/speech-synthesis.md were measured on: dev.
DEV_IDS = tuple(f"LJ002-{i:04d}" for i in range(71, 101))


@dataclass
class TTSExample:
    """One aligned clip.

    Attributes:
        id: clip id.
        text: transcript.
        phones: int64 ``[P]`` phone ids (:data:`rayspec.tts.phones.PHONES`).
        durations: int64 ``[P]`` codec frames per phone; sums to ``T``.
        codes: int64 ``[T, 16]`` Lyra codes at 50 frames/s.
    """

    id: str
    text: str
    phones: np.ndarray
    durations: np.ndarray
    codes: np.ndarray


def prepare(manifests: list[str], work_dir: str, codec_dir: str, num_codebooks: int = 16,
            max_utterances: int | None = None) -> tuple[list[TTSExample], list[str]]:
    """Encode and align every clip of ``manifests`` once; later calls read the cache.

    Returns:
        ``(examples, failed)``: the aligned clips, and one ``"id: reason"`` line per clip skipped (unreadable audio,
        no alignment).
    """
    from ..tts.align import Aligner

    os.makedirs(work_dir, exist_ok=True)
    cache = os.path.join(work_dir, "tts_data.npz")
    if os.path.exists(cache):
        return load(cache), json.loads(str(np.load(cache)["failed"]))
    utts = [u for m in manifests for u in read_manifest(m)][:max_utterances]
    codec, aligner = LyraCodec(codec_dir, num_codebooks), Aligner()
    examples, failed = [], []
    for u in tqdm(utts, desc="encode + align", unit="clip"):
        try:
            audio = load_audio(u.audio, SAMPLE_RATE)
            codes = codec.encode(audio)
            phones, durations = aligner.align(audio, u.text or "", len(codes))
        except ValueError as e:
            failed.append(f"{u.id}: {e}")
            continue
        examples.append(TTSExample(u.id, u.text, np.asarray(phones.ids), durations, codes))
    save(cache, examples, failed)
    return examples, failed


def save(path: str, examples: list[TTSExample], failed: list[str]) -> None:
    """Write examples as flat arrays with cumulative offsets (atomic)."""
    cu_p = np.cumsum([0] + [len(e.phones) for e in examples])
    cu_t = np.cumsum([0] + [len(e.codes) for e in examples])
    tmp = path + ".tmp.npz"
    np.savez(tmp, ids=np.asarray([e.id for e in examples]), texts=np.asarray([e.text for e in examples]),
             phones=np.concatenate([e.phones for e in examples]), durations=np.concatenate([e.durations for e in examples]),
             codes=np.concatenate([e.codes for e in examples]), cu_phones=cu_p, cu_frames=cu_t,
             failed=json.dumps(failed))
    os.replace(tmp, path)


def load(path: str) -> list[TTSExample]:
    """Examples written by :func:`save`."""
    z = np.load(path)
    cu_p, cu_t = z["cu_phones"], z["cu_frames"]
    return [TTSExample(str(z["ids"][i]), str(z["texts"][i]), z["phones"][cu_p[i]:cu_p[i + 1]],
                       z["durations"][cu_p[i]:cu_p[i + 1]], z["codes"][cu_t[i]:cu_t[i + 1]])
            for i in range(len(cu_p) - 1)]


def split_dev(examples: list[TTSExample], dev_ids=DEV_IDS) -> tuple[list[TTSExample], list[TTSExample]]:
    """``(train, dev)`` by id."""
    dev = set(dev_ids)
    return [e for e in examples if e.id not in dev], [e for e in examples if e.id in dev]
