"""Corpus manifests: JSONL, CSV or Parquet files with ``id``, ``audio`` and optional ``text``, or a folder of audio."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".sph", ".nist", ".aiff", ".aif", ".mp3", ".opus")


class ManifestError(ValueError):
    """A manifest that cannot be read, or rows without the required columns."""


@dataclass(frozen=True)
class Utterance:
    """One row of a corpus.

    Attributes:
        id: unique utterance id.
        audio: absolute path of the audio file.
        text: reference transcript, or None.
        duration_s: duration in seconds if the manifest gives it (used for length sorting before decoding), else None.
        corpus: name of the corpus (the manifest's stem or folder name); `score` groups by it.
    """

    id: str
    audio: str
    text: Optional[str] = None
    duration_s: Optional[float] = None
    corpus: str = ""


def corpus_name(path: Path) -> str:
    """The corpus name of a manifest's rows that name none: a folder's name, else ``<parent folder>/<file stem>``
    (``an4/test`` for ``.../an4/test.jsonl``)."""
    if path.is_dir():
        return path.name
    parent = path.parent.name
    return f"{parent}/{path.stem}" if parent else path.stem


def _rows_from_file(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ManifestError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
        return rows
    try:
        if suffix == ".csv":
            import pyarrow.csv as pcsv

            return pcsv.read_csv(path).to_pylist()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError for malformed files
        raise ManifestError(f"{path}: cannot read {suffix[1:]} manifest: {exc}") from exc
    raise ManifestError(f"unknown manifest format {suffix!r} (use .jsonl, .csv, .parquet or a folder of audio): {path}")


def read_manifest(path: str | os.PathLike) -> list[Utterance]:
    """Read a manifest file, a folder of audio files, or one audio file (one utterance, id its file name).

    Relative audio paths are resolved against the manifest's folder. A folder is scanned recursively for files with
    an audio suffix (:data:`AUDIO_SUFFIXES`); ids are the relative paths without suffix, and a ``<name>.txt`` beside
    an audio file, if present, is its reference. Entries with an audio suffix that are not readable files
    (directories, broken symlinks, symlink loops) are kept, so that they become error rows instead of vanishing.

    Returns:
        Utterances in manifest order (at least one).

    Raises:
        ManifestError: missing or unreadable manifest, no rows, rows without ``id``/``audio``, or duplicate ids.
    """
    path = Path(path)
    if not path.exists():
        raise ManifestError(f"manifest not found: {path}")
    corpus = corpus_name(path)
    out: list[Utterance] = []
    if path.is_file() and path.suffix.lower() in AUDIO_SUFFIXES:  # one audio file: one utterance
        ref = path.with_suffix(".txt")
        text = ref.read_text(encoding="utf-8", errors="replace").strip() if ref.is_file() else None
        return [Utterance(path.stem, os.path.abspath(path), text, None, corpus)]
    if path.is_dir():
        for audio in sorted(p for p in path.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES):
            ref = audio.with_suffix(".txt")
            text = ref.read_text(encoding="utf-8", errors="replace").strip() if ref.is_file() else None
            uid = str(audio.relative_to(path).with_suffix(""))
            out.append(Utterance(uid, os.path.abspath(audio), text, None, corpus))
    else:
        base = path.parent.resolve()
        for i, row in enumerate(_rows_from_file(path)):
            if not isinstance(row, dict) or row.get("id") is None or row.get("audio") is None:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ManifestError(f"{path}: row {i + 1} lacks 'id' or 'audio' (has {keys})")
            audio = Path(str(row["audio"]))
            audio = audio if audio.is_absolute() else base / audio
            text = row.get("text")
            duration = row.get("duration_s")
            out.append(
                Utterance(
                    str(row["id"]),
                    str(audio),
                    None if text is None else str(text),
                    None if duration is None else float(duration),
                    str(row.get("corpus") or corpus),
                )
            )
    if not out:
        raise ManifestError(f"{path}: no utterances (an empty manifest, or a folder without audio files "
                            f"{', '.join(AUDIO_SUFFIXES)})")
    seen: set[str] = set()
    for u in out:
        if u.id in seen:
            raise ManifestError(f"{path}: duplicate id {u.id!r}")
        seen.add(u.id)
    return out


def estimated_seconds(u: Utterance) -> float:
    """Duration for length sorting: the manifest's, else estimated from the file size (16-bit 16 kHz mono)."""
    if u.duration_s:
        return float(u.duration_s)
    try:
        return os.path.getsize(u.audio) / 32000.0
    except OSError:
        return 0.0
