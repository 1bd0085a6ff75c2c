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


def _corpus_name(path: Path) -> str:
    if path.is_dir():
        return path.name
    parent = path.parent.name
    return f"{parent}/{path.stem}" if parent else path.stem


def _rows_from_file(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ManifestError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
        return rows
    if suffix == ".csv":
        import pyarrow.csv as pcsv

        return pcsv.read_csv(path).to_pylist()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ManifestError(f"unknown manifest format {suffix!r} (use .jsonl, .csv, .parquet or a folder of audio): {path}")


def read_manifest(path: str | os.PathLike) -> list[Utterance]:
    """Read a manifest file or a folder of audio files.

    Relative audio paths are resolved against the manifest's folder. A folder is scanned recursively for files with
    an audio suffix (:data:`AUDIO_SUFFIXES`); ids are the relative paths without suffix, and a ``<name>.txt`` beside
    an audio file, if present, is its reference.

    Returns:
        Utterances in manifest order.

    Raises:
        ManifestError: unreadable manifest, missing ``id``/``audio`` columns, or duplicate ids.
    """
    path = Path(path)
    if not path.exists():
        raise ManifestError(f"manifest not found: {path}")
    corpus = _corpus_name(path)
    out: list[Utterance] = []
    if path.is_dir():
        for audio in sorted(p for p in path.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file()):
            ref = audio.with_suffix(".txt")
            text = ref.read_text(encoding="utf-8").strip() if ref.exists() else None
            uid = str(audio.relative_to(path).with_suffix(""))
            out.append(Utterance(uid, str(audio.resolve()), text, None, corpus))
    else:
        base = path.parent.resolve()
        for i, row in enumerate(_rows_from_file(path)):
            if "id" not in row or "audio" not in row:
                raise ManifestError(f"{path}: row {i} lacks 'id' or 'audio' (has {sorted(row)})")
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
    seen: set[str] = set()
    for u in out:
        if u.id in seen:
            raise ManifestError(f"{path}: duplicate id {u.id!r}")
        seen.add(u.id)
    return out
