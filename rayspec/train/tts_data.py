"""TTS training data -> phones, phone durations and Lyra codes, cached. Two sources:

- Recordings + transcripts (:func:`prepare`): each clip is resampled to 16 kHz, encoded to 16 Lyra codebooks
  (:mod:`rayspec.tts.codec`) and force-aligned to its transcript (:mod:`rayspec.tts.align`); one ``tts_data.npz`` in
  the work directory.
- A teacher voice reading text (:func:`prepare_piper`, ``rayspec train tts-data``): the Piper voice speaks each
  sentence and says how long each phoneme lasts (:meth:`rayspec.tts.piper.PiperVoice.speak_aligned`), so phones and
  durations are exact, not estimated; the audio is resampled to 16 kHz and encoded. Shards of ``shard_size``
  sentences (``piper-00000.npz``...) are written atomically, so an interrupted run resumes at the next shard.

Both are reused by every later run (training the target, distilling the draft, offline acceptance estimates).
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ..audio import load_audio
from ..manifest import read_manifest
from ..tts.codec import FRAME_SAMPLES, SAMPLE_RATE, LyraCodec

# The 30 LJSpeech clips the TTS benchmark's intelligibility floors are measured on (LJ002-0071..0100): dev.
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
        return load(cache)
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


_worker: dict = {}  # a data worker's voice and codec


def _init_worker(voice: str, codec_dir: str, noise: float | None, noise_w: float) -> None:
    from ..tts.piper import PiperVoice

    _worker["voice"] = PiperVoice(voice, threads=1, noise=noise, noise_w=noise_w, durations=True)
    _worker["codec"] = LyraCodec(codec_dir, 16)


def teacher_example(voice, codec: LyraCodec, key: str, text: str) -> tuple[TTSExample, np.ndarray]:
    """One sentence read by a Piper voice opened with ``durations=True``: its phones, their durations in codec frames
    (rounded at phone boundaries) and the Lyra codes of the 16 kHz audio; and that audio, float32 ``[S]``.

    Raises:
        TextError: nothing pronounceable in ``text``.
    """
    import soxr

    from ..tts.phones import ipa_phones

    symbols = voice.symbols(text)
    audio, frames = voice.speak_aligned(voice.ids(symbols))
    audio16 = soxr.resample(audio, voice.sample_rate, SAMPLE_RATE)
    codes = codec.encode(audio16)
    phones, per_phone = ipa_phones(symbols, frames)
    seconds = np.cumsum(per_phone) * (len(audio) / max(1, int(frames.sum()))) / voice.sample_rate
    ends = np.minimum(np.round(seconds * SAMPLE_RATE / FRAME_SAMPLES).astype(np.int64), len(codes))
    ends[-1] = len(codes)
    return TTSExample(key, text, np.asarray(phones.ids), np.diff(ends, prepend=0), codes), audio16


def _teacher_row(row: tuple[str, str]) -> TTSExample | str:
    from ..tts.phones import TextError

    try:
        return teacher_example(_worker["voice"], _worker["codec"], *row)[0]
    except TextError as e:
        return f"{row[0]}: {e}"


def prepare_piper(texts: list[tuple[str, str]], data_dir: str, codec_dir: str, voice: str = "en_US-joe-medium",
                  workers: int = 2, noise: float | None = None, noise_w: float = 0.0,
                  shard_size: int = 250) -> tuple[list[TTSExample], list[str]]:
    """Have a Piper voice read ``texts`` and cache phones, durations and codes in ``data_dir``; resumes by shard.

    Args:
        texts: ``(id, text)`` pairs, one sentence each.
        voice: a packaged Piper voice or a ``.onnx`` path (:func:`rayspec.tts.piper.voice_path`).
        workers: processes, each with one voice and one codec (one thread each).
        noise, noise_w: the voice's scales (``None``: the voice's default noise); ``noise_w = 0`` makes the
            durations a function of the text, which is what the duration predictor learns.

    Returns:
        ``(examples, failed)`` as :func:`prepare`.

    Raises:
        ModuleNotFoundError: onnxruntime or onnx is missing; FileNotFoundError: no such voice.
    """
    from multiprocessing import get_context

    os.makedirs(data_dir, exist_ok=True)
    shards = [texts[i:i + shard_size] for i in range(0, len(texts), shard_size)]
    todo = [n for n in range(len(shards)) if not os.path.exists(_shard_path(data_dir, n))]
    if todo:
        from ..tts.piper import PiperVoice

        PiperVoice(voice, durations=True)  # fails here, with its reason, rather than in every worker's start-up
        with get_context("spawn").Pool(workers, _init_worker, (voice, codec_dir, noise, noise_w)) as pool, \
                tqdm(total=sum(len(shards[n]) for n in todo), desc="teacher speech", unit="sentence") as bar:
            for n in todo:
                examples, failed = [], []
                for got in pool.imap(_teacher_row, shards[n], chunksize=4):
                    (failed if isinstance(got, str) else examples).append(got)
                    bar.update()
                save(_shard_path(data_dir, n), examples, failed)
    return load_dir(data_dir)


def _shard_path(data_dir: str, n: int) -> str:
    return os.path.join(data_dir, f"piper-{n:05d}.npz")


def load_dir(data_dir: str) -> tuple[list[TTSExample], list[str]]:
    """All shards of a :func:`prepare_piper` directory (or its ``tts_data.npz``): ``(examples, failed)``.

    Raises:
        FileNotFoundError: no shard in ``data_dir``.
    """
    names = sorted(n for n in os.listdir(data_dir) if n.endswith(".npz") and (n.startswith("piper-")
                                                                               or n == "tts_data.npz"))
    if not names:
        raise FileNotFoundError(f"no TTS data in {data_dir} (make it with: rayspec train tts-data)")
    examples, failed = [], []
    for name in names:
        got, bad = load(os.path.join(data_dir, name))
        examples, failed = examples + got, failed + bad
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


def load(path: str) -> tuple[list[TTSExample], list[str]]:
    """``(examples, failed)`` written by :func:`save` (each array read once: an ``NpzFile`` re-reads an array at
    every access)."""
    with np.load(path) as z:
        a = {k: z[k] for k in ("ids", "texts", "phones", "durations", "codes", "cu_phones", "cu_frames", "failed")}
    cu_p, cu_t = a["cu_phones"], a["cu_frames"]
    return [TTSExample(str(a["ids"][i]), str(a["texts"][i]), a["phones"][cu_p[i]:cu_p[i + 1]],
                       a["durations"][cu_p[i]:cu_p[i + 1]], a["codes"][cu_t[i]:cu_t[i + 1]])
            for i in range(len(cu_p) - 1)], json.loads(str(a["failed"]))


def split_dev(examples: list[TTSExample], dev_ids=DEV_IDS) -> tuple[list[TTSExample], list[TTSExample]]:
    """``(train, dev)`` by id: dev is ``dev_ids`` (LJSpeech recordings) and one id in 50 of any source (CRC-32 of
    the id is 0 mod 50), so teacher sentences have a dev set too."""
    dev = set(dev_ids)
    is_dev = [e.id in dev or zlib.crc32(e.id.encode()) % 50 == 0 for e in examples]
    return [e for e, d in zip(examples, is_dev) if not d], [e for e, d in zip(examples, is_dev) if d]
