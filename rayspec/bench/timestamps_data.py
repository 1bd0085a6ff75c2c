"""Measurement data for ``rayspec bench --suite timestamps``: speech with true word times, and long recordings.

- **Piper set** (:func:`build_piper_set`): the Piper voice (:class:`~rayspec.tts.piper.PiperVoice`) reads held-out
  LJSpeech sentences (``metadata_text_only.csv``, minus every id of the clips other benchmarks decode). VITS's
  duration predictor says how many output frames (256 samples at 22,050 Hz: 11.6 ms) each input phoneme lasts, so a
  word's true start and end are sums of frame counts (:func:`word_times`), not estimates. Noise scales 0: the same
  audio and durations on every run.
- **Long recordings** (:func:`build_long_set`): consecutive LJSpeech clips (after the first ``skip``, which the other
  benchmarks use) concatenated into files of about ``seconds`` seconds, with their joined transcripts.

Both write 16 kHz WAV files and a JSON Lines manifest (``id``, ``audio``, ``duration_s``, ``sample_rate``, ``text``);
the Piper set adds ``words``: ``[{word, start_s, end_s}]`` per line. A finished set (its manifest exists) is reused.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re

import numpy as np

from ..files import write_atomic
from ..tts.g2p import PUNCTUATION, _TOKEN, word_ipa

RATE = 16000
STRESS = "ˈˌ"
"""Stress marks: input symbols with durations of their own but no sound; a word's times skip them at its edges."""
_PLAIN = re.compile(r"[A-Za-z ,.;:'?!]+")


def reference_words(text: str) -> list[str] | None:
    """The words of ``text`` as the G2P reads them, one IPA word each (``_TOKEN`` minus punctuation), or None when
    the G2P would not read them one to one (digits, hyphens, a word it cannot pronounce, characters outside plain
    English letters and ``,.;:'?!``)."""
    if not _PLAIN.fullmatch(text):
        return None
    words = [t for t in _TOKEN.findall(text) if t not in PUNCTUATION]
    return words if words and all(word_ipa(w) for w in words) else None


def word_times(symbols: list[str], frames: np.ndarray, seconds_per_frame: float) -> list[tuple[float, float]]:
    """``(start_s, end_s)`` of each word of a Piper input (``symbols``: :meth:`PiperVoice.symbols`, words separated
    by ``" "``; ``frames`` int ``[len(symbols)]``: output frames per symbol, one id per symbol). A word spans from
    the start of its first sounding symbol to the end of its last: pads (``_``) inside it count, stress marks and
    punctuation at its edges do not.

    Raises:
        ValueError: ``frames`` and ``symbols`` differ in length.
    """
    if len(frames) != len(symbols):
        raise ValueError(f"{len(frames)} durations for {len(symbols)} symbols (a symbol with several ids?)")
    ends = np.cumsum(frames)
    starts = ends - frames
    out: list[tuple[float, float]] = []
    span: list[int] = []  # indices of the current word's sounding symbols
    for k, s in enumerate(symbols + [" "]):
        if s in (" ", "$"):
            if span:
                out.append((starts[span[0]] * seconds_per_frame, ends[span[-1]] * seconds_per_frame))
            span = []
        elif s not in STRESS and s not in PUNCTUATION and s not in ("^", "_"):
            span.append(k)
    return out


def held_out_sentences(texts_csv: str, exclude: set[str], n: int, seed: int = 0, min_words: int = 6,
                       max_words: int = 30) -> list[tuple[str, str, list[str]]]:
    """``n`` ``(id, text, words)`` from an LJSpeech ``id|raw|normalized`` file: the normalized text, ids not in
    ``exclude``, :func:`reference_words` one to one, ``min_words``..``max_words`` words; a seeded random sample,
    in id order."""
    with open(texts_csv, encoding="utf-8") as f:
        rows = [r for r in csv.reader(f, delimiter="|", quoting=csv.QUOTE_NONE) if len(r) >= 2]
    rows = sorted((r[0], r[-1].strip()) for r in rows if r[0] not in exclude)
    random.Random(seed).shuffle(rows)
    out = []
    for uid, text in rows:
        words = reference_words(text)
        if words and min_words <= len(words) <= max_words:
            out.append((uid, text, words))
            if len(out) == n:
                break
    return sorted(out)


def _write_wav(path: str, audio: np.ndarray) -> None:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, audio, RATE, subtype="PCM_16", format="WAV")
    write_atomic(path, buf.getvalue())


def _write_manifest(path: str, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def build_piper_set(texts_csv: str, out_dir: str, exclude: set[str], n: int = 30, seed: int = 0,
                    voice: str = "en_US-joe-medium") -> str:
    """The Piper set in ``out_dir`` (``piper.jsonl`` + ``piper/<id>.wav``); returns the manifest's path.

    Raises:
        ValueError: fewer than ``n`` usable sentences; FileNotFoundError / ModuleNotFoundError: the voice or the
        ``onnx`` package (durations) is missing.
    """
    import soxr

    from ..tts.piper import PiperVoice

    manifest = os.path.join(out_dir, f"piper-{n}-seed{seed}.jsonl")
    if os.path.exists(manifest):
        return manifest
    picked = held_out_sentences(texts_csv, exclude, n, seed)
    if len(picked) < n:
        raise ValueError(f"only {len(picked)} usable sentences in {texts_csv}")
    v = PiperVoice(voice, noise=0.0, noise_w=0.0, durations=True)
    os.makedirs(os.path.join(out_dir, "piper"), exist_ok=True)
    rows = []
    for uid, text, words in picked:
        symbols = v.symbols(text)
        audio, frames = v.speak_aligned(v.ids(symbols))
        times = word_times(symbols, frames, len(audio) / frames.sum() / v.sample_rate)
        if len(times) != len(words):
            raise ValueError(f"{uid}: {len(times)} IPA words for {len(words)} text words")
        wav = os.path.join("piper", f"{uid}.wav")
        _write_wav(os.path.join(out_dir, wav), soxr.resample(audio, v.sample_rate, RATE, quality="HQ"))
        rows.append({"id": uid, "audio": wav, "duration_s": len(audio) / v.sample_rate, "sample_rate": RATE,
                     "text": text, "words": [{"word": w, "start_s": round(float(a), 4), "end_s": round(float(b), 4)}
                                             for w, (a, b) in zip(words, times)]})
    _write_manifest(manifest, rows)
    return manifest


def build_long_set(clips_manifest: str, out_dir: str, skip: int = 40, files: int = 2, seconds: float = 300.0,
                   gap_s: float = 0.3) -> str:
    """``files`` recordings of about ``seconds`` s each in ``out_dir`` (``long.jsonl`` + ``long/long-<k>.wav``):
    consecutive clips of ``clips_manifest`` after the first ``skip``, ``gap_s`` of silence between two clips;
    returns the manifest's path.

    Raises:
        ValueError: not enough clips for ``files`` recordings.
    """
    from ..audio import load_audio
    from ..manifest import read_manifest

    manifest = os.path.join(out_dir, f"long-{files}x{seconds:g}s-skip{skip}.jsonl")
    if os.path.exists(manifest):
        return manifest
    clips = read_manifest(clips_manifest)[skip:]
    os.makedirs(os.path.join(out_dir, "long"), exist_ok=True)
    rows, k = [], 0
    gap = np.zeros(int(gap_s * RATE), dtype=np.float32)
    for f in range(files):
        parts, texts, total, ids = [], [], 0.0, []
        while total < seconds:
            if k >= len(clips):
                raise ValueError(f"{clips_manifest} has too few clips for {files} files of {seconds:g} s")
            audio = load_audio(clips[k].audio, RATE)
            parts += [audio, gap]
            texts.append(clips[k].text or "")
            ids.append(clips[k].id)
            total += (len(audio) + len(gap)) / RATE
            k += 1
        audio = np.concatenate(parts[:-1])
        wav = os.path.join("long", f"long-{f}.wav")
        _write_wav(os.path.join(out_dir, wav), audio)
        rows.append({"id": f"long-{f}", "audio": wav, "duration_s": len(audio) / RATE, "sample_rate": RATE,
                     "text": " ".join(texts), "clips": f"{ids[0]}..{ids[-1]}"})
    _write_manifest(manifest, rows)
    return manifest
